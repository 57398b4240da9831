"""The report of a bench run: every derived table and plot, from the merged records alone.

Contract: `write_report(out_dir)` derives summary.csv, pairs.csv, summary.md, lossless.md and the
plots from ``records.jsonl`` (and ``divergences.jsonl``) alone; rerunning it gives identical bytes.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from treespec.apps.bench.decisions import LEGEND, decisions_table
from treespec.apps.bench.lossless import lossless_text, read_divergences
from treespec.apps.bench.outdir import DIVERGENCES, RECORDS, shard_files
from treespec.apps.bench.plots import plot_budget_curves, plot_tau_histograms
from treespec.apps.bench.records import read_records
from treespec.apps.bench.summary import (
    compare_pairs,
    disturbed_note,
    markdown_table,
    summarize,
    threads_note,
    write_csv,
)

__all__ = ["Report", "write_report"]


@attrs.frozen
class Report:
    """What `write_report` wrote, and the losslessness verdict."""

    files: tuple[Path, ...]  # every derived file
    table: str  # summary.md's text
    lossless: str  # lossless.md's text
    unacceptable: int  # divergences from AR beyond tolerance (or with no measured gap)


def pooled_runs_note(records) -> str:
    """A note when a (dataset, temperature) cell pools records measured by several runs (a resumed
    folder): its speedup then mixes timings of other conditions, though every pair is of one run."""
    runs: dict[tuple[str, float], set[str]] = {}
    for r in records:
        if r.run:
            runs.setdefault((r.dataset, r.temperature), set()).add(r.run)
    mixed = {cell: len(found) for cell, found in runs.items() if len(found) > 1}
    if not mixed:
        return ""
    cells = ", ".join(f"{d} T={t:g} ({n} runs)" for (d, t), n in sorted(mixed.items()))
    return (f"\nNote: {len(mixed)} cell(s) pool conversations measured by different runs of a resumed folder, so "
            f"their speedups mix timings taken under other conditions (each pair is of one run): {cells}.\n")


def write_report(out_dir: str | Path, *, resamples: int = 1000) -> Report:
    """Derive the tables and plots from ``records.jsonl`` (+ ``divergences.jsonl``), byte for byte."""
    out_dir = Path(out_dir)
    if not (out_dir / RECORDS).is_file():
        hint = " (run `treespec bench merge` first)" if shard_files(out_dir, "records") else ""
        raise FileNotFoundError(f"no {RECORDS} in {out_dir}{hint}")
    records = list(read_records(out_dir / RECORDS))
    if not records:
        raise ValueError(f"{out_dir / RECORDS} holds no records")
    summaries = summarize(records, resamples=resamples)
    table = markdown_table(summaries) + pooled_runs_note(records) + disturbed_note(records) + threads_note(records)
    decided = decisions_table(records, list(dict.fromkeys(s.method for s in summaries)))
    if decided:
        table += f"\n\nWhat the decoders decided ({LEGEND}):\n\n```\n{decided}\n```\n"
    lossless, bad = lossless_text(records, read_divergences(out_dir / DIVERGENCES))
    write_csv(summaries, out_dir / "summary.csv")
    write_csv(compare_pairs(records, resamples=resamples), out_dir / "pairs.csv")
    (out_dir / "summary.md").write_text(table)
    (out_dir / "lossless.md").write_text(lossless)
    plots = [plot_tau_histograms(records, out_dir / f"tau_hist.{ext}") for ext in ("svg", "png")]
    plots += [plot_budget_curves(summaries, out_dir / f"budget_curves.{ext}") for ext in ("svg", "png")]
    names = ("summary.csv", "pairs.csv", "summary.md", "lossless.md")
    return Report(tuple(out_dir / n for n in names) + tuple(plots), table, lossless, bad)
