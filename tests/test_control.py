"""The draft controller on recorded rounds and curves (treespec.apps.replay.simulate): the guarantees its
module docstring states, on a deterministic clock, with no model run."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import by_default

from treespec.apps.replay.simulate import (
    Regime,
    fixed_rate,
    recorded_calibration,
    recorded_rounds,
    regimes,
    simulate,
    summary,
)
from treespec.interfaces import Decision, DraftController, EveryRound
from treespec.pricing.control import ControlSettings, PricedController, best_case_yield
from treespec.pricing.cost import ConvexCost
from treespec.pricing.live_cost import LiveCost

REGIMES = regimes()
QUIET = ("torch-bf16", "llama.cpp-q4_1", "torch-bf16-icelake")


def controller(regime: Regime, settings: ControlSettings | None = None) -> PricedController:
    return PricedController(LiveCost(regime.prior), recorded_calibration(), 16, settings=settings)


def best_fixed(regime: Regime, seed: int = 0) -> tuple[str, float]:
    rates = {c: fixed_rate(regime, c, seed=seed) for c in ("ar", "full", "priced")}
    return max(rates.items(), key=lambda kv: kv[1])


def test_the_recorded_data_is_what_the_simulator_says():
    rounds = recorded_rounds()
    assert len(rounds) >= 150 and all(1 <= len(r.scores) <= 16 for r in rounds)
    assert sum(len(r.scores) == 16 for r in rounds) >= 0.9 * len(rounds)  # the last rounds are cut to what is left
    assert all(list(r.scores) == sorted(r.scores, reverse=True) for r in rounds)  # pop order: best first
    assert all(r.tau(0) == 1 and r.tau(16) == 1 + len(r.accepted) and max(r.accepted, default=0) <= len(r.scores)
               for r in rounds)
    assert set(REGIMES) >= {"torch-bf16", "llama.cpp-q4_1", "halving", "busy"}
    # the regimes are what their names say: trees pay on the memory-bound curve, no tree on the others
    assert fixed_rate(REGIMES["torch-bf16"], "priced") > 1.2 * fixed_rate(REGIMES["torch-bf16"], "ar")
    for name in ("llama.cpp-q4_1", "torch-bf16-icelake"):
        assert fixed_rate(REGIMES[name], "priced") < fixed_rate(REGIMES[name], "ar")


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(st.sampled_from(QUIET), st.integers(0, 10**6), st.sampled_from([0.01, 0.02, 0.05]))
def test_exploring_rounds_lose_at_most_the_stated_share_of_the_time(name, seed, share):
    """Measured on the true clock: the exploring rounds' seconds less what the best option would have
    taken for their tokens stay within ``explore_share`` of all the seconds, plus one round's worth."""
    regime = REGIMES[name]
    rounds = simulate(controller(regime, ControlSettings(explore_share=share)), regime, seed=seed)
    _, best = best_fixed(regime, seed)
    lead = max(1.0, best / fixed_rate(regime, "ar", seed=seed))  # the best option's yield in AR steps
    lost = sum(r.seconds - r.tau * r.step / lead for r in rounds if r.explored)
    total = sum(r.seconds for r in rounds)
    assert lost <= share * total + max(r.seconds for r in rounds)


@pytest.mark.parametrize("name", QUIET)
@pytest.mark.parametrize("seed", by_default(range(3), 0))
def test_on_a_stable_machine_it_converges_to_the_best_option(name, seed):
    """The second half of the run goes to the best fixed option: within 2 % of its speed."""
    regime = REGIMES[name]
    rounds = simulate(controller(regime), regime, seed=seed)
    late = summary(rounds[len(rounds) // 2:])
    choice, _ = best_fixed(regime, seed)
    if choice == "ar":
        assert late["drafted"] <= late["explored"] + 1  # nothing drafted but explorations
    else:
        assert late["ar"] <= late["explored"]  # no AR step but explorations
    assert summary(rounds)["rate"] >= 0.97 * best_fixed(regime, seed)[1]


def test_where_no_tree_can_pay_no_round_drafts():
    """A verify of n tokens at n AR steps: B <= 1, so no generation reads taps and no round drafts."""
    steps = ConvexCost(0.002, (128,), ((1.0, 17.0),), ((0.01, 0.17),))
    regime = Regime("compute-bound", steps, steps)
    ctl = controller(regime)
    assert best_case_yield(steps, 16, 128) <= 1.0
    rounds = simulate(ctl, regime)
    assert not any(r.drafted for r in rounds) and not ctl.start_generation()


def test_trees_the_drafters_reach_cannot_pay_for_are_never_explored():
    """On llama.cpp's recorded curve a 16-node tree pays only if more tokens are accepted than the drafter's
    8-deep block holds: told that reach, the controller never explores a full-budget tree (told nothing, every
    node may be accepted, and it does); where no tree within reach pays at all, nothing drafts."""
    regime = REGIMES["llama.cpp-q4_1"]
    curve = regime.prior
    assert best_case_yield(curve, 16, 128, reach=7) < best_case_yield(curve, 16, 128)
    every_round = ControlSettings(quiet_every=1)  # every AR round taught to the live model, as in both arms
    reached, blind = controller(regime, every_round), controller(regime, every_round)
    reached.bind(7)
    assert not any(r.explored and r.size == 17 for r in simulate(reached, regime))
    assert any(r.explored and r.size == 17 for r in simulate(blind, regime))
    short = controller(regime)
    short.bind(1)  # one drafted token: two tokens a round at most
    assert best_case_yield(curve, 16, 128, reach=1) <= 1.0 and not short.start_generation()
    assert not any(r.drafted for r in simulate(short, regime))


def test_a_generation_without_taps_teaches_the_live_model_one_round_in_quiet_every():
    """Rounds of a generation that reads no taps cost the controller a sum, not a re-fit: the live model
    hears one in ``quiet_every`` (the step stays measured), and the rounds all count in the seconds."""
    regime = REGIMES["llama.cpp-q4_1"]
    ctl = controller(regime)
    ctl.bind(1)  # nothing within reach pays: no generation reads taps
    rounds = simulate(ctl, regime, generations=2, tokens=64)
    assert not any(r.tau > 1 for r in rounds) and len(rounds) == 128
    assert len(ctl.live.observations) == 128 // ctl.settings.quiet_every
    assert ctl._rounds == 128


@pytest.mark.parametrize("seed", range(3))
def test_a_uniform_change_of_speed_changes_nothing_it_decides(seed):
    """The machine halves its speed mid-run: trees still pay as much, and it keeps drafting."""
    regime = REGIMES["halving"]
    rounds = simulate(controller(regime), regime, seed=seed)
    done, after = 0, []
    for r in rounds:
        if done >= regime.change_at:
            after.append(r)
        done += r.tau
    assert sum(r.drafted for r in after) >= 0.95 * len(after)


@pytest.mark.parametrize("seed", range(3))
def test_when_trees_stop_paying_it_turns_to_ar_steps(seed):
    """Tree verifies 3x dearer mid-run, the AR step unchanged: trees stop paying, and within the live
    model's drift rounds plus the rounds Y needs to exclude 1 the rounds are AR steps."""
    regime = REGIMES["trees-dearer"]
    ctl = controller(regime)
    rounds = simulate(ctl, regime, seed=seed)
    done, index = 0, None
    for i, r in enumerate(rounds):
        if done >= regime.change_at and index is None:
            index = i
        done += r.tau
    before, after = rounds[:index], rounds[index:]
    assert sum(r.drafted for r in before) >= 0.9 * len(before)
    switched = next(i for i in range(len(after)) if not any(r.drafted and not r.explored for r in after[i:]))
    assert switched <= 40 and not ctl.trees_lead


def test_a_busy_machine_is_never_slower_than_ar_and_mostly_drafts_where_trees_pay():
    """30 % of rounds 3.5x slower hits AR steps as hard as trees: no seed runs below 0.97x AR, and over
    eight seeds drafting keeps most of what the trees pay.  (A seed can lose the trees: the live curve,
    fed few AR steps on such a machine, may price trees dearer than they are.)"""
    regime, speeds = REGIMES["busy"], []
    for seed in range(8):
        rounds = simulate(controller(regime), regime, seed=seed)
        speeds.append(summary(rounds)["rate"] / fixed_rate(regime, "ar", seed=seed))
    assert min(speeds) >= 0.97 and sum(speeds) / len(speeds) >= 1.15


def test_the_controller_is_deterministic_in_what_it_observed():
    regime = REGIMES["busy"]
    assert simulate(controller(regime), regime, seed=5) == simulate(controller(regime), regime, seed=5)


def test_the_published_convention_drafts_every_round_and_the_default_controller_too():
    regime = REGIMES["llama.cpp-q4_1"]
    published = PricedController(LiveCost(regime.prior), recorded_calibration(), 16, versus_ar=False)
    assert all(r.drafted for r in simulate(published, regime, generations=2))
    assert all(r.drafted for r in simulate(EveryRound(), regime, generations=2))
    assert EveryRound().decide() == Decision() or EveryRound().decide().draft


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="budget"):
        PricedController(REGIMES["busy"].prior, None, 0)
    with pytest.raises(ValueError):
        ControlSettings(min_spread=-0.1)
    with pytest.raises(ValueError):
        ControlSettings(explore_share=-0.1)


class _Recording(DraftController):
    """A controller that keeps what it was asked and told (the live run's side of the next test)."""

    def __init__(self, inner: DraftController) -> None:
        self.inner, self.starts, self.decisions, self.reports = inner, [], [], []

    def bind(self, reach):
        self.inner.bind(reach)

    def start_generation(self) -> bool:
        self.starts.append(self.inner.start_generation())
        return self.starts[-1]

    def decide(self) -> Decision:
        self.decisions.append(self.inner.decide())
        return self.decisions[-1]

    def observe_round(self, report) -> None:
        self.reports.append(report)
        self.inner.observe_round(report)


def _decided(decision: Decision) -> tuple:
    price = None if decision.price is None else decision.price.to_dict()
    return decision.draft, decision.taps, decision.explore, price


def test_a_recorded_generation_replayed_decides_the_same_rounds():
    """Live decoding and a replay of its reports run one round protocol (`treespec.steering.Steering`): a
    fresh controller told the same reports makes the same decisions, round for round, generation after
    generation (the live run's times reach it through its reports alone)."""
    import torch

    from treespec import registry
    from treespec.apps.kit.testing import tiny_target
    from treespec.decoding import SpeculativeDecoder
    from treespec.steering import Steering

    prior = REGIMES["torch-bf16"].prior

    def policy():
        return registry.create("policy", "caddtree", budget=16, cost_model=LiveCost(prior))

    live = policy()
    recording = _Recording(live.draft_controller())
    oracle = registry.create("drafter", "oracle", config="typical", seed=0)
    decoder = SpeculativeDecoder(tiny_target(), oracle, live, controller=recording)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        decoder.generate(torch.randint(0, 128, (8,), generator=gen), max_new_tokens=40)
    assert any(d.draft for d in recording.decisions) and len(recording.reports) > 30
    again = policy()
    controller = again.draft_controller()
    controller.bind(oracle.reach)
    reports, decisions, asked = iter(recording.reports), iter(recording.decisions), 0
    for started in recording.starts:
        steering = Steering(controller, again)
        assert steering.start() == started
        rounds = 0
        while rounds < 40:
            report = next(reports, None)
            if report is None:
                break
            if steering.tapping:
                assert _decided(steering.decide()) == _decided(next(decisions))
                asked += 1
            steering.report(report)
            rounds += report.result.tau
    assert asked == len(recording.decisions)
