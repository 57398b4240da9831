"""Recursive rejection sampling over children drawn without replacement: lossless for sampled trees.

The multi-draft rule of SpecInfer (Miao et al., 2024: "multi-step speculative sampling"), in its
without-replacement form (Jeon et al., 2024, "Recursive Speculative Decoding"; Sequoia, Chen et
al., 2024, uses the same rule for its sampled trees).

Contract
--------
The tree must come from a policy declaring ``samples_from_draft``, with its `Proposals`: node n's
children x_1, x_2, ... (in node order) were drawn from q_n without replacement, and whether a
draw entered the tree does not depend on its token (policies/sampled.py says why theirs qualify).
The walk starts at the root with p = the target's distribution at the node (softmax of the
filtered logits / T) and q = q_n; for each child x_i in turn, with a fresh uniform u:

* accept x_i if u < min(1, p(x_i) / q(x_i)): move to x_i and start again there;
* otherwise  p <- normalise(max(p - q, 0))  and  q <- q with x_i removed, renormalised.

When a node's children are all rejected (or it has none) the bonus is drawn from the current p.
Each step is one Leviathan rejection step with proposal q, whose i-th child is exactly a draw from
the q it is tested against; by induction over the children the token leaving node n has
distribution p_n, and by induction over depth the committed path has the target's distribution.
A rejected x_i has p(x_i) <= q(x_i), so the residual gives it no mass, as removing it from q
requires.  At T = 0 the rule reduces to match verification (and is run as it).  Uniforms and
residual draws come from the caller's generator stream.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from treespec.interfaces import DraftOutput, Proposals, SamplingParams, Verifier, VerifyResult
from treespec.sampling import sample_from_probs, target_probs, target_tokens
from treespec.tree import DraftTree
from treespec.verifiers.match import check_logits, walk_matches

__all__ = ["RecursiveRejectionVerifier", "SampledTreeVerifier", "check_proposals"]


def check_proposals(tree: DraftTree, proposals: Proposals | None, verifier: str) -> Proposals:
    """The tree's proposals, one row per node, or a clear error."""
    if proposals is None:
        raise ValueError(f"the {verifier} verifier needs the Proposals a sampled tree's children were drawn "
                         "from (a policy declaring samples_from_draft, at temperature > 0)")
    if proposals.tokens.shape[0] != len(tree):
        raise ValueError(f"proposals have {proposals.tokens.shape[0]} rows for a tree of {len(tree)} nodes")
    return proposals


class SampledTreeVerifier(Verifier):
    """A verifier that uses each node's q, so needs a sampled tree and its `Proposals`: at T = 0 it is
    match verification; at T > 0 `verify_sampled` gets the target's law at every node."""

    requires_sampled_tree = True

    def verify(self, tree: DraftTree, target_logits: torch.Tensor, *, sampling: SamplingParams,
               generator: torch.Generator | None, position: int,
               draft: DraftOutput | None = None, proposals: Proposals | None = None) -> VerifyResult:
        check_logits(tree, target_logits)
        if sampling.greedy:
            return walk_matches(tree, target_tokens(target_logits, tree.depths + position, sampling, None))
        if generator is None:
            raise ValueError(f"the {self.name} verifier at temperature > 0 needs an explicit torch.Generator")
        proposals = check_proposals(tree, proposals, self.name)
        return self.verify_sampled(tree, target_probs(target_logits, sampling), proposals, generator)

    @abstractmethod
    def verify_sampled(self, tree: DraftTree, p_rows: torch.Tensor, proposals: Proposals,
                       generator: torch.Generator) -> VerifyResult:
        """The accepted path and bonus at T > 0; ``p_rows`` [N, V] is the target's law at every node."""


class RecursiveRejectionVerifier(SampledTreeVerifier):
    """SpecInfer / RSD recursive rejection sampling over sampled children (module docstring)."""

    name = "recursive-rejection"

    def verify_sampled(self, tree: DraftTree, p_rows: torch.Tensor, proposals: Proposals,
                       generator: torch.Generator) -> VerifyResult:
        path = [0]
        while True:
            node = path[-1]
            p = p_rows[node].clone()  # [V]
            child = self.first_accepted(tree, node, p, proposals.probs(node, p.numel()), generator)
            if child is None:
                return VerifyResult(torch.tensor(path, dtype=torch.int64, device=tree.device),
                                    sample_from_probs(p, generator))
            path.append(child)

    def first_accepted(self, tree: DraftTree, node: int, p: torch.Tensor, q: torch.Tensor,
                       generator: torch.Generator) -> int | None:
        """The first child of ``node`` accepted, or None; ``p`` [V] is left as the residual to draw from."""
        tokens = tree.tokens.tolist()
        for child in tree.children[node]:
            x = tokens[child]
            if float(q[x]) <= 0.0:
                raise ValueError(f"child token {x} of node {node} has proposal probability 0: the tree was not "
                                 "drawn from its proposals")
            u = float(torch.rand((), dtype=torch.float64, generator=generator, device=generator.device))
            if u < min(1.0, float(p[x] / q[x])):
                return child
            self.after_rejection(p, q, x)
        return None

    @staticmethod
    def after_rejection(p: torch.Tensor, q: torch.Tensor, x: int) -> None:
        """In place, after child token x is rejected: p <- norm(max(p - q, 0)), q <- q without x, renormalised."""
        residual = (p - q).clamp_min(0.0)  # [V]
        total = float(residual.sum())
        if total > 0.0:  # zero only when p == q, where the acceptance test always accepts
            p.copy_(residual / total)
        q[x] = 0.0
        q /= q.sum().clamp_min(torch.finfo(q.dtype).tiny)
