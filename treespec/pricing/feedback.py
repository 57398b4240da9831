"""How what a policy prices with learns from the rounds it prices.

Contract
--------
A policy that prices its trees with a cost model and a calibration implements the two round hooks
of `treespec.interfaces.TreePolicy` by returning `plan_round(cost_model, calibration)` and
`observe_round(cost_model, calibration, report)`:

* a live cost model (`treespec.pricing.live_cost.LiveCost`) decides before the round whether it
  explores (it then prices a verify as an AR step, so the full tree is built and measured) or
  measures an AR step, and after it learns the round's verify seconds for its tree size and cached
  context and, for a drafted round, its draft + build seconds; it says when the machine changed speed.
  It learns only from a round whose tree was verified alone (``report.batch_rows == 1``): a batched
  round's times are the batch's, not its tree's (the decoders ask such a policy's plan only then too);
* a live calibration (`treespec.pricing.calibration.LiveCalibration`) learns from a drafted round's
  verified tree which nodes the target accepted (`node_outcomes`);
* fixed models learn nothing.
"""

from __future__ import annotations

from treespec.interfaces import RoundPlan, RoundReport
from treespec.pricing.calibration import LiveCalibration, node_outcomes
from treespec.pricing.live_cost import LiveCost

__all__ = ["drafting_pays", "observe_round", "plan_round"]


def plan_round(cost_model, calibration=None) -> RoundPlan:
    """The plan a policy pricing with ``cost_model`` and ``calibration`` gives the next round."""
    live = cost_model if isinstance(cost_model, LiveCost) else None
    explore = live is not None and live.begin_round()
    return RoundPlan(explore=explore, ar_step=live is not None and live.wants_ar_step,
                     priced_with=live.priced() if live is not None else cost_model,
                     calibrated_with=calibration.current if isinstance(calibration, LiveCalibration) else None)


def observe_round(cost_model, calibration, report: RoundReport) -> bool:
    """Feed ``report`` to the live models among ``cost_model`` and ``calibration``; True when the cost
    model judged that the machine changed speed."""
    changed = False
    if isinstance(cost_model, LiveCost) and report.batch_rows == 1:
        changed = cost_model.observe(len(report.tree), report.context, report.times["verify"],
                                     report.drafting_seconds, len(report.result.accepted))
    if isinstance(calibration, LiveCalibration) and report.drafted:
        calibration.observe(*node_outcomes(report.tree, report.result))
    return changed


def drafting_pays(cost_model) -> bool:
    """Whether a generation priced by ``cost_model`` should draft: not when its live model measured that
    the drafted rounds of late delivered tokens slower than AR steps (`LiveCost.drafting_verdict`; each
    such answer counts a generation toward measuring again); True otherwise (nothing measured yet, or a
    fixed model)."""
    if not isinstance(cost_model, LiveCost) or cost_model.drafting_verdict() is not False:
        return True
    cost_model.skip_generation()
    return False
