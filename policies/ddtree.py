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

from treespec.interfaces import DraftOutput
from treespec.policies.engine.best_first import BestFirstPolicy, budget_field, check_logprobs
from treespec.policies.engine.candidates import TopTokens
from treespec.policies.engine.stop import StopRule

__all__ = ["DDTree"]


@attrs.frozen
class DDTree(BestFirstPolicy):
    """Best-first over marginals (see the module docstring)."""

    name: ClassVar[str] = "ddtree"

    budget: int = budget_field(16)  # non-root nodes per round
    stop: StopRule | None = None  # optional early stop rule

    def validate(self, draft: DraftOutput) -> None:
        check_logprobs(draft)

    def candidates(self, draft: DraftOutput) -> TopTokens:
        return TopTokens(draft.logprobs, self.budget)  # a tree of B nodes uses at most B per depth
