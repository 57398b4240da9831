"""Cost models and the cost-aware stop rule.

* CaDDTree keeps exactly the brute-force argmax over n of θ(n) = (1 + Σ_{j<=n} exp(s_j)) /
  (C_d + C_v(n + 1; ctx)) along DDTree's order, or the root-only tree when that θ does not beat
  AR's 1 / C_v(1), for linear and for fitted convex cost models; ``convention="published"``
  builds the tree of an independent implementation of CaDDTree's released builder.
* The convex fit is the exact least-squares monotone convex fit (checked against an enumeration of
  active sets), reproduces convex data, interpolates between profiled context lengths, and
  survives a JSON round trip; malformed cost files are refused with the file and field named.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treespec.drafters.toy import MarginalDrafter, ToyConditionalDrafter
from treespec.interfaces import DraftContext
from treespec.policies.caddtree import CaDDTree
from treespec.policies.ddtree import DDTree
from treespec.policies.dominotree import DominoTree
from treespec.policies.engine.cost import CostAwareStop
from treespec.pricing.calibration import Calibration
from treespec.pricing.cost import COST_PRESETS, ConvexCost, LinearCost, fit_convex_curve, load_cost_model

SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


def draft_at(position: int, depth: int, vocab: int, seed: int, scale: float, quantum: float | None = None):
    ctx = DraftContext(sequence=torch.full((position + 1,), 5), features=None)
    return MarginalDrafter.random(depth, vocab, scale=scale, quantum=quantum, seed=seed).draft(ctx)


def brute_force_best_size(scores: list[float], cost, ctx: int) -> tuple[int, bool]:
    """(size, paid): argmax over n = 0..len(scores) of θ(n), the first maximiser, when it beats AR
    (paid); otherwise the first argmax of the gain over an AR step for the verify alone,
    Φ(n) - (C_v(n + 1) / C_v(1) - 1), or 0 when no n gains.  Every value computed from scratch."""
    deltas = [float(torch.tensor(s, dtype=torch.float64).exp()) for s in scores]

    def verify(n: int) -> float:
        return float(cost.verify_cost(torch.tensor(float(n)), ctx))

    best_n, best_theta, best_gain, gain_n = 0, -math.inf, 0.0, 0
    for n in range(len(scores) + 1):
        phi = 0.0
        for delta in deltas[:n]:
            phi += delta
        theta = (1.0 + phi) / (cost.draft_cost + verify(n + 1))
        if theta > best_theta:
            best_n, best_theta = n, theta
        gain = phi - (verify(n + 1) / verify(1) - 1.0)
        if gain > best_gain:
            gain_n, best_gain = n, gain
    if best_theta > 1.0 / verify(1):
        return best_n, True
    return gain_n, False


def convex_samples(rng: np.random.Generator, contexts: list[int]) -> list[tuple[float, int, float]]:
    """Noisy latencies of a convex, increasing verify cost that also grows with the context."""
    samples = []
    for ctx in contexts:
        base, lin, quad = rng.uniform(0.01, 0.03), rng.uniform(1e-5, 1e-3), rng.uniform(0, 2e-5)
        for n in (1, 2, 4, 8, 16, 32, 64, 128):
            for _ in range(3):
                clean = base + lin * n + quad * n * n + 2e-6 * ctx
                samples.append((n, ctx, clean * rng.uniform(0.97, 1.03)))
    return samples


@st.composite
def cost_models(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    draft = float(rng.uniform(0.001, 0.02))
    if draw(st.booleans()):
        return LinearCost(draft=draft, base=float(rng.uniform(0.01, 0.05)),
                          per_token=float(rng.uniform(1e-5, 3e-3)), per_context=float(rng.uniform(0, 1e-5)))
    return ConvexCost.fit(convex_samples(rng, [128, 512, 2048]), draft=draft)


@settings(max_examples=150, **SETTINGS)
@given(cost_models(), st.integers(1, 16), st.sampled_from([5, 50, 1000]), st.integers(1, 300),
       st.sampled_from([0.5, 2.0, 5.0]), st.sampled_from([None, 1.0]), st.integers(0, 4000), st.integers(0, 2**31))
def test_caddtree_stops_at_the_brute_force_argmax(cost, depth, vocab, budget, scale, quantum, position, seed):
    draft = draft_at(position, depth, vocab, seed, scale, quantum)
    order = DDTree(budget=budget).with_backend("networkx").build(draft)
    expected, _ = brute_force_best_size(order.scores[1:].tolist(), cost, position)
    policy = CaDDTree(budget=budget, cost_model=cost)
    for tree in (policy.build(draft), policy.with_backend("networkx").build(draft)):
        assert tree.budget == expected
        assert tree.equal(DDTree(budget=max(expected, 1)).build(draft)) or expected == 0


def test_stop_rule_reaches_interior_optima():
    """The property above is not vacuous: optima strictly inside (0, B) occur."""
    cost = COST_PRESETS["smollm2-cpu-bf16"]
    sizes = {CaDDTree(budget=256, cost_model=cost).build(draft_at(300, 16, 200, seed, 4.0)).budget
             for seed in range(12)}
    assert any(0 < s < 256 for s in sizes), sizes


def test_cost_aware_policies_choose_the_root_only_tree_when_no_tree_pays():
    """A machine where one extra verified token costs as much as an AR step: no tree beats AR."""
    cost = LinearCost(draft=0.01, base=0.0, per_token=0.07)
    draft = draft_at(300, 8, 200, 0, 4.0)
    for backend in ("torch", "networkx"):
        assert len(CaDDTree(budget=64, cost_model=cost).with_backend(backend).build(draft)) == 1
    cheap = LinearCost(draft=0.001, base=0.07, per_token=1e-4)  # a GPU-like curve: trees pay
    assert len(CaDDTree(budget=64, cost_model=cheap).build(draft)) > 1


def test_a_spent_draft_is_still_verified_when_a_tree_gains_over_an_ar_step():
    """A drafter dearer than the trees it makes are worth: no tree pays for its draft, but once the
    draft is made a cheap verify still gains, so the tree is kept (whether the next rounds draft is the
    controller's, which counts what such rounds yield)."""
    draft = draft_at(300, 8, 200, 0, 4.0)
    dear = LinearCost(draft=1.0, base=0.07, per_token=1e-4)
    for policy in (CaDDTree(budget=64, cost_model=dear),
                   CaDDTree(budget=64, cost_model=dear, convention="published")):
        assert len(policy.build(draft)) > 1


def published_caddtree_sizes(logprobs: torch.Tensor, cost, ctx: int, max_budget: int) -> list[tuple]:
    """An independent heap implementation of CaDDTree's released builder: (rank path) of every node.

    theta_prev = 1 / (C_d + C_v(0)); pop the best (score, path); stop when
    (1 + phi + delta) / (C_d + C_v(count + 1)) <= theta_prev; push the next sibling and first child.
    """
    import heapq

    top = torch.sort(logprobs.float(), dim=-1, descending=True, stable=True).values.tolist()  # [L, V]
    costs = cost.verify_costs(max_budget + 1, ctx).tolist()
    heap, nodes, phi = [(-top[0][0], (0,))], [], 0.0
    theta_prev = 1.0 / (cost.draft_cost + costs[0])
    while heap and len(nodes) < max_budget:
        neg, path = heapq.heappop(heap)
        theta = (1.0 + phi + math.exp(-neg)) / (cost.draft_cost + costs[len(nodes) + 1])
        if theta <= theta_prev:
            break
        nodes.append(path)
        phi, theta_prev = phi + math.exp(-neg), theta
        depth, rank = len(path), path[-1]
        if rank + 1 < len(top[depth - 1]):
            heapq.heappush(heap, (neg + top[depth - 1][rank] - top[depth - 1][rank + 1], path[:-1] + (rank + 1,)))
        if depth < len(top):
            heapq.heappush(heap, (neg - top[depth][0], path + (0,)))
    return nodes


@settings(max_examples=60, **SETTINGS)
@given(cost_models(), st.integers(1, 8), st.integers(1, 120), st.integers(0, 3000), st.integers(0, 2**31))
def test_published_convention_builds_the_released_tree(cost, depth, budget, position, seed):
    draft = draft_at(position, depth, 50, seed, 3.0)  # continuous scores: no ties between paths
    expected = published_caddtree_sizes(draft.logprobs.double(), cost, position, budget)
    for backend in ("torch", "networkx"):
        tree = CaDDTree(budget=budget, cost_model=cost, convention="published").with_backend(backend).build(draft)
        assert list(tree.rank_paths[1:]) == expected


def test_cost_aware_stop_composes_with_dominotree():
    draft = ToyConditionalDrafter(seed=3, vocab_size=60, depth=8, logit_scale=4.0).draft(
        DraftContext(sequence=torch.full((301,), 2), features=None))
    cost = LinearCost(draft=0.005, base=0.02, per_token=0.002)
    full = DominoTree(budget=64).with_backend("networkx").build(draft)
    tree = DominoTree(budget=64, stop=CostAwareStop(cost)).build(draft)
    expected, paid = brute_force_best_size(full.scores[1:].tolist(), cost, draft.position)
    assert tree.budget == expected and 0 < expected < 64 and paid
    assert tree.equal(DominoTree(budget=64, stop=CostAwareStop(cost)).with_backend("networkx").build(draft))


# ---------------------------------------------------------------------------- the models
def test_linear_cost_values_and_round_trip(tmp_path):
    cost = LinearCost(draft=0.01, base=0.02, per_token=0.001, per_context=1e-6)
    n = torch.tensor([1.0, 10.0])
    assert torch.allclose(cost.verify_cost(n, 1000), torch.tensor([0.022, 0.031], dtype=torch.float64))
    cost.save(tmp_path / "linear.json")
    assert load_cost_model(tmp_path / "linear.json") == cost


@settings(max_examples=100, **SETTINGS)
@given(st.integers(0, 2**31))
def test_convex_fit_is_monotone_and_convex(seed):
    rng = np.random.default_rng(seed)
    points = [(int(n), float(y)) for n, y in zip(rng.integers(1, 200, 40), rng.uniform(0.01, 0.1, 40))]
    knots, values = fit_convex_curve(points)
    slopes = np.diff(values) / np.diff(knots)
    assert (slopes >= 0).all()
    assert (np.diff(slopes) >= -1e-12).all()


def enumerated_convex_fit(points: list[tuple[float, float]]) -> float:
    """Least squares over every non-decreasing convex piecewise-linear function with knots at the
    distinct x, by enumeration: each set of active constraints (slope increments fixed at 0) is an
    unconstrained least-squares problem; the best feasible one is the optimum (KKT, convex QP)."""
    import itertools

    xs = sorted({x for x, _ in points})
    x = np.array([p[0] for p in points])
    y = np.array([p[1] for p in points])
    basis = [np.ones_like(x), x - xs[0]] + [np.maximum(x - k, 0.0) for k in xs[1:-1]]
    best = math.inf
    for free in itertools.product([False, True], repeat=len(basis) - 1):
        cols = [basis[0]] + [b for b, f in zip(basis[1:], free) if f]
        coef = np.linalg.lstsq(np.stack(cols, axis=1), y, rcond=None)[0]
        if (coef[1:] >= -1e-12).all():
            best = min(best, float(((np.stack(cols, axis=1) @ coef - y) ** 2).sum()))
    return best


@settings(max_examples=80, **SETTINGS)
@given(st.integers(0, 2**31))
def test_convex_fit_is_the_exact_least_squares_fit(seed):
    rng = np.random.default_rng(seed)
    sizes = sorted(rng.choice(np.arange(1, 80), size=int(rng.integers(2, 8)), replace=False).tolist())
    points = [(float(n), float(0.03 + 2e-4 * n + rng.normal(0, 4e-3))) for n in sizes for _ in range(rng.integers(1, 4))]
    knots, values = fit_convex_curve(points)
    fitted = dict(zip(knots, values))
    sse = sum((y - fitted[x]) ** 2 for x, y in points)
    assert sse <= enumerated_convex_fit(points) * (1 + 1e-9) + 1e-15
    slopes = np.diff(values) / np.diff(knots)
    assert (slopes >= -1e-12).all() and (np.diff(slopes) >= -1e-9).all()


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "not valid JSON"),
    ('{"kind": "convex", "draft": 0.01}', "needs the field"),
    ('{"kind": "linear", "draft": "fast", "base": 0.1, "per_token": 0.01}', "draft must be a finite number"),
    ('{"kind": "convex", "draft": 0.01, "contexts": [128], "knots": [[1, 2]], "values": [[0.1]]}',
     "2 knots and 1 values"),
    ('{"kind": "convex", "draft": 0.01, "contexts": 128, "knots": [[1]], "values": [[0.1]]}', "must be a list"),
    ("[1, 2]", "expected a JSON object"),
])
def test_malformed_cost_files_name_the_file_and_the_problem(tmp_path, text, message):
    path = tmp_path / "cost.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        load_cost_model(path)
    assert str(path) in str(info.value)
    with pytest.raises(ValueError, match="no cost model file"):
        load_cost_model(tmp_path / "missing.json")


def test_convex_fit_reproduces_convex_data_and_averages_repeats():
    knots = [1, 2, 4, 8, 16, 64]
    truth = [0.02 + 1e-4 * n + 1e-5 * n * n for n in knots]
    fitted_knots, fitted = fit_convex_curve(list(zip(knots, truth)) + list(zip(knots, truth)))
    assert list(fitted_knots) == knots
    assert np.allclose(fitted, truth, rtol=0, atol=1e-12)


def test_convex_fit_repairs_a_non_convex_bump():
    _, values = fit_convex_curve([(1, 1.0), (2, 3.0), (3, 3.5), (4, 6.0)])
    slopes = np.diff(values)
    assert (np.diff(slopes) >= -1e-12).all() and (slopes >= 0).all()
    assert abs(sum(values) - (1.0 + 3.0 + 3.5 + 6.0)) < 1e-9  # least-squares intercept keeps the mean


def test_convex_cost_interpolates_between_contexts_and_clamps_outside(tmp_path):
    cost = ConvexCost.fit([(1, 100, 1.0), (9, 100, 2.0), (1, 300, 3.0), (9, 300, 6.0)], draft=0.5)
    n = torch.tensor([1.0, 5.0, 9.0, 17.0])
    low, high = cost.verify_cost(n, 100), cost.verify_cost(n, 300)
    assert torch.allclose(cost.verify_cost(n, 200), (low + high) / 2)
    assert torch.equal(cost.verify_cost(n, 50), low) and torch.equal(cost.verify_cost(n, 900), high)
    assert high[3] == 6.0 + 3.0  # past the last knot the last slope continues
    cost.save(tmp_path / "convex.json")
    again = load_cost_model(tmp_path / "convex.json")
    assert again == cost and torch.equal(again.verify_costs(40, 250), cost.verify_costs(40, 250))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.sampled_from([64, 128, 512]), st.floats(0.001, 0.2)), min_size=1,
                max_size=30), st.floats(0.0, 80.0), st.integers(0, 900))
def test_verify_seconds_is_verify_cost_at_one_size(samples, n, ctx):
    """The live cost model's scalar path gives the tensor path's value bit for bit, between, at and
    beyond the knots and the profiled contexts; the base class's default asks the tensor path."""
    cost = ConvexCost.fit(samples, draft=0.01)
    assert cost.verify_seconds(n, ctx) == float(cost.verify_cost(torch.tensor([n], dtype=torch.float64), ctx)[0])
    linear = LinearCost(draft=0.01, base=0.02, per_token=0.001, per_context=1e-5)
    assert linear.verify_seconds(n, ctx) == float(linear.verify_cost(torch.tensor([n], dtype=torch.float64), ctx)[0])


def test_bad_cost_inputs_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="per_token"):
        LinearCost(draft=0.01, base=0.01, per_token=-1.0)
    with pytest.raises(ValueError, match="zero samples"):
        ConvexCost.fit([], draft=0.01)
    (tmp_path / "x.json").write_text('{"kind": "quadratic"}')
    with pytest.raises(ValueError, match="unknown cost model kind 'quadratic'"):
        load_cost_model(tmp_path / "x.json")
    with pytest.raises(TypeError, match="cost_model"):
        CaDDTree(cost_model="fast")
    zero = LinearCost(draft=0.0, base=0.0, per_token=0.0)
    with pytest.raises(ValueError, match="> 0"):
        CaDDTree(cost_model=zero).build(draft_at(10, 4, 20, 0, 1.0))


def test_preset_is_convex_and_matches_the_profiled_points():
    cost = COST_PRESETS["smollm2-cpu-bf16"]
    measured = {1: 0.0233, 8: 0.0253, 16: 0.0292, 65: 0.0602}
    for n, seconds in measured.items():
        assert abs(float(cost.verify_cost(torch.tensor(float(n)), 300)) - seconds) < 1e-9


@pytest.mark.parametrize("convention", ["treespec", "published"])
def test_cost_aware_dominotree_is_dominotree_with_the_cost_stop(convention):
    from treespec.policies.cost_aware_dominotree import CostAwareDominoTree

    cost = LinearCost(draft=0.005, base=0.02, per_token=0.002)
    for seed in range(4):
        draft = ToyConditionalDrafter(seed=seed, vocab_size=60, depth=8, logit_scale=4.0).draft(
            DraftContext(sequence=torch.full((301,), 2), features=None))
        composed = DominoTree(budget=64, stop=CostAwareStop(cost, convention))
        policy = CostAwareDominoTree(budget=64, cost_model=cost, convention=convention)
        for backend in ("torch", "networkx"):
            assert policy.with_backend(backend).build(draft).equal(composed.with_backend(backend).build(draft))
    with pytest.raises(ValueError, match="needs the cost model"):
        CostAwareDominoTree().build(draft)
    with pytest.raises(ValueError, match="convention"):
        CostAwareDominoTree(cost_model=cost, convention="paper")


def test_a_calibration_scales_the_promise_and_the_backends_still_agree():
    """κ < 1 (a drafter that promises more than the target accepts) never grows the tree; κ = 1 is the plain rule."""
    cost = LinearCost(draft=0.002, base=0.02, per_token=4e-4)
    sizes = []
    for seed in range(6):
        draft = draft_at(300, 8, 200, seed, 4.0)
        plain = CaDDTree(budget=64, cost_model=cost).build(draft)
        assert plain.equal(CaDDTree(budget=64, cost_model=cost, calibration=1.0).build(draft))
        for kappa in (0.3, 0.7, Calibration(0.7, 1.5)):
            policy = CaDDTree(budget=64, cost_model=cost, calibration=kappa)
            tree = policy.build(draft)
            assert tree.equal(policy.with_backend("networkx").build(draft))
            assert tree.budget <= plain.budget
            sizes.append((plain.budget, tree.budget))
    assert any(small < big for big, small in sizes)  # the calibration changed some decisions
    with pytest.raises(ValueError, match="calibration must be a finite number > 0"):
        CaDDTree(cost_model=cost, calibration=0.0)


def test_a_power_below_one_lifts_the_small_promises_and_the_backends_still_agree():
    """β < 1 raises every promise below 1 (κ = 1), so the rule never keeps fewer nodes; the trees of both
    backends agree, and the verdict on the draft is read with the same calibration."""
    cost = LinearCost(draft=0.01, base=0.02, per_token=1e-3)
    grew = 0
    for seed in range(6):
        draft = draft_at(300, 8, 200, seed, 2.0)
        plain = CaDDTree(budget=64, cost_model=cost).build(draft)
        policy = CaDDTree(budget=64, cost_model=cost, calibration=Calibration(1.0, 0.6))
        tree = policy.build(draft)
        assert tree.equal(policy.with_backend("networkx").build(draft))
        assert tree.budget >= plain.budget
        grew += tree.budget > plain.budget
        lifted = Calibration(1.0, 0.6).deltas(tree.scores[1:])
        assert bool((lifted >= tree.scores[1:].double().exp()).all())
    assert grew > 0


def test_the_controller_leaves_drafting_that_yields_less_than_ar_steps():
    """With a drafter dearer than its trees are worth (a 16-node tree pays only if nearly all of it is
    accepted), each drafted round still verifies a tree (the draft is made), and once the drafted rounds'
    yield is below 1 beyond doubt the rounds are AR steps, the taps dropped; with a cheap drafter every
    round drafts."""
    from test_target import hf_greedy, tiny_target

    from treespec.decoding import SpeculativeDecoder
    from treespec.drafters.oracle import ORACLE_PRESETS, OracleDrafter

    target = tiny_target("qwen3")
    drafter = OracleDrafter(ORACLE_PRESETS["typical"], tap_layers=(0, 2))
    prompt = torch.tensor([5, 9, 2, 7])
    for draft_cost, pays in ((0.3, False), (0.001, True)):
        policy = CaDDTree(budget=16, cost_model=LinearCost(draft=draft_cost, base=0.05, per_token=1e-4))
        decoder = SpeculativeDecoder(target, drafter, policy)
        out = decoder.generate(prompt, max_new_tokens=40)
        assert out.tokens.tolist() == hf_greedy(target.model, prompt, 40)
        rounds = out.stats.rounds[:-3]  # the last ones are cut to what is left
        drafted = [i for i, r in enumerate(rounds) if r.drafted]
        assert all(rounds[i].tree_size > 1 for i in drafted)  # a made draft is verified when a tree gains
        if pays:
            assert len(drafted) == len(rounds) and decoder.controller.trees_lead
        else:
            assert drafted == list(range(len(drafted))) and 2 <= len(drafted) <= 6  # the first rounds only
            assert not decoder.controller.trees_lead and not decoder.controller.start_generation()


def test_where_no_tree_could_pay_the_decoder_does_not_draft_at_all():
    """A drafter dearer than the most a tree could save (20 AR steps for a 16-node tree that commits 17
    tokens at best): the generation runs as AR steps with no draft and no taps, says so, and is the
    target's greedy output; a policy that can pay drafts as before."""
    from test_target import hf_greedy, tiny_target

    from treespec.decoding import SpeculativeDecoder
    from treespec.drafters.oracle import ORACLE_PRESETS, OracleDrafter
    from treespec.pricing.control import best_case_yield

    target = tiny_target("qwen3")
    prompt = torch.tensor([5, 9, 2, 7])
    dear = LinearCost(draft=1.0, base=0.05, per_token=1e-4)
    compute_bound = LinearCost(draft=0.01, base=0.0, per_token=0.05)  # n tokens cost n steps: never pays
    assert all(best_case_yield(cost, 16, ctx) <= 1 for cost in (dear, compute_bound) for ctx in (0, 512, 4096))
    assert best_case_yield(LinearCost(draft=0.3, base=0.05, per_token=1e-4), 16, 0) > 1
    for cost in (dear, compute_bound):
        drafter = OracleDrafter(ORACLE_PRESETS["typical"], tap_layers=(0, 2))
        calls = []
        drafter.draft = lambda ctx, calls=calls: calls.append(ctx)  # never asked
        policy = CaDDTree(budget=16, cost_model=cost)
        assert not policy.draft_controller().start_generation()
        out = SpeculativeDecoder(target, drafter, policy).generate(prompt, max_new_tokens=24)
        assert out.tokens.tolist() == hf_greedy(target.model, prompt, 24)
        assert out.stats.undrafted and not calls and all(r.tree_size == 1 and not r.drafted for r in out.stats.rounds)
    published = CaDDTree(budget=16, cost_model=dear, convention="published")
    assert published.draft_controller().start_generation()  # the released rule never compares with AR: it drafts
