"""Plots derived from bench records: tau histograms per method, speedup and tau against budget.

Contract: pure functions of the records; files are written with the Agg backend and a fixed SVG
hash salt, so the same records give the same SVG bytes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from treespec.apps.bench.records import BenchRecord
from treespec.apps.bench.summary import POOLED, CellSummary

__all__ = ["budget_axis", "interval_axes", "plot_budget_curves", "plot_tau_histograms", "save_figure"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return matplotlib, plt


def save_figure(fig, path: Path) -> Path:
    """Write ``fig`` to ``path`` (its suffix names the format) with stable SVG ids and no date; close it."""
    matplotlib, plt = _pyplot()
    with matplotlib.rc_context({"svg.hashsalt": "treespec"}):
        fig.savefig(path, metadata={"Date": None} if path.suffix == ".svg" else None)
    plt.close(fig)
    return path


def budget_axis(ax, budgets: Sequence[int], label: str = "budget B (non-root nodes)") -> None:
    """A log2 x axis ticked at the budgets themselves (a single budget keeps a linear axis)."""
    if len(budgets) > 1:
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel(label)


def interval_axes(ax, label: str, values: Sequence[float], min_span: float = 0.1) -> None:
    """Label ``ax``'s y axis and bound it to ``values`` (the intervals' ends) padded by 10 %, never
    narrower than ``min_span``: matplotlib's auto-zoom makes differences of a few thousandths look
    like the whole axis."""
    finite = [v for v in values if np.isfinite(v)]
    if finite:
        lo, hi = min(finite), max(finite)
        pad = max(0.1 * (hi - lo), (min_span - (hi - lo)) / 2, 0.0)
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)


def plot_tau_histograms(records: Sequence[BenchRecord], path: str | Path) -> Path:
    """One histogram of per-round acceptance lengths per method (all cells pooled)."""
    _, plt = _pyplot()
    taus: dict[str, list[int]] = defaultdict(list)
    for r in records:
        taus[r.method].extend(r.taus)
    methods = sorted(taus)
    fig, axes = plt.subplots(len(methods), 1, figsize=(6, 1.6 * len(methods) + 0.4), sharex=True, squeeze=False)
    top = max(max(v) for v in taus.values())
    for ax, m in zip(axes[:, 0], methods):
        ax.hist(taus[m], bins=range(1, top + 2), align="left", rwidth=0.85, color="#546e7a")
        ax.set_ylabel(m, rotation=0, ha="right", fontsize=8)
    axes[-1, 0].set_xlabel("acceptance length per round (tau)")
    fig.tight_layout()
    return save_figure(fig, Path(path))


def _curve_cells(summaries: Sequence[CellSummary]) -> list[CellSummary]:
    """The cells a budget curve shows: the pooled cell of each temperature when there is one (its
    interval resamples every prompt together), else the single dataset's cells."""
    pooled = {s.temperature for s in summaries if s.dataset == POOLED}
    return [s for s in summaries if s.budget > 0 and (s.dataset == POOLED) == (s.temperature in pooled)]


def plot_budget_curves(summaries: Sequence[CellSummary], path: str | Path) -> Path:
    """Speedup and tau against tree budget with their 95 % bootstrap intervals, one line per method
    family (the method with its budget taken out, so options and drafter stay apart) and
    temperature; a dashed line marks AR's speed (1.0)."""
    _, plt = _pyplot()
    cells = _curve_cells(summaries)
    curves: dict[str, list[CellSummary]] = defaultdict(list)
    several = len({s.temperature for s in cells}) > 1
    for s in cells:
        curves[s.family + (f" T={s.temperature:g}" if several else "")].append(s)
    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(9, 3.6))
    for name in sorted(curves):
        rows = sorted(curves[name], key=lambda s: s.budget)
        x = [s.budget for s in rows]
        for ax, stat in ((ax_s, "speedup"), (ax_t, "tau")):
            mid = np.array([getattr(s, stat) for s in rows])
            err = [mid - [getattr(s, f"{stat}_lo") for s in rows], [getattr(s, f"{stat}_hi") for s in rows] - mid]
            ax.errorbar(x, mid, yerr=err, marker="o", capsize=3, label=name)
    ax_s.axhline(1.0, color="black", linestyle="dashed", linewidth=0.8)
    interval_axes(ax_s, "speedup over AR [95% CI]", [v for s in cells for v in (s.speedup_lo, s.speedup_hi)] + [1.0])
    interval_axes(ax_t, "tau [95% CI]", [v for s in cells for v in (s.tau_lo, s.tau_hi)])
    for ax in (ax_s, ax_t):
        budget_axis(ax, sorted({s.budget for s in cells}))
    if curves:
        ax_t.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, Path(path))
