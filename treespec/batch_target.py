"""The target over S sequences at once: one KV cache with a row per sequence, ragged lengths, one forward.

Contract
--------
`BatchTarget(target)` drives the model of a `TargetModel` (same weights, its own cache) for S
sequences whose committed lengths differ.  The cache is right-padded: row s holds sequence s's
``lengths[s]`` cached tokens in columns ``0 .. lengths[s] - 1``; columns past that are garbage that
every mask hides (benchmarks/bench_batch.py measures this layout against a ragged one).

* ``prefill(prompts, taps)`` starts S sequences: it runs ``prompt[:-1]`` of each (the last prompt
  token is the first round's root, as in `TargetModel`) in one padded forward and returns each
  sequence's taps of those positions.
* ``forward_trees(batch, taps)`` runs a `TreeBatch` on top of the cache (the mask and positions of
  `TreeBatch.attention_mask` / ``position_ids``) and returns one `TargetOutput` per tree.
* ``commit(accepted)`` keeps, for every sequence, the K/V rows of its accepted nodes (root first),
  moved to right after its own prefix; the cache is then cropped to the longest sequence.
* ``keep(rows)`` keeps only the sequences ``rows`` (in that order): finished ones leave the batch.

Every sequence's rows equal what `TargetModel` computes for it alone, up to the rounding of a
batched matmul; the decoder's outputs, which only take the target's own choices, stay each
sequence's own (tests/test_batch.py checks it token for token in float64).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from treespec.batch import TreeBatch
from treespec.target import TargetModel, TargetOutput, crop_cache, tap_features
from treespec.tree import additive_mask

__all__ = ["BatchTarget"]


class BatchTarget:
    """S sequences over one target model (see the module docstring)."""

    def __init__(self, target: TargetModel) -> None:
        self.target = target
        self.cache = None
        self.lengths: list[int] = []
        self._tree_start = 0  # cache width before the last tree forward: where its nodes' rows begin
        self._tree_sizes: tuple[int, ...] = ()  # node counts of the last tree forward

    @property
    def device(self) -> torch.device:
        return self.target.device

    def __len__(self) -> int:
        return len(self.lengths)

    def width(self) -> int:
        """Columns of the cache (>= every length)."""
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    # ------------------------------------------------------------------ forwards
    @torch.inference_mode()
    def prefill(self, prompts: Sequence[torch.Tensor], taps: tuple[int, ...] = ()) -> list[torch.Tensor | None]:
        """Start ``prompts`` ([P_s] each); returns each one's taps [P_s - 1, F] (None without taps)."""
        if not prompts:
            raise ValueError("a batch needs at least one prompt")
        heads = [torch.as_tensor(p, dtype=torch.int64).reshape(-1)[:-1].to(self.device) for p in prompts]
        self.target._check_taps(taps)
        for head in heads:
            self.target._check_room(max(head.numel() - 1, 0))
        self.cache, self.lengths = self.target._new_cache(), [h.numel() for h in heads]
        width = max(self.lengths)
        if width == 0:  # one-token prompts only: nothing to cache yet
            empty = torch.empty(0, len(taps) * self.target.hidden_size, dtype=self.target.dtype, device=self.device)
            return [empty if taps else None for _ in heads]
        ids = torch.zeros(len(heads), width, dtype=torch.int64, device=self.device)
        for s, head in enumerate(heads):
            ids[s, :head.numel()] = head
        out = self.target._call(ids, self._prefill_mask(width), torch.arange(width, device=self.device).expand(len(heads), -1),
                                taps, logits_to_keep=1, cache=self.cache)
        features = tap_features(out, taps)
        return [None if features is None else features[s, :n] for s, n in enumerate(self.lengths)]

    def _prefill_mask(self, width: int) -> torch.Tensor:
        """[S, 1, W, W] additive: causal within each prompt; a padding position sees itself only."""
        index = torch.arange(width, device=self.device)
        lengths = torch.tensor(self.lengths, device=self.device)[:, None, None]
        causal = (index[None, :, None] >= index[None, None, :]) & (index[None, None, :] < lengths)  # [S, W, W]
        visible = causal | torch.eye(width, dtype=torch.bool, device=self.device)[None]
        return additive_mask(visible, self.target.dtype)[:, None]

    @torch.inference_mode()
    def forward_trees(self, batch: TreeBatch, taps: tuple[int, ...] = ()) -> list[TargetOutput]:
        """One forward over every node of every tree: per tree, logits [N_s, V] and features [N_s, F]."""
        if self.cache is None:
            raise RuntimeError("forward_trees before prefill: start the sequences first")
        if len(batch) != len(self):
            raise ValueError(f"{len(batch)} trees for {len(self)} sequences")
        self.target._check_taps(taps)
        for length, tree in zip(self.lengths, batch.trees, strict=True):
            self.target._check_room(length + tree.max_depth)
        top = max(int(t.tokens.max()) for t in batch.trees)
        if top >= self.target.vocab_size:
            raise ValueError(f"tree token {top} is outside the target's vocabulary of {self.target.vocab_size}")
        self._tree_start, self._tree_sizes = self.width(), batch.sizes
        mask = batch.attention_mask(self.lengths, self.width(), self.target.dtype)
        out = self.target._call(batch.tokens.to(self.device), mask.to(self.device),
                                batch.position_ids(self.lengths).to(self.device), taps, cache=self.cache)
        features = tap_features(out, taps)
        logits = batch.split(out.logits)
        feats = [None] * len(batch) if features is None else batch.split(features)
        return [TargetOutput(lg, ft) for lg, ft in zip(logits, feats, strict=True)]

    @torch.inference_mode()
    def commit(self, accepted: Sequence[torch.Tensor]) -> None:
        """Keep each sequence's accepted nodes' K/V rows (node indices, root first) after its prefix."""
        if len(accepted) != len(self._tree_sizes):
            raise ValueError(f"{len(accepted)} accepted paths for the {len(self._tree_sizes)} trees of the last forward")
        start = self._tree_start
        rows, sources, targets = [], [], []
        for s, nodes in enumerate(accepted):
            nodes = nodes.to(self.device)
            if nodes.numel() == 0 or int(nodes[0]) != 0:
                raise ValueError(f"sequence {s}: accepted node indices must start with the root (node 0)")
            if int(nodes.max()) >= self._tree_sizes[s]:
                raise ValueError(f"sequence {s}: accepted node {int(nodes.max())} was not in its tree "
                                 f"({self._tree_sizes[s]} nodes)")
            rows.append(torch.full_like(nodes, s))
            sources.append(start + nodes)
            targets.append(self.lengths[s] + torch.arange(nodes.numel(), device=self.device))
        rows_t, sources_t, targets_t = torch.cat(rows), torch.cat(sources), torch.cat(targets)
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name)  # [S, H, width, D]
                tensor[rows_t, :, targets_t] = tensor[rows_t, :, sources_t]  # the right side is gathered first
        self.lengths = [n + a.numel() for n, a in zip(self.lengths, accepted, strict=True)]
        self._tree_sizes = ()
        crop_cache(self.cache, max(self.lengths))

    @torch.inference_mode()
    def keep(self, rows: Sequence[int]) -> None:
        """Only the sequences ``rows`` stay, in that order (finished sequences leave the batch)."""
        index = torch.as_tensor(list(rows), dtype=torch.int64, device=self.device)
        self.lengths = [self.lengths[r] for r in rows]
        if not self.lengths:
            self.cache = None
            return
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        crop_cache(self.cache, max(self.lengths))
