"""Tree policies: both backends build the same tree, and the trees are the right ones.

* Every policy's torch backend (compact and static modes) returns the networkx reference's tree --
  tokens, parents, depths, order and float32 score bits -- over random drafts with forced ties
  (quantised logits, shared corrections), vocabularies from 2 to 151936, budgets 1..1024 and
  depths 1..16.  The default run holds hundreds of cases per policy; ``-m slow`` adds 1000 more.
* DDTree equals brute-force enumeration of the top-B prefixes; DominoTree with a path-independent
  scorer, M = V and node_topk >= B equals DDTree over the scorer's marginals.
* Trees are valid, in canonical order, within budget; bad input gets clear errors.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treespec import registry
from treespec.drafters.domino import DominoScorer
from treespec.drafters.toy import MarginalDrafter, ToyConditionalDrafter, ToyConfig
from treespec.interfaces import DraftContext, DraftOutput
from treespec.policies.caddtree import CaDDTree
from treespec.policies.chain import Chain
from treespec.policies.ddtree import DDTree
from treespec.policies.dominotree import DominoTree
from treespec.policies.engine.best_first import BestFirstPolicy
from treespec.policies.engine.cost import CostAwareStop
from treespec.policies.static_corrected import StaticCorrected
from treespec.pricing.cost import COST_PRESETS, LinearCost
from treespec.tree import DraftTree

QWEN_VOCAB = 151936
BUDGETS = st.one_of(st.integers(1, 40), st.sampled_from([64, 100, 256, 512, 1024]))
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


def context(anchor: int = 3, position: int = 300) -> DraftContext:
    return DraftContext(sequence=torch.full((position + 1,), anchor), features=None)


def marginal_draft(depth: int, vocab: int, seed: int, *, scale: float = 3.0, quantum: float | None = None,
                   position: int = 300) -> DraftOutput:
    return MarginalDrafter.random(depth, vocab, scale=scale, quantum=quantum, seed=seed).draft(
        context(position=position))


def toy_draft(seed: int, **config) -> DraftOutput:
    return ToyConditionalDrafter(ToyConfig(**config), seed=seed).draft(context())


def built_alike(policy: BestFirstPolicy, draft: DraftOutput) -> DraftTree:
    """The networkx tree, after asserting both torch modes return it bit for bit."""
    reference = policy.with_backend("networkx").build(draft)
    compact = policy.build(draft)
    static = policy.build_torch(draft, static=True)
    assert compact.equal(reference), f"compact torch != networkx for {policy}"
    assert static.equal(reference), f"static torch != networkx for {policy}"
    return reference


def reachable(widths: list[int], cap: int) -> int:
    """Nodes of the full tree with the given per-depth branching, capped."""
    total, level = 0, 1
    for w in widths:
        level *= w
        total += level
        if total >= cap:
            return cap
    return total


def check_valid(tree: DraftTree, draft: DraftOutput, expected_size: int) -> None:
    """DraftTree validation, size, depth limit and the canonical score order."""
    DraftTree(tree.tokens, tree.parents, tree.depths, tree.scores)  # re-validate with checks on
    assert tree.budget == expected_size
    assert tree.root_token == draft.root_token
    assert tree.max_depth <= draft.depth
    assert bool((tree.scores[1:-1] >= tree.scores[2:]).all()), "scores must not rise along the order"


def check_marginal_scores(tree: DraftTree, draft: DraftOutput) -> None:
    """Scores are float32(parent score + logp(token)), one rounding, and ranks give the canonical order."""
    scores, parents = tree.scores.tolist(), tree.parents.tolist()
    order = torch.sort(draft.logprobs, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1]).expand_as(order))
    paths: list[tuple] = [()]
    for i in range(1, len(tree)):
        d, t = int(tree.depths[i]), int(tree.tokens[i])
        logp = float(draft.logprobs[d - 1, t])
        assert scores[i] == float(np.float32(scores[parents[i]]) + np.float32(logp))
        paths.append(paths[parents[i]] + (int(rank[d - 1, t]),))
    keys = [(-s, p) for s, p in zip(scores[1:], paths[1:])]
    assert keys == sorted(keys) and len(set(keys)) == len(keys), "not in canonical (heap pop) order"


# ---------------------------------------------------------------------------- strategies
@st.composite
def marginal_cases(draw, vocabs=(2, 3, 5, 17, 64, 400)):
    depth = draw(st.integers(1, 16))
    vocab = draw(st.sampled_from(vocabs))
    budget = draw(BUDGETS)
    quantum = draw(st.sampled_from([None, None, 0.25, 1.0, 4.0]))  # quantised logits force ties
    scale = draw(st.sampled_from([0.1, 1.0, 3.0, 10.0]))
    seed = draw(st.integers(0, 2**31))
    return marginal_draft(depth, vocab, seed, scale=scale, quantum=quantum), budget


@st.composite
def toy_cases(draw, vocabs=(2, 5, 40, 300)):
    vocab = draw(st.sampled_from(vocabs))
    config = {"vocab_size": vocab, "depth": draw(st.integers(1, 16)),
              "pure_draft_prefix_len": draw(st.integers(0, 2)), "quantum": draw(st.sampled_from([None, 1.0, 4.0])),
              "logit_scale": draw(st.sampled_from([1.0, 3.0])), "correction_rows": draw(st.sampled_from([None, 1, 3])),
              "gru_size": draw(st.sampled_from([4, 8]))}
    top_m = draw(st.sampled_from([1, 4, 64, vocab]))
    node_topk = draw(st.integers(1, max(1, min(8, top_m))))
    budget = draw(st.one_of(st.integers(1, 40), st.sampled_from([64, 200, 1024])))
    return toy_draft(draw(st.integers(0, 2**31)), **config), budget, top_m, node_topk


def random_cost(rng: np.random.Generator) -> LinearCost:
    return LinearCost(draft=float(rng.uniform(0.001, 0.02)), base=float(rng.uniform(0.01, 0.05)),
                      per_token=float(rng.uniform(1e-5, 3e-3)), per_context=float(rng.uniform(0, 1e-5)))


# ---------------------------------------------------------------------------- backends agree
@settings(max_examples=250, **SETTINGS)
@given(marginal_cases())
def test_ddtree_backends_agree_and_tree_is_canonical(case):
    draft, budget = case
    tree = built_alike(DDTree(budget=budget), draft)
    k = min(budget, draft.vocab_size)
    check_valid(tree, draft, reachable([k] * draft.depth, budget))
    check_marginal_scores(tree, draft)


@settings(max_examples=250, **SETTINGS)
@given(marginal_cases())
def test_chain_backends_agree_over_marginals(case):
    draft, budget = case
    tree = built_alike(Chain(budget=budget), draft)
    check_valid(tree, draft, min(budget, draft.depth))
    top1 = torch.sort(draft.logprobs, dim=-1, descending=True, stable=True).indices[:, 0]
    assert tree.tokens[1:].tolist() == top1[: tree.budget].tolist()
    assert tree.parents.tolist() == list(range(-1, tree.budget))


@settings(max_examples=250, **SETTINGS)
@given(marginal_cases(), st.integers(0, 2**31))
def test_caddtree_backends_agree_and_prefix_ddtree(case, seed):
    draft, budget = case
    cost = random_cost(np.random.default_rng(seed))
    tree = built_alike(CaDDTree(budget=budget, cost_model=cost), draft)
    full = DDTree(budget=budget).with_backend("networkx").build(draft)
    n = len(tree)
    assert tree.equal(DraftTree(full.tokens[:n], full.parents[:n], full.depths[:n], full.scores[:n]))
    assert tree.equal(DDTree(budget=budget, stop=CostAwareStop(cost)).build(draft))


@settings(max_examples=200, **SETTINGS)
@given(toy_cases())
def test_dominotree_backends_agree(case):
    draft, budget, top_m, node_topk = case
    tree = built_alike(DominoTree(budget=budget, top_m=top_m, node_topk=node_topk), draft)
    k_prefix, k_corrected = min(node_topk, draft.vocab_size), min(node_topk, top_m, draft.vocab_size)
    prefix = draft.scorer.cfg.pure_draft_prefix_len
    widths = [k_prefix if d < prefix else k_corrected for d in range(draft.depth)]
    check_valid(tree, draft, reachable(widths, budget))


@settings(max_examples=150, **SETTINGS)
@given(toy_cases())
def test_static_corrected_backends_agree(case):
    draft, budget, top_m, _ = case
    tree = built_alike(StaticCorrected(budget=budget, top_m=top_m), draft)
    width = min(budget, top_m, draft.vocab_size)
    check_valid(tree, draft, reachable([width] * draft.depth, budget))


@settings(max_examples=150, **SETTINGS)
@given(toy_cases())
def test_chain_backends_agree_over_a_scorer(case):
    draft, budget, top_m, _ = case
    tree = built_alike(Chain(budget=budget, top_m=top_m), draft)
    check_valid(tree, draft, min(budget, draft.depth))
    state = draft.scorer.root_state()
    for depth in range(tree.budget):  # the greedy rollout, node by node
        out = draft.scorer.expand(state[None], depth, top_m=min(top_m, draft.vocab_size), k=1)
        assert int(out.tokens[0, 0]) == int(tree.tokens[depth + 1])
        state = out.states[0, 0]


@pytest.mark.parametrize("budget", [1, 16, 1024])
@pytest.mark.parametrize("quantum", [None, 1.0])
def test_backends_agree_on_qwen3_sized_vocabulary(budget, quantum):
    draft = marginal_draft(16, QWEN_VOCAB, seed=budget, scale=2.0, quantum=quantum)
    assert built_alike(DDTree(budget=budget), draft).budget == budget
    assert built_alike(Chain(budget=budget), draft).budget == min(budget, 16)
    built_alike(CaDDTree(budget=budget, cost_model=COST_PRESETS["smollm2-cpu-bf16"]), draft)  # may keep only the root
    toy = toy_draft(budget, vocab_size=QWEN_VOCAB, depth=16, quantum=quantum, correction_rows=3 if quantum else None)
    for policy in (DominoTree(budget=budget), StaticCorrected(budget=min(budget, 256)), Chain(budget=budget)):
        built_alike(policy, toy)


@pytest.mark.slow
@settings(max_examples=1000, **SETTINGS)
@given(marginal_cases(vocabs=(2, 3, 5, 17, 64, 400, 5000)), st.integers(0, 2**31))
def test_factorized_policies_agree_many_cases(case, seed):
    draft, budget = case
    built_alike(DDTree(budget=budget), draft)
    built_alike(Chain(budget=budget), draft)
    built_alike(CaDDTree(budget=budget, cost_model=random_cost(np.random.default_rng(seed))), draft)


@pytest.mark.slow
@settings(max_examples=1000, **SETTINGS)
@given(toy_cases(vocabs=(2, 5, 40, 300, 3000)))
def test_conditional_policies_agree_many_cases(case):
    draft, budget, top_m, node_topk = case
    built_alike(DominoTree(budget=budget, top_m=top_m, node_topk=node_topk), draft)
    built_alike(StaticCorrected(budget=budget, top_m=top_m), draft)
    built_alike(Chain(budget=budget, top_m=top_m), draft)


# ---------------------------------------------------------------------------- the right trees
def brute_force_top_prefixes(draft: DraftOutput, budget: int) -> DraftTree:
    """Enumerate every path up to depth L, score it in float32, keep the best B by (score, rank path)."""
    lp = draft.logprobs.numpy()
    ranked = [sorted(range(draft.vocab_size), key=lambda t, row=row: (-row[t], t)) for row in lp]
    nodes = []  # (-score, rank path, tokens)
    for depth in range(1, draft.depth + 1):
        for ranks in itertools.product(range(draft.vocab_size), repeat=depth):
            score, tokens = np.float32(0.0), []
            for d, r in enumerate(ranks):
                tokens.append(ranked[d][r])
                score = np.float32(score + lp[d, tokens[-1]])
            nodes.append((-float(score), ranks, tokens))
    best = sorted(nodes)[:budget]
    index = {(): 0}
    for i, (_, ranks, _) in enumerate(best, start=1):
        index[ranks] = i
    return DraftTree.build([draft.root_token] + [t[-1] for _, _, t in best],
                           [-1] + [index[r[:-1]] for _, r, _ in best],
                           scores=[0.0] + [-s for s, _, _ in best])


@settings(max_examples=150, **SETTINGS)
@given(st.integers(1, 4), st.integers(2, 4), st.integers(1, 60), st.sampled_from([None, 0.5, 2.0]),
       st.integers(0, 2**31))
def test_ddtree_equals_brute_force_top_prefixes(depth, vocab, budget, quantum, seed):
    draft = marginal_draft(depth, vocab, seed, scale=2.0, quantum=quantum)
    expected = brute_force_top_prefixes(draft, budget)
    assert built_alike(DDTree(budget=budget), draft).equal(expected)


def scorer_marginals(draft: DraftOutput) -> DraftOutput:
    """The per-depth distributions of a path-independent scorer, as a factorized draft."""
    vocab, state = draft.vocab_size, draft.scorer.root_state()[None]
    rows = torch.empty(draft.depth, vocab)
    for depth in range(draft.depth):
        out = draft.scorer.expand(state, depth, top_m=vocab, k=vocab)
        rows[depth, out.tokens[0]] = out.logprobs[0]
    return DraftOutput(logprobs=rows, root_token=draft.root_token, position=draft.position)


@settings(max_examples=100, **SETTINGS)
@given(st.integers(1, 8), st.sampled_from([2, 5, 30]), st.integers(1, 200), st.integers(0, 2),
       st.sampled_from([None, 1.0]), st.integers(0, 2**31))
def test_path_independent_dominotree_equals_ddtree(depth, vocab, budget, prefix, quantum, seed):
    draft = toy_draft(seed, vocab_size=vocab, depth=depth, pure_draft_prefix_len=prefix, quantum=quantum,
                      path_independent=True, correction_rows=2 if quantum else None)
    domino = DominoTree(budget=budget, top_m=vocab, node_topk=min(budget, vocab))
    tree = built_alike(domino, draft)
    assert tree.equal(built_alike(DDTree(budget=budget), scorer_marginals(draft)))


def test_path_dependent_dominotree_differs_from_its_static_ablation():
    """Sanity: with the path-dependent scorer the two arms do build different trees somewhere."""
    differ = 0
    for seed in range(10):
        draft = toy_draft(seed, vocab_size=40, depth=6, correction_gain=6.0)
        a = DominoTree(budget=32).build(draft)
        b = StaticCorrected(budget=32).build(draft)
        differ += not a.equal(b)
    assert differ > 0


def test_chain_is_the_top1_path_and_defaults_to_the_draft_depth():
    draft = marginal_draft(7, 50, seed=1)
    tree = Chain().build(draft)
    assert tree.budget == 7
    assert tree.tokens[1:].tolist() == draft.logprobs.argmax(-1).tolist()
    assert tree.scores.tolist() == DraftTree.chain(draft.root_token, tree.tokens[1:],
                                                   draft.logprobs.max(-1).values).scores.tolist()


def test_ddtree_uses_only_the_top_budget_tokens_per_depth():
    draft = marginal_draft(3, 500, seed=4, scale=0.01)  # nearly flat: a wide first level
    tree = DDTree(budget=20).build(draft)
    top = torch.sort(draft.logprobs, dim=-1, descending=True, stable=True).indices[:, :20]
    for d, t in zip(tree.depths[1:].tolist(), tree.tokens[1:].tolist()):
        assert t in top[d - 1].tolist()


def test_graph_backend_exposes_rank_paths_in_pop_order():
    draft = toy_draft(5, vocab_size=30, depth=5, quantum=1.0, correction_rows=2)
    graph = DominoTree(budget=50).build_graph(draft)
    keys = [(-graph.nodes[i]["score"], graph.nodes[i]["path"]) for i in range(1, graph.number_of_nodes())]
    assert keys == sorted(keys)
    assert DraftTree.from_networkx(graph).equal(DominoTree(budget=50).build(draft))


# ---------------------------------------------------------------------------- errors and registry
POLICY_CLASSES = [Chain, DDTree, CaDDTree, DominoTree, StaticCorrected]


@pytest.mark.parametrize("cls", POLICY_CLASSES)
@pytest.mark.parametrize("bad", [0, -3])
def test_budget_below_one_is_rejected(cls, bad):
    with pytest.raises(ValueError, match=f"budget must be an integer >= 1 .*got {bad}"):
        cls(budget=bad)


@pytest.mark.parametrize("cls", POLICY_CLASSES)
@pytest.mark.parametrize("bad", [2.5, True, "16"])
def test_budget_that_is_not_an_int_is_rejected(cls, bad):
    with pytest.raises(ValueError, match="budget must be an integer"):
        cls(budget=bad)


@pytest.mark.parametrize("cls", [Chain, DDTree, CaDDTree])
def test_nan_and_positive_logprobs_are_rejected(cls):
    draft = marginal_draft(4, 30, seed=0)
    lp = draft.logprobs.clone()
    lp[2, 7] = math.nan
    with pytest.raises(ValueError, match="NaN.*depth row 2, token 7"):
        cls(budget=8).build(DraftOutput(logprobs=lp, root_token=1))
    lp[2, 7] = 0.5
    for backend in ("torch", "networkx"):
        with pytest.raises(ValueError, match="<= 0"):
            cls(budget=8).with_backend(backend).build(DraftOutput(logprobs=lp, root_token=1))


@pytest.mark.parametrize("cls", POLICY_CLASSES)
def test_unknown_backend_is_rejected(cls):
    with pytest.raises(ValueError, match="unknown backend 'numpy'"):
        cls().with_backend("numpy").build(toy_draft(0))


@pytest.mark.parametrize("cls", [DominoTree, StaticCorrected])
def test_conditional_policies_need_a_scorer(cls):
    with pytest.raises(ValueError, match="ConditionalScorer"):
        cls().build(marginal_draft(4, 30, seed=0))


def test_scorer_returning_nan_is_reported():
    draft = toy_draft(0, vocab_size=20)
    draft.scorer.logprobs[1, :] = math.nan  # corrupt the base rows the scorer reads
    with pytest.raises(ValueError, match="scorer.expand at depth 1"):
        DominoTree(budget=16).build(draft)


def test_dominotree_checks_its_widths():
    with pytest.raises(ValueError, match="node_topk"):
        DominoTree(top_m=4, node_topk=8)
    with pytest.raises(ValueError, match="top_m"):
        DominoTree(top_m=0)


@pytest.mark.parametrize("name", registry.available("policy"))
def test_registry_names_build_trees(name):
    cost = {"cost_model": LinearCost(draft=0.001, base=0.05, per_token=1e-4)}  # trees pay
    policy = registry.create("policy", name, budget=8, **(cost if registry.resolve("policy", name).uses_cost_model else {}))
    assert policy.name == name
    tree = policy.build(toy_draft(2, vocab_size=50, depth=4))
    assert 1 <= tree.budget <= 8


def test_tiny_vocabulary_caps_the_tree_at_every_reachable_node():
    draft = marginal_draft(3, 2, seed=9)
    tree = built_alike(DDTree(budget=1000), draft)
    assert tree.budget == 2 + 4 + 8  # every path of the full binary tree of depth 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", [DDTree(budget=64), Chain(), CaDDTree(budget=64, cost_model=LinearCost(
    draft=0.001, base=0.05, per_token=1e-4))], ids=["ddtree", "chain", "caddtree"])
def test_cuda_graph_build_equals_reference(policy):
    from treespec.policies.engine.cuda_graph import GraphedBuild

    graphed = GraphedBuild(policy, 16, 4096)
    for seed in range(4):  # one capture, several replays with new drafts
        draft = marginal_draft(16, 4096, seed, quantum=1.0 if seed % 2 else None)
        on_gpu = DraftOutput(logprobs=draft.logprobs.cuda(), root_token=draft.root_token, position=draft.position)
        assert graphed.build(on_gpu).to("cpu").equal(policy.with_backend("networkx").build(draft))
        assert policy.build(on_gpu).to("cpu").equal(policy.with_backend("networkx").build(draft))


def random_domino_round(seed: int, device: str, modules: tuple, *, vocab: int = 300, hidden: int = 24,
                        depth: int = 6) -> DraftOutput:
    """One round over random Domino ``modules`` (GRU, projection, embedding; float32) on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    gru_module, proj, embed = modules
    logits = 3 * torch.randn(depth, vocab, generator=gen)
    scorer = DominoScorer(rows=torch.randn(depth, hidden, generator=gen).to(device), base_logits=logits.to(device),
                          prefix_gru=gru_module, embed_proj=proj, embed=embed, anchor=seed % vocab,
                          pure_draft_prefix_len=1)
    return DraftOutput(logprobs=torch.log_softmax(logits, -1).to(device), root_token=seed % vocab, scorer=scorer)


def random_domino_modules(device: str, *, vocab: int = 300, hidden: int = 24, gru: int = 8, rank: int = 6) -> tuple:
    torch.manual_seed(0)
    modules = (torch.nn.GRU(hidden, gru, batch_first=True, bias=False),
               torch.nn.Sequential(torch.nn.Linear(hidden + gru, rank, bias=False), torch.nn.SiLU(),
                                   torch.nn.Linear(rank, vocab, bias=False)),
               torch.nn.Embedding(vocab, hidden))
    return tuple(m.requires_grad_(False).to(device) for m in modules)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", [DominoTree(budget=48, top_m=16, node_topk=4), Chain(top_m=16)],
                         ids=["dominotree", "chain-domino"])
def test_cuda_graph_build_over_a_scorer_equals_eager(policy):
    """A Domino round's scorer captured through its round inputs: every replay is the eager static build."""
    from treespec.policies.engine.cuda_graph import GraphedBuild

    modules = random_domino_modules("cuda")
    first = random_domino_round(0, "cuda", modules)
    graphed = GraphedBuild(policy, first.depth, first.vocab_size, scorer=first.scorer)
    for seed in range(1, 5):  # one capture, several replays with new rounds
        draft = random_domino_round(seed, "cuda", modules)
        assert graphed.build(draft).equal(policy.build_torch(draft, static=True))


@pytest.mark.parametrize(("policy", "scored"), [
    (DDTree(budget=48), False), (Chain(), False),
    (CaDDTree(budget=48, cost_model=LinearCost(draft=0.001, base=0.05, per_token=1e-4)), False),
    (DominoTree(budget=48, top_m=16, node_topk=4), True), (Chain(top_m=16), True),
], ids=["ddtree", "chain", "caddtree", "dominotree", "chain-domino"])
def test_captured_selection_reads_no_value_on_the_host(policy, scored):
    """What a CUDA graph captures of a build runs on meta tensors, which have no values (an ``item``,
    a ``nonzero`` or a branch on a value fails there), with the shapes it has on real values: the
    capture's precondition, checked without a GPU."""
    from treespec.policies.engine.cuda_graph import static_selection

    if scored:
        real = random_domino_round(3, "cpu", random_domino_modules("cpu"))
        meta = random_domino_round(3, "meta", random_domino_modules("meta"))
    else:
        real = marginal_draft(16, 300, 3)
        meta = DraftOutput(logprobs=real.logprobs.to("meta"), root_token=real.root_token)
    expected = static_selection(policy, real)
    got = static_selection(policy, meta)
    assert all(t.is_meta for t in got)
    assert [t.shape for t in got] == [t.shape for t in expected]
