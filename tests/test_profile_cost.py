"""`treespec profile-cost` on a tiny random target: timings, cache restored, a loadable convex model."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from treespec.apps.commands.profile_cost import time_verify
from treespec.pricing.live_cost import LiveCost
from treespec.engines.torch import TargetModel


def test_time_verify_leaves_the_cache_as_it_found_it():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    target = TargetModel(Qwen3ForCausalLM(cfg))
    seconds = time_verify(target, n=8, ctx=20, repeats=2, generator=torch.Generator().manual_seed(0))
    assert seconds > 0
    assert target.length == 20 and target.cache_length() == 20


def test_fitted_model_round_trips(tmp_path):
    from treespec.pricing.cost import ConvexCost, load_cost_model

    samples = [(1, 64, 0.020), (8, 64, 0.022), (16, 64, 0.026), (64, 64, 0.060), (1, 512, 0.025), (16, 512, 0.031)]
    model = ConvexCost.fit(samples, draft=0.007)
    model.save(tmp_path / "cost.json")
    again = load_cost_model(tmp_path / "cost.json")
    assert torch.equal(again.verify_costs(64, 300), model.verify_costs(64, 300))
    costs = model.verify_costs(64, 64)[1:]
    assert bool((costs[1:] >= costs[:-1]).all())  # monotone


def test_verify_sizes_are_timed_in_turn_and_leave_the_cache():
    """Every repeat times each size once, starting one size later, so drift reaches all sizes alike."""
    from treespec.pricing.profile import time_verify_sizes

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    target = TargetModel(Qwen3ForCausalLM(cfg))
    calls, forward = [], target.forward_tree
    target.forward_tree = lambda tree, taps=(): calls.append(tree.num_nodes) or forward(tree, taps)
    seconds = time_verify_sizes(target, (1, 2, 5), ctx=20, repeats=4, generator=torch.Generator().manual_seed(0))
    assert sorted(seconds) == [1, 2, 5] and all(s > 0 for s in seconds.values())
    assert calls == [1, 2, 5] + [1, 2, 5] + [2, 5, 1] + [5, 1, 2] + [1, 2, 5]  # warm-up, then the repeats
    assert target.length == 20 and target.cache_length() == 20


def test_what_a_live_run_learned_is_saved_with_the_profile_and_shown_beside_it(tmp_path, monkeypatch, steady_timings):
    """persist_live writes the live curve into this machine's profile cache; the next profile read
    prices with it, and profile-cost prints both curves with the rounds each point rests on."""
    import attrs

    from treespec.apps.assembly.cost_source import persist_live
    from treespec.apps.commands.profile_cost import describe_profile
    from treespec.pricing.calibration import Calibration
    from treespec.pricing.profile import machine_profile, refresh_profile, save_profile

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    target = TargetModel(Qwen3ForCausalLM(cfg))
    profile = machine_profile(target, repeats=1)
    measured = profile.cost_model()
    live, lopsided = LiveCost(measured), LiveCost(measured)
    for _ in range(24):  # a machine 2x slower at every size; and one whose trees alone cost 3x
        for n in (1, 17):
            live.observe(n, 100, 2 * float(measured.verify_cost(torch.tensor([float(n)]), 100)[0]))
        lopsided.observe(17, 100, 3 * float(measured.verify_cost(torch.tensor([17.0]), 100)[0]))
    assert persist_live(target, profile, [(measured, None)]) == (None, "no live cost model observed a round")
    kept, why = persist_live(target, profile, [(lopsided, None)])  # trees at 3x the AR step's price: refused
    assert kept is None and "implausible" in why and "AR steps where the profile measured" in why
    saved, why = persist_live(target, profile, [(live, None)])
    again = machine_profile(target, repeats=1)  # read from the cache, not measured
    assert why == "" and again == saved and again.live_rounds == 48
    for n in (2, 17, 33):
        assert float(again.cost_model().verify_cost(torch.tensor([float(n)]), 128)[0]) == pytest.approx(
            2 * float(measured.verify_cost(torch.tensor([float(n)]), 128)[0]), rel=1e-6)
    assert again.cost_model(live=False) == measured
    text = describe_profile(again, [], [])
    assert "live correction: 48 decoding rounds" in text and "(24 rounds)" in text and "live-corrected" in text
    assert "none yet" in describe_profile(profile, [], [])
    calibrated = attrs.evolve(again, calibrations={"some drafter": Calibration(0.8, 1.1)})
    save_profile(target, calibrated)
    fresh = refresh_profile(target, repeats=1)  # `profile-cost --fresh`: new timings, the correction dropped
    assert machine_profile(target, repeats=1) == fresh and fresh.live_rounds == 0
    assert fresh.calibrations == {"some drafter": Calibration(0.8, 1.1)}  # keyed by weights: kept
