"""Traversal verification: leaf-to-root, with sequence-level acceptance; lossless for sampled trees.

After Weng et al., 2025, "Traversal Verification for Speculative Tree Decoding" (NeurIPS 2025).
Token-level verification (`treespec.verifiers.recursive`) walks down from the root and, once a node is
rejected, throws its whole subtree away.  Traversal verification visits the tree in post-order
(a node's children, each with its whole subtree, in node order, then the node) and asks at each
leaf whether the whole path from the root to it is accepted, so a good path under a doubtful
prefix can still be kept, and a chain accepts at least as much as token by token.

Contract
--------
The tree must come from a policy declaring ``samples_from_draft``, with its `Proposals` (node n's
children drawn from q_n without replacement, in node order), as for recursive rejection.  Each node
a holds a target law P_a (at first the target's distribution at a: softmax of the filtered logits /
T), a proposal Q_a (at first q_a) and a path acceptance h_a; h_root = 1.  When the traversal first
reaches a child c of a (token x), it sets

    h_c = min(1, h_a P_a(x) / Q_a(x)),      P_c = the target's distribution at c.

At a leaf c (a node without children, or whose children were all rejected), with a fresh uniform
u: if u < h_c the path root..c is accepted and the bonus is drawn from P_c; otherwise c is rejected
and its parent a is updated:

    r = max(h_a P_a - Q_a, 0),  S = sum(r):   P_a <- r / S,   h_a <- S / (S + 1 - h_a),
    Q_a <- Q_a with x removed, renormalised,

and the traversal goes on with a's next child.  The root is never rejected: with all its children
rejected, the bonus is drawn from P_root.

Why it is exact.  Put the path's acceptance into one law over the vocabulary and a "reject"
symbol: at node a, Ptilde_a = h_a P_a on tokens and 1 - h_a on reject.  A child c drawn from Q_a
is tested with min(1, Ptilde_a(x) / Q_a(x)) = h_c, which is Leviathan's test of a draw from Q_a
against Ptilde_a; on rejection the residual of Ptilde_a - Q_a puts r on tokens and 1 - h_a on
reject (Q_a has no reject mass), which is the update above read as (h_a, P_a).  So the children of
a node, tried in turn, are recursive rejection sampling without replacement of Ptilde_a, and by
induction on depth each subtree accepts its root c with probability exactly h_c and, when it
does, continues with the target's law at c.  At the root (h = 1) that is the target's law of the
committed tokens.  At T = 0 it reduces to match verification (and is run as it).  Uniforms and the
bonus draw come from the caller's generator stream.
"""

from __future__ import annotations

import torch

from treespec.interfaces import Proposals, VerifyResult
from treespec.sampling import sample_from_probs
from treespec.tree import DraftTree
from treespec.verifiers.recursive import SampledTreeVerifier

__all__ = ["TraversalVerifier"]


class TraversalVerifier(SampledTreeVerifier):
    """Traversal verification over sampled trees (module docstring)."""

    name = "traversal"

    def verify_sampled(self, tree: DraftTree, p_rows: torch.Tensor, proposals: Proposals,
                       generator: torch.Generator) -> VerifyResult:
        return _Traversal(tree, p_rows.to(torch.float64), proposals, self, generator).run()

    @staticmethod
    def after_rejection(h: float, p: torch.Tensor, q: torch.Tensor, x: int) -> float:
        """In place, when a child with token x of a node (path acceptance h, law p, proposal q) is
        rejected: p <- norm(max(h p - q, 0)), q <- q without x, renormalised; returns the new h."""
        residual = (h * p - q).clamp_min(0.0)  # [V]
        mass = float(residual.sum())
        if mass > 0.0:
            p.copy_(residual / mass)
        q[x] = 0.0
        q /= q.sum().clamp_min(torch.finfo(q.dtype).tiny)
        return mass / (mass + 1.0 - h) if mass + 1.0 - h > 0.0 else 0.0


class _Traversal:
    """The state of one traversal: per reached node its law, proposal, acceptance and next child."""

    def __init__(self, tree: DraftTree, p_rows: torch.Tensor, proposals: Proposals, rule: TraversalVerifier,
                 generator: torch.Generator) -> None:
        self.tree, self.p_rows, self.proposals, self.rule, self.generator = tree, p_rows, proposals, rule, generator
        self.tokens = tree.tokens.tolist()
        self.law = {0: p_rows[0].clone()}  # node -> P_a [V]
        self.proposal: dict[int, torch.Tensor] = {}  # node -> Q_a [V], once a child of it is tried
        self.accept = {0: 1.0}  # node -> h_a
        self.tried = {0: 0}  # node -> how many of its children were rejected

    def run(self) -> VerifyResult:
        path = [0]
        while True:
            node = path[-1]
            children = self.tree.children[node]
            if self.tried[node] < len(children):
                path.append(self.enter(node, children[self.tried[node]]))
                continue
            if node == 0 or self.uniform() < self.accept[node]:  # the root is never rejected
                return VerifyResult(torch.tensor(path, dtype=torch.int64, device=self.tree.device),
                                    sample_from_probs(self.law[node], self.generator))
            path.pop()
            self.reject(path[-1], node)

    def enter(self, parent: int, child: int) -> int:
        """Reach ``child`` for the first time: its path acceptance against the parent's current state."""
        x = self.tokens[child]
        q = self.proposal.setdefault(parent, self.proposals.probs(parent, self.p_rows.shape[1]).to(torch.float64))
        if float(q[x]) <= 0.0:
            raise ValueError(f"child token {x} of node {parent} has proposal probability 0: the tree was not "
                             "drawn from its proposals")
        self.accept[child] = min(1.0, self.accept[parent] * float(self.law[parent][x] / q[x]))
        self.law[child] = self.p_rows[child].clone()
        self.tried[child] = 0
        return child

    def reject(self, parent: int, child: int) -> None:
        x = self.tokens[child]
        self.accept[parent] = self.rule.after_rejection(self.accept[parent], self.law[parent], self.proposal[parent], x)
        self.tried[parent] += 1

    def uniform(self) -> float:
        return float(torch.rand((), dtype=torch.float64, generator=self.generator, device=self.generator.device))
