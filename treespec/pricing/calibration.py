"""How far a drafter's path probabilities can be trusted: a calibration by confidence.

Contract
--------
A tree node's score s is its path log-probability under the drafter; δ = exp(s) is what the drafter
promises (the chance the target accepts the node's whole path), and cost rules add promises up.
`Calibration` maps each promise to a calibrated one,

    δ' = min(1, κ δ^β) = exp(min(0, log κ + β s)),

κ (``scale``) one factor on every promise, β (``power``) bending the map (β < 1 raises the small
promises against the large); κ = β = 1 is the identity.  The map is increasing in s, so it never
changes which candidate a best-first build takes next, only how much each is worth.

`fit_calibration(rounds)` fits (κ, β) by maximum likelihood from recorded nodes (accepted when on the
round's accepted path, `node_outcomes`, with probability δ'): the log-likelihood is concave in
(log κ, β), so a damped Newton ascent from the identity finds its maximum; too little evidence (fewer
than ``MIN_NODES`` nodes, none accepted, or none rejected) gives the identity.

`LiveCalibration(prior)` learns the map while decoding: the decoder hands it every drafted round's
node outcomes; every ``refit_every`` rounds, once its window (the last rounds holding ``window``
nodes) holds ``min_nodes``, it re-fits κ and keeps the prior's β (re-fitting both on trimmed trees
pinned β poorly and cost the cost-aware DominoTree about 3 %; ``fit_power`` re-fits both).  A window
where no node, or every node, was accepted gets the smoothed κ = (A + 1/2) / (Σ δ^β + 1/2).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

import attrs
import torch

__all__ = ["MIN_NODES", "Calibration", "LiveCalibration", "LiveCalibrationSettings", "fit_calibration",
           "node_outcomes", "promise_by_quartile", "to_calibration"]

MIN_NODES = 50  # recorded nodes below which a fit is not attempted (the identity is kept)
_POWER_RANGE = (0.05, 5.0)  # the powers a fit may return: outside them the data are degenerate
_EDGE = 1e-9  # promises are kept below 1 - _EDGE in the fit, so a rejected sure node stays finite


def _positive(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value < math.inf:
        raise ValueError(f"calibration {attribute.name} must be a finite number > 0, got {value!r}")


@attrs.frozen
class Calibration:
    """δ' = min(1, scale · δ^power) (module docstring); the default is the identity."""

    scale: float = attrs.field(default=1.0, validator=_positive, converter=float)  # κ: one factor on every promise
    power: float = attrs.field(default=1.0, validator=_positive, converter=float)  # β: < 1 lifts small promises

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.power == 1.0

    def deltas(self, scores: torch.Tensor) -> torch.Tensor:
        """Calibrated promises δ' of path log-probabilities ``scores`` (any shape), float64, in (0, 1]."""
        s = scores.double()
        if self.identity:
            return s.exp()
        return (math.log(self.scale) + self.power * s).clamp(max=0.0).exp()

    def to_record(self) -> list[float]:
        return [self.scale, self.power]

    @classmethod
    def from_record(cls, record) -> Calibration:
        """From `to_record`'s [scale, power] (anything else: a ValueError naming it)."""
        try:
            scale, power = record
        except (TypeError, ValueError):
            raise ValueError(f"a calibration is [scale, power], got {record!r}") from None
        return cls(scale, power)

    def describe(self) -> str:
        return f"kappa {self.scale:.3f}, power {self.power:.3f}"


def to_calibration(value: Calibration | LiveCalibration | float | int) -> Calibration | LiveCalibration:
    """attrs converter of a policy's ``calibration`` field: a `Calibration` or `LiveCalibration`, or a
    number κ (power 1)."""
    if isinstance(value, Calibration | LiveCalibration):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"calibration must be a Calibration or a finite number > 0, got {value!r}")
    if not 0.0 < value < math.inf:
        raise ValueError(f"calibration must be a finite number > 0, got {value!r}")
    return Calibration(value)


def node_outcomes(tree, result) -> tuple[torch.Tensor, torch.Tensor]:
    """([n - 1] float64 scores, [n - 1] bool accepted) of a verified tree's non-root nodes: whether each
    lies on the accepted path (``result.accepted``, node indices from the root)."""
    on_path = torch.zeros(len(tree), dtype=torch.bool)
    on_path[result.accepted.cpu()] = True
    return tree.scores[1:].detach().cpu().double(), on_path[1:]


def promise_by_quartile(rounds: Iterable[tuple[torch.Tensor, torch.Tensor]], calibration: Calibration = Calibration(),
                        groups: int = 4) -> list[tuple[float, float]]:
    """(mean draft tokens promised, mean accepted) of the rounds in each of ``groups`` equal groups by
    promise (Φ = Σ δ' of a round's nodes under ``calibration``), least promising first: a calibrated
    drafter's two columns agree in every group.  ``rounds``: (scores, accepted) pairs, `node_outcomes`."""
    rows = sorted((float(calibration.deltas(s).sum()), int(a.sum())) for s, a in rounds)
    if len(rows) < groups:
        return []
    cuts = [round(i * len(rows) / groups) for i in range(groups + 1)]
    parts = [rows[lo:hi] for lo, hi in zip(cuts, cuts[1:])]
    return [(sum(p for p, _ in part) / len(part), sum(a for _, a in part) / len(part)) for part in parts]


def _log_likelihood(z: torch.Tensor, y: torch.Tensor) -> float:
    """Σ y min(z, 0) + (1 - y) log(1 - e^z): -inf where a rejected node is promised certainty."""
    if bool((z[~y] >= 0).any()):
        return -math.inf
    return float(z[y].clamp(max=0.0).sum() + torch.log(-torch.expm1(z[~y])).sum())


def fit_calibration(rounds: Iterable[tuple[torch.Tensor, torch.Tensor]], *, fit_power: bool = True,
                    iterations: int = 100, start: Calibration | None = None) -> Calibration:
    """The maximum-likelihood (κ, β) of recorded nodes: ``rounds`` yields (scores, accepted) pairs
    (`node_outcomes` of each verified tree).  ``fit_power=False`` fits κ alone (β = 1).  The ascent
    starts from ``start`` (default the identity; a live re-fit starts from its last fit, a few
    Newton steps away) or from the identity when ``start`` is impossible for these nodes."""
    pairs = [(s.double().reshape(-1), a.bool().reshape(-1)) for s, a in rounds]
    if not pairs:
        return Calibration()
    x = torch.cat([s for s, _ in pairs]).clamp(max=math.log1p(-_EDGE))  # [N] log δ, kept below 0
    y = torch.cat([a for _, a in pairs])  # [N]
    if x.numel() < MIN_NODES or bool(y.all()) or not bool(y.any()):
        return Calibration()
    design = torch.stack([torch.ones_like(x), x], dim=1) if fit_power else torch.ones_like(x)[:, None]  # [N, p]
    theta = torch.tensor([0.0, 1.0] if fit_power else [0.0], dtype=torch.float64)  # (log κ, β)
    z_of = lambda t: design @ t + (0.0 if fit_power else x)  # noqa: E731  z = log κ + β log δ
    best = _log_likelihood(z_of(theta), y)
    if start is not None:
        given = torch.tensor([math.log(start.scale), start.power][:theta.numel()], dtype=torch.float64)
        if (value := _log_likelihood(z_of(given), y)) > best:  # -inf where it promises a rejected node certainty
            theta, best = given, value
    for _ in range(iterations):
        z = z_of(theta)
        ez = torch.exp(z.clamp(max=0.0))
        slope = torch.where(y, (z < 0).double(), -ez / (-torch.expm1(z.clamp(max=-_EDGE))))  # dLL/dz
        curve = torch.where(y, torch.zeros_like(z), -ez / torch.expm1(z.clamp(max=-_EDGE)).square())  # d²LL/dz²
        grad = design.T @ slope  # [p]
        hess = design.T @ (curve[:, None] * design) - 1e-9 * torch.eye(design.shape[1], dtype=torch.float64)
        step = -torch.linalg.solve(hess, grad)
        t, improved = 1.0, False
        while t > 1e-6:  # backtracking: stay where every rejected node keeps a promise below 1
            candidate = theta + t * step
            value = _log_likelihood(z_of(candidate), y)
            if value > best:
                theta, best, improved = candidate, value, True
                break
            t /= 2
        if not improved or float(step.abs().max()) * t < 1e-10:
            break
    scale, power = math.exp(float(theta[0])), float(theta[1]) if fit_power else 1.0
    power = min(max(power, _POWER_RANGE[0]), _POWER_RANGE[1])
    return Calibration(scale, power)


@attrs.frozen
class LiveCalibrationSettings:
    """The live calibration's window and re-fit cadence (module docstring)."""

    window: int = attrs.field(default=2048, validator=attrs.validators.ge(MIN_NODES))  # most recent nodes a fit reads
    min_nodes: int = attrs.field(default=256, validator=attrs.validators.ge(MIN_NODES))  # nodes before the first fit
    refit_every: int = attrs.field(default=8, validator=attrs.validators.ge(1))  # observed rounds between fits
    fit_power: bool = False  # re-fit β too; by default κ alone, β the prior's (see the module docstring)


class LiveCalibration:
    """A drafter's calibration learned from the rounds it drafts (module docstring)."""

    def __init__(self, prior: Calibration = Calibration(),
                 settings: LiveCalibrationSettings = LiveCalibrationSettings()) -> None:
        self.prior = to_calibration(prior)
        self.settings = settings
        self.current = self.prior  # the map policies read now
        self.fits = 0  # fits made so far (0: still the prior)
        self._rounds: deque[tuple[torch.Tensor, torch.Tensor]] = deque()  # (scores, accepted) per round
        self._nodes = 0  # nodes in the window
        self._since_fit = 0  # rounds observed since the last fit

    @property
    def identity(self) -> bool:
        return False  # never dropped as a no-op: what it learns may move it

    @property
    def nodes(self) -> int:
        """Nodes the window holds now."""
        return self._nodes

    def deltas(self, scores: torch.Tensor) -> torch.Tensor:
        return self.current.deltas(scores)

    def describe(self) -> str:
        source = f"fitted live on {self._nodes} nodes" if self.fits else "the prior, not yet fitted live"
        return f"{self.current.describe()} ({source})"

    def observe(self, scores: torch.Tensor, accepted: torch.Tensor) -> bool:
        """One verified tree's non-root nodes (`node_outcomes`); True when it re-fitted the map."""
        scores, accepted = scores.detach().double().reshape(-1).cpu(), accepted.bool().reshape(-1).cpu()
        if scores.shape != accepted.shape:
            raise ValueError(f"observe: {scores.numel()} scores for {accepted.numel()} outcomes")
        if scores.numel() == 0:
            return False  # a root-only tree promises nothing and tests nothing
        self._rounds.append((scores, accepted))
        self._nodes += scores.numel()
        while len(self._rounds) > 1 and self._nodes - self._rounds[0][0].numel() >= self.settings.window:
            self._nodes -= self._rounds.popleft()[0].numel()
        self._since_fit += 1
        if self._nodes < self.settings.min_nodes or self._since_fit < self.settings.refit_every:
            return False
        self.current, self._since_fit = self._fit(), 0
        self.fits += 1
        return True

    def _fit(self) -> Calibration:
        y = torch.cat([a for _, a in self._rounds])  # [N]
        power = None if self.settings.fit_power else self.prior.power
        rounds = list(self._rounds) if power is None else [(power * s, a) for s, a in self._rounds]  # δ^β: κ alone
        if bool(y.any()) and not bool(y.all()):
            fitted = fit_calibration(rounds, start=self.current, fit_power=power is None)
            return fitted if power is None else Calibration(fitted.scale, power)
        promised = float(torch.cat([s for s, _ in rounds]).exp().sum())  # Σ δ^β
        return Calibration((int(y.sum()) + 0.5) / (promised + 0.5), power or 1.0)  # no maximum: the smoothed ratio
