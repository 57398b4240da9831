"""Where the apps load what a run decodes with: the target, its tokenizer, the drafters.

Contract
--------
One loader of each: `load_target` (a local model folder, a transformers module or a `TargetModel`),
`load_tokenizer` (a local model folder's; a clear error when it has none) and `load_drafter` (an
instance, a registered name, a checkpoint folder read by its config, or a registered name loaded
from a folder by its declared ``from_pretrained``).  `drafter_dirs` resolves the ``--drafter
NAME=DIR`` flags of a run (the embedded default's own drafters when none is given) and
`embedded_drafter_dir` names those shipped in ``treespec/assets/``.  `Parts.load(model_dir,
drafter_dirs)` loads the drafters first (a missing or unloadable checkpoint fails, naming it,
before the target's weights are read), then the target (the embedded SmolLM2 when ``model_dir`` is
None) and its tokenizer (None for a bare model directory unless one is required); bench, demo and
replay load through it, the api and ``treespec draw`` through the three loaders.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from treespec import registry
from treespec.apps.methods import DEFAULT_DRAFTERS, drafter_names
from treespec.apps.models import eos_ids
from treespec.interfaces import Drafter
from treespec.target import TargetModel

__all__ = ["EMBEDDED_NAME", "Parts", "drafter_dirs", "embedded_drafter_dir", "load_drafter", "load_target",
           "load_tokenizer"]

PathLike = str | os.PathLike
EMBEDDED_NAME = "smollm2-135m-instruct"  # how records name the embedded default
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_target(model: PathLike | TargetModel | torch.nn.Module, *, dtype: torch.dtype | str = "auto",
                device: str | torch.device = "cpu", float32_head: bool | None = None) -> TargetModel:
    """A `TargetModel` from a directory, a transformers model, or itself.

    ``float32_head``: the final norm and LM head of a bf16/fp16 target in float32 (None: on).
    """
    if isinstance(model, TargetModel):
        return model
    if isinstance(model, torch.nn.Module):
        return TargetModel(model, float32_head=float32_head)
    if not Path(model).is_dir():
        raise FileNotFoundError(f"no local model directory at {model}")
    return TargetModel.from_local(model, dtype=_resolved_dtype(model, dtype, device), device=device,
                                  float32_head=float32_head)


def _resolved_dtype(path: PathLike, dtype: torch.dtype | str, device: str | torch.device) -> torch.dtype | str:
    """``dtype`` for `TargetModel.from_local`: ``"auto"`` becomes this machine's faster dtype for the
    model (measured once and cached, `treespec.pricing.hardware`), bf16 on CUDA, or the stored one."""
    if dtype != "auto":
        return dtype
    from transformers import AutoConfig

    from treespec.pricing.hardware import resolve_dtype

    if not (Path(path) / "config.json").is_file():
        return dtype  # from_local names the missing config
    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    resolved = resolve_dtype("auto", device=device, config=config)
    return "checkpoint" if resolved == "auto" else resolved


def load_tokenizer(path: PathLike) -> Any:
    """The tokenizer of a local model directory; a clear error when the directory has none."""
    if not any((Path(path) / name).is_file() for name in _TOKENIZER_FILES):
        # transformers 5 would build an empty tokenizer here; refuse instead of encoding garbage
        raise ValueError(f"no tokenizer files in {path}: pass tokenizer= or token ids")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


def load_drafter(drafter: Drafter | PathLike | None, path: PathLike | None = None, **kwargs: Any) -> Drafter | None:
    """The one drafter loader: ``drafter`` itself (an instance, or None for AR); with ``path``, the
    registered drafter ``drafter`` loaded from that folder through its declared loader (its class's
    ``from_pretrained``); a DFlash / Domino checkpoint folder, read by its config; or a registered
    name built with ``kwargs``.  A missing folder or a drafter with no loader is refused by name."""
    if drafter is None or isinstance(drafter, Drafter):
        return drafter
    if path is not None:
        return _from_folder(str(drafter), Path(path))
    if Path(drafter).is_dir():
        return registry.create("drafter", "checkpoint", path=drafter, **kwargs)
    if str(drafter) not in registry.available("drafter") and (
            isinstance(drafter, os.PathLike) or os.sep in str(drafter) or Path(drafter).exists()):
        raise FileNotFoundError(f"no drafter checkpoint directory at {drafter}")
    return registry.create("drafter", str(drafter), **kwargs)


def _from_folder(name: str, path: Path) -> Drafter:
    """The registered drafter ``name`` loaded from ``path`` by its class's ``from_pretrained``."""
    if not path.is_dir():
        raise FileNotFoundError(f"no {name} drafter checkpoint at {path}: pass --drafter {name}=DIR, or leave out "
                                f"the methods that need the {name} drafter")
    try:
        return registry.resolve("drafter", name).from_pretrained(path)
    except NotImplementedError as exc:
        raise ValueError(f"the {name} drafter: {exc}") from None


def drafter_dirs(names, given: list[str], flags: Mapping[str, Path | None] | None = None, *,
                 embedded: bool = True) -> dict[str, Path]:
    """NAME -> checkpoint directory for each drafter of ``names``: from ``given`` (``NAME=DIR`` texts
    of ``--drafter``) or ``flags`` (``--dflash DIR``-style, by name), else the embedded target's own
    drafter when ``embedded``; a missing one, an unknown name or a malformed flag is refused by name."""
    dirs = {name: Path(path) for name, path in (flags or {}).items() if path is not None}
    known = drafter_names() if given else []
    for item in given:
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            raise ValueError(f"--drafter takes NAME=DIR, got {item!r}")
        if name not in known:
            raise ValueError(f"--drafter {item}: unknown drafter {name!r}; available: {', '.join(known)}")
        dirs[name] = Path(path)
    out = {}
    for name in names:
        if name in dirs:
            out[name] = dirs[name]
        elif embedded and name in DEFAULT_DRAFTERS.values():
            out[name] = embedded_drafter_dir(name)
        else:
            raise ValueError(f"a method runs over the {name} drafter: give its checkpoint with --drafter {name}=DIR")
    return out


def embedded_drafter_dir(kind: str) -> Path:
    """Directory of the drafter shipped for the embedded SmolLM2 target ("dflash" or "domino")."""
    if kind not in ("dflash", "domino"):
        raise ValueError(f"embedded drafters are 'dflash' and 'domino', got {kind!r}")
    return Path(__file__).resolve().parents[1] / "assets" / f"smollm2-135m-instruct-{kind}"


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
        from treespec.apps.embedded import embedded_model_dir

        drafters = {name: load_drafter(name, path) for name, path in (drafter_dirs or {}).items()}
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
