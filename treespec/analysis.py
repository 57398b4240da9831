"""Quantities of a draft tree: its expected acceptance under the drafter, its accepted length on given tokens.

Contract
--------
``accepted_length(tree, future)`` is the tau of the match verifier's walk when the target's tokens
after the root are ``future``: what trace replay and held-out evaluation count.

``expected_acceptance(tree, draft)`` is the expected acceptance length (accepted draft tokens plus
the bonus token) of ``tree`` if the target sampled exactly from the drafter's own distribution:

    E[tau] = 1 + sum over non-root nodes of P(the node's whole path is drawn),

because at most one node per depth lies on the accepted path and a node is accepted exactly when
its path is drawn.  For a factorized draft (``draft.scorer is None``) the path probability is the
product of the marginals of the path's tokens, recomputed here in float64 from
``draft.logprobs``, so any tree over that draft can be scored (a static tree, another policy's
tree).  For a conditional draft the path probabilities are the exp of the tree's own scores: the
path log-probs the policy recorded under the scorer's (top-M renormalised) distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from treespec.interfaces import DraftOutput
from treespec.tree import DraftTree

__all__ = ["accepted_length", "accepted_path", "expected_acceptance", "path_logprobs"]


def path_logprobs(tree: DraftTree, draft: DraftOutput) -> torch.Tensor:
    """[N] float64 log-probability of each node's path under the draft's marginals (root 0)."""
    if tree.max_depth > draft.depth:
        raise ValueError(f"tree depth {tree.max_depth} exceeds the draft's {draft.depth} drafted positions")
    if tree.num_nodes > 1 and int(tree.tokens[1:].max()) >= draft.vocab_size:
        raise ValueError(f"tree holds a token id >= the draft's vocabulary size {draft.vocab_size}")
    lp = draft.logprobs.to(tree.device, torch.float64)
    own = torch.zeros(tree.num_nodes, dtype=torch.float64, device=tree.device)
    own[1:] = lp[tree.depths[1:] - 1, tree.tokens[1:]]  # each node's own token log-prob at its depth
    out = own.clone()
    for depth in range(2, tree.max_depth + 1):  # parents are complete before their children
        rows = (tree.depths == depth).nonzero().flatten()
        out[rows] = out[tree.parents[rows]] + own[rows]
    return out


def expected_acceptance(tree: DraftTree, draft: DraftOutput) -> float:
    """Expected acceptance length of ``tree`` under the drafter's own distribution (module docstring)."""
    if tree.root_token != draft.root_token:
        raise ValueError(f"tree root {tree.root_token} is not the draft's root token {draft.root_token}")
    if draft.scorer is None:
        logp = path_logprobs(tree, draft)[1:]
    else:
        logp = tree.scores[1:].double()
    return 1.0 + float(logp.exp().sum())


def accepted_path(tree: DraftTree, future: Sequence[int]) -> list[int]:
    """Node indices of the match verifier's walk, root first, when the target's tokens are ``future``
    (the trajectory after the root): from the root, step to the lowest-index child holding the next
    token."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    path = [0]
    for i in range(1, len(tokens)):  # a child's index exceeds its parent's: one pass finds the walk
        depth = len(path) - 1
        if parents[i] == path[-1] and depth < len(future) and tokens[i] == future[depth]:
            path.append(i)
    return path


def accepted_length(tree: DraftTree, future: Sequence[int]) -> int:
    """tau of the match verifier's walk (`accepted_path`): the accepted nodes, the root's bonus included."""
    return len(accepted_path(tree, future))
