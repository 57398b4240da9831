"""Scorers made from a draft for policies that give each node children of its own.

Contract
--------
A `ScorerSource` asks a `ConditionalScorer` for each parent's children; these two build such a
scorer for a policy that wants to change, node by node, what the draft proposes:

* `RowScorer(logprobs)` -- a draft's marginals as a scorer: every node of depth d gets the top-k
  tokens of row d, whatever its path (a state of no size).  A per-node rule over a marginal drafter
  (DFlash) builds on it.
* `RescoredScorer(inner, rescore)` -- ``inner``'s children with log-probs changed by
  ``rescore(depth, tokens, logprobs, main)`` ([n, k] each, ``main`` [n] bool: whether the parent lies
  on the drafter's main path, every rank 0 from the root).  Rows come back sorted again (log-prob
  descending, ties by token ascending); a child whose new log-prob is ``-inf`` is no child
  (policies/engine/candidates.py).  The state is ``inner``'s followed by one main-path flag, and
  ``inner``'s deferred protocol (``expand_deferred`` / ``advance``) is kept, so a Domino scorer still
  pays its GRU step only for the rows expanded.

Both compute each row independently of the batch it came in whenever ``inner`` and ``rescore`` do,
so the torch and networkx backends build the same tree.  They cannot be captured in a CUDA graph
(``round_inputs`` is None) nor stacked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from treespec.interfaces import ConditionalScorer, Expansion
from treespec.topk import exact_topk, order_key

__all__ = ["Rescore", "RescoredScorer", "RowScorer"]

Rescore = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RowScorer(ConditionalScorer):
    """The draft's marginals as a scorer: the top-k of row ``depth`` under every parent."""

    def __init__(self, logprobs: torch.Tensor) -> None:
        self.logprobs = logprobs  # [L, V] float32
        self._rows: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def root_state(self) -> torch.Tensor:
        return self.logprobs.new_zeros(0)  # [0]: the children depend on the depth alone

    def expand(self, states: torch.Tensor, depth: int, *, top_m: int, k: int) -> Expansion:
        if (depth, k) not in self._rows:
            values, tokens = exact_topk(self.logprobs[depth:depth + 1], min(k, self.logprobs.shape[1]))
            self._rows[depth, k] = (tokens[0], values[0])
        tokens, values = self._rows[depth, k]
        n = states.shape[0]
        return Expansion(tokens.expand(n, -1).clone(), values.expand(n, -1).clone(),
                         states.new_zeros(n, tokens.numel(), 0))


class RescoredScorer(ConditionalScorer):
    """``inner``'s children rescored per parent (module docstring)."""

    def __init__(self, inner: ConditionalScorer, rescore: Rescore) -> None:
        self.inner, self.rescore = inner, rescore

    def root_state(self) -> torch.Tensor:
        state = self.inner.root_state()
        return torch.cat([state, state.new_ones(1)])  # the root lies on the main path

    def expand(self, states: torch.Tensor, depth: int, *, top_m: int, k: int) -> Expansion:
        out = self.inner.expand(states[:, :-1], depth, top_m=top_m, k=k)
        return self._children(out, states[:, -1] > 0.5, depth)

    def expand_deferred(self, states: torch.Tensor, depth: int, *, top_m: int, k: int) -> Expansion:
        out = self.inner.expand_deferred(states[:, :-1], depth, top_m=top_m, k=k)
        return self._children(out, states[:, -1] > 0.5, depth)

    def advance(self, pending: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.inner.advance(pending[:, :-1]), pending[:, -1:].to(pending.dtype)], dim=1)

    def _children(self, out: Expansion, main: torch.Tensor, depth: int) -> Expansion:
        """Rescored, re-sorted children; each child's flag: its parent's and its own draft rank 0."""
        logprobs = self.rescore(depth, out.tokens, out.logprobs, main)  # [n, k]
        order = order_key(logprobs, out.tokens).argsort(dim=1)  # [n, k]: log-prob desc, token asc
        tokens, logprobs = out.tokens.gather(1, order), logprobs.gather(1, order)
        first = (order == 0) & main[:, None]  # [n, k] the drafter's own best child of a main-path parent
        states = out.states.gather(1, order[..., None].expand(-1, -1, out.states.shape[-1]))
        return Expansion(tokens, logprobs, torch.cat([states, first[..., None].to(states.dtype)], dim=2))
