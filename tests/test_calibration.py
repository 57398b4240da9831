"""The calibration by confidence: the map, its maximum-likelihood fit, and what it is fitted from."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treespec.interfaces import VerifyResult
from treespec.pricing.calibration import (
    Calibration,
    LiveCalibration,
    LiveCalibrationSettings,
    fit_calibration,
    node_outcomes,
    promise_by_quartile,
    to_calibration,
)
from treespec.tree import DraftTree


def synthetic_rounds(truth: Calibration, rounds: int, seed: int, nodes: int = 16):
    """Rounds of ``nodes`` path log-probabilities each, accepted with the chance ``truth`` gives them; the
    rounds differ in confidence (their best node's δ from e^-3 to 1), as a drafter's do."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rounds):
        top = -3.0 * float(torch.rand(1, generator=g, dtype=torch.float64))
        scores = top - torch.rand(nodes, generator=g, dtype=torch.float64) * 4.0  # [nodes] log δ
        out.append((scores, torch.rand(nodes, generator=g, dtype=torch.float64) < truth.deltas(scores)))
    return out


@given(st.floats(0.2, 3.0), st.floats(0.2, 3.0), st.lists(st.floats(-30.0, 0.0), min_size=1, max_size=20))
@settings(deadline=None, max_examples=60)
def test_the_map_is_a_clamped_power_law_increasing_in_the_score(scale, power, scores):
    s = torch.tensor(sorted(scores), dtype=torch.float64)
    out = Calibration(scale, power).deltas(s)
    expected = torch.tensor([min(1.0, scale * math.exp(v) ** power) for v in sorted(scores)], dtype=torch.float64)
    assert torch.allclose(out, expected, rtol=1e-9, atol=1e-300)
    assert bool((out.diff() >= 0).all()) and bool((out <= 1).all())  # the pop order's ranking is kept


def test_the_identity_takes_the_promises_as_they_are_and_records_round_trip():
    s = torch.tensor([-3.0, -0.5, 0.0])
    assert Calibration().identity and torch.equal(Calibration().deltas(s), s.double().exp())
    assert Calibration.from_record(Calibration(0.8, 0.6).to_record()) == Calibration(0.8, 0.6)
    with pytest.raises(ValueError, match=r"a calibration is \[scale, power\], got 0.9"):
        Calibration.from_record(0.9)  # a bare scale is no record of this format (its profile is measured again)
    assert to_calibration(0.7) == Calibration(0.7) and to_calibration(Calibration(1, 2)) == Calibration(1, 2)
    with pytest.raises(ValueError, match="power must be a finite number > 0"):
        Calibration(1.0, -1.0)
    with pytest.raises(ValueError, match="scale, power"):
        Calibration.from_record("high")
    with pytest.raises(ValueError, match="finite number > 0"):
        to_calibration(float("nan"))


@pytest.mark.parametrize("truth", [Calibration(0.8, 0.6), Calibration(1.0, 1.0), Calibration(1.3, 1.4),
                                   Calibration(0.5, 1.0)])
def test_the_fit_recovers_the_calibration_the_outcomes_were_drawn_with(truth):
    rounds = synthetic_rounds(truth, 4000, seed=1)  # 64,000 nodes
    fitted = fit_calibration(rounds)
    assert fitted.scale == pytest.approx(truth.scale, rel=0.08) and fitted.power == pytest.approx(truth.power, abs=0.05)
    if truth.power == 1.0:  # the scale alone, when the power is right
        assert fit_calibration(rounds, fit_power=False).scale == pytest.approx(truth.scale, rel=0.06)


def test_a_scale_alone_cannot_fit_a_drafter_unsure_when_low_and_sure_when_high():
    """The case the power is for: with one factor the groups by promise stay far off what was accepted;
    the fitted power brings every group's promise to within a tenth of a token of it."""
    rounds = synthetic_rounds(Calibration(0.9, 0.6), 2000, seed=2)
    scale_only = promise_by_quartile(rounds, fit_calibration(rounds, fit_power=False))
    assert max(abs(promised - accepted) for promised, accepted in scale_only) > 0.5
    for promised, accepted in promise_by_quartile(rounds, fit_calibration(rounds)):
        assert promised == pytest.approx(accepted, abs=0.1)


def test_too_little_or_one_sided_evidence_keeps_the_identity():
    few = synthetic_rounds(Calibration(0.5, 0.5), 2, seed=3)  # 32 nodes
    assert fit_calibration(few).identity and fit_calibration([]).identity
    scores = -torch.rand(200, dtype=torch.float64)
    assert fit_calibration([(scores, torch.zeros(200, dtype=torch.bool))]).identity
    assert fit_calibration([(scores, torch.ones(200, dtype=torch.bool))]).identity


def test_a_rejected_node_promised_certainty_stays_finite():
    rounds = synthetic_rounds(Calibration(0.7, 1.0), 300, seed=4)
    rounds.append((torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.bool)))  # δ = 1, rejected
    fitted = fit_calibration(rounds)
    assert math.isfinite(fitted.scale) and fitted.scale < 1.0


def test_node_outcomes_mark_the_accepted_path():
    #   0 -> 1 -> 3
    #     -> 2
    tree = DraftTree.build([9, 4, 5, 6], [-1, 0, 0, 1], scores=[0.0, -0.1, -2.0, -0.7])
    scores, accepted = node_outcomes(tree, VerifyResult(accepted=torch.tensor([0, 1]), bonus_token=3))
    assert scores.tolist() == pytest.approx([-0.1, -2.0, -0.7]) and accepted.tolist() == [True, False, False]


# ---------------------------------------------------------------------------- learned while decoding
def test_a_live_calibration_keeps_its_prior_until_it_has_seen_enough_nodes():
    prior = Calibration(0.9, 1.1)
    live = LiveCalibration(prior, LiveCalibrationSettings(min_nodes=160, refit_every=1))
    for scores, accepted in synthetic_rounds(Calibration(0.4, 1.0), 9, seed=5):  # 144 nodes
        assert not live.observe(scores, accepted)
        assert live.current == prior and torch.equal(live.deltas(scores), prior.deltas(scores))
    assert not live.observe(torch.empty(0), torch.empty(0, dtype=torch.bool))  # a root-only tree tests nothing
    scores, accepted = synthetic_rounds(Calibration(0.4, 1.0), 1, seed=6)[0]
    assert live.observe(scores, accepted) and live.fits == 1 and live.current != prior
    assert "fitted live on 160 nodes" in live.describe()


@pytest.mark.parametrize("truth", [Calibration(0.5, 1.0), Calibration(0.9, 0.6), Calibration(1.3, 1.3)])
def test_a_live_calibration_converges_to_the_map_its_outcomes_were_drawn_with(truth):
    live = LiveCalibration(settings=LiveCalibrationSettings(window=16_384, refit_every=50, fit_power=True))
    for scores, accepted in synthetic_rounds(truth, 1500, seed=7):
        live.observe(scores, accepted)
    assert live.nodes <= 16_384 + 16 and live.fits == 30
    assert live.current.scale == pytest.approx(truth.scale, rel=0.12)
    assert live.current.power == pytest.approx(truth.power, abs=0.08)


def test_a_live_calibration_follows_a_drafter_that_gets_worse_within_its_window():
    """A drafter that was calibrated starts to promise three times what the target accepts: once the
    window (2,048 nodes: 128 rounds of 16) holds only the new rounds, the live map promises what the
    target accepts (the tokens promised on fresh rounds within a fifth of the truth's: a window this
    small fits κ and β jointly only roughly, the tokens they promise closely)."""
    fresh = [s for s, _ in synthetic_rounds(Calibration(), 500, seed=99)]
    promised = lambda calibration: sum(float(calibration.deltas(s).sum()) for s in fresh)  # noqa: E731
    live = LiveCalibration(settings=LiveCalibrationSettings(window=2048, refit_every=8))
    for scores, accepted in synthetic_rounds(Calibration(), 300, seed=8):
        live.observe(scores, accepted)
    assert promised(live.current) == pytest.approx(promised(Calibration()), rel=0.2)
    for scores, accepted in synthetic_rounds(Calibration(1 / 3, 1.0), 136, seed=9):  # the window and one re-fit
        live.observe(scores, accepted)
    assert promised(live.current) == pytest.approx(promised(Calibration(1 / 3)), rel=0.2)


def test_a_drafter_the_target_never_follows_gets_a_small_smoothed_scale():
    live = LiveCalibration(settings=LiveCalibrationSettings(min_nodes=64, refit_every=1))
    scores = torch.full((16,), -0.5, dtype=torch.float64)  # 16 promises of 0.61 each, all rejected
    for _ in range(4):
        live.observe(scores, torch.zeros(16, dtype=torch.bool))
    assert live.current == Calibration(0.5 / (64 * math.exp(-0.5) + 0.5), 1.0)
    assert float(live.deltas(scores)[0]) < 0.01  # the identity's fit (no maximum) would have kept 0.61
    with pytest.raises(ValueError, match="16 scores for 3 outcomes"):
        live.observe(scores, torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError):
        LiveCalibrationSettings(min_nodes=10)


def test_a_fit_started_near_its_maximum_ends_where_a_cold_one_does():
    rounds = synthetic_rounds(Calibration(0.8, 0.7), 300, seed=10)
    cold = fit_calibration(rounds)
    for start in (Calibration(0.75, 0.72), Calibration(50.0, 0.1)):  # near; and one promising certainty to rejects
        warm = fit_calibration(rounds, start=start)
        assert warm.scale == pytest.approx(cold.scale, rel=1e-6) and warm.power == pytest.approx(cold.power, abs=1e-6)


def test_a_live_calibration_refits_the_scale_under_the_priors_power_unless_asked_for_both():
    truth = Calibration(0.5, 1.3)
    rounds = synthetic_rounds(truth, 300, seed=11)
    scale_only, both = (LiveCalibration(Calibration(0.9, 1.3), LiveCalibrationSettings(fit_power=f))
                        for f in (False, True))
    for scores, accepted in rounds:
        scale_only.observe(scores, accepted)
        both.observe(scores, accepted)
    assert scale_only.current.power == 1.3 and scale_only.current.scale == pytest.approx(0.5, rel=0.15)
    assert both.current.power != 1.3 and both.current.power == pytest.approx(1.3, abs=0.3)
