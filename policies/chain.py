"""Chain: the single best path, one node per depth (the DFlash decoder, or Domino's greedy rollout).

Contract
--------
``Chain(budget=None, top_m=64)``.  Over a factorized draft the chain is the top-1 token of every
marginal row (ties by token id ascending); when the draft carries a `ConditionalScorer` it is the
greedy rollout through ``scorer.expand(..., top_m=top_m, k=1)``, each node reading its own path
state.  ``budget`` caps the length; the default is the draft's depth L.  A chain is best-first
search with one candidate per node, so it runs on the shared skeleton and expander.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from treespec.interfaces import DraftOutput
from treespec.policies.engine.best_first import BestFirstPolicy, check_logprobs, count_field
from treespec.policies.engine.candidates import Candidates, ScorerSource, TopTokens
from treespec.policies.engine.stop import StopRule
from treespec.tree import check_budget

__all__ = ["Chain"]


def _optional_budget(instance, attribute, value) -> None:
    if value is not None:
        check_budget(value, attribute.name)


@attrs.frozen
class Chain(BestFirstPolicy):
    """Top-1 child per depth (see the module docstring)."""

    name: ClassVar[str] = "chain"
    uses_scorer: ClassVar[str] = "optional"

    budget: int | None = attrs.field(default=None, validator=_optional_budget)  # most nodes (None: L)
    top_m: int = count_field(64)  # with a scorer: candidates per depth the correction is normalised over
    stop: StopRule | None = None  # optional early stop (e.g. CostAwareStop)

    def max_nodes(self, draft: DraftOutput) -> int:
        return draft.depth if self.budget is None else min(self.budget, draft.depth)

    def validate(self, draft: DraftOutput) -> None:
        if draft.scorer is None:
            check_logprobs(draft)

    def candidates(self, draft: DraftOutput) -> Candidates:
        if draft.scorer is not None:
            return ScorerSource(draft.scorer, min(self.top_m, draft.vocab_size), 1)
        return TopTokens(draft.logprobs, 1)
