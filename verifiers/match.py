"""Match verification ("naive sampling"): lossless for any tree, at any temperature.

Contract
--------
The target chooses one token at every node (`treespec.sampling.target_tokens`: argmax at T = 0, a
draw from the filtered softmax(logits / T) at T > 0).  The walk starts at the root; while the
target's token at the current node equals the token of one of its children, it moves to that child
(the lowest-index one should a policy ever propose two equal siblings).  The target's token at the
node where the walk stops is the bonus.  Every committed token is therefore a token the target chose
given exactly the committed prefix, so the output has the target's distribution, whatever the tree.

The walk reads the target's choice only at the nodes it visits, so drawing noise for the other
nodes (which the vectorised sampler does) changes nothing.
"""

from __future__ import annotations

import math

import torch

from treespec.interfaces import DraftOutput, Proposals, SamplingParams, Verifier, VerifyResult
from treespec.sampling import target_tokens
from treespec.tree import DraftTree

__all__ = ["MatchVerifier", "check_logits", "walk_matches"]


def check_logits(tree: DraftTree, target_logits: torch.Tensor) -> None:
    """The logits must be [N, V] for this tree, NaN-free, and wide enough for the tree's tokens."""
    if target_logits.dim() != 2 or target_logits.shape[0] != len(tree):
        raise ValueError(f"target_logits must be [N={len(tree)}, V], got {tuple(target_logits.shape)}")
    top = int(tree.tokens[0]) if len(tree) == 1 else int(tree.tokens.max())
    if top >= target_logits.shape[1]:
        raise ValueError(f"tree token {top} is outside the target's vocabulary of {target_logits.shape[1]}")
    if float(target_logits.max()) < math.inf:  # no NaN (it would propagate) and no +inf: the common case, one pass
        return
    nan_rows = torch.isnan(target_logits).any(-1)
    if bool(nan_rows.any()):
        raise FloatingPointError(f"target logits contain NaN at tree nodes {nan_rows.nonzero().flatten().tolist()}")
    inf_rows = torch.isposinf(target_logits).any(-1)
    if bool(inf_rows.any()):
        raise FloatingPointError(f"target logits contain +inf at tree nodes {inf_rows.nonzero().flatten().tolist()} "
                                 "(an overflow in the target's forward: try a wider dtype)")


def walk_matches(tree: DraftTree, chosen: torch.Tensor) -> VerifyResult:
    """Follow the target's per-node tokens ``chosen`` [N] from the root; the first miss is the bonus."""
    chosen_list, tokens = chosen.tolist(), tree.tokens.tolist()
    path = [0]
    while True:
        want = chosen_list[path[-1]]
        nxt = next((c for c in tree.children[path[-1]] if tokens[c] == want), None)
        if nxt is None:
            return VerifyResult(torch.tensor(path, dtype=torch.int64, device=tree.device), want)
        path.append(nxt)


class MatchVerifier(Verifier):
    """Accept the longest root path on which every draft token equals the target's own choice."""

    name = "match"
    reproduces_ar_samples = True  # every node's target token is the position-keyed draw AR makes there

    def verify(self, tree: DraftTree, target_logits: torch.Tensor, *, sampling: SamplingParams,
               generator: torch.Generator | None, position: int,
               draft: DraftOutput | None = None, proposals: Proposals | None = None) -> VerifyResult:
        check_logits(tree, target_logits)
        positions = tree.depths.to(target_logits.device) + position  # [N] where each node's choice lands
        chosen = target_tokens(target_logits, positions, sampling, generator)  # [N]
        return walk_matches(tree, chosen)
