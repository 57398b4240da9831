"""CaDDTree: DDTree whose size is chosen each round by the cost-aware stop rule.

Contract
--------
``CaDDTree(budget=1024, cost_model=..., convention="treespec")`` builds exactly the tree of
``DDTree(budget=budget, stop=CostAwareStop(cost_model, convention))``: DDTree's pops, ended at the
first candidate that does not raise the expected tokens per second (policies/cost.py states the
rule, its two conventions and the comparison with AR).  ``budget`` is only a cap, 1024 as in the
published harness, so in practice the cost model alone sizes the tree; the context length the
cost model sees is ``draft.position``.  The cost model is the machine's: `treespec.generate`,
``treespec bench`` and ``treespec demo`` pass the profile they measured (`treespec.profile`); built
by hand, the policy needs one (`treespec.cost.ConvexCost.fit`, or a named ``COST_PRESETS`` entry).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import attrs

from policies.best_first import BestFirstPolicy, budget_field, check_logprobs
from policies.cost import CostAwareStop, CostModel, check_convention, check_cost_model
from policies.ddtree import marginal_source
from policies.sources import FactorizedSource
from treespec.interfaces import DraftOutput

__all__ = ["CaDDTree"]


@attrs.frozen
class CaDDTree(BestFirstPolicy):
    """DDTree with cost-aware stopping (see the module docstring)."""

    name: ClassVar[str] = "caddtree"
    uses_cost_model: ClassVar[bool] = True

    budget: int = budget_field(1024)  # cap on non-root nodes (the published harness's); the cost rule ends sooner
    cost_model: CostModel | None = attrs.field(default=None, validator=check_cost_model)  # C_d, C_v of the machine
    convention: Literal["treespec", "published"] = attrs.field(default="treespec", validator=check_convention)  # tree-size accounting (policies/cost.py)

    @property
    def stop(self) -> CostAwareStop:
        if self.cost_model is None:
            raise ValueError(f"{self.name} needs the cost model of this machine: pass cost_model= (measured by "
                             "treespec.profile.machine_profile or `treespec profile-cost`)")
        return CostAwareStop(self.cost_model, self.convention)

    def validate(self, draft: DraftOutput) -> None:
        check_logprobs(draft)
        self.stop  # noqa: B018 - refuses a missing cost model before any work

    def candidates(self, draft: DraftOutput, *, reference: bool, static: bool = False) -> FactorizedSource:
        return marginal_source(draft, self.budget, reference=reference, static=static)
