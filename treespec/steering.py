"""The round protocol: one generation's conversation with its draft controller, written once.

Contract
--------
`Steering(controller, policy)` is what every decoding path asks before and tells after each round of
one generation (``policy`` None: a simulation that builds no trees): the live decoder (each row of a batch has its own), trace replay
(`treespec.apps.replay.evaluate`) and the controller simulator (`treespec.apps.replay.simulate`).

* ``start()``: the controller's ``start_generation``: whether this generation may draft (read the
  drafter's taps); when it may, the policy hears ``begin_generation``.
* ``decide()``: the round's `Decision`: `AR_ROUND` once the generation reads no taps (the controller
  is asked no more this generation), else the controller's, and the policy hears ``begin_round``.
* ``report(report)``: the round's `RoundReport` to the controller's ``observe`` and, for a drafting
  generation, the policy's ``observe_round``.

``tapping`` is the one record of whether the generation still reads taps.  The rule the controller
decides by is its own (treespec/pricing/control.py for the priced one).
"""

from __future__ import annotations

from treespec.interfaces import Decision, DraftController, RoundReport, TreePolicy

__all__ = ["AR_ROUND", "Steering"]

AR_ROUND = Decision(draft=False, taps=False)  # a round that runs the target's one-token step, no taps


class Steering:
    """One generation's side of the round protocol (module docstring)."""

    def __init__(self, controller: DraftController, policy: TreePolicy | None = None) -> None:
        self.controller, self.policy = controller, policy
        self.tapping = False  # the generation reads the drafter's taps (False: it drafts no more)

    def start(self) -> bool:
        """A generation starts: whether it may draft."""
        self.tapping = bool(self.controller.start_generation())
        if self.tapping and self.policy is not None:
            self.policy.begin_generation()
        return self.tapping

    def decide(self) -> Decision:
        """This round's `Decision` (module docstring)."""
        if not self.tapping:
            return AR_ROUND
        decision = self.controller.decide()
        self.tapping = decision.taps
        if self.policy is not None:
            self.policy.begin_round()
        return decision

    def report(self, report: RoundReport) -> None:
        """The round as verified, to the controller and (a drafting generation's) policy."""
        self.controller.observe_round(report)
        if report.tapped and self.policy is not None:
            self.policy.observe_round(report)
