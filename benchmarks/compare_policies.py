"""Every registered policy at budgets 4 .. 128, replayed from one trace of the embedded default.

Replays each policy (T = 0) at every budget of ``--budgets`` from one replay trace (``treespec
replay record`` of held-out prompts) and writes ``--out`` (default docs/figures/compared/):
``records.json`` (per policy and budget: the per-prompt τ sequences and the replay's seconds per
round) and ``budget_curves.svg``; ``--doc`` (default docs/policies-compared.md) gets the table
`comparison_table` derives from the records: pooled τ with the paired 95 % bootstrap interval of
its difference from DDTree at the same budget (prompts resampled together), and the milliseconds
of one round's replay (draft rebuild and tree build; machine-dependent, single-threaded).  The
chains take no budget; cost-aware policies are priced by the cost models the trace recorded.

    OMP_NUM_THREADS=1 python benchmarks/compare_policies.py --trace runs/trace-compare
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = (4, 8, 16, 32, 64, 128)
BASELINE = "ddtree"
BEGIN, END = "<!-- table: benchmarks/compare_policies.py -->", "<!-- end of table -->"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "figures" / "compared")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "policies-compared.md")
    parser.add_argument("--resamples", type=int, default=2000)
    return parser.parse_args()


def methods(budgets) -> list[tuple[str, str, int | None]]:
    """(method string, policy, budget) of every registered policy; the chains once per drafter."""
    from treespec import registry

    out = [("dflash", "chain", None), ("domino", "chain", None)]
    for name in registry.available("policy"):
        if name != "chain":
            out += [(f"{name}@{b}", name, b) for b in budgets]
    return out


def record(trace_path: Path, budgets) -> dict:
    from treespec.apps.replay import Trace, evaluate

    trace = Trace.load(trace_path)
    rows = {}
    for spec, policy, budget in methods(budgets):
        result = evaluate(trace, [spec])[0]
        rows[spec] = {"policy": policy, "budget": budget, "taus": [list(t) for t in result.taus],
                      "ms_per_round": 1e3 * result.seconds / max(1, result.rounds)}
        print(f"{spec}: tau {result.mean_tau:.3f}", flush=True)
    return {"trace": trace.meta.get("config", {}), "prompts": trace.num_prompts, "methods": rows}


def comparison_table(records: dict, resamples: int = 2000, seed: int = 0) -> str:
    """The Markdown table of the doc, derived from ``records`` alone (module docstring)."""
    from treespec.apps.bench.summary import bootstrap_interval
    from treespec.apps.replay.compare import pooled_tau

    rows = records["methods"]
    n = records["prompts"]
    budgets = sorted({r["budget"] for r in rows.values() if r["budget"] is not None})
    lines = ["| policy | " + " | ".join(f"B = {b}" for b in budgets) + " | ms per round (B = 16) |",
             "|---|" + "---|" * len(budgets) + "---|"]
    for spec in (s for s, r in rows.items() if r["budget"] is None):
        tau = pooled_tau(rows[spec]["taus"], range(n))
        lines.append(f"| {spec} (chain) | {tau:.3f} " + "| " * (len(budgets) - 1) + f"| {rows[spec]['ms_per_round']:.2f} |")
    for policy in sorted({r["policy"] for r in rows.values() if r["budget"] is not None}):
        cells = []
        for b in budgets:
            mine, base = rows[f"{policy}@{b}"]["taus"], rows[f"{BASELINE}@{b}"]["taus"]
            tau = pooled_tau(mine, range(n))
            if policy == BASELINE:
                cells.append(f"{tau:.3f}")
                continue
            diff = lambda idx: pooled_tau(mine, idx) - pooled_tau(base, idx)  # noqa: E731, B023
            lo, hi = bootstrap_interval(diff, n, resamples, seed)
            cells.append(f"{tau:.3f} ({diff(np.arange(n)):+.3f} [{lo:+.3f}, {hi:+.3f}])")
        ms = rows[f"{policy}@16"]["ms_per_round"] if f"{policy}@16" in rows else float("nan")
        lines.append(f"| {policy} | " + " | ".join(cells) + f" | {ms:.2f} |")
    return "\n".join(lines) + "\n"


def plot(records: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from treespec.apps.replay.compare import pooled_tau

    rows, n = records["methods"], records["prompts"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in sorted({r["policy"] for r in rows.values() if r["budget"] is not None}):
        points = sorted((r["budget"], pooled_tau(r["taus"], range(n))) for r in rows.values() if r["policy"] == policy)
        ax.plot([b for b, _ in points], [t for _, t in points], marker="o", label=policy)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget B (non-root nodes)")
    ax.set_ylabel("mean τ (replayed, T = 0)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)


def write_doc(doc: Path, table: str) -> None:
    text = doc.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    doc.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


def main() -> None:
    args = parse_args()
    budgets = tuple(int(b) for b in args.budgets.split(","))
    records = record(args.trace, budgets)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "records.json").write_text(json.dumps(records, sort_keys=True) + "\n")
    plot(records, args.out / "budget_curves.svg")
    write_doc(args.doc, comparison_table(records, args.resamples))
    print(f"wrote {args.out / 'records.json'}, {args.out / 'budget_curves.svg'} and the table in {args.doc}")


if __name__ == "__main__":
    main()
