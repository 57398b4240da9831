"""Leviathan rejection sampling for chains: accept draft token x with probability min(1, p(x) / q(x)).

Contract
--------
Only chains (every node's parent is the previous node) are accepted; any other tree is an error.
p is the target's distribution at the node's parent (softmax of the filtered logits / T), q the
proposal that produced the drafted token:

* ``proposal="point"`` (the default): q is the point mass on the drafted token, the exact proposal
  of a deterministic chain -- the chain every built-in policy builds: accept with probability
  p(x), else resample from p with x removed.
* ``proposal="draft"`` (Leviathan et al.): q is what the chain's token was drawn from: the tree's
  `Proposals` row of its parent when a sampled policy gives them, else the draft's own row
  ``softmax(draft.logprobs[d-1])``.
  Lossless only when the chain's tokens were *drawn* from those rows; applied to a deterministic
  chain it is biased (total-variation distance 0.38 from the target's first token in one
  measurement; the tests detect it).  So it declares ``requires_sampled_tree``, and
  `SpeculativeDecoder` refuses it with a policy that does not declare ``samples_from_draft``.
  The chain's score increments must equal the draft's base log-probs, so a chain re-scored by a
  path-dependent scorer (whose full q rows are unknown here) is refused.

On the first rejection the bonus is drawn from the residual normalise(max(p - q, 0)); when every
draft token is accepted it is drawn from p at the last node.  At T = 0 both reduce to match
verification.  Uniforms and residual draws come from the caller's generator stream (position keying
does not apply to rejection sampling).
"""

from __future__ import annotations

import torch

from treespec.interfaces import DraftOutput, Proposals, SamplingParams, Verifier, VerifyResult
from treespec.sampling import sample_from_probs, target_probs, target_tokens
from treespec.tree import DraftTree
from treespec.verifiers.match import check_logits, walk_matches

__all__ = ["PROPOSALS", "RejectionVerifier"]

PROPOSALS = ("draft", "point")


def _check_chain(tree: DraftTree) -> None:
    expected = torch.arange(-1, len(tree) - 1, device=tree.device)
    if not torch.equal(tree.parents, expected):
        raise ValueError("RejectionVerifier needs a chain (parent of node i is i - 1); "
                         "use MatchVerifier for trees")


class RejectionVerifier(Verifier):
    """Rejection sampling down a chain with the proposal's probabilities."""

    name = "rejection"

    def __init__(self, proposal: str = "point") -> None:
        if proposal not in PROPOSALS:
            raise ValueError(f"proposal must be one of {PROPOSALS}, got {proposal!r}")
        self.proposal = proposal

    @property
    def requires_sampled_tree(self) -> bool:
        """The draft proposal is exact only for chains sampled from the draft's rows."""
        return self.proposal == "draft"

    def verify(self, tree: DraftTree, target_logits: torch.Tensor, *, sampling: SamplingParams,
               generator: torch.Generator | None, position: int,
               draft: DraftOutput | None = None, proposals: Proposals | None = None) -> VerifyResult:
        check_logits(tree, target_logits)
        _check_chain(tree)
        if sampling.greedy:
            return walk_matches(tree, target_tokens(target_logits, tree.depths + position, sampling, None))
        if generator is None:
            raise ValueError("rejection sampling at temperature > 0 needs an explicit torch.Generator")
        p = target_probs(target_logits, sampling)  # [N, V] float64
        q = self._proposal_probs(tree, draft, proposals, p.shape[1])  # [N - 1, V] float64, row d-1: depth d
        return self._walk(tree, p, q, generator)

    def _proposal_probs(self, tree: DraftTree, draft: DraftOutput | None, proposals: Proposals | None,
                        vocab: int) -> torch.Tensor:
        tokens = tree.tokens[1:]
        if self.proposal == "point" or tokens.numel() == 0:  # a root-only tree proposes nothing
            return torch.nn.functional.one_hot(tokens, vocab).to(torch.float64)
        if proposals is not None:  # a sampled chain: node d-1's proposal drew the token at depth d
            return torch.stack([proposals.probs(d, vocab) for d in range(len(tokens))])
        if draft is None:
            raise ValueError("proposal='draft' needs the DraftOutput (pass draft=...)")
        if draft.vocab_size != vocab:
            raise ValueError(f"draft vocabulary {draft.vocab_size} != target vocabulary {vocab}")
        rows = draft.logprobs[: len(tokens)].to(tree.device)  # [L', V]
        _check_scores_are_base(tree, rows)
        return rows.to(torch.float64).softmax(-1)

    @staticmethod
    def _walk(tree: DraftTree, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator) -> VerifyResult:
        tokens = tree.tokens.tolist()
        uniforms = torch.rand(len(tree) - 1, dtype=torch.float64, generator=generator, device=generator.device)
        for d in range(1, len(tree)):
            x, pd, qd = tokens[d], p[d - 1], q[d - 1]  # p at the parent predicts depth d
            if float(qd[x]) <= 0.0:
                raise ValueError(f"draft token {x} at depth {d} has proposal probability 0")
            if float(uniforms[d - 1]) >= min(1.0, float(pd[x] / qd[x])):
                residual = (pd - qd).clamp_min(0.0)  # [V]
                bonus = sample_from_probs(residual if float(residual.sum()) > 0 else pd, generator)
                return _result(tree, d, bonus)
        return _result(tree, len(tree), sample_from_probs(p[-1], generator))


def _check_scores_are_base(tree: DraftTree, rows: torch.Tensor) -> None:
    chosen = rows.gather(1, tree.tokens[1:, None]).squeeze(1)  # [L'] log q(x_d)
    increments = tree.scores[1:] - tree.scores[:-1]
    if not torch.allclose(increments, chosen, atol=1e-4, rtol=1e-4):
        raise ValueError("the chain's scores are not the draft's base log-probs (a path-dependent scorer?); "
                         "proposal='draft' cannot know q there -- use proposal='point' or MatchVerifier")


def _result(tree: DraftTree, n_accepted: int, bonus: int) -> VerifyResult:
    return VerifyResult(torch.arange(n_accepted, dtype=torch.int64, device=tree.device), bonus)
