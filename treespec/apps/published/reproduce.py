"""The DominoTree paper's tables from its repository's raw records, diffed against its CSVs.

Contract
--------
`reproduce_dominotree(clone, out)` finds each model size the repository holds (Qwen3-4B:
``results/raw/``; Qwen3-8B: ``results/raw/8b/``), imports its three harnesses' records
(`treespec.apps.published.records`), derives Table 1 and the pairwise intervals under the paper's
convention for that size (`CONVENTIONS["dominotree-4b"]` / ``-8b``), writes them under
``out/SIZE/``, and diffs them with ``results/tables_gpunative/table1_cells[_8b].csv`` and
``pairwise_ci[_8b].csv``.  It also derives Table 1 under treespec's convention and reports the
cells that move.  The result says, per size, how many cells matched of how many.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path

import attrs

from treespec.apps.published.records import HarnessRecord, read_records
from treespec.apps.published.report import Difference, diff_pairwise, diff_table1, write_tables
from treespec.apps.published.tables import CONVENTIONS, Cell, pairwise, table1

__all__ = ["SizeResult", "convention_shift", "dominotree_layout", "reproduce_dominotree"]


@attrs.frozen
class SizeResult:
    """One model size's reproduction."""

    model: str
    table_cells: int  # cells compared (Table 1)
    table_differences: tuple[Difference, ...]
    pair_cells: int  # comparisons compared (pairwise table)
    pair_differences: tuple[Difference, ...]
    shift: str  # what treespec's own convention changes, one paragraph
    files: tuple[Path, ...]

    @property
    def matched(self) -> bool:
        return not self.table_differences and not self.pair_differences


def dominotree_layout(clone: Path) -> list[dict]:
    """Per model size present in the clone: its label, raw folders and published CSVs."""
    results = clone / "results"
    if not results.is_dir():
        raise ValueError(f"{clone} holds no results/ folder: is it a clone of the DominoTree repository?")
    sizes = []
    for size, raw, suffix in (("4b", results / "raw", ""), ("8b", results / "raw" / "8b", "_8b")):
        if not (raw / "dominotree").is_dir():
            continue
        tables = results / "tables_gpunative"
        sizes.append({"size": size, "model": f"Qwen3-{size.upper()}",
                      "raw": {"dominotree-harness": raw / "dominotree",
                              "caddtree-harness": raw / "baseline_ddtree_caddtree",
                              "domino-official": raw / "domino_official" / f"qwen3-{size}"},
                      "table1": tables / f"table1_cells{suffix}.csv", "pairwise": tables / f"pairwise_ci{suffix}.csv"})
    if not sizes:
        raise ValueError(f"{results} holds no raw/dominotree/ records")
    return sizes


def _flips(paper: list[Cell], ours: list[Cell], focus: str) -> tuple[int, int]:
    """(cells where ``focus`` and another non-AR row swap order between the conventions, cells compared)."""
    a = {(c.temperature, c.dataset, c.label): c.speedup for c in paper}
    b = {(c.temperature, c.dataset, c.label): c.speedup for c in ours}
    flips = total = 0
    for (temp, dataset, label), speed in a.items():
        mine, theirs = (temp, dataset, focus), (temp, dataset, label)
        if label in (focus, "AR") or mine not in a or not all(k in b for k in (mine, theirs)):
            continue
        values = (a[mine], speed, b[mine], b[theirs])
        if not all(math.isfinite(v) for v in values):
            continue
        total += 1
        flips += (values[0] > values[1]) != (values[2] > values[3])
    return flips, total


def convention_shift(paper: list[Cell], ours: list[Cell], focus: str = "DominoTree (16)") -> str:
    """How the cells' speedups move from the paper's convention to treespec's, in one paragraph."""
    index = {(c.temperature, c.dataset, c.label): c for c in ours}
    moves = [(c, index[(c.temperature, c.dataset, c.label)]) for c in paper if (c.temperature, c.dataset, c.label) in index]
    measurable = [(a, b) for a, b in moves if math.isfinite(a.speedup) and math.isfinite(b.speedup)]
    changes = [100 * (b.speedup / a.speedup - 1) for a, b in measurable if a.label != "AR"]
    unmeasurable = len(moves) - len(measurable)
    printed = sum(1 for a, b in measurable if f"{a.speedup:.2f}" != f"{b.speedup:.2f}")
    if not changes:
        return f"treespec's convention leaves no speedup measurable ({unmeasurable} cells lack token counts or times)."
    flips, compared = _flips(paper, ours, focus)
    return (f"Under treespec's convention (speedup of totals, prompts paired with their AR, no warm-up drop) "
            f"{printed} of {len(measurable)} measurable printed speedups change: median "
            f"{statistics.median(changes):+.1f} %, from {min(changes):+.1f} % to {max(changes):+.1f} %; "
            f"{focus} and a baseline swap order in {flips} of {compared} cells"
            + (f"; {unmeasurable} cells are not measurable (their records keep no token counts or times)"
               if unmeasurable else "") + ".")


def _import(raw: dict[str, Path]) -> list[HarnessRecord]:
    return [r for fmt, path in raw.items() if path.is_dir() for r in read_records(fmt, [path])]


def reproduce_dominotree(clone: str | Path, out: str | Path, *, resamples: int | None = None,
                         progress: Callable[[str], None] = lambda _: None) -> list[SizeResult]:
    """Every model size's reproduction (module docstring)."""
    results = []
    for layout in dominotree_layout(Path(clone)):
        progress(f"{layout['model']}: importing the raw records")
        records = _import(layout["raw"])
        conv = CONVENTIONS[f"dominotree-{layout['size']}"]
        if resamples is not None:
            conv = attrs.evolve(conv, resamples=resamples)
        cells = table1(records, conv)
        progress(f"{layout['model']}: pairwise intervals ({conv.resamples} resamples each)")
        pairs = pairwise(records, conv)
        where = Path(out) / layout["size"]
        files = write_tables(where, cells, pairs, conv, layout["model"])
        n_table, table_diff = diff_table1(cells, layout["table1"])
        n_pairs, pair_diff = diff_pairwise(pairs, layout["pairwise"])
        ours = table1(records, CONVENTIONS["treespec"])
        files += write_tables(where / "treespec-convention", ours, None, CONVENTIONS["treespec"], layout["model"])
        results.append(SizeResult(layout["model"], n_table, tuple(table_diff), n_pairs, tuple(pair_diff),
                                  convention_shift(cells, ours), tuple(files)))
    return results
