"""Cost models of one machine: C_d (a drafter forward) and C_v(n; ctx) (a target verify forward).

Contract
--------
A `CostModel` gives C_d, the seconds of one drafter forward, and C_v(n; ctx), the seconds of one
target forward over n tokens (a tree's nodes, root included) on top of ctx cached tokens.
``verify_costs(n_max, ctx)`` tabulates C_v for n = 0..n_max in float64; every reader of a model
uses that table, so decisions taken from it are bit-identical between policy backends.

* `LinearCost`: C_v = base + per_token * n + per_context * ctx.
* `ConvexCost`: for each profiled context length a piecewise-linear C_v(n) with knots at the
  profiled n; between profiled context lengths the two neighbouring curves are interpolated
  linearly, outside them the nearest curve is used.  Beyond its end knots a curve continues with
  its end slopes.  ``ConvexCost.fit`` makes it non-decreasing and convex: the exact weighted
  least-squares fit under monotonicity and convexity (`fit_convex_curve`), the regression
  CaDDTree's method prescribes, solved without a QP solver.  A machine's profile keeps its
  measured value at every profiled size instead (`fit_verify_curve`), since measured verify times
  are neither (the class keeps its name: files and records say ``"convex"``).

``save`` writes JSON; `load_cost_model` reads it back and names the file and the field in every
error.  Cost models hold no policy logic: cost-aware stop rules live in ``policies/engine/cost.py``, and
the models of a machine come from `treespec.pricing.profile`, which measures them.
"""

from __future__ import annotations

import bisect
import json
import math
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import attrs
import numpy as np
import torch

__all__ = [
    "COST_PRESETS", "CURVE_SHAPES", "ConvexCost", "CostModel", "CostModelError", "LinearCost", "cost_model_from_dict",
    "fit_convex_curve", "fit_verify_curve", "load_cost_model", "nnls", "resolve_cost_model",
]


class CostModelError(ValueError):
    """A cost model file or description that cannot be used (the message names the problem)."""


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

    def verify_seconds(self, n: float, ctx: int) -> float:
        """C_v(n; ctx) of one size as a Python float (a model may answer it without a tensor)."""
        return float(self.verify_cost(torch.tensor([float(n)], dtype=torch.float64), ctx)[0])

    @abstractmethod
    def to_dict(self) -> dict:
        """A JSON-ready description (``kind`` names the class)."""

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _check_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise CostModelError(f"{name} must be a finite number of seconds >= 0, got {value!r}")


@attrs.frozen
class LinearCost(CostModel):
    """C_v(n; ctx) = base + per_token * n + per_context * ctx."""

    draft: float  # C_d, seconds per drafter forward
    base: float  # seconds of a verify forward's fixed part
    per_token: float  # extra seconds per tree token
    per_context: float = 0.0  # extra seconds per context token

    def __attrs_post_init__(self) -> None:
        for name in ("draft", "base", "per_token", "per_context"):
            _check_seconds(name, getattr(self, name))

    @property
    def draft_cost(self) -> float:
        return self.draft

    def verify_cost(self, n: torch.Tensor, ctx: int) -> torch.Tensor:
        n = torch.as_tensor(n, dtype=torch.float64)
        return self.base + self.per_token * n + self.per_context * float(ctx)

    def to_dict(self) -> dict:
        return {"kind": "linear", **attrs.asdict(self)}


# ---------------------------------------------------------------------------- the exact convex fit
def nnls(a: np.ndarray, y: np.ndarray, *, max_iter: int | None = None) -> np.ndarray:
    """argmin_{x >= 0} ||a x - y||_2 (Lawson and Hanson's active-set method, float64)."""
    a, y = np.asarray(a, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(a).max(initial=0.0)) * float(np.abs(y).max(initial=0.0)))
    for _ in range(max_iter or 3 * n + 10):
        gradient = a.T @ (y - a @ x)  # [n] descent direction of the free coordinates
        free = ~passive & (gradient > tol)
        if not free.any():
            break
        passive[np.argmax(np.where(~passive, gradient, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                break
            blocking = passive & (z <= 0)
            step = np.min(x[blocking] / (x[blocking] - z[blocking]))
            x = x + step * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = z
    return x


def fit_convex_curve(points: Iterable[tuple[float, float]], weights: Iterable[float] | None = None,
                     ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Knots and values of the least-squares non-decreasing convex piecewise-linear fit.

    With distinct profiled sizes x_0 < ... < x_{m-1} (repeated sizes count once per sample), every
    non-decreasing convex piecewise-linear function with knots there is

        f(x) = c + b (x - x_0) + sum_k a_k (x - x_k)_+,    k = 1..m-2,  b >= 0,  a_k >= 0,

    (b: the first slope; a_k: the slope increase at knot k).  Minimising sum w (y - f(x))^2 over
    every sample (``weights``: one per sample, default 1) is a non-negative least-squares problem in
    (b, a) once the free intercept c is projected out, so the fit is exact; the function returns f
    at the knots.
    """
    points = list(points)
    sample_weights = [1.0] * len(points) if weights is None else [float(w) for w in weights]
    if len(sample_weights) != len(points) or any(not w > 0 for w in sample_weights):
        raise CostModelError("a cost curve's sample weights must be one positive number per sample")
    groups: dict[float, list[tuple[float, float]]] = defaultdict(list)
    for (n, seconds), w in zip(points, sample_weights):
        groups[float(n)].append((float(seconds), w))
    if not groups:
        raise CostModelError("cannot fit a cost curve to zero samples")
    knots = np.array(sorted(groups))
    weights = np.array([sum(w for _, w in groups[k]) for k in knots], dtype=np.float64)  # [m] weight per knot
    means = np.array([sum(s * w for s, w in groups[k]) for k in knots]) / weights  # [m] weighted means
    if knots.size == 1:
        return (float(knots[0]),), (float(means[0]),)
    basis = np.stack([knots - knots[0]] + [np.maximum(knots - k, 0.0) for k in knots[1:-1]], axis=1)  # [m, m-1]
    # weighted least squares on the means equals least squares on every sample (up to a constant)
    w = weights / weights.sum()
    centred = basis - w @ basis  # the intercept's optimum absorbs the weighted means
    root = np.sqrt(weights)[:, None]
    coef = nnls(root * centred, root[:, 0] * (means - w @ means))
    intercept = float(w @ means - (w @ basis) @ coef)
    values = intercept + basis @ coef
    return tuple(float(k) for k in knots), tuple(float(v) for v in values)


CURVE_SHAPES = ("measured", "convex")


def fit_verify_curve(points: Iterable[tuple[float, float]], weights: Iterable[float] | None = None, *,
                     shape: str = "measured") -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Knots and values of one context's C_v from (n, seconds) samples.

    ``"measured"`` (default): a knot at every sampled n, valued at its samples' median (weighted:
    their weighted mean), the curve linear between them.  Measured verify times need not be
    monotone or convex in n: on a 2-core Zen 5 in bf16, forwards of 3, 7 and 11 tokens took 25 %
    longer than forwards of 4, 8 and 12, so a policy priced by a smoothed curve builds trees of the
    slow sizes believing them cheap.  ``"convex"``: the convex fit (`fit_convex_curve`) of the
    samples with n >= 2, and the one-token forward as measured (its median, capped by the fit at the
    first knot so the curve stays non-decreasing) -- a CPU runs a one-token forward through another
    kernel (matrix-vector), so a convex fit through both would price an AR step far above its cost;
    the shape CaDDTree's published method regresses.  ``weights``: as in `fit_convex_curve`."""
    if shape not in CURVE_SHAPES:
        raise CostModelError(f"curve shape must be one of {CURVE_SHAPES}, got {shape!r}")
    points = [(float(n), float(s)) for n, s in points]
    w = [1.0] * len(points) if weights is None else [float(x) for x in weights]
    if shape == "measured":
        return _per_size(points, w, weighted=weights is not None)
    single = [(s, x) for (n, s), x in zip(points, w) if n == 1]
    many = [(p, x) for p, x in zip(points, w) if p[0] >= 2]
    if not single or not many:
        return fit_convex_curve(points, w)
    knots, values = fit_convex_curve([p for p, _ in many], [x for _, x in many])
    if weights is not None:
        one = sum(s * x for s, x in single) / sum(x for _, x in single)
        return (1.0, *knots), (min(one, values[0]), *values)
    return (1.0, *knots), (min(float(np.median([s for s, _ in single])), values[0]), *values)


def _per_size(points: list[tuple[float, float]], weights: list[float], *,
              weighted: bool) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """One knot per distinct n: the median of its samples (their weighted mean when ``weighted``)."""
    if not points:
        raise CostModelError("cannot fit a verify curve to zero samples")
    by_size: dict[float, list[tuple[float, float]]] = defaultdict(list)
    for (n, s), x in zip(points, weights):
        by_size[n].append((s, x))
    knots = tuple(sorted(by_size))
    if weighted:
        values = tuple(sum(s * x for s, x in by_size[n]) / sum(x for _, x in by_size[n]) for n in knots)
    else:
        values = tuple(float(np.median([s for s, _ in by_size[n]])) for n in knots)
    return knots, values


def _interp_curve(n: torch.Tensor, knots: tuple[float, ...], values: tuple[float, ...]) -> torch.Tensor:
    """Piecewise-linear curve at ``n``, continued with its end slopes (flat for a single knot); past
    the last knot never falling (a measured curve may end on a cheaper size than the one before it,
    which says nothing about larger trees)."""
    if len(knots) == 1:
        return torch.full_like(n, values[0])
    x = torch.tensor(knots, dtype=torch.float64)
    y = torch.tensor(values, dtype=torch.float64)
    seg = (torch.searchsorted(x, n, right=True) - 1).clamp(0, len(knots) - 2)  # segment of each n
    slope = (y[seg + 1] - y[seg]) / (x[seg + 1] - x[seg])
    slope = torch.where(n > x[-1], slope.clamp_min(0.0), slope)
    return (y[seg] + slope * (n - x[seg])).clamp_min(0.0)


def _interp_point(n: float, knots: tuple[float, ...], values: tuple[float, ...]) -> float:
    """`_interp_curve` at one size, in Python floats (the same operations in the same order)."""
    if len(knots) == 1:
        return values[0]
    seg = min(max(bisect.bisect_right(knots, n) - 1, 0), len(knots) - 2)  # the segment of n
    slope = (values[seg + 1] - values[seg]) / (knots[seg + 1] - knots[seg])
    if n > knots[-1]:
        slope = max(slope, 0.0)
    return max(values[seg] + slope * (n - knots[seg]), 0.0)


def _check_curve(ctx: int, knots: tuple[float, ...], values: tuple[float, ...]) -> None:
    if not knots or len(knots) != len(values):
        raise CostModelError(f"context {ctx}: {len(knots)} knots and {len(values)} values; "
                             "a curve needs one value per knot, and at least one")
    for name, seq in (("knots", knots), ("values", values)):
        if any(isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) for v in seq):
            raise CostModelError(f"context {ctx}: {name} must be finite numbers, got {list(seq)}")
    if list(knots) != sorted(set(knots)):
        raise CostModelError(f"context {ctx}: knots must be distinct and ascending, got {list(knots)}")
    if min(values) < 0:
        raise CostModelError(f"context {ctx}: verify seconds must be >= 0, got {list(values)}")


@attrs.frozen
class ConvexCost(CostModel):
    """Non-decreasing convex C_v(n) per profiled context length, interpolated across contexts."""

    draft: float  # C_d, seconds per drafter forward
    contexts: tuple[int, ...]  # profiled context lengths, ascending
    knots: tuple[tuple[float, ...], ...]  # per context: token counts n of the curve's knots
    values: tuple[tuple[float, ...], ...]  # per context: C_v at those knots, seconds

    def __attrs_post_init__(self) -> None:
        _check_seconds("draft", self.draft)
        if not self.contexts or list(self.contexts) != sorted(set(self.contexts)):
            raise CostModelError(f"contexts must be distinct and ascending, got {list(self.contexts)}")
        if not len(self.contexts) == len(self.knots) == len(self.values):
            raise CostModelError(f"{len(self.contexts)} contexts, {len(self.knots)} knot lists and "
                                 f"{len(self.values)} value lists: need one of each per context")
        for ctx, k, v in zip(self.contexts, self.knots, self.values):
            _check_curve(ctx, k, v)

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, int, float]], draft: float) -> ConvexCost:
        """Fit from measured (n tokens, context length, seconds) samples; see `fit_convex_curve`."""
        by_context: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for n, ctx, seconds in samples:
            by_context[int(ctx)].append((n, seconds))
        if not by_context:
            raise CostModelError("cannot fit a cost model to zero samples")
        contexts = tuple(sorted(by_context))
        curves = [fit_convex_curve(by_context[c]) for c in contexts]
        return cls(draft, contexts, tuple(k for k, _ in curves), tuple(v for _, v in curves))

    @property
    def draft_cost(self) -> float:
        return self.draft

    def verify_cost(self, n: torch.Tensor, ctx: int) -> torch.Tensor:
        n = torch.as_tensor(n, dtype=torch.float64)
        return sum(w * _interp_curve(n, self.knots[i], self.values[i]) for i, w in self._blend(ctx))

    def verify_seconds(self, n: float, ctx: int) -> float:
        """One size without tensors (the live cost model asks a few dozen of these a round): the
        same curve as `verify_cost`, float for float."""
        return sum(w * _interp_point(float(n), self.knots[i], self.values[i]) for i, w in self._blend(ctx))

    def _blend(self, ctx: int) -> tuple[tuple[int, float], ...]:
        """(profiled context, weight) pairs whose curves make the one at ``ctx``: the nearest one outside
        the profiled range or at a profiled length, else the two around it, linear in ctx."""
        hi = bisect.bisect_left(self.contexts, ctx)
        if hi == 0 or hi == len(self.contexts) or self.contexts[hi] == ctx:  # outside, or profiled
            return ((min(hi, len(self.contexts) - 1), 1.0),)
        w = (ctx - self.contexts[hi - 1]) / (self.contexts[hi] - self.contexts[hi - 1])
        return (hi - 1, 1.0 - w), (hi, w)

    def with_draft(self, draft: float) -> ConvexCost:
        """The same verify curves with another C_d (one profile serves several drafters)."""
        return attrs.evolve(self, draft=draft)

    def to_dict(self) -> dict:
        return {"kind": "convex", "draft": self.draft, "contexts": list(self.contexts),
                "knots": [list(k) for k in self.knots], "values": [list(v) for v in self.values]}


# ---------------------------------------------------------------------------- reading
_FIELDS = {"linear": ("draft", "base", "per_token"), "convex": ("draft", "contexts", "knots", "values")}


def cost_model_from_dict(data: object, where: str = "cost model") -> CostModel:
    """A cost model from its `CostModel.to_dict` form; `CostModelError` naming ``where`` and the field."""
    if not isinstance(data, dict):
        raise CostModelError(f"{where}: expected a JSON object, got {type(data).__name__}")
    kind = data.get("kind")
    if kind not in _FIELDS:
        raise CostModelError(f"{where}: unknown cost model kind {kind!r}; expected 'linear' or 'convex'")
    missing = [f for f in _FIELDS[kind] if f not in data]
    if missing:
        raise CostModelError(f"{where}: a {kind} cost model needs the field(s) {', '.join(missing)}")
    try:
        if kind == "linear":
            return LinearCost(data["draft"], data["base"], data["per_token"], data.get("per_context", 0.0))
        lists = [data[f] for f in ("contexts", "knots", "values")]
        if not all(isinstance(v, list) for v in lists) or not all(isinstance(r, list) for r in lists[1] + lists[2]):
            raise CostModelError("contexts must be a list, knots and values lists of lists")
        return ConvexCost(data["draft"], tuple(data["contexts"]), tuple(tuple(k) for k in data["knots"]),
                          tuple(tuple(v) for v in data["values"]))
    except CostModelError as exc:
        raise CostModelError(f"{where}: {exc}") from None
    except TypeError as exc:
        raise CostModelError(f"{where}: a field has the wrong type ({exc})") from None


def load_cost_model(path: str | Path) -> CostModel:
    """Read a cost model written by ``CostModel.save``; `CostModelError` names the file and the problem."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CostModelError(f"no cost model file at {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CostModelError(f"{path}: cannot read the cost model ({exc})") from None
    except json.JSONDecodeError as exc:
        raise CostModelError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    return cost_model_from_dict(data, str(path))


# Measured once on one 2-core CPU (SmolLM2-135M in bf16, 300-token cache, verify of 1/8/16/65 tokens,
# the block-16 drafter).  Named for reproducing that session's runs; never a default: a machine's
# own model comes from `treespec.pricing.profile`.
COST_PRESETS: dict[str, CostModel] = {
    "smollm2-cpu-bf16": ConvexCost.fit([(1, 300, 0.0233), (8, 300, 0.0253), (16, 300, 0.0292),
                                        (65, 300, 0.0602)], draft=0.0078),
}


def resolve_cost_model(spec: str | Path) -> CostModel:
    """``preset:NAME`` (a `COST_PRESETS` entry) or the path of a cost model JSON file."""
    text = str(spec)
    if text.startswith("preset:"):
        name = text.removeprefix("preset:")
        if name not in COST_PRESETS:
            raise CostModelError(f"unknown cost preset {name!r}; available: {', '.join(sorted(COST_PRESETS))}")
        return COST_PRESETS[name]
    return load_cost_model(text)
