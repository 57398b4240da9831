"""A drafter from a checkpoint directory, whichever kind it holds (registry name ``"checkpoint"``).

``from_checkpoint(path, **kwargs)`` reads the directory's ``config.json`` and loads it with
`DominoDrafter` when it is a Domino checkpoint (``dflash_config.projector_type`` present), else
with `DFlashDrafter`; ``kwargs`` go to ``from_pretrained`` (dtype, device).
"""

from __future__ import annotations

from pathlib import Path

from treespec.drafters.config import read_config
from treespec.drafters.dflash import DFlashDrafter
from treespec.drafters.domino import DominoDrafter

__all__ = ["from_checkpoint"]


def from_checkpoint(path: str | Path, **kwargs) -> DFlashDrafter:
    """The DFlash or Domino drafter stored at ``path``."""
    cls = DominoDrafter if read_config(path).is_domino else DFlashDrafter
    return cls.from_pretrained(path, **kwargs)
