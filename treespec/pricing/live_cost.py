"""A cost model that learns the machine while it decodes: the profile corrected by live round times.

Contract
--------
`LiveCost(prior)` is a `treespec.pricing.cost.CostModel` (C_d, C_v(n; ctx)) that prices like ``prior``
(the machine's profile) until it is told what rounds cost: after every round a single sequence's
forward verified alone, the draft controller that learns with it (treespec/pricing/control.py)
calls ``observe(n, ctx, verify, draft, explored)`` with the verify seconds of the round's n tree
tokens on ctx cached tokens and, for a drafted round, its draft and build seconds.  Nothing else
writes to it; everything it computes is deterministic in the observations, so a recorded run can
be priced again.

The rules (docs/decoding.md, "Live cost model", has the reasons and the measurements behind them):

* **Buckets**: the prior's profiled sizes; an observed n goes to the nearest in log n.  The one-token
  step (n = 1, another kernel) is a kind of its own, trees (n >= 2) the other.
* **Per bucket** a correction: the `trimmed_mean` of seconds / prior over its last ``window``
  observations, pooled with its kind's (``pool_weight`` rounds' worth); a bucket never observed takes
  its kind's, trees with none observed take the one-token step's, else 1.
* **The curve**, per profiled context: each knot's prior value and corrected value, weighted by a
  pseudo-count of the prior and the bucket's observations, fitted by `fit_verify_curve` as the
  profile is; C_d the trimmed mean of draft + build seconds, weighted alike.
* **Re-fit** every ``refit_every`` observations, and at once on a change of regime: ``drift_rounds``
  rounds of a kind in a row beyond the `ordinary` range of the earlier ones (second smallest to second
  largest log(measured / predicted)) by more than ``drift`` on the same side, or an exploring round
  (one the controller priced flat, `flat_curve`, to measure large trees) faster than the trees'
  ordinary range by more than 2 ``drift``.  A change empties that kind's windows and scales the
  other kind's corrections by the same factor; the next round of the other kind replaces them only
  if it lies outside that kind's ordinary spread around them.  ``observe`` returns True then.

`snapshot()` is the current curve as a frozen `ConvexCost`; `flat_curve()` the curve that prices
every tree at the current one-token step (what an exploring round builds at: the full budget);
`support()` says how many observations each knot rests on.  `LiveCost.restore(prior, observations)`
rebuilds the model a run ended with.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence

import attrs
import torch

from treespec.pricing.cost import ConvexCost, CostModel, fit_verify_curve

__all__ = ["LiveCost", "LiveSettings", "Observation", "ordinary", "shifted", "trimmed_mean"]


@attrs.frozen
class LiveSettings:
    """How the live estimator weighs and re-fits (module docstring)."""

    # observations kept per bucket
    window: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    # the prior's pseudo-count
    prior_weight: int = attrs.field(default=2, validator=attrs.validators.ge(0))
    # observations between re-fits
    refit_every: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    # log(measured / predicted) beyond a kind's ordinary range that makes a new regime
    drift: float = attrs.field(default=0.2, validator=attrs.validators.gt(0))
    # rounds of a kind in a row that must all lie beyond that range
    drift_rounds: int = attrs.field(default=5, validator=attrs.validators.ge(1))
    # rounds' worth of the kind's pooled correction in each tree size's own (0: none)
    pool_weight: float = attrs.field(default=4.0, validator=attrs.validators.ge(0))


@attrs.frozen
class Observation:
    """One round as the loop measured it."""

    n: int  # tree tokens verified, root included
    ctx: int  # cached context tokens under the tree
    verify: float  # seconds of the verify stage
    draft: float | None = None  # seconds of the draft and build stages (None: an AR round, nothing drafted)
    explored: bool = False  # the round was priced flat to measure large trees (`LiveCost.flat_curve`)

    def to_list(self) -> list:
        return [self.n, self.ctx, self.verify, self.draft, self.explored]

    @classmethod
    def from_list(cls, row: Sequence) -> Observation:
        n, ctx, verify, draft, explored = row
        return cls(int(n), int(ctx), float(verify), None if draft is None else float(draft), bool(explored))


def _grid(prior: CostModel) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(contexts, knots) the live curve is kept on: the prior's own when it is a profiled curve."""
    if isinstance(prior, ConvexCost):
        return prior.contexts, tuple(sorted({k for ks in prior.knots for k in ks}))
    return (128, 512), (1.0, 2.0, 3.0, 5.0, 9.0, 17.0, 33.0)


class LiveCost(CostModel):
    """The prior cost model corrected by observed rounds (module docstring)."""

    def __init__(self, prior: CostModel, settings: LiveSettings | None = None) -> None:
        if isinstance(prior, LiveCost):
            prior = prior.snapshot()
        self.prior = prior
        self.settings = settings or LiveSettings()
        self.contexts, self.knots = _grid(prior)
        # (observation index, value) windows: verify ratios per knot, draft + build seconds
        self._ratios: list[deque[tuple[int, float]]] = [deque(maxlen=self.settings.window) for _ in self.knots]
        self._counts = [0] * len(self.knots)  # observations ever made per knot
        self._draft_count = 0  # drafted rounds ever observed
        self._drafts: deque[tuple[int, float]] = deque(maxlen=self.settings.window)
        # per kind (0: the one-token step, 1: trees): (n, ctx, log(measured / predicted by the current
        # curve)) of the last rounds, and whether the kind has changed regime (its prior then no longer counts)
        self._baseline = max(self.settings.drift_rounds, self.settings.window // 2)  # earlier errors a drift needs
        self._errors = [deque(maxlen=self._baseline + self.settings.window) for _ in range(2)]
        self._changed = [False, False]
        self._stale: int | None = None  # a kind whose corrections were scaled from the other's regime change
        self._since_fit = 0
        self.observations: list[Observation] = []  # every round observed, in order
        # AR steps' seconds over the curve's step, with the drafter's taps computed and without (`tap_share`)
        self._tap_steps: dict[bool, deque[float]] = {True: deque(maxlen=32), False: deque(maxlen=32)}
        self.refits = 0
        self._current = self._fit()

    # ------------------------------------------------------------------ CostModel
    @property
    def draft_cost(self) -> float:
        return self._current.draft_cost

    def verify_cost(self, n: torch.Tensor, ctx: int) -> torch.Tensor:
        return self._current.verify_cost(n, ctx)

    def verify_seconds(self, n: float, ctx: int) -> float:
        return self._current.verify_seconds(n, ctx)  # the current curve's scalar path (no tensors)

    def to_dict(self) -> dict:
        """The current curve (a plain convex cost model: what a saved file or a record replays with)."""
        return self._current.to_dict()

    def flat_curve(self) -> ConvexCost:
        """The current curve with every tree priced at its one-token step (one knot per context:
        `ConvexCost` extends it flat): a policy priced by it builds its full budget."""
        cur = self._current
        steps = tuple(cur.verify_seconds(1, c) for c in cur.contexts)
        return ConvexCost(cur.draft, cur.contexts, tuple((1.0,) for _ in cur.contexts), tuple((v,) for v in steps))

    # ------------------------------------------------------------------ the controller's side
    def observe(self, n: int, ctx: int, verify: float, draft: float | None = None, explored: bool = False,
                tapped: bool = False) -> bool:
        """One round's measured seconds: ``verify`` for ``n`` tree tokens on ``ctx`` cached tokens, and
        the draft and build seconds of a drafted round; ``explored``: the round was priced flat; ``tapped``:
        its forward computed the drafter's taps.  True when it changed the regime (the model re-fitted to a
        new speed of the machine)."""
        obs = Observation(int(n), int(ctx), float(verify), None if draft is None else float(draft), bool(explored))
        if obs.n < 1 or not math.isfinite(obs.verify) or obs.verify <= 0:
            raise ValueError(f"a round of {n} tokens that took {verify} s cannot be observed")
        if obs.n == 1 and obs.draft is None:  # an AR step: what taps add to it
            self._tap_steps[bool(tapped)].append(obs.verify / self._current.verify_seconds(1, obs.ctx))
        return self._update(obs)

    def tap_share(self) -> float:
        """What the drafter's taps add to an AR step, as a share of the step: the trimmed means of AR steps'
        seconds over the curve's step, with taps and without, apart (0 until both were measured)."""
        if not self._tap_steps[True] or not self._tap_steps[False]:
            return 0.0
        return max(0.0, trimmed_mean(list(self._tap_steps[True])) - trimmed_mean(list(self._tap_steps[False])))

    def _update(self, obs: Observation) -> bool:
        index = len(self.observations)
        self.observations.append(obs)
        kind = int(obs.n > 1)
        predicted = self._current.verify_seconds(obs.n, obs.ctx)
        error = math.log(obs.verify / predicted) if predicted > 0 else math.inf  # > 0: dearer than priced
        measured = self._stale == kind  # the first round of a kind whose corrections were only scaled
        if measured:
            self._stale = None
            if self._contradicts_scaling(kind, error):
                for window in self._windows(kind):
                    _keep_from(window, index)
                self._errors[kind].clear()  # they were errors against the scaled estimate
        # the trees' ordinary rounds before an exploring one (the rule for a faster machine below)
        lo = ordinary(self._kind_errors(kind))[0] if obs.explored else 0.0
        self._errors[kind].append((obs.n, obs.ctx, error))
        prior = self.prior.verify_seconds(obs.n, obs.ctx)
        bucket = self._bucket(obs.n)
        if prior > 0:
            self._ratios[bucket].append((index, obs.verify / prior))
            self._counts[bucket] += 1
        if obs.draft is not None:
            self._drafts.append((index, obs.draft))
            self._draft_count += 1
        self._since_fit += 1
        s = self.settings
        drifted = shifted(self._kind_errors(kind), s.drift_rounds, s.drift, self._baseline)
        cheaper = obs.explored and error < lo - 2 * s.drift  # an exploring round found the machine faster
        if drifted or cheaper:
            self._new_regime(kind, index - s.drift_rounds + 1 if drifted else index)
            self._errors[kind].clear()  # errors against the old regime's curve
        if self._since_fit >= s.refit_every or drifted or cheaper or measured:
            before, self._current = self._current, self._fit()
            self._rebase_errors(before)
            self._since_fit = 0
            self.refits += 1
        return drifted or cheaper

    def price_spread(self) -> float:
        """The relative standard error of the curve's price of a tree against an AR step: per kind (the
        one-token step, trees) the variance of its kept errors log(measured / predicted) over their count
        (``drift`` squared as the spread of a kind with fewer than two rounds), summed, square-rooted."""
        total = 0.0
        for kind in (0, 1):
            errors = self._kind_errors(kind)
            var = statistics.variance(errors) if len(errors) >= 2 else self.settings.drift ** 2
            total += var / max(len(errors), 1)
        return math.sqrt(total)

    def _kind_errors(self, kind: int) -> list[float]:
        """The kept errors log(measured / predicted) of one kind's rounds, oldest first."""
        return [e for _, _, e in self._errors[kind]]

    def _contradicts_scaling(self, kind: int, error: float) -> bool:
        """Whether the first round of a kind whose corrections were scaled, ``error`` off their
        estimate, lies outside that kind's ordinary range of errors (widened by ``drift``) around it:
        then its measurement replaces them, else they stand (one round of a busy machine is a poor
        estimate of its mean)."""
        errors = self._kind_errors(kind)
        lo, hi = ordinary(errors)
        mid = statistics.median(errors) if errors else 0.0  # the spread of the kind's rounds, centred on the estimate
        return not lo - mid - self.settings.drift <= error <= hi - mid + self.settings.drift

    def _rebase_errors(self, before: ConvexCost) -> None:
        """Re-express the kept errors against the curve just fitted (a re-fit is not a change of the machine)."""
        for errors in self._errors:
            rebased = [(n, ctx, e + math.log(before.verify_seconds(n, ctx) / self._current.verify_seconds(n, ctx)))
                       for n, ctx, e in errors]
            errors.clear()
            errors.extend(rebased)

    def _new_regime(self, kind: int, index: int) -> None:
        """A change of regime of one kind: its windows (and the drafts', for trees) keep only what was
        observed from observation ``index`` on, and its prior no longer counts.  The other kind's
        corrections are scaled by the same factor (the machine changed speed, not one kernel) and
        marked stale: the next round of that kind checks them (`_contradicts_scaling`)."""
        self._changed[kind] = True
        mine, other = self._windows(kind), self._windows(1 - kind)
        before = [x for w in mine for i, x in w if i < index]
        after = [x for w in mine for i, x in w if i >= index]
        factor = statistics.median(after) / statistics.median(before) if before and after else 1.0
        for window in mine + ([self._drafts] if kind else []):
            _keep_from(window, index)
        for window in other:
            scaled = [(i, x * factor) for i, x in window]
            window.clear()
            window.extend(scaled)
        errors = self._errors[1 - kind]  # its rounds as if they had run at the new speed, as its windows now say
        shifted_errors = [(n, ctx, e + math.log(factor)) for n, ctx, e in errors]
        errors.clear()
        errors.extend(shifted_errors)
        if any(other):
            self._stale = 1 - kind

    def _windows(self, kind: int) -> list[deque]:
        """The ratio windows of one kind's buckets (0: the one-token step, 1: trees)."""
        return [w for w, k in zip(self._ratios, self.knots, strict=True) if int(k > 1) == kind]

    @property
    def step_unmeasured(self) -> bool:
        """Whether the one-token step is only an estimate scaled from the trees' change of regime (a round of
        it measures it)."""
        return self._stale == 0

    @property
    def trees_unmeasured(self) -> bool:
        """Whether the trees' prices are only estimates scaled from the one-token step's change of regime."""
        return self._stale == 1

    # ------------------------------------------------------------------ the estimator
    def _bucket(self, n: int) -> int:
        """The knot nearest ``n`` in log n; n = 1 only in the one-token bucket and never in a tree's."""
        if n == 1 and 1.0 in self.knots:
            return self.knots.index(1.0)
        trees = [i for i, k in enumerate(self.knots) if k >= 2] or list(range(len(self.knots)))
        return min(trees, key=lambda i: abs(math.log(self.knots[i]) - math.log(n)))

    def _corrections(self) -> list[float]:
        """r_k per knot: the trimmed mean of its observed ratios shrunk toward its kind's pooled
        correction, or the pooled correction alone where nothing was observed (module docstring)."""
        own = [trimmed_mean([x for _, x in r]) if r else None for r in self._ratios]
        seen = [j for j in range(len(self.knots)) if own[j] is not None]

        def pooled(trees: bool) -> float | None:  # the kind's observed corrections, each weighed by its rounds
            kin = [j for j in seen if (self.knots[j] >= 2) == trees] or (seen if trees else [])
            counts = [len(self._ratios[j]) for j in kin]
            return sum(own[j] * m for j, m in zip(kin, counts)) / sum(counts) if kin else None

        pools, w = {trees: pooled(trees) for trees in (False, True)}, self.settings.pool_weight
        out = []
        for i, k in enumerate(self.knots):
            pool, m = pools[k >= 2], len(self._ratios[i])
            if own[i] is None:
                out.append(1.0 if pool is None else pool)
            else:
                out.append((m * own[i] + w * pool) / (m + w) if pool is not None else own[i])
        return out

    def _fit(self) -> ConvexCost:
        w0, window = self.settings.prior_weight, self.settings.window
        ratios = self._corrections()
        seen = [len(r) for r in self._ratios]  # observations in each bucket's window
        knots, values = [], []
        for ctx in self.contexts:
            base = self.prior.verify_cost(torch.tensor(self.knots, dtype=torch.float64), ctx).tolist()  # [K]
            points, weights = [], []
            for k, b, r, m in zip(self.knots, base, ratios, seen, strict=True):
                # the prior's pseudo-count, replaced as observations come, gone after a change of regime
                prior_w = 0.0 if self._changed[int(k > 1)] else w0 * (1.0 - m / window)
                if m == 0:  # never observed: the prior's shape at the level of the nearest observed bucket
                    points.append((k, b * r))
                    weights.append(max(prior_w, 1.0))
                else:
                    points.append((k, (prior_w * b + m * b * r) / (prior_w + m)))
                    weights.append(prior_w + m)
            kn, va = fit_verify_curve(points, weights)
            knots.append(kn)
            values.append(va)
        draft = self.prior.draft_cost
        if self._drafts:
            m = len(self._drafts)
            prior_w = 0.0 if self._changed[1] else w0 * (1.0 - m / window)
            draft = (prior_w * draft + m * trimmed_mean([x for _, x in self._drafts])) / (prior_w + m)
        return ConvexCost(float(draft), tuple(self.contexts), tuple(knots), tuple(values))

    # ------------------------------------------------------------------ reading it back
    def snapshot(self) -> ConvexCost:
        """The current curve, frozen."""
        return self._current

    def support(self) -> dict[int, int]:
        """Observations each knot rests on (every round ever observed, not only the window)."""
        return {int(k): c for k, c in zip(self.knots, self._counts, strict=True)}

    @property
    def draft_support(self) -> int:
        """Drafted rounds observed (every one, not only the window)."""
        return self._draft_count

    @classmethod
    def restore(cls, prior: CostModel, observations: Iterable[Observation | Sequence],
                settings: LiveSettings | None = None) -> LiveCost:
        """The model a run ended with, rebuilt from its prior and its observations in order."""
        live = cls(prior, settings)
        for obs in observations:
            live._update(obs if isinstance(obs, Observation) else Observation.from_list(obs))
        return live


def trimmed_mean(values: Sequence[float], share: float = 0.125) -> float:
    """The mean of ``values`` without the largest and the smallest ``share`` of them (at least one of
    each once there are three): robust to a few outliers, yet it follows a persistent tail."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values to average")
    cut = max(1, int(len(xs) * share)) if len(xs) >= 3 else 0
    return statistics.fmean(xs[cut:len(xs) - cut])


def ordinary(errors: Sequence[float]) -> tuple[float, float]:
    """The range of ordinary rounds among ``errors``: from the second smallest to the second largest
    (one outlier each side left out; all of them with fewer than three; (0, 0) with none)."""
    xs = sorted(errors)
    if not xs:
        return 0.0, 0.0
    cut = 1 if len(xs) >= 3 else 0
    return xs[cut], xs[-1 - cut]


def shifted(errors: Sequence[float], recent: int, least: float, baseline: int) -> bool:
    """Whether the last ``recent`` errors all lie beyond the ordinary range of the earlier ones (at least
    ``baseline`` of them) by more than ``least``, on the same side: a change of regime, which a few
    slow rounds of a busy machine, or one descheduled round of a quiet one, are not."""
    errors = list(errors)
    if len(errors) < recent + max(baseline, 1):
        return False
    lo, hi = ordinary(errors[:-recent])
    new = errors[-recent:]
    return min(new) > hi + least or max(new) < lo - least


def _keep_from(window: deque, index: int) -> None:
    """Drop a window's entries observed before observation ``index``."""
    kept = [(i, x) for i, x in window if i >= index]
    window.clear()
    window.extend(kept)
