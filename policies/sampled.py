"""Sampled trees: every node's children drawn without replacement from the draft, grown best-first.

Contract
--------
``DDTreeSampled(budget=16, top_m=64)`` and ``DominoTreeSampled(budget=16, top_m=64, node_topk=8)``
are DDTree and DominoTree for T > 0 under a verifier that uses the draft's q (verifiers/recursive.py).
At T = 0 they build exactly the deterministic trees of their parents (``build``).  At T > 0
``sample(draft, sampling=, seed=)`` draws the tree:

* **q of a node.**  The node's candidates are the top-M tokens of its draft row -- the factorized
  marginal of its depth (DDTree) or Domino's corrected conditional along the node's own path
  (DominoTree: the scorer's M candidates, the correction normalised over them) -- and
  q(x) = softmax(log p_draft(x) / T) over those M: the draft at the target's temperature.
* **Children without replacement (Gumbel-top-k).**  Each expanded node draws one standard Gumbel
  per candidate, g_x = phi + log q(x) + G_x with phi the node's path log-probability; sorting the
  candidates by g descending is a draw of them without replacement from q (Kool et al. 2019), and
  the node's children are a prefix of that order (at most B, or ``node_topk`` for DominoTree).
* **Shape** (field ``shape``), chosen so that whether a draw enters the tree never depends on
  *which* token it is -- what recursive rejection sampling needs, since it treats a node's i-th
  child as a draw from q with the first i - 1 removed:

  - ``"fixed"`` (default; Sequoia's way): the shape of the deterministic parent's tree for this
    draft (``build``), fixed before any noise is drawn; each node's draws fill its child slots in
    draw order (the first draw takes the slot of the rank-1 child and its subtree).
  - ``"perturbed"``: best-first on Stochastic Beam Search scores (Kool et al. 2019): a child's
    score is its g truncated below its parent's, ``s = -log(exp(-s_parent) - exp(-max g) +
    exp(-g))``, so children never beat their parent and siblings come in draw order; the heap pops
    B nodes as DDTree's does.  The i-th draw's score is a function of the i-th largest Gumbel value
    alone, which (given the draws before it) is independent of the token attaining it -- the
    Gumbel-max property, kept under truncation -- so every pop decision is token-blind.  (It grows
    deep: a first child's score equals its parent's.)

  Unperturbed scores (log q of the drawn token) would not do: a child would enter the tree because
  its token is likely, and the verifier would over-accept.

The noise comes from a ``torch.Generator`` seeded with ``seed`` (the decoder draws one per round
from the caller's generator and records it), drawn node by node in pop order: the same draft,
sampling and seed give the same tree on both backends (one implementation serves both).  The
tree's ``scores`` are the unperturbed path log q (at temperature T); its node order is the
perturbed pop order, not the canonical order of deterministic trees.
"""

from __future__ import annotations

import heapq
import math
from typing import ClassVar

import attrs
import torch

from treespec.interfaces import DraftOutput, Proposals, SamplingParams
from treespec.policies.ddtree import DDTree
from treespec.policies.dominotree import DominoTree
from treespec.policies.engine.best_first import count_field
from treespec.policies.engine.candidates import CandidateSource, FactorizedSource, ScorerSource
from treespec.tree import DraftTree

__all__ = ["SHAPES", "DDTreeSampled", "DominoTreeSampled", "fill_sampled", "grow_sampled", "truncated_gumbel"]


def truncated_gumbel(g: torch.Tensor, bound: float) -> torch.Tensor:
    """[M] the values ``g`` shifted so that their max equals ``bound`` and their order is kept:
    -log(exp(-bound) - exp(-max g) + exp(-g)), in the numerically stable form of Kool et al."""
    z = g.max()
    v = bound - g + torch.log(-torch.expm1(g - z))  # log1mexp(g - z); -inf at the max itself
    return bound - v.clamp_min(0.0) - torch.log1p(torch.exp(-v.abs()))


@attrs.define
class _Node:
    """One node of the growing tree and its drawn children, in draw order."""

    token: int
    parent: int
    depth: int
    phi: float  # path log q at temperature T
    score: float  # perturbed (truncated) score
    state: torch.Tensor | None  # the scorer's path state (None: factorized)
    kids: list[tuple[float, int, float, torch.Tensor | None]] | None = None  # drawn (score, token, log q, state)


def _draw_children(node: _Node, source: CandidateSource, temperature: float, keep: int,
                   gen: torch.Generator) -> tuple[list, torch.Tensor, torch.Tensor]:
    """The node's children in draw order (at most ``keep``) and its proposal row (tokens, log q)."""
    out = source.expand(None if node.state is None else node.state[None], 1, node.depth)
    tokens, base = out.tokens[0], out.logprobs[0].to(torch.float64)  # [M]
    logq = torch.log_softmax(base / temperature, dim=-1)  # [M] q over the M candidates
    gumbel = -torch.empty(logq.shape, dtype=torch.float64).exponential_(generator=gen).log()
    g = node.phi + logq.cpu() + gumbel
    scores = truncated_gumbel(g, node.score)
    order = torch.argsort(scores, descending=True, stable=True)[:keep]
    order = order[torch.isfinite(scores[order])]
    states = out.states[0] if out.states is not None else None
    kids = [(float(scores[j]), int(tokens[j]), float(logq[j]), None if states is None else states[j])
            for j in order.tolist()]
    return kids, tokens, logq


def grow_sampled(draft: DraftOutput, source: CandidateSource, budget: int, keep: int, top_m: int,
                 sampling: SamplingParams, seed: int) -> tuple[DraftTree, Proposals]:
    """Best-first on perturbed scores over children drawn without replacement (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    nodes = [_Node(draft.root_token, -1, 0, 0.0, 0.0, source.root_state())]
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    heap: list[tuple[float, int, int, int]] = []  # (-score, tie, parent, rank)

    def expand(index: int) -> None:
        node = nodes[index]
        node.kids, tokens, logq = _draw_children(node, source, sampling.temperature, keep, gen)
        rows[index] = (tokens, logq)
        offer(index, 0)

    def offer(parent: int, rank: int) -> None:
        kids = nodes[parent].kids
        if rank < len(kids):
            heapq.heappush(heap, (-kids[rank][0], len(nodes) + len(heap), parent, rank))

    expand(0)
    while heap and len(nodes) <= budget:
        _, _, parent, rank = heapq.heappop(heap)
        score, token, logq, state = nodes[parent].kids[rank]
        depth = nodes[parent].depth + 1
        nodes.append(_Node(token, parent, depth, nodes[parent].phi + logq, score, state))
        offer(parent, rank + 1)
        if depth < draft.depth and len(nodes) <= budget:  # the last node's children could not be popped
            expand(len(nodes) - 1)
    return _as_tree(nodes, draft), _proposals(rows, len(nodes), top_m, seed)


def fill_sampled(draft: DraftOutput, source: CandidateSource, shape: DraftTree, top_m: int,
                  sampling: SamplingParams, seed: int) -> tuple[DraftTree, Proposals]:
    """``shape``'s parents and depths, every node's children drawn without replacement from its q
    and given to the shape's child slots in draw order (a subtree without a draw is dropped)."""
    gen = torch.Generator().manual_seed(seed)
    nodes = [_Node(draft.root_token, -1, 0, 0.0, 0.0, source.root_state())]
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    where = {0: 0}  # shape node -> index in nodes
    for slot, kids in enumerate(shape.children):
        if not kids or slot not in where:
            continue
        index = where[slot]
        drawn, tokens, logq = _draw_children(nodes[index], source, sampling.temperature, len(kids), gen)
        rows[index] = (tokens, logq)
        for kid, (score, token, lq, state) in zip(kids, drawn):
            where[kid] = len(nodes)
            parent = nodes[index]
            nodes.append(_Node(token, index, parent.depth + 1, parent.phi + lq, score, state))
    return _as_tree(nodes, draft), _proposals(rows, len(nodes), top_m, seed)


def _as_tree(nodes: list[_Node], draft: DraftOutput) -> DraftTree:
    return DraftTree.build([n.token for n in nodes], [n.parent for n in nodes], [n.depth for n in nodes],
                           torch.tensor([n.phi for n in nodes], dtype=torch.float32),
                           device=draft.logprobs.device)


def _proposals(rows: dict[int, tuple[torch.Tensor, torch.Tensor]], n: int, top_m: int, seed: int) -> Proposals:
    tokens = torch.full((n, top_m), -1, dtype=torch.int64)
    logq = torch.full((n, top_m), -math.inf, dtype=torch.float64)
    for index, (row_tokens, row_logq) in rows.items():
        tokens[index, :row_tokens.numel()] = row_tokens.cpu()
        logq[index, :row_logq.numel()] = row_logq.cpu()
    return Proposals(tokens, logq, seed)


SHAPES = ("fixed", "perturbed")


def shape_field():
    """The ``shape`` field of a sampled policy (module docstring)."""
    return attrs.field(default="fixed", validator=attrs.validators.in_(SHAPES))


def _grow(policy, draft: DraftOutput, source: CandidateSource, keep: int, m: int, sampling: SamplingParams,
          seed: int) -> tuple[DraftTree, Proposals]:
    if policy.shape == "fixed":  # the deterministic tree's shape: chosen before any noise is drawn
        return fill_sampled(draft, source, policy.build(draft), m, sampling, seed)
    return grow_sampled(draft, source, policy.budget, keep, m, sampling, seed)


def _check_sampling(policy, sampling: SamplingParams) -> None:
    if sampling.greedy:
        raise ValueError(f"{policy.name} samples at temperature > 0 only; at T = 0 use build()")
    if policy.stop is not None:
        raise ValueError(f"{policy.name} takes no stop rule (a cost-aware stop reads unperturbed scores)")


class _Sampled:
    """`TreePolicy.sample` for both sampled policies; each says where its candidates come from."""

    samples_from_draft: ClassVar[bool] = True

    def sample(self, draft: DraftOutput, *, sampling: SamplingParams, seed: int) -> tuple[DraftTree, Proposals]:
        _check_sampling(self, sampling)
        self.validate(draft)
        m = min(self.top_m, draft.vocab_size)
        return _grow(self, draft, self.sampled_source(draft, m), self.children_kept(m), m, sampling, seed)


@attrs.frozen
class DDTreeSampled(_Sampled, DDTree):
    """DDTree with children drawn from the factorized marginals (see the module docstring)."""

    name: ClassVar[str] = "ddtree-sampled"

    top_m: int = count_field(64)  # candidates per depth q is normalised over
    shape: str = shape_field()  # "fixed": DDTree's shape; "perturbed": best-first on perturbed scores

    def sampled_source(self, draft: DraftOutput, m: int) -> CandidateSource:
        values, tokens = draft.logprobs.topk(m, dim=-1)  # [L, M]
        return FactorizedSource.from_rows(tokens, values)

    def children_kept(self, m: int) -> int:
        return min(self.budget, m)


@attrs.frozen
class DominoTreeSampled(_Sampled, DominoTree):
    """DominoTree with children drawn from each node's own corrected conditional (module docstring)."""

    name: ClassVar[str] = "dominotree-sampled"

    shape: str = shape_field()  # "fixed": DominoTree's shape; "perturbed": best-first on perturbed scores

    def sampled_source(self, draft: DraftOutput, m: int) -> CandidateSource:
        return ScorerSource(draft.scorer, m, m)  # all M candidates: q is normalised over them

    def children_kept(self, m: int) -> int:
        return min(self.node_topk, m)
