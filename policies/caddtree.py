"""CaDDTree: DDTree whose size is chosen each round by the cost-aware stop rule.

Contract
--------
``CaDDTree(budget=64, cost_model=COST_PRESETS["smollm2-cpu-bf16"])`` builds exactly the tree of
``DDTree(budget=budget, stop=CostAwareStop(cost_model))``: DDTree's pops, ended at the first
candidate that does not raise the expected tokens per second (policies/cost.py, `CostAwareStop`,
states the rule and its n and initial θ).  ``budget`` is only a cap; the context length the cost
model sees is ``draft.position``.  Fit a model for your own hardware with `ConvexCost.fit`.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from policies.best_first import BestFirstPolicy, budget_field, check_logprobs
from policies.cost import COST_PRESETS, CostAwareStop, CostModel
from policies.ddtree import marginal_source
from policies.sources import FactorizedSource
from treespec.interfaces import DraftOutput

__all__ = ["CaDDTree"]


def _is_cost_model(instance, attribute, value) -> None:
    if not isinstance(value, CostModel):
        raise TypeError(f"cost_model must be a CostModel, got {type(value).__name__}")


@attrs.frozen
class CaDDTree(BestFirstPolicy):
    """DDTree with cost-aware stopping (see the module docstring)."""

    name: ClassVar[str] = "caddtree"

    budget: int = budget_field(64)  # cap on non-root nodes; the stop rule usually ends sooner
    cost_model: CostModel = attrs.field(factory=lambda: COST_PRESETS["smollm2-cpu-bf16"],
                                        validator=_is_cost_model)  # C_d and C_v(n; ctx) of the hardware

    @property
    def stop(self) -> CostAwareStop:
        return CostAwareStop(self.cost_model)

    def validate(self, draft: DraftOutput) -> None:
        check_logprobs(draft)

    def candidates(self, draft: DraftOutput, *, reference: bool, static: bool = False) -> FactorizedSource:
        return marginal_source(draft, self.budget, reference=reference, static=static)
