"""Per-round and per-generation measurements returned by the decoder.

Contract: times are wall-clock seconds measured by the decoding loop (synchronised on CUDA), never
inside a policy.  Acceptance length tau counts accepted draft tokens plus the bonus token.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import attrs
import torch

if TYPE_CHECKING:
    from treespec.interfaces import CalibrationMap, PricedCurve

__all__ = ["GenerationResult", "GenerationStats", "RoundStats", "STAGES"]

STAGES = ("draft", "build", "verify", "commit")  # the timed stages of one round


@attrs.frozen
class RoundStats:
    """One draft-build-verify-commit round."""

    tau: int  # accepted draft tokens + 1
    tree_size: int  # nodes in the verified tree, root included
    times: dict[str, float]  # seconds per stage, keys from STAGES
    explored: bool = False  # the draft controller took this round to explore (`treespec.interfaces.Decision`)
    drafted: bool = True  # the drafter was asked (False: an AR round its controller decided, or AR decoding)
    priced_with: PricedCurve | None = None  # the curve the policy's cost model priced this round's tree with
    calibrated_with: CalibrationMap | None = None  # the map a live calibration gave this round (None: none live)
    tree_seed: int | None = None  # a sampled tree's noise seed (`Proposals.seed`); None: built deterministically


@attrs.define
class GenerationStats:
    """Everything measured while generating one response."""

    rounds: list[RoundStats] = attrs.field(factory=list)  # in order
    prefill_time: float = 0.0  # seconds spent on the prompt (excluded from decode speed)
    decode_time: float = 0.0  # seconds from the first round to the last commit
    new_tokens: int = 0  # tokens emitted (after truncation to max_new_tokens / stop)
    undrafted: bool = False  # the draft controller declined the generation: decoded without drafting

    @property
    def taus(self) -> list[int]:
        return [r.tau for r in self.rounds]

    @property
    def mean_tau(self) -> float:
        return statistics.fmean(self.taus) if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def time_per_token(self) -> float:
        return self.decode_time / self.new_tokens if self.new_tokens else 0.0

    def stage_totals(self) -> dict[str, float]:
        """Seconds per stage summed over rounds."""
        return {s: sum(r.times.get(s, 0.0) for r in self.rounds) for s in STAGES}

    def as_dict(self) -> dict:
        """JSON-ready summary (per-round taus and stage totals)."""
        return {"taus": self.taus, "mean_tau": self.mean_tau, "new_tokens": self.new_tokens,
                "prefill_time": self.prefill_time, "decode_time": self.decode_time,
                "stage_times": self.stage_totals()}


@attrs.frozen(eq=False)
class GenerationResult:
    """Generated tokens (prompt excluded) and the measurements of the run."""

    tokens: torch.Tensor  # [n_new] int64
    stats: GenerationStats
