"""Rebuilding the drafts of a trace: the `DraftOutput` recorded at any anchor, without the drafter.

Contract
--------
``ReplayDrafts.of(trace, kind).draft(index, anchor, position)`` returns anchor row ``index``'s draft:
the recorded marginal tokens at their log-probs and -inf elsewhere, and, when the drafter's draft
carried a `RecordableScorer`, that scorer rebuilt by its class's ``replayer`` (found in the
registry by the recorded kind) from the round's tensors.
"""

from __future__ import annotations

import torch

from treespec.apps.replay.trace import DrafterRecord, Trace, TraceError, scorer_class
from treespec.interfaces import DraftOutput

__all__ = ["ReplayDrafts"]


class ReplayDrafts:
    """Rebuilds the `DraftOutput` recorded at any anchor of one drafter."""

    @classmethod
    def of(cls, trace: Trace, kind: str) -> ReplayDrafts:
        """The draft rebuilder of ``trace``'s drafter ``kind`` ("dflash", "domino")."""
        if kind not in trace.drafters:
            raise TraceError(f"the trace recorded no {kind} drafter; it has {sorted(trace.drafters) or 'none'}")
        return cls(trace.drafters[kind], trace.meta["drafters"][kind])

    def __init__(self, record: DrafterRecord, meta: dict) -> None:
        self.record, self.meta = record, meta
        self.depth, self.vocab = int(meta["depth"]), int(meta["vocab_size"])
        self.starts = torch.cat([torch.zeros(1, dtype=torch.int64), record.counts.sum(1).cumsum(0)]).tolist()
        scorer = meta["scorer"]
        self.scorer = None if scorer is None else scorer_class(scorer["kind"]).replayer(record.scorer.shared, scorer, self.vocab)

    @property
    def num_anchors(self) -> int:
        return self.record.counts.shape[0]

    def draft(self, index: int, anchor: int, position: int) -> DraftOutput:
        """The draft of anchor row ``index`` (token ``anchor`` at absolute ``position``)."""
        if not 0 <= index < self.num_anchors:
            raise IndexError(f"anchor {index} out of range: the trace holds {self.num_anchors}")
        logprobs = self._marginals(index)
        scorer = None
        if self.scorer is not None:
            scorer = self.scorer({name: t[index] for name, t in self.record.scorer.rounds.items()}, anchor)
        return DraftOutput(logprobs=logprobs, root_token=anchor, position=position, scorer=scorer)

    def _marginals(self, index: int) -> torch.Tensor:
        start, end = self.starts[index], self.starts[index + 1]
        depth_of = torch.repeat_interleave(torch.arange(self.depth), self.record.counts[index])  # [n]
        flat = torch.full((self.depth * self.vocab,), float("-inf"))
        flat[depth_of * self.vocab + self.record.tokens[start:end].long()] = self.record.logprobs[start:end]
        return flat.view(self.depth, self.vocab)  # [L, V]
