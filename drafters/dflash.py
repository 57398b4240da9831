"""The DFlash block drafter: one forward of a small bidirectional block model per round.

Contract
--------
``DFlashDrafter(config)`` builds a model with fresh weights; ``DFlashDrafter(path=dir)`` or
``DFlashDrafter.from_pretrained(dir)`` loads a released z-lab checkpoint (config.json +
safetensors, strict key matching) and `save_pretrained` writes the same layout.

``bind(target)`` must precede ``draft``.  It reads only ``embed_tokens``, ``lm_head``,
``hidden_size``, ``vocab_size``, ``num_hidden_layers``, ``dtype`` and ``device`` of the target
(the embedding table and head are used, never copied) and raises a clear error when the
checkpoint does not fit the target.  ``tap_layers`` = ``target_layer_ids + 1`` (indices into
Hugging Face's ``hidden_states``).

Each ``draft(ctx)``:

1. appends the context keys/values of the newly committed positions ``ctx.feature_start ..``
   (``ctx.features`` rows) to the drafter's own cache; afterwards the cache must cover exactly
   positions ``0 .. P-1`` where P is the anchor's position;
2. runs the block ``[anchor, mask x (B-1)]`` at positions ``P .. P+B-1`` (its keys/values are
   never cached);
3. returns ``DraftOutput(logprobs [L, V] float32, root_token=anchor, position=P)`` where row
   d-1 = log_softmax(lm_head(z)) at the block position predicting depth d: L = B-1 and rows from
   block position 1 (``shift_label = false``), or L = B from position 0 (``shift_label = true``).

A reduced draft vocabulary (``config.draft_vocab_size`` = N, the ``d2t`` buffer) computes only the
head rows of those N target tokens (gathered once at bind) and gives every other token log-prob
−inf: the policies never draft it, and verification, hence the output, is unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from treespec.drafters._checkpoint import check_state, load_weights, save_weights
from treespec.drafters._layers import ContextCache, DFlashModel
from treespec.drafters.config import ConfigError, DFlashConfig, read_config
from treespec.interfaces import ConditionalScorer, DraftContext, Drafter, DraftOutput

if TYPE_CHECKING:
    from treespec.target import Target

__all__ = ["DFlashDrafter", "DrafterMismatchError"]


class DrafterMismatchError(ValueError):
    """The drafter does not fit the target it is bound to, or the context it is given."""


class DFlashDrafter(Drafter):
    """DFlash: block diffusion drafting from the target's hidden-state taps (see module docstring)."""

    kind: ClassVar[str] = "DFlash"  # name used in error messages

    def __init__(self, config: DFlashConfig | None = None, *, path: str | Path | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        if (config is None) == (path is None):
            raise ValueError(f"{type(self).__name__} takes exactly one of config= or path=")
        config = read_config(path) if path is not None else config
        self._check_kind(config)
        self.config = config
        if path is None:
            self.model = self._build_model(config)
        else:  # built without storage, then the checkpoint's own tensors are assigned (stored dtype, bits)
            with torch.device("meta"):
                self.model = self._build_model(config)
            self._load_state(load_weights(path), source=str(path))
        self.model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self._dtype = dtype  # explicit compute dtype; None: the target's, set at bind
        self.tap_layers = config.tap_layers
        self.cache = ContextCache(config.num_hidden_layers)
        self._target: Any = None
        self._head_rows: torch.Tensor | None = None  # [N, H] head rows of a reduced vocabulary
        self._head_ids: torch.Tensor | None = None  # [N] their target ids

    # ------------------------------------------------------------------ construction and I/O
    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> DFlashDrafter:
        """Load ``path/config.json`` and its safetensors weights (strict key matching)."""
        return cls(path=path, **kwargs)

    @classmethod
    def random(cls, config: DFlashConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
               **kwargs: Any) -> DFlashDrafter:
        """Random weights for tests and benchmarks: N(0, 1/fan_in) matrices, norms near one."""
        drafter = cls(config, dtype=dtype, **kwargs)
        generator = torch.Generator().manual_seed(seed)
        for name, param in drafter.model.named_parameters():
            param.copy_(_random_like(name, param, generator))
        return drafter

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` in the released layout."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.config.save(directory)
        save_weights(directory, self.model.state_dict())
        return directory

    def _build_model(self, config: DFlashConfig) -> nn.Module:
        return DFlashModel(config)

    def _check_kind(self, config: DFlashConfig) -> None:
        if config.is_domino:
            raise ConfigError(
                f"this is a Domino checkpoint (dflash_config.projector_type = {config.domino.projector_type!r}); "
                "load it with DominoDrafter (registry name 'domino'), not DFlashDrafter")

    def _load_state(self, state: dict[str, torch.Tensor], *, source: str) -> None:
        check_state(self.model.state_dict(), state, source=source)
        self.model.load_state_dict(state, strict=True, assign=True)

    # ------------------------------------------------------------------ Drafter hooks
    @property
    def reach(self) -> int:
        """B - 1: a block of B positions is the anchor and B - 1 drafted tokens."""
        return self.config.block_size - 1

    def bind(self, target: Target) -> None:
        _check_target(self.config, target, self.kind)
        self._target = target
        self.model.to(device=target.device, dtype=self._dtype or target.dtype)
        self._head_ids = self.draft_token_ids
        self._head_rows = (None if self._head_ids is None
                           else target.lm_head.weight.detach().index_select(0, self._head_ids))
        self.reset()

    # ------------------------------------------------------------------ reduced vocabulary
    @property
    def draft_token_ids(self) -> torch.Tensor | None:
        """[N] target ids the head covers (draft id order), or None for the full vocabulary."""
        if self.config.draft_vocab_size is None:
            return None
        d2t = self.model.d2t
        return torch.arange(d2t.numel(), device=d2t.device) + d2t

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Make the head cover ``token_ids`` [N] (distinct target ids), stored in ``d2t``."""
        n = self.config.draft_vocab_size
        ids = torch.as_tensor(token_ids, dtype=torch.int64)
        if n is None or ids.shape != (n,):
            raise ValueError(f"the draft vocabulary needs exactly draft_vocab_size = {n} token ids, got "
                             f"{tuple(ids.shape)}")
        if ids.unique().numel() != n or int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary ids must be distinct and in 0..{self.config.vocab_size - 1}")
        self.model.d2t.copy_(ids.to(self.model.d2t.device) - torch.arange(n, device=self.model.d2t.device))

    def reset(self) -> None:
        self.cache.reset()

    def fork(self) -> DFlashDrafter:
        """The same weights and binding, with a context cache of its own."""
        clone = copy.copy(self)
        clone.cache = ContextCache(self.config.num_hidden_layers)
        return clone

    @torch.no_grad()
    def draft_batch(self, forks: Sequence[DFlashDrafter], contexts: Sequence[DraftContext]) -> list[DraftOutput]:
        """Every fork's draft from one block forward over the batch and one head matmul.

        Each fork extends its own context cache; the contexts, whose lengths differ, are padded
        and masked (a block position sees its own sequence's context and block only)."""
        if self._target is None:
            raise RuntimeError(f"{type(self).__name__}.bind(target) must be called before draft_batch()")
        positions = [fork._extend_context(ctx) for fork, ctx in zip(forks, contexts, strict=True)]
        anchors = [ctx.anchor for ctx in contexts]
        z = self._batch_block_states(forks, anchors, positions)  # [S, B, H]
        rows = z[:, self.config.first_drafted_position:]  # [S, L, H]
        logits = self._head_logits(rows.flatten(0, 1)).unflatten(0, rows.shape[:2])  # [S, L, V] float32
        return [self._output(a, p, r, lg) for a, p, r, lg in zip(anchors, positions, rows, logits, strict=True)]

    def _batch_block_states(self, forks: Sequence[DFlashDrafter], anchors: Sequence[int],
                            positions: Sequence[int]) -> torch.Tensor:
        """Normed hidden states [S, B, H] of every fork's block, its context padded to the longest."""
        size, n = self.config.block_size, len(forks)
        block = self._blocks(anchors)  # [S, B, H]
        starts = torch.tensor(list(positions), device=self.device)
        block_positions = starts[:, None] + torch.arange(size, device=self.device)  # [S, B]
        contexts = [fork._context() for fork in forks]  # per fork, per layer: keys/values [n_kv, T_s, d]
        width = max(c[0][0].shape[-2] for c in contexts)
        padded = [tuple(_pad_stack([c[layer][part] for c in contexts], width) for part in (0, 1))
                  for layer in range(len(contexts[0]))]
        seen = torch.arange(width, device=self.device)[None, :] < starts[:, None]  # [S, T] context that exists
        mask = torch.cat([seen, seen.new_ones(n, size)], dim=1)[:, None, None, :]  # [S, 1, 1, T + B]
        return self.model(block, block_positions, padded, mask)

    @torch.no_grad()
    def draft(self, ctx: DraftContext) -> DraftOutput:
        if self._target is None:
            raise RuntimeError(f"{type(self).__name__}.bind(target) must be called before draft()")
        position = self._extend_context(ctx)
        z = self._block_states(ctx.anchor, position)  # [B, H]
        rows = z[self.config.first_drafted_position:]  # [L, H]
        return self._output(ctx.anchor, position, rows, self._head_logits(rows))

    def _output(self, anchor: int, position: int, rows: torch.Tensor, logits: torch.Tensor) -> DraftOutput:
        """The draft of drafted rows ``rows`` [L, H] and their float32 head logits [L, V]."""
        return DraftOutput(logprobs=torch.log_softmax(logits, dim=-1), root_token=anchor, position=position,
                           scorer=self._scorer(anchor, rows, logits))

    def _scorer(self, anchor: int, rows: torch.Tensor, logits: torch.Tensor) -> ConditionalScorer | None:
        return None

    # ------------------------------------------------------------------ one round
    @property
    def dtype(self) -> torch.dtype:
        return self.model.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    def _extend_context(self, ctx: DraftContext) -> int:
        """Append the new positions' context keys/values; returns the anchor's position P."""
        position = ctx.position
        if ctx.features is not None and ctx.features.shape[0] > 0:
            self._append_features(ctx.features, ctx.feature_start)
        if self.cache.length != position:
            raise DrafterMismatchError(
                f"the drafter's context covers positions 0..{self.cache.length - 1} but the anchor sits at "
                f"position {position}; features must cover every committed token before the anchor")
        return position

    def _append_features(self, features: torch.Tensor, start: int) -> None:
        width = len(self.tap_layers) * self.config.hidden_size
        if features.dim() != 2 or features.shape[1] != width:
            raise DrafterMismatchError(f"features must be [n, {width}] ({len(self.tap_layers)} taps x hidden "
                                       f"{self.config.hidden_size}), got {tuple(features.shape)}")
        if not 0 <= start <= self.cache.length:
            raise DrafterMismatchError(f"features start at position {start} but the drafter's context ends at "
                                       f"{self.cache.length}; positions in between would be missing")
        self.cache.truncate(start)  # a restart from an earlier position overwrites what follows
        positions = torch.arange(start, start + features.shape[0], device=self.device)
        self.cache.append(self.model.context_kv(features.to(self.device, self.dtype), positions))

    def _block_states(self, anchor: int, position: int) -> torch.Tensor:
        """Normed hidden states [B, H] of the block [anchor, mask, ...] at positions P..P+B-1."""
        positions = torch.arange(position, position + self.config.block_size, device=self.device)
        return self.model(self._blocks([anchor])[0], positions, self._context())

    def _blocks(self, anchors: Sequence[int]) -> torch.Tensor:
        """[S, B, H] embeddings of the blocks [anchor, mask, ..., mask], one per anchor."""
        ids = torch.full((len(anchors), self.config.block_size), self.config.mask_token_id, dtype=torch.int64,
                         device=self.device)
        ids[:, 0] = torch.tensor(list(anchors), device=self.device)
        return self._target.embed_tokens(ids).to(self.dtype)

    def _context(self) -> list:
        """Per-layer context keys/values; empty ones when nothing precedes the anchor (a one-token prompt)."""
        if self.cache.length:
            return self.cache.layers()
        empty = torch.empty(0, len(self.tap_layers) * self.config.hidden_size, dtype=self.dtype, device=self.device)
        return self.model.context_kv(empty, torch.empty(0, dtype=torch.int64, device=self.device))

    def _head_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """The target's LM head on ``rows`` [L, H], as float32 logits [L, V] (−inf outside a reduced vocabulary)."""
        head = self._target.lm_head
        if self._head_rows is None:
            head_dtype = next(head.parameters(), rows).dtype
            return head(rows.to(head_dtype)).float()
        reduced = (rows.to(self._head_rows.dtype) @ self._head_rows.T).float()  # [L, N]
        logits = reduced.new_full((rows.shape[0], self.config.vocab_size), float("-inf"))  # [L, V]
        return logits.index_copy_(1, self._head_ids, reduced)


def _pad_stack(parts: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """[S, ..., width, d]: per-sequence [..., T_s, d] tensors, zero-padded along T."""
    out = parts[0].new_zeros((len(parts), *parts[0].shape[:-2], width, parts[0].shape[-1]))
    for s, part in enumerate(parts):
        out[s, ..., :part.shape[-2], :] = part
    return out


def _random_like(name: str, param: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
    if param.dim() == 1:  # RMSNorm gains (and biases): near one / near zero
        base = 1.0 if name.endswith("norm.weight") else 0.0
        return (base + 0.1 * noise).to(param.dtype)
    return (noise / param.shape[-1] ** 0.5).to(param.dtype)


def _check_target(config: DFlashConfig, target: Any, kind: str) -> None:
    """Raise `DrafterMismatchError` naming the first way the checkpoint does not fit the target."""
    if config.hidden_size != target.hidden_size:
        raise DrafterMismatchError(f"{kind} drafter hidden size {config.hidden_size} does not match the "
                                   f"target's hidden size {target.hidden_size}")
    if config.mask_token_id >= target.vocab_size:
        raise DrafterMismatchError(f"mask token {config.mask_token_id} is outside the target's vocabulary "
                                   f"({target.vocab_size} tokens)")
    if config.vocab_size != target.vocab_size:
        raise DrafterMismatchError(f"{kind} drafter vocabulary {config.vocab_size} does not match the "
                                   f"target's vocabulary {target.vocab_size}")
    beyond = [i for i in config.target_layer_ids if i >= target.num_hidden_layers]
    if beyond:
        raise DrafterMismatchError(f"target_layer_ids {beyond} are beyond the target's {target.num_hidden_layers} "
                                   f"layers (valid: 0..{target.num_hidden_layers - 1})")
    if config.num_target_layers != target.num_hidden_layers:
        raise DrafterMismatchError(f"{kind} drafter was trained on a {config.num_target_layers}-layer target, "
                                   f"the target has {target.num_hidden_layers} layers")
