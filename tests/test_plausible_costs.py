"""What the cost model may believe: a cached profile damaged by hand heals instead of being believed,
and nothing implausible is written back (issue: absurd but finite costs were used and saved again)."""

from __future__ import annotations

import json

import pytest
import torch
from bigram_drafter import BigramDrafter
from hypothesis import given, settings
from hypothesis import strategies as st
from test_target import tiny_model

from treespec.apps.assembly.cost_source import persist_live
from treespec.pricing.calibration import Calibration
from treespec.pricing.live_cost import LiveCost
from treespec.pricing.profile import (
    DRAFT_RANGE,
    VERIFY_CEILING,
    VERIFY_FLOOR,
    CostProfile,
    implausible,
    implausible_curve,
    implausible_live,
    machine_profile,
    save_profile,
)
from treespec.engines.torch import TargetModel

SIZES, CONTEXTS = (1, 2, 5, 17), (8,)


def target() -> TargetModel:
    torch.manual_seed(0)
    return TargetModel(tiny_model(dtype=torch.float32))


def drafter() -> BigramDrafter:
    return BigramDrafter.random(128, depth=4)


def profiled(tmp_path, drafters=()):
    model = target()
    profile = machine_profile(model, list(drafters), sizes=SIZES, contexts=CONTEXTS, repeats=3, cache_dir=tmp_path)
    (path,) = tmp_path.glob("profile-*.json")
    return model, profile, path


def damage(path, **fields) -> None:
    record = json.loads(path.read_text())
    for name, change in fields.items():
        record[name] = change(record[name])
    path.write_text(json.dumps(record))


def again(model, tmp_path, drafters=()):
    return machine_profile(model, list(drafters), sizes=SIZES, contexts=CONTEXTS, repeats=3, cache_dir=tmp_path)


def plausible_on_disk(path) -> bool:
    return implausible(CostProfile.from_record(json.loads(path.read_text()))) is None


@pytest.mark.parametrize("factor", [1e6, 1e-6])
def test_a_curve_scaled_beyond_the_machine_for_trees_is_measured_again(tmp_path, caplog, factor):
    """Every size >= 2 multiplied (or divided) by 10^6: one line, the curve measured again (a 17-token
    verify back under 5 AR steps), the calibration kept, the file healed on disk."""
    model, profile, path = profiled(tmp_path)
    save_profile(model, profile.with_calibration("d@w", Calibration(0.8, 0.9)), sizes=SIZES, contexts=CONTEXTS,
                 cache_dir=tmp_path)
    damage(path, verify=lambda rows: [[n, c, s * factor if n >= 2 else s] for n, c, s in rows])
    healed = again(model, tmp_path)
    err = caplog.text
    assert f"measuring the cached cost profile {path} again: its verify of 2 tokens at context 8" in err
    assert err.count("\n") == 1 and healed.verify_in_steps(17) < 5
    assert healed.calibration("d@w") == Calibration(0.8, 0.9) and plausible_on_disk(path)


def test_a_curve_scaled_whole_is_caught_by_the_spot_check_at_start(tmp_path, caplog):
    """Every size multiplied alike keeps the shape a machine can have; the quick measurement at start
    sees the seconds are not this machine's, and the profile is measured again."""
    model, profile, path = profiled(tmp_path)
    damage(path, verify=lambda rows: [[n, c, s * 1e6] for n, c, s in rows])
    healed = again(model, tmp_path)
    err = caplog.text
    assert f"measuring the cached cost profile {path} again: a 1-token verify at context 8 takes" in err
    assert max(s for _, _, s in healed.verify) < 1e3 * max(s for _, _, s in profile.verify)
    assert json.loads(path.read_text())["verify"] == [list(v) for v in healed.verify]


def test_an_absurd_draft_is_measured_again_and_the_rest_kept(tmp_path, caplog):
    bigram = drafter()
    model, profile, path = profiled(tmp_path, [bigram])
    damage(path, drafts=lambda drafts: {k: 1e30 for k in drafts})
    healed = again(model, tmp_path, [bigram])
    err = caplog.text
    assert f"measuring a drafter's round in the cached cost profile {path} again: a round of drafter" in err
    assert healed.verify == profile.verify  # the curve stays as measured
    assert healed.break_even_tau(bigram, 4) < 1e3 and plausible_on_disk(path)


@pytest.mark.parametrize("rounds", [-99985, 2.5])
def test_a_live_correction_with_bad_round_counts_is_dropped(tmp_path, caplog, rounds):
    bigram = drafter()
    model, profile, path = profiled(tmp_path, [bigram])
    (ident,) = profile.drafts
    record = json.loads(path.read_text())
    record["live_verify"] = [[n, c, s, rounds] for n, c, s in record["verify"]]
    record["live_drafts"] = {ident: [record["drafts"][ident], 3]}
    path.write_text(json.dumps(record))
    healed = again(model, tmp_path, [bigram])
    assert "not a whole number >= 0" in caplog.text
    assert healed.live_verify == () and healed.live_drafts == {}
    assert json.loads(path.read_text())["live_verify"] == []


def test_a_healed_file_is_still_spot_checked(tmp_path, caplog):
    """Every verify at 10^9 s (flat in AR steps, so plausible in shape) beside a broken live part: the
    healing that drops the live part rewrites the file, and the start-up spot check still measures
    the absurd timings again instead of pricing with them and writing them back."""
    bigram = drafter()
    model, profile, path = profiled(tmp_path, [bigram])
    record = json.loads(path.read_text())
    record["verify"] = [[n, c, 1e9] for n, c, _ in record["verify"]]
    record["live_verify"] = [[n, c, s, -3] for n, c, s in record["verify"]]
    path.write_text(json.dumps(record))
    healed = again(model, tmp_path, [bigram])
    assert "dropping the live correction" in caplog.text and "measuring the cached cost profile" in caplog.text
    on_disk = json.loads(path.read_text())["verify"]
    assert max(s for _, _, s in healed.verify) < 10 and max(s for _, _, s in on_disk) < 10


def test_nothing_implausible_is_written_back(tmp_path):
    model, profile, path = profiled(tmp_path)
    before = path.read_text()
    broken = CostProfile(tuple((n, c, s * (1e6 if n > 1 else 1)) for n, c, s in profile.verify))
    with pytest.raises(ValueError, match="refusing to cache the cost profile .*: its verify of 2 tokens"):
        save_profile(model, broken, sizes=SIZES, contexts=CONTEXTS, cache_dir=tmp_path)
    assert path.read_text() == before


def test_a_live_curve_gone_absurd_is_not_saved(tmp_path):
    """Rounds that taught a live model a 17-token verify at a millionth of an AR step leave the cache
    as it was, and say why."""
    model, profile, path = profiled(tmp_path)
    live = LiveCost(profile.cost_model())
    for _ in range(40):
        live.observe(17, 8, 1e-12)
        live.observe(1, 8, profile.cost_model().verify_seconds(1, 8))
    before = path.read_text()
    updated, why = persist_live(model, profile, [(live, None)], sizes=SIZES, contexts=CONTEXTS)
    assert updated is None and "implausible" in why and path.read_text() == before


def test_the_file_check_blames_a_list_on_its_shape(tmp_path, caplog):
    model, _, path = profiled(tmp_path)
    path.write_text(json.dumps([1, 2, 3]))
    again(model, tmp_path)
    err = caplog.text
    assert f"ignoring the cached measurement {path} (its top level is not a JSON object)" in err


@settings(max_examples=60, deadline=None)
@given(one=st.floats(1e-6, 10.0), slope=st.floats(0.0, 1.0), scale=st.floats(1e-3, 1e3),
       sizes=st.lists(st.integers(2, 64), min_size=1, max_size=8, unique=True))
def test_a_curve_any_engine_can_have_is_plausible_at_any_scale(one, slope, scale, sizes):
    """From a memory-bound verify (flat in n) to a compute-bound one (n one-token steps), at any speed."""
    samples = [(1, 8, one * scale)] + [(n, 8, one * scale * (1 + slope * (n - 1))) for n in sizes]
    assert implausible_curve(samples) is None


@settings(max_examples=60, deadline=None)
@given(one=st.floats(1e-6, 10.0), n=st.integers(2, 64), beyond=st.floats(1.01, 1e9))
def test_a_curve_beyond_the_bounds_is_named(one, n, beyond):
    dear = [(1, 8, one), (n, 8, one * VERIFY_CEILING * n * beyond)]
    cheap = [(1, 8, one), (n, 8, one * VERIFY_FLOOR / beyond)]
    for samples in (dear, cheap):
        assert f"its verify of {n} tokens at context 8" in implausible_curve(samples)


def test_a_draft_outside_its_range_is_implausible():
    verify = ((1, 8, 0.01), (2, 8, 0.012))
    low, high = DRAFT_RANGE
    assert implausible(CostProfile(verify, {"d": 0.01 * high * 0.99})) is None
    assert "a round of drafter d" in implausible(CostProfile(verify, {"d": 0.01 * high * 1.01}))
    assert "a round of drafter d" in implausible(CostProfile(verify, {"d": 0.01 * low * 0.99}))
    assert implausible_live(CostProfile(verify, live_drafts={"d": (0.01, -1)})) is not None
