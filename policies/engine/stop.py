"""The stop-rule interface: what ends a best-first build early (policies/engine/cost.py's cost rule is one).

Contract
--------
A `StopRule` sees the build's candidates in pop (canonical) order only, in both backends: the
networkx reference asks a fresh ``reference`` predicate candidate by candidate, the torch builder
asks ``keep`` once for the whole canonical order; ``trim`` then cuts the finished build in both.
The two must agree bit for bit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from treespec.interfaces import DraftOutput

__all__ = ["StopRule"]


class StopRule(ABC):
    """Ends a best-first build early.  It sees candidates in pop (canonical) order only."""

    @abstractmethod
    def reference(self, draft: DraftOutput, budget: int) -> Callable[[float], bool]:
        """A fresh predicate for one build: called with each popped candidate's score, in pop
        order; True means stop before adding that candidate."""

    @abstractmethod
    def keep(self, draft: DraftOutput, scores: torch.Tensor) -> torch.Tensor:
        """0-dim int64: how many of the first candidates (scores [m], pop order) the rule keeps."""

    def trim(self, draft: DraftOutput, scores: torch.Tensor) -> int:
        """How many of the kept nodes (scores [k] float32, pop order) to return, decided once the
        build has ended; both backends call it with the same scores.  Default: all of them."""
        return scores.numel()
