"""A static tree: the same shape every round, given as EAGLE / Medusa rank-path ``choices``.

Contract
--------
``Static(choices="eagle1", budget=None)``.  A choice is a rank path (r_1, ..., r_d): the node at
depth d whose token is the rank-r_d candidate of marginal row d - 1 (ranks by log-prob descending,
ties by token id), under the node (r_1, ..., r_{d-1}); every path's parent comes earlier in the
list.  ``budget`` keeps the first ``budget`` choices as listed (the published lists are ordered by
importance), None keeps them all.  Choices deeper than the draft or ranking past its vocabulary
are left out with their descendants.  A node's score is ``float32(score(parent) + logp)``; nodes
come in the canonical order (`treespec.tree`: score descending, ties by rank path), so the shape
is the choices' and the order is every policy's.

Named presets (the lists are published facts, cited by where they were read):

* ``"medusa"``: Medusa's default tree ``mc_sim_7b_63`` (63 nodes, depth 4, ranks < 10), from the
  Medusa repository (FasterDecoding/Medusa), ``medusa/model/medusa_choices.py``.
* ``"eagle1"``: EAGLE-1's default tree (25 nodes, depth 5, ranks < 4), named ``mc_sim_7b_63`` in
  the EAGLE repository (SafeAILab/EAGLE), ``eagle/model/choices.py``.

Both backends (networkx: Python floats in float32; torch: one gather per depth and one sort)
return the same tree bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import attrs
import networkx as nx
import numpy as np
import torch

from treespec.interfaces import DraftOutput, TreePolicy, backend_field
from treespec.policies.engine.best_first import check_logprobs
from treespec.topk import exact_topk, order_key, reference_topk
from treespec.tree import DraftTree, check_budget

__all__ = ["STATIC_PRESETS", "Static"]

Path = tuple[int, ...]

STATIC_PRESETS: dict[str, tuple[Path, ...]] = {
    "medusa": (
        (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
        (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,),
        (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0),
        (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0),
        (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1),
        (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0)),
    "eagle1": (
        (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (0, 0, 0),
        (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1),
        (0, 0, 0, 2), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1)),
}


def _choices(value: str | Sequence[Sequence[int]]) -> tuple[Path, ...]:
    """A preset name or rank paths -> checked rank paths (each parent earlier, no repeats)."""
    if isinstance(value, str):
        if value not in STATIC_PRESETS:
            raise ValueError(f"unknown static tree preset {value!r}; available: {', '.join(STATIC_PRESETS)}")
        return STATIC_PRESETS[value]
    paths = tuple(tuple(int(r) for r in c) for c in value)
    seen: set[Path] = {()}
    for p in paths:
        if not p or min(p) < 0:
            raise ValueError(f"choice {list(p)}: a choice is a non-empty path of ranks >= 0")
        if p in seen:
            raise ValueError(f"choice {list(p)} appears twice")
        if p[:-1] not in seen:
            raise ValueError(f"choice {list(p)} comes before its parent {list(p[:-1])}")
        seen.add(p)
    if not paths:
        raise ValueError("a static tree needs at least one choice")
    return paths


def _budget(instance, attribute, value) -> None:
    if value is not None:
        check_budget(value)


@attrs.frozen
class Static(TreePolicy):
    """A fixed rank-path tree (module docstring)."""

    name: ClassVar[str] = "static"

    choices: tuple[Path, ...] = attrs.field(default="eagle1", converter=_choices)  # rank paths, or a preset name
    budget: int | None = attrs.field(default=None, validator=_budget)  # the first `budget` choices; None: all
    backend: str = backend_field()  # "torch" (vectorised) or "networkx" (the readable reference)

    def used(self, draft: DraftOutput) -> tuple[Path, ...]:
        """The choices this draft can hold: within the budget, its depth and its vocabulary."""
        kept = [p for p in self.choices[:self.budget] if len(p) <= draft.depth and max(p) < draft.vocab_size]
        keep = set(kept)
        return tuple(p for p in kept if all(p[:i] in keep for i in range(1, len(p))))

    def build(self, draft: DraftOutput) -> DraftTree:
        check_logprobs(draft)
        paths = self.used(draft)
        if not paths:
            return DraftTree.root_only(draft.root_token, device=draft.logprobs.device)
        if self.backend == "networkx":
            return DraftTree.from_networkx(self.build_graph(draft), device=draft.logprobs.device)
        return self._build_torch(draft, paths)

    def _candidates(self, draft: DraftOutput, paths: tuple[Path, ...], topk) -> tuple[torch.Tensor, torch.Tensor]:
        depth, width = max(map(len, paths)), max(max(p) for p in paths) + 1
        return topk(draft.logprobs[:depth].float().contiguous(), width)  # [D, K] values and tokens

    def build_graph(self, draft: DraftOutput) -> nx.DiGraph:
        """The networkx reference: scores added in float32 along each path, then sorted."""
        paths = self.used(draft)
        values, tokens = self._candidates(draft, paths, reference_topk)
        score: dict[Path, np.float32] = {(): np.float32(0.0)}
        for p in paths:  # parents first
            score[p] = np.float32(score[p[:-1]] + np.float32(values[len(p) - 1, p[-1]]))
        graph = nx.DiGraph()
        graph.add_node(0, token=draft.root_token, depth=0, score=0.0, path=())
        index = {(): 0}
        for node, p in enumerate(sorted(paths, key=lambda q: (-score[q], q)), start=1):
            graph.add_node(node, token=int(tokens[len(p) - 1, p[-1]]), depth=len(p), score=float(score[p]), path=p)
            graph.add_edge(index[p[:-1]], node)
            index[p] = node
        return graph

    def _build_torch(self, draft: DraftOutput, paths: tuple[Path, ...]) -> DraftTree:
        device = draft.logprobs.device
        values, tokens = self._candidates(draft, paths, exact_topk)
        index = {p: i for i, p in enumerate(paths)}
        parent = torch.tensor([index.get(p[:-1], -1) for p in paths], device=device)  # [n] into paths
        depth = torch.tensor([len(p) for p in paths], device=device)
        rank = torch.tensor([p[-1] for p in paths], device=device)
        logp, tok = values[depth - 1, rank], tokens[depth - 1, rank]  # [n]
        scores = torch.zeros(len(paths), dtype=torch.float32, device=device)
        for d in range(1, int(depth.max()) + 1):  # parents' scores are final before their children's
            at = depth == d
            base = torch.where(parent[at] >= 0, scores[parent[at].clamp_min(0)], torch.zeros_like(logp[at]))
            scores[at] = base + logp[at]
        lexicographic = torch.tensor(_path_order(paths), device=device)
        order = order_key(scores, lexicographic).argsort()  # canonical order
        new_index = torch.empty(len(paths), dtype=torch.int64, device=device)
        new_index[order] = torch.arange(1, len(paths) + 1, device=device)
        parents = torch.where(parent[order] >= 0, new_index[parent[order].clamp_min(0)], 0)
        return DraftTree(torch.cat([torch.tensor([draft.root_token], device=device), tok[order].to(torch.int64)]),
                         torch.cat([torch.tensor([-1], device=device), parents]),
                         torch.cat([torch.zeros(1, dtype=torch.int64, device=device), depth[order]]),
                         torch.cat([torch.zeros(1, dtype=torch.float32, device=device), scores[order]]))


def _path_order(paths: Sequence[Path]) -> list[int]:
    """Each path's position in lexicographic order (a prefix before its extensions)."""
    position = [0] * len(paths)
    for rank, i in enumerate(sorted(range(len(paths)), key=lambda j: paths[j])):
        position[i] = rank
    return position
