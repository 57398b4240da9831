"""Gap DDTree: DDTree whose fan-out at each depth follows the gap between the drafter's top two.

Contract
--------
``GapDDTree(budget=16, width=8, ratio=4.0)``.  Over marginals every node of a depth shares one
distribution, so the fan-out is a depth's: where the drafter's top-1 at a depth leads its top-2 by
more than ``ratio`` (p1 / p2 > ratio) a node there keeps one child, elsewhere up to ``width``, best
first; the budget goes to the depths where the drafter is unsure (JetSpec's fan-out by the
top-1/top-2 gap).  Otherwise DDTree: a best-first tree over path log-probs, at most ``budget``
nodes.  Over a path-dependent drafter the same rule per node is `PrunedDominoTree(rule="ratio")`.
"""

from __future__ import annotations

import math
from typing import ClassVar

import attrs

from treespec.interfaces import DraftOutput
from treespec.policies.engine.best_first import BestFirstPolicy, budget_field, check_logprobs, count_field
from treespec.policies.engine.candidates import FactorizedSource
from treespec.topk import exact_topk

__all__ = ["GapDDTree"]


def _ratio(instance, attribute, value) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 1:
        raise ValueError(f"ratio must be a number >= 1 (p1 / p2), got {value!r}")


@attrs.frozen
class GapDDTree(BestFirstPolicy):
    """DDTree with a fan-out per depth by the top-1/top-2 gap (module docstring)."""

    name: ClassVar[str] = "gap-ddtree"

    budget: int = budget_field(16)  # non-root nodes per round
    width: int = count_field(8)  # children per node at a depth where the drafter is unsure
    ratio: float = attrs.field(default=4.0, validator=_ratio)  # p1 / p2 above which one child is enough
    stop = None

    def validate(self, draft: DraftOutput) -> None:
        check_logprobs(draft)

    def candidates(self, draft: DraftOutput) -> FactorizedSource:
        width = min(max(2, self.width), draft.vocab_size)
        values, tokens = exact_topk(draft.logprobs, width)  # [L, K] best first
        sure = (values[:, 0] - values[:, 1] > math.log(self.ratio)).tolist()  # [L]
        widths = [1 if s else min(self.width, width) for s in sure]
        return FactorizedSource(tuple(t[:w] for t, w in zip(tokens, widths, strict=True)),
                                tuple(v[:w] for v, w in zip(values, widths, strict=True)))
