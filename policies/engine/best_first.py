"""The best-first skeleton every tree policy shares: the policy base, the stop rule, the heap reference.

Contract
--------
A best-first policy grows the tree a max-heap would pop: start from the root's children; pop the
best candidate (score descending, ties by rank path, lexicographically smaller first); after a pop
offer that node's next sibling and its first child; stop after ``budget`` pops, when nothing is
left, or when the `StopRule` says so.  A node's score is ``float32(score(parent) + logp(child))``,
one float32 addition.  Policies differ only in their `CandidateSource`.

Because log-probs are <= 0 and float32 rounding is monotone, a child never beats its parent and a
sibling never beats its elder, so the pop order is the global order on (score desc, rank path
asc) and every prefix of it is prefix-closed.  That is what lets the torch backend replace the
heap by a per-depth beam and one global selection (policies/engine/frontier.py).

What a policy provides: ``candidates(draft)``, its children as data (`candidates.TopTokens`, a
`FactorizedSource` or a `ScorerSource`), ``validate(draft)``, and the fields ``budget`` and
``stop``.  What it may not assume: which backend or mode builds the tree, which top-k routine
selects its tokens, or how many of its candidates are ever read; the shared builder resolves the
candidates for the build (`frontier.resolve`) and returns the same tree in every mode.

Backends: ``grow_reference`` (networkx: grows an ``nx.DiGraph`` node by node with ``heapq``; the
readable reference, also for drawing) and `frontier.expand_frontier` (torch, vectorized; mode
*compact* on the CPU, *static* elsewhere).  Both return the same `DraftTree`: tokens, parents,
depths, node order and score bits.
"""

from __future__ import annotations

import heapq
from abc import abstractmethod
from collections.abc import Sequence

import attrs
import networkx as nx
import numpy as np
import torch

from treespec.interfaces import DraftOutput, TreePolicy, backend_field
from treespec.policies.engine.candidates import Candidates, CandidateSource, check_candidates, padded
from treespec.policies.engine.frontier import Mode, expand_frontier, grow_batch, resolve
from treespec.policies.engine.stop import StopRule
from treespec.tree import DraftTree, check_budget, check_count

__all__ = ["BestFirstPolicy", "budget_field", "check_logprobs", "count_field", "grow_graph", "grow_reference", "possible"]

# ---------------------------------------------------------------------------- input checks
def budget_field(default: int):
    """An attrs field holding the tree budget (non-root nodes; `treespec.tree.check_budget`)."""
    return attrs.field(default=default, validator=lambda _, attribute, value: check_budget(value, attribute.name))


def count_field(default: int):
    """An attrs field holding a count that is not a budget: a width, a fan-out, a depth cap, a number
    of rounds (an integer >= 1, `treespec.tree.check_count`)."""
    return attrs.field(default=default, validator=lambda _, attribute, value: check_count(value, attribute.name))


def check_logprobs(draft: DraftOutput) -> None:
    """Reject NaN or positive log-probs (one reduction; the heap order relies on logp <= 0)."""
    worst = draft.logprobs.amax()  # NaN propagates through amax
    if torch.isnan(worst):
        bad = torch.isnan(draft.logprobs).nonzero()[0].tolist()
        raise ValueError(f"draft logprobs contain NaN (first at depth row {bad[0]}, token {bad[1]})")
    if worst > 0:
        raise ValueError(f"draft logprobs must be log-probabilities (<= 0); the largest is {float(worst)}")


# ---------------------------------------------------------------------------- the policy base
@attrs.frozen(slots=False)  # a dict class: its subclasses may mix in other slotted bases (CostAware)
class BestFirstPolicy(TreePolicy):
    """`TreePolicy.build` for best-first policies, on both backends; subclasses provide `candidates`
    and the fields ``budget`` (an int, or None where `max_nodes` derives it) and ``stop`` (a
    `StopRule` or None); ``backend`` is this base's own keyword-only field."""

    backend: str = backend_field()  # "torch" (vectorised) or "networkx" (the readable reference)

    def build(self, draft: DraftOutput) -> DraftTree:
        self.validate(draft)
        if self.backend == "networkx":
            return possible(grow_reference(draft, self.source(draft, "reference"), self.max_nodes(draft), self.stop))
        return possible(self.build_torch(draft))

    def build_batch(self, drafts: Sequence[DraftOutput]) -> list[DraftTree]:
        """`build` of every draft, bit for bit; the torch backend grows the drafts' trees together
        where that is the cheaper build (`frontier.grow_batch`)."""
        if self.backend == "networkx" or len(drafts) < 2:
            return [self.build(draft) for draft in drafts]
        for draft in drafts:
            self.validate(draft)
        budgets = [self.max_nodes(draft) for draft in drafts]
        trees = grow_batch(drafts, [self.checked_candidates(draft) for draft in drafts], budgets, self.stop)
        return [possible(tree) for tree in trees]

    def build_graph(self, draft: DraftOutput) -> nx.DiGraph:
        """The networkx reference's graph itself (node attributes token, depth, score, path)."""
        self.validate(draft)
        return grow_graph(draft, self.source(draft, "reference"), self.max_nodes(draft), self.stop)

    def build_torch(self, draft: DraftOutput, *, static: bool | None = None) -> DraftTree:
        """The torch backend without input checks; ``static`` defaults to True off the CPU."""
        static = draft.logprobs.device.type != "cpu" if static is None else static
        source = self.source(draft, "static" if static else "compact")
        return expand_frontier(draft, source, self.max_nodes(draft), self.stop, static=static)

    def source(self, draft: DraftOutput, mode: Mode) -> CandidateSource:
        """This round's candidates, checked, resolved for one build ``mode`` (policies/engine/frontier.py)
        and padded to the draft's depth (fewer lists than depths: no deeper)."""
        return padded(resolve(self.checked_candidates(draft), self.max_nodes(draft), mode), draft.depth)

    def checked_candidates(self, draft: DraftOutput) -> Candidates:
        """`candidates`, refused by `check_candidates` when they break the contract (naming the policy)."""
        return check_candidates(self.candidates(draft), draft, self.name)

    def max_nodes(self, draft: DraftOutput) -> int:
        """The most non-root nodes this build may return."""
        return self.budget

    @abstractmethod
    def validate(self, draft: DraftOutput) -> None:
        """Raise ValueError naming what is wrong with ``draft`` for this policy (host-side checks)."""

    @abstractmethod
    def candidates(self, draft: DraftOutput) -> Candidates:
        """This round's children as data: `candidates.TopTokens`, a `FactorizedSource` or a `ScorerSource`."""


def possible(tree: DraftTree) -> DraftTree:
    """``tree`` without its nodes of score -inf (a child whose log-prob is -inf is no child,
    policies/engine/candidates.py); in pop order they come last, so what stays is a prefix of it."""
    if len(tree) == 1 or not bool(torch.isneginf(tree.scores[-1])):
        return tree
    return tree.select(~torch.isneginf(tree.scores))


# ---------------------------------------------------------------------------- networkx reference
def _add32(a: float, b: float) -> float:
    """float32(a + b) for float32 values a, b: one IEEE single-precision addition."""
    return float(np.float32(a) + np.float32(b))


def _child_list(source: CandidateSource, state: torch.Tensor | None, depth: int) -> list[tuple]:
    """[(token, logp, state)] of one node's children, best first."""
    out = source.expand(None if state is None else state[None], 1, depth)
    states = [None] * out.tokens.shape[1] if out.states is None else list(out.states[0])
    return list(zip(out.tokens[0].tolist(), out.logprobs[0].tolist(), states))


def grow_graph(draft: DraftOutput, source: CandidateSource, budget: int,
               stop: StopRule | None = None) -> nx.DiGraph:
    """Grow the tree node by node with a Python heap (see the module docstring).

    Nodes are 0..N-1 in pop order (0 the root) with attributes token, depth, score and path
    (the rank path); edges run parent -> child.
    """
    graph = nx.DiGraph()
    graph.add_node(0, token=draft.root_token, depth=0, score=0.0, path=())
    children = {0: _child_list(source, source.root_state(), 0)}
    heap: list[tuple] = []

    def offer(parent: int, rank: int) -> None:
        if rank < len(children[parent]):
            score = _add32(graph.nodes[parent]["score"], children[parent][rank][1])
            heapq.heappush(heap, (-score, graph.nodes[parent]["path"] + (rank,), parent, rank))

    should_stop = stop.reference(draft, budget) if stop is not None else None
    offer(0, 0)
    while heap and graph.number_of_nodes() <= budget:
        neg_score, path, parent, rank = heapq.heappop(heap)
        if should_stop is not None and should_stop(-neg_score):
            break
        node, (token, _, state) = graph.number_of_nodes(), children[parent][rank]
        depth = graph.nodes[parent]["depth"] + 1
        graph.add_node(node, token=token, depth=depth, score=-neg_score, path=path)
        graph.add_edge(parent, node)
        offer(parent, rank + 1)
        if depth < draft.depth:
            children[node] = _child_list(source, state, depth)
            offer(node, 0)
    if stop is not None:
        scores = torch.tensor([graph.nodes[i]["score"] for i in range(1, graph.number_of_nodes())], dtype=torch.float32)
        graph.remove_nodes_from(range(1 + stop.trim(draft, scores), graph.number_of_nodes()))  # a pop-order prefix
    return graph


def grow_reference(draft: DraftOutput, source: CandidateSource, budget: int,
                   stop: StopRule | None = None) -> DraftTree:
    """The networkx backend: `grow_graph` as a DraftTree."""
    return DraftTree.from_networkx(grow_graph(draft, source, budget, stop), device=draft.logprobs.device)
