"""Confident trees: DDTree and DominoTree that stop growing where the target would not follow.

Contract
--------
``ConfidentDDTree(budget=16, min_rate=0.02)`` and ``ConfidentDominoTree(budget=16, top_m=64,
node_topk=8, min_rate=0.02)`` build their parent's best-first tree up to the budget, and stop at the
first candidate (in pop order: path probability descending) whose path probability falls under a
floor θ: a round whose draft is sure builds its full budget and deep; an unsure one builds fewer
nodes (an adaptive budget and depth from the draft's own confidence, beside CaDDTree's cost rule).

θ is learned from what the target accepted (a `LearnedFloor`, through `TreePolicy.observe_round`):
it keeps every verified node's path probability δ = exp(score) and whether the target accepted its
whole path, over the last ``window`` nodes, fits the acceptance rate as a non-decreasing function of
δ (isotonic regression, pool adjacent violators) and sets θ to the smallest δ whose fitted rate
reaches ``min_rate``: nodes under θ are accepted less often than that.  Until ``min_nodes`` nodes are
seen θ is 0 (the parent policy's trees).  The stop rule reads θ at each build; given the same
observations a draft builds the same tree.  θ and its nodes are the policy's ``learned_state``,
kept per drafter by `treespec profile-cost --calibrate` as the learned acceptance is
(policies/learned.py).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import ClassVar

import attrs
import numpy as np
import torch

from treespec.interfaces import DraftOutput, RoundReport
from treespec.policies.dominotree import corrected_source, require_scorer
from treespec.policies.engine.best_first import BestFirstPolicy, budget_field, check_logprobs, count_field
from treespec.policies.engine.candidates import ScorerSource, TopTokens
from treespec.policies.engine.stop import StopRule
from treespec.tree import DraftTree

__all__ = ["ConfidentDDTree", "ConfidentDominoTree", "FloorStop", "LearnedFloor", "isotonic"]


@attrs.frozen
class FloorStop(StopRule):
    """Stop at the first candidate whose path probability is under ``floor``."""

    floor: float  # θ in [0, 1]

    def _log(self) -> float:
        """log θ rounded to float32, as the scores it is compared with (both backends alike)."""
        return float(np.float32(math.log(self.floor))) if self.floor > 0 else -math.inf

    def reference(self, draft: DraftOutput, budget: int) -> Callable[[float], bool]:
        bound = self._log()
        return lambda score: score < bound

    def keep(self, draft: DraftOutput, scores: torch.Tensor) -> torch.Tensor:
        return (scores >= self._log()).sum()  # pop order: scores never rise, so the kept are a prefix


def isotonic(y: np.ndarray) -> np.ndarray:
    """The non-decreasing least-squares fit of ``y`` (pool adjacent violators)."""
    values, weights = [], []
    for v in y.tolist():
        values.append(float(v)), weights.append(1.0)
        while len(values) > 1 and values[-2] > values[-1]:
            w = weights[-2] + weights[-1]
            values[-2:] = [(values[-2] * weights[-2] + values[-1] * weights[-1]) / w]
            weights[-2:] = [w]
    return np.repeat(values, np.array(weights, dtype=int))


@attrs.define(eq=False)
class LearnedFloor:
    """θ learned from verified nodes (module docstring)."""

    min_rate: float = 0.02  # nodes whose fitted acceptance rate is under this are not worth verifying
    window: int = 4096  # most recent nodes the fit reads
    min_nodes: int = 256  # nodes before the first fit (θ = 0 until then)
    refit_every: int = 8  # drafted rounds between fits
    floor: float = 0.0  # θ now
    nodes: deque = attrs.field(factory=deque)  # (log δ, accepted) of the last nodes
    rounds: int = 0  # drafted rounds since the last fit

    def observe(self, tree: DraftTree, accepted: list[int]) -> None:
        on = set(accepted)
        for i, score in enumerate(tree.scores.tolist()[1:], start=1):
            self.nodes.append((score, float(i in on)))
        while len(self.nodes) > self.window:
            self.nodes.popleft()
        self.rounds += 1
        if self.rounds >= self.refit_every and len(self.nodes) >= self.min_nodes:
            self.floor, self.rounds = self.fit(), 0

    def fit(self) -> float:
        """The smallest δ whose fitted acceptance rate reaches ``min_rate`` (0 when the lowest does)."""
        data = np.array(sorted(self.nodes))  # [n, 2] by log δ ascending
        rate = isotonic(data[:, 1])
        reached = np.nonzero(rate >= self.min_rate)[0]
        if reached.size == 0 or reached[0] == 0:
            return 0.0
        return float(math.exp(data[reached[0], 0]))


def _floor_field():
    return attrs.field(factory=LearnedFloor, metadata={"option": False})  # learned, not a method option


class _Confident:
    """What both policies share: the floor's stop rule and its feedback."""

    learns: ClassVar[bool] = True

    floor: LearnedFloor
    min_rate: float

    def __attrs_post_init__(self) -> None:
        if not 0 < self.min_rate < 1:
            raise ValueError(f"min_rate must be in (0, 1), got {self.min_rate}")
        self.floor.min_rate = self.min_rate

    @property
    def stop(self) -> FloorStop:
        return FloorStop(self.floor.floor)

    def observe_round(self, report: RoundReport) -> None:
        if report.drafted and len(report.tree) > 1:
            self.floor.observe(report.tree, report.result.accepted.tolist())

    def learned_state(self) -> dict:
        return {"floor": self.floor.floor, "nodes": [list(node) for node in self.floor.nodes]}

    def restore_learned(self, state) -> None:
        floor, nodes = float(state["floor"]), [(float(s), float(y)) for s, y in state["nodes"]]
        if not 0 <= floor <= 1 or any(s > 0 or y not in (0.0, 1.0) for s, y in nodes):
            raise ValueError("a learned floor must lie in [0, 1] over nodes of log-probability <= 0, accepted 0 or 1")
        self.floor.floor = floor
        self.floor.nodes = deque(nodes[-self.floor.window:], maxlen=None)


@attrs.frozen
class ConfidentDDTree(_Confident, BestFirstPolicy):
    """DDTree stopped under the learned floor (module docstring)."""

    name: ClassVar[str] = "confident-ddtree"

    budget: int = budget_field(16)  # most non-root nodes per round
    min_rate: float = 0.02  # the acceptance rate under which a node is not worth verifying
    floor: LearnedFloor = _floor_field()  # θ, learned from verified rounds

    def validate(self, draft: DraftOutput) -> None:
        check_logprobs(draft)

    def candidates(self, draft: DraftOutput) -> TopTokens:
        return TopTokens(draft.logprobs, self.budget)


@attrs.frozen
class ConfidentDominoTree(_Confident, BestFirstPolicy):
    """DominoTree stopped under the learned floor (module docstring)."""

    name: ClassVar[str] = "confident-dominotree"
    uses_scorer: ClassVar[str] = "required"

    budget: int = budget_field(16)  # most non-root nodes per round
    top_m: int = count_field(64)  # base candidates per depth the correction is normalised over
    node_topk: int = count_field(8)  # children kept per expanded node
    min_rate: float = 0.02  # the acceptance rate under which a node is not worth verifying
    floor: LearnedFloor = _floor_field()  # θ, learned from verified rounds

    def validate(self, draft: DraftOutput) -> None:
        require_scorer(draft, "confident DominoTree")

    def candidates(self, draft: DraftOutput) -> ScorerSource:
        return corrected_source(draft, self.top_m, self.node_topk)
