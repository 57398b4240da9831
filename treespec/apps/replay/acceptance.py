"""The positional acceptance vector of a drafter, estimated from a replay trace (Sequoia's model).

Contract
--------
``fit_acceptance(trace, kind, ranks=16)`` walks every anchor of every recorded trajectory and, at
each drafted depth d that the trajectory still covers, finds the rank of the target's token (the
trajectory's token at that depth) in the recorded marginal of depth d (log-prob descending, ties
by token id; a token the trace did not record ranks past every recorded one).  p_k is the share of
those (anchor, depth) cells where that rank is k - 1, for k = 1..``ranks``: the chance that greedy
verification accepts the rank-k child of a node, pooled over depths, as Sequoia's positional model
takes it.  `Acceptance` carries the vector and how many cells it rests on; ``save`` writes JSON,
`load_acceptance` reads it back for ``sequoia``'s ``acceptance=``.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import torch

from treespec.apps.replay.rebuild import ReplayDrafts
from treespec.apps.replay.trace import Trace

__all__ = ["Acceptance", "fit_acceptance", "load_acceptance"]


@attrs.frozen
class Acceptance:
    """p_1, p_2, ... of one drafter, and what they were estimated from."""

    vector: tuple[float, ...]  # p_k: share of cells whose target token had rank k - 1
    cells: int  # (anchor, depth) cells counted
    drafter: str  # the trace's drafter kind

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(attrs.asdict(self), indent=1) + "\n")


def load_acceptance(path: str | Path) -> tuple[float, ...]:
    """The vector of a file `Acceptance.save` wrote."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "vector" not in data:
        raise ValueError(f"{path}: not an acceptance vector file (no 'vector')")
    return tuple(float(x) for x in data["vector"])


def _rank(row: torch.Tensor, token: int) -> int:
    """Rank of ``token`` in one marginal row [V] (ties by token id); past every recorded token if unrecorded."""
    value = row[token]
    if torch.isinf(value):
        return int(torch.isfinite(row).sum())
    ids = torch.arange(row.numel())
    return int(((row > value) | ((row == value) & (ids < token))).sum())


def fit_acceptance(trace: Trace, kind: str, ranks: int = 16) -> Acceptance:
    """The positional acceptance vector of the trace's ``kind`` drafter (module docstring)."""
    drafts = ReplayDrafts.of(trace, kind)
    counts, cells = torch.zeros(ranks, dtype=torch.int64), 0
    for prompt in range(trace.num_prompts):
        seq, start = trace.sequences[prompt].tolist(), trace.prompt_len(prompt) - 1
        for done in range(trace.max_new_tokens):
            anchor = start + done
            rows = drafts.draft(trace.anchor_index(prompt, done), seq[anchor], anchor).logprobs  # [L, V]
            for d in range(min(rows.shape[0], len(seq) - anchor - 1)):
                rank = _rank(rows[d], seq[anchor + 1 + d])
                cells += 1
                if rank < ranks:
                    counts[rank] += 1
    vector = tuple(round(float(c) / max(cells, 1), 6) for c in counts)
    return Acceptance(vector, cells, kind)
