"""Local model directories for training tools: a frozen target and its identity.

Contract
--------
``model_identity(name, model_dir)`` is ``{"name", "sha256"}``: the sha256 over the directory's
``*.safetensors`` weight files in name order, which is what distillation data and teacher caches
record so that data made with one target is never used with another.  ``load_frozen_model(path,
dtype_name)`` loads a local transformers causal LM (default: the embedded SmolLM2) in eval mode
without gradients, with the dtype chosen as `treespec.pricing.hardware.resolve_dtype` chooses it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["eos_ids", "load_frozen_model", "model_identity"]


def eos_ids(tokenizer, config=None) -> list[int]:
    """The end-of-sequence ids a generation stops at: the tokenizer's, else the model config's (one
    id or several), else none."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def model_identity(name: str, model_dir: str | Path) -> dict[str, str]:
    """``{"name", "sha256"}`` of a model directory (see the module docstring)."""
    digest = hashlib.sha256()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {model_dir}")
    for path in files:
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    return {"name": name, "sha256": digest.hexdigest()}


def load_frozen_model(path: Path | None, dtype_name: str, device: str = "cpu", *, tokenizer: bool = True):
    """(model, tokenizer, identity) of the causal LM at ``path`` (default: the embedded SmolLM2);
    ``tokenizer=False`` skips the tokenizer (None in its place) for callers that need only ids.
    A directory that holds no model, or no usable tokenizer when one is asked for, raises an
    OSError naming it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from treespec.apps.embedded import SMOLLM2_135M_INSTRUCT, embedded_model_dir
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
            words = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise OSError(f"{path}: no usable tokenizer ({str(exc).strip().splitlines()[0]})") from None
    return model, words, model_identity(name, path)
