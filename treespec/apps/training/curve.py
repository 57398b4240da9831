"""The held-out τ curve of a training run, drawn by the run itself beside its ``eval.jsonl``.

Contract: `draw_tau_curve(run_dir, primary)` reads ``eval.jsonl`` (one line per evaluation: ``step``
and ``tau/METHOD`` per eval method) and writes ``tau_curve.svg`` and ``tau_curve.png`` beside it: τ
against the step, one line per method, the best step of ``primary`` (the method the run keeps its
best weights by) marked.  A pure function of the file (the same lines give the same SVG bytes); the
trainer calls it after every evaluation.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["CURVE_FILES", "draw_tau_curve", "read_evaluations"]

CURVE_FILES = ("tau_curve.svg", "tau_curve.png")


def read_evaluations(path: Path) -> list[dict[str, float]]:
    """The evaluations of ``eval.jsonl``, in file order (a line cut short by an interruption is skipped)."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def draw_tau_curve(run_dir: Path, primary: str) -> list[Path]:
    """``tau_curve.svg`` and ``.png`` of ``run_dir/eval.jsonl`` (module docstring); [] when ``primary`` was
    never scored there."""
    from treespec.apps.bench.plots import _pyplot, save_figure

    rows = [r for r in read_evaluations(run_dir / "eval.jsonl") if f"tau/{primary}" in r]
    if not rows:
        return []
    methods = sorted({k[4:] for r in rows for k in r if k.startswith("tau/")}, key=lambda m: (m != primary, m))
    _, plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for method in methods:
        points = [(r["step"], r[f"tau/{method}"]) for r in rows if f"tau/{method}" in r]
        ax.plot([s for s, _ in points], [t for _, t in points], marker="o", markersize=3, label=method)
    step, tau = max(((r["step"], r[f"tau/{primary}"]) for r in rows), key=lambda p: (p[1], -p[0]))
    ax.annotate(f"best {tau:.3f} at step {step}", (step, tau), textcoords="offset points", xytext=(-6, 6),
                ha="right", fontsize=8)
    ax.margins(y=0.18)  # room for the note above the best point
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out τ (T = 0)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    png, svg = run_dir / "tau_curve.png", run_dir / "tau_curve.svg"
    fig.savefig(png)
    save_figure(fig, svg)  # closes the figure
    return [svg, png]
