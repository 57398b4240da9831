"""Tables derived from bench records: per-cell speedup and tau, and paired bootstrap intervals.

Contract: `summarize` and `compare_pairs` are deterministic functions of the records (the bootstrap
uses its own seeded generator), and the CSV / Markdown writers format numbers with fixed precision,
so re-deriving the tables from the same JSONL gives identical bytes.

A run over two or more datasets also gets the pooled cell ``all`` per temperature: every prompt
turn together, each still paired with its own AR run.

Speedup of a method in a cell (dataset, temperature) = AR time per token / method time per token,
both aggregated over the cell's prompts (total decode time / total new tokens), AR measured in the
same run on the same prompts.  Intervals resample prompts with replacement, keeping each prompt's
records together (paired).
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from treespec.apps.bench.records import BenchRecord

__all__ = ["POOLED", "CellSummary", "PairComparison", "bootstrap_interval", "compare_pairs", "markdown_table",
           "summarize", "time_per_token", "write_csv"]

AR = "ar"
POOLED = "all"  # the cell of every dataset together


@attrs.frozen
class CellSummary:
    """One method in one (dataset, temperature) cell."""

    dataset: str
    temperature: float
    method: str
    budget: int
    prompts: int  # paired prompt turns
    tau: float  # mean of per-response mean tau
    tau_lo: float
    tau_hi: float
    speedup: float  # AR time per token / method time per token
    speedup_lo: float
    speedup_hi: float
    tokens_per_second: float
    lossless: float  # fraction of responses whose tokens equal AR's (meaningful at T = 0)
    family: str = ""  # the method without its budget (`BenchRecord.family`): one budget curve


@attrs.frozen
class PairComparison:
    """Method a against method b on the same prompts of one cell."""

    dataset: str
    temperature: float
    a: str
    b: str
    tau_diff: float  # mean tau(a) - mean tau(b)
    tau_diff_lo: float
    tau_diff_hi: float
    speed_ratio: float  # time per token of b / time per token of a (> 1: a is faster)
    speed_ratio_lo: float
    speed_ratio_hi: float


def _group(records: Iterable[BenchRecord]) -> dict[tuple[str, float], dict[str, dict[tuple, BenchRecord]]]:
    """cell -> method -> pairing key -> record; with two or more datasets, also the pooled cell
    (`POOLED`, every prompt turn of the temperature, paired by dataset, prompt and turn)."""
    records = list(records)
    cells: dict = defaultdict(lambda: defaultdict(dict))
    for r in records:
        cells[(r.dataset, r.temperature)][r.method][(r.prompt_id, r.turn)] = r
    datasets = {r.dataset for r in records}
    if POOLED in datasets:
        raise ValueError(f"records name a dataset {POOLED!r}, the name of the pooled cell; rename that dataset")
    if len(datasets) > 1:
        for r in records:
            cells[(POOLED, r.temperature)][r.method][(r.dataset, r.prompt_id, r.turn)] = r
    return cells


def _paired(methods: dict[str, dict[tuple, BenchRecord]], names: Sequence[str]) -> list[list[BenchRecord]]:
    """Rows of records, one per prompt turn present for every named method, sorted by key."""
    keys = sorted(set.intersection(*(set(methods[m]) for m in names)))
    return [[methods[m][k] for m in names] for k in keys]


def bootstrap_interval(stat, n: int, resamples: int, seed: int) -> tuple[float, float]:
    """95% percentile interval of ``stat(indices)`` over prompt resamples."""
    rng = np.random.default_rng(seed)
    values = [stat(rng.integers(0, n, n)) for _ in range(resamples)]
    lo, hi = np.percentile(values, [2.5, 97.5])
    return float(lo), float(hi)


def time_per_token(rows: Iterable[BenchRecord]) -> float:
    """Decode seconds per new token over ``rows`` (total time / total tokens)."""
    rows = list(rows)
    return sum(r.decode_time for r in rows) / max(1, sum(r.new_tokens for r in rows))


def _time_per_token(rows: Sequence[BenchRecord], idx) -> float:
    return time_per_token(rows[i] for i in idx)


def summarize(records: Iterable[BenchRecord], *, resamples: int = 1000, seed: int = 0) -> list[CellSummary]:
    """One summary per (dataset, temperature, method), sorted; requires AR in every cell."""
    out = []
    for (dataset, temp), methods in sorted(_group(records).items()):
        if AR not in methods:
            raise ValueError(f"cell {dataset} T={temp} has no '{AR}' records: speedup needs AR measured alongside")
        for method in sorted(methods):
            rows = _paired(methods, [AR, method])
            ar, me = [r[0] for r in rows], [r[1] for r in rows]
            taus = np.array([r.mean_tau for r in me])
            n = len(rows)
            speed = lambda idx: _time_per_token(ar, idx) / _time_per_token(me, idx)  # noqa: E731
            full = np.arange(n)
            out.append(CellSummary(
                dataset, temp, method, me[0].budget, n, float(taus.mean()),
                *bootstrap_interval(lambda idx: float(taus[idx].mean()), n, resamples, seed),
                speed(full), *bootstrap_interval(speed, n, resamples, seed),
                1.0 / _time_per_token(me, full) if _time_per_token(me, full) else 0.0,
                sum(a.hash == m.hash for a, m in rows) / n, me[0].family))
    return out


def compare_pairs(records: Iterable[BenchRecord], *, resamples: int = 1000, seed: int = 0) -> list[PairComparison]:
    """Paired comparison of every ordered pair (a < b by name) of methods in every cell."""
    out = []
    for (dataset, temp), methods in sorted(_group(records).items()):
        names = sorted(methods)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                rows = _paired(methods, [a, b])
                ra, rb = [r[0] for r in rows], [r[1] for r in rows]
                diff = np.array([x.mean_tau - y.mean_tau for x, y in rows])
                ratio = lambda idx: _time_per_token(rb, idx) / _time_per_token(ra, idx)  # noqa: E731
                n = len(rows)
                out.append(PairComparison(
                    dataset, temp, a, b, float(diff.mean()),
                    *bootstrap_interval(lambda idx: float(diff[idx].mean()), n, resamples, seed),
                    ratio(np.arange(n)), *bootstrap_interval(ratio, n, resamples, seed)))
    return out


def _fmt(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def write_csv(rows: Sequence, path=None) -> str:
    """CSV text of attrs rows (fixed 4-decimal floats); written to ``path`` when given."""
    buf = io.StringIO()
    fields = [f.name for f in attrs.fields(type(rows[0]))] if rows else []
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(fields)
    writer.writerows([[_fmt(getattr(r, f)) for f in fields] for r in rows])
    if path is not None:
        with open(path, "w") as fh:
            fh.write(buf.getvalue())
    return buf.getvalue()


def markdown_table(summaries: Sequence[CellSummary]) -> str:
    """Speedup / tau per cell with 95% intervals, one row per method, one table per cell."""
    lines: list[str] = []
    for (dataset, temp) in sorted({(s.dataset, s.temperature) for s in summaries}):
        lines += [f"### {dataset}, T = {temp:g}", "",
                  "| method | prompts | speedup [95% CI] | tau [95% CI] | tok/s | = AR |",
                  "|---|---:|---|---|---:|---:|"]
        for s in (s for s in summaries if (s.dataset, s.temperature) == (dataset, temp)):
            lines.append(f"| {s.method} | {s.prompts} | {s.speedup:.2f} [{s.speedup_lo:.2f}, {s.speedup_hi:.2f}] | "
                         f"{s.tau:.2f} [{s.tau_lo:.2f}, {s.tau_hi:.2f}] | {s.tokens_per_second:.1f} | {s.lossless:.0%} |")
        lines.append("")
    return "\n".join(lines)
