"""Tree build time per round: every policy, both backends, side by side in one run.

For L = 16, each vocabulary size and each budget, it prints the median build time per round of
the torch backend (and its best round, the figure least disturbed by other load on a shared
machine), the networkx backend's median, their ratio and the tree size; next to DDTree it times a
published-style heap builder (torch.topk of min(B, V) tokens per depth, then a Python heap), so
that ratio is measured here too; next to DominoTree it times a published-style DominoTree builder
(one Python heap, one ``scorer.expand`` call per popped node, `heap_dominotree`), interleaved.  Published figures quoted by the issue (2 quiet cores) are
printed for reference, not measured.

Drafts: marginal policies get N(0, scale^2) logits per row.  DominoTree and the static-corrected
arm run on the project's `DominoScorer` with random Domino-sized parts (SmolLM2 sizes with V =
49152, Qwen3-4B sizes with V = 151936; M = 64, node_topk = 8), a fresh scorer per round so its
per-round gathers are timed.  ``dominotree[toy]`` is the same policy over the toy scorer whose
path states are deferred (a child's GRU step runs only if it is expanded).

    python benchmarks/bench_build.py                      # the full table (a few minutes)
    python benchmarks/bench_build.py --vocabs 49152 --budgets 16 64 --rounds 5
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import time

import torch
from torch import nn

from treespec.drafters.domino import DominoScorer
from treespec.drafters.toy import ToyConditionalDrafter, ToyConfig
from treespec.interfaces import DraftContext, DraftOutput
from treespec.policies.caddtree import CaDDTree
from treespec.policies.chain import Chain
from treespec.policies.ddtree import DDTree
from treespec.policies.dominotree import DominoTree
from treespec.policies.static_corrected import StaticCorrected
from treespec.pricing.conditions import ThreadControl
from treespec.pricing.cost import COST_PRESETS

DEPTH = 16
SIZES = {  # V -> Domino part sizes: hidden H, GRU G, correction rank E
    49152: {"hidden": 576, "gru": 256, "rank": 64},
    151936: {"hidden": 2560, "gru": 1024, "rank": 256},
}
PUBLISHED = {  # the figures (ms), measured by its author on 2 quiet cores
    ("ddtree-heap", 49152): {16: 1.2, 64: 0.8, 256: 1.7, 1024: 5.4},
    ("ddtree-heap", 151936): {16: 2.0, 64: 2.1, 256: 3.1, 1024: 6.8},
    ("dominotree-heap", 49152): {16: 5.4, 64: 16, 256: 61},
    ("dominotree-heap", 151936): {16: 77, 64: 282, 256: 1204},
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabs", nargs="+", type=int, default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--budgets", nargs="+", type=int, default=[16, 64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=21, help="timed torch rounds per marginal cell (median)")
    parser.add_argument("--scorer-rounds", type=int, default=5, help="timed torch rounds per scorer cell")
    parser.add_argument("--nx-rounds", type=int, default=3, help="timed networkx rounds per cell")
    parser.add_argument("--nx-seconds", type=float, default=3.0,
                        help="skip networkx cells whose first round takes longer than this")
    parser.add_argument("--scale", type=float, default=4.0, help="std of the random draft logits")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return parser.parse_args()


# ---------------------------------------------------------------------------- drafts
class HashedEmbedding(nn.Module):
    """Random [rows, H] token embeddings read at t mod rows: Domino-sized width, small memory."""

    def __init__(self, rows: int, hidden: int, gen: torch.Generator) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, hidden, generator=gen) * 0.02, requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight[tokens % self.weight.shape[0]]


class DominoParts:
    """Random Domino modules of one size; `draft` makes a fresh round (new logits, new scorer)."""

    def __init__(self, vocab: int, hidden: int, gru: int, rank: int, scale: float) -> None:
        gen = torch.Generator().manual_seed(0)
        self.gru = nn.GRU(hidden, gru, batch_first=True, bias=False).requires_grad_(False)
        self.proj = nn.Sequential(nn.Linear(hidden + gru, rank, bias=False), nn.SiLU(),
                                  nn.Linear(rank, vocab, bias=False)).requires_grad_(False)
        for module in (self.gru, self.proj):  # re-draw from the explicit generator
            for weight in module.parameters():
                weight.copy_(torch.randn(weight.shape, generator=gen) / weight.shape[-1] ** 0.5)
        self.embed = HashedEmbedding(4096, hidden, gen)
        self.vocab, self.hidden, self.scale = vocab, hidden, scale

    def draft(self, seed: int, depth: int = DEPTH) -> DraftOutput:
        gen = torch.Generator().manual_seed(seed)
        logits = self.scale * torch.randn(depth, self.vocab, generator=gen)
        rows = torch.randn(depth, self.hidden, generator=gen)
        scorer = DominoScorer(rows=rows, base_logits=logits, prefix_gru=self.gru, embed_proj=self.proj,
                              embed=self.embed, anchor=seed % self.vocab, pure_draft_prefix_len=1)
        return DraftOutput(logprobs=torch.log_softmax(logits, -1), root_token=seed % self.vocab,
                           position=512, scorer=scorer)


def marginal_draft(vocab: int, scale: float, seed: int, depth: int = DEPTH) -> DraftOutput:
    gen = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(scale * torch.randn(depth, vocab, generator=gen), -1)
    return DraftOutput(logprobs=logprobs, root_token=1, position=512)


def toy_drafter(vocab: int, hidden: int, gru: int, rank: int, scale: float) -> ToyConditionalDrafter:
    config = ToyConfig(vocab_size=vocab, depth=DEPTH, hidden_size=hidden, gru_size=gru, rank=rank,
                       exact=False, embed_rows=4096, logit_scale=scale)
    return ToyConditionalDrafter(config, seed=0)


# ---------------------------------------------------------------------------- the baseline
def heap_ddtree(logprobs: torch.Tensor, budget: int) -> list[tuple[int, int, float]]:
    """A published-style DDTree builder: top-min(B, V) per depth by torch.topk, then heapq on the host.

    Returns (token, parent, score) per node in pop order; scores are summed in float64 here, as
    a host heap would, so its trees are not bit-exact -- it is a timing baseline only.
    """
    k = min(budget, logprobs.shape[1])
    values, tokens = torch.topk(logprobs, k, dim=-1)
    values, tokens = values.tolist(), tokens.tolist()
    heap = [(-values[0][0], 0, 0, 0, 0.0)]  # (-score, depth - 1, rank, parent node, parent score)
    nodes: list[tuple[int, int, float]] = []
    while heap and len(nodes) < budget:
        neg, d, r, parent, parent_score = heapq.heappop(heap)
        nodes.append((tokens[d][r], parent, -neg))
        if r + 1 < k:
            heapq.heappush(heap, (-(parent_score + values[d][r + 1]), d, r + 1, parent, parent_score))
        if d + 1 < len(values):
            heapq.heappush(heap, (neg - values[d + 1][0], d + 1, 0, len(nodes), -neg))
    return nodes


def heap_dominotree(draft: DraftOutput, budget: int, top_m: int, node_topk: int) -> list[tuple[int, int, float]]:
    """A published-style DominoTree builder: one Python heap, one scorer call per popped node.

    Each popped node's children (its own path's top node_topk of the top-M candidates, with their
    GRU states) come from ``scorer.expand`` on that node alone and all go on the heap.  Returns
    (token, parent, score) per node in pop order; a timing baseline only (float64 scores).
    """
    scorer, depth_limit = draft.scorer, draft.depth
    top_m = min(top_m, draft.vocab_size)
    k = min(node_topk, top_m)
    heap: list[tuple] = []  # (-score, tie counter, parent node, depth, token, state)
    counter = 0

    def push_children(node: int, depth: int, score: float, state: torch.Tensor) -> None:
        nonlocal counter
        out = scorer.expand(state[None], depth, top_m=top_m, k=k)
        for token, logp, child in zip(out.tokens[0].tolist(), out.logprobs[0].tolist(), out.states[0]):
            heapq.heappush(heap, (-(score + logp), counter, node, depth + 1, token, child))
            counter += 1

    push_children(0, 0, 0.0, scorer.root_state())
    nodes: list[tuple[int, int, float]] = []
    while heap and len(nodes) < budget:
        neg, _, parent, depth, token, state = heapq.heappop(heap)
        nodes.append((token, parent, -neg))
        if depth < depth_limit:
            push_children(len(nodes), depth, -neg, state)
    return nodes


# ---------------------------------------------------------------------------- timing
def interleaved_ms(builds: dict, make_draft, seeds: range) -> dict[str, tuple[float, int]]:
    """Median and best ms per build and the last tree size; each round runs every build on one
    fresh draft in turn, so that load on the shared machine hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in builds}
    sizes = dict.fromkeys(builds, 0)
    for seed in seeds:
        for name, build in builds.items():
            draft = make_draft(seed)  # fresh per build: a scorer caches its per-round gathers
            start = time.perf_counter()
            tree = build(draft)
            times[name].append(1e3 * (time.perf_counter() - start))
            sizes[name] = len(tree) - 1 if hasattr(tree, "tokens") else len(tree)
    return {name: (statistics.median(t), min(t), sizes[name]) for name, t in times.items()}


def networkx_ms(policy, make_draft, rounds: int, limit: float) -> float | None:
    """Median ms of the networkx backend, or None when its first round exceeds ``limit`` seconds."""
    first = interleaved_ms({"nx": lambda d: policy.with_backend("networkx").build(d)}, make_draft, range(9_000, 9_001))
    if first["nx"][0] > 1e3 * limit:
        return None
    reference = policy.with_backend("networkx")
    return interleaved_ms({"nx": lambda d: reference.build(d)}, make_draft, range(rounds))["nx"][0]


def fmt(ms: float | None) -> str:
    return "skipped" if ms is None else f"{ms:.2f}"


def arms(budget: int) -> dict[str, tuple]:
    """name -> (policy, draft kind)."""
    return {"chain": (Chain(budget=budget), "marginal"), "ddtree": (DDTree(budget=budget), "marginal"),
            "caddtree": (CaDDTree(budget=budget, cost_model=COST_PRESETS["smollm2-cpu-bf16"]), "marginal"),
            "dominotree": (DominoTree(budget=budget), "domino"),
            "dominotree[toy]": (DominoTree(budget=budget), "toy"),
            "static-corrected": (StaticCorrected(budget=budget), "domino")}


def print_heap_ratios(timed: dict[str, tuple[float, float, int]]) -> None:
    """Published-style heap builder time / torch time, medians of the same interleaved rounds."""
    for name in ("ddtree", "dominotree"):
        if name in timed and f"{name}-heap" in timed:
            print(f"  {name}-heap / {name} torch: {timed[f'{name}-heap'][0] / timed[name][0]:.1f}x", flush=True)


def run_vocab(vocab: int, args: argparse.Namespace) -> None:
    sizes = SIZES[vocab]
    parts = DominoParts(vocab, **sizes, scale=args.scale)
    toy = toy_drafter(vocab, **sizes, scale=args.scale)

    def toy_draft(seed: int) -> DraftOutput:
        return toy.draft(DraftContext(sequence=torch.full((513,), seed % vocab), features=None))

    sources = {"marginal": lambda seed: marginal_draft(vocab, args.scale, seed), "domino": parts.draft,
               "toy": toy_draft}
    print(f"\nV = {vocab}, L = {DEPTH}; Domino parts H = {sizes['hidden']}, G = {sizes['gru']}, "
          f"rank = {sizes['rank']}; logits N(0, {args.scale}^2); threads = {torch.get_num_threads()}")
    print(f"{'policy':<18}{'B':>6}{'torch ms':>11}{'best':>8}{'networkx ms':>13}{'nx/torch':>10}{'nodes':>7}"
          f"{'published ms':>14}")
    for budget in args.budgets:
        for kind in ("marginal", "domino", "toy"):
            chosen = {name: policy for name, (policy, k) in arms(budget).items() if k == kind}
            builds = {name: (lambda d, p=policy: p.build(d)) for name, policy in chosen.items()}
            if kind == "marginal":
                builds["ddtree-heap"] = lambda d, b=budget: heap_ddtree(d.logprobs, b)
            if kind == "domino":
                builds["dominotree-heap"] = lambda d, b=budget: heap_dominotree(d, b, top_m=64, node_topk=8)
            interleaved_ms(builds, sources[kind], range(10_000, 10_001))  # warm-up
            timed = interleaved_ms(builds, sources[kind], range(args.rounds if kind == "marginal" else args.scorer_rounds))
            for name, (torch_ms, best_ms, size) in timed.items():
                nx_ms = None if name.endswith("-heap") else networkx_ms(
                    chosen[name], sources[kind], args.nx_rounds, args.nx_seconds)
                ratio = "" if nx_ms is None else f"{nx_ms / torch_ms:.1f}x"
                published = PUBLISHED.get((name, vocab), {}).get(budget, "")
                shown = "" if name.endswith("-heap") else fmt(nx_ms)
                print(f"{name:<18}{budget:>6}{torch_ms:>11.2f}{best_ms:>8.2f}{shown:>13}{ratio:>10}{size:>7}"
                      f"{published:>14}", flush=True)
            print_heap_ratios(timed)


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        ThreadControl.start(args.threads)
    torch.set_grad_enabled(False)
    for vocab in args.vocabs:
        run_vocab(vocab, args)


if __name__ == "__main__":
    main()
