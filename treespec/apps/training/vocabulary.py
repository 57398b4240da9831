"""The reduced draft vocabulary: the N most frequent tokens of the target's own responses.

A drafter's head over those N tokens (EAGLE-3's ``d2t``) costs N / V of the full head; tokens outside
it get -inf in the draft, so decoding stays lossless.  These functions count the training responses'
tokens and say how much of them a set covers; the set itself is `treespec.training.draft_vocabulary`
(the kernel's, since a recipe that grows a saved head ranks tokens by the same rule).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["coverage", "response_token_counts"]


def response_token_counts(sequences: Iterable[tuple[torch.Tensor, int]], vocab_size: int) -> torch.Tensor:
    """[V] int64 how often each token occurs in the responses of (tokens, response_start) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for tokens, start in sequences:
        counts += torch.bincount(tokens[start:].long().cpu(), minlength=vocab_size)[:vocab_size]
    return counts


def coverage(draft_vocab: torch.Tensor, counts: torch.Tensor) -> float:
    """Share of the counted tokens that the draft vocabulary covers."""
    return float(counts[draft_vocab].sum()) / max(int(counts.sum()), 1)
