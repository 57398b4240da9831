"""Published tables from raw records (treespec/apps/published/, `treespec bench import / report / reproduce`).

The fixture is written here in the three stored formats of the DominoTree repository (its
harness, the CaDDTree harness as exported there, the released Domino's answer files), small and
with numbers chosen so every convention moves a cell:

* readers keep what the files hold and nothing more (no invented signature, ids or per-round tau);
  a Domino turn with no tokens is left out; bad files are named with the line;
* under the paper's convention each cell is recomputed here by hand: warm-up row dropped, mean
  tokens/s over the AR's, the released Domino over the common AR, the faster mode;
* under treespec's: totals, prompts paired with their AR, and NaN where a source keeps no times;
* pairwise deltas by hand for both pairings; the Python bootstrap is reproducible;
* the diff passes on the values derived here and names a cell that differs; the CLI imports,
  reports, refuses to replace an import, and `reproduce` reads a clone laid out as the repository.
"""

from __future__ import annotations

import csv
import json
import math
import re
import statistics

import attrs
import pytest

from treespec.apps.cli import main
from treespec.apps.published.records import read_records
from treespec.apps.published.report import diff_pairwise, diff_table1, write_tables
from treespec.apps.published.tables import CONVENTIONS, pairwise, table1

PAPER = attrs.evolve(CONVENTIONS["dominotree-4b"], datasets=("gsm8k", "mt-bench"),
                     groups={"Math": ("gsm8k",), "Overall": ("gsm8k", "mt-bench")}, resamples=200)
OURS = attrs.evolve(CONVENTIONS["treespec"], datasets=PAPER.datasets, groups=PAPER.groups, resamples=200)

# per (method, prompt): (tokens, seconds, tau) at T = 0, GSM8K; the first row of each DominoTree-harness
# method is a slow cold start that the paper's convention drops
OURS_ROWS = {"ar": [(100, 4.0, 1.0), (200, 2.0, 1.0), (300, 3.0, 1.0), (400, 4.0, 1.0)],
             "dominotree@16": [(100, 2.0, 5.0), (200, 0.4, 6.0), (300, 0.5, 7.0), (400, 1.0, 8.0)]}
CAD_ROWS = {"baseline": [(100, 1.0, 1.0), (200, 2.0, 1.0), (300, 3.0, 1.0), (400, 4.0, 1.0)],
            "ddtree_tb16": [(100, 0.25, 4.0), (200, 0.5, 4.0), (300, 1.0, 5.0), (400, 0.8, 6.0)]}
# released Domino: per question, (tokens, seconds, acceptance lengths); eager is the faster mode
DOMINO = {"graph": [(100, 1.0, [2, 4]), (200, 2.0, [3]), (300, 3.0, [4]), (400, 4.0, [5])],
          "eager": [(100, 0.5, [2, 4]), (200, 1.0, [3]), (0, 0.0, []), (400, 2.0, [5])]}


def _write_plain(path, rows: dict, signature: bool, times: bool = True) -> None:
    lines = []
    for method, values in rows.items():
        for i, (tokens, seconds, tau) in enumerate(values):
            row = {"method": method, "sample_idx": i, "turn_index": 0, "tps": tokens / seconds, "mean_accept": tau}
            if times:
                row |= {"num_output": tokens, "decode_time": seconds}
            if signature:
                row["out_sig"] = f"sig{i}" if method == "ar" or i % 2 else f"other{i}"
            lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")


def _write_domino(folder) -> None:
    (folder / "T0.0").mkdir(parents=True)
    for mode, values in DOMINO.items():
        rows = [{"question_id": q, "choices": [
            {"block_size": 1, "new_tokens": [], "decode_times": [], "acceptance_lengths": []},
            {"block_size": 16, "new_tokens": [tokens], "decode_times": [seconds], "acceptance_lengths": [accs]}]}
            for q, (tokens, seconds, accs) in enumerate(values)]
        (folder / "T0.0" / f"{mode}_gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def clone(tmp_path):
    """A folder laid out as the DominoTree repository (Qwen3-4B only), GSM8K at T = 0."""
    raw = tmp_path / "clone" / "results" / "raw"
    for name in ("dominotree", "baseline_ddtree_caddtree"):
        (raw / name).mkdir(parents=True)
    _write_plain(raw / "dominotree" / "gsm8k_T0.0.jsonl", OURS_ROWS, signature=True)
    _write_plain(raw / "baseline_ddtree_caddtree" / "gsm8k_T0.0.jsonl", CAD_ROWS, signature=False)
    _write_domino(raw / "domino_official" / "qwen3-4b")
    return tmp_path / "clone"


def _records(clone):
    raw = clone / "results" / "raw"
    return (read_records("dominotree-harness", [raw / "dominotree"])
            + read_records("caddtree-harness", [raw / "baseline_ddtree_caddtree"])
            + read_records("domino-official", [raw / "domino_official" / "qwen3-4b"]))


def _tps(rows):
    return [tokens / seconds for tokens, seconds, _ in rows]


def test_readers_keep_what_the_files_hold(clone):
    records = _records(clone)
    ours = [r for r in records if r.harness == "dominotree-harness"]
    assert [r.order for r in ours if r.method == "ar"] == [0, 1, 2, 3]
    assert all(r.signature is not None and r.taus is None for r in ours)
    cad = [r for r in records if r.harness == "caddtree-harness"]
    assert all(r.signature is None and r.new_tokens is not None for r in cad)
    domino = [r for r in records if r.harness == "domino-official"]
    assert sorted({r.mode for r in domino}) == ["eager", "graph"]
    assert len([r for r in domino if r.mode == "eager"]) == 3  # the turn with no tokens is left out
    assert next(r for r in domino if r.mode == "graph" and r.prompt_id == "0").taus == (2, 4)


def test_bad_files_are_named(tmp_path):
    bad = tmp_path / "gsm8k_T0.0.jsonl"
    bad.write_text('{"method": "ar", "sample_idx": 0, "tps": 1}\nnot json\n')
    with pytest.raises(ValueError, match="gsm8k_T0.0.jsonl:2: not JSON"):
        read_records("dominotree-harness", [bad])
    bad.write_text('{"method": "ar", "sample_idx": 0}\n')
    with pytest.raises(ValueError, match=":1: neither 'tps' nor 'num_output'"):
        read_records("caddtree-harness", [bad])
    (tmp_path / "oddname.jsonl").write_text("")
    with pytest.raises(ValueError, match="named <dataset>_T<temperature>.jsonl"):
        read_records("caddtree-harness", [tmp_path / "oddname.jsonl"])
    with pytest.raises(ValueError, match="unknown record format"):
        read_records("nosuch", [bad])


def test_the_papers_convention_recomputed_by_hand(clone):
    cells = {c.label: c for c in table1(_records(clone), PAPER)}
    ar_ours, dt = _tps(OURS_ROWS["ar"])[1:], _tps(OURS_ROWS["dominotree@16"])[1:]  # warm-up rows dropped
    assert cells["DominoTree (16)"].speedup == pytest.approx(statistics.fmean(dt) / statistics.fmean(ar_ours))
    assert cells["DominoTree (16)"].tau == pytest.approx(7.0) and cells["DominoTree (16)"].n == 3
    cad_ar, dd = _tps(CAD_ROWS["baseline"]), _tps(CAD_ROWS["ddtree_tb16"])  # nothing dropped
    assert cells["DDTree@16"].speedup == pytest.approx(statistics.fmean(dd) / statistics.fmean(cad_ar))
    assert cells["AR"].speedup == pytest.approx(1.0) and cells["AR"].tau == 1.0
    eager = [200.0, 200.0, 200.0]  # the faster mode, over the common AR (the DominoTree harness's, trimmed)
    assert cells["Domino"].speedup == pytest.approx(statistics.fmean(eager) / statistics.fmean(ar_ours))
    assert cells["Domino"].tau == pytest.approx(statistics.fmean([3.0, 3.0, 5.0]))


def test_treespecs_convention_pairs_and_totals(clone):
    records = _records(clone)
    cells = {c.label: c for c in table1(records, OURS)}
    def totals(rows):
        return sum(t for t, _, _ in rows) / sum(s for _, s, _ in rows)
    expected = totals(OURS_ROWS["dominotree@16"]) / totals(OURS_ROWS["ar"])  # every row, none dropped
    assert cells["DominoTree (16)"].speedup == pytest.approx(expected)
    assert cells["DominoTree (16)"].speedup != pytest.approx(table1(records, PAPER)[-1].speedup)
    timeless = [attrs.evolve(r, decode_time=None) if r.harness == "caddtree-harness" else r for r in records]
    assert math.isnan({c.label: c for c in table1(timeless, OURS)}["DDTree@16"].speedup)  # not measurable


def test_pairwise_deltas_by_hand_and_reproducible_intervals(clone):
    records = _records(clone)
    pairs = {(p.group, p.b): p for p in pairwise(records, PAPER)}
    by_prompt = pairs[("GSM8K", "Domino")]  # both over the common AR: raw tokens/s paired by prompt
    dt = dict(zip(range(4), _tps(OURS_ROWS["dominotree@16"])))
    units = [(dt[q], 200.0) for q in (1, 3)]  # prompt 0 dropped (warm-up); the eager run has no prompt 2
    assert by_prompt.unit == "tps by prompt" and by_prompt.n == 2
    assert by_prompt.delta_pct == pytest.approx(100 * (statistics.fmean(a for a, _ in units) / 200.0 - 1))
    cross = pairs[("GSM8K", "DDTree@16")]  # speedups over each harness's own AR, paired by run position
    left = [a / b for a, b in zip(_tps(OURS_ROWS["dominotree@16"]), _tps(OURS_ROWS["ar"]))][1:]
    right = [a / b for a, b in zip(_tps(CAD_ROWS["ddtree_tb16"]), _tps(CAD_ROWS["baseline"]))][1:]
    assert cross.unit == "speedup by run position" and cross.n == 3
    assert cross.delta_pct == pytest.approx(100 * (statistics.fmean(left) / statistics.fmean(right) - 1))
    assert cross.lo <= cross.delta_pct <= cross.hi
    again = {(p.group, p.b): p for p in pairwise(records, PAPER)}
    assert again[("Overall", "DDTree@16")] == pairs[("Overall", "DDTree@16")]


def test_the_diff_passes_on_equal_tables_and_names_a_difference(clone, tmp_path):
    records = _records(clone)
    cells, pairs = table1(records, PAPER), pairwise(records, PAPER)
    write_tables(tmp_path / "out", cells, pairs, PAPER, "tiny")
    assert diff_table1(cells, tmp_path / "out" / "table1_cells.csv") == (len(cells), [])
    assert diff_pairwise(pairs, tmp_path / "out" / "pairwise_ci.csv") == (len(pairs), [])
    rows = list(csv.DictReader(open(tmp_path / "out" / "table1_cells.csv")))
    rows[-1]["speedup"] = str(float(rows[-1]["speedup"]) + 0.01)
    with open(tmp_path / "edited.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows[:-2] + rows[-1:])  # one cell edited, one missing
    _, differences = diff_table1(cells, tmp_path / "edited.csv")
    assert {(d.where, d.field) for d in differences} == {("T=0 gsm8k DominoTree (16)", "speedup"),
                                                         ("T=0 gsm8k Domino", "cell")}
    with pytest.raises(ValueError, match="is not a table in this layout"):
        diff_table1(cells, tmp_path / "out" / "pairwise_ci.csv")


def test_cli_imports_reports_and_reproduces(clone, tmp_path, capsys):
    raw, out = clone / "results" / "raw", tmp_path / "imported"
    for fmt, folder in (("dominotree-harness", raw / "dominotree"), ("caddtree-harness", raw / "baseline_ddtree_caddtree"),
                        ("domino-official", raw / "domino_official" / "qwen3-4b")):
        assert main(["bench", "import", "--from", fmt, str(folder), "--out", str(out)]) == 0
    assert "no output signature: 8 of 8" in capsys.readouterr().out.splitlines()[1]
    assert main(["bench", "import", "--from", "domino-official", str(raw / "domino_official"), "--out", str(out)]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    # the paper's own CSVs, as its script would have written them for this slice
    tables = clone / "results" / "tables_gpunative"
    conv = attrs.evolve(CONVENTIONS["dominotree-4b"], resamples=10000)
    records = _records(clone)
    write_tables(tables, table1(records, conv), pairwise(records, conv), conv, "Qwen3-4B")
    assert main(["bench", "report", str(out), "--convention", "dominotree-4b",
                 "--expect", str(tables / "table1_cells.csv")]) == 0
    printed = capsys.readouterr().out
    assert "Table 1: 4 of 4 cells match" in printed
    assert "losslessness at T = 0, from the records' output signatures: 2 of 4 responses equal their AR's" in printed
    assert main(["bench", "report", str(out), "--expect", str(tables / "table1_cells.csv")]) == 1  # treespec's
    assert "DominoTree (16): speedup" in capsys.readouterr().out
    target = tmp_path / "reproduced"
    assert main(["bench", "reproduce", "dominotree", str(clone), "--out", str(target)]) == 0
    printed = capsys.readouterr().out
    assert "Qwen3-4B: Table 1 4 of 4 cells match; pairwise" in printed and "Under treespec's convention" in printed
    assert main(["bench", "reproduce", "dominotree", str(clone), "--out", str(target)]) == 2  # never overwritten
    assert main(["bench", "reproduce", "dominotree", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "holds no results/ folder" in capsys.readouterr().err


def test_treespecs_own_records_in_the_papers_layout(tmp_path, capsys):
    from test_bench_report import make_records

    from treespec.apps.bench.records import write_records

    write_records(tmp_path / "records.jsonl", make_records())
    assert main(["bench", "report", str(tmp_path), "--layout", "table1", "--model-label", "toy"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "table1_cells.csv")))
    assert {r["method"] for r in rows} == {"ar", "chain", "ddtree@16"} and {r["model"] for r in rows} == {"toy"}
    ddtree = next(r for r in rows if r["method"] == "ddtree@16")
    assert float(ddtree["tau"]) == pytest.approx(2.5) and 1.7 < float(ddtree["speedup"]) < 2.3


def test_conventions_are_set_one_by_one_and_bad_ones_named(clone, tmp_path, capsys):
    from treespec.apps.published.tables import with_settings

    conv = with_settings(PAPER, ["speedup=totals", "paired=true", "warmup=none", "resamples=50"])
    assert (conv.speedup, conv.paired, dict(conv.warmup), conv.resamples) == ("totals", True, {}, 50)
    records = _records(clone)
    mine = {c.label: c.speedup for c in table1(records, conv)}
    assert mine == pytest.approx({c.label: c.speedup for c in table1(records, attrs.evolve(OURS, rows=PAPER.rows))})
    added = with_settings(CONVENTIONS["treespec"], ["warmup=domino-official:first-prompt"])
    assert dict(added.warmup) == {"domino-official": "first-prompt"}
    for bad, message in [(["speedup=median"], "speedup convention must be"), (["paired=maybe"], "paired takes true"),
                         (["resamples=many"], "resamples takes a int"), (["colour=red"], "no convention 'colour'"),
                         (["warmup=first-row"], "warmup takes HARNESS:first-row"), (["speedup"], "KEY=VALUE")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            with_settings(PAPER, bad)
    raw = clone / "results" / "raw"
    assert main(["bench", "import", "--from", "caddtree-harness", str(raw / "baseline_ddtree_caddtree"),
                 "--out", str(tmp_path / "imp")]) == 0
    assert main(["bench", "report", str(tmp_path / "imp"), "--conv", "colour=red"]) == 2
    assert "no convention 'colour'" in capsys.readouterr().err
