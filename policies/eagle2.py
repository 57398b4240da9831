"""EAGLE-2's dynamic draft tree (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees"), over the per-depth marginals of a block drafter.

Contract
--------
``Eagle2(budget=16, topk=10, depth=None)``.  A node's score is its path's cumulative draft
log-probability, ``float32(score(parent) + logp(child))`` (the paper's "value": the product of the
path's confidences).  The tree is grown in two phases:

1. **Expansion.**  Depth 1 is the root's top-``topk`` children.  At each depth d >= 1 the ``topk``
   best nodes of depth d (by score; ties by rank path) are expanded, each with its top-``topk``
   children, the top-``topk`` tokens of marginal row d (ties by token id: a block drafter's
   children at a depth are the same list under every parent).  Expansion runs to ``depth`` (the
   draft's depth when None) or the draft's depth, whichever is smaller.
2. **Re-ranking.**  Of every drafted node, the ``budget`` best by score are kept, ties by rank path.
   Log-probs are <= 0, so a child never beats its parent and a younger sibling never beats an elder
   one: the kept set is closed under ancestors and is a tree.

With ``topk >= budget`` no node the budget could keep is left unexpanded, and the tree is DDTree's
(the ``budget`` most likely prefixes).  Nodes come in the canonical order (`treespec.tree`).

Backends: ``networkx`` grows the drafted tree node by node in Python and sorts it; ``torch`` runs
the expansion as one [topk, topk] selection per depth and the re-ranking as one sort over the
drafted nodes.  Both return the same tree, bit for bit.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import networkx as nx
import numpy as np
import torch

from treespec.interfaces import DraftOutput, TreePolicy, backend_field
from treespec.policies.engine.best_first import budget_field, check_logprobs, count_field
from treespec.topk import exact_topk, order_key, reference_topk
from treespec.tree import DraftTree

__all__ = ["Eagle2"]


def _depth_limit(instance, attribute, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"depth must be an integer >= 1 or None (the draft's depth), got {value!r}")


@attrs.frozen
class Eagle2(TreePolicy):
    """EAGLE-2's expand-then-rerank tree over marginals (module docstring)."""

    name: ClassVar[str] = "eagle2"

    budget: int = budget_field(16)  # non-root nodes kept after re-ranking
    backend: str = backend_field()  # "torch" (vectorised) or "networkx" (the readable reference)
    topk: int = count_field(10)  # nodes expanded per depth, and children per expanded node
    depth: int | None = attrs.field(default=None, validator=_depth_limit)  # expansion depth; None: the draft's

    def build(self, draft: DraftOutput) -> DraftTree:
        check_logprobs(draft)
        if self.backend == "networkx":
            return DraftTree.from_networkx(self.build_graph(draft), device=draft.logprobs.device)
        return self._build_torch(draft)

    def _depth(self, draft: DraftOutput) -> int:
        return min(draft.depth, self.depth or draft.depth)

    # ------------------------------------------------------------------ networkx: the readable reference
    def build_graph(self, draft: DraftOutput) -> nx.DiGraph:
        """The kept tree as a graph in canonical order (node attributes token, depth, score, path)."""
        k = min(self.topk, draft.vocab_size)
        values, tokens = reference_topk(draft.logprobs[:self._depth(draft)].float(), k)  # [L, k] each row's children
        drafted = []  # (score, path, token)
        level = [(np.float32(0.0), ())]  # the nodes expanded at this depth
        for d in range(values.shape[0]):
            children = [(np.float32(score + np.float32(values[d, r])), path + (r,), int(tokens[d, r]))
                        for score, path in level for r in range(k)]
            drafted += children
            level = [(s, p) for s, p, _ in sorted(children, key=lambda c: (-c[0], c[1]))[:k]]
        kept = sorted(drafted, key=lambda c: (-c[0], c[1]))[:self.budget]
        graph = nx.DiGraph()
        graph.add_node(0, token=draft.root_token, depth=0, score=0.0, path=())
        index = {(): 0}
        for node, (score, path, token) in enumerate(kept, start=1):
            graph.add_node(node, token=token, depth=len(path), score=float(score), path=path)
            graph.add_edge(index[path[:-1]], node)
            index[path] = node
        return graph

    # ------------------------------------------------------------------ torch: vectorized
    def _build_torch(self, draft: DraftOutput) -> DraftTree:
        device = draft.logprobs.device
        k, depth = min(self.topk, draft.vocab_size), self._depth(draft)
        values, tokens = exact_topk(draft.logprobs[:depth].float().contiguous(), k)  # [L, k]
        ranks = torch.arange(k, device=device)
        # every drafted node: score, token, depth, its parent's index among the drafted nodes, its rank
        scores, toks, depths, parents, child_ranks = [values[0]], [tokens[0]], [torch.ones(k, dtype=torch.int64,
                                                                                          device=device)], \
            [torch.full((k,), -1, dtype=torch.int64, device=device)], [ranks]
        level, offset = torch.arange(k, device=device), 0  # the expanded nodes of depth 1: all, in rank-path order
        for d in range(1, depth):
            parent_scores = scores[-1][level - offset]  # [k'] the expanded nodes, in (score, path) order
            cand = parent_scores[:, None] + values[d][None, :]  # [k', k] float32: one addition each
            scores.append(cand.reshape(-1))
            toks.append(tokens[d].repeat(level.numel()))
            depths.append(torch.full((cand.numel(),), d + 1, dtype=torch.int64, device=device))
            parents.append(level.repeat_interleave(k))
            child_ranks.append(ranks.repeat(level.numel()))
            offset_next = offset + scores[-2].numel()
            # the next level: the k best of these children, ties by rank path.  The expanded parents are
            # kept in rank-path order, so the children's flat index (parent, rank) is their path order
            flat = torch.arange(cand.numel(), device=device)
            best = order_key(cand.reshape(-1), flat).topk(min(k, cand.numel()), largest=False).indices
            level, offset = offset_next + best.sort().values, offset_next
        return self._rerank(draft, torch.cat(scores), torch.cat(toks), torch.cat(depths), torch.cat(parents),
                            torch.cat(child_ranks))

    def _rerank(self, draft: DraftOutput, scores: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor,
                parents: torch.Tensor, ranks: torch.Tensor) -> DraftTree:
        """The ``budget`` best drafted nodes in canonical order, as a tree."""
        device = scores.device
        preorder = _preorder_rank(parents, ranks, depths)  # rank path order of the drafted nodes
        order = order_key(scores, preorder).argsort()[:self.budget]  # [B] kept nodes, canonical order
        new_index = torch.full((scores.numel() + 1,), -1, dtype=torch.int64, device=device)
        new_index[order] = torch.arange(1, order.numel() + 1, device=device)
        kept_parents = torch.where(parents[order] >= 0, new_index[parents[order].clamp_min(0)], 0)
        root = torch.tensor([draft.root_token], dtype=torch.int64, device=device)
        return DraftTree(torch.cat([root, tokens[order].to(torch.int64)]),
                         torch.cat([torch.tensor([-1], device=device), kept_parents]),
                         torch.cat([torch.zeros(1, dtype=torch.int64, device=device), depths[order]]),
                         torch.cat([torch.zeros(1, dtype=torch.float32, device=device), scores[order]]))


def _preorder_rank(parents: torch.Tensor, ranks: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """[n] each node's position in the lexicographic order of rank paths (a prefix first): its path,
    padded with -1 to the deepest depth, sorted by one stable sort per digit from the last."""
    n, deepest = parents.numel(), int(depths.max())
    digits = torch.full((n, deepest), -1, dtype=torch.int64, device=parents.device)  # [n, D] the rank paths
    node = torch.arange(n, device=parents.device)
    for _ in range(deepest):  # walk every path up, writing each ancestor's rank at its depth
        live = node >= 0
        rows = torch.nonzero(live).squeeze(1)
        digits[rows, depths[node[rows]] - 1] = ranks[node[rows]]
        node = torch.where(live, parents[node.clamp_min(0)], node)
    order = torch.arange(n, device=parents.device)
    for column in range(deepest - 1, -1, -1):
        order = order[torch.sort(digits[order, column], stable=True).indices]
    position = torch.empty(n, dtype=torch.int64, device=parents.device)
    position[order] = torch.arange(n, device=parents.device)
    return position
