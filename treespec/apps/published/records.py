"""Other harnesses' per-prompt records, read as they are stored, saying what they do not hold.

Contract
--------
`read_records(FORMAT, paths)` reads the raw files of one harness into `HarnessRecord`s.  A
record keeps only what its source holds: a field the source lacks is None (never invented), and
``order`` is the record's position among its method's rows of the same file, the run order
(the source writes rows as it runs them).  Formats, named by what writes them:

* ``dominotree-harness``: the DominoTree repository's benchmark harness, ``<dataset>_T<temp>.jsonl``
  rows with ``method``, ``sample_idx``, ``turn_index``, ``num_output``, ``decode_time``, ``tps``,
  ``mean_accept`` and ``out_sig`` (a signature of the output's token ids).
* ``caddtree-harness``: the CaDDTree / DDTree reference harness as exported there, the same file
  names; rows with ``method`` (``baseline`` is its AR), ``sample_idx``, and where kept
  ``turn_index``, ``num_output``, ``decode_time``, ``tps``, ``mean_accept``; no output signature.
* ``domino-official``: the released Domino decoder's answer files, ``T<temp>/<mode>_<dataset>.jsonl``
  (mode ``graph`` or ``eager``), one row per question with per-turn ``new_tokens``,
  ``decode_times`` and per-round ``acceptance_lengths`` under the block-size-16 choice; a turn
  with no new tokens or no decode time is left out (its tokens/s is undefined), and counted.

Errors name the file and line.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

__all__ = ["FORMATS", "HarnessRecord", "read_imported", "read_records", "write_imported"]

FORMATS = ("dominotree-harness", "caddtree-harness", "domino-official")
_PLAIN_NAME = re.compile(r"^(?P<dataset>.+)_T(?P<temp>\d+(?:\.\d+)?)\.jsonl$")
_DOMINO_NAME = re.compile(r"^(?P<mode>graph|eager)_(?P<dataset>.+)\.jsonl$")
_DOMINO_TEMP = re.compile(r"^T(?P<temp>\d+(?:\.\d+)?)$")


@attrs.frozen
class HarnessRecord:
    """One measured response of another harness, as far as its source tells."""

    harness: str  # the format that wrote it (FORMATS)
    method: str  # the source's own method name ("ar", "dominotree@16", "baseline", "ddtree_tb16", "domino", ...)
    dataset: str
    temperature: float
    prompt_id: str  # the source's prompt index
    turn: int  # 0-based turn (the source's turn_index; 0 where it keeps none)
    order: int  # position among this method's rows of its file: the run order
    tps: float  # tokens per second of the response, as recorded (or new_tokens / decode_time)
    new_tokens: int | None = None  # response tokens (None: not recorded)
    decode_time: float | None = None  # seconds (None: not recorded)
    mean_tau: float | None = None  # mean acceptance length (None: not recorded)
    taus: tuple[int, ...] | None = None  # per-round acceptance lengths (None: not recorded)
    signature: str | None = None  # the source's signature of the output ids (None: none recorded)
    mode: str = ""  # the source's run mode where it has several (domino-official: graph or eager)
    source: str = ""  # the file it came from

    @property
    def key(self) -> tuple[str, int]:
        return (self.prompt_id, self.turn)


def _rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object")
            rows.append(row)
    return rows


def _number(row: dict, key: str, where: str, kind=float, required: bool = False):
    if key not in row or row[key] is None:
        if required:
            raise ValueError(f"{where}: no {key!r}")
        return None
    try:
        return kind(row[key])
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {key!r} is not a number ({row[key]!r})") from None


def _files(paths: Iterable[str | Path], pattern: re.Pattern, glob: str) -> list[Path]:
    out = []
    for path in map(Path, paths):
        if path.is_dir():
            out += sorted(p for p in path.rglob(glob) if pattern.match(p.name))
        elif path.is_file():
            out.append(path)
        else:
            raise ValueError(f"no raw records at {path}")
    return out


def _read_plain(fmt: str, path: Path) -> list[HarnessRecord]:
    """A ``<dataset>_T<temp>.jsonl`` file of the DominoTree or the CaDDTree harness."""
    named = _PLAIN_NAME.match(path.name)
    if named is None:
        raise ValueError(f"{path}: a {fmt} file is named <dataset>_T<temperature>.jsonl")
    order: dict[str, int] = defaultdict(int)
    out = []
    for n, row in enumerate(_rows(path), 1):
        where = f"{path}:{n}"
        method = row.get("method")
        if not isinstance(method, str):
            raise ValueError(f"{where}: no 'method'")
        tokens = _number(row, "num_output", where, int)
        seconds = _number(row, "decode_time", where)
        tps = _number(row, "tps", where)
        if tps is None:
            if tokens is None or not seconds:
                raise ValueError(f"{where}: neither 'tps' nor 'num_output' with 'decode_time'")
            tps = tokens / seconds
        out.append(HarnessRecord(
            fmt, method, named["dataset"], float(named["temp"]), str(_number(row, "sample_idx", where, int, True)),
            _number(row, "turn_index", where, int) or 0, order[method], tps, tokens, seconds,
            _number(row, "mean_accept", where), None, row.get("out_sig") if fmt == "dominotree-harness" else None,
            "", str(path)))
        order[method] += 1
    return out


def _read_domino(path: Path) -> list[HarnessRecord]:
    """A ``T<temp>/<mode>_<dataset>.jsonl`` answer file of the released Domino decoder."""
    named, temp = _DOMINO_NAME.match(path.name), _DOMINO_TEMP.match(path.parent.name)
    if named is None or temp is None:
        raise ValueError(f"{path}: a domino-official file is T<temperature>/<graph|eager>_<dataset>.jsonl")
    out, order = [], 0
    for n, row in enumerate(_rows(path), 1):
        where = f"{path}:{n}"
        choice = next((c for c in row.get("choices", []) if str(c.get("block_size")) != "1"), None)
        if choice is None:
            raise ValueError(f"{where}: no speculative (block size > 1) choice")
        qid = str(_number(row, "question_id", where, int, True))
        accs = choice.get("acceptance_lengths", [])
        for turn, (tokens, seconds) in enumerate(zip(choice["new_tokens"], choice["decode_times"])):
            if not tokens or seconds <= 0:
                continue  # tokens/s undefined: the source measured nothing for this turn
            taus = tuple(int(t) for t in accs[turn]) if turn < len(accs) and accs[turn] else None
            out.append(HarnessRecord(
                "domino-official", "domino", named["dataset"], float(temp["temp"]), qid, turn, order,
                tokens / seconds, int(tokens), float(seconds), statistics.fmean(taus) if taus else None, taus,
                None, named["mode"], str(path)))
            order += 1
    return out


def read_records(fmt: str, paths: Sequence[str | Path]) -> list[HarnessRecord]:
    """Every record of the files (or folders of files) ``paths``, written by ``fmt`` (module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown record format {fmt!r}; known: {', '.join(FORMATS)}")
    if fmt == "domino-official":
        return [r for path in _files(paths, _DOMINO_NAME, "*.jsonl") for r in _read_domino(path)]
    return [r for path in _files(paths, _PLAIN_NAME, "*.jsonl") for r in _read_plain(fmt, path)]


def write_imported(records: Iterable[HarnessRecord], path: str | Path) -> Path:
    """One JSON object per record (`read_imported` reads them back)."""
    path = Path(path)
    with open(path, "w") as fh:
        for r in records:
            fh.write(json.dumps(attrs.asdict(r), sort_keys=True) + "\n")
    return path


def read_imported(path: str | Path) -> list[HarnessRecord]:
    out = []
    for n, row in enumerate(_rows(Path(path)), 1):
        try:
            if row.get("taus") is not None:
                row["taus"] = tuple(row["taus"])
            out.append(HarnessRecord(**row))
        except TypeError as exc:
            raise ValueError(f"{path}:{n}: not an imported record ({exc})") from None
    return out
