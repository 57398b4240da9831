"""Plots derived from bench records: tau histograms per method, speedup and tau against budget.

Contract: pure functions of the records; files are written with the Agg backend and a fixed SVG
hash salt, so the same records give the same SVG bytes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from treespec.apps.bench.records import BenchRecord
from treespec.apps.bench.summary import POOLED, CellSummary

__all__ = ["plot_budget_curves", "plot_tau_histograms"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return matplotlib, plt


def _save(fig, path: Path) -> Path:
    matplotlib, plt = _pyplot()
    with matplotlib.rc_context({"svg.hashsalt": "treespec"}):
        fig.savefig(path, metadata={"Date": None} if path.suffix == ".svg" else None)
    plt.close(fig)
    return path


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
    return _save(fig, Path(path))


def plot_budget_curves(summaries: Sequence[CellSummary], path: str | Path) -> Path:
    """Speedup and tau against tree budget, one line per policy, pooled cells averaged."""
    _, plt = _pyplot()
    curves: dict[str, dict[int, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for s in summaries:
        if s.budget > 0 and s.dataset != POOLED:  # the pooled cell would count every prompt twice (no
            # dataset has its name: `summarize` refuses such records)
            curves[s.method.split("@")[0]][s.budget].append((s.speedup, s.tau))
    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(9, 3.4))
    for policy in sorted(curves):
        budgets = sorted(curves[policy])
        mean = lambda b, j: sum(v[j] for v in curves[policy][b]) / len(curves[policy][b])  # noqa: E731
        ax_s.plot(budgets, [mean(b, 0) for b in budgets], marker="o", label=policy)
        ax_t.plot(budgets, [mean(b, 1) for b in budgets], marker="o", label=policy)
    for ax, label in ((ax_s, "speedup over AR"), (ax_t, "tau")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget B")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if curves:
        ax_t.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, Path(path))
