"""A training run's checkpoints: each written whole beside the last, made current in one atomic step, checked when read.

Contract
--------
A run directory ``OUT`` keeps its checkpoints in ``OUT/checkpoints/step-NNNNNNNN/`` (the drafter in its
released layout, the optimiser's moments, the trainer state and a ``manifest.json`` of every file's
size and sha256).  ``OUT/checkpoint`` is a symbolic link to the current one; ``OUT/drafter`` and
``OUT/trainer_state.json`` link through it, so the paths a user reads stay put.

* `write_checkpoint(out, step, write)`: ``write(folder)`` fills ``checkpoints/step-N.partial/``; the
  files are flushed to disk, the manifest written, the folder renamed to ``step-N`` and the link
  replaced (`os.replace`: atomic).  Only then are older checkpoints removed, all but the one before
  (a fallback).  A crash at any moment leaves the old checkpoint current, or the new one: never a mix.
* `current_checkpoint(out)`: the checkpoint a resume takes: the current one if its manifest checks, else
  the newest that checks (`Resumed.note` says why the current one was passed over); None for a run
  with none.  A checkpoint whose files do not match its manifest (cut, missing, changed) never loads.
  Partial folders of an interrupted save are removed.
* `replace_folder(path, write)`: a folder such as ``best/`` replaced whole (written beside it, then two
  renames; a crash between them is repaired at the next call or `restore_folder`).
* A run written before checkpoints were units (``drafter/``, ``optimizer.safetensors`` and
  ``trainer_state.json`` directly in ``OUT``) resumes as it is, said so; its next save makes it a unit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import attrs

__all__ = ["CheckpointError", "Resumed", "current_checkpoint", "replace_folder", "write_checkpoint"]

MANIFEST = "manifest.json"
LINKS = ("drafter", "trainer_state.json")  # what OUT shows of the current checkpoint
_PREFIX = "step-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted (its message names the file and what is wrong)."""


@attrs.frozen
class Resumed:
    """The checkpoint a resume takes."""

    folder: Path  # the checkpoint's folder
    step: int  # its step
    note: str = ""  # why another one was passed over (empty: it is the current one)
    legacy: bool = False  # a run directory from before checkpoints were units


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _sync(path: Path) -> None:
    """Flush ``path`` (a file or a folder's entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def write_checkpoint(out: Path, step: int, write: Callable[[Path], None]) -> Path:
    """Write the checkpoint of ``step`` as a unit and make it current (module docstring); its folder."""
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f"{_name(step)}.partial"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    write(partial)
    files = _files(partial)
    manifest = {"step": step, "files": {str(p.relative_to(partial)): {"bytes": p.stat().st_size, "sha256": _digest(p)}
                                        for p in files}}
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for path in [*files, partial / MANIFEST, *{p.parent for p in files}, partial]:
        _sync(path)
    final = root / _name(step)
    if final.exists():  # a checkpoint of this step already (a run resumed and stopped at once): replaced
        shutil.rmtree(final)
    partial.rename(final)
    _sync(root)
    _point(out, final)
    _prune(root, keep=final)
    return final


def _point(out: Path, folder: Path) -> None:
    """``OUT/checkpoint`` -> ``folder`` in one atomic replace, and the links through it."""
    link, fresh = out / "checkpoint", out / "checkpoint.new"
    if fresh.is_symlink() or fresh.exists():
        fresh.unlink()
    fresh.symlink_to(folder.relative_to(out))
    os.replace(fresh, link)
    for name in LINKS:
        view = out / name
        if view.is_symlink():
            continue
        if view.is_dir():
            shutil.rmtree(view)  # a run from before checkpoints were units: its copy now lives in the checkpoint
        elif view.exists():
            view.unlink()
        view.symlink_to(Path("checkpoint") / name)
    legacy = out / "optimizer.safetensors"
    if legacy.is_file():
        legacy.unlink()
    _sync(out)


def _prune(root: Path, keep: Path) -> None:
    """Remove older checkpoints, all but the newest one before ``keep``, and partial folders."""
    done = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.endswith(".partial") and p != keep),
                  key=lambda p: p.name)
    for folder in done[:-1]:
        shutil.rmtree(folder)
    for folder in root.glob("*.partial"):
        shutil.rmtree(folder)


def check(folder: Path) -> int:
    """The step of the checkpoint at ``folder`` if every file matches its manifest, else `CheckpointError`."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        files, step = manifest["files"], int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: no readable manifest ({exc})") from None
    present = {str(p.relative_to(folder)) for p in _files(folder)}
    missing = sorted(set(files) - present)
    if missing:
        raise CheckpointError(f"{folder}: {', '.join(missing)} missing")
    for name, entry in files.items():
        p = folder / name
        if p.stat().st_size != entry["bytes"] or _digest(p) != entry["sha256"]:
            raise CheckpointError(f"{p}: {p.stat().st_size} bytes that do not match the manifest's "
                                  f"{entry['bytes']} bytes and sha256 (cut or changed after it was written)")
    return step


def current_checkpoint(out: Path) -> Resumed | None:
    """The checkpoint a resume takes (module docstring), or None when the run has none."""
    root = out / "checkpoints"
    for partial in root.glob("*.partial") if root.is_dir() else ():
        shutil.rmtree(partial)
    link = out / "checkpoint"
    current = link.resolve() if link.is_symlink() else None
    candidates = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.name, reverse=True) \
        if root.is_dir() else []
    if current is not None and current in candidates:
        candidates.remove(current)
        candidates.insert(0, current)
    passed = []
    for folder in candidates:
        try:
            step = check(folder)
        except CheckpointError as exc:
            passed.append(str(exc))
            continue
        note = "" if folder == current else "; ".join(passed) or f"{link} named none of them"
        return Resumed(folder, step, note)
    if passed:
        raise CheckpointError(f"{out}: no checkpoint can be trusted ({'; '.join(passed)}): start a new --out")
    if (out / "trainer_state.json").is_file() and not (out / "trainer_state.json").is_symlink():
        return _legacy(out)
    return None


def _legacy(out: Path) -> Resumed:
    """A run directory from before checkpoints were units: its files as they are, readable or refused."""
    state = out / "trainer_state.json"
    try:
        step = int(json.loads(state.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{state}: not a readable trainer state ({exc}): start a new --out") from None
    return Resumed(out, step, "a run directory written before checkpoints were units: resumed from its files",
                   legacy=True)


def restore_folder(path: Path) -> None:
    """Repair what a crash inside `replace_folder` left: the old folder back where the new one never arrived;
    a half-written new one removed."""
    old, partial = path.with_name(path.name + ".old"), path.with_name(path.name + ".partial")
    if old.is_dir() and not path.exists():
        old.rename(path)
    for leftover in (old, partial):
        if leftover.is_dir():
            shutil.rmtree(leftover)


def replace_folder(path: Path, write: Callable[[Path], None]) -> None:
    """``write(folder)`` into a fresh folder beside ``path``, which then takes its place (module docstring)."""
    restore_folder(path)
    partial, old = path.with_name(path.name + ".partial"), path.with_name(path.name + ".old")
    partial.mkdir(parents=True)
    write(partial)
    for file in _files(partial):
        _sync(file)
    if path.exists():
        path.rename(old)
    partial.rename(path)
    if old.exists():
        shutil.rmtree(old)
