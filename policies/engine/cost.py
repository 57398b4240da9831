"""The cost-aware stop rule (CaDDTree's), for any best-first policy.

Contract
--------
`CostAwareStop(cost)` ends a best-first build when one more node no longer raises the expected
tokens per second of the round, priced by a `treespec.pricing.cost.CostModel` of the machine.  Candidates
arrive in pop order with scores s_1 >= s_2 >= ...; δ_j = exp(s_j) is the chance the target accepts
candidate j's path and Φ_j = δ_1 + ... + δ_j (float64, summed in pop order).  A tree of the root
and the first j candidates yields 1 + Φ_j tokens in expectation and costs C_d + C_v(n_j; ctx), with
ctx = ``draft.position``:

    θ_j = (1 + Φ_j) / (C_d + C_v(n_j; ctx)),    θ_0 = 1 / (C_d + C_v(n_0; ctx)).

Two conventions:

* ``"treespec"`` (default): n_j = j + 1, the tokens the verify forward really covers (the root is
  one of them).  The build keeps the first argmax j* of θ_j over every j up to the budget (a measured
  C_v need not be convex: on CPUs a one-token forward runs another kernel than a many-token one)
  when θ_j* beats autoregressive decoding, 1 / C_v(1; ctx): the round paid for its draft.
  Otherwise the draft and the build are spent by the time the tree is cut, and only the verify is
  still to pay, so the rule keeps the tree that gains most over an AR step for its verify alone,

      j° = argmax_j  Φ_j - (C_v(n_j; ctx) / C_v(1; ctx) - 1)     (expected tokens over one, in AR steps),

  and the root-only tree when no j gains (the first argmax; j = 0 gains 0).  Whether the next rounds
  draft at all is not the rule's: the policy's draft controller measures what drafted rounds yield
  (`CostAware.draft_controller`, treespec/pricing/control.py).
* ``"published"``: CaDDTree's released ``build_caddtree_tree``: n_j = j (its C_v is indexed by the
  drafted nodes, the root not counted), candidates kept up to the first j with θ_j <= θ_{j-1}
  (scores never rise along the pop order, so with a convex C_v the ratio is unimodal and this is
  its first argmax), no comparison against AR.  For the same curve it builds the released tree.

``calibration`` (default: none) corrects a drafter whose probabilities promise more or less than the
target accepts, by confidence: δ_j = min(1, κ exp(s_j)^β) (`treespec.pricing.calibration.Calibration`; a
bare number is κ with β = 1).  `treespec.pricing.calibration.fit_calibration` fits κ and β from recorded
nodes, and the machine profile stores them per drafter.

The rule keeps no state between builds; `keep` (torch) and `reference` + `trim` (networkx) read one
float64 cost table and agree bit for bit.  A round is built at the price its controller decided
(`CostAware.priced`: a frozen curve and calibration), so a build is a pure function of the draft
and the policy's fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Literal

import attrs
import torch

from treespec.interfaces import DraftController, DraftOutput
from treespec.policies.engine.stop import StopRule
from treespec.pricing.calibration import Calibration, to_calibration
from treespec.pricing.control import PricedController
from treespec.pricing.cost import CostModel

__all__ = [
    "CONVENTIONS", "CostAwareStop", "CostAware", "check_convention", "check_cost_model", "require_cost_model",
]

CONVENTIONS = ("treespec", "published")


def check_convention(instance, attribute, value) -> None:
    """attrs validator: one of `CONVENTIONS`."""
    if value not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {value!r}")


def _is_cost_model(instance, attribute, value) -> None:
    if not isinstance(value, CostModel):
        raise TypeError(f"{attribute.name} must be a CostModel, got {type(value).__name__}")


def check_cost_model(instance, attribute, value) -> None:
    """attrs validator of a policy's ``cost_model`` field: a `CostModel`, or None until one is given."""
    if value is not None:
        _is_cost_model(instance, attribute, value)


@attrs.frozen
class CostAwareStop(StopRule):
    """Stop when one more node no longer raises the expected tokens per second (module docstring)."""

    cost: CostModel = attrs.field(validator=_is_cost_model)  # C_d and C_v(n; ctx) of this machine
    convention: Literal["treespec", "published"] = attrs.field(default="treespec", validator=check_convention)
    calibration: Calibration = attrs.field(default=Calibration(), converter=to_calibration)  # δ_j = min(1, κ δ^β)

    def _deltas(self, scores: torch.Tensor) -> torch.Tensor:
        """[m] float64 acceptance chances of the candidates: exp(score), calibrated, at most 1."""
        return self.calibration.deltas(scores)

    def _verify_table(self, draft: DraftOutput, count: int) -> torch.Tensor:
        """[count + 1] float64: C_v(n_j; ctx) for j = 0..count, n_j as the convention counts."""
        offset = 1 if self.convention == "treespec" else 0
        return self.cost.verify_costs(count + 1, draft.position)[offset:offset + count + 1]

    def _costs(self, verify: torch.Tensor) -> torch.Tensor:
        """C_d + C_v(n_j; ctx), elementwise over a `_verify_table`."""
        costs = self.cost.draft_cost + verify
        if not bool((costs > 0).all()):
            raise ValueError("cost model must give C_d + C_v(n) > 0 for every tree size")
        return costs

    def _phis(self, scores: torch.Tensor) -> torch.Tensor:
        """[m + 1] float64 Φ_0..Φ_m of the first candidates (scores [m], pop order; Φ_0 = 0)."""
        zero = torch.zeros(1, dtype=torch.float64, device=scores.device)
        return torch.cat([zero, self._deltas(scores).cumsum(0)])

    def reference(self, draft: DraftOutput, budget: int) -> Callable[[float], bool]:
        if self.convention == "treespec":
            return lambda score: False  # the whole pop order up to the budget; `trim` takes the argmax
        costs = self._costs(self._verify_table(draft, budget)).tolist()
        state = {"j": 0, "phi": 0.0, "theta": 1.0 / costs[0]}

        def should_stop(score: float) -> bool:
            j = state["j"] + 1
            phi = state["phi"] + float(self._deltas(torch.tensor([score], dtype=torch.float32))[0])
            theta = (1.0 + phi) / costs[j]
            if theta <= state["theta"]:
                return True
            state.update(j=j, phi=phi, theta=theta)
            return False

        return should_stop

    def _thetas(self, verify: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
        """[m + 1] float64 θ_0..θ_m from the verify table and Φ_0..Φ_m (`_verify_table`, `_phis`)."""
        return (1.0 + phi) / self._costs(verify)

    def keep(self, draft: DraftOutput, scores: torch.Tensor) -> torch.Tensor:
        m = scores.numel()
        if self.convention == "treespec" or m == 0:
            return torch.tensor(m, dtype=torch.int64, device=scores.device)
        theta = self._thetas(self._verify_table(draft, m).to(scores.device), self._phis(scores))
        drop = theta[1:] <= theta[:-1]  # [m] candidate j+1 does not raise θ
        return torch.where(drop, torch.arange(m, device=scores.device), m).min()

    def trim(self, draft: DraftOutput, scores: torch.Tensor) -> int:
        """Treespec convention: the first argmax j* of θ over the kept nodes (scores [k]) when that
        tree beats AR; otherwise the tree that gains most over an AR step for its verify alone (the
        draft is spent), 0 when none gains."""
        if self.convention == "published" or scores.numel() == 0:
            return scores.numel()
        verify = self._verify_table(draft, scores.numel()).to(scores.device)  # [k + 1] C_v(j + 1); C_v(1) first
        phi = self._phis(scores)  # [k + 1]
        theta = self._thetas(verify, phi)  # [k + 1]
        best = int(theta.argmax())  # the first maximum
        if float(theta[best]) > 1.0 / float(verify[0]):  # beats AR, 1 / C_v(1; ctx)
            return best
        gain = phi - (verify / verify[0] - 1.0)  # [k + 1] expected tokens over one, less the verify's extra AR steps
        spent = int(gain.argmax())  # the first maximum; gain[0] = 0
        return spent if float(gain[spent]) > 0.0 else 0


@attrs.frozen
class CostAware:
    """Mixin of a cost-aware best-first policy: the machine's cost model, the accounting convention
    and the stop rule they make (keyword-only fields, after the policy's own), and the draft
    controller that learns with the cost model (`treespec.pricing.control`)."""

    uses_cost_model: ClassVar[bool] = True

    cost_model: CostModel | None = attrs.field(default=None, validator=check_cost_model, kw_only=True)  # C_d, C_v
    convention: Literal["treespec", "published"] = attrs.field(default="treespec", validator=check_convention,
                                                               kw_only=True)  # tree-size accounting (above)
    calibration: Calibration = attrs.field(default=Calibration(), converter=to_calibration,
                                           kw_only=True)  # the drafter's (κ, β)

    def draft_controller(self) -> DraftController:
        """Whether and at what price each round drafts: a `PricedController` learning with this policy's
        cost model and calibration (the published convention drafts every round)."""
        return PricedController(self.require_cost_model(), self.calibration, self.budget,
                                versus_ar=self.convention == "treespec")

    def priced(self, price: CostModel | None, calibration: Calibration | None):
        """This policy building at ``price`` and ``calibration`` (frozen; None keeps its own)."""
        changes = {k: v for k, v in (("cost_model", price), ("calibration", calibration)) if v is not None}
        return attrs.evolve(self, **changes) if changes else self

    def require_cost_model(self) -> CostModel:
        """The cost model, or a ValueError saying where one comes from (before any work is done)."""
        return require_cost_model(self.name, self.cost_model)

    @property
    def stop(self) -> CostAwareStop:
        return CostAwareStop(self.require_cost_model(), self.convention, self.calibration)


def require_cost_model(name: str, cost_model: CostModel | None) -> CostModel:
    """``cost_model``, or a ValueError telling the policy ``name`` where to get one."""
    if cost_model is None:
        raise ValueError(f"{name} needs the cost model of this machine: pass cost_model= (measured by "
                         "treespec.pricing.profile.machine_profile or `treespec profile-cost`)")
    return cost_model
