"""The draft controller of a priced policy: draft where trees pay, decode as AR where none does.

Contract
--------
`PricedController(cost, calibration, budget)` decides each round of a policy that prices its trees
(CaDDTree, the cost-aware DominoTree, the hardware-aware Sequoia); this docstring is the one statement
of its rule.  Rounds verified alone teach the policy's `LiveCost` their seconds; drafted rounds teach
a `LiveCalibration` their nodes.  Seconds reach the rule through the curve's prices only, so a live
run and a replay of its reports decide alike.

*Yield*: drafting pays when Y = sum_i t_i C_v(1; c_i) / sum_i (C_d + C_v(n_i; c_i)) > 1 over the
drafted rounds of the last ``forget_after`` (t tokens, n tree tokens, c context), with bounds Y -+ z s
(s: the ratio estimator's error, at least Y ``min_spread`` / sqrt(m), and the curve's own
`LiveCost.price_spread`).  Before any drafted round Y is the best case B = max_n (min(n, L) + 1)
C_v(1) / (C_d + C_v(n + 1)), L the drafter's reach (`Drafter.reach`, told through ``bind``).

*Rule*, before each round: (1) B <= 1: nothing drafts, no generation reads taps.  (2) One option
leads, trees at first; trees stop leading when Y's upper bound falls below 1, AR when the lower bound
rises above 1 (judged from two drafted rounds on).  (3) An exploration measures what the leader
would not -- a full-budget tree (`LiveCost.flat_curve`; at the live price where no full tree within
the drafter's reach could pay) while AR leads and Y's upper bound exceeds 1; an AR step while trees
lead and fewer than ``ar_rounds`` steps were seen; a flat tree every ``size_every`` drafted rounds --
taken only while the exploring rounds' losses (seconds less the leader's for their tokens, taps
kept for them included, `tap_cost`) stay within ``explore_share`` of all rounds' seconds.  (4) A
generation reads taps while trees lead or an exploration is due at its start; once AR leads it drops
them and decodes as AR: the round protocol (`treespec.steering`) asks no more, and those rounds are
counted at the step's price, one in ``quiet_every`` teaching the live model.

Guarantees (tests/test_control.py, on recorded rounds and curves): explorations lose at most
``explore_share`` of the seconds plus one round; where B <= 1 nothing drafts; on a stable machine the
better option wins once the bounds exclude 1; after a change of speed the prices follow within the
live model's ``drift_rounds``.  Batched rounds (``batch_rows > 1``) teach only the calibration.  The
published convention (``versus_ar=False``) drafts every round at the live price.
"""

from __future__ import annotations

import math
from collections import deque

import attrs

from treespec.interfaces import Decision, DraftController, RoundReport
from treespec.pricing.calibration import LiveCalibration, node_outcomes
from treespec.pricing.cost import CostModel
from treespec.pricing.live_cost import LiveCost

__all__ = ["ControlSettings", "PricedController", "best_case_yield"]


@attrs.frozen
class ControlSettings:
    """How the priced controller weighs and explores (module docstring)."""

    # the least relative spread of one round's yield (a tree's tokens vary from round to round)
    min_spread: float = attrs.field(default=0.3, validator=attrs.validators.ge(0))
    # width of the confidence bound, in standard errors
    z: float = attrs.field(default=2.0, validator=attrs.validators.ge(0))
    # most of the observed seconds that exploring rounds may lose
    explore_share: float = attrs.field(default=0.02, validator=attrs.validators.ge(0))
    # one-token steps observed before the yields are trusted without an AR exploration
    ar_rounds: int = attrs.field(default=2, validator=attrs.validators.ge(0))
    # drafted rounds between flat-priced trees while trees lead (0: never)
    size_every: int = attrs.field(default=32, validator=attrs.validators.ge(0))
    # rounds after which a drafted round no longer counts in Y (acceptance drifts with the prompts)
    forget_after: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    # while a generation decodes as AR without taps, one round in this many teaches the live model its step
    # (the others are counted at the curve's price: a generation that does not draft pays almost nothing)
    quiet_every: int = attrs.field(default=16, validator=attrs.validators.ge(1))


@attrs.frozen
class _Round:
    """One drafted round as Y keeps it."""

    index: int  # the round's number among every round observed
    tokens: int  # tokens committed
    size: int  # tree tokens verified, root included
    context: int  # tokens cached under the tree


def best_case_yield(cost: CostModel, budget: int, ctx: int, reach: int | None = None) -> float:
    """B: the best yield a tree of at most ``budget`` nodes can have at context ``ctx`` under ``cost``, as many
    of its nodes accepted as the drafter's ``reach`` allows (None: every one): max over n of
    (min(n, reach) + 1) C_v(1) / (C_d + C_v(n + 1)) (the tokens of one round over its price)."""
    step = cost.verify_seconds(1, ctx)
    reach = budget if reach is None else reach
    return max((min(n, reach) + 1) * step / (cost.draft_cost + cost.verify_seconds(n + 1, ctx))
               for n in range(1, budget + 1))


def _seconds(curve: CostModel, size: int, ctx: int, drafted: bool) -> float:
    """Seconds ``curve`` prices a round of ``size`` tree tokens at ``ctx`` at: C_d if it drafted, plus C_v."""
    return (curve.draft_cost if drafted else 0.0) + curve.verify_seconds(size, ctx)


class PricedController(DraftController):
    """Draft where trees pay, AR where none does, exploring within a stated share (module docstring)."""

    def __init__(self, cost: CostModel, calibration=None, budget: int = 16, *, versus_ar: bool = True,
                 settings: ControlSettings | None = None) -> None:
        if budget < 1:
            raise ValueError(f"a priced controller needs a budget of at least one node, got {budget}")
        self.cost, self.calibration, self.budget, self.versus_ar = cost, calibration, budget, versus_ar
        self.settings = settings or ControlSettings()
        self.live = cost if isinstance(cost, LiveCost) else None
        self._kept: deque[_Round] = deque()  # the drafted rounds Y is made of
        self._terms: deque[tuple[float, float]] = deque()  # theirs at `_priced_by`: (t C_v(1), C_d + C_v(n))
        self._priced_by: CostModel | None = None
        self._best: tuple[object, int, float] | None = None  # (curve, context, B) last computed
        self._trees_lead = versus_ar  # which option leads (rule 2)
        self._rounds = 0  # rounds observed (alone)
        self._seconds = 0.0  # their seconds
        self._lost = 0.0  # what the exploring rounds among them lost against the leader
        self._since_flat = 0  # drafted rounds since the last flat-priced one
        contexts = getattr(cost, "contexts", None)
        self._context = contexts[0] if contexts else 0  # the last round's context (where the next one is priced)
        self._asked = False  # decide() was called since the last observe (else the round was a generation's without taps)
        self._yield: tuple[tuple, tuple[float, float, float]] | None = None  # (what it rests on, `trees_yield`)
        self._generation_rounds = [0, 0]  # rounds of the generation under way, and of the last one
        self.reach: int | None = None  # the depth the drafter's drafts reach (`bind`; None: unknown)
        self._quiet_rounds = 0  # rounds of generations without taps (`_quiet`)
        self._step_price: tuple[int, object, float] | None = None  # (context span, curve, its step) last priced

    # ------------------------------------------------------------------ estimates
    def _curve(self) -> CostModel:
        """The curve prices are read from now (the live model's current fit, or the fixed model)."""
        return self.live.snapshot() if self.live is not None else self.cost

    def _step(self, ctx: int) -> float:
        """The curve's one-token step at ``ctx`` (seconds of an AR round)."""
        return self.cost.verify_seconds(1, ctx)

    def bind(self, reach: int | None) -> None:
        self.reach, self._best = reach, None

    def best_case(self) -> float:
        """B near the last round's context under the current curve (module docstring): computed at the
        start of its 64-token span of contexts, once per curve."""
        curve, span = self._curve(), self._context - self._context % 64
        if self._best is None or self._best[0] is not curve or self._best[1] != span:
            self._best = (curve, span, best_case_yield(curve, self.budget, span, self.reach))
        return self._best[2]

    def _terms_now(self) -> deque[tuple[float, float]]:
        """Every kept round's terms at the current curve (re-priced when the curve changed)."""
        curve = self._curve()
        if self._priced_by is not curve:
            self._terms = deque(self._price(r, curve) for r in self._kept)
            self._priced_by = curve
        return self._terms

    @staticmethod
    def _price(r: _Round, curve: CostModel) -> tuple[float, float]:
        return r.tokens * curve.verify_seconds(1, r.context), _seconds(curve, r.size, r.context, True)

    def trees_yield(self) -> tuple[float, float, float]:
        """(Y, its lower bound, its upper bound) (module docstring); computed once per round observed."""
        resting_on = (self._curve(), self.settings, self._rounds)  # the live model observes in `observe` only
        if self._yield is None or any(a is not b for a, b in zip(self._yield[0][:2], resting_on[:2], strict=True)) \
                or self._yield[0][2] != resting_on[2]:
            self._yield = (resting_on, self._compute_yield())
        return self._yield[1]

    def _compute_yield(self) -> tuple[float, float, float]:
        terms, s = self._terms_now(), self.settings
        m = len(terms)
        if m == 0:
            best = self.best_case()
            return best, 0.0, best
        gained = [t[0] for t in terms]  # AR's seconds for the rounds' tokens
        prices = [t[1] for t in terms]
        y = sum(gained) / sum(prices)
        se = y * s.min_spread / math.sqrt(m)
        if m >= 2:  # the ratio estimator's standard error
            residual = sum((g - y * p) ** 2 for g, p in zip(gained, prices, strict=True)) / (m - 1)
            se = max(se, math.sqrt(residual / m) / (sum(prices) / m))
        if self.live is not None:  # and the prices' own: a few rounds of a noisy machine say little
            se = math.hypot(se, y * self.live.price_spread())
        return y, y - s.z * se, y + s.z * se

    @property
    def trees_lead(self) -> bool:
        """Whether drafting is the leading option (rule 2)."""
        return self._trees_lead

    def _judge(self) -> None:
        """Rule 2: the leader changes on confident evidence only."""
        if self.best_case() <= 1.0:
            self._trees_lead = False
            return
        if len(self._kept) < 2:
            return  # one round is no evidence
        if self.live is not None and self.live.step_unmeasured:
            return  # the AR step is only scaled from the trees' change of regime: the next round measures it
        _, lo, hi = self.trees_yield()
        if self._trees_lead and hi < 1.0:
            self._trees_lead = False
        elif not self._trees_lead and lo > 1.0:
            self._trees_lead = True

    # ------------------------------------------------------------------ the decoder's side
    def start_generation(self) -> bool:
        self._generation_rounds = [0, self._generation_rounds[0] or self._generation_rounds[1]]
        return not self.versus_ar or self._may_draft()

    def tap_cost(self) -> float:
        """Seconds an AR round pays for the drafter's taps (an engine computes them for the whole generation
        once its prefill asked for them), as the live model measured them (`LiveCost.tap_share`; 0 with a
        fixed model or until measured)."""
        return 0.0 if self.live is None else self.live.tap_share() * self._step(self._context)

    def _may_draft(self) -> bool:
        """Whether this generation may draft: trees lead, or an exploration of them is due (B > 1)."""
        if self.best_case() <= 1.0:
            return False
        return self._trees_lead or self._tree_exploration_due()

    def _tree_exploration_due(self) -> bool:
        """While AR leads: whether trees may still win (Y's upper bound above 1, or their prices only scaled
        from the AR step's change) and a flat-priced tree fits the share now."""
        unmeasured = self.live is not None and self.live.trees_unmeasured
        taps = self.tap_cost() * self._generation_rounds[1]  # the taps of a generation as long as the last
        return (self.trees_yield()[2] > 1.0 or unmeasured) and self._affordable(self._flat_loss(1.0) + taps)

    def decide(self) -> Decision:
        self._asked = True
        if not self.versus_ar:
            return self._tree(explore=False)
        if self.best_case() <= 1.0:
            return self._ar(taps=False)
        if self._trees_lead:
            return self._while_trees_lead(max(self.trees_yield()[0], 1.0))
        if self.live is not None and self.live.step_unmeasured:
            return self._ar(taps=True)  # the AR step was scaled from the trees' change: this round measures it
        if self._tree_exploration_due():
            return self._tree(explore=True, flat=self._flat_may_pay())
        return self._ar(taps=False)  # the generation drafts no more: the next one may explore

    def _while_trees_lead(self, y: float) -> Decision:
        s = self.settings
        live = self.live
        if live is not None and live.step_unmeasured:  # Y is priced in a step scaled from the trees' change
            return self._ar(taps=True, explore=True)
        unseen = live is not None and live.support().get(1, 0) < s.ar_rounds
        if unseen and self._affordable(self._step(self._context) * (1.0 - 1.0 / y)):
            return self._ar(taps=True, explore=True)
        due = s.size_every and self._since_flat >= s.size_every
        if (due or (live is not None and live.trees_unmeasured)) and self._flat_may_pay() \
                and self._affordable(self._flat_loss(y)):
            return self._tree(explore=True, flat=True)
        return self._tree(explore=False)

    def _flat_may_pay(self) -> bool:
        """Whether a tree of the whole budget could pay at the current curve with as many of its nodes accepted
        as the drafter reaches (else an exploration is built at the live price: a full tree would measure a
        size no accepted path can pay for)."""
        curve, ctx = self._curve(), self._context
        tokens = min(self.budget, self.reach if self.reach is not None else self.budget) + 1
        return tokens * curve.verify_seconds(1, ctx) > _seconds(curve, self.budget + 1, ctx, True)

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
        return Decision(draft=False, taps=taps, explore=explore)

    def observe_round(self, report: RoundReport) -> None:
        asked, self._asked = self._asked, False
        if not asked and not report.drafted and report.batch_rows == 1 and self._quiet(report):
            return  # a round the round protocol decided without asking: its generation reads no taps
        if isinstance(self.calibration, LiveCalibration) and report.drafted:
            self.calibration.observe(*node_outcomes(report.tree, report.result))
        if report.batch_rows != 1:
            return  # a batch's round: its seconds are the batch's, its tree's share unknown
        size, ctx, tau = len(report.tree), report.context, report.result.tau
        seconds = _seconds(self.cost, size, ctx, report.drafted)  # what the round cost, as the curve prices it
        self._context = ctx
        self._generation_rounds[0] += 1
        verify = report.times.get("verify", 0.0)
        if size == 1 and not report.drafted and report.tapped and not self._trees_lead:
            self._lost += self.tap_cost()  # taps kept for an exploration: part of what it costs
        if report.explored:  # what the leading option would have taken for the round's tokens
            lead = max(self.trees_yield()[0], 1.0) if self._trees_lead else 1.0
            self._lost += seconds - tau * self._step(ctx) / lead
        index = self._rounds
        self._rounds += 1
        self._seconds += seconds
        if report.drafted:
            self._since_flat = 0 if report.explored else self._since_flat + 1
            self._keep(_Round(index, tau, size, ctx))
        while self._kept and self._kept[0].index <= index - self.settings.forget_after:
            self._kept.popleft()
            if self._priced_by is not None:
                self._terms.popleft()
        if self.live is not None and verify > 0:  # a replayed round has no times: the curve learns nothing
            self.live.observe(size, ctx, verify, report.drafting_seconds, report.explored, tapped=report.tapped)
        if self.versus_ar:
            self._judge()

    def _quiet(self, report: RoundReport) -> bool:
        """A round of a generation that reads no taps: counted at the curve's step price alone, but for one in
        ``quiet_every``, which the live model learns the step from (True: nothing more to do)."""
        self._quiet_rounds += 1
        if self._quiet_rounds % self.settings.quiet_every == 0:
            return False
        ctx = report.context
        if self._step_price is None or self._step_price[0] != ctx - ctx % 64 or self._step_price[1] is not self.cost:
            self._step_price = (ctx - ctx % 64, self.cost, self._step(ctx - ctx % 64))
        self._context = ctx
        self._generation_rounds[0] += 1
        self._rounds += 1
        self._seconds += self._step_price[2]
        return True

    def _keep(self, r: _Round) -> None:
        self._kept.append(r)
        if self._priced_by is not None:
            self._terms.append(self._price(r, self._priced_by))
