"""The live cost model: converging to injected round times, following a step change, and pricing a
cost-aware policy's controller between full trees and AR steps on a fake clock."""

from __future__ import annotations

import math
import random

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_target import hf_greedy, tiny_target

from treespec import registry
from treespec.decoding import SpeculativeDecoder
from treespec.drafters.oracle import ORACLE_PRESETS, OracleConfig, OracleDrafter
from treespec.pricing.calibration import Calibration, LiveCalibration, LiveCalibrationSettings
from treespec.pricing.control import ControlSettings
from treespec.pricing.cost import ConvexCost, LinearCost
from treespec.pricing.live_cost import LiveCost, LiveSettings, Observation, ordinary, shifted, trimmed_mean

SIZES, CONTEXTS = (1, 2, 3, 5, 9, 17, 33), (128, 512)


def profile(step: float = 0.05, per_token: float = 0.001, draft: float = 0.01) -> ConvexCost:
    """A profiled curve: a one-token step and trees growing linearly, the same at both contexts."""
    return ConvexCost.fit([(n, c, step + per_token * n) for n in SIZES for c in CONTEXTS], draft=draft)


def at(model, n: int, ctx: int = 300) -> float:
    return float(model.verify_cost(torch.tensor([float(n)]), ctx)[0])


def test_the_estimate_converges_to_the_injected_curve():
    prior = profile()
    truth = lambda n: 0.05 if n == 1 else 0.08 + 0.002 * n  # noqa: E731  trees 1.6x the AR step, steeper
    live = LiveCost(prior)
    for i in range(64):
        n = SIZES[i % len(SIZES)]
        live.observe(n, 300, truth(n), 0.02 if n > 1 else None)
    for n in SIZES:
        assert at(live, n) == pytest.approx(truth(n), rel=0.12), n  # within the prior's pull (2 of 18)
    assert live.draft_cost == pytest.approx(0.02, rel=0.1)
    assert abs(at(live, 17) - truth(17)) < 0.2 * abs(at(prior, 17) - truth(17))
    assert sum(live.support().values()) == 64 and live.support()[17] == 64 // len(SIZES) + (1 if 64 % 7 > 5 else 0)


def test_an_unobserved_size_borrows_the_observed_sizes_correction_by_what_each_rests_on():
    """Sixteen rounds of 5-token trees at 1.2 times the profile and two of 9 at 1.4: a 17-token
    verify, never observed, is priced at their mean weighed by rounds (1.22), not at the 1.4 of the
    nearest bucket, seen twice; and the bucket seen twice is itself shrunk toward that pooled value
    by ``pool_weight`` rounds' worth of it."""
    prior, s = profile(), LiveSettings(refit_every=1)
    live = LiveCost(prior, s)
    for n, ratio, rounds in ((5, 1.2, 16), (9, 1.4, 2)):
        for _ in range(rounds):
            live.observe(n, 300, ratio * at(prior, n), 0.02)
    assert live.support().get(17, 0) == 0
    pooled = (16 * 1.2 + 2 * 1.4) / 18
    assert at(live, 17) / at(prior, 17) == pytest.approx(pooled, rel=0.02)
    shrunk = (2 * 1.4 + s.pool_weight * pooled) / (2 + s.pool_weight)
    prior_weight = s.prior_weight * (1 - 2 / s.window)  # a bucket seen twice keeps some prior
    assert at(live, 9) / at(prior, 9) == pytest.approx((prior_weight + 2 * shrunk) / (prior_weight + 2), rel=0.02)
    unpooled = LiveCost(prior, attrs.evolve(s, pool_weight=0))
    for obs in live.observations:
        unpooled.observe(obs.n, obs.ctx, obs.verify, obs.draft)
    assert at(unpooled, 9) / at(prior, 9) == pytest.approx((prior_weight + 2 * 1.4) / (prior_weight + 2), rel=0.02)


def test_one_descheduled_round_does_not_move_the_estimate():
    live = LiveCost(profile())
    for _ in range(LiveSettings().window):  # a full window: the prior no longer counts
        live.observe(17, 300, 0.1, 0.02)
    before = at(live, 17)
    assert before == pytest.approx(0.1)
    live.observe(17, 300, 5.0, 0.02)  # a round the guest was descheduled in
    for _ in range(7):
        live.observe(17, 300, 0.1, 0.02)
    assert at(live, 17) == pytest.approx(before, rel=0.02)


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_a_step_change_is_followed_within_the_drift_rounds_plus_the_window_median(factor):
    s = LiveSettings()
    live = LiveCost(profile(), s)
    for _ in range(20):
        live.observe(17, 300, 0.1, 0.02)
    rounds = 0
    while abs(math.log(at(live, 17) / (0.1 * factor))) > 0.15:
        live.observe(17, 300, 0.1 * factor, 0.02)
        rounds += 1
        assert rounds <= s.window // 2 + s.drift_rounds + 1, "the estimate did not follow the step change"


def test_the_one_token_step_and_trees_are_corrected_apart():
    """A CPU runs one token through another kernel: once trees are observed, an AR step's correction
    does not reach them (before that, a slower AR step is taken as a slower machine)."""
    live = LiveCost(profile())
    for _ in range(24):  # a full window, then a re-fit
        live.observe(1, 300, 0.1)  # AR steps twice the profile's
    assert at(live, 1) == pytest.approx(0.1, rel=1e-6)  # the prior no longer counts
    assert at(live, 17) == pytest.approx(at(profile(), 17) * 0.1 / 0.051, rel=1e-6)
    for _ in range(24):
        live.observe(17, 300, 3 * at(profile(), 17))  # trees three times the profile's
    assert at(live, 1) == pytest.approx(0.1, rel=1e-6)
    assert at(live, 9) == pytest.approx(3 * at(profile(), 9), rel=1e-6)  # the trees' own correction


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(SIZES), st.integers(0, 900), st.floats(0.01, 1.0),
                          st.one_of(st.none(), st.floats(0.0, 0.2))), min_size=1, max_size=40))
def test_the_model_is_rebuilt_from_its_observations_and_prices_every_tree(rows):
    """Restored from its observations it is the same model, and every tree size at every context has a
    finite positive price (the curve keeps each size's own value, so it need not be monotone)."""
    live = LiveCost(profile())
    for n, ctx, verify, draft in rows:
        live.observe(n, ctx, verify, draft)
    again = LiveCost.restore(profile(), [o.to_list() for o in live.observations])
    assert again.to_dict() == live.to_dict() and again.support() == live.support()
    for ctx in (0, 128, 300, 512, 2000):
        costs = live.verify_costs(40, ctx)[1:]
        assert bool(torch.isfinite(costs).all()) and bool((costs > 0).all())


def test_a_prior_measured_at_every_size_keeps_its_slow_sizes():
    """A prior whose 3-token forward is dearer than its 4-token one (a CPU kernel's choice) keeps that
    shape when rounds confirm it, and a uniform slowdown scales it rather than smoothing it away."""
    measured = {1: 0.022, 2: 0.030, 3: 0.036, 4: 0.028, 5: 0.029, 8: 0.029, 17: 0.034}
    prior = ConvexCost(0.003, (128,), (tuple(float(n) for n in measured),), (tuple(measured.values()),))
    live = LiveCost(prior)
    for _ in range(40):
        for n in (3, 4, 17):
            live.observe(n, 128, 1.5 * measured[n], 0.004)
    assert at(live, 3, 128) > at(live, 4, 128)
    assert at(live, 4, 128) == pytest.approx(1.5 * measured[4], rel=1e-6)


def test_bad_observations_and_a_non_convex_prior():
    live = LiveCost(LinearCost(0.01, 0.05, 0.001))
    assert live.contexts == CONTEXTS and at(live, 9) == pytest.approx(0.059)
    with pytest.raises(ValueError, match="cannot be observed"):
        live.observe(0, 10, 0.1)
    with pytest.raises(ValueError, match="cannot be observed"):
        live.observe(3, 10, float("nan"))
    assert Observation.from_list([3, 10, 0.1, None, True]) == Observation(3, 10, 0.1, None, True)


# --- the loop feeds it: a cost-aware policy on a fake clock ------------------------------------------------

class FakeClock:
    """Seconds that pass only when the target verifies or the drafter drafts, as the test says."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def clocked(target, drafter, clock: FakeClock, verify_cost):
    """Make the target's tree forward take ``verify_cost(n)`` and a draft 10 ms of the fake clock."""
    forward, draft = target.forward_tree, drafter.draft

    def timed_forward(tree, *args, **kwargs):
        clock.now += verify_cost(len(tree))
        return forward(tree, *args, **kwargs)

    def timed_draft(ctx):
        clock.now += 0.01
        return draft(ctx)

    target.forward_tree, drafter.draft = timed_forward, timed_draft


def test_a_cost_aware_policy_follows_the_machine_from_full_trees_to_ar_and_back():
    target = tiny_target("qwen3")
    drafter = OracleDrafter(ORACLE_PRESETS["typical"], tap_layers=(0, 2))
    clock, phase = FakeClock(), {"verify": "cheap"}
    costs = {"cheap": lambda n: 0.05 + 0.0005 * n, "dear": lambda n: 0.05 if n == 1 else 0.4}
    clocked(target, drafter, clock, lambda n: costs[phase["verify"]](n))
    # only the trees' price moves here (a real load slows the AR steps too); the controller forgets drafted
    # rounds after 24 rounds and may spend a fifth of the time exploring, so the way back is short
    live = LiveCost(profile(step=0.05, per_token=0.0005))
    policy = registry.create("policy", "caddtree", budget=16, cost_model=live)
    decoder = SpeculativeDecoder(target, drafter, policy, clock=clock)
    decoder.controller.settings = ControlSettings(forget_after=24, explore_share=0.2)
    assert decoder.controller.decide().price is live.snapshot()  # the round is priced at the live curve
    prompt = torch.tensor([5, 9, 2, 7])

    def rounds(new_tokens: int) -> list[tuple[int, bool, bool]]:
        out = decoder.generate(prompt, max_new_tokens=new_tokens)
        assert out.tokens.tolist() == hf_greedy(target.model, prompt, new_tokens)  # lossless whatever it prices
        return [(r.tree_size, r.drafted, r.explored) for r in out.stats.rounds][:-4]  # the last: cut to what is left

    cheap = rounds(60)
    assert all(n >= 9 and drafted for n, drafted, explored in cheap if not explored)  # trees pay: large ones
    phase["verify"] = "dear"
    dear = rounds(120)
    switched = next(i for i, (n, _, _) in enumerate(dear) if n == 1)
    assert switched <= LiveSettings().drift_rounds  # root-only trees or AR steps within the drift rounds
    late = dear[len(dear) // 2:]
    assert sum(not drafted for _, drafted, _ in late) > 0.8 * len(late)  # then AR steps, drafting left
    assert at(live, 17) == pytest.approx(0.4, rel=0.15)
    phase["verify"] = "cheap"
    back = rounds(160)
    again = next(i for i, (n, drafted, explored) in enumerate(back) if drafted and n >= 9 and not explored)
    assert again <= 60  # once the dear rounds are forgotten, an exploration finds trees cheap again
    assert all(drafted for _, drafted, explored in back[again:] if not explored)  # and trees lead


def test_a_live_calibration_stops_trusting_a_drafter_the_target_does_not_follow():
    """A drafter that looks as sure as a good one and is rarely right (top-1 one time in ten): priced by
    its own promises, trees of 8 and 9 nodes seem to pay every round it drafts; calibrated live, the
    policy learns within a few hundred nodes that they do not and builds smaller trees, and its
    controller drafts less.  The output is the target's either way."""
    prompt, new_tokens = torch.tensor([5, 9, 2, 7]), 90
    results = {}
    for name in ("as drafted", "live"):
        target = tiny_target("qwen3")
        drafter = OracleDrafter(OracleConfig(top1=0.1, near=0.1), tap_layers=(0, 2))
        clock = FakeClock()
        clocked(target, drafter, clock, lambda n: 0.05 + 0.0005 * n)
        calibration = LiveCalibration(settings=LiveCalibrationSettings(min_nodes=64, refit_every=2))
        policy = registry.create("policy", "caddtree", budget=16, cost_model=profile(step=0.05, per_token=0.0005),
                                 **({"calibration": calibration} if name == "live" else {}))
        decoder = SpeculativeDecoder(target, drafter, policy, clock=clock)
        assert (decoder.controller.decide().calibration is calibration.current) == (name == "live")
        out = decoder.generate(prompt, max_new_tokens=new_tokens)
        assert out.tokens.tolist() == hf_greedy(target.model, prompt, new_tokens)
        results[name] = out.stats.rounds
    drafted = [r for r in results["as drafted"][:-8] if r.drafted]  # the controller counts the tokens either way
    assert len(drafted) >= 4 and all(r.tree_size >= 8 and r.calibrated_with is None for r in drafted)
    late = results["live"][len(results["live"]) // 2:]
    assert sum(not r.drafted for r in late) > len(late) // 2  # the controller drafts less ...
    assert max(r.tree_size for r in late) < 9  # ... and what is drafted builds smaller trees
    drafted = [r.calibrated_with for r in results["live"] if r.drafted]
    assert drafted[0] == Calibration()  # the prior first, then what was learned: a third of the promise or less
    assert float(drafted[-1].deltas(torch.tensor([-0.5]))[0]) < math.exp(-0.5) / 3


def test_a_change_of_regime_seen_on_trees_rescales_the_ar_step_until_it_is_observed():
    """A busy machine slows AR steps and trees alike: trees that get 2.5x dearer take the AR step with them."""
    live = LiveCost(profile())
    for _ in range(12):
        live.observe(1, 300, 0.05)
        live.observe(17, 300, 0.1, 0.02)
    assert at(live, 1) == pytest.approx(0.05, rel=0.05)
    for _ in range(LiveSettings().drift_rounds):
        live.observe(17, 300, 0.25, 0.02)  # a hog on the other core: trees only are observed
    assert at(live, 17) == pytest.approx(0.25, rel=0.05)
    assert at(live, 1) == pytest.approx(0.125, rel=0.1)  # the AR step scaled by about the same 2.5 ...
    assert live.step_unmeasured  # ... until a round of it measures it (the draft controller asks for one)
    live.observe(1, 300, 0.05)  # the AR step was not slower after all (only trees were)
    assert not live.step_unmeasured
    for _ in range(8):
        live.observe(17, 300, 0.25, 0.02)
    assert at(live, 1) == pytest.approx(0.05, rel=0.05)  # its own measurement, not the scaled estimate


def test_a_persistent_tail_counts_as_throughput_pays_it_while_outliers_do_not():
    """A busy machine: one AR step in four takes three times as long.  The estimate follows the
    tail (a median would ignore it) and lies nearer the mean a run pays than the typical round."""
    live = LiveCost(profile(step=0.05))
    for i in range(64):
        live.observe(1, 300, 0.15 if i % 4 == 0 else 0.05)
    mean = 0.075
    assert abs(at(live, 1) - mean) < abs(0.05 - mean) / 2
    assert trimmed_mean([1.0] * 14 + [40.0, 0.001]) == 1.0  # one stall and one glitch: left out
    assert trimmed_mean([2.0, 3.0]) == 2.5 and trimmed_mean([1.0, 9.0, 2.0]) == 2.0
    with pytest.raises(ValueError, match="no values"):
        trimmed_mean([])


def busy(rng: random.Random, seconds: float, share: float = 0.3, slow: float = 3.5) -> float:
    """A round on a busy machine: ``share`` of the rounds ``slow`` times longer, all with 10 % noise."""
    return seconds * (slow if rng.random() < share else 1.0) * math.exp(rng.gauss(0.0, 0.1))


@pytest.mark.parametrize("seed", range(4))
def test_a_busy_machines_tail_is_not_a_change_of_regime(seed):
    """Three slow rounds in a row come every 37 rounds on such a machine: they are the machine's
    ordinary range, not a new speed, and the curve is not rebuilt from them, so a 17-token verify's
    price in AR steps stays near the true ratio of the mean rounds (1.6)."""
    rng, live = random.Random(seed), LiveCost(profile())
    changes, prices = 0, []
    for i in range(400):
        n = 1 if i % 2 else 17
        changes += live.observe(n, 300, busy(rng, 0.05 if n == 1 else 0.08), None if n == 1 else 0.01)
        if i >= 100:
            prices.append(at(live, 17) / at(live, 1))
    assert changes <= 1  # the first slow rounds ever seen may look like one; the rule it replaced: 50-60
    assert 0.45 * 1.6 < min(prices) and max(prices) < 2.0 * 1.6


@pytest.mark.parametrize("into_busy", [True, False])
def test_a_change_between_a_quiet_and_a_busy_machine_is_seen_within_the_drift_rounds(into_busy):
    """Quiet to busy: the busy machine's rounds are all slower than the quiet ones' range.  Busy to
    quiet: the quiet rounds are all faster than the busy machine's fast ones (noise does not make a
    round faster)."""
    rng, s = random.Random(1), LiveSettings()
    live = LiveCost(profile(), s)
    quiet = lambda: 0.1 * math.exp(rng.gauss(0.0, 0.03))  # noqa: E731
    hogged = lambda: busy(rng, 0.2)  # noqa: E731  every round twice as long, 30 % of them 7 times
    first, then = (quiet, hogged) if into_busy else (hogged, quiet)
    for _ in range(48):
        live.observe(17, 300, first(), 0.01)
    seen = next((i for i in range(s.drift_rounds) if live.observe(17, 300, then(), 0.01)), None)
    assert seen == s.drift_rounds - 1


def test_ordinary_range_and_the_shift_rule():
    assert ordinary([]) == (0.0, 0.0) and ordinary([0.3]) == (0.3, 0.3)
    assert ordinary([float(i) for i in range(11)]) == pytest.approx((1.0, 9.0))
    earlier = [0.0, 1.2] * 6  # a busy machine: half the rounds 1.2 slower in log
    assert not shifted(earlier + [1.3, 1.3, 1.3], 3, 0.2, 8)  # within its range: not a change
    assert shifted(earlier + [1.5, 1.5, 1.5], 3, 0.2, 8)  # slower than its slow rounds by more than 0.2
    assert shifted(earlier + [-0.3, -0.3, -0.3], 3, 0.2, 8) and not shifted(earlier + [-0.3, 0.0, -0.3], 3, 0.2, 8)
    assert not shifted([0.0] * 7 + [1.0] * 3, 3, 0.2, 8)  # too few earlier rounds to judge against


def test_a_scaled_kind_that_its_rounds_confirm_is_not_a_change_of_regime_again():
    """Trees get 2.5x dearer and the AR step is scaled with them; AR steps that then run at the
    scaled speed are the new regime, already priced, not another change."""
    rng, s = random.Random(2), LiveSettings()
    live = LiveCost(profile(), s)
    noisy = lambda seconds: seconds * math.exp(rng.gauss(0.0, 0.03))  # noqa: E731
    for _ in range(12):
        live.observe(1, 300, noisy(0.05))
        live.observe(17, 300, noisy(0.1), 0.02)
    assert any(live.observe(17, 300, noisy(0.25), 0.02) for _ in range(s.drift_rounds))
    assert live.step_unmeasured
    assert not any(live.observe(1, 300, noisy(0.125)) for _ in range(3 * s.drift_rounds))
    assert at(live, 1) == pytest.approx(0.125, rel=0.1) and at(live, 17) == pytest.approx(0.25, rel=0.1)
