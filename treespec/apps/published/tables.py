"""Table 1 and the pairwise intervals of a paper, from per-prompt records, under named conventions.

Contract
--------
`Conventions` holds every choice a table makes beyond the records; the presets name the papers
they follow.  `table1(records, conv)` gives one `Cell` per (temperature, dataset, table row):

* warm-up: per harness, nothing, the first row of each method ("first-row": the DominoTree
  harness's Qwen3-4B runs had no warm-up prompt, so the paper drops each method's first
  measured response) or every turn of the first prompt ("first-prompt").
* several run modes of one method (the released Domino's CUDA-graph and eager runs): the mode
  with the higher mean tokens/s in that cell ("faster of two runs", as published), or all.
* speedup: ``mean-tps`` = mean over responses of tokens/s, divided by the same mean of the AR
  rows (the published statistic), or ``totals`` = total tokens / total decode seconds over the
  AR's (treespec's: a long response weighs by its length, so the figure is the time a user waits
  per token; it needs token counts and times, and is NaN where a source lacks them).
* AR: ``own`` divides by the AR of the row's own harness where that harness recorded one and by
  the common AR (``common_ar``) otherwise; ``common`` divides every row by the common AR.
* pairing: ``paired=False`` keeps every response of each method (the paper), ``True`` only the
  prompt turns its AR also has (treespec's bench).
* tau: the mean over responses of each response's mean acceptance length (None where no record
  holds it).  Avg columns: the mean of the datasets' cells of each group.

`pairwise(records, conv)`: the focus row against each other row, delta % = 100 (mean(a) / mean(b)
- 1) over paired units, with a 95 % percentile bootstrap interval over the units: units are
responses paired by prompt turn with raw tokens/s when both rows divide by the same AR, else
per-response speedups over the own harness's AR response of the same run position, paired by run
position (the paper's cross-harness pairing).  Rollups pool the units of a group's datasets.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from treespec.apps.published.records import HarnessRecord

__all__ = ["CONVENTIONS", "Cell", "Conventions", "Pair", "TableRow", "avg_cells", "pairwise", "table1", "with_settings"]


@attrs.frozen
class TableRow:
    """One method row of Table 1: which harness's records under which of its method names."""

    label: str  # as the table prints it
    harness: str  # record format (treespec.apps.published.records.FORMATS, or "treespec")
    method: str  # the harness's own method name


DATASETS = ("gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench", "mt-bench", "alpaca")
LABELS = {"gsm8k": "GSM8K", "math500": "MATH-500", "aime25": "AIME25", "humaneval": "HumanEval", "mbpp": "MBPP",
          "livecodebench": "LCB", "mt-bench": "MT-Bench", "alpaca": "Alpaca"}
GROUPS = {"Math": ("gsm8k", "math500", "aime25"), "Code": ("humaneval", "mbpp", "livecodebench"),
          "Chat": ("mt-bench", "alpaca"), "Overall": DATASETS}
DOMINOTREE_ROWS = (
    TableRow("AR", "caddtree-harness", "baseline"),
    TableRow("DFlash", "caddtree-harness", "dflash"),
    TableRow("DDTree@16", "caddtree-harness", "ddtree_tb16"),
    TableRow("CaDDTree", "caddtree-harness", "caddtree"),
    TableRow("Domino", "domino-official", "domino"),
    TableRow("DominoTree (16)", "dominotree-harness", "dominotree@16"),
)


@attrs.frozen
class Conventions:
    """Every choice of a table beyond the records (module docstring)."""

    speedup: str = "totals"  # "mean-tps" (mean tokens/s over AR's) or "totals" (total tokens / total time over AR's)
    ar: str = "own"  # "own" (each harness's own AR where it has one) or "common" (every row over common_ar)
    common_ar: tuple[str, str] = ("dominotree-harness", "ar")  # (harness, method) of the common AR
    own_ar: Mapping[str, str] = attrs.field(factory=lambda: {"dominotree-harness": "ar", "caddtree-harness": "baseline",
                                                              "treespec": "ar"})  # harness -> its AR method
    warmup: Mapping[str, str] = attrs.field(factory=dict)  # harness -> "first-row" or "first-prompt" dropped
    best_mode: bool = True  # of a method run in several modes, keep the faster mode per cell
    paired: bool = True  # keep only the prompt turns the row's AR also has
    rows: tuple[TableRow, ...] = DOMINOTREE_ROWS  # the table's method rows, in order
    datasets: tuple[str, ...] = DATASETS  # the table's dataset columns, in order
    groups: Mapping[str, tuple[str, ...]] = attrs.field(factory=lambda: dict(GROUPS))  # Avg columns
    focus: str = "DominoTree (16)"  # the row the pairwise table compares with every other non-AR row
    against: tuple[str, ...] = ("Domino", "DDTree@16", "CaDDTree", "DFlash")  # rows compared, in this order
    resamples: int = 10000  # bootstrap resamples of the pairwise intervals
    seed: int = 0  # bootstrap seed
    bootstrap: str = "numpy"  # "numpy" (one seeded numpy generator per comparison) or "python" (below)
    streams: Mapping[str, int] = attrs.field(factory=dict)  # python: compared row -> its own stream's seed

    def __attrs_post_init__(self) -> None:
        if self.speedup not in ("mean-tps", "totals"):
            raise ValueError(f"speedup convention must be 'mean-tps' or 'totals', got {self.speedup!r}")
        if self.ar not in ("own", "common"):
            raise ValueError(f"AR convention must be 'own' or 'common', got {self.ar!r}")
        if self.bootstrap not in ("numpy", "python"):
            raise ValueError(f"bootstrap must be 'numpy' or 'python', got {self.bootstrap!r}")
        bad = {h: w for h, w in self.warmup.items() if w not in ("first-row", "first-prompt")}
        if bad:
            raise ValueError(f"warm-up drops are 'first-row' or 'first-prompt', got {bad}")


# The paper's intervals: Python's random.Random streams, one seeded 12345 for the released Domino, one
# seeded 1 for DFlash (added later, so the others' intervals did not move), one seeded 0 shared by
# the rest, drawn in table order (temperature, then datasets and rollups, then `against`).
_PAPER_STREAMS = {"Domino": 12345, "DFlash": 1}

# The DominoTree paper's Table 1 (Qwen3-4B and Qwen3-8B) as its script derives it, and treespec's own.
CONVENTIONS: dict[str, Conventions] = {
    "dominotree-4b": Conventions(speedup="mean-tps", paired=False, warmup={"dominotree-harness": "first-row"},
                                 bootstrap="python", streams=_PAPER_STREAMS),
    "dominotree-8b": Conventions(speedup="mean-tps", paired=False, warmup={"domino-official": "first-prompt"},
                                 bootstrap="python", streams=_PAPER_STREAMS),
    "treespec": Conventions(),
}


@attrs.frozen
class Cell:
    """One (temperature, dataset, row) cell."""

    temperature: float
    dataset: str
    label: str
    harness: str
    speedup: float  # NaN: not measurable under the convention (e.g. totals without times)
    tau: float  # NaN: no record holds acceptance lengths
    tps: float  # the row's mean tokens/s
    n: int  # responses in the cell


@attrs.frozen
class Pair:
    """The focus row against one other row, in one dataset or rollup."""

    temperature: float
    group: str  # dataset label or rollup name
    a: str  # the focus row
    b: str  # the row compared against
    unit: str  # "tps by prompt" or "speedup by run position"
    n: int
    delta_pct: float  # 100 (mean(a) / mean(b) - 1): > 0 means a is faster
    lo: float
    hi: float

    @property
    def verdict(self) -> str:
        """'faster' / 'slower' when the interval excludes 0, else 'tie'."""
        return "faster" if self.lo > 0 else "slower" if self.hi < 0 else "tie"


def _mean(values) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(finite) if finite else float("nan")


def _drop_warmup(rows: list[HarnessRecord], how: str | None) -> list[HarnessRecord]:
    if not how or not rows:
        return rows
    rows = sorted(rows, key=lambda r: r.order)
    if how == "first-row":
        return rows[1:]
    first = rows[0].prompt_id
    return [r for r in rows if r.prompt_id != first]


def _by_cell(records: Sequence[HarnessRecord], conv: Conventions) -> dict:
    """(temperature, dataset, harness, method) -> rows after the warm-up drop and the mode choice."""
    cells: dict = defaultdict(lambda: defaultdict(list))
    for r in records:
        cells[(r.temperature, r.dataset, r.harness, r.method)][r.mode].append(r)
    out = {}
    for key, modes in cells.items():
        kept = {m: _drop_warmup(rows, conv.warmup.get(key[2])) for m, rows in modes.items()}
        if conv.best_mode and len(kept) > 1:
            out[key] = max(kept.values(), key=lambda rows: _mean(r.tps for r in rows))
        else:
            out[key] = [r for rows in kept.values() for r in rows]
    return out


def _ar_of(row: TableRow, conv: Conventions) -> tuple[str, str]:
    if conv.ar == "own" and row.harness in conv.own_ar:
        return row.harness, conv.own_ar[row.harness]
    return conv.common_ar


def _rate(rows: Sequence[HarnessRecord], conv: Conventions) -> float:
    if conv.speedup == "mean-tps":
        return _mean(r.tps for r in rows)
    if not rows or any(r.new_tokens is None or not r.decode_time for r in rows):
        return float("nan")  # totals need every response's tokens and time
    return sum(r.new_tokens for r in rows) / sum(r.decode_time for r in rows)


def table1(records: Sequence[HarnessRecord], conv: Conventions) -> list[Cell]:
    """One cell per temperature x dataset x row that the records hold (module docstring)."""
    cells = _by_cell(records, conv)
    temps = sorted({r.temperature for r in records})
    out = []
    for temp in temps:
        for dataset in conv.datasets:
            for row in conv.rows:
                mine = cells.get((temp, dataset, row.harness, row.method), [])
                if not mine:
                    continue  # the records hold no such cell
                ar = cells.get((temp, dataset, *_ar_of(row, conv)), [])
                if conv.paired:
                    keys = {r.key for r in ar}
                    mine, ar = [r for r in mine if r.key in keys], [r for r in ar if r.key in {m.key for m in mine}]
                speed = _rate(mine, conv) / _rate(ar, conv) if mine and ar else float("nan")
                out.append(Cell(temp, dataset, row.label, row.harness, speed, _mean(r.mean_tau for r in mine),
                                _mean(r.tps for r in mine), len(mine)))
    return out


def avg_cells(cells: Sequence[Cell], conv: Conventions) -> dict[tuple[float, str, str], tuple[float, float]]:
    """(temperature, group, row label) -> (mean speedup, mean tau) over the group's dataset cells."""
    index = {(c.temperature, c.dataset, c.label): c for c in cells}
    out = {}
    for temp in sorted({c.temperature for c in cells}):
        for name, datasets in conv.groups.items():
            for row in conv.rows:
                members = [index[(temp, d, row.label)] for d in datasets if (temp, d, row.label) in index]
                out[(temp, name, row.label)] = (_mean(c.speedup for c in members), _mean(c.tau for c in members))
    return out


def _natural(prompt_id: str) -> tuple[int, int | str]:
    """Numeric prompt ids in numeric order, before any other id."""
    return (0, int(prompt_id)) if prompt_id.isdigit() else (1, prompt_id)


def _units(cells: dict, temp: float, dataset: str, a: TableRow, b: TableRow, conv: Conventions):
    """(unit name, [(a value, b value)]) for one dataset (module docstring)."""
    rows_a = cells.get((temp, dataset, a.harness, a.method), [])
    rows_b = cells.get((temp, dataset, b.harness, b.method), [])
    ar_a, ar_b = _ar_of(a, conv), _ar_of(b, conv)
    if ar_a == ar_b:
        tps_b = {r.key: r.tps for r in rows_b}
        ordered = sorted(rows_a, key=lambda r: (_natural(r.prompt_id), r.turn))  # prompt 2 before prompt 10
        return "tps by prompt", [(r.tps, tps_b[r.key]) for r in ordered if r.key in tps_b]

    def speedups(rows, ar):
        base = {r.order: r.tps for r in cells.get((temp, dataset, *ar), [])}
        return {r.order: r.tps / base[r.order] for r in rows if base.get(r.order, 0) > 0}

    left, right = speedups(rows_a, ar_a), speedups(rows_b, ar_b)
    return "speedup by run position", [(left[i], right[i]) for i in sorted(set(left) & set(right))]


def _delta(pairs: np.ndarray) -> float:
    return 100.0 * (pairs[:, 0].mean() / pairs[:, 1].mean() - 1.0)


def _numpy_interval(data: np.ndarray, conv: Conventions) -> tuple[float, float]:
    rng = np.random.default_rng(conv.seed)
    draws = [_delta(data[rng.integers(0, len(data), len(data))]) for _ in range(conv.resamples)]
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return float(lo), float(hi)


def _python_interval(units: list[tuple[float, float]], rng, resamples: int) -> tuple[float, float]:
    """Resample units with ``rng.randrange``; the 2.5 / 97.5 % points as the sorted draws' elements at
    int(q (R - 1)) (no interpolation): the convention of the paper's script."""
    draws = []
    for _ in range(resamples):
        sample = [units[rng.randrange(len(units))] for _ in units]
        value = 100.0 * (statistics.fmean(a for a, _ in sample) / statistics.fmean(b for _, b in sample) - 1.0)
        if math.isfinite(value):
            draws.append(value)
    draws.sort()
    return draws[int(0.025 * (len(draws) - 1))], draws[int(0.975 * (len(draws) - 1))]


def pairwise(records: Sequence[HarnessRecord], conv: Conventions) -> list[Pair]:
    """The focus row against each row of ``conv.against``, per dataset and rollup (module docstring)."""
    import random

    cells = _by_cell(records, conv)
    by_label = {r.label: r for r in conv.rows}
    missing = [name for name in (conv.focus, *conv.against) if name not in by_label]
    if missing:
        raise ValueError(f"pairwise rows {missing} are not rows of the table ({', '.join(by_label)})")
    focus = by_label[conv.focus]
    streams = {name: random.Random(seed) for name, seed in conv.streams.items()}
    shared = random.Random(conv.seed)
    groups = [(LABELS.get(d, d), (d,)) for d in conv.datasets] + list(conv.groups.items())
    out = []
    for temp in sorted({r.temperature for r in records}):
        for name, datasets in groups:
            for other in (by_label[label] for label in conv.against):
                units, kind = [], ""
                for dataset in datasets:
                    kind, found = _units(cells, temp, dataset, focus, other, conv)
                    units += found
                data = np.array(units, dtype=np.float64).reshape(-1, 2)
                nan = float("nan")
                delta = 100.0 * (statistics.fmean(a for a, _ in units) / statistics.fmean(b for _, b in units) - 1.0) \
                    if units else nan
                if len(units) < 2 or conv.resamples <= 0:
                    lo, hi = nan, nan
                elif conv.bootstrap == "python":
                    lo, hi = _python_interval(units, streams.get(other.label, shared), conv.resamples)
                else:
                    lo, hi = _numpy_interval(data, conv)
                out.append(Pair(temp, name, focus.label, other.label, kind, len(units), delta, lo, hi))
    return out


_SETTABLE = {"speedup": str, "ar": str, "paired": bool, "best_mode": bool, "resamples": int, "seed": int,
             "bootstrap": str, "focus": str}


def with_settings(conv: Conventions, settings: Sequence[str]) -> Conventions:
    """``conv`` with ``KEY=VALUE`` settings applied (``speedup=totals``, ``paired=false``,
    ``warmup=dominotree-harness:first-row`` (``none`` clears it), ``resamples=2000``, ...), each checked."""
    changes: dict = {}
    for item in settings:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"a convention setting is KEY=VALUE, got {item!r}")
        if key == "warmup":
            drops = dict(changes.get("warmup", conv.warmup)) if value != "none" else {}
            if value != "none":
                harness, colon, how = value.partition(":")
                if not colon:
                    raise ValueError(f"warmup takes HARNESS:first-row, HARNESS:first-prompt or none, got {value!r}")
                drops[harness] = how
            changes["warmup"] = drops
        elif key in _SETTABLE:
            kind = _SETTABLE[key]
            if kind is bool:
                if value.lower() not in ("true", "false"):
                    raise ValueError(f"{key} takes true or false, got {value!r}")
                changes[key] = value.lower() == "true"
            else:
                try:
                    changes[key] = kind(value)
                except ValueError:
                    raise ValueError(f"{key} takes a {kind.__name__}, got {value!r}") from None
        else:
            raise ValueError(f"no convention {key!r}; settable: {', '.join(sorted([*_SETTABLE, 'warmup']))}")
    return attrs.evolve(conv, **changes)
