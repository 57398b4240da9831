"""DominoTree's trees against the released builder's, on real drafts of the embedded Domino drafter.

Needs a local clone of the released code (https://github.com/slin-zhq/Domino-Tree), given by
``--published``; its ``dominotree.py`` (the best-first heap) and ``domino_adapter.py`` (the
conditional children function) are imported from there and called on the same drafts as
treespec's `DominoTree` (both backends).  The target is the embedded SmolLM2 with its LM head in
the dtype of the run (as the released harness computes the base logits), the drafter the shipped
Domino checkpoint.  Drafts come from AR-greedy contexts of Alpaca bench prompts, one per position.

For each budget it prints how many rounds give the same tree (the same set of root-to-node token
paths), on the drafts as drafted and on the same drafts with ties broken by token id.  A reduced-
precision logit row holds many exactly equal values, and the builders order tied candidates
differently (the released one as torch.topk returns them, treespec by ascending token id), so a
tie at a selection boundary (a pure-draft depth's top node_topk, a corrected depth's top M) gives
other candidates and other scores below it.  "ties broken" changes the base and hands
the same logits to both builders: then any other tree is a difference in the maths.

    python benchmarks/check_published_dominotree.py --published ~/src/Domino-Tree --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from treespec.interfaces import DraftContext
from treespec.policies.dominotree import DominoTree


def _contexts(target, tokenizer, prompts: int, positions: int, taps) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(sequence ending at the anchor, its target features) at ``positions`` greedy steps of each prompt."""
    from treespec.apps.data.datasets import encode_chat, load_prompts

    out = []
    for record in load_prompts("alpaca", split="bench", limit=prompts):
        ids = torch.tensor(encode_chat(tokenizer, record.turns[:1]))
        for _ in range(positions):
            prefill = target.prefill(ids[:-1], taps)
            out.append((ids.clone(), prefill.features))
            nxt = target.model(ids[None]).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt[None]])
    return out


def _published_tree(mods, target, drafter, draft, base, budget: int, top_m: int, node_topk: int):
    """The released builder's nodes (token, depth, parent, score) on ``draft`` with base logits ``base``."""
    dominotree, adapter = mods
    scorer = draft.scorer
    shim = SimpleNamespace(model=SimpleNamespace(embed_tokens=target.embed_tokens))
    children = adapter.make_conditional_children_fn(
        target=shim, draft=drafter.model, ph=scorer.rows, base_logits=base, k_draft=draft.depth,
        prefix_len=scorer.prefix_len, node_topk=node_topk, corr_topm=top_m, device=scorer.rows.device)
    _, root = drafter.model.prefix_gru(target.embed_tokens(torch.tensor([[draft.root_token]])))
    return dominotree.build_best_first_tree(children, root, budget, draft.depth)


def _paths_published(nodes) -> dict[tuple[int, ...], float]:
    paths: list[tuple[int, ...]] = []
    for node in nodes:
        prefix = () if node.parent < 0 else paths[node.parent]
        paths.append(prefix + (node.token,))
    return {p: n.cum_logprob for p, n in zip(paths, nodes)}


def _paths_treespec(tree) -> dict[tuple[int, ...], float]:
    tokens, parents, scores = tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist()
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + (tokens[i],))
    return {paths[i]: scores[i] for i in range(1, len(tokens))}


def _break_ties(logits: torch.Tensor, step: float = 1e-5) -> torch.Tensor:
    """[L, V] float32: the k-th (by id) of each group of equal values in a row lowered by k * step."""
    out = logits.clone()
    for row, values in zip(out, logits):
        order = torch.sort(values, descending=True, stable=True).indices  # ties: ascending id
        sorted_values = values[order]
        new_group = torch.ones_like(sorted_values, dtype=torch.bool)
        new_group[1:] = sorted_values[1:] != sorted_values[:-1]
        start = torch.cummax(torch.where(new_group, torch.arange(len(order)), 0), 0).values
        row[order] = sorted_values - step * (torch.arange(len(order)) - start)
    return out


def _tie_broken(draft):
    """(the draft with its base logits' ties broken by token id, those float32 logits [L, V])."""
    from treespec.drafters.domino import DominoScorer
    from treespec.interfaces import DraftOutput

    s = draft.scorer
    base = _break_ties(s.base_logits)  # [L, V]
    scorer = DominoScorer(rows=s.rows, base_logits=base, prefix_gru=s.prefix_gru, embed_proj=s.embed_proj,
                          embed=s.embed, anchor=s.anchor, pure_draft_prefix_len=s.prefix_len, gru_table=s.gru_table)
    return DraftOutput(logprobs=torch.log_softmax(base, dim=-1), root_token=draft.root_token,
                       position=draft.position, scorer=scorer), base


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--published", type=Path, required=True, help="a clone of slin-zhq/Domino-Tree")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--positions", type=int, default=8, help="draft rounds per prompt")
    parser.add_argument("--top-m", type=int, default=64)
    parser.add_argument("--node-topk", type=int, default=8)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if not (args.published / "dominotree.py").is_file():
        raise SystemExit(f"--published {args.published}: no clone of slin-zhq/Domino-Tree here (dominotree.py missing)")
    sys.path.insert(0, str(args.published))
    import domino_adapter
    import dominotree

    from treespec.apps.assembly.embedded import embedded_model_dir
    from treespec.apps.assembly.loading import embedded_drafter_dir
    from treespec.drafters.domino import DominoDrafter
    from treespec.engines.torch import TargetModel

    dtype = getattr(torch, args.dtype)
    target = TargetModel.from_local(embedded_model_dir(), dtype=dtype, float32_head=False)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    drafter = DominoDrafter.from_pretrained(embedded_drafter_dir("domino"), dtype=dtype)
    drafter.bind(target)
    contexts = _contexts(target, tokenizer, args.prompts, args.positions, drafter.tap_layers)
    print(f"{len(contexts)} rounds, {args.dtype}, top_m {args.top_m}, node_topk {args.node_topk}")
    compare(args, (dominotree, domino_adapter), target, drafter, contexts)


def compare(args, mods, target, drafter, contexts) -> None:
    """Per budget, both drafts' labels and both backends: how many rounds build the released tree."""
    drafts = []
    with torch.no_grad():
        for sequence, features in contexts:
            drafter.reset()
            draft = drafter.draft(DraftContext(sequence=sequence, features=features, feature_start=0))
            head_dtype = target.lm_head.weight.dtype  # the released harness's base logits: lm_head(z)
            drafts.append(("as drafted", draft, target.lm_head(draft.scorer.rows.to(head_dtype))))
            drafts.append(("ties broken", *_tie_broken(draft)))
        for budget in args.budgets:
            policy = DominoTree(budget=budget, top_m=args.top_m, node_topk=args.node_topk)
            for label in ("as drafted", "ties broken"):
                published = [set(_paths_published(_published_tree(mods, target, drafter, draft, base, budget,
                                                                   args.top_m, args.node_topk)))
                             for name, draft, base in drafts if name == label]
                ours = [draft for name, draft, _ in drafts if name == label]
                for backend in ("torch", "networkx"):
                    same = sum(set(_paths_treespec(policy.with_backend(backend).build(d))) == p
                               for d, p in zip(ours, published))
                    print(f"B = {budget:3d} {label:11s} {backend:8s}: same tree {same}/{len(ours)}")

if __name__ == "__main__":
    main()
