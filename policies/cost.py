"""Cost models for cost-aware tree sizing, and the cost-aware stop rule (CaDDTree's, for any policy).

Contract
--------
A `CostModel` gives C_d, the seconds of one drafter forward, and C_v(n; ctx), the seconds of one
target verify forward over n tokens (the tree's nodes, root included) at context length ctx.
``verify_costs(n_max, ctx)`` tabulates C_v for n = 0..n_max in float64; both backends read the
same table, so the stop decision is bit-identical between them.

* `LinearCost`: C_v = base + per_token * n + per_context * ctx.
* `ConvexCost`: for each profiled context length, a non-decreasing convex piecewise-linear C_v(n)
  fitted to measured (n, ctx, seconds) samples; between profiled context lengths the two
  neighbouring curves are interpolated linearly (a convex combination of non-decreasing convex
  functions is one), outside them the nearest curve is used.  Past its last knot a curve continues
  with its last slope.  The fit is pool-adjacent-violators on the slopes (convexity = non-decreasing
  slopes), slopes clipped at 0 (monotone), then the intercept by weighted least squares; no solver.
  ``save`` / ``load_cost_model`` use JSON.

`CostAwareStop` is the stop rule of DESIGN §4 (see its docstring for the precise n and initial θ).
"""

from __future__ import annotations

import bisect
import itertools
import json
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs
import torch

from policies.best_first import StopRule
from treespec.interfaces import DraftOutput

__all__ = [
    "COST_PRESETS", "ConvexCost", "CostAwareStop", "CostModel", "LinearCost", "fit_convex_curve",
    "load_cost_model",
]


class CostModel(ABC):
    """C_d and C_v(n; ctx) in seconds."""

    @property
    @abstractmethod
    def draft_cost(self) -> float:
        """C_d: one drafter forward."""

    @abstractmethod
    def verify_cost(self, n: torch.Tensor, ctx: int) -> torch.Tensor:
        """C_v(n; ctx) for token counts ``n`` (any shape, float64 result)."""

    def verify_costs(self, n_max: int, ctx: int) -> torch.Tensor:
        """[n_max + 1] float64: C_v(n; ctx) for n = 0..n_max."""
        return self.verify_cost(torch.arange(n_max + 1, dtype=torch.float64), ctx)

    @abstractmethod
    def to_dict(self) -> dict:
        """A JSON-ready description (``kind`` names the class)."""

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _check_positive(name: str, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0 seconds, got {value}")


@attrs.frozen
class LinearCost(CostModel):
    """C_v(n; ctx) = base + per_token * n + per_context * ctx."""

    draft: float  # C_d, seconds per drafter forward
    base: float  # seconds of a verify forward's fixed part
    per_token: float  # extra seconds per tree token
    per_context: float = 0.0  # extra seconds per context token

    def __attrs_post_init__(self) -> None:
        for name in ("draft", "base", "per_token", "per_context"):
            _check_positive(name, getattr(self, name))

    @property
    def draft_cost(self) -> float:
        return self.draft

    def verify_cost(self, n: torch.Tensor, ctx: int) -> torch.Tensor:
        n = torch.as_tensor(n, dtype=torch.float64)
        return self.base + self.per_token * n + self.per_context * float(ctx)

    def to_dict(self) -> dict:
        return {"kind": "linear", **attrs.asdict(self)}


# ---------------------------------------------------------------------------- convex fit
def _pav_non_decreasing(values: list[float], weights: list[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return [mean for mean, _, count in blocks for _ in range(count)]


def fit_convex_curve(points: Iterable[tuple[float, float]]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Knots and values of a non-decreasing convex piecewise-linear fit to (n, seconds) points.

    Repeated n are averaged (weighted by their count); consecutive slopes are made non-decreasing
    by PAV (weighted by the gap between knots) and clipped at 0; the intercept then minimises the
    weighted squared error.
    """
    groups: dict[float, list[float]] = defaultdict(list)
    for n, seconds in points:
        groups[float(n)].append(float(seconds))
    if not groups:
        raise ValueError("cannot fit a cost curve to zero samples")
    knots = sorted(groups)
    means = [sum(groups[n]) / len(groups[n]) for n in knots]
    weights = [len(groups[n]) for n in knots]
    gaps = [b - a for a, b in itertools.pairwise(knots)]
    slopes = [(y2 - y1) / g for y1, y2, g in zip(means, means[1:], gaps)]
    slopes = [max(0.0, s) for s in _pav_non_decreasing(slopes, gaps)]
    shape = [0.0]
    for s, g in zip(slopes, gaps):
        shape.append(shape[-1] + s * g)
    intercept = sum(w * (y - f) for w, y, f in zip(weights, means, shape)) / sum(weights)
    return tuple(knots), tuple(intercept + f for f in shape)


def _interp_curve(n: torch.Tensor, knots: tuple[float, ...], values: tuple[float, ...]) -> torch.Tensor:
    """Piecewise-linear curve at ``n``, continued with its end slopes (flat for a single knot)."""
    if len(knots) == 1:
        return torch.full_like(n, values[0])
    x = torch.tensor(knots, dtype=torch.float64)
    y = torch.tensor(values, dtype=torch.float64)
    seg = (torch.searchsorted(x, n, right=True) - 1).clamp(0, len(knots) - 2)  # segment of each n
    slope = (y[seg + 1] - y[seg]) / (x[seg + 1] - x[seg])
    return (y[seg] + slope * (n - x[seg])).clamp_min(0.0)


@attrs.frozen
class ConvexCost(CostModel):
    """Non-decreasing convex C_v(n) per profiled context length, interpolated across contexts."""

    draft: float  # C_d, seconds per drafter forward
    contexts: tuple[int, ...]  # profiled context lengths, ascending
    knots: tuple[tuple[float, ...], ...]  # per context: token counts n of the curve's knots
    values: tuple[tuple[float, ...], ...]  # per context: C_v at those knots, seconds

    def __attrs_post_init__(self) -> None:
        _check_positive("draft", self.draft)
        if not self.contexts or list(self.contexts) != sorted(set(self.contexts)):
            raise ValueError(f"contexts must be distinct and ascending, got {self.contexts}")
        if not len(self.contexts) == len(self.knots) == len(self.values):
            raise ValueError("contexts, knots and values must have one entry per context")

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, int, float]], draft: float) -> ConvexCost:
        """Fit from measured (n tokens, context length, seconds) samples; see `fit_convex_curve`."""
        by_context: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for n, ctx, seconds in samples:
            by_context[int(ctx)].append((n, seconds))
        if not by_context:
            raise ValueError("cannot fit a cost model to zero samples")
        contexts = tuple(sorted(by_context))
        curves = [fit_convex_curve(by_context[c]) for c in contexts]
        return cls(draft, contexts, tuple(k for k, _ in curves), tuple(v for _, v in curves))

    @property
    def draft_cost(self) -> float:
        return self.draft

    def verify_cost(self, n: torch.Tensor, ctx: int) -> torch.Tensor:
        n = torch.as_tensor(n, dtype=torch.float64)
        hi = bisect.bisect_left(self.contexts, ctx)
        if hi == 0 or hi == len(self.contexts) or self.contexts[hi] == ctx:  # outside, or profiled
            i = min(hi, len(self.contexts) - 1)
            return _interp_curve(n, self.knots[i], self.values[i])
        lo = hi - 1
        w = (ctx - self.contexts[lo]) / (self.contexts[hi] - self.contexts[lo])
        return (1.0 - w) * _interp_curve(n, self.knots[lo], self.values[lo]) + w * _interp_curve(
            n, self.knots[hi], self.values[hi])

    def to_dict(self) -> dict:
        return {"kind": "convex", "draft": self.draft, "contexts": list(self.contexts),
                "knots": [list(k) for k in self.knots], "values": [list(v) for v in self.values]}


def load_cost_model(path: str | Path) -> CostModel:
    """Read a cost model written by ``CostModel.save``."""
    data = json.loads(Path(path).read_text())
    kind = data.pop("kind", None)
    if kind == "linear":
        return LinearCost(**data)
    if kind == "convex":
        return ConvexCost(data["draft"], tuple(data["contexts"]), tuple(tuple(k) for k in data["knots"]),
                          tuple(tuple(v) for v in data["values"]))
    raise ValueError(f"{path}: unknown cost model kind {kind!r}; expected 'linear' or 'convex'")


# DESIGN §8: SmolLM2-135M in bf16 on this 2-core CPU with a 300-token cache (verify of 1/8/16/65
# tokens) and the block-16 drafter forward.  A starting point until `treespec profile-cost` runs.
COST_PRESETS: dict[str, CostModel] = {
    "smollm2-cpu-bf16": ConvexCost.fit([(1, 300, 0.0233), (8, 300, 0.0253), (16, 300, 0.0292),
                                        (65, 300, 0.0602)], draft=0.0078),
}


# ---------------------------------------------------------------------------- the stop rule
@attrs.frozen
class CostAwareStop(StopRule):
    """Stop when one more node no longer raises the expected tokens per second.

    Candidates arrive in pop order with scores s_1 >= s_2 >= ...; δ_j = exp(s_j) is the chance
    that the target accepts candidate j's path and Φ_j = δ_1 + ... + δ_j (float64, summed in that
    order).  Here n counts the tree's nodes before candidate j, root included (n = j), so with the
    candidate the verify forward covers n + 1 tokens:

        θ_j = (1 + Φ_j) / (C_d + C_v(n + 1; ctx)),      θ_0 = 1 / (C_d + C_v(1; ctx)),

    θ_0 being the root-only tree.  ctx = ``draft.position``.  The build stops at the first j with
    θ_j <= θ_{j-1}, keeping j - 1 nodes.  Scores never rise along the pop order, so the numerator
    is concave in j; with a convex C_v the ratio is unimodal and this is its first argmax.
    """

    cost: CostModel  # the C_d / C_v model of this hardware

    def _costs(self, draft: DraftOutput, count: int) -> torch.Tensor:
        """[count + 1]: C_d + C_v(j + 1; ctx) for j = 0..count."""
        table = self.cost.verify_costs(count + 1, draft.position)[1:]
        costs = self.cost.draft_cost + table
        if not bool((costs > 0).all()):
            raise ValueError("cost model must give C_d + C_v(n) > 0 for every n >= 1")
        return costs

    def reference(self, draft: DraftOutput, budget: int) -> Callable[[float], bool]:
        costs = self._costs(draft, budget).tolist()
        state = {"j": 0, "phi": 0.0, "theta": 1.0 / costs[0]}

        def should_stop(score: float) -> bool:
            j = state["j"] + 1
            phi = state["phi"] + float(torch.tensor(score, dtype=torch.float64).exp())
            theta = (1.0 + phi) / costs[j]
            if theta <= state["theta"]:
                return True
            state.update(j=j, phi=phi, theta=theta)
            return False

        return should_stop

    def keep(self, draft: DraftOutput, scores: torch.Tensor) -> torch.Tensor:
        m = scores.numel()
        costs = self._costs(draft, m).to(scores.device)
        phi = scores.double().exp().cumsum(0)  # [m] Φ_j
        theta = torch.cat([1.0 / costs[:1], (1.0 + phi) / costs[1:]])  # [m + 1] θ_0..θ_m
        drop = theta[1:] <= theta[:-1]  # [m] candidate j+1 does not raise θ
        first = torch.where(drop, torch.arange(m, device=scores.device), m)
        return first.min() if m else torch.zeros((), dtype=torch.int64, device=scores.device)
