"""The bench runner on a tiny float64 Qwen3 target with random DFlash and Domino drafters.

One unsharded run (module fixture) over a single-turn and a two-turn (MT-Bench-shaped) local prompt
file at T = 0 and T = 1 is checked for completeness, equality with AR, pairing and the MT-Bench turn
chaining; its report is re-derived byte for byte; a two-rank run merged equals it (times aside);
an injected wrong token is caught by the losslessness check with the AR logits' top-two gap.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_drafters_support import tiny_config
from test_target import tiny_model

import treespec.apps.bench as ab
from treespec.apps.assembly.cost_source import CostSource
from treespec.apps.assembly.methods import parse_method
from treespec.apps.assembly.session import Session
from treespec.apps.bench.records import read_records
from treespec.apps.cli import main
from treespec.decoding import SpeculativeDecoder
from treespec.drafters.dflash import DFlashDrafter
from treespec.drafters.domino import DominoDrafter
from treespec.interfaces import SamplingParams
from treespec.sampling import gumbel_noise, sampling_key
from treespec.engines.torch import TargetModel

VOCAB, EOS = 128, 0
METHODS = ("ar", "dflash", "domino", "ddtree", "caddtree", "dominotree")
EXPANDED = ("ar", "dflash", "domino", "ddtree@4", "caddtree@4", "dominotree@4")
TEMPERATURES = (0.0, 1.0)
TIMES = ("decode_time", "prefill_time", "stage_times", "run", "cost_models", "cost_rounds", "load")  # what depends on the run and the machine


class CharTokenizer:
    """The slice of a Hugging Face tokenizer the runner uses: a character-level chat template."""

    chat_template = "role:content|"
    eos_token_id = EOS

    def apply_chat_template(self, messages, *, tokenize, add_generation_prompt, **kwargs):
        return "".join(f"{m['role']}:{m['content']}|" for m in messages) + "assistant:"

    def __call__(self, text, add_special_tokens):
        return type("Encoding", (), {"input_ids": [1 + ord(c) % (VOCAB - 2) for c in text]})()

    def decode(self, ids, skip_special_tokens):
        return "".join(chr(ord("a") + i % 26) for i in ids if not (skip_special_tokens and i == EOS))


def make_harness() -> Session:
    target = TargetModel(tiny_model("qwen3", vocab=VOCAB, hidden=32, layers=4))
    config = {"vocab": VOCAB, "hidden": 32, "num_target_layers": 4, "layer_ids": (0, 2), "block_size": 4}
    drafters = {"dflash": DFlashDrafter.random(tiny_config(**config), dtype=torch.float64, seed=1),
                "domino": DominoDrafter.random(tiny_config(domino=True, **config), dtype=torch.float64, seed=2)}
    # the profile as measured: live-corrected costs make a cost-aware method's trees depend on the
    # moment's timings, and these tests check that records do not depend on sharding or order
    return Session(target, CharTokenizer(), drafters, costs=CostSource.parse("profile"))


def prompt_files(folder: Path) -> tuple[str, str]:
    single = folder / "qa.jsonl"
    single.write_text("".join(json.dumps({"prompt": f"say {w}"}) + "\n" for w in ("one", "two", "three")))
    chat = folder / "chat.jsonl"
    chat.write_text("".join(json.dumps({"question_id": 7 + i, "turns": [f"hi {i}", f"more {i}"]}) + "\n"
                            for i in range(2)))
    return str(single), str(chat)


CONFIG = ab.BenchConfig(methods=METHODS, budgets=(4,), temperatures=TEMPERATURES, prompts=2,
                            max_new_tokens=8, warmup_tokens=2, datasets=("unset",))


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """(config, harness, output folder) of one unsharded run, merged and reported."""
    folder = tmp_path_factory.mktemp("bench")
    config = attrs.evolve(CONFIG, datasets=prompt_files(folder))
    harness = make_harness()
    ab.run_shard(config, harness, folder / "out", progress=False)
    ab.merge_shards(folder / "out")
    ab.write_report(folder / "out", resamples=50)
    return config, harness, folder / "out"


def by_key(records) -> dict[tuple, dict[str, ab.BenchRecord]]:
    cells: dict = {}
    for r in records:
        cells.setdefault(r.key, {})[r.method] = r
    return cells


def without_times(record) -> dict:
    return {k: v for k, v in attrs.asdict(record).items() if k not in TIMES}


# ---------------------------------------------------------------------------- methods, seeds, config
def test_methods_expand_over_budgets_with_ar_first():
    names = [m.name for m in ab.expand_methods(["dflash", "ddtree", "ar", "ddtree@4", "ddtree:domino",
                                                    "domino", "chain"], [4, 8])]
    assert names == ["ar", "dflash", "ddtree@4", "ddtree@8", "ddtree@4:domino", "ddtree@8:domino", "domino"]
    assert parse_method("chain") == parse_method("dflash")  # the chain over the default drafter: one method, one name
    assert [m.budget for m in ab.expand_methods(["ddtree@32"], [4])] == [None, 32]
    expanded = ab.expand_methods(["ddtree", "ddtree:domino", "caddtree"], [4, 8])
    assert all(m == parse_method(m.name) for m in expanded)  # a copy at the budget, as its name parses
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        ab.expand_methods(["nope"], [4])


def test_pair_seed_depends_on_the_turn_not_on_the_method():
    seeds = {ab.pair_seed(0, "d", p, t, temp) for p in ("a", "b") for t in (0, 1) for temp in (0.0, 1.0)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert ab.pair_seed(0, "d", "a", 0, 1.0) == ab.pair_seed(0, "d", "a", 0, 1.0)
    assert ab.pair_seed(1, "d", "a", 0, 1.0) != ab.pair_seed(0, "d", "a", 0, 1.0)


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="prompts must be >= 1"):
        ab.BenchConfig(prompts=0)
    with pytest.raises(ValueError, match="temperatures must be >= 0"):
        ab.BenchConfig(temperatures=(-1,))
    with pytest.raises(ValueError, match="rank 2 outside a world of 2"):
        ab.Shard(2, 2)
    with pytest.raises(ValueError, match="needs a domino drafter"):
        Session(make_harness().target, CharTokenizer()).decoders(
            ab.expand_methods(["domino"], []))


def test_command_line_options_override_the_preset(tmp_path, capsys):
    from treespec.apps.commands import bench as command

    parser = __import__("argparse").ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--preset", "smoke", "--methods", "ar,ddtree", "--budgets", "16,64",
                              "--temperatures", "0,0.7", "--no-stop", "--out", str(tmp_path)])
    config = command.config_from_args(args)
    assert (config.methods, config.budgets, config.temperatures) == (("ar", "ddtree"), (16, 64), (0.0, 0.7))
    assert config.prompts == ab.BENCH_PRESETS["smoke"].prompts and config.stop_at_eos is False
    assert main(["bench", "--methods", "ar"]) == 2
    assert "--out DIR is required" in capsys.readouterr().err
    assert main(["bench", "report", str(tmp_path)]) == 2
    assert "no records.jsonl" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the run
def test_every_method_prompt_turn_and_temperature_is_recorded_with_ar(bench):
    _, _, out = bench
    records = list(read_records(out / ab.RECORDS))
    turns = 2 * 1 + 2 * 2  # two single-turn prompts, two two-turn prompts
    assert len(records) == turns * len(TEMPERATURES) * len(EXPANDED)
    cells = by_key(records)
    assert len(cells) == turns * len(TEMPERATURES)
    canonical = ("ar", *sorted(EXPANDED[1:]))  # AR first, then by name
    assert all(tuple(methods) == canonical for methods in cells.values())
    assert Counter(r.turn for r in records if r.dataset == "chat") == {0: 24, 1: 24}
    assert not list(out.glob("*-rank*.jsonl"))  # shards merged away
    budgets = {(r.method, r.budget) for r in records}
    assert budgets == {(m, 4 if "@" in m else 0) for m in EXPANDED}


def test_outputs_equal_ar_at_both_temperatures_with_paired_seeds(bench):
    _, _, out = bench
    cells = by_key(read_records(out / ab.RECORDS))
    for methods in cells.values():
        ar = methods["ar"]
        assert all(r.tokens == ar.tokens and r.seed == ar.seed for r in methods.values())
        assert all(sum(r.taus) == len(r.tokens) for r in methods.values())
    assert (out / ab.DIVERGENCES).read_text() == ""
    greedy = {k[2:]: m["ar"].tokens for k, m in cells.items() if k[1] == 0.0}
    sampled = {k[2:]: m["ar"].tokens for k, m in cells.items() if k[1] == 1.0}
    assert greedy != sampled  # T = 1 really samples, so its equality with AR is not the greedy one
    assert len({m["ar"].seed for m in cells.values()}) == len(cells)


def test_second_turn_is_asked_after_ar_answer_to_the_first(bench):
    _, harness, out = bench
    cells = by_key(read_records(out / ab.RECORDS))
    prompt = next(p for p in ab.bench_prompts(attrs.evolve(CONFIG, datasets=(str(out.parent / "chat.jsonl"),))))
    for temperature in TEMPERATURES:
        first, second = (cells[("chat", temperature, prompt.id, t)]["ar"] for t in (0, 1))
        ids = harness.chat.encode(prompt.turns, [harness.chat.decode(first.tokens)])
        again = SpeculativeDecoder(harness.target).generate(
            ids, max_new_tokens=CONFIG.max_new_tokens, temperature=temperature, stop_token_ids=[EOS],
            generator=torch.Generator().manual_seed(second.seed))
        assert again.tokens.tolist() == second.tokens


def test_report_is_reproducible_byte_for_byte(bench):
    _, _, out = bench
    names = ("summary.csv", "pairs.csv", "summary.md", "lossless.md", "tau_hist.svg", "tau_hist.png",
             "budget_curves.svg", "budget_curves.png")
    before = {n: (out / n).read_bytes() for n in names}
    for n in names:
        (out / n).unlink()
    assert main(["bench", "report", str(out), "--resamples", "50"]) == 0
    assert {n: (out / n).read_bytes() for n in names} == before
    assert "| dominotree@4 | 4 |" in before["summary.md"].decode()
    lossless = before["lossless.md"].decode()
    assert lossless.count("all 30 outputs equal AR's token for token.") == 2


@pytest.mark.slow
def test_sharded_runs_merge_to_the_unsharded_records(bench, tmp_path):
    config, harness, out = bench
    for rank in (1, 0):  # finishing order does not matter
        ab.run_shard(config, harness, tmp_path, ab.Shard(rank, 2), progress=False)
    parts = [list(read_records(ab.shard_paths(tmp_path, r)[0])) for r in (0, 1)]
    assert {r.prompt_id for r in parts[0]}.isdisjoint({r.prompt_id for r in parts[1]}) and all(parts)
    merged = list(read_records(ab.merge_shards(tmp_path)))
    assert [without_times(r) for r in merged] == [without_times(r) for r in read_records(out / ab.RECORDS)]
    ab.run_shard(config, harness, tmp_path, ab.Shard(0, 2), progress=False)
    (tmp_path / "records-rank1.jsonl").write_text((tmp_path / "records-rank0.jsonl").read_text())
    with pytest.raises(ValueError, match="duplicate record"):
        ab.merge_shards(tmp_path)


# ---------------------------------------------------------------------------- losslessness check
class Corrupt:
    """A decoder whose answers change one token: what a lossy method would do."""

    def __init__(self, inner: SpeculativeDecoder, position: int) -> None:
        self.inner, self.position = inner, position

    def generate(self, ids, **kwargs):
        out = self.inner.generate(ids, **kwargs)
        if out.tokens.numel() > self.position:  # the warm-up is shorter
            out.tokens[self.position] = (out.tokens[self.position] + 1) % VOCAB
        return out


class CorruptSession(Session):
    def decoder(self, method, **options):
        decoder = super().decoder(method, **options)
        return Corrupt(decoder, 3) if method.name == "dflash" else decoder


def ar_scores(harness, prompt: torch.Tensor, ar, k: int) -> torch.Tensor:
    """[V] what AR's token k was chosen by: logits, plus T x the Gumbel noise of its position at T > 0."""
    with torch.inference_mode():
        logits = harness.target.model(torch.cat([prompt, torch.tensor(ar.tokens[:k])])[None]).logits[0, -1]
    if ar.temperature == 0:
        return logits
    generator = torch.Generator().manual_seed(ar.seed)
    sampling = SamplingParams(ar.temperature, key=sampling_key(generator))  # the key the decoder draws first
    noise = gumbel_noise(torch.tensor([prompt.numel() + k]), VOCAB, sampling, generator, logits.device,
                         torch.float64)[0]
    return logits + ar.temperature * noise


def test_a_divergence_from_ar_is_listed_with_the_ar_decision_margin(tmp_path):
    single, _ = prompt_files(tmp_path)
    base = make_harness()
    harness = CorruptSession(base.target, base.tokenizer, base.drafters)
    config = attrs.evolve(CONFIG, methods=("ar", "dflash"), temperatures=(0.0, 0.5), datasets=(single,),
                          prompts=1, stop_at_eos=False)
    ab.run_shard(config, harness, tmp_path / "out", progress=False)
    ab.merge_shards(tmp_path / "out")
    divergences = ab.read_divergences(tmp_path / "out" / ab.DIVERGENCES)
    ars = {r.temperature: r for r in read_records(tmp_path / "out" / ab.RECORDS) if r.method == "ar"}
    prompt = harness.chat.encode(ab.bench_prompts(config)[0].turns, [])
    assert [d.temperature for d in divergences] == [0.0, 0.5]
    for div in divergences:
        ar = ars[div.temperature]
        top = ar_scores(harness, prompt, ar, 3).topk(2)
        assert int(top.indices[0]) == ar.tokens[3]  # the scores of the right position: AR's pick is their argmax
        assert (div.method, div.position, div.ar_token) == ("dflash", 3, ar.tokens[3])
        assert div.gap == pytest.approx(float(top.values[0] - top.values[1]), abs=1e-9)
        assert div.tolerance == harness.target.numerics().tolerance and not div.acceptable
        assert attrs.evolve(div, tolerance=div.gap).acceptable
    assert main(["bench", "report", str(tmp_path / "out"), "--resamples", "20"]) == 1  # flagged
    text = (tmp_path / "out" / "lossless.md").read_text()
    assert text.count("BEYOND TOLERANCE") == 2 and text.count("1 of 1 responses differ from AR's") == 2


def test_first_difference_counts_a_shorter_answer():
    assert ab.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert ab.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert ab.first_difference([1, 2], [1, 2, 0]) == 2


# ---------------------------------------------------------------------------- interruption and resumption
def test_an_interrupted_run_resumes_to_the_uninterrupted_records(bench, tmp_path, monkeypatch, capsys):
    config, harness, out = bench
    calls = {"n": 0}
    measure = ab.measure.Runner.measure

    def interrupted(self, turn):
        calls["n"] += 1
        if calls["n"] == 5:  # the fifth measured turn (the warm-up does not call measure)
            raise KeyboardInterrupt
        return measure(self, turn)

    monkeypatch.setattr(ab.measure.Runner, "measure", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ab.run_shard(config, harness, tmp_path, progress=False)
    monkeypatch.setattr(ab.measure.Runner, "measure", measure)
    rec_path = ab.shard_paths(tmp_path, 0)[0]
    saved = list(read_records(rec_path))
    conversations = {(r.dataset, r.prompt_id, r.temperature) for r in saved}
    assert len(conversations) == 4 and len(saved) == 4 * len(EXPANDED)  # the four finished before the fifth turn
    with open(rec_path, "a") as fh:
        fh.write('{"method": "ar", "trunc')  # a crash in the middle of a write
    ab.run_shard(config, harness, tmp_path, progress=False)
    assert "truncated last line" in capsys.readouterr().err
    merged = list(read_records(ab.merge_shards(tmp_path)))
    expected = list(read_records(out / ab.RECORDS))
    assert len(merged) == len(expected)
    assert sorted(json.dumps(without_times(r), sort_keys=True) for r in merged) == \
        sorted(json.dumps(without_times(r), sort_keys=True) for r in expected)


def test_an_output_folder_of_another_configuration_is_refused(tmp_path):
    settings = {"prompts": 2, "methods": ["ar"]}
    assert ab.prepare_out(tmp_path, settings) == "new"
    ab.write_settings(tmp_path, settings)
    (tmp_path / ab.RECORDS).write_text("")
    assert ab.prepare_out(tmp_path, settings) == "resume"  # the merged records become the shard again
    assert ab.shard_paths(tmp_path, 0)[0].is_file() and not (tmp_path / ab.RECORDS).exists()
    with pytest.raises(ValueError, match=r"another bench configuration \(differs in prompts\).*--overwrite"):
        ab.prepare_out(tmp_path, {"prompts": 3, "methods": ["ar"]})
    assert ab.shard_paths(tmp_path, 0)[0].is_file()  # nothing lost
    assert ab.prepare_out(tmp_path, {"prompts": 3, "methods": ["ar"]}, overwrite=True) == "overwrite"
    assert not ab.shard_paths(tmp_path, 0)[0].exists()


def test_new_weights_at_the_same_path_are_another_configuration(tmp_path):
    from safetensors.torch import save_file

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    save_file({"w": torch.zeros(3)}, drafter / "model.safetensors")
    before = ab.weights_identity(drafter)
    settings = {"prompts": 2, "drafters": {"dflash": before}}
    out = tmp_path / "out"
    out.mkdir()
    ab.write_settings(out, settings)
    (out / ab.RECORDS).write_text("")
    save_file({"w": torch.ones(3)}, drafter / "model.safetensors")  # retrained, saved over the old one
    after = ab.weights_identity(drafter)
    assert after["path"] == before["path"] and after["sha256"] != before["sha256"]
    with pytest.raises(ValueError, match=r"differs in drafters"):
        ab.prepare_out(out, {"prompts": 2, "drafters": {"dflash": after}})
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        ab.weights_identity(tmp_path)


def test_a_failing_bench_leaves_an_existing_folder_untouched(tmp_path, capsys):
    from treespec.apps.cli import main

    (tmp_path / ab.SETTINGS).write_text('{"kept": true}\n')
    (tmp_path / ab.RECORDS).write_text("")
    assert main(["bench", "--methods", "ar,ddtree@0", "--out", str(tmp_path)]) == 2
    assert "budget must be an integer >= 1" in capsys.readouterr().err
    assert main(["bench", "--datasets", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert (tmp_path / ab.SETTINGS).read_text() == '{"kept": true}\n'


def test_options_in_method_names_set_the_policys_own_fields_and_bad_ones_are_named():
    from treespec.apps.assembly.methods import build_policy, with_budget

    method = parse_method("eagle2@16+topk=4+depth=3")
    assert method.options == {"topk": 4, "depth": 3} and method.budget == 16
    policy = build_policy(method)
    assert (policy.budget, policy.topk, policy.depth) == (16, 4, 3)
    assert build_policy(parse_method("ddtree@16+backend=networkx")).backend == "networkx"  # a policy's own field
    assert with_budget(parse_method("eagle2+topk=4:domino"), 32).name == "eagle2@32+topk=4:domino"
    assert [m.name for m in ab.expand_methods(["eagle2+topk=2"], [8, 16])][1:] == ["eagle2@8+topk=2", "eagle2@16+topk=2"]
    for text, message in [("eagle2@16+tpk=4", "eagle2 has no option 'tpk'; its options: backend, depth, topk"),
                          ("eagle2@16+topk=x", "option topk='x': not a valid int"),
                          ("eagle2@16+topk", "an option is KEY=VALUE"),
                          ("eagle2@16+topk=2+topk=3", "given twice"),
                          ("ddtree@16+stop=1", "ddtree has no option 'stop'; its options: backend"),
                          ("ddtree@16+backend=jax", "unknown backend 'jax'")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_method(text)


def test_a_verifier_in_the_method_name_checks_that_methods_trees(tmp_path):
    """``POLICY@B/VERIFIER``: parsed once, kept by budgets and option sweeps, refused by name when
    unknown or when its policy cannot feed it; the bench decodes with it and records it (at T = 0
    every exact verifier is greedy decoding, so the output equals AR's)."""
    from treespec.apps.assembly.methods import with_budget, with_options

    method = parse_method("ddtree-sampled@8/recursive-rejection")
    assert (method.policy, method.budget, method.verifier) == ("ddtree-sampled", 8, "recursive-rejection")
    assert parse_method("ddtree@8").verifier == "match"
    assert with_budget(method, 16).name == "ddtree-sampled@16/recursive-rejection"
    assert with_options(parse_method("eagle2@8:domino/match"), {"topk": "2"}).name == "eagle2@8+topk=2:domino"
    assert parse_method("dominotree-sampled@16+shape=fixed/recursive-rejection").family == \
        "dominotree-sampled+shape=fixed/recursive-rejection"
    with pytest.raises(ValueError, match="unknown verifier 'nosuch'; available: match"):
        parse_method("ddtree@8/nosuch")
    harness = make_harness()
    with pytest.raises(ValueError, match="recursive-rejection"):
        harness.decoders([parse_method("ddtree@4/recursive-rejection")])  # a deterministic tree cannot feed it
    single, _ = prompt_files(tmp_path)
    config = attrs.evolve(CONFIG, methods=("ar", "ddtree-sampled/recursive-rejection"), temperatures=(0.0, 1.0),
                          datasets=(single,), prompts=2)
    ab.run_shard(config, harness, tmp_path / "out", progress=False)
    ab.merge_shards(tmp_path / "out")
    records = list(ab.read_records(tmp_path / "out" / ab.RECORDS))
    sampled = [r for r in records if r.method == "ddtree-sampled@4/recursive-rejection"]
    assert len(sampled) == 4 and {r.verifier for r in sampled} == {"recursive-rejection"}
    ar = {r.key: r for r in records if r.method == "ar"}
    assert all(r.tokens == ar[r.key].tokens for r in sampled if r.temperature == 0.0)


def test_rejection_verifiers_at_t_above_0_are_not_compared_token_for_token(tmp_path):
    """Recursive rejection samples from the target's distribution without AR's draws: at T > 0 its
    outputs are reported as distribution-exact, not counted as divergences; at T = 0 they are checked."""
    from treespec.apps.bench.lossless import lossless_text, token_comparable

    single, _ = prompt_files(tmp_path)
    config = attrs.evolve(CONFIG, methods=("ar", "ddtree-sampled/recursive-rejection", "ddtree"),
                          temperatures=(0.0, 1.0), datasets=(single,), prompts=3)
    ab.run_shard(config, make_harness(), tmp_path / "out", progress=False)
    ab.merge_shards(tmp_path / "out")
    records = list(ab.read_records(tmp_path / "out" / ab.RECORDS))
    sampled = [r for r in records if r.verifier == "recursive-rejection"]
    assert [token_comparable(r) for r in sampled] == [r.temperature == 0.0 for r in sampled]
    assert all(token_comparable(r) for r in records if r.verifier == "match")
    text, bad = lossless_text(records, ab.read_divergences(tmp_path / "out" / ab.DIVERGENCES))
    assert bad == 0
    assert "3 responses of ddtree-sampled@4/recursive-rejection are not compared with AR's" in text
    t1 = text.split("### T = 1")[1]
    assert "all 3 outputs equal AR's token for token" in t1  # only ddtree@4 (match) is compared at T = 1


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(["ddtree", "dominotree", "eagle2", "ddtree-sampled"]),
       budget=st.one_of(st.none(), st.integers(1, 512)), drafter=st.sampled_from([None, "dflash", "domino"]),
       verifier=st.sampled_from(["match", "recursive-rejection"]), topk=st.one_of(st.none(), st.integers(1, 32)))
def test_a_method_name_is_made_from_its_fields_and_reads_back_to_them(policy, budget, drafter, verifier, topk):
    """`MethodSpec.name` is derived from the fields (never the text as typed), and parsing it gives the
    same spec: one name per method, so records of ``ddtree@16`` and ``ddtree@16:dflash`` pool as one."""
    from treespec.apps.assembly.methods import MethodSpec, default_drafter

    if drafter == "dflash" and policy == "dominotree":
        drafter = "domino"  # a marginal drafter cannot feed DominoTree (refused; tested elsewhere)
    options = {"topk": topk} if topk is not None and policy == "eagle2" else {}
    spec = MethodSpec(policy, drafter or default_drafter(policy), budget, options, verifier)
    again = parse_method(spec.name)
    assert again == spec
    assert again.family == attrs.evolve(spec, budget=None).name
    assert ("@" in spec.name) == (budget is not None)
    assert (":" in spec.name) == (spec.drafter != default_drafter(policy))
    assert spec.name.endswith("/recursive-rejection") == (verifier != "match")


def test_a_second_bench_into_a_folder_being_written_is_refused_at_its_start(tmp_path, capsys):
    import fcntl
    import os

    from treespec.apps.bench.outdir import LOCK
    from treespec.apps.cli import main

    out = tmp_path / "bench"
    out.mkdir()
    held = os.open(out / LOCK, os.O_RDWR | os.O_CREAT)
    os.write(held, b"4242")
    fcntl.flock(held, fcntl.LOCK_EX)  # the first run, still writing
    try:
        assert main(["bench", "--methods", "ar", "--prompts", "1", "--out", str(out), "--no-progress",
                     "--model", str(tmp_path / "not-loaded")]) == 2
    finally:
        os.close(held)
    err = capsys.readouterr().err
    assert f"{out} is being written by another run (process 4242)" in err
    assert sorted(p.name for p in out.iterdir()) == [LOCK]  # nothing written: the folder stays usable
