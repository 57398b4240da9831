"""What a target is, whatever engine runs it: the protocol the decoding loop, the cost profile and the
drafters call, the protocol an engine registers, and what they exchange.

Contract
--------
A `Target` owns one sequence's cache.  ``length`` is the number of committed tokens it holds; the
decoder keeps exactly one committed token, the tree's root, outside the cache.

* ``prefill(input_ids, taps)`` starts a new sequence: it runs the tokens and caches them.
* ``forward_tree(tree, taps)`` runs every node of a `DraftTree` in one forward on top of the cache
  (each node sees the cached prefix, its ancestors and itself, at position ``length + depth``).
  Row i of the logits is the target's next-token distribution after node i's root-to-node path; an
  AR step is the forward of a root-only tree.
* ``commit(accepted)`` keeps the accepted nodes (root first, a root-to-node path) right after the
  prefix and drops the rest of the tree, so the cache again holds the committed tokens in position
  order; ``drop_tree()`` drops the whole tree; ``truncate(n)`` keeps the first n committed tokens.
* ``numerics(tokens)`` says how a tree of that many tokens compares with one-token steps here
  (`Numerics`: equal bit for bit, or within a measured tolerance of AR's top-two gap).

Hidden-state taps: tap t is the model's hidden state after t decoder layers (0 = the embedding
output, the last one after the final norm); the taps are concatenated on the last dim, giving
features of shape ``[n, len(taps) * hidden_size]``.

Each engine is a registry entry of kind ``"engine"`` whose class implements `Engine` (how the apps
find, describe and load its target) and whose targets implement `Target`; an engine that decodes
several sequences in one forward names the class of that batch (`Engine.batch_class`, a
`TargetBatch`).  The torch engine is ``treespec/engines/torch.py``, llama.cpp
``treespec/engines/llama_cpp.py``; the drafters and the dtype probe read a target's `ModelShapes`,
never an engine's own config.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from treespec.tree import DraftTree

__all__ = ["DTYPE_NAMES", "ContextOverflowError", "Engine", "EngineUnavailable", "ModelShapes", "NonFiniteLogits",
           "Numerics", "Target", "TargetBatch", "TargetOutput", "batch_class", "check_device", "check_finite",
           "reduced_precision",
           "select_taps", "spread_layers", "stored_dtype"]

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float64": torch.float64}


def reduced_precision(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a 16-bit float (bf16 or fp16): where the kernels' float32 paths apply."""
    return dtype in (torch.bfloat16, torch.float16)


def stored_dtype(config) -> torch.dtype | None:
    """The dtype a Hugging Face config says its weights are stored in (None: it names none)."""
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        return DTYPE_NAMES.get(stored)
    return stored if isinstance(stored, torch.dtype) else None


class ContextOverflowError(ValueError):
    """The sequence would not fit in the target's context window."""


class EngineUnavailable(RuntimeError):
    """A target engine that cannot run here: its binding is not installed or does not load (the message
    says which, and how to install it)."""


@attrs.frozen(eq=False)
class TargetOutput:
    """Logits and tap features of one target forward."""

    logits: torch.Tensor  # [n, V] next-token logits (prefill: the last position only, n = 1)
    features: torch.Tensor | None  # [n, len(taps) * H] tap features, None when no taps were asked for


@attrs.frozen
class ModelShapes:
    """A target model's shapes, under the names a transformers config gives them: what its forward
    costs depend on (the dtype probe times its matmuls, `treespec.pricing.hardware.linear_shapes`)."""

    hidden_size: int  # H
    intermediate_size: int  # the MLP's width
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads
    num_hidden_layers: int  # decoder layers
    vocab_size: int  # the logits' width
    head_dim: int | None = None  # per head (None: hidden_size // num_attention_heads)
    dtype: torch.dtype | None = None  # what its weights are stored in, where that is a torch dtype (None: not)

    @classmethod
    def of_config(cls, config: Any) -> ModelShapes:
        """The shapes a transformers config states (an MLP of 4 H and as many KV heads as heads by default)."""
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        return cls(hidden, int(getattr(config, "intermediate_size", None) or 4 * hidden), heads,
                   int(getattr(config, "num_key_value_heads", None) or heads), int(config.num_hidden_layers),
                   int(config.vocab_size), getattr(config, "head_dim", None), stored_dtype(config))


@attrs.frozen
class Numerics:
    """How a tree forward's logits compare with the same tokens run as one-token steps on a target."""

    exact: bool  # equal bit for bit (its rows and the cache it commits): T = 0 output is AR's token for token
    tolerance: float  # else: the largest top-two gap of AR's logits a tree may flip (logit units; 0.0 when exact)
    how: str  # one line: what establishes it, or why it does not hold here

    def __attrs_post_init__(self) -> None:
        if self.exact and self.tolerance != 0.0:
            raise ValueError("exact numerics have no tolerance")
        if not self.tolerance >= 0.0:
            raise ValueError(f"a tolerance is a gap >= 0, got {self.tolerance}")


@runtime_checkable
class Target(Protocol):
    """What the decoding loop, the cost profile and the drafters call on a target (module docstring)."""

    engine: str  # the registry name (kind "engine") of what runs it
    length: int  # committed tokens in its cache
    vocab_size: int  # the logits' width
    hidden_size: int  # the width of every tap
    num_hidden_layers: int  # taps run from 0 (the embedding) to this (after the final norm)
    max_positions: int  # its context window
    embed_tokens: torch.nn.Module  # the input embedding, in torch (the drafters share it)
    lm_head: torch.nn.Module  # the LM head, in torch (the drafters share it)

    @property
    def dtype(self) -> torch.dtype: ...  # the torch side's dtype (embedding, head, taps)

    @property
    def device(self) -> torch.device: ...

    def prefill(self, input_ids: torch.Tensor, taps: tuple[int, ...] = ()) -> TargetOutput: ...

    def forward_tree(self, tree: DraftTree, taps: tuple[int, ...] = ()) -> TargetOutput: ...

    def commit(self, accepted: torch.Tensor) -> None: ...

    def drop_tree(self) -> None: ...

    def truncate(self, length: int) -> None: ...  # keep the first ``length`` committed tokens (a rollback)

    def reset(self) -> None: ...

    def cache_length(self) -> int: ...

    def sibling(self) -> Target: ...  # a target over the same weights with a cache of its own

    def check_taps(self, taps: tuple[int, ...]) -> None: ...  # a ValueError naming taps it cannot give

    def check_room(self, last_position: int) -> None: ...  # `ContextOverflowError` past its window

    def shapes(self) -> ModelShapes: ...

    def identity(self) -> dict: ...  # what its cost profile is keyed by: the model's architecture, the file it runs

    def describe(self) -> str: ...  # what runs, in a few words ("bfloat16, cpu"; a GGUF file and its quantization)

    def eos_token_ids(self) -> list[int]: ...  # the end-of-sequence ids its model states (a tokenizer's come first)

    def numerics(self, tokens: int = 17) -> Numerics: ...  # trees of ``tokens`` tokens against one-token steps


class TargetBatch(Protocol):
    """Several sequences decoded together on one target, one forward per round (`Engine.batch_class`)."""

    lengths: list[int]  # committed tokens of each sequence

    def prefill(self, prompts: Sequence[torch.Tensor], taps: tuple[int, ...] = ()) -> list[torch.Tensor | None]:
        ...  # start the sequences (each prompt's last token is its first root); each one's taps

    def forward_trees(self, trees: Sequence[DraftTree], taps: tuple[int, ...] = ()) -> list[TargetOutput]: ...

    def commit(self, accepted: Sequence[torch.Tensor]) -> None: ...

    def keep(self, rows: Sequence[int]) -> None: ...  # only these sequences stay, in this order


class Engine(Protocol):
    """The class an engine registers (kind "engine"): how the apps find, describe and load its target."""

    file_suffix: str | None  # the suffix of the one file it runs (".gguf"); None: it loads a model folder
    # how it decodes several sequences at once: the class of its batch, made from one of its targets
    # (``batch_class(target)``); None: one sequence at a time
    batch_class: type[TargetBatch] | None

    @classmethod
    def model_path(cls, model: str | os.PathLike) -> Path: ...  # the folder or file it runs for ``model``

    @classmethod
    def read_shapes(cls, path: Path) -> ModelShapes | None: ...  # from metadata only (None: unknown)

    @classmethod
    def load(cls, path: Path, *, dtype: torch.dtype | str, device: str | torch.device,
             float32_head: bool | None = None, exact: bool | None = None) -> Target: ...
    # ``exact``: True, the engine's numeric path where a tree's rows equal one-token steps bit for bit
    # (`Target.numerics` measures it); False, its plain path; None, the engine's default

    @staticmethod
    def installed() -> bool: ...  # whether it can run here

    @staticmethod
    def install_recipe() -> tuple[str, dict[str, str]] | None: ...  # (pip requirement, build env); None: nothing


def batch_class(target: Target) -> type[TargetBatch]:
    """The class of a batch of sequences on ``target``'s engine (`Engine.batch_class`; ``batch_class(t)(t)``
    makes one); a ValueError naming the engine when it decodes one sequence at a time."""
    factory = type(target).batch_class
    if factory is None:
        raise ValueError(f"the {target.engine} engine decodes one sequence at a time: decode the prompts one by one, "
                         "or batch them on an engine that batches")
    return factory


class NonFiniteLogits(ValueError):
    """The target's logits after a prompt hold NaN or infinities: its weights do."""


def check_finite(logits: torch.Tensor, model: str) -> None:
    """`NonFiniteLogits` naming ``model`` when a prefill's logits [1, V] are not all finite (a model whose
    weights hold NaN or overflow: nothing it decodes would mean anything)."""
    if logits.numel() and not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogits(f"{model}: the model's logits after the prompt are not finite (NaN or infinite): "
                              "its weights hold NaN or infinities")


def check_device(device: str | torch.device) -> None:
    """A clear error for a device this torch build or machine does not have."""
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r} (cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} asked for, but this torch build sees no CUDA device "
                         f"(torch {torch.__version__}); use --device cpu")


def spread_layers(num_target_layers: int, taps: int = 4) -> tuple[int, ...]:
    """Evenly spread tap layers from layer 1 to the second-to-last (like the released drafters)."""
    last = num_target_layers - 2
    return tuple(sorted({round(1 + i * (last - 1) / (taps - 1)) for i in range(taps)}))


def select_taps(features: torch.Tensor, have: Sequence[int], want: Sequence[int]) -> torch.Tensor:
    """[n, len(want) * H]: the taps ``want`` (a subset of ``have``, any order) of ``features``
    [n, len(have) * H], whose columns hold the hidden states of layers ``have`` side by side."""
    have, want = tuple(have), tuple(want)
    if want == have:
        return features
    missing = sorted(set(want) - set(have))
    if missing:
        raise ValueError(f"taps {missing} are not among the features' taps {list(have)}")
    width = features.shape[1] // len(have)
    return torch.cat([features[:, have.index(t) * width:(have.index(t) + 1) * width] for t in want], dim=1)
