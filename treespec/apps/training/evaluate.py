"""Held-out τ of a drafter without running the target: greedy acceptance over cached AR answers.

Contract
--------
At temperature 0 the target's output is its own greedy continuation, so a teacher-cache record
(`treespec.apps.training.teacher`) of a held-out prompt with the target's greedy response holds
everything a live round sees: the committed tokens, their hidden-state taps and the tokens the target accepts.
`heldout_tau` decodes over it as the live loop does with ``first_token="round"``: the first anchor
is the last prompt token; at an anchor at position p the drafter drafts from the features of
positions < p, the policy builds its tree, the accepted path is the longest root-to-node path whose
tokens equal the response's next tokens, the round yields that path plus the bonus token
(τ = accepted + 1), and the next anchor is the last token yielded.  Rounds stop at the end of the
stored response.

The features come from one forward over the whole sequence where a live run gets them from its
tree forwards: equal up to float rounding, so τ equals live τ up to near-ties (compare with
``treespec bench`` in float32).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import torch

from treespec.analysis import accepted_length
from treespec.interfaces import DraftContext, Drafter, TreePolicy
from treespec.training import TeacherRecord

__all__ = ["HeldoutTau", "heldout_tau", "sequence_taus"]


@attrs.frozen
class HeldoutTau:
    """Mean τ of one policy over held-out sequences."""

    policy: str  # the method's name
    tau: float  # tokens yielded per round, over every round of every sequence
    rounds: int  # rounds counted
    per_sequence: tuple[float, ...]  # mean τ of each sequence (for paired comparisons)


@torch.no_grad()
def sequence_taus(drafter: Drafter, policy: TreePolicy, record: TeacherRecord, features: torch.Tensor) -> list[int]:
    """τ of every round of greedy decoding over one record (``features`` [T, k*H]: the drafter's taps)."""
    tokens = record.tokens.tolist()
    drafter.reset()
    anchor, cached, taus = record.response_start - 1, 0, []
    while anchor + 1 < len(tokens):
        ctx = DraftContext(sequence=record.tokens[:anchor + 1], features=features[cached:anchor],
                           feature_start=cached)
        cached = anchor
        rest = tokens[anchor + 1:]
        tau = min(accepted_length(policy.build(drafter.draft(ctx)), rest), len(rest))
        taus.append(tau)
        anchor += tau
    return taus


def heldout_tau(drafter: Drafter, methods: dict[str, TreePolicy], records: Iterable[TeacherRecord],
                taps=lambda record: record.features) -> list[HeldoutTau]:
    """`HeldoutTau` of each policy in ``methods`` (name -> policy) over ``records``.

    ``taps(record)`` gives the drafter's features of a record (e.g. a subset of the cache's taps).
    """
    records = list(records)
    out = []
    for name, policy in methods.items():
        per = [sequence_taus(drafter, policy, r, taps(r).float()) for r in records]
        rounds = sum(len(t) for t in per)
        out.append(HeldoutTau(name, sum(map(sum, per)) / max(rounds, 1), rounds,
                              tuple(sum(t) / max(len(t), 1) for t in per)))
    return out
