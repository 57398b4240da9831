"""Offline trace replay (treespec/apps/replay/) against the live decoder, on tiny float64 models.

* For every policy arm (the chain over DFlash and over Domino, DDTree, CaDDTree, DominoTree,
  static-corrected) at several budgets, on several prompts: at every live round the tree built from
  the replayed draft equals the live tree bit for bit, and the replayed tau sequences equal the
  live ones (`SpeculativeDecoder` at T = 0), also with a stop token and the networkx backend.
* Compressed marginals (max_budget < V): budgets up to max_budget, including DDTree's adaptive
  candidate lists (B > 64), still replay exactly while deep depths keep far fewer than V tokens.
* The walk that gives tau is the match verifier's; the trace round-trips through safetensors;
  replay refuses budgets / top-M it cannot answer and trees that reach unrecorded tokens; the CLI
  records and evaluates a trace.
"""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from test_drafters_support import tiny_config
from test_target import random_prompts, random_tree, tiny_model

from treespec.analysis import accepted_length
from treespec.apps.assembly.methods import build_policy, parse_method
from treespec.apps.assembly.session import Session
from treespec.apps.cli import main
from treespec.apps.replay import (
    RecordConfig,
    ReplayDrafts,
    Trace,
    TraceError,
    evaluate,
    record_trace,
    replay_prompt,
    replay_rounds,
)
from treespec.decoding import SpeculativeDecoder
from treespec.drafters.dflash import DFlashDrafter
from treespec.drafters.domino import DominoDrafter
from treespec.drafters.toy import ToyConditionalDrafter, ToyConfig
from treespec.interfaces import DraftOutput, RoundReport, TreePolicy
from treespec.pricing.control import ControlSettings
from treespec.pricing.cost import COST_PRESETS, LinearCost, cost_model_from_dict
from treespec.engines.torch import TargetModel
from treespec.tree import DraftTree
from treespec.verifiers.match import walk_matches

N_TOKENS = 24
COST = COST_PRESETS["smollm2-cpu-bf16"]  # prices caddtree's trees (interior optima and root-only rounds)
METHODS = ["dflash", "domino", "ddtree@2", "ddtree@8", "ddtree@48", "caddtree@48", "dominotree@4",
           "dominotree@16", "dominotree@48", "static-corrected@8", "static-corrected@48"]
COMPRESSED_METHODS = ["dflash", "domino", "ddtree@16", "ddtree@80", "caddtree@80", "dominotree@80",
                      "static-corrected@80"]


class Capturing(TreePolicy):
    """Wraps a policy and keeps every tree the live loop asked it for, with the round's anchor position."""

    def __init__(self, inner: TreePolicy) -> None:
        self.inner = inner
        self.trees: list[tuple[int, DraftTree]] = []

    def build(self, draft: DraftOutput) -> DraftTree:
        tree = self.inner.build(draft)
        self.trees.append((draft.position, tree))
        return tree

    def begin_generation(self) -> None:
        self.inner.begin_generation()

    def draft_controller(self):
        return self.inner.draft_controller()

    def begin_round(self) -> None:
        self.inner.begin_round()

    def priced(self, price, calibration) -> TreePolicy:
        """The inner policy at the round's price, still capturing into these trees."""
        inner = self.inner.priced(price, calibration)
        if inner is self.inner:
            return self
        view = Capturing(inner)
        view.trees = self.trees
        return view

    def observe_round(self, report: RoundReport) -> None:
        self.inner.observe_round(report)


class World:
    """A tiny float64 Qwen3 target, random DFlash and Domino drafters, prompts, and their trace."""

    def __init__(self, vocab: int, config: RecordConfig, n_prompts: int = 3, seed: int = 0) -> None:
        model = tiny_model(vocab=vocab, hidden=32, layers=2, seed=seed)
        with torch.no_grad():
            model.lm_head.weight.mul_(0.3)  # flatter drafts, bushier trees; the greedy text is unchanged
        self.target = TargetModel(model)
        self.drafters = {  # different taps, so the recorder must give each its own columns
            "dflash": DFlashDrafter.random(tiny_config(vocab=vocab, num_target_layers=2, layer_ids=(0, 1),
                                                      block_size=5), dtype=torch.float64, seed=seed + 1),
            "domino": DominoDrafter.random(tiny_config(domino=True, vocab=vocab, num_target_layers=2, layer_ids=(1,),
                                                      block_size=5), dtype=torch.float64, seed=seed + 2),
        }
        # a drafter needs context before its anchor, so every prompt has at least two tokens
        self.prompts = [p for p in random_prompts(n_prompts + 4, vocab, seed=seed + 3) if p.numel() > 1][:n_prompts]
        self.session = Session(self.target, drafters=self.drafters)
        self.trace = record_trace(self.session, self.prompts, config=config)

    def live(self, method: str, **kwargs) -> tuple[list[tuple[int, ...]], list[list[tuple[int, DraftTree]]]]:
        """Per-prompt live taus and trees; every output must equal the recorded greedy trajectory."""
        parsed = parse_method(method)
        taus, trees = [], []
        policy = Capturing(build_policy(parsed, COST))
        decoder = SpeculativeDecoder(self.target, self.drafters[parsed.drafter], policy)  # one, as replay's
        for i, prompt in enumerate(self.prompts):
            policy.trees = []
            out = decoder.generate(prompt, max_new_tokens=self.trace.max_new_tokens, **kwargs)
            assert out.tokens.tolist() == self.trace.sequences[i][prompt.numel():][:out.tokens.numel()].tolist()
            taus.append(tuple(out.stats.taus))
            trees.append(policy.trees)
        return taus, trees


@pytest.fixture(scope="module")
def small():
    return World(16, RecordConfig(max_new_tokens=N_TOKENS, max_budget=64))  # max_budget >= V: full rows


@pytest.fixture(scope="module")
def compressed():
    return World(128, RecordConfig(max_new_tokens=16, max_budget=80, min_k=4), n_prompts=2, seed=10)


def assert_replay_equals_live(world: World, method: str) -> list[tuple[int, ...]]:
    parsed = parse_method(method)
    policy = build_policy(parsed, COST)
    drafts = ReplayDrafts.of(world.trace, parsed.drafter)
    live_taus, live_trees = world.live(method)
    for i, rounds in enumerate(live_trees):
        sequence, start = world.trace.sequences[i], world.prompts[i].numel() - 1
        for position, tree in rounds:
            draft = drafts.draft(world.trace.anchor_index(i, position - start), int(sequence[position]), position)
            assert policy.build(draft).equal(tree), f"{method}: prompt {i}, anchor position {position}"
    replayed = evaluate(world.trace, [method], cost_model=COST)[0]
    assert list(replayed.taus) == live_taus
    return live_taus


# ---------------------------------------------------------------------------- replay equals live
@pytest.mark.parametrize("method", METHODS)
def test_replayed_trees_and_taus_equal_live(small, method):
    taus = assert_replay_equals_live(small, method)
    if method.endswith("@48"):
        assert max(max(t) for t in taus) >= 2  # trees were accepted into, not only root-only rounds


@pytest.mark.parametrize("method", COMPRESSED_METHODS)
def test_compressed_marginals_replay_exactly(compressed, method):
    assert_replay_equals_live(compressed, method)


def test_compressed_trace_keeps_far_fewer_than_the_vocabulary(compressed):
    counts = compressed.trace.drafters["dflash"].counts  # [R, L]
    assert int(counts.min()) >= 4 and int(counts[:, -1].max()) < 128 // 4
    assert int(counts[:, 0].max()) <= 80  # at most the budget's worth at any depth


@pytest.mark.parametrize("method", ["ddtree@16", "dominotree@16", "static-corrected@8"])
def test_networkx_backend_replays_the_same_taus(small, method):
    live, _ = small.live(method)
    assert list(evaluate(small.trace, [f"{method}+backend=networkx"], cost_model=COST)[0].taus) == live


@pytest.mark.parametrize("method", ["ddtree@48", "dominotree@16"])
def test_stop_tokens_end_responses_as_live(small, method):
    stop = int(small.trace.sequences[0][small.prompts[0].numel() + 9])  # the 10th generated token of prompt 0
    live, _ = small.live(method, stop_token_ids=[stop])
    replayed = evaluate(small.trace, [method], stop_token_ids=[stop], cost_model=COST)[0]
    assert list(replayed.taus) == live
    assert sum(live[0]) < N_TOKENS  # the response stopped early


def test_autoregressive_replay_is_one_token_per_round(small):
    result = evaluate(small.trace, ["ar"], cost_model=COST)[0]
    assert result.taus == ((1,) * N_TOKENS,) * len(small.prompts)


@pytest.mark.parametrize("method", ["ddtree@8", "caddtree@48"])
def test_replayed_rounds_are_the_live_rounds(small, method):
    """Each replayed round's tau, verified tree size and whether it drafted are the live loop's, the
    controller's AR steps included (caddtree@48 priced with a drafter dearer than its trees are worth):
    one controller over the prompts in order, live and replayed."""
    parsed = parse_method(method)
    dear = attrs.evolve(COST, draft=3 * float(COST.verify_costs(1, COST.contexts[0])[1]))
    decoder = SpeculativeDecoder(small.target, small.drafters[parsed.drafter], build_policy(parsed, dear))
    drafts, policy = ReplayDrafts.of(small.trace, parsed.drafter), build_policy(parsed, dear)
    controller, skipped = policy.draft_controller(), 0
    for i, prompt in enumerate(small.prompts):
        live = decoder.generate(prompt, max_new_tokens=small.trace.max_new_tokens).stats.rounds
        replayed = replay_rounds(small.trace, drafts, policy, i, controller=controller)
        assert [(r.tau, r.tree_size, r.drafted) for r in replayed] == [(r.tau, r.tree_size, r.drafted) for r in live]
        skipped += sum(not r.drafted for r in replayed)
    assert (skipped > 0) == (method == "caddtree@48")


@pytest.mark.slow
def test_the_modelled_speed_bench_charges_rounds_by_the_cost_model(small, tmp_path):
    """benchmarks/bench_modelled_rules.py: AR is 1.000x by construction, every method gets a row, and C_d
    in AR steps needs a fitted curve (refused by name otherwise)."""
    import subprocess
    import sys
    from pathlib import Path

    small.trace.save(tmp_path / "trace.safetensors")
    COST.save(tmp_path / "cost.json")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_modelled_rules.py"
    run = lambda *extra: subprocess.run([sys.executable, str(script), str(tmp_path / "trace.safetensors"),  # noqa: E731
                                         "--methods", "ar", "ddtree@8", "caddtree@48", "--resamples", "50",
                                         "--cost-model", str(tmp_path / "cost.json"), *extra],
                                        capture_output=True, text=True, timeout=300)
    done = run()
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "×" in line]
    assert len(rows) == 3 and rows[0].startswith("| ar | 1.00 | 0 % |") and "1.000× [1.000, 1.000]" in rows[0]
    steps = run("--draft-steps", "dflash=0.3")
    assert steps.returncode == 0 and "C_d dflash 0.30 AR steps" in steps.stdout
    LinearCost(draft=0.002, base=0.02, per_token=4e-4).save(tmp_path / "cost.json")
    refused = run("--draft-steps", "0.3")
    assert refused.returncode != 0 and "needs a fitted cost model" in refused.stderr


# ---------------------------------------------------------------------------- pieces
def test_accepted_length_is_the_match_verifiers_walk():
    gen = torch.Generator().manual_seed(0)
    taus = []
    for _ in range(60):
        tree = random_tree(3, 40, 4, gen)  # 4 tokens: many repeated siblings, deep matches
        node = int(torch.randint(1, 40, (), generator=gen))  # the trajectory follows this node's path, then noise
        future = tree.tokens[tree.path(node)[1:]].tolist() + torch.randint(0, 4, (10,), generator=gen).tolist()
        chosen = [future[d] for d in tree.depths.tolist()]  # the target's token at each node (its depth's)
        taus.append(accepted_length(tree, future))
        assert taus[-1] == walk_matches(tree, torch.tensor(chosen)).tau
    assert max(taus) >= 5


def test_trace_round_trips_through_safetensors(small, tmp_path):
    path = small.trace.save(tmp_path / "trace.safetensors")
    loaded = Trace.load(path)
    assert loaded.meta == small.trace.meta
    assert all(torch.equal(a, b) for a, b in zip(loaded.sequences, small.trace.sequences, strict=True))
    methods = ["ddtree@8", "dominotree@16", "domino"]
    again, before = (evaluate(t, methods, cost_model=COST) for t in (loaded, small.trace))
    assert [r.taus for r in again] == [r.taus for r in before]
    assert path.read_bytes()[8:9] == b"{"  # a safetensors JSON header: no pickle anywhere


def test_non_trace_files_are_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(TraceError, match="not a treespec trace"):
        Trace.load(tmp_path / "other.safetensors")
    with pytest.raises(TraceError, match="cannot read trace"):
        Trace.load(tmp_path / "missing.safetensors")


@pytest.mark.parametrize(("method", "message"), [
    ("ddtree@81", "exceeds the trace's max_budget 80"),
    ("caddtree@100", "exceeds the trace's max_budget 80"),
    ("ddtree@16:domino", None),  # the Domino drafter's marginals are recorded as well
])
def test_budgets_beyond_the_recording_are_refused(compressed, method, message):
    if message is None:
        assert_replay_equals_live(compressed, method)
        return
    with pytest.raises(TraceError, match=message):
        evaluate(compressed.trace, [method], cost_model=COST)


def test_top_m_beyond_the_recording_is_refused(compressed):
    wide = attrs.evolve(parse_method("dominotree@16"), options={"top_m": 96})
    with pytest.raises(TraceError, match="top_m 96 exceeds the 64 scorer candidates"):
        evaluate(compressed.trace, [wide], cost_model=COST)


def test_a_missing_drafter_is_named(compressed):
    only_dflash = attrs.evolve(compressed.trace, drafters={"dflash": compressed.trace.drafters["dflash"]})
    with pytest.raises(TraceError, match="needs the domino drafter"):
        evaluate(only_dflash, ["dominotree@16"], cost_model=COST)


class DeepRanks(TreePolicy):
    """A static tree that takes the rank-7 token at depth 2: more than min_k = 4 tokens per depth."""

    name = "deep-ranks"

    def build(self, draft: DraftOutput) -> DraftTree:
        top = draft.logprobs.topk(8, dim=-1)
        return DraftTree.from_topk_choices([(0,), (0, 7)], root_token=draft.root_token, topk_tokens=top.indices,
                                           topk_logprobs=top.values)


def test_a_scorer_replay_cannot_rebuild_is_refused_when_recording(small):
    toy = ToyConditionalDrafter(ToyConfig(vocab_size=small.target.vocab_size))  # its ToyScorer is no RecordableScorer
    with pytest.raises(TraceError, match="cannot record a ToyScorer: .* implement treespec.interfaces.RecordableScorer"):
        record_trace(Session(small.target, drafters={"domino": toy}), small.prompts[:1], config=RecordConfig(max_new_tokens=2))


def test_trees_reaching_unrecorded_tokens_fail(compressed):
    drafts = ReplayDrafts.of(compressed.trace, "dflash")
    with pytest.raises(TraceError, match="did not record"):
        replay_prompt(compressed.trace, drafts, DeepRanks(), 0)


# ---------------------------------------------------------------------------- CLI
def test_cli_records_and_evaluates_a_trace(small, tmp_path, capsys):
    small.target.model.save_pretrained(tmp_path / "target")
    for kind, drafter in small.drafters.items():
        drafter.save_pretrained(tmp_path / kind)
    (tmp_path / "prompts.json").write_text(json.dumps([p.tolist() for p in small.prompts]))
    out = tmp_path / "trace.safetensors"
    assert main(["replay", "record", "--out", str(out), "--model", str(tmp_path / "target"), "--dtype", "float64",
                 "--dflash", str(tmp_path / "dflash"), "--domino", str(tmp_path / "domino"),
                 "--prompt-ids", str(tmp_path / "prompts.json"), "--max-new-tokens", "12", "--max-budget", "64"]) == 0
    methods = ["ddtree@8", "dominotree@16"]
    assert main(["replay", "eval", str(out), "--methods", ",".join(methods), "--json", str(tmp_path / "t.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    for method in methods:
        parsed = parse_method(method)
        decoder = SpeculativeDecoder(small.target, small.drafters[parsed.drafter], build_policy(parsed, COST))
        live = [decoder.generate(p, max_new_tokens=12).stats.taus for p in small.prompts]
        assert [r["taus"] for r in rows if r["method"] == method] == live
    assert main(["replay", "info", str(out)]) == 0
    assert '"max_new_tokens": 12' in capsys.readouterr().out
    assert main(["replay", "eval", str(out), "--methods", "nosuch@4"]) == 2  # a bad argument, as argparse exits
    assert "unknown policy 'nosuch'" in capsys.readouterr().err
    assert not out.with_name(out.name + ".parts").exists()  # the parts go once the trace is written
    record = ["replay", "record", "--out", str(out), "--model", str(tmp_path / "target"), "--dflash",
              str(tmp_path / "dflash"), "--prompt-ids", str(tmp_path / "prompts.json"), "--max-new-tokens", "4"]
    before = out.read_bytes()
    assert main(record) == 2  # an existing trace is never silently replaced
    assert f"{out} exists; pass --overwrite" in capsys.readouterr().err and out.read_bytes() == before
    assert main([*record, "--overwrite"]) == 0 and Trace.load(out).max_new_tokens == 4


# ---------------------------------------------------------------------------- resumable recording
def _trace_bytes(trace: Trace, path) -> dict:
    """A trace's tensors and metadata, compared after a save/load round trip."""
    trace.save(path)
    loaded = Trace.load(path)
    tensors = {k: v.tolist() for k, v in _flatten_for_test(loaded).items()}
    return {"meta": loaded.meta, "tensors": tensors}


def _flatten_for_test(trace: Trace) -> dict:
    from treespec.apps.replay.trace import _flatten

    return _flatten(trace)


class _Interrupt(Exception):
    pass


def test_an_interrupted_recording_resumes_into_the_same_trace(compressed, tmp_path):
    world = compressed
    config = RecordConfig(max_new_tokens=16, max_budget=80, min_k=4)
    whole = _trace_bytes(world.trace, tmp_path / "whole.safetensors")
    domino, calls = world.drafters["domino"], {"n": 0}
    original = domino.draft

    def failing(ctx):  # the second prompt's recording stops half way (a crash, or SIGINT)
        calls["n"] += 1
        if calls["n"] == 16 + 8:
            raise _Interrupt
        return original(ctx)

    domino.draft = failing
    with pytest.raises(_Interrupt):
        record_trace(world.session, world.prompts, config=config, parts_dir=tmp_path / "parts")
    domino.draft = original
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == ["part-00000.safetensors"]  # no torn part
    resumed = record_trace(world.session, world.prompts, config=config, parts_dir=tmp_path / "parts")
    assert _trace_bytes(resumed, tmp_path / "resumed.safetensors") == whole


def test_parts_of_other_settings_are_refused(compressed, tmp_path):
    world = compressed
    config = RecordConfig(max_new_tokens=16, max_budget=80, min_k=4)
    record_trace(world.session, world.prompts[:1], config=config, parts_dir=tmp_path)
    with pytest.raises(TraceError, match="recorded with other config"):
        record_trace(world.session, world.prompts[:1], parts_dir=tmp_path,
                     config=RecordConfig(max_new_tokens=12, max_budget=80, min_k=4))
    with pytest.raises(TraceError, match="recorded with other prompt, prompt_sha256"):
        record_trace(world.session, world.prompts[1:2], config=config, parts_dir=tmp_path,
                     prompt_ids=["other"])


# ---------------------------------------------------------------------------- live-corrected costs
@pytest.mark.parametrize("method", ["caddtree@16", "cost-aware-dominotree@16"])
def test_a_live_cost_run_replays_with_its_recorded_curves(small, method):
    """Round by round with the curve and calibration its record names, a run whose costs and
    calibration were learned live (on a clock that makes trees cheap, dear, then cheap, so the controller switches
    and explores; the calibration re-fitted every other round) builds the same trees."""
    from treespec.apps.bench.records import BenchRecord, cost_schedule
    from treespec.apps.replay import replay_priced
    from treespec.pricing.calibration import Calibration, LiveCalibration, LiveCalibrationSettings
    from treespec.pricing.live_cost import LiveCost, LiveSettings

    parsed = parse_method(method)
    live = LiveCost(COST, LiveSettings())
    calibration = LiveCalibration(settings=LiveCalibrationSettings(min_nodes=50, refit_every=2))
    policy = Capturing(build_policy(parsed, live, calibration))
    now = {"t": 0.0, "rounds": 0}
    decoder = SpeculativeDecoder(small.target, small.drafters[parsed.drafter], policy, clock=lambda: now["t"])
    decoder.controller.settings = ControlSettings(size_every=3, explore_share=0.5,  # flat-priced rounds often
                                                  quiet_every=1)  # every AR round re-prices the curve
    forward = small.target.forward_tree

    def timed(tree, *args, **kwargs):  # trees dear in forwards 6 to 14, cheap before and after
        now["rounds"] += 1
        now["t"] += 0.02 if len(tree) == 1 else (0.3 if 6 <= now["rounds"] <= 14 else 0.021)
        return forward(tree, *args, **kwargs)

    small.target.forward_tree = timed
    try:
        drafts = ReplayDrafts.of(small.trace, parsed.drafter)
        sizes, curves, calibrations, drafted = [], set(), set(), []
        for i, prompt in enumerate(small.prompts):
            policy.trees = []
            out = decoder.generate(prompt, max_new_tokens=small.trace.max_new_tokens)
            models, rounds = cost_schedule(out.stats.rounds)
            record = BenchRecord(method, parsed.policy, 16, 0.0, "d", str(i), 0, 0, out.tokens.tolist(),
                                 out.stats.taus, 1.0, 0.0, {}, cost_models=models, cost_rounds=rounds)
            taus = replay_priced(small.trace, drafts, parsed, i, record.priced_rounds())
            assert taus == out.stats.taus, f"prompt {i}"
            sizes += [len(t) for _, t in policy.trees]
            drafted += [r.drafted for r in out.stats.rounds]
            curves |= {json.dumps(m, sort_keys=True) for m in models}
            start = prompt.numel() - 1
            for (position, tree), priced in zip(policy.trees, [dict(p) for p in record.priced_rounds() if p]):
                fitted = Calibration.from_record(priced.pop("calibration"))
                calibrations.add(fitted)
                rebuilt = build_policy(parsed, cost_model_from_dict(priced), fitted)
                draft = drafts.draft(small.trace.anchor_index(i, position - start), int(small.trace.sequences[i][position]),
                                     position)
                assert rebuilt.build(draft).equal(tree)
        assert max(sizes) > 1 and not all(drafted)  # the controller switched between trees and AR steps
        assert len(curves) >= 2  # priced with several curves: the live one and an exploring round's flat one
        assert len(calibrations) >= 2  # and calibrated by the prior and a fit
    finally:
        small.target.forward_tree = forward


def test_a_policy_that_can_pay_for_no_tree_replays_as_the_live_loop_runs_it(small):
    """A compute-bound cost (every token an AR step): live decoding does not draft at all, and replay,
    asking the same question first, gives the same one-token rounds."""
    bound = LinearCost(draft=0.001, base=0.0, per_token=0.05)
    parsed = parse_method("caddtree@16")
    (row,) = evaluate(small.trace, ["caddtree@16"], cost_model=bound)
    decoder = SpeculativeDecoder(small.target, small.drafters[parsed.drafter], build_policy(parsed, bound))
    drafts = ReplayDrafts.of(small.trace, parsed.drafter)
    for i, prompt in enumerate(small.prompts):
        out = decoder.generate(prompt, max_new_tokens=small.trace.max_new_tokens)
        replayed = replay_rounds(small.trace, drafts, build_policy(parsed, bound), i)
        assert out.stats.undrafted and not any(r.drafted for r in out.stats.rounds)
        assert [(r.tau, r.drafted) for r in replayed] == [(t, False) for t in out.stats.taus]  # no draft asked
        assert tuple(row.taus[i]) == tuple(out.stats.taus)
