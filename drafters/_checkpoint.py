"""Safetensors checkpoint I/O with strict key matching.

Contract: `load_weights` reads ``model.safetensors`` (or the shards named by
``model.safetensors.index.json``) and returns the tensors unchanged (dtype and bits as stored);
`check_state` compares them against a module's state dict and raises `CheckpointError` naming
every missing key, unexpected key and shape mismatch.  `save_weights` writes one
``model.safetensors``.  No pickles are read or written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["CheckpointError", "check_state", "load_weights", "save_weights"]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DOMINO_HEAD_PREFIXES = ("prefix_gru.", "embed_proj.")  # keys only a Domino checkpoint has


class CheckpointError(ValueError):
    """A checkpoint whose files or tensors do not match the model being loaded."""


def _shard_files(directory: Path) -> list[Path]:
    single = directory / WEIGHTS_NAME
    if single.is_file():
        return [single]
    index = directory / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [directory / name for name in sorted(set(weight_map.values()))]
    raise CheckpointError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {directory}")


def load_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint in ``directory``, as stored."""
    state: dict[str, torch.Tensor] = {}
    for path in _shard_files(Path(directory)):
        if not path.is_file():
            raise CheckpointError(f"checkpoint shard {path} is missing")
        try:
            state.update(load_file(str(path)))
        except Exception as exc:  # safetensors raises its own error types for a damaged header or body
            raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None
    return state


def save_weights(directory: str | Path, state: Mapping[str, torch.Tensor]) -> Path:
    """Write ``state`` to ``directory/model.safetensors`` (tensors made contiguous, on the CPU)."""
    path = Path(directory) / WEIGHTS_NAME
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(path), metadata={"format": "pt"})
    return path


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def check_state(expected: Mapping[str, torch.Tensor], found: Mapping[str, torch.Tensor], *, source: str) -> None:
    """Raise `CheckpointError` unless ``found`` has exactly the keys and shapes of ``expected``."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = sorted(k for k in set(expected) & set(found) if tuple(expected[k].shape) != tuple(found[k].shape))
    problems = []
    if missing:
        problems.append(f"missing keys: {_names(missing)}")
    if unexpected:
        hint = " (Domino head weights: load this checkpoint with DominoDrafter)" if any(
            k.startswith(DOMINO_HEAD_PREFIXES) for k in unexpected) else ""
        problems.append(f"unexpected keys: {_names(unexpected)}{hint}")
    for key in shapes:
        problems.append(f"{key}: checkpoint shape {tuple(found[key].shape)}, model {tuple(expected[key].shape)}")
    if problems:
        raise CheckpointError(f"checkpoint {source} does not match the model: " + "; ".join(problems))
