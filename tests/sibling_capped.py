"""A policy written the way a researcher adds one, living in the tests: best-first over the draft's
path-dependent scorer with at most ``siblings`` children per node.

It is one file plus one registration (tests/conftest.py, through the public `treespec.register`),
and declares that it needs a scorer; bench, replay and the lossless tests pick it up from the
registry (tests/test_new_policy.py checks that they do).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from treespec import DraftOutput
from treespec.policies.engine.best_first import BestFirstPolicy, budget_field, count_field
from treespec.policies.engine.candidates import ScorerSource

NAME = "sibling-capped"


@attrs.frozen
class SiblingCapped(BestFirstPolicy):
    """Best-first under each node's own path scores; a node keeps its ``siblings`` best children."""

    name: ClassVar[str] = NAME
    uses_scorer: ClassVar[str] = "required"

    budget: int = budget_field(16)  # non-root nodes per round
    top_m: int = count_field(32)  # base candidates per depth the scorer normalises over
    siblings: int = count_field(2)  # children kept per node
    stop = None  # no early stop rule

    def validate(self, draft: DraftOutput) -> None:
        if draft.scorer is None:
            raise ValueError(f"{NAME} needs a draft with a ConditionalScorer")

    def candidates(self, draft: DraftOutput) -> ScorerSource:
        top_m = min(self.top_m, draft.vocab_size)
        return ScorerSource(draft.scorer, top_m, min(self.siblings, top_m))
