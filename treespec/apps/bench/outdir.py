"""A bench run's output folder: its file names, its settings, and what may happen to earlier results.

Contract
--------
A run writes ``bench.json`` (its settings), per shard ``records-rank{r}.jsonl`` and
``divergences-rank{r}.jsonl``, and after merging ``records.jsonl`` and ``divergences.jsonl``.
`prepare_out` checks a folder before anything is measured: the same settings resume, other
settings are refused unless ``overwrite`` is given; results are never silently replaced.  The
settings name the target and the drafters by `weights_identity` (path and sha256 of the weights, or
of the one file an engine runs: a GGUF file's quantization is part of it), so new weights saved over
the same path are other settings, not a resume.  `lock_out` makes one run at a time write a folder:
a second one is refused at its start (the lock goes with the process, so a killed run leaves the
folder usable).  `bench` and `demo` keep this one contract.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import attrs

from treespec.apps.assembly.methods import MethodSpec
from treespec.apps.bench.config import BenchConfig

__all__ = ["DIVERGENCES", "LOCK", "RECORDS", "SETTINGS", "abandon_out", "lock_out", "measured_settings", "open_out",
           "prepare_out",
           "run_settings",
           "shard_files", "shard_paths", "unlock_out", "weights_identity", "write_settings"]

RECORDS, DIVERGENCES, SETTINGS, LOCK = "records.jsonl", "divergences.jsonl", "bench.json", ".lock"


def shard_paths(out_dir: Path, rank: int) -> tuple[Path, Path]:
    return out_dir / f"records-rank{rank}.jsonl", out_dir / f"divergences-rank{rank}.jsonl"


def _rank_of(path: Path) -> int:
    return int(re.search(r"rank(\d+)", path.name).group(1))


def shard_files(out_dir: Path, stem: str) -> list[Path]:
    """The ``{stem}-rank*.jsonl`` files of ``out_dir``, by rank."""
    return sorted(out_dir.glob(f"{stem}-rank*.jsonl"), key=_rank_of)


def run_settings(config: BenchConfig, methods: Sequence[MethodSpec], extra: dict) -> dict:
    """What a run measures, as JSON-ready data: the config, the expanded methods and ``extra``."""
    settings = attrs.asdict(config) | {"expanded_methods": [m.name for m in methods]} | extra
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def weights_identity(model: str | Path) -> dict[str, str]:
    """``{"path", "sha256"}`` of a model or drafter directory (its safetensors weights) or of a model
    file (a GGUF file an engine runs): where it is and what its weights are."""
    from treespec.apps.assembly.loading import model_identity

    return {"path": str(model), "sha256": model_identity(str(model), model)["sha256"]}


def measured_settings(config: BenchConfig, methods: Sequence[MethodSpec], session, *, model: str | Path,
                      drafters: dict[str, Path], engine: str, logits_dtype: str, cost_model: str,
                      device: str) -> dict:
    """What a measuring run's records depend on: its config and methods, the weights its engine runs for
    ``model`` (the folder's safetensors, or the one file an engine runs: a GGUF file and so its
    quantization), the drafters' weights, the target's dtype, the engine and its numeric path (the target's
    ``describe``: exact kernels, a K/V cache type), torch, the cost model and the device.  The same settings resume a folder; other ones are refused (`prepare_out`)."""
    import torch

    from treespec.apps.assembly.loading import model_path

    return run_settings(config, methods, {
        "model": weights_identity(model_path(model, engine)),
        "drafters": {k: weights_identity(p) for k, p in drafters.items()},
        "dtype": str(session.target.dtype).removeprefix("torch."), "logits_dtype": logits_dtype, "engine": engine,
        "target": session.target.describe(), "torch": torch.__version__, "cost_model": cost_model, "device": device})


_LOCKS: dict[Path, int] = {}  # folder -> the open descriptor of its lock, held while this process runs
_MADE: set[Path] = set()  # folders `lock_out` created (removed again by `abandon_out` while empty)


def lock_out(out_dir: Path) -> None:
    """Make this process the one writer of ``out_dir`` (created if missing): a ValueError naming the
    other run when one holds it.  The lock (``.lock``, an flock) is released when the process ends,
    or by `abandon_out` for a run that ends before it measured anything."""
    import fcntl
    import os

    key = out_dir.resolve()
    if key in _LOCKS:
        return
    if not out_dir.exists():
        _MADE.add(key)
    out_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ValueError(f"{out_dir} is being written by another run (process {holder}); wait for it to end, or "
                         "choose another --out") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _LOCKS[key] = fd


def unlock_out(out_dir: Path) -> None:
    """Give up the lock `lock_out` took (a run that ends before its process does)."""
    import os

    fd = _LOCKS.pop(out_dir.resolve(), None)
    if fd is not None:
        os.close(fd)


def abandon_out(out_dir: Path) -> None:
    """A run that could not start: its lock given up, and the folder removed again when `lock_out` made
    it and nothing but the lock is in it (nothing is left behind by a run that measured nothing)."""
    unlock_out(out_dir)
    key = out_dir.resolve()
    if key in _MADE and [p.name for p in out_dir.iterdir()] == [LOCK]:
        (out_dir / LOCK).unlink()
        out_dir.rmdir()
    _MADE.discard(key)


def open_out(out_dir: Path, settings: dict, *, overwrite: bool = False) -> str:
    """`lock_out`, `prepare_out` and `write_settings` in one: the folder ready for this run's records
    ("new", "resume" or "overwrite", as `prepare_out` says)."""
    lock_out(out_dir)
    state = prepare_out(out_dir, settings, overwrite=overwrite)
    write_settings(out_dir, settings)
    return state


def write_settings(out_dir: Path, settings: dict) -> Path:
    """``bench.json``: the run's settings (the report does not read them; a resumed run checks them)."""
    (out_dir / SETTINGS).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return out_dir / SETTINGS


_RESULTS = (RECORDS, DIVERGENCES, "summary.csv", "pairs.csv", "summary.md", "lossless.md", "tau_hist.svg",
            "tau_hist.png", "budget_curves.svg", "budget_curves.png")


def prepare_out(out_dir: Path, settings: dict, *, overwrite: bool = False) -> str:
    """Check ``out_dir`` against this run's ``settings`` before anything is measured.

    Returns "new" (nothing there), "resume" (the same configuration: completed conversations are
    kept) or "overwrite" (another configuration's results removed, as asked); raises ValueError for
    another configuration's results without ``overwrite``.  A merged single-process run is turned
    back into its shard so it can be resumed or extended.
    """
    results = [out_dir / n for n in _RESULTS if (out_dir / n).exists()] + shard_files(out_dir, "records") + \
        shard_files(out_dir, "divergences")
    if not results:
        return "new"
    previous = _read_settings(out_dir)
    if previous == settings:
        if (out_dir / RECORDS).is_file() and not shard_files(out_dir, "records"):
            (out_dir / RECORDS).replace(shard_paths(out_dir, 0)[0])
            if (out_dir / DIVERGENCES).is_file():
                (out_dir / DIVERGENCES).replace(shard_paths(out_dir, 0)[1])
        return "resume"
    if not overwrite:
        differ = sorted(k for k in set(settings) | set(previous or {}) if (previous or {}).get(k) != settings.get(k))
        what = f"differs in {', '.join(differ)}" if previous is not None else "has no bench.json"
        raise ValueError(f"{out_dir} holds the results of another bench configuration ({what}); choose another "
                         "--out, or pass --overwrite to replace them")
    for path in results:
        path.unlink()
    return "overwrite"


def _read_settings(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / SETTINGS).read_text())
    except (OSError, ValueError):
        return None
