"""CaDDTree: DDTree whose size is chosen each round by the cost-aware stop rule.

Contract
--------
``CaDDTree(budget=1024, cost_model=..., convention="treespec")`` builds exactly the tree of
``DDTree(budget=budget, stop=CostAwareStop(cost_model, convention))``: DDTree's pops, ended at the
first candidate that does not raise the expected tokens per second (policies/engine/cost.py states the
rule, its two conventions and the comparison with AR).  ``budget`` is only a cap, 1024 as in the
published harness, so in practice the cost model alone sizes the tree; the context length the
cost model sees is ``draft.position``.  The cost model is the machine's: `treespec.generate`,
``treespec bench`` and ``treespec demo`` pass the profile they measured (`treespec.pricing.profile`); built
by hand, the policy needs one (`treespec.pricing.cost.ConvexCost.fit`, or a named ``COST_PRESETS`` entry).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from treespec.interfaces import DraftOutput
from treespec.policies.engine.best_first import BestFirstPolicy, budget_field, check_logprobs
from treespec.policies.engine.candidates import TopTokens
from treespec.policies.engine.cost import CostAware

__all__ = ["CaDDTree"]


@attrs.frozen
class CaDDTree(CostAware, BestFirstPolicy):
    """DDTree with cost-aware stopping (see the module docstring)."""

    name: ClassVar[str] = "caddtree"

    budget: int = budget_field(1024)  # cap on non-root nodes (the published harness's); the cost rule ends sooner
    def validate(self, draft: DraftOutput) -> None:
        check_logprobs(draft)
        self.require_cost_model()

    def candidates(self, draft: DraftOutput) -> TopTokens:
        return TopTokens(draft.logprobs, self.budget)
