"""DDTree: best-first over the per-depth marginals (the optimal tree under the factorized surrogate).

Contract
--------
``DDTree(budget=16, stop=None)``.  Children at depth d are the top-min(B, V) tokens of marginal
row d - 1, the same ranked list under every parent; the heap pops B nodes (offering, after each
pop, the next sibling and the first child), so the tree is the B most likely prefixes with depth
at most L.  ``stop`` ends the build early (``DDTree(stop=CostAwareStop(model))`` is CaDDTree).
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from policies.best_first import BestFirstPolicy, StopRule, budget_field, check_logprobs
from policies.sources import FactorizedSource
from treespec.interfaces import DraftOutput
from treespec.reach import best_chain, reachable
from treespec.topk import exact_topk, order_key, reference_topk

__all__ = ["DDTree", "marginal_source"]

_FIRST_PASS = 32  # candidates per depth tried first when the budget is large


def marginal_source(draft: DraftOutput, budget: int, *, reference: bool, static: bool = False) -> FactorizedSource:
    """The top-min(B, V) tokens of every marginal row, best first (ties by token id).

    The compact torch path (not ``reference``, not ``static``) with a large budget returns
    shorter lists where that provably changes nothing; see `_adaptive_source`.
    """
    k = min(budget, draft.vocab_size)
    if not (reference or static) and k > _FIRST_PASS:
        return _adaptive_source(draft, budget)
    values, tokens = (reference_topk if reference else exact_topk)(draft.logprobs, k)
    return FactorizedSource.from_rows(tokens, values)


def _adaptive_source(draft: DraftOutput, budget: int) -> FactorizedSource:
    """Per-depth lists that are only as long as they need to be.

    Any B distinct nodes bound the tree's B-th best score from below; `_score_floor` takes a
    cheap family of them.  A token at depth d can only enter the tree if float32(S + logp)
    reaches that floor, S being the best depth-(d-1) score (the top-1 chain; rounding is
    monotone).  Depths whose 33rd token cannot reach it keep their top 32; the others get exactly
    the tokens that can (at most B, best first).
    """
    values, tokens = exact_topk(draft.logprobs, _FIRST_PASS + 1)  # [L, 33]
    chain = best_chain(values[:, 0])  # [L] best score of a parent at each depth
    floor = _score_floor(values[:, :_FIRST_PASS], chain, budget)
    narrow = FactorizedSource.from_rows(tokens[:, :_FIRST_PASS], values[:, :_FIRST_PASS])
    widen = reachable(values[:, _FIRST_PASS:_FIRST_PASS + 1], chain, floor)[:, 0].nonzero().flatten().tolist()
    if not widen:
        return narrow
    rows_t, rows_v = list(narrow.tokens), list(narrow.logprobs)
    for d in widen:
        rows_t[d], rows_v[d] = _reachable(draft.logprobs[d], chain[d], floor, budget)
    return FactorizedSource(tuple(rows_t), tuple(rows_v))


def _score_floor(values: torch.Tensor, chain: torch.Tensor, budget: int) -> float:
    """The B-th best score among some B real nodes (-inf if the family is smaller than B).

    The family: every depth-1 node, every depth-2 node, and below that the top-1 chain ending in
    each candidate -- scores float32(parent + logp), exactly as the tree computes them.
    """
    family = [values[0], (values[0, :, None] + values[1:2].reshape(-1)[None, :]).reshape(-1),
              (chain[2:, None] + values[2:]).reshape(-1)]  # depths 1, 2 and 3..L
    scores = torch.cat(family)
    if scores.numel() < budget:
        return float("-inf")
    return float(scores.topk(budget, sorted=False).values.min())


def _reachable(row: torch.Tensor, parent: torch.Tensor, floor: float, budget: int):
    """The best min(B, ...) tokens t of ``row`` with float32(parent + row[t]) >= floor, best first."""
    ids = reachable(row[None], parent.reshape(1), floor)[0].nonzero().flatten()
    top = order_key(row[ids], ids).topk(min(budget, ids.numel()), largest=False, sorted=True).indices
    return ids[top], row[ids[top]]


@attrs.frozen
class DDTree(BestFirstPolicy):
    """Best-first over marginals (see the module docstring)."""

    name: ClassVar[str] = "ddtree"

    budget: int = budget_field(16)  # non-root nodes per round
    stop: StopRule | None = None  # optional early stop rule

    def validate(self, draft: DraftOutput) -> None:
        check_logprobs(draft)

    def candidates(self, draft: DraftOutput, *, reference: bool, static: bool = False) -> FactorizedSource:
        return marginal_source(draft, self.budget, reference=reference, static=static)
