"""Tables derived from bench records: per-cell speedup and tau, and paired bootstrap intervals.

Contract: `summarize` and `compare_pairs` are deterministic functions of the records (the bootstrap
uses its own seeded generator), and the CSV / Markdown writers format numbers with fixed precision,
so re-deriving the tables from the same JSONL gives identical bytes.

A run over two or more datasets also gets the pooled cell ``all`` per temperature: every prompt
turn together, each still paired with its own AR run.

Speedup of a method in a cell (dataset, temperature) = AR time per token / method time per token,
both aggregated over the cell's prompts (total decode time / total new tokens), AR measured in the
same run on the same prompts.  Intervals resample prompts with replacement, keeping each prompt's
records together (paired).  Speeds are computed on the turns no other process disturbed
(`BenchRecord.disturbed`: their times say what the load cost, not the method); τ and equality with
AR on every turn.  `disturbed_note` says how many turns were left out.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from treespec.apps.bench.records import BenchRecord

__all__ = ["POOLED", "CellSummary", "PairComparison", "bootstrap_interval", "compare_pairs", "disturbed_note",
           "markdown_table", "summarize", "threads_by_turn", "threads_note", "time_per_token", "undisturbed",
           "write_csv"]

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


def undisturbed(rows: list[list[BenchRecord]]) -> list[list[BenchRecord]]:
    """The paired rows none of whose records another process disturbed (`BenchRecord.disturbed`):
    the rows a speed comparison is made on; every row when each was disturbed (`disturbed_note`
    then says the speeds are of a disturbed run)."""
    clean = [row for row in rows if not any(r.disturbed for r in row)]
    return clean or rows


def _speed(num: Sequence[BenchRecord], den: Sequence[BenchRecord], resamples: int, seed: int) -> tuple[float, ...]:
    """(ratio, lo, hi): time per token of ``num`` over that of ``den``, paired rows resampled together;
    NaN when no row is left."""
    n = len(num)
    if n == 0:
        return math.nan, math.nan, math.nan
    ratio = lambda idx: _time_per_token(num, idx) / _time_per_token(den, idx)  # noqa: E731
    return (ratio(np.arange(n)), *bootstrap_interval(ratio, n, resamples, seed))


def summarize(records: Iterable[BenchRecord], *, resamples: int = 1000, seed: int = 0) -> list[CellSummary]:
    """One summary per (dataset, temperature, method), sorted; requires AR in every cell."""
    out = []
    for (dataset, temp), methods in sorted(_group(records).items()):
        if AR not in methods:
            raise ValueError(f"cell {dataset} T={temp} has no '{AR}' records: speedup needs AR measured alongside")
        for method in sorted(methods):
            rows = _paired(methods, [AR, method])
            me = [r[1] for r in rows]
            taus = np.array([r.mean_tau for r in me])
            n = len(rows)
            timed = undisturbed(rows)  # speed: the turns no other process disturbed
            tpt = time_per_token(r[1] for r in timed)
            out.append(CellSummary(
                dataset, temp, method, me[0].budget, n, float(taus.mean()),
                *bootstrap_interval(lambda idx: float(taus[idx].mean()), n, resamples, seed),
                *_speed([r[0] for r in timed], [r[1] for r in timed], resamples, seed),
                1.0 / tpt if tpt else 0.0, sum(a.hash == m.hash for a, m in rows) / n, me[0].family))
    return out


def compare_pairs(records: Iterable[BenchRecord], *, resamples: int = 1000, seed: int = 0) -> list[PairComparison]:
    """Paired comparison of every ordered pair (a < b by name) of methods in every cell."""
    out = []
    for (dataset, temp), methods in sorted(_group(records).items()):
        names = sorted(methods)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                rows = _paired(methods, [a, b])
                diff = np.array([x.mean_tau - y.mean_tau for x, y in rows])
                timed = undisturbed(rows)  # speed: the turns no other process disturbed
                out.append(PairComparison(
                    dataset, temp, a, b, float(diff.mean()),
                    *bootstrap_interval(lambda idx: float(diff[idx].mean()), len(rows), resamples, seed),
                    *_speed([r[1] for r in timed], [r[0] for r in timed], resamples, seed)))
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


def disturbed_note(records: Iterable[BenchRecord]) -> str:
    """A note when other processes disturbed some turns: how many, and that speeds leave them out."""
    turns: dict[tuple, bool] = {}
    for r in records:
        turns[r.key] = turns.get(r.key, False) or r.disturbed
    hit = sum(turns.values())
    if not hit:
        return ""
    if hit == len(turns):
        return (f"\nNote: every one of the {hit} prompt turns ran while another process took cores this run was "
                "using (records' ``load``): its speedups and time ratios measure the load as much as the methods.\n")
    return (f"\nNote: {hit} of {len(turns)} prompt turns ran while another process took cores this run was using "
            f"(records' ``load``); speedups and time ratios leave them out, τ and equality with AR count them.\n")


def threads_by_turn(records: Iterable[BenchRecord]) -> dict[int, int]:
    """threads -> prompt turns measured with them (a turn's methods share its threads)."""
    turns = {r.key: r.threads for r in records}
    counts: dict[int, int] = {}
    for threads in turns.values():
        counts[threads] = counts.get(threads, 0) + 1
    return dict(sorted(counts.items()))


def threads_note(records: Iterable[BenchRecord]) -> str:
    """A note when the run's threads changed with the load (`treespec.pricing.conditions.ThreadControl`)."""
    counts = threads_by_turn(records)
    if len(counts) < 2:
        return ""
    spread = ", ".join(f"{threads} on {n}" for threads, n in counts.items())
    return (f"\nNote: the threads followed the load (threads on prompt turns: {spread}; records' ``threads``); "
            "the methods of a turn ran with the same threads, so its paired ratios compare alike.\n")
