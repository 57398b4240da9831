"""Writing Table 1 and the pairwise table in a paper's layout, and diffing them against its CSVs.

Contract
--------
* `write_tables(out_dir, cells, pairs, conv, model)` writes ``table1.md`` (``speedup / tau`` per
  cell, the groups' Avg columns), ``table1_cells.csv`` (temp, dataset, model, harness, method,
  speedup, tau, tps, n: the DominoTree repository's layout) and, when ``pairs`` is given,
  ``pairwise_ci.csv`` / ``.md`` (temp, dataset_or_rollup, comparison, metric, n, delta_pct,
  ci_low, ci_high).
* `diff_table1(cells, path)` and `diff_pairwise(pairs, path)` compare with a published CSV of that
  layout at its printed precision (two decimals; n exactly; the pairwise verdict: the interval
  above 0, below 0, or across it) and return one `Difference` per cell that differs, or that one
  side has and the other lacks.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

import attrs

from treespec.apps.published.tables import LABELS, Cell, Conventions, Pair, avg_cells

__all__ = ["Difference", "diff_pairwise", "diff_table1", "write_tables"]


@attrs.frozen
class Difference:
    """One cell that differs at the printed precision."""

    where: str  # temperature, dataset or rollup, row
    field: str  # "speedup", "tau", "n", "delta_pct", "verdict", or "cell" (present on one side only)
    mine: str
    published: str


def _fmt(value: float) -> str:
    return "--" if value is None or not math.isfinite(value) else f"{value:.2f}"


def _temp(value: float) -> str:
    return f"{value:.1f}"


def write_tables(out_dir: str | Path, cells: Sequence[Cell], pairs: Sequence[Pair] | None, conv: Conventions,
                 model: str) -> list[Path]:
    """The files of the module docstring; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    avgs = avg_cells(cells, conv)
    index = {(c.temperature, c.dataset, c.label): c for c in cells}
    lines = ["# Table 1: speedup / tau", ""]
    for temp in sorted({c.temperature for c in cells}):
        header = ["Model", "Method"] + [LABELS.get(d, d) for d in conv.datasets] + [f"{g} Avg" for g in conv.groups]
        lines += [f"## Temperature = {_temp(temp)}", "", "| " + " | ".join(header) + " |",
                  "| " + " | ".join("---" for _ in header) + " |"]
        for row in conv.rows:
            found = [index.get((temp, d, row.label)) for d in conv.datasets]
            text = [f"{_fmt(c.speedup)} / {_fmt(c.tau)}" if c else "--" for c in found]
            text += [" / ".join(map(_fmt, avgs[(temp, g, row.label)])) for g in conv.groups]
            lines.append("| " + " | ".join([model, row.label, *text]) + " |")
        lines.append("")
    paths = [out_dir / "table1.md", out_dir / "table1_cells.csv"]
    paths[0].write_text("\n".join(lines))
    with open(paths[1], "w", newline="") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(["temp", "dataset", "model", "harness", "method", "speedup", "tau", "tps", "n"])
        writer.writerows([[_temp(c.temperature), c.dataset, model, c.harness, c.label, c.speedup, c.tau, c.tps,
                           float(c.n)] for c in cells])
    if pairs:
        paths += _write_pairs(out_dir, pairs)
    return paths


def _write_pairs(out_dir: Path, pairs: Sequence[Pair]) -> list[Path]:
    rows = [[_temp(p.temperature), p.group, f"{p.a} vs {p.b}", p.unit, p.n, p.delta_pct, p.lo, p.hi] for p in pairs]
    csv_path, md_path = out_dir / "pairwise_ci.csv", out_dir / "pairwise_ci.md"
    with open(csv_path, "w", newline="") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(["temp", "dataset_or_rollup", "comparison", "metric", "n", "delta_pct", "ci_low", "ci_high"])
        writer.writerows(rows)
    lines = ["# Pairwise delta % with 95 % paired bootstrap intervals", "",
             "delta % = 100 (mean(a) / mean(b) - 1) over paired units; > 0: a is faster.", "",
             "| Temp | Dataset/Rollup | Comparison | Unit | N | Delta % | 95% CI |", "|---|---|---|---|---:|---:|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {_fmt(r[5])} | [{_fmt(r[6])}, {_fmt(r[7])}] |"
              for r in rows]
    md_path.write_text("\n".join(lines) + "\n")
    return [csv_path, md_path]


def _read_csv(path: str | Path) -> list[dict[str, str]]:
    try:
        with open(path, newline="") as fh:
            return list(csv.DictReader(fh))
    except FileNotFoundError:
        raise ValueError(f"no published table at {path}") from None


def _need(rows: list[dict], columns: Sequence[str], path) -> None:
    missing = [c for c in columns if rows and c not in rows[0]]
    if missing or not rows:
        raise ValueError(f"{path} is not a table in this layout: it lacks {missing or 'rows'} "
                         f"(expected columns {', '.join(columns)})")


def _diff(mine: dict, theirs: dict, checks) -> tuple[int, list[Difference]]:
    """(keys compared, differences): a key on one side only, or each (field, mine, published) of
    ``checks(mine_value, their_row)`` whose two texts differ."""
    out = []
    for key in sorted(set(theirs) | set(mine), key=str):
        where = f"T={key[0]:g} {key[1]} {key[2]}"
        if key not in mine or key not in theirs:
            out.append(Difference(where, "cell", "present" if key in mine else "absent",
                                  "present" if key in theirs else "absent"))
            continue
        out += [Difference(where, field, a, b) for field, a, b in checks(mine[key], theirs[key]) if a != b]
    return len(set(theirs) | set(mine)), out


def diff_table1(cells: Sequence[Cell], published: str | Path) -> tuple[int, list[Difference]]:
    """(cells compared, differences) of ``cells`` against a published ``table1_cells.csv``."""
    rows = _read_csv(published)
    _need(rows, ("temp", "dataset", "method", "speedup", "tau"), published)
    theirs = {(round(float(r["temp"]), 3), r["dataset"], r["method"]): r for r in rows}
    mine = {(round(c.temperature, 3), c.dataset, c.label): c for c in cells}
    return _diff(mine, theirs, lambda c, r: [(f, _fmt(getattr(c, f)), _fmt(float(r[f]))) for f in ("speedup", "tau")])


def _verdict(lo: float, hi: float) -> str:
    return "faster" if lo > 0 else "slower" if hi < 0 else "tie"


def _pair_checks(p: Pair, r: dict) -> list[tuple[str, str, str]]:
    lo, hi = float(r["ci_low"]), float(r["ci_high"])
    return [("n", str(p.n), str(int(float(r["n"])))), ("delta_pct", _fmt(p.delta_pct), _fmt(float(r["delta_pct"]))),
            ("ci_low", _fmt(p.lo), _fmt(lo)), ("ci_high", _fmt(p.hi), _fmt(hi)), ("verdict", p.verdict, _verdict(lo, hi))]


def diff_pairwise(pairs: Sequence[Pair], published: str | Path) -> tuple[int, list[Difference]]:
    """(comparisons compared, differences) of ``pairs`` against a published ``pairwise_ci.csv``."""
    rows = _read_csv(published)
    _need(rows, ("temp", "dataset_or_rollup", "comparison", "n", "delta_pct", "ci_low", "ci_high"), published)
    theirs = {(round(float(r["temp"]), 3), r["dataset_or_rollup"], r["comparison"]): r for r in rows}
    mine = {(round(p.temperature, 3), p.group, f"{p.a} vs {p.b}"): p for p in pairs}
    return _diff(mine, theirs, _pair_checks)
