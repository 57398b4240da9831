"""Cost-aware DominoTree: DominoTree's conditional best-first, sized each round by the cost rule.

Contract
--------
``CostAwareDominoTree(budget=16, top_m=64, node_topk=8, cost_model=..., convention="treespec")``
builds exactly ``DominoTree(budget, top_m, node_topk, stop=CostAwareStop(cost_model, convention))``:
DominoTree's pops under each node's own path scores, ended where one more node no longer raises the
expected tokens per second (policies/engine/cost.py).  ``budget`` caps the tree.  Like CaDDTree it takes
the machine's cost model, which the harnesses pass from the measured profile.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from treespec.interfaces import DraftOutput
from treespec.policies.dominotree import corrected_source, require_scorer
from treespec.policies.engine.best_first import BestFirstPolicy, budget_field, count_field
from treespec.policies.engine.candidates import ScorerSource
from treespec.policies.engine.cost import CostAware

__all__ = ["CostAwareDominoTree"]


@attrs.frozen
class CostAwareDominoTree(CostAware, BestFirstPolicy):
    """DominoTree with cost-aware stopping (see the module docstring)."""

    name: ClassVar[str] = "cost-aware-dominotree"
    uses_scorer: ClassVar[str] = "required"

    budget: int = budget_field(16)  # cap on non-root nodes
    top_m: int = count_field(64)  # base candidates per depth the correction is normalised over
    node_topk: int = count_field(8)  # children kept per expanded node
    def validate(self, draft: DraftOutput) -> None:
        require_scorer(draft, "cost-aware DominoTree")
        self.require_cost_model()

    def candidates(self, draft: DraftOutput) -> ScorerSource:
        return corrected_source(draft, self.top_m, self.node_topk)
