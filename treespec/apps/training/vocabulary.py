"""The reduced draft vocabulary: the N most frequent tokens of the target's own responses.

A drafter's head over those N tokens (EAGLE-3's ``d2t``) costs N / V of the full head; tokens outside
it get -inf in the draft, so decoding stays lossless.  These functions pick the set from training data
and say how much of it the set covers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["coverage", "draft_vocabulary", "response_token_counts"]


def response_token_counts(sequences: Iterable[tuple[torch.Tensor, int]], vocab_size: int) -> torch.Tensor:
    """[V] int64 how often each token occurs in the responses of (tokens, response_start) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for tokens, start in sequences:
        counts += torch.bincount(tokens[start:].long().cpu(), minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocabulary(counts: torch.Tensor, size: int) -> torch.Tensor:
    """[size] the ``size`` most frequent token ids (ties and unseen tokens by ascending id), ascending."""
    if not 1 <= size <= counts.numel():
        raise ValueError(f"a draft vocabulary of {size} tokens needs 1 <= size <= {counts.numel()}")
    order = torch.sort(counts, descending=True, stable=True).indices  # ties keep ascending ids
    return order[:size].sort().values


def coverage(draft_vocab: torch.Tensor, counts: torch.Tensor) -> float:
    """Share of the counted tokens that the draft vocabulary covers."""
    return float(counts[draft_vocab].sum()) / max(int(counts.sum()), 1)
