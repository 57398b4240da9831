"""Replay comparisons (treespec/apps/replay/compare.py, `treespec replay eval --budgets/--set/--baseline/--out`).

* A sweep crosses every method with the budgets and with the option values its own policy has;
  an option no swept policy has, a bad value and a repeated name are refused, naming them.
* The table's tau is the pooled tau of `evaluate`; the paired difference is recomputed here from
  the per-prompt taus; a method against itself differs by exactly 0 on every resample; intervals
  hold their point estimates; a baseline without a budget is taken at each method's budget.
* Against another trace of the same prompts and target answers (`--against`), each method is
  paired with itself replayed there; traces of other prompts, other answers or another length are
  refused, naming the difference.
* The CLI writes the table, the per-prompt values and the plot to a new folder, refuses to write
  into a used one without --overwrite (leaving its files as they were), and names bad flags.
* The bench and replay plots bound their y axes to the intervals, never to a sliver around dots.
"""

from __future__ import annotations

import csv

import pytest
import torch
from test_replay import World

from treespec.apps.assembly.session import Session
from treespec.apps.cli import main
from treespec.apps.replay import RecordConfig, Trace, compare, compare_traces, evaluate, expand_sweep, record_trace
from treespec.apps.replay.compare import markdown_table, per_prompt_rows, pooled_tau


@pytest.fixture(scope="module")
def world():
    return World(16, RecordConfig(max_new_tokens=16, max_budget=64), n_prompts=4, seed=3)


@pytest.fixture(scope="module")
def trace_file(world, tmp_path_factory):
    return world.trace.save(tmp_path_factory.mktemp("trace") / "trace.safetensors")


def test_a_sweep_crosses_budgets_with_each_policys_own_options():
    methods = expand_sweep(["dflash", "ddtree", "eagle2", "dominotree@8"], [4, 8], {"topk": ["2", "4"]})
    names = [m.name for m in methods]
    assert names == ["dflash", "ddtree@4", "ddtree@8", "eagle2@4+topk=2", "eagle2@8+topk=2", "eagle2@4+topk=4",
                     "eagle2@8+topk=4", "dominotree@8"]
    assert [m.options for m in methods if m.policy == "eagle2"] == [{"topk": 2}] * 2 + [{"topk": 4}] * 2
    assert all(m.budget == int(m.name.split("@")[1].split("+")[0]) for m in methods if "@" in m.name)


def test_two_options_make_a_grid():
    names = [m.name for m in expand_sweep(["eagle2@16"], (), {"topk": ["2", "4"], "depth": ["3", "5"]})]
    assert names == ["eagle2@16+topk=2+depth=3", "eagle2@16+topk=2+depth=5", "eagle2@16+topk=4+depth=3",
                     "eagle2@16+topk=4+depth=5"]


@pytest.mark.parametrize("methods, settings, message", [
    (["ddtree", "dominotree"], {"topk": ["2"]}, "none of the swept policies \\(ddtree, dominotree\\) has an option 'topk'"),
    (["eagle2"], {"topk": ["two"]}, "eagle2 option topk='two': not a valid int"),
    (["ddtree@4", "ddtree"], {}, "the sweep names ddtree@4 more than once"),
])
def test_bad_sweeps_are_refused_naming_the_problem(methods, settings, message):
    with pytest.raises(ValueError, match=message):
        expand_sweep(methods, [4], settings)


def test_the_table_holds_the_replayed_tau_and_the_paired_difference(world):
    methods = expand_sweep(["ddtree", "dominotree", "eagle2+topk=2"], [4, 16])
    results = evaluate(world.trace, methods)
    rows = {r.method: r for r in compare(results, methods, baseline="ddtree", resamples=300)}
    taus = {r.method: r.taus for r in results}
    for result in results:
        row = rows[result.method]
        assert row.tau == pytest.approx(result.mean_tau) and row.rounds == result.rounds and row.prompts == 4
        assert row.tau_lo <= row.tau <= row.tau_hi
        assert row.baseline == f"ddtree@{row.budget}"  # the baseline at the method's own budget
        base = taus[row.baseline]
        assert row.diff == pytest.approx(pooled_tau(result.taus, range(4)) - pooled_tau(base, range(4)))
        assert row.diff_lo <= row.diff + 1e-12 and row.diff - 1e-12 <= row.diff_hi
    assert (rows["ddtree@16"].diff, rows["ddtree@16"].diff_lo, rows["ddtree@16"].diff_hi) == (0.0, 0.0, 0.0)
    table = markdown_table(list(rows.values()))
    assert "tau − baseline [95% paired CI]" in table and "| ddtree@16 |" in table


def test_a_baseline_that_was_not_replayed_is_named(world):
    methods = expand_sweep(["dominotree@4"])
    with pytest.raises(ValueError, match="baseline ddtree@4 was not replayed"):
        compare(evaluate(world.trace, methods), methods, baseline="ddtree")


def test_per_prompt_rows_hold_each_prompts_tau(world):
    results = evaluate(world.trace, ["ddtree@4"])
    rows = per_prompt_rows(results, ["a", "b", "c", "d"])
    assert [r["prompt_id"] for r in rows] == ["a", "b", "c", "d"]
    for row, taus in zip(rows, results[0].taus):
        assert (row["rounds"], row["tokens"]) == (len(taus), sum(taus))
        assert row["tau"] == pytest.approx(sum(taus) / len(taus))


def test_cli_sweeps_with_a_baseline_into_a_new_folder(world, trace_file, tmp_path, capsys):
    out = tmp_path / "sweep"
    args = ["replay", "eval", str(trace_file), "--methods", "ddtree,eagle2", "--budgets", "4,8", "--set", "topk=2,4",
            "--baseline", "ddtree", "--out", str(out), "--resamples", "200"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "eagle2@8+topk=4" in printed and "ddtree@8" in printed
    with open(out / "table.csv") as fh:
        table = list(csv.DictReader(fh))
    assert [r["method"] for r in table] == ["ddtree@4", "ddtree@8", "eagle2@4+topk=2", "eagle2@8+topk=2",
                                            "eagle2@4+topk=4", "eagle2@8+topk=4"]
    assert {r["options"] for r in table} == {"", "topk=2", "topk=4"}
    with open(out / "per_prompt.csv") as fh:
        per_prompt = list(csv.DictReader(fh))
    assert len(per_prompt) == 6 * 4
    expected = evaluate(world.trace, ["eagle2@8+topk=2"])[0]
    mine = [r for r in per_prompt if r["method"] == "eagle2@8+topk=2"]
    assert [int(r["tokens"]) for r in mine] == [sum(t) for t in expected.taus]
    assert (out / "budget_curves.svg").read_bytes().startswith(b"<?xml")
    before = (out / "table.md").read_bytes()
    assert main(args) == 2  # a used folder is never silently rewritten
    assert "pass --overwrite" in capsys.readouterr().err and (out / "table.md").read_bytes() == before
    assert main([*args, "--overwrite"]) == 0


@pytest.mark.parametrize("flags, message", [
    (["--set", "topk"], "--set takes KEY=V1"),
    (["--set", "topk=2", "--set", "topk=4"], "--set topk given twice"),
    (["--budgets", "4,x"], "budget must be an integer >= 1"),
    (["--budgets", "0"], "budget must be an integer >= 1"),
    (["--set", "nosuch=1"], "has an option 'nosuch'"),
])
def test_cli_names_bad_sweep_flags(trace_file, capsys, flags, message):
    assert main(["replay", "eval", str(trace_file), "--methods", "eagle2", *flags]) == 2
    assert message in capsys.readouterr().err


def test_plot_axes_span_the_intervals_not_a_sliver():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from treespec.apps.bench.plots import interval_axes

    fig, ax = plt.subplots()
    interval_axes(ax, "tau", [0.922, 0.936])
    lo, hi = ax.get_ylim()
    assert hi - lo == pytest.approx(0.1) and lo < 0.922 and hi > 0.936
    interval_axes(ax, "tau", [1.0, 3.0, float("nan")])
    assert ax.get_ylim() == pytest.approx((0.8, 3.2))
    plt.close(fig)


def test_an_outside_policy_sweeps_its_own_option_in_one_command(world, trace_file, tmp_path, capsys):
    """tests/sibling_capped.py is registered at run time as a user's package would (conftest): its
    ``siblings`` field sweeps against a baseline with no edit in treespec/."""
    from sibling_capped import NAME

    out = tmp_path / "outside"
    assert main(["replay", "eval", str(trace_file), "--methods", NAME, "--budgets", "4,16", "--set", "siblings=1,3",
                 "--baseline", "dominotree", "--out", str(out), "--resamples", "200"]) == 0
    with open(out / "table.csv") as fh:
        rows = {r["method"]: r for r in csv.DictReader(fh)}
    assert set(rows) == {"dominotree@4", "dominotree@16", f"{NAME}@4+siblings=1", f"{NAME}@16+siblings=1",
                         f"{NAME}@4+siblings=3", f"{NAME}@16+siblings=3"}
    expected = evaluate(world.trace, [f"{NAME}@16+siblings=1"])[0]
    assert float(rows[f"{NAME}@16+siblings=1"]["tau"]) == pytest.approx(expected.mean_tau, abs=1e-4)
    assert rows[f"{NAME}@16+siblings=3"]["baseline"] == "dominotree@16"


@pytest.fixture(scope="module")
def retrained(world, tmp_path_factory):
    """A trace of the same prompts and target answers with other drafters (another seed): a retrained pair."""
    from treespec.drafters.dflash import DFlashDrafter
    from treespec.drafters.domino import DominoDrafter

    def again(kind, seed):
        old = world.drafters[kind]
        return type(old).random(old.config, dtype=torch.float64, seed=seed)

    drafters = {"dflash": again("dflash", 41), "domino": again("domino", 42)}
    assert isinstance(drafters["dflash"], DFlashDrafter) and isinstance(drafters["domino"], DominoDrafter)
    trace = record_trace(Session(world.target, drafters=drafters), world.prompts, config=RecordConfig(max_new_tokens=16, max_budget=64))
    return trace, trace.save(tmp_path_factory.mktemp("retrained") / "retrained.safetensors")


def test_a_method_against_itself_on_another_trace_is_paired_prompt_by_prompt(world, retrained):
    other, _ = retrained
    methods = expand_sweep(["dflash", "ddtree@8", "dominotree@8"])
    mine, theirs = evaluate(world.trace, methods), evaluate(other, methods)
    assert any(a.taus != b.taus for a, b in zip(mine, theirs))  # other drafters, other rounds
    rows = compare_traces(mine, theirs, methods, "retrained", resamples=300)
    for row, a, b in zip(rows, mine, theirs):
        assert row.baseline == f"{row.method} @ retrained" and row.tau == pytest.approx(a.mean_tau)
        assert row.diff == pytest.approx(pooled_tau(a.taus, range(4)) - pooled_tau(b.taus, range(4)))
        assert row.diff_lo <= row.diff + 1e-12 and row.diff - 1e-12 <= row.diff_hi
    same = compare_traces(mine, mine, methods, "itself", resamples=300)
    assert all((r.diff, r.diff_lo, r.diff_hi) == (0.0, 0.0, 0.0) for r in same)


def test_cli_compares_two_traces_into_a_new_folder(world, trace_file, retrained, tmp_path, capsys):
    other, other_file = retrained
    out = tmp_path / "ab"
    assert main(["replay", "eval", str(trace_file), "--methods", "ddtree@8", "dominotree@8", "--against",
                 str(other_file), "--out", str(out), "--resamples", "200"]) == 0
    assert "dominotree@8 @ retrained" in capsys.readouterr().out
    with open(out / "table.csv") as fh:
        table = {r["method"]: r for r in csv.DictReader(fh)}
    mine, theirs = (evaluate(t, ["dominotree@8"])[0].mean_tau for t in (world.trace, other))
    assert float(table["dominotree@8"]["diff"]) == pytest.approx(mine - theirs, abs=5e-5)  # the CSV's 4 decimals


def test_traces_of_other_answers_are_not_paired(world, trace_file, retrained, tmp_path, capsys):
    other, _ = retrained
    shuffled = Trace(other.meta | {"prompts": other.meta["prompts"][::-1]}, other.sequences[::-1], other.drafters)
    bent = list(other.sequences)
    bent[2] = bent[2].clone()
    bent[2][-1] = (bent[2][-1] + 1) % 16
    cases = [(shuffled, "holds other prompts"), (Trace(other.meta, tuple(bent), other.drafters),
                                                  "answers differ from --against"),
             (Trace(other.meta | {"config": other.meta["config"] | {"max_new_tokens": 8}}, other.sequences,
                    other.drafters), "same --max-new-tokens")]
    for i, (bad, message) in enumerate(cases):
        path = bad.save(tmp_path / f"bad{i}.safetensors")
        assert main(["replay", "eval", str(trace_file), "--methods", "ddtree@8", "--against", str(path)]) == 2
        assert message in capsys.readouterr().err
    assert main(["replay", "eval", str(trace_file), "--methods", "ddtree@8", "--against", str(trace_file),
                 "--baseline", "dflash"]) == 2
    assert "name one" in capsys.readouterr().err
