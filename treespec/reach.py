"""Which tokens of a factorized draft can still enter a best-first tree of at most B nodes.

Contract
--------
In a best-first tree over per-depth log-probs ``logprobs`` [L, V] (float32), a node at depth d
(row d - 1) scores float32(parent + logp) and its parent scores at most the best depth-(d - 1)
score, the top-1 chain `best_chain`.  Float32 rounding is monotone, so a token whose
float32(chain + logp) falls below the B-th best score of some B nodes of the tree (a "floor")
can never be among the tree's B nodes.  `reachable` marks the tokens that pass; DDTree's
adaptive candidate lists and trace recording (how many tokens a replay must keep) both use it.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["best_chain", "reachable"]


def best_chain(top1: torch.Tensor) -> torch.Tensor:
    """[L] float32: 0, then the running float32 sums of the top-1 log-probs ``top1`` [L] (one rounding per step)."""
    out = [np.float32(0.0)]
    for value in top1[:-1].tolist():
        out.append(out[-1] + np.float32(value))
    return torch.tensor(np.array(out, dtype=np.float32), device=top1.device)


def reachable(logprobs: torch.Tensor, chain: torch.Tensor, floor: float | torch.Tensor) -> torch.Tensor:
    """[L, V] bool: float32(chain[d] + logprobs[d, t]) >= ``floor`` (see the module docstring)."""
    return (chain[:, None] + logprobs) >= floor
