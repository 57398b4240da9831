"""A batch of draft trees for S sequences: one target forward over all of them, each tree's rows back.

Contract
--------
`TreeBatch(trees)` holds S `DraftTree`s whose node counts N_s may differ (a sequence that only
decodes autoregressively this round has a root-only tree).  The target runs them in one forward in
a padded layout: batch row s holds tree s's N_s nodes, then N_max - N_s padding nodes that repeat
the root token.  The target's cache rows are right-padded too: sequence s has ``lengths[s]``
cached tokens in columns ``0 .. lengths[s] - 1`` of a cache ``width`` columns wide.

* ``tokens`` [S, N_max] int64.
* ``attention_mask(lengths, width, dtype)`` [S, 1, N_max, width + N_max] additive: node i of tree
  s sees the cache columns ``< lengths[s]`` and the tree columns of its ancestors and itself (0),
  nothing else (the dtype's minimum).  A padding node sees itself only, so its row stays finite and
  its keys/values, which later rounds never see, stay finite too.
* ``position_ids(lengths)`` [S, N_max]: ``lengths[s] + depth`` (a padding node: ``lengths[s]``).
* ``split(x)`` the per-tree slices ``x[s, :N_s]`` of a [S, N_max, ...] result.

``block_mask()`` is the other layout, ragged: the [ΣN, ΣN] block-diagonal ancestor mask of the
trees' nodes concatenated in one row (benchmarks/bench_batch.py measures the two side by side).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs
import torch

from treespec.tree import DraftTree, additive_mask

__all__ = ["TreeBatch"]


def _check_trees(instance, attribute, trees: tuple[DraftTree, ...]) -> None:
    if not trees:
        raise ValueError("a TreeBatch needs at least one tree")
    devices = {t.device for t in trees}
    if len(devices) > 1:
        raise ValueError(f"the trees of a batch must share one device, got {sorted(map(str, devices))}")


@attrs.frozen(eq=False)
class TreeBatch:
    """S draft trees, packed for one target forward (see the module docstring)."""

    trees: tuple[DraftTree, ...] = attrs.field(converter=tuple, validator=_check_trees)

    def __len__(self) -> int:
        return len(self.trees)

    @property
    def device(self) -> torch.device:
        return self.trees[0].device

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        """N_s, the node count of each tree (root included)."""
        return tuple(len(t) for t in self.trees)

    @property
    def width(self) -> int:
        """N_max, the padded node count of every batch row."""
        return max(self.sizes)

    @functools.cached_property
    def tokens(self) -> torch.Tensor:
        """[S, N_max] int64: each tree's tokens, padded with its root token."""
        out = torch.stack([t.tokens[:1].expand(self.width) for t in self.trees]).clone()
        for s, tree in enumerate(self.trees):
            out[s, :len(tree)] = tree.tokens
        return out

    @functools.cached_property
    def _depths(self) -> torch.Tensor:
        """[S, N_max] int64 node depths, 0 for padding."""
        out = torch.zeros(len(self), self.width, dtype=torch.int64, device=self.device)
        for s, tree in enumerate(self.trees):
            out[s, :len(tree)] = tree.depths
        return out

    @functools.cached_property
    def _tree_visible(self) -> torch.Tensor:
        """[S, N_max, N_max] bool: each tree's ancestor mask, identity on the padding."""
        out = torch.eye(self.width, dtype=torch.bool, device=self.device).repeat(len(self), 1, 1)
        for s, tree in enumerate(self.trees):
            n = len(tree)
            out[s, :n, :n] = tree.ancestor_mask
        return out

    def _lengths(self, lengths: Sequence[int]) -> torch.Tensor:
        if len(lengths) != len(self):
            raise ValueError(f"{len(lengths)} cache lengths for a batch of {len(self)} trees")
        return torch.as_tensor(list(lengths), dtype=torch.int64, device=self.device)

    def attention_mask(self, lengths: Sequence[int], width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[S, 1, N_max, width + N_max] additive mask of one padded forward (module docstring)."""
        cached = self._lengths(lengths)
        if int(cached.max()) > width:
            raise ValueError(f"a cache length {int(cached.max())} exceeds the cache width {width}")
        columns = torch.arange(width, device=self.device)
        real = torch.arange(self.width, device=self.device)[None, :] < torch.tensor(self.sizes, device=self.device)[:, None]
        sees_cache = (columns[None, None, :] < cached[:, None, None]) & real[:, :, None]  # [S, N_max, width]
        return additive_mask(torch.cat([sees_cache, self._tree_visible], dim=-1), dtype)[:, None]

    def position_ids(self, lengths: Sequence[int]) -> torch.Tensor:
        """[S, N_max] absolute positions: ``lengths[s] + depth``."""
        return self._lengths(lengths)[:, None] + self._depths

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x[s, :N_s]`` for every tree s of a [S, N_max, ...] tensor."""
        if x.shape[:2] != (len(self), self.width):
            raise ValueError(f"expected a [{len(self)}, {self.width}, ...] tensor, got {tuple(x.shape)}")
        return [x[s, :n] for s, n in enumerate(self.sizes)]

    def block_mask(self) -> torch.Tensor:
        """[ΣN, ΣN] bool block-diagonal ancestor mask of the trees' nodes concatenated (ragged layout)."""
        return torch.block_diag(*(t.ancestor_mask.to(torch.uint8) for t in self.trees)).bool()
