"""The torch frontier over S drafts at once, in static shapes: the home of the static build.

Contract
--------
`stack_sources(sources)` stacks S resolved `CandidateSource`s of one kind into one `SourceStack`
(None when they cannot be stacked: mixed kinds, or factorized lists of different lengths):

* `FactorizedStack` -- per depth, the S sequences' ranked lists [S, K_d] (one K_d for all S);
* `ScorerStack` -- the S drafts' scorers as one stacked scorer: ``type(scorer).stack(scorers)``
  where the scorer class offers it (drafters/domino.py: one batched correction for all S), else
  `LoopedScorers`, which calls each scorer in turn.  A stacked scorer has the methods of a
  `ConditionalScorer` (its deferred pair ``expand_deferred`` / ``advance`` included) with a
  leading [S] dimension on every tensor.

`stacked_selection(roots, stack, budgets, depth)` grows S trees level by level with the
frontier of policies/engine/frontier.py in its static form -- every level of every sequence holds
exactly ``min(B, n k)`` nodes, B the largest budget, so shapes depend on the budgets, the depth
and the widths alone and nothing synchronises with the host (a GPU build can be captured in a CUDA
graph) -- and returns each sequence's pool and canonical order.  A tree of budget B_s is a prefix
of the canonical order of a pool grown with any width >= B_s, so sequences with smaller budgets
take a prefix.  `assemble` turns one sequence's pool and order into its `DraftTree`.

Sequence s's tree equals its single build bit for bit: the batched operations (float32 additions,
the int64 order keys, scatter-adds) compute every sequence's entries independently, and a stacked
scorer must return each sequence's rows as its own scorer would.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from treespec.interfaces import ConditionalScorer, Expansion
from treespec.policies.engine.candidates import (
    CandidateSource,
    FactorizedSource,
    ScorerSource,
    check_children,
    scorer_children,
)
from treespec.topk import order_key
from treespec.tree import DraftTree

__all__ = ["FactorizedStack", "LoopedScorers", "ScorerStack", "SourceStack", "assemble",
           "stack_sources", "stacked_selection"]


# ---------------------------------------------------------------------------- stacked sources
@attrs.frozen(eq=False)
class FactorizedStack:
    """S factorized sources: one ranked list per sequence and depth."""

    tokens: tuple[torch.Tensor, ...]  # per depth d-1: [S, K_d] int64, each row best first
    logprobs: tuple[torch.Tensor, ...]  # per depth: [S, K_d] float32, each row descending


@attrs.frozen(eq=False)
class ScorerStack:
    """S scorer sources: one stacked scorer, the shared ``top_m`` and ``k``."""

    scorer: object  # a stacked scorer (module docstring)
    top_m: int  # candidates per depth the correction is normalised over
    k: int  # children kept per parent
    check_values: bool = True  # also reject NaN / positive log-probs (a host sync)

    def root_states(self) -> torch.Tensor:
        """[S, 1, G] the roots' states."""
        state = self.scorer.root_state()
        if state.dim() != 2:
            raise ValueError(f"a stacked scorer's root_state() must be [S, G], got shape {tuple(state.shape)}")
        return state[:, None]

    def expand(self, states: torch.Tensor, depth: int) -> Expansion:
        """Children of the parents ``states`` [S, n, G]: tokens, log-probs [S, n, k], states [S, n, k, G]."""
        out = scorer_children(self.scorer, states, depth, self.top_m, self.k)
        check_children(out.tokens, out.logprobs, out.states, tuple(states.shape[:-1]), depth, self.check_values)
        return out


SourceStack = FactorizedStack | ScorerStack


def _stacked(outs: Sequence[Expansion]) -> Expansion:
    return Expansion(tokens=torch.stack([o.tokens for o in outs]), logprobs=torch.stack([o.logprobs for o in outs]),
                     states=torch.stack([o.states for o in outs]))


class LoopedScorers:
    """S scorers as one stacked scorer, each called in turn (for scorer classes whose ``stack`` declines)."""

    def __init__(self, scorers: Sequence[ConditionalScorer]) -> None:
        self.scorers = list(scorers)

    def root_state(self) -> torch.Tensor:
        return torch.stack([s.root_state() for s in self.scorers])  # [S, G]

    def expand(self, states: torch.Tensor, depth: int, *, top_m: int, k: int) -> Expansion:
        return _stacked([s.expand(row, depth, top_m=top_m, k=k) for s, row in zip(self.scorers, states, strict=True)])

    def expand_deferred(self, states: torch.Tensor, depth: int, *, top_m: int, k: int) -> Expansion:
        return _stacked([s.expand_deferred(row, depth, top_m=top_m, k=k)
                         for s, row in zip(self.scorers, states, strict=True)])

    def advance(self, pending: torch.Tensor) -> torch.Tensor:
        return torch.stack([s.advance(row) for s, row in zip(self.scorers, pending, strict=True)])


def stack_sources(sources: Sequence[CandidateSource]) -> SourceStack | None:
    """One `SourceStack` over ``sources`` (resolved for static builds), or None if they do not stack."""
    if all(isinstance(s, FactorizedSource) for s in sources):
        widths = {tuple(t.numel() for t in s.tokens) for s in sources}
        if len(widths) != 1:
            return None
        return FactorizedStack(tuple(torch.stack(rows) for rows in zip(*(s.tokens for s in sources), strict=True)),
                               tuple(torch.stack(rows) for rows in zip(*(s.logprobs for s in sources), strict=True)))
    if not all(isinstance(s, ScorerSource) for s in sources):
        return None
    first = sources[0]
    if any((s.top_m, s.k, s.check_values) != (first.top_m, first.k, first.check_values) for s in sources):
        return None
    scorers = [s.scorer for s in sources]
    stacked = type(scorers[0]).stack(scorers) if all(type(s) is type(scorers[0]) for s in scorers) else None
    return ScorerStack(stacked if stacked is not None else LoopedScorers(scorers), first.top_m, first.k, first.check_values)


# ---------------------------------------------------------------------------- the stacked frontier
@attrs.frozen(eq=False)
class _Level:
    """The kept nodes of one depth of every sequence, in lexicographic rank-path order."""

    tokens: torch.Tensor  # [S, n] int64
    scores: torch.Tensor  # [S, n] float32
    parent_rows: torch.Tensor  # [S, n] int64 row of each node's parent in the previous level
    parents: torch.Tensor  # [S, n] int64 pool index of each node's parent (pool = levels concatenated)


class _StackedFrontier:
    """Per-depth beam of width B for S sequences at once (the static form of policies/engine/frontier.py's
    `_Frontier`: every node of the last level is expanded, the best B children per sequence kept)."""

    def __init__(self, roots: torch.Tensor, stack: SourceStack, width: int) -> None:
        self.stack, self.width = stack, width
        s = roots.shape[0]
        no_parent = torch.full_like(roots, -1)
        self.levels = [_Level(roots, torch.zeros(s, 1, device=roots.device), no_parent, no_parent)]
        self.size = 1  # pool nodes per sequence so far
        self.states = stack.root_states() if isinstance(stack, ScorerStack) else None  # [S, n, G]

    def grow(self, depth_limit: int) -> None:
        for depth in range(depth_limit):
            self._step(depth)

    def _children(self, depth: int) -> tuple[torch.Tensor, ...]:
        """(scores [S, n k], tokens, states, k) of every child of the last level, in rank-path order;
        tokens [S, n k], or [S, K] shared by every parent (factorized), and states [S, n k, G] or None."""
        level = self.levels[-1]
        s = level.scores.shape[0]
        if isinstance(self.stack, FactorizedStack):
            values = self.stack.logprobs[depth]  # [S, K]
            scores = (level.scores[:, :, None] + values[:, None, :]).reshape(s, -1)  # float32(parent + logp)
            return scores, self.stack.tokens[depth], None, values.shape[1]
        out = self.stack.expand(self.states, depth)
        scores = (level.scores[:, :, None] + out.logprobs).reshape(s, -1)  # float32(parent + logp)
        return scores, out.tokens.reshape(s, -1), out.states.reshape(s, scores.shape[1], -1), out.tokens.shape[2]

    def _step(self, depth: int) -> None:
        level = self.levels[-1]
        scores, tokens, states, k = self._children(depth)
        s, total = scores.shape
        if total <= self.width:
            sel = torch.arange(total, device=scores.device).expand(s, -1)
        else:  # the best B per sequence by (score desc, rank path asc), back in rank-path order
            key = order_key(scores, torch.arange(total, device=scores.device))
            sel = key.topk(self.width, dim=1, largest=False, sorted=False).indices.sort(dim=1).values
        parent_rows = sel // k
        tokens = tokens.gather(1, sel % k if states is None else sel)  # factorized: the shared list
        if states is not None:
            self.states = states.gather(1, sel[:, :, None].expand(-1, -1, states.shape[2]))
        level_start = self.size - level.scores.shape[1]
        self.levels.append(_Level(tokens, scores.gather(1, sel), parent_rows, parent_rows + level_start))
        self.size += sel.shape[1]

    def _preorder(self) -> torch.Tensor:
        """[S, P] every pool node's position in its sequence's depth-first (lexicographic rank-path) order.

        What precedes x: at each shallower depth, its ancestor and the ancestor's lex-smaller
        cousins (``prefix``); its own lex-smaller cousins (its lex position); and every pool node
        hanging below those cousins (their descendant counts).
        """
        desc = [torch.zeros_like(self.levels[-1].tokens)]  # pool descendants per node, deepest first
        for child, parent in zip(self.levels[:0:-1], self.levels[-2::-1]):
            desc.append(torch.zeros_like(parent.tokens).scatter_add_(1, child.parent_rows, desc[-1] + 1))
        pieces, above = [], None  # above: prefix + lexpos + 1 of the previous level
        for level, count in zip(self.levels, desc[::-1]):
            lexpos = torch.arange(count.shape[1], device=count.device).expand_as(count)
            prefix = torch.zeros_like(count) if above is None else above.gather(1, level.parent_rows)
            pieces.append(prefix + lexpos + count.cumsum(1) - count)
            above = prefix + lexpos + 1
        return torch.cat(pieces, dim=1)

    def select(self) -> tuple[torch.Tensor, ...]:
        """(order [S, m], tokens, scores, depths, parents [S, P]): each sequence's best
        m = min(B, P - 1) pool nodes in canonical order, and the pools (pool index 0 is the root)."""
        tokens = torch.cat([lv.tokens for lv in self.levels], dim=1)
        scores = torch.cat([lv.scores for lv in self.levels], dim=1)
        parents = torch.cat([lv.parents for lv in self.levels], dim=1)
        depths = torch.cat([torch.full_like(lv.tokens, d) for d, lv in enumerate(self.levels)], dim=1)
        m = min(self.width, self.size - 1)
        key = order_key(scores[:, 1:], self._preorder()[:, 1:])
        order = key.topk(m, dim=1, largest=False, sorted=True).indices + 1
        return order, tokens, scores, depths, parents


def stacked_selection(roots: torch.Tensor, stack: SourceStack, budgets: Sequence[int],
                      depth: int) -> tuple[list[torch.Tensor], torch.Tensor, ...]:
    """(orders, tokens, scores, depths, parents): sequence s's canonical order [m_s] (its best
    min(B_s, P - 1) nodes) and the pools [S, P], for root tokens ``roots`` [S, 1] int64."""
    frontier = _StackedFrontier(roots, stack, max(budgets))
    frontier.grow(depth)
    order, tokens, scores, depths, parents = frontier.select()
    orders = [row[:budget] for row, budget in zip(order, budgets, strict=True)]
    return orders, tokens, scores, depths, parents


def assemble(order, tokens, scores, depths, parents) -> DraftTree:
    """The DraftTree of pool nodes ``order`` (canonical order, prefix-closed) under pool node 0."""
    index = torch.zeros_like(tokens)  # pool index -> tree index (the root stays 0)
    index[order] = torch.arange(1, order.numel() + 1, device=tokens.device)
    head = torch.zeros(1, dtype=torch.int64, device=tokens.device)
    return DraftTree(torch.cat([tokens[:1], tokens[order]]),
                     torch.cat([head - 1, index[parents[order]]]),
                     torch.cat([head, depths[order]]),
                     torch.cat([scores[:1], scores[order]]), check=False)
