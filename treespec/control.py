"""Whether and how much each round drafts: the draft controller's contract.

Contract
--------
A decoder asks one `DraftController` (its policy's, `TreePolicy.draft_controller`) and nothing else
whether to draft.  Before a generation, ``start_generation()`` says whether the generation may draft
at all (False: the target is run without the drafter's taps, so the generation is plain AR
decoding).  Before every round, ``decide()`` returns a `Decision`: draft or not, keep the drafter's
taps or not (once a round drops them, the generation drafts no more and the decoder stops keeping
them: the drafter would miss the taps of the tokens committed meanwhile; an engine that fixes its
taps at the prefill still computes them), and the price the round's tree is built at (the cost curve and
calibration a priced policy builds with, `TreePolicy.priced`; None: the policy's own fields).
After every round, ``observe(report)`` receives the round as measured (`RoundReport`: its tree,
accepted path, context, stage seconds, whether it drafted and explored, how many sequences one
forward verified).  The tokens committed never depend on a decision: every tree is verified
losslessly, so a controller changes speed only.

`EveryRound` (the default) drafts every round at the policy's own price, as the published loops
do: fixed-size policies and the published CaDDTree use it.  A controller that learns
(treespec/pricing/control.py) keeps its state across the generations of the decoder that asked for
it; it is deterministic in what it observed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from treespec.interfaces import CalibrationMap, PricedCurve, RoundReport

__all__ = ["Decision", "DraftController", "EveryRound"]


@attrs.frozen(eq=False)
class Decision:
    """What the next round does (module docstring)."""

    draft: bool = True  # ask the drafter this round (False: an AR step)
    taps: bool = True  # keep reading the drafter's taps (False: this generation drafts no more)
    price: PricedCurve | None = None  # the cost curve a priced policy builds this round's tree at (None: its own)
    calibration: CalibrationMap | None = None  # the calibration it builds at (None: its own)
    explore: bool = False  # the round measures what the controller does not favour (its reports count them)

    def __attrs_post_init__(self) -> None:
        if self.draft and not self.taps:
            raise ValueError("a round that drafts keeps the drafter's taps")


class DraftController(ABC):
    """Decides before each round whether and how much to draft, and learns from each round."""

    def start_generation(self) -> bool:
        """A new generation starts: whether it may draft (read the drafter's taps).  Default: True."""
        return True

    @abstractmethod
    def decide(self) -> Decision:
        """The next round's `Decision`."""

    def observe(self, report: RoundReport) -> None:
        """The round just verified, as measured.  Default: learns nothing."""


class EveryRound(DraftController):
    """Draft every round at the policy's own price (the published loops' rule)."""

    _always = Decision()

    def decide(self) -> Decision:
        return self._always
