"""Where the apps load what a run decodes with: the target, its tokenizer, the drafters.

Contract
--------
One loader of each: `load_target` (a target as it is, or the ``engine``'s target of a model: any
registered engine, `treespec.target.Engine`: ``torch`` loads a local model folder or a transformers
module, ``llama.cpp`` runs a GGUF file through llama-cpp-python, `model_path` says which file),
`load_tokenizer` (a local model folder's; a clear error when it has none) and `load_drafter` (an
instance, a registered name, a checkpoint folder read by its config, or a registered name loaded
from a folder by its declared ``from_pretrained``).  `drafter_dirs` resolves the ``--drafter
NAME=DIR`` flags of a run (the embedded default's own drafters when none is given) and
`embedded_drafter_dir` names those shipped in ``treespec/assets/``.  A run's parts are loaded by
`treespec.apps.assembly.session.Session.load` (drafters first) or given to a `Session` as built.

For the training tools: `load_frozen_model(path, dtype_name)` loads a local transformers causal LM
(default: the embedded SmolLM2) in eval mode without gradients, its dtype resolved as the target's,
its tokenizer through `load_tokenizer`; `model_identity(name, model_dir)` is ``{"name", "sha256"}``
(the sha256 over the directory's ``*.safetensors`` files in name order), which distillation data and
teacher caches record so that data made with one target is never used with another; `eos_ids` are
the ids a generation stops at.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from treespec import registry
from treespec.registry import DEFAULT_ENGINE
from treespec.apps.assembly.methods import DEFAULT_DRAFTERS, drafter_names
from treespec.interfaces import Drafter
from treespec.target import Target

__all__ = ["DEFAULT_ENGINE", "EMBEDDED_NAME", "check_sha256", "drafter_dirs", "drafter_source", "embedded_drafter_dir",
           "engine_class", "engines", "eos_ids", "load_drafter", "load_frozen_model", "load_target", "load_tokenizer",
           "model_identity", "model_path"]

PathLike = str | os.PathLike
EMBEDDED_NAME = "smollm2-135m-instruct"  # how records name the embedded default
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")



def engines() -> list[str]:
    """The engines a target can run on (registry kind "engine"), the default first."""
    return [DEFAULT_ENGINE, *(e for e in registry.available("engine") if e != DEFAULT_ENGINE)]


def engine_class(engine: str):
    """The registered `treespec.target.Engine` class of ``engine`` (a ValueError naming the known ones)."""
    if engine not in registry.available("engine"):
        raise ValueError(f"unknown engine {engine!r}; available: {', '.join(engines())}")
    return registry.resolve("engine", engine)


def load_target(model: PathLike | Target | torch.nn.Module, *, dtype: torch.dtype | str = "auto",
                device: str | torch.device = "cpu", float32_head: bool | None = None,
                engine: str = DEFAULT_ENGINE, exact: bool | None = None) -> Target:
    """``model`` itself when it is a target already, else the ``engine``'s target of it: of the folder or
    file the engine runs for it (`model_path`), its torch side (the embedding and head the drafters
    share, the taps) in ``dtype`` (``"auto"``: the faster of bf16 and fp32 here for the model's shapes,
    measured once, `treespec.pricing.hardware`; bf16 on CUDA; the stored one where neither applies).

    ``float32_head``: the final norm and LM head of a bf16/fp16 target in float32 (None: on).
    ``exact``: the engine's numeric path where trees equal one-token steps bit for bit (True), its plain one
    (False), or the engine's own default (None; `treespec.target.Engine.load`).
    """
    if _is_target(model):
        return model
    cls = engine_class(engine)
    if isinstance(model, torch.nn.Module):  # loaded already: its own dtype
        if cls.file_suffix is not None:
            raise ValueError(f"the {engine} engine runs a model file; pass its path, not a {type(model).__name__}")
        return cls.load(model, dtype=dtype, device=device, float32_head=float32_head, exact=exact)
    path = model_path(model, engine)
    if dtype == "auto":
        dtype = _auto_dtype(cls.read_shapes(path), device)
    return cls.load(path, dtype=dtype, device=device, float32_head=float32_head, exact=exact)


def _is_target(model: Any) -> bool:
    """Whether ``model`` is a target already (an engine's, `treespec.target.Target`)."""
    return not isinstance(model, str | os.PathLike | torch.nn.Module) and isinstance(model, Target)


def _auto_dtype(shapes, device: str | torch.device) -> torch.dtype | str:
    """``"auto"`` for a model of ``shapes`` (None: unknown): this machine's faster dtype, bf16 on CUDA, or
    ``"checkpoint"`` (the stored one) where no choice applies."""
    from treespec.pricing.hardware import resolve_dtype

    if shapes is None:
        return "checkpoint"
    resolved = resolve_dtype("auto", device=device, config=shapes)
    return "checkpoint" if resolved == "auto" else resolved


def model_path(model: Any, engine: str = DEFAULT_ENGINE) -> Path:
    """The folder or file the ``engine`` runs for ``model`` (`treespec.target.Engine.model_path`); for the
    embedded default's folder, an engine that runs one file runs the file kept beside it
    (`treespec.apps.assembly.embedded.embedded_gguf`)."""
    from treespec.apps.assembly.embedded import embedded_gguf

    cls = engine_class(engine)
    if not isinstance(model, str | os.PathLike):
        raise ValueError(f"the {engine} engine runs a model from files; pass its path, not a {type(model).__name__}")
    if cls.file_suffix == ".gguf" and _is_embedded(model):
        return embedded_gguf()
    return cls.model_path(model)


def load_tokenizer(path: PathLike) -> Any:
    """The tokenizer of a local model directory (or of a GGUF file: the one beside it, else the one it
    carries); a clear error when there is none."""
    if Path(path).is_file():
        return _file_tokenizer(Path(path))
    if not any((Path(path) / name).is_file() for name in _TOKENIZER_FILES):
        # transformers 5 would build an empty tokenizer here; refuse instead of encoding garbage
        raise ValueError(f"no tokenizer files in {path} ({', '.join(_TOKENIZER_FILES)}): add them, or give the "
                         "API tokenizer= or token ids")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


def _file_tokenizer(path: Path) -> Any:
    """The tokenizer of the folder a model file sits in, else the one the GGUF file carries."""
    from transformers import AutoTokenizer

    if any((path.parent / name).is_file() for name in _TOKENIZER_FILES):
        return load_tokenizer(path.parent)
    try:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 -- transformers' GGUF reader raises bare struct/index errors on a damaged file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"no tokenizer beside {path} and none readable in it ({first}): put the model's tokenizer "
                         f"files ({', '.join(_TOKENIZER_FILES[:2])}) in {path.parent}, or give the API token "
                         "ids") from None


def load_drafter(drafter: Drafter | PathLike | None, path: PathLike | None = None, *, model: Any = None,
                 **kwargs: Any) -> Drafter | None:
    """The one drafter loader: ``drafter`` itself (an instance, or None for AR); with ``path``, the
    registered drafter ``drafter`` loaded from that folder through its declared loader (its class's
    ``from_pretrained``); a DFlash / Domino checkpoint folder, read by its config; or a registered
    name, built with ``kwargs`` or, for a drafter that loads only from a folder, named alone: its
    checkpoint for ``model`` (`drafter_source`).  A missing folder or a drafter with no loader is
    refused by name."""
    if drafter is None or isinstance(drafter, Drafter):
        return drafter
    if path is not None:
        return _from_folder(str(drafter), Path(path))
    source = drafter_source(drafter, model, given_kwargs=bool(kwargs))
    if isinstance(source, Path):
        return registry.create("drafter", "checkpoint", path=source, **kwargs)
    return registry.create("drafter", source, **kwargs)


def drafter_source(drafter: PathLike | Drafter | None, model: Any = None, *,
                   given_kwargs: bool = False) -> Drafter | Path | str | None:
    """What `load_drafter` loads for ``drafter``, found without loading anything (so a command refuses
    a bad one before a model loads): a checkpoint folder (a `Path`), a registered name built with
    its keyword arguments (the name), or the instance itself.  A registered drafter that loads only
    from a folder (it declares ``from_pretrained``), named alone, is the checkpoint treespec ships
    for ``model`` when ``model`` is the embedded default; for any other model it is refused in one
    line asking for the folder.  A path that is no folder is refused by name."""
    if drafter is None or isinstance(drafter, Drafter):
        return drafter
    if Path(drafter).is_dir():
        return Path(drafter)
    name = str(drafter)
    if name not in registry.available("drafter"):
        if isinstance(drafter, os.PathLike) or os.sep in name or Path(drafter).exists():
            raise FileNotFoundError(f"no drafter checkpoint directory at {drafter}")
        raise ValueError(f"unknown drafter {name!r}: name a checkpoint directory or one of "
                         f"{', '.join(registry.available('drafter'))}")
    if given_kwargs or not _loads_from_folder(name):
        return name
    if name in DEFAULT_DRAFTERS.values() and _is_embedded(model):
        return embedded_drafter_dir(name)
    raise ValueError(f"the {name} drafter loads from a checkpoint directory: name its directory instead of "
                     f"{name!r} (treespec ships {name} weights for the embedded default only)")


def _loads_from_folder(name: str) -> bool:
    cls = registry.resolve("drafter", name)
    return isinstance(cls, type) and getattr(cls.from_pretrained, "__func__", None) is not \
        Drafter.from_pretrained.__func__


def _is_embedded(model: Any) -> bool:
    """Whether ``model`` names the embedded default: its converted folder or the GGUF file kept in it
    (never fetching either)."""
    from treespec.apps.assembly.embedded import SMOLLM2_135M_INSTRUCT, cache_root

    if not isinstance(model, str | os.PathLike):
        return False
    folder = (cache_root() / SMOLLM2_135M_INSTRUCT.dirname).resolve()
    path = Path(model).expanduser().resolve()
    return path == folder or path == folder / Path(SMOLLM2_135M_INSTRUCT.gguf_member).name


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
    return Path(__file__).resolve().parents[2] / "assets" / f"smollm2-135m-instruct-{kind}"


def eos_ids(tokenizer, target: Target | None = None) -> list[int]:
    """The end-of-sequence ids a generation stops at: the tokenizer's, else the target model's
    (`treespec.target.Target.eos_token_ids`), else none."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        return [eos] if isinstance(eos, int) else list(eos)
    return [] if target is None else target.eos_token_ids()


def check_sha256(model: PathLike | None, engine: str, expected: str) -> None:
    """The weights ``engine`` runs for ``model`` (None: the embedded default) have the sha256 ``expected``
    (`model_identity`'s digest: a file's own, or a folder's safetensors in name order), else a ValueError
    naming the file and both digests."""
    from treespec.apps.assembly.embedded import embedded_model_dir

    if not re.fullmatch(r"[0-9a-fA-F]{64}", expected):
        raise ValueError(f"--sha256 takes 64 hex digits, got {expected!r}")
    path = model_path(model if model is not None else embedded_model_dir(), engine)
    found = model_identity(str(path), path)["sha256"]
    if found != expected.lower():
        raise ValueError(f"{path}: sha256 {found}, expected {expected.lower()}: the weights are not the ones named "
                         "(damaged, or another file)")


def model_identity(name: str, model_dir: str | Path) -> dict[str, str]:
    """``{"name", "sha256"}`` of a model directory (see the module docstring), or of a model file (the
    file's own sha256: a GGUF file an engine runs)."""
    digest = hashlib.sha256()
    files = [Path(model_dir)] if Path(model_dir).is_file() else sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {model_dir}")
    for path in files:
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    return {"name": name, "sha256": digest.hexdigest()}


def load_frozen_model(path: Path | None, dtype_name: str, device: str = "cpu", *, tokenizer: bool = True):
    """(model, tokenizer, identity) of the causal LM at ``path`` (default: the embedded SmolLM2), in
    eval mode without gradients; ``tokenizer=False`` skips the tokenizer (None in its place) for
    callers that need only ids.  A directory that holds no model, or no usable tokenizer when one is
    asked for, raises an OSError naming it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from treespec.apps.assembly.embedded import SMOLLM2_135M_INSTRUCT, embedded_model_dir
    from treespec.pricing.hardware import resolve_dtype
    from treespec.target import check_device

    check_device(device)
    name = str(path) if path else SMOLLM2_135M_INSTRUCT.requirement
    path = path or embedded_model_dir()
    if not (Path(path) / "config.json").is_file():
        raise OSError(f"{path}: no model here (a Hugging Face directory with config.json and *.safetensors)")
    dtype = resolve_dtype(dtype_name, device=device, config=AutoConfig.from_pretrained(path, local_files_only=True))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.eval().requires_grad_(False).to(device)
    words = None
    if tokenizer:
        try:
            words = load_tokenizer(path)
        except (OSError, ValueError) as exc:
            raise OSError(f"{path}: no usable tokenizer ({str(exc).strip().splitlines()[0]})") from None
    return model, words, model_identity(name, path)
