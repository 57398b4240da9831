"""The parts a run loads, in one place: the target, its tokenizer and the drafters it names.

Contract
--------
`Parts.load(model_dir, drafter_dirs)` loads the drafters first (a missing or unloadable checkpoint
fails, naming it, before the target's weights are read), then the target (the embedded SmolLM2 when
``model_dir`` is None) and its tokenizer (None for a bare model directory unless one is required).
``parts.name`` is how records name the target; ``parts.stop_ids`` the ids a generation stops at.
Bench, demo and replay load through it.  The api keeps its own entry because it also takes live
objects (a `TargetModel`, a module, a drafter instance) in place of directories, and ``treespec
draw --drafter DIR`` takes a checkpoint directory of either kind, read by its config, as the api does.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from treespec.apps.methods import load_named_drafter
from treespec.apps.models import eos_ids
from treespec.interfaces import Drafter
from treespec.target import TargetModel

__all__ = ["Parts"]

EMBEDDED_NAME = "smollm2-135m-instruct"  # how records name the embedded default


@attrs.frozen(eq=False)
class Parts:
    """What a run decodes with."""

    target: TargetModel
    tokenizer: Any  # the target's tokenizer; None for a bare model directory (prompts as token ids)
    name: str  # how records name the target (the embedded default's name, else its directory)
    drafters: Mapping[str, Drafter] = attrs.field(factory=dict)  # registered drafter name -> drafter

    @classmethod
    def load(cls, model_dir: str | Path | None, drafter_dirs: Mapping[str, str | Path] | None = None, *,
             dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu", float32_head: bool | None = None,
             tokenizer_required: bool = True) -> Parts:
        """The parts of the module docstring, drafters first."""
        from treespec.apps.api import load_target, load_tokenizer
        from treespec.apps.embedded import embedded_model_dir

        drafters = {name: load_named_drafter(name, path) for name, path in (drafter_dirs or {}).items()}
        path = Path(model_dir) if model_dir is not None else embedded_model_dir()
        target = load_target(path, dtype=dtype, device=device, float32_head=float32_head)
        try:
            tokenizer = load_tokenizer(path)
        except (OSError, ValueError):
            if tokenizer_required:
                raise
            tokenizer = None  # a bare model directory: prompts must come as token ids
        return cls(target, tokenizer, EMBEDDED_NAME if model_dir is None else str(model_dir), drafters)

    @property
    def stop_ids(self) -> list[int]:
        return eos_ids(self.tokenizer, self.target.config)
