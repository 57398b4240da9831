"""The parts under the policies: exact top-k, the test drafters, and expected acceptance length."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treespec import registry
from treespec.analysis import expected_acceptance, path_logprobs
from treespec.drafters.toy import TOY_PRESETS, MarginalDrafter, ToyConditionalDrafter, ToyConfig
from treespec.interfaces import DraftContext, DraftOutput
from treespec.policies.chain import Chain
from treespec.policies.ddtree import DDTree
from treespec.policies.dominotree import DominoTree
from treespec.topk import exact_topk, order_key, reference_topk, top_set
from treespec.tree import DraftTree

SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
CTX = DraftContext(sequence=torch.tensor([4, 8, 15, 16, 23, 42]), features=None)


# ---------------------------------------------------------------------------- exact top-k
@settings(max_examples=300, **SETTINGS)
@given(st.integers(1, 5), st.sampled_from([1, 2, 7, 63, 64, 65, 700, 5000, 40000]), st.integers(1, 300),
       st.sampled_from([None, 0.5, 3.0]), st.booleans(), st.booleans(), st.sampled_from([torch.float32, torch.float64]),
       st.integers(0, 2**31))
def test_exact_topk_equals_a_stable_sort(rows, vocab, k, quantum, extremes, raw, dtype, seed):
    k = min(k, vocab)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 3
    if quantum is not None:
        logits = torch.round(logits / quantum) * quantum
    values = logits if raw else torch.log_softmax(logits, dim=-1)  # raw: logits of either sign
    if extremes:  # -inf, +inf, and both zeros (which must tie)
        values[:, ::7] = -math.inf
        values[:, 1::11] = 0.0
        values[:, 2::13] = -0.0
        values[:, 5::17] = math.inf if raw else 0.0
    got, ids = exact_topk(values, k)
    want, want_ids = reference_topk(values, k)
    assert torch.equal(ids, want_ids) and torch.equal(got, want)
    assert torch.equal(top_set(values, k), want_ids.sort(dim=-1).values)


def test_order_key_orders_by_value_then_index():
    values = torch.tensor([-1.0, -0.5, -1.0, 0.0, -0.0, -math.inf, 2.0, math.inf, 0.5, 2.0])
    order = order_key(values, torch.arange(10)).argsort().tolist()
    assert order == [7, 6, 9, 8, 3, 4, 1, 0, 2, 5]


def test_top_set_breaks_ties_at_the_boundary_by_token_id():
    values = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 5.0]])
    assert top_set(values, 3).tolist() == [[1, 2, 5]]
    assert top_set(values, 9).tolist() == [[0, 1, 2, 3, 4, 5]]  # m above V: the whole row


def test_exact_topk_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k must be in 1..5"):
        exact_topk(torch.zeros(2, 5), 6)
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        exact_topk(torch.zeros(5), 2)


# ---------------------------------------------------------------------------- marginal drafter
def test_marginal_drafter_log_softmaxes_fixed_or_callable_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    out = MarginalDrafter(logits).draft(CTX)
    assert out.logprobs.dtype == torch.float32 and out.root_token == 42 and out.position == 5
    assert torch.allclose(out.logprobs.exp().sum(-1), torch.ones(2))
    varying = MarginalDrafter(lambda ctx: torch.full((2, 3), float(ctx.anchor)))
    assert torch.allclose(varying.draft(CTX).logprobs, torch.full((2, 3), -math.log(3)))
    quantised = MarginalDrafter.random(3, 50, quantum=1.0, seed=1).draft(CTX).logprobs
    assert quantised.unique().numel() < 50  # ties are forced
    with pytest.raises(ValueError, match=r"\[L, V\]"):
        MarginalDrafter(torch.zeros(5))


# ---------------------------------------------------------------------------- conditional toy
def toy(**overrides) -> ToyConditionalDrafter:
    return ToyConditionalDrafter(ToyConfig(**{"vocab_size": 40, "depth": 6, **overrides}), seed=7)


def random_states(draft: DraftOutput, n: int, seed: int) -> torch.Tensor:
    """States of n random paths (walking the scorer down random children)."""
    gen = torch.Generator().manual_seed(seed)
    states = draft.scorer.root_state()[None].expand(n, -1)
    for depth in range(int(torch.randint(0, draft.depth - 1, (1,), generator=gen))):
        out = draft.scorer.expand(states, depth, top_m=8, k=4)
        pick = torch.randint(0, out.tokens.shape[1], (n,), generator=gen)
        states = out.states[torch.arange(n), pick]
    return states


@settings(max_examples=60, **SETTINGS)
@given(st.integers(0, 2**31), st.integers(1, 40), st.sampled_from([0, 1, 2]), st.sampled_from([None, 1.0]))
def test_exact_toy_scorer_rows_do_not_depend_on_the_batch(seed, n, prefix, quantum):
    draft = toy(pure_draft_prefix_len=prefix, quantum=quantum, correction_rows=3 if quantum else None).draft(CTX)
    states = random_states(draft, n, seed)
    depth = draft.depth - 2
    batch = draft.scorer.expand(states, depth, top_m=16, k=5)
    for i in range(n):
        one = draft.scorer.expand(states[i:i + 1], depth, top_m=16, k=5)
        assert torch.equal(one.tokens[0], batch.tokens[i])
        assert torch.equal(one.logprobs[0].view(torch.int32), batch.logprobs[i].view(torch.int32))
        assert torch.equal(one.states[0], batch.states[i])


def test_toy_children_are_sorted_normalised_over_top_m_and_path_dependent():
    draft = toy(correction_rows=2, quantum=1.0).draft(CTX)
    states = random_states(draft, 12, seed=3)
    out = draft.scorer.expand(states, 3, top_m=20, k=20)
    lp, tok = out.logprobs, out.tokens
    assert torch.allclose(lp.exp().sum(-1), torch.ones(12))  # k = M: the whole renormalised set
    ordered = (lp[:, :-1] > lp[:, 1:]) | ((lp[:, :-1] == lp[:, 1:]) & (tok[:, :-1] < tok[:, 1:]))
    assert bool(ordered.all())
    top20 = set(reference_topk(draft.logprobs[3][None], 20)[1][0].tolist())
    assert all(set(row) == top20 for row in tok.tolist())
    assert len({tuple(row) for row in lp.tolist()}) > 1  # different paths, different children


def test_toy_pure_prefix_uses_base_rows_and_path_independent_mode_ignores_the_path():
    draft = toy(pure_draft_prefix_len=2).draft(CTX)
    states = random_states(draft, 6, seed=1)
    out = draft.scorer.expand(states, 1, top_m=4, k=5)
    want_lp, want_tok = reference_topk(draft.logprobs[1][None], 5)
    assert torch.equal(out.tokens, want_tok.expand(6, -1)) and torch.equal(out.logprobs, want_lp.expand(6, -1))
    independent = toy(path_independent=True).draft(CTX)
    out = independent.scorer.expand(random_states(independent, 6, seed=2), 4, top_m=10, k=3)
    assert (out.tokens == out.tokens[:1]).all() and (out.logprobs == out.logprobs[:1]).all()


def test_toy_state_is_the_deferred_path_and_weights_sit_on_their_grids():
    drafter = toy()
    draft = drafter.draft(CTX)
    root = draft.scorer.root_state()
    assert root.shape == (drafter.config.gru_size + 1,) and int(root[-1]) == 42
    out = draft.scorer.expand(root[None], 0, top_m=10, k=3)
    assert torch.equal(out.states[0, :, -1].long(), out.tokens[0])  # each child carries its own token
    for name in ("w_ih", "w_hh", "w1_z", "w1_s", "w2"):
        w = getattr(drafter.weights, name)
        assert torch.equal(w * 256, torch.round(w * 256)), name
    assert torch.equal(drafter.draft(CTX).logprobs, draft.logprobs)  # keyed by the context


def test_toy_scorer_rejects_bad_calls():
    draft = toy().draft(CTX)
    root = draft.scorer.root_state()[None]
    with pytest.raises(ValueError, match="depth 6 out of range"):
        draft.scorer.expand(root, 6, top_m=4, k=2)
    with pytest.raises(ValueError, match=r"states must be \[n, 9\]"):
        draft.scorer.expand(root[:, :3], 1, top_m=4, k=2)
    with pytest.raises(ValueError, match="only top_m = 4"):
        draft.scorer.expand(root, 2, top_m=4, k=5)


def test_fast_toy_runs_and_registry_names_resolve():
    drafter = registry.create("drafter", "toy-conditional", vocab_size=300, depth=4, exact=False)
    tree = DominoTree(budget=20).build(drafter.draft(CTX))
    assert tree.budget == 20
    assert isinstance(registry.create("drafter", "marginal", logits=torch.zeros(2, 3)), MarginalDrafter)
    assert TOY_PRESETS["qwen3-4b-sized"].vocab_size == 151936


# ---------------------------------------------------------------------------- expected acceptance
def test_expected_acceptance_is_one_plus_the_path_probabilities():
    draft = MarginalDrafter.random(5, 30, seed=2).draft(CTX)
    tree = DDTree(budget=40).build(draft)
    direct = 1.0
    for i in range(1, len(tree)):
        p = 1.0
        for node in tree.path(i)[1:]:
            p *= math.exp(float(draft.logprobs[int(tree.depths[node]) - 1, int(tree.tokens[node])]))
        direct += p
    assert math.isclose(expected_acceptance(tree, draft), direct, rel_tol=1e-12)
    assert math.isclose(expected_acceptance(tree, draft), 1 + float(tree.scores[1:].double().exp().sum()),
                        rel_tol=1e-5)
    assert expected_acceptance(DraftTree.root_only(42), draft) == 1.0


def test_a_tree_holding_every_path_accepts_all_depths():
    depth, vocab = 3, 3
    draft = MarginalDrafter.random(depth, vocab, seed=5).draft(CTX)
    tree = DDTree(budget=vocab + vocab**2 + vocab**3).build(draft)
    assert math.isclose(expected_acceptance(tree, draft), 1 + depth, rel_tol=1e-6)  # float32 rows sum to 1 +- ulps


def test_expected_acceptance_matches_simulation_for_a_chain():
    draft = MarginalDrafter.random(4, 5, scale=1.5, seed=3).draft(CTX)
    tree = Chain().build(draft)
    gen = torch.Generator().manual_seed(0)
    samples = torch.multinomial(draft.logprobs.exp(), 40000, replacement=True, generator=gen).T  # [S, L]
    match = (samples == tree.tokens[1:]).long().cumprod(dim=1)
    simulated = 1 + match.sum(1).double().mean()
    assert abs(float(simulated) - expected_acceptance(tree, draft)) < 0.03  # ~6 standard errors


def test_expected_acceptance_uses_tree_scores_for_conditional_drafts_and_checks_inputs():
    draft = toy().draft(CTX)
    tree = DominoTree(budget=10).build(draft)
    assert math.isclose(expected_acceptance(tree, draft), 1 + float(tree.scores[1:].double().exp().sum()))
    marginal = MarginalDrafter.random(2, 30, seed=2).draft(CTX)
    with pytest.raises(ValueError, match="root"):
        expected_acceptance(DraftTree.root_only(7), marginal)
    deep = DraftTree.chain(42, [1, 2, 3])
    with pytest.raises(ValueError, match="exceeds"):
        path_logprobs(deep, marginal)


def test_pure_prefix_zero_and_combinations_build_valid_trees():
    for prefix, quantum in itertools.product([0, 3], [None, 2.0]):
        draft = toy(pure_draft_prefix_len=prefix, quantum=quantum).draft(CTX)
        tree = DominoTree(budget=30, top_m=6, node_topk=3).build(draft)
        DraftTree(tree.tokens, tree.parents, tree.depths, tree.scores)
        assert tree.budget == 30
