"""How the apps price cost-aware policies: one rule for bench, demo, generate, draw and example.

Contract
--------
`CostSource.parse(text)` reads ``--cost-model``: ``live`` (the default): this machine's profile
(`treespec.pricing.profile`), corrected while decoding by a `treespec.pricing.live_cost.LiveCost` of the policy's
own, and the drafter's calibration by confidence, re-fitted while decoding by a
`treespec.pricing.calibration.LiveCalibration` from the profile's; ``profile``: the profile and its
calibration as measured, fixed; a JSON file or ``preset:NAME``: that model, fixed, uncalibrated.
``source.price(profile_pricing)`` turns the (cost model, calibration) of the profile into what one
policy gets: each call gives a new `LiveCost` and `LiveCalibration`, so policies never share one.
`method_policy` builds a method's policy and prices it when its policy declares ``uses_cost_model``
(the one place an app does both).  `persist_live` writes what the live cost models learned back
into this machine's profile cache (`CostProfile.with_live`, under the profile's own key), so the
next run starts from the corrected curve, unless the curve is implausible against the measured
profile or the caller's run was disturbed by another process (the caller does not ask then); a live calibration is not written back (it learns from
the prompts of one run, and re-learns in a few hundred nodes; the profile keeps the calibration
fitted on its own prompts).  Fixed-size policies are never priced (they do not declare
``uses_cost_model``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from treespec.apps.assembly.methods import MethodSpec, build_policy
from treespec.interfaces import Drafter, TreePolicy
from treespec.pricing.calibration import Calibration, LiveCalibration
from treespec.pricing.cost import CostModel, resolve_cost_model
from treespec.pricing.live_cost import LiveCost, LiveSettings

__all__ = ["CostSource", "method_policy", "persist_live", "restore_learned"]


@attrs.frozen
class CostSource:
    """Where a cost-aware policy's cost model comes from (module docstring)."""

    live: bool = True  # correct the model with the round times measured while decoding
    fixed: CostModel | None = None  # a given model (file or preset) instead of this machine's profile
    spec: str = "live"  # the --cost-model text it was parsed from (records name it)
    settings: LiveSettings = LiveSettings()  # the live estimator's windows, re-fits and exploration

    @classmethod
    def parse(cls, text: str | None) -> CostSource:
        """``live`` (None too), ``profile``, or a cost model file / ``preset:NAME`` (fixed)."""
        if text is None or text == "live":
            return cls()
        if text == "profile":
            return cls(live=False, spec=text)
        return cls(live=False, fixed=resolve_cost_model(text), spec=text)

    @property
    def uses_profile(self) -> bool:
        """Whether pricing needs this machine's measured profile."""
        return self.fixed is None

    def price(self, profile_pricing: Callable[[], tuple[CostModel, Calibration]]
              ) -> tuple[CostModel, Calibration | LiveCalibration]:
        """(cost model, calibration) for one policy; ``profile_pricing`` gives the profile's."""
        cost, calibration = (self.fixed, Calibration()) if self.fixed is not None else profile_pricing()
        if not self.live:
            return cost, calibration
        return LiveCost(cost, self.settings), LiveCalibration(calibration)

    def describe(self) -> str:
        return {"live": "this machine's profile, corrected live", "profile": "this machine's profile"}.get(
            self.spec, self.spec)


def method_policy(method: MethodSpec, drafter: Drafter | None, costs: CostSource,
                  profile: Callable[[], object]) -> tuple[TreePolicy | None, CostModel | None]:
    """(policy, the cost model it prices with) of ``method`` over ``drafter``: (None, None) for AR; a
    fixed-size policy as built (no cost model); a cost-aware one priced as ``costs`` says, with
    ``profile()`` (this machine's `treespec.pricing.profile.CostProfile`) asked only when pricing needs it."""
    if method.autoregressive:
        return None, None
    if not method.cost_aware or "cost_model" in method.options:  # fixed-size, or given its model
        return build_policy(method), None
    cost, calibration = costs.price(lambda: profile().pricing(drafter))
    return build_policy(method, cost, calibration), cost


def restore_learned(policy: TreePolicy | None, drafter: Drafter | None, profile: Callable[[], object]) -> bool:
    """Start a learning policy (``TreePolicy.learns``) from what it learned over ``drafter`` on the
    calibration prompts, kept in this machine's profile by `treespec profile-cost --calibrate`
    (``profile()`` is asked only for such a policy); True when a state was restored."""
    if policy is None or drafter is None or not policy.learns:
        return False
    state = profile().learned_state(policy.name, drafter)
    if state is None:
        return False
    policy.restore_learned(state)
    return True


def persist_live(target, profile, priced: Sequence[tuple[CostModel, Drafter | None]], *, sizes=None,
                 contexts=None) -> tuple[object | None, str]:
    """Write what the live models among ``priced`` ((cost model, drafter) per priced policy) learned into
    the machine's profile cache; returns (the updated profile, "") or (None, why nothing was written):
    no live model observed a round, the profile itself was measured under another process's load, or
    the learned curve breaks the plausibility rules, its own or against the measured profile
    (`treespec.pricing.profile.implausible`).  The verify curve is the one of the live model that
    observed the most tree rounds; each drafter's draft + build cost is its own policy's."""
    from treespec.pricing.profile import PROFILE_CONTEXTS, PROFILE_SIZES, implausible, save_profile

    lives = [(c, d) for c, d in priced if isinstance(c, LiveCost) and c.observations]
    if not lives:
        return None, "no live cost model observed a round"
    if profile.disturbed:
        return None, f"the profile it corrects was measured while {profile.disturbed}"
    trees = lambda live: sum(n for k, n in live.support().items() if k > 1)  # noqa: E731
    best = max(lives, key=lambda item: (trees(item[0]), len(item[0].observations)))[0]
    updated = profile.with_live(best)
    for live, drafter in lives:
        if drafter is not None:
            updated = updated.with_live_draft(live, drafter)
    broken = implausible(updated)
    if broken is not None:
        return None, f"the learned curve is implausible: {broken}"
    save_profile(target, updated, sizes=sizes or PROFILE_SIZES, contexts=contexts or PROFILE_CONTEXTS)
    return updated, ""
