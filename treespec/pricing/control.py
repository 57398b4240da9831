"""The draft controller of a priced policy: draft where trees pay, decode as AR where none does.

Contract
--------
`PricedController(cost, calibration, budget)` is a `treespec.control.DraftController` for a policy
that prices its trees (CaDDTree, the cost-aware DominoTree, the hardware-aware Sequoia).  It is the
one place that decides whether a round drafts and at what price its tree is built; it learns with
the policy's cost model (a `treespec.pricing.live_cost.LiveCost` learns the machine's curve from the
rounds it is given here) and calibration (a `LiveCalibration` learns from the drafted rounds' nodes).
A fixed cost model learns nothing, and the rule below still measures what the rounds yield.

**What it compares.**  Two options: AR steps, and drafting a tree priced by the current curve
(the policy's cost rule then picks the tree's size).  A round is measured in the AR steps of its
moment: its *yield* is y = (tokens committed) x (the curve's one-token step at its context) /
(its seconds, every stage counted), so AR's yield is 1 by construction, and trees pay when the
drafted rounds' yield Y = sum(tokens x step) / sum(seconds) over the last ``window`` drafted rounds
exceeds 1.  Its confidence bound is Y (1 +- z s), s the ratio estimator's relative standard error
over those rounds.  Before ``min_rounds`` drafted rounds have been measured, Y is the best case
B = max over n <= budget of (n + 1) C_v(1) / (C_d + C_v(n + 1)): every node accepted.

**The rule**, before each round:

1. B <= 1 (even a tree whose every node is accepted cannot pay: a compute-bound engine): no round
   drafts, no generation reads taps.
2. Trees *lead* while Y > 1 (B for a tree never measured: optimism at the start, at most
   ``min_rounds`` drafted rounds).  The leader runs every round unless an exploration is due.
3. An *exploration* measures the other option: a tree priced flat (`LiveCost.flat_curve`: the full
   budget, which also measures the curve's large end) while AR leads and Y's upper bound is above 1;
   an AR step while trees lead and the one-token step has fewer than ``ar_rounds`` observations
   (the yields are only as good as the step they are measured in); a flat-priced tree every
   ``size_every`` drafted rounds while trees lead (the curve's large end, where the policy's own
   trees may never reach).  Each exploration is taken only when the exploring rounds' losses so far
   plus its predicted loss stay within ``explore_share`` of the seconds of every round observed.  A
   round's *loss* is its seconds less what the leading option would have taken for its tokens
   (negative for an exploration that pays); an exploring tree's loss is predicted with one token.
4. Taps: a generation reads the drafter's taps when trees lead or Y's upper bound is above 1 (a
   later round may still draft); otherwise it is plain AR decoding.  A round that leaves trees
   behind for good this generation drops them.
5. Forgetting: a drafted round older than ``forget_after`` rounds leaves the window, so a machine
   where trees lost long ago explores them again (under the share of 3); a change of regime found
   by the live cost model re-expresses the rounds since its start in the new regime's step.

**Guarantees** (tested on `treespec.pricing.simulate`'s recorded rounds and curves, a deterministic
clock): exploring rounds lose at most ``explore_share`` of the seconds observed, plus one round's
misprediction; besides them, at most ``min_rounds`` drafted rounds run before trees are first
judged (and none where B <= 1); on a stable machine, once Y's bound excludes 1 the controller runs
the better option only, so its time converges to that option's; after a change of the machine's
speed it decides on the new speed within the live model's ``drift_rounds`` plus ``min_rounds``
rounds of the option it favours.  Everything is deterministic in the rounds observed.

Rounds verified in a batch (``report.batch_rows > 1``) teach it nothing about time (their seconds
are the batch's); their nodes still teach a live calibration.  The published convention never
compares with AR (``versus_ar=False``): every round drafts at the live price.
"""

from __future__ import annotations

import math
from collections import deque

import attrs

from treespec.control import Decision, DraftController
from treespec.interfaces import RoundReport
from treespec.pricing.calibration import LiveCalibration, node_outcomes
from treespec.pricing.cost import CostModel
from treespec.pricing.live_cost import LiveCost

__all__ = ["ControlSettings", "PricedController", "best_case_yield"]


@attrs.frozen
class ControlSettings:
    """How the priced controller weighs and explores (module docstring)."""

    # drafted rounds whose yield makes Y
    window: int = attrs.field(default=32, validator=attrs.validators.ge(2))
    # drafted rounds measured before Y replaces the best case B
    min_rounds: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    # width of the confidence bound, in standard errors
    z: float = attrs.field(default=2.0, validator=attrs.validators.ge(0))
    # most of the observed seconds that exploring rounds may lose
    explore_share: float = attrs.field(default=0.02, validator=attrs.validators.ge(0))
    # one-token steps observed before the yields are trusted without an AR exploration
    ar_rounds: int = attrs.field(default=2, validator=attrs.validators.ge(0))
    # drafted rounds between flat-priced trees while trees lead (0: never)
    size_every: int = attrs.field(default=32, validator=attrs.validators.ge(0))
    # rounds after which a drafted round leaves the window
    forget_after: int = attrs.field(default=512, validator=attrs.validators.ge(1))


@attrs.frozen
class _Yield:
    """One drafted round as the window keeps it."""

    index: int  # the round's number among every round observed
    tokens: int  # tokens committed
    seconds: float  # every stage
    step: float  # the curve's one-token step at the round's context when it was observed
    context: int


def best_case_yield(cost: CostModel, budget: int, ctx: int) -> float:
    """B: the best yield a tree of at most ``budget`` nodes can have at context ``ctx`` under ``cost``, every
    node accepted: max over n of (n + 1) C_v(1) / (C_d + C_v(n + 1)) (n + 1 tokens for one round)."""
    costs = cost.verify_costs(budget + 1, ctx)  # [budget + 2] C_v(n), n = 0..budget + 1
    sizes = range(1, budget + 1)
    return max((n + 1) * float(costs[1]) / (cost.draft_cost + float(costs[n + 1])) for n in sizes)


class PricedController(DraftController):
    """Draft where trees pay, AR where none does, exploring within a stated share (module docstring)."""

    def __init__(self, cost: CostModel, calibration=None, budget: int = 16, *, versus_ar: bool = True,
                 settings: ControlSettings | None = None) -> None:
        if budget < 1:
            raise ValueError(f"a priced controller needs a budget of at least one node, got {budget}")
        self.cost, self.calibration, self.budget, self.versus_ar = cost, calibration, budget, versus_ar
        self.settings = settings or ControlSettings()
        self.live = cost if isinstance(cost, LiveCost) else None
        self._yields: deque[_Yield] = deque(maxlen=self.settings.window)
        self._rounds = 0  # rounds observed (alone)
        self._seconds = 0.0  # their seconds
        self._lost = 0.0  # what the exploring rounds among them lost against the leader
        self._since_flat = 0  # drafted rounds since the last flat-priced one
        self._context = 0  # the last round's context (where the next one is priced)
        self._tapping = True  # this generation reads taps
        self.explorations = 0

    # ------------------------------------------------------------------ estimates
    def _step(self, ctx: int) -> float:
        """The curve's one-token step at ``ctx`` (seconds of an AR round)."""
        return self.cost.verify_seconds(1, ctx)

    def _best_case(self) -> float:
        return best_case_yield(self.cost, self.budget, self._context)

    def trees_yield(self) -> tuple[float, float, float]:
        """(Y, its lower bound, its upper bound); the best case B for all three before ``min_rounds``
        drafted rounds."""
        rounds = list(self._yields)
        if len(rounds) < self.settings.min_rounds:
            best = self._best_case()
            return best, best, best
        gained = [r.tokens * r.step for r in rounds]  # what AR would have taken for the same tokens
        seconds = [r.seconds for r in rounds]
        y = sum(gained) / sum(seconds)
        m = len(rounds)
        residual = sum((g - y * s) ** 2 for g, s in zip(gained, seconds, strict=True)) / (m - 1)
        se = math.sqrt(residual / m) / (sum(seconds) / m)  # ratio estimator: se(Y)
        half = self.settings.z * se
        return y, y - half, y + half

    def trees_lead(self) -> bool:
        return self.trees_yield()[0] > 1.0

    # ------------------------------------------------------------------ the decoder's side
    def start_generation(self) -> bool:
        self._tapping = not self.versus_ar or self._may_draft()
        return self._tapping

    def _may_draft(self) -> bool:
        """Whether trees may still win: they lead, or Y's upper bound is above 1 (and B is)."""
        if self._best_case() <= 1.0:
            return False
        y, _, hi = self.trees_yield()
        return y > 1.0 or hi > 1.0

    def decide(self) -> Decision:
        if not self.versus_ar:
            return self._tree(explore=False)
        if not self._tapping:
            return Decision(draft=False, taps=False)
        if self._best_case() <= 1.0:
            return self._ar(taps=False)
        y, _, hi = self.trees_yield()
        if y > 1.0:
            return self._while_trees_lead(y)
        if hi > 1.0 and self._affordable(self._flat_loss(1.0)):
            return self._tree(explore=True, flat=True)
        return self._ar(taps=hi > 1.0)

    def _while_trees_lead(self, y: float) -> Decision:
        s = self.settings
        ar_seen = self.live.support().get(1, 0) if self.live is not None else s.ar_rounds
        if ar_seen < s.ar_rounds and self._affordable(self._step(self._context) * (1.0 - 1.0 / y)):
            return self._ar(taps=True, explore=True)
        if s.size_every and self._since_flat >= s.size_every and self._affordable(self._flat_loss(y)):
            return self._tree(explore=True, flat=True)
        return self._tree(explore=False)

    def _flat_loss(self, leader_yield: float) -> float:
        """The predicted loss of a flat-priced tree: its seconds less the leader's for one token."""
        step = self._step(self._context)
        seconds = self.cost.draft_cost + self.cost.verify_seconds(self.budget + 1, self._context)
        return seconds - step / leader_yield

    def _affordable(self, loss: float) -> bool:
        """Whether an exploration predicted to lose ``loss`` seconds keeps the losses within the share."""
        return self._lost + loss <= self.settings.explore_share * (self._seconds + max(loss, 0.0))

    def _tree(self, *, explore: bool, flat: bool = False) -> Decision:
        price = self.cost
        if self.live is not None:
            price = self.live.flat_curve() if flat else self.live.snapshot()
        calibration = self.calibration.current if isinstance(self.calibration, LiveCalibration) else None
        return Decision(draft=True, price=price, calibration=calibration, explore=explore)

    def _ar(self, *, taps: bool, explore: bool = False) -> Decision:
        self._tapping = taps
        return Decision(draft=False, taps=taps, explore=explore)

    def observe(self, report: RoundReport) -> None:
        if isinstance(self.calibration, LiveCalibration) and report.drafted:
            self.calibration.observe(*node_outcomes(report.tree, report.result))
        if report.batch_rows != 1 or "verify" not in report.times:
            return  # a batch's seconds, or a replayed round: nothing about this tree's time
        seconds = report.seconds
        if seconds <= 0:
            return
        self._context = report.context
        step = self._step(report.context)
        if report.explored:  # what the leading option would have taken for the round's tokens
            lead = max(self.trees_yield()[0], 1.0) if self.versus_ar else 1.0
            self._lost += seconds - report.result.tau * step / lead
            self.explorations += 1
        index = self._rounds
        self._rounds += 1
        self._seconds += seconds
        if report.drafted:
            self._since_flat = 0 if report.explored else self._since_flat + 1
            self._yields.append(_Yield(index, report.result.tau, seconds, step, report.context))
        while self._yields and self._yields[0].index <= index - self.settings.forget_after:
            self._yields.popleft()
        if self.live is not None and self.live.observe(len(report.tree), report.context, report.times["verify"],
                                                       report.drafting_seconds, report.explored):
            self._rebase(self.live.regime_start)

    def _rebase(self, start: int) -> None:
        """A change of regime began at the live model's observation ``start``: the drafted rounds since are
        measured in the new regime's step."""
        first = self._rounds - (len(self.live.observations) - start)  # our index of that observation
        rebased = [attrs.evolve(r, step=self._step(r.context)) if r.index >= first else r for r in self._yields]
        self._yields.clear()
        self._yields.extend(rebased)
