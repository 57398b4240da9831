"""Bench tables: speedup arithmetic, paired intervals, byte-for-byte reproducibility."""

from __future__ import annotations

import json
import random

import attrs
import pytest

from treespec.apps.bench.records import BenchRecord, read_records, write_records
from treespec.apps.bench.summary import compare_pairs, markdown_table, summarize, write_csv


def make_records(n_prompts=12, seed=0):
    rng = random.Random(seed)
    out = []
    for p in range(n_prompts):
        toks = [rng.randrange(100) for _ in range(20)]
        for method, tpt, taus in (("ar", 0.04, [1, 1]), ("ddtree@16", 0.02, [2, 3]), ("chain", 0.03, [1, 2])):
            jitter = 1 + 0.1 * rng.random()
            out.append(BenchRecord(method=method, policy=method.split("@")[0], budget=16 if "@" in method else 0,
                                   temperature=0.0, dataset="toy", prompt_id=str(p), turn=0, seed=0,
                                   tokens=toks if method != "chain" or p else toks[:-1] + [999],
                                   taus=taus * 4, decode_time=tpt * jitter * 20, prefill_time=0.1,
                                   stage_times={"draft": 0.0}))
    return out


def test_speedup_is_ar_time_per_token_over_method_time_per_token():
    summary = {s.method: s for s in summarize(make_records())}
    assert summary["ar"].speedup == pytest.approx(1.0)
    assert 1.7 < summary["ddtree@16"].speedup < 2.3
    s = summary["ddtree@16"]
    assert s.speedup_lo <= s.speedup <= s.speedup_hi
    assert summary["chain"].lossless == pytest.approx(11 / 12)  # prompt 0 differs from AR
    assert summary["ddtree@16"].lossless == 1.0


def test_pairs_are_paired_by_prompt():
    pairs = {(c.a, c.b): c for c in compare_pairs(make_records())}
    c = pairs[("chain", "ddtree@16")]
    assert c.tau_diff == pytest.approx(1.5 - 2.5)
    assert c.tau_diff_lo == pytest.approx(-1.0) and c.tau_diff_hi == pytest.approx(-1.0)
    assert c.speed_ratio_lo <= c.speed_ratio <= c.speed_ratio_hi
    assert c.speed_ratio < 1  # ddtree (b) is faster than chain (a)


def test_tables_are_reproducible_from_jsonl(tmp_path):
    path = tmp_path / "r.jsonl"
    write_records(path, make_records())
    texts = []
    for _ in range(2):
        recs = list(read_records(path))
        texts.append(write_csv(summarize(recs)) + write_csv(compare_pairs(recs)) + markdown_table(summarize(recs)))
    assert texts[0] == texts[1]
    assert "| ddtree@16 | 12 |" in texts[0]


def test_missing_ar_and_malformed_lines_are_errors(tmp_path):
    with pytest.raises(ValueError, match="no 'ar' records"):
        summarize([r for r in make_records() if r.method != "ar"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"method": "ar"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: malformed"):
        list(read_records(bad))


def test_plots_are_written_reproducibly(tmp_path):
    from treespec.apps.bench.plots import plot_budget_curves, plot_tau_histograms

    recs = make_records()
    a = plot_tau_histograms(recs, tmp_path / "a.svg").read_bytes()
    b = plot_tau_histograms(recs, tmp_path / "b.svg").read_bytes()
    assert a == b and b"<svg" in a
    assert plot_budget_curves(summarize(recs), tmp_path / "c.png").stat().st_size > 1000


def test_two_datasets_add_a_pooled_cell_paired_within_each_dataset():
    """The pooled cell holds every prompt turn once, even where prompt ids repeat across datasets."""
    import attrs

    from treespec.apps.bench.summary import POOLED

    a, b = make_records(6, seed=1), make_records(6, seed=2)  # the same prompt ids "0".."5" in both
    records = [attrs.evolve(r, dataset="x") for r in a] + [attrs.evolve(r, dataset="y") for r in b]
    cells = {(s.dataset, s.method): s for s in summarize(records)}
    assert {d for d, _ in cells} == {"x", "y", POOLED}
    pooled, x, y = (cells[(d, "ddtree@16")] for d in (POOLED, "x", "y"))
    assert pooled.prompts == x.prompts + y.prompts == 12
    assert min(x.speedup, y.speedup) <= pooled.speedup <= max(x.speedup, y.speedup)
    assert cells[(POOLED, "chain")].lossless == pytest.approx(10 / 12)  # prompt 0 differs in each dataset
    pairs = {(c.dataset, c.a, c.b): c for c in compare_pairs(records)}
    assert pairs[(POOLED, "chain", "ddtree@16")].tau_diff == pytest.approx(-1.0)
    assert {s.dataset for s in summarize(a)} == {"toy"}  # one dataset: no pooled copy of it
    with pytest.raises(ValueError, match="dataset 'all', the name of the pooled cell"):
        summarize([attrs.evolve(r, dataset=POOLED) for r in a] + records)


def test_a_dataset_named_like_the_pooled_cell_or_like_another_is_refused(tmp_path):
    from treespec.apps.bench.config import BenchConfig, bench_prompts

    row = json.dumps({"prompt": "say one"}) + "\n"
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "qa.jsonl").write_text(row)
    (tmp_path / "all.jsonl").write_text(row)
    with pytest.raises(ValueError, match="named 'all', the name of the report's pooled cell"):
        bench_prompts(BenchConfig(datasets=(str(tmp_path / "all.jsonl"),), prompts=1))
    with pytest.raises(ValueError, match="both named 'qa'.*would mix"):
        bench_prompts(BenchConfig(datasets=(str(tmp_path / "a" / "qa.jsonl"), str(tmp_path / "b" / "qa.jsonl")),
                                  prompts=1))
    assert len(bench_prompts(BenchConfig(datasets=(str(tmp_path / "a" / "qa.jsonl"),), prompts=1))) == 1


def test_the_report_says_when_a_cell_pools_several_runs():
    from treespec.apps.bench.records import BenchRecord
    from treespec.apps.bench.report import pooled_runs_note

    def record(method, prompt, run):
        return BenchRecord(method, method, 0, 0.0, "gsm8k", prompt, 0, 1, [1, 2], [1, 1], 1.0, 0.1, {}, run=run)

    one = [record(m, p, "r1") for m in ("ar", "ddtree@16") for p in ("a", "b")]
    assert pooled_runs_note(one) == ""
    two = one[:2] + [record(m, "b", "r2") for m in ("ar", "ddtree@16")]
    assert "gsm8k T=0 (2 runs)" in pooled_runs_note(two)
    assert pooled_runs_note([attrs.evolve(r, run="") for r in two]) == ""  # records of older versions name none


def test_the_decisions_table_says_why_a_cost_aware_method_ran_as_ar():
    """Per method that priced its trees or ran AR rounds: rounds drafted and AR, explorations, the mean tree
    size, generations decoded without drafting and the break-even of its budget under the curve it priced
    with; AR and a fixed tree that always drafted have no row."""
    from treespec.apps.bench.decisions import break_even, decisions_table
    from treespec.pricing.cost import LinearCost

    curve = LinearCost(draft=0.002, base=0.01, per_token=0.004).to_dict()  # C_v(n) = 0.01 + 0.004 n

    def rec(method, budget, decisions, models=()):
        return BenchRecord(method=method, policy=method.split("@")[0], budget=budget, temperature=0.0, dataset="d",
                           prompt_id="1", turn=0, seed=0, tokens=[1], taus=[1], decode_time=1.0, prefill_time=0.0,
                           stage_times={}, decisions=decisions, cost_models=list(models), cost_rounds=[0] * len(models))

    records = [rec("ar", 0, {}),
               rec("ddtree@16", 16, {"drafted": 10, "ar": 0, "explored": 0, "tree_tokens": 170, "undrafted": False}),
               rec("caddtree@16", 16, {"drafted": 4, "ar": 20, "explored": 1, "tree_tokens": 30, "undrafted": False},
                   [curve]),
               rec("caddtree@16", 16, {"drafted": 0, "ar": 24, "explored": 0, "tree_tokens": 0, "undrafted": True})]
    table = decisions_table(records, ["ar", "ddtree@16", "caddtree@16"]).splitlines()
    assert len(table) == 3 and table[2].split() == ["caddtree@16", "4", "44", "1", "7.5", "1/2", "5.71"]
    assert break_even(curve, 16) == pytest.approx((0.002 + 0.01 + 0.004 * 17) / (0.01 + 0.004))
    assert decisions_table(records[:2], ["ar", "ddtree@16"]) == ""
