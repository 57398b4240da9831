"""The best-first skeleton every tree policy shares: one heap reference, one torch frontier expander.

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
heap by a per-depth beam and one global selection (see `expand_frontier`).

Backends: ``grow_reference`` (networkx: grows an ``nx.DiGraph`` node by node with ``heapq``; the
readable reference, also for drawing) and ``expand_frontier`` (torch, vectorized).  Both return
the same `DraftTree`: tokens, parents, depths, node order and score bits.  The torch backend has
two modes: *compact* (default on CPU) expands only frontier nodes that can still matter and may
read sizes back to the host; *static* (default on other devices) uses shapes fixed by the budget,
the depth and the candidate widths alone, with no host synchronisation, so a GPU build can be
captured in a CUDA graph (policies/cuda_graph.py).
"""

from __future__ import annotations

import functools
import heapq
from abc import ABC, abstractmethod
from collections.abc import Callable

import attrs
import networkx as nx
import numpy as np
import torch

from policies.sources import CandidateSource, FactorizedSource
from treespec.interfaces import BACKENDS, DraftOutput, TreePolicy
from treespec.topk import order_key
from treespec.tree import DraftTree

__all__ = [
    "MAX_BUDGET", "BestFirstPolicy", "StopRule", "assemble", "budget_field", "check_backend", "check_budget", "check_logprobs",
    "expand_frontier", "frontier_selection", "grow_graph", "grow_reference",
]

MAX_BUDGET = 8192  # largest tree budget: an [N, N] float32 mask of 256 MiB, a verify forward over N tokens
_HYPERBOLA_MIN = 4096  # factorized depths with more candidates than this get the pruned layout
_STABLE_SORT_MAX = 512  # up to this many candidates a stable sort beats building int64 keys
_CHUNK_MIN = 8  # fewest rows per scorer call when compact mode expands a depth in chunks


# ---------------------------------------------------------------------------- input checks
def check_budget(budget: int, name: str = "budget") -> int:
    """``budget`` as an int >= 1; TypeError for a non-integer, ValueError below 1."""
    if isinstance(budget, bool) or not isinstance(budget, int | np.integer):
        raise TypeError(f"{name} must be an integer >= 1, got {budget!r}")
    if budget < 1:
        raise ValueError(f"{name} must be >= 1 (it counts non-root nodes), got {budget}")
    if name == "budget" and budget > MAX_BUDGET:
        raise ValueError(f"budget {budget} exceeds {MAX_BUDGET} nodes: a tree's [N, N] masks and the verify forward "
                         f"over N tokens would not fit in memory (the published harnesses cap trees at 1024)")
    return int(budget)


def budget_field(default: int):
    """An attrs field holding a count that must be an int >= 1 (budgets, widths)."""
    return attrs.field(default=default, validator=lambda _, attribute, value: check_budget(value, attribute.name))


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def check_logprobs(draft: DraftOutput) -> None:
    """Reject NaN or positive log-probs (one reduction; the heap order relies on logp <= 0)."""
    worst = draft.logprobs.amax()  # NaN propagates through amax
    if torch.isnan(worst):
        bad = torch.isnan(draft.logprobs).nonzero()[0].tolist()
        raise ValueError(f"draft logprobs contain NaN (first at depth row {bad[0]}, token {bad[1]})")
    if worst > 0:
        raise ValueError(f"draft logprobs must be log-probabilities (<= 0); the largest is {float(worst)}")


# ---------------------------------------------------------------------------- stop rules
class StopRule(ABC):
    """Ends a best-first build early.  It sees candidates in pop (canonical) order only."""

    @abstractmethod
    def reference(self, draft: DraftOutput, budget: int) -> Callable[[float], bool]:
        """A fresh predicate for one build: called with each popped candidate's score, in pop
        order; True means stop before adding that candidate."""

    @abstractmethod
    def keep(self, draft: DraftOutput, scores: torch.Tensor) -> torch.Tensor:
        """0-dim int64: how many of the first candidates (scores [m], pop order) the rule keeps."""

    def trim(self, draft: DraftOutput, scores: torch.Tensor) -> int:
        """How many of the kept nodes (scores [k] float32, pop order) to return, decided once the
        build has ended; both backends call it with the same scores.  Default: all of them."""
        return scores.numel()


# ---------------------------------------------------------------------------- the policy base
class BestFirstPolicy(TreePolicy):
    """`TreePolicy.build` for best-first policies; subclasses provide `candidates` and fields
    ``budget`` (an int, or None where `max_nodes` derives it) and ``stop``."""

    budget: int | None
    stop: StopRule | None

    def build(self, draft: DraftOutput, *, backend: str = "torch") -> DraftTree:
        check_backend(backend)
        self.validate(draft)
        if backend == "networkx":
            source = self.candidates(draft, reference=True)
            return grow_reference(draft, source, self.max_nodes(draft), self.stop)
        return self.build_torch(draft)

    def build_graph(self, draft: DraftOutput) -> nx.DiGraph:
        """The networkx reference's graph itself (node attributes token, depth, score, path)."""
        self.validate(draft)
        return grow_graph(draft, self.candidates(draft, reference=True), self.max_nodes(draft), self.stop)

    def build_torch(self, draft: DraftOutput, *, static: bool | None = None) -> DraftTree:
        """The torch backend without input checks; ``static`` defaults to True off the CPU."""
        static = draft.logprobs.device.type != "cpu" if static is None else static
        source = self.candidates(draft, reference=False, static=static)
        return expand_frontier(draft, source, self.max_nodes(draft), self.stop, static=static)

    def max_nodes(self, draft: DraftOutput) -> int:
        """The most non-root nodes this build may return."""
        return self.budget

    @abstractmethod
    def validate(self, draft: DraftOutput) -> None:
        """Raise ValueError naming what is wrong with ``draft`` for this policy (host-side checks)."""

    @abstractmethod
    def candidates(self, draft: DraftOutput, *, reference: bool, static: bool = False) -> CandidateSource:
        """The round's candidate source (``reference``: for the networkx backend)."""


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


# ---------------------------------------------------------------------------- torch frontier expander
@attrs.frozen(eq=False)
class _Level:
    """The kept nodes of one depth, in lexicographic rank-path order."""

    tokens: torch.Tensor  # [n] int64
    scores: torch.Tensor  # [n] float32
    parent_rows: torch.Tensor  # [n] int64 row of each node's parent in the previous level
    parents: torch.Tensor  # [n] int64 pool index of each node's parent (pool = levels concatenated)


@attrs.frozen(eq=False)
class _Candidates:
    """The children of one depth's expanded nodes, in rank-path order (parent row, then rank)."""

    parent: torch.Tensor  # [c] int64 row of the parent in the last level
    scores: torch.Tensor  # [c] float32: float32(parent score + logp)
    tokens: torch.Tensor  # [c] int64 per candidate, or the shared list [K] when `shared`
    col: torch.Tensor  # [c] int64 rank of each candidate among its parent's candidates
    states: torch.Tensor | None  # [c, S] child states, or None
    shared: bool = True  # tokens is one list indexed by `col` (factorized sources)

    def take(self, sel: torch.Tensor | None) -> tuple:
        """(parent, scores, tokens, states) of the candidates ``sel`` (None: all of them)."""
        if sel is None:
            tokens = self.tokens[self.col] if self.shared else self.tokens
            return self.parent, self.scores, tokens, self.states
        tokens = self.tokens[self.col[sel]] if self.shared else self.tokens[sel]
        states = None if self.states is None else self.states[sel]
        return self.parent[sel], self.scores[sel], tokens, states

    @staticmethod
    def merged(parts: list[_Candidates]) -> _Candidates:
        """Per-candidate parts joined and put back in rank-path order."""
        if len(parts) == 1:
            return parts[0]
        parent = torch.cat([p.parent for p in parts])
        col = torch.cat([p.col for p in parts])
        order = (parent * (int(col.max()) + 1) + col).argsort()
        states = None if parts[0].states is None else torch.cat([p.states for p in parts])[order]
        return _Candidates(parent[order], torch.cat([p.scores for p in parts])[order],
                           torch.cat([p.tokens for p in parts])[order], col[order], states, shared=False)


def _grid(n: int, k: int, device: torch.device, cache: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) [n * k] of each cell of a row-major [n, k] grid."""
    if cache:
        return _cached_grid(n, k, device)
    index = torch.arange(n * k, device=device)
    return index // k, index % k


@functools.lru_cache(maxsize=512)
def _cached_grid(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return _grid(n, k, device, cache=False)


class _Frontier:
    """Per-depth beam of width B over a `CandidateSource`, then one global selection.

    Depth by depth, the children of the expanded nodes are scored and the best B of them (by score,
    ties by rank path, which within one depth is the candidate order) are kept.  The top-B tree is
    prefix-closed and holds at most B nodes per depth, so it survives every per-depth cut.

    Compact mode expands only nodes whose score reaches the (B-1)-th best score found so far: a
    node with a child in the final tree has fewer than B-1 nodes ahead of it, hence fewer than
    B-1 strictly better scores; the (B-1)-th best of the nodes found so far never exceeds that of
    all nodes, so skipping is safe.  Over a scorer a depth is expanded best rows first, in
    halves, so that their children can raise the bound before the weaker rows are paid for.
    """

    def __init__(self, draft: DraftOutput, source: CandidateSource, budget: int, static: bool) -> None:
        device = draft.logprobs.device
        self.source, self.budget, self.static, self.device = source, budget, static, device
        root = torch.full((1,), draft.root_token, dtype=torch.int64, device=device)  # a fill: capturable
        no_parent = torch.full((1,), -1, dtype=torch.int64, device=device)
        self.levels = [_Level(root, torch.zeros(1, device=device), no_parent, no_parent)]
        self.size = 1  # pool nodes so far
        state = source.root_state()
        self.states = None if state is None else state[None]  # [n, S] states of the last level
        self.best = torch.empty(0, device=device)  # the best B-1 non-root scores so far (compact)

    def grow(self, depth_limit: int) -> None:
        for depth in range(depth_limit):
            rows = self._rows_to_expand(depth)
            if rows is not None and rows.numel() == 0:
                break
            self._step(depth, rows)

    def _rows_to_expand(self, depth: int) -> torch.Tensor | None:
        """Rows of the last level worth expanding (None: all of them)."""
        if self.static or depth == 0:
            return None
        if self.budget == 1:
            return self.levels[-1].tokens.new_empty(0)  # the single best depth-1 node needs no children
        if self.best.numel() < self.budget - 1:
            return None
        rows = (self.levels[-1].scores >= self.best.min()).nonzero().flatten()
        return None if rows.numel() == self.levels[-1].tokens.numel() else rows

    def _step(self, depth: int, rows: torch.Tensor | None) -> None:
        level = self.levels[-1]
        if self.static:
            cand = self._expanded(level.scores, self.states, depth)
        elif isinstance(self.source, FactorizedSource):
            cand = self._factorized(level.scores if rows is None else level.scores[rows], depth, rows)
        else:
            cand = self._expanded_in_chunks(rows, depth)
        parent_rows, child_scores, tokens, self.states = cand.take(self._best_of(cand.scores))
        level_start = self.size - level.tokens.numel()
        self.levels.append(_Level(tokens, child_scores, parent_rows, parent_rows + level_start))
        self.size += tokens.numel()
        if isinstance(self.source, FactorizedSource) and not self.static:
            self._remember(child_scores)

    def _expanded(self, scores: torch.Tensor, states: torch.Tensor | None, depth: int,
                  rows: torch.Tensor | None = None) -> _Candidates:
        """Every child of the nodes ``rows`` of the last level (None: all), from the source."""
        out = self.source.expand(states, scores.numel(), depth)
        n, k = out.tokens.shape
        parent, col = _grid(n, k, self.device, cache=not self.static)
        child_states = None if out.states is None else out.states.reshape(n * k, -1)
        child_scores = (scores[:, None] + out.logprobs).reshape(-1)  # float32(parent + logp)
        parent = parent if rows is None else rows[parent]
        return _Candidates(parent, child_scores, out.tokens.reshape(-1), col, child_states, shared=False)

    def _expanded_in_chunks(self, rows: torch.Tensor | None, depth: int) -> _Candidates:
        """Compact mode over a scorer: expand the best half of the remaining rows, let their
        children raise the threshold, drop the rows that fall below it, repeat.

        Children never beat their parents, so the best rows' children are the likeliest to push
        weaker rows of the same depth under the (B-1)-th best score, which saves their expansion.
        """
        level = self.levels[-1]
        rows = torch.arange(level.scores.numel(), device=self.device) if rows is None else rows
        queue = rows[order_key(level.scores[rows], rows).argsort()]  # best first
        parts = []
        while queue.numel():
            half = max(_CHUNK_MIN, (queue.numel() + 1) // 2)
            take, queue = queue[:half].sort().values, queue[half:]  # each part in rank-path order
            parts.append(self._expanded(level.scores[take], self.states[take], depth, take))
            self._remember(parts[-1].scores)
            if queue.numel() and self.best.numel() >= self.budget - 1:
                queue = queue[level.scores[queue] >= self.best.min()]
        return _Candidates.merged(parts)

    def _factorized(self, scores: torch.Tensor, depth: int, rows: torch.Tensor | None) -> _Candidates:
        """Children from a shared per-depth list, pruned to a hyperbola when the grid is large.

        Order the n parents by key; parent i's rank-r child is matched or beaten in score by the
        (i + 1)(r + 1) - 1 others of its rectangle (better-or-equal parents x better-or-equal
        ranks), so only r < B // (i + 1) can be kept -- unless exact score ties reorder the
        rectangle, which `_cut_is_safe` detects, falling back to the whole grid.
        """
        values, tokens = self.source.logprobs[depth], self.source.tokens[depth]  # [K]
        n, width = scores.numel(), values.numel()
        if n * width > _HYPERBOLA_MIN:
            lex = torch.arange(n, device=self.device)
            rank = torch.empty_like(lex).scatter_(0, order_key(scores, lex).argsort(), lex)
            limit = (self.budget // (rank + 1)).clamp_max(width)  # [n] candidates kept per parent
            parent = torch.repeat_interleave(lex, limit)
            first = torch.repeat_interleave(limit.cumsum(0) - limit, limit, output_size=parent.numel())
            col = torch.arange(parent.numel(), device=self.device) - first
            child_scores = scores[parent] + values[col]
            if self._cut_is_safe(scores, values, limit, child_scores):
                return _Candidates(parent if rows is None else rows[parent], child_scores, tokens, col, None)
        parent, col = _grid(n, width, self.device, cache=True)
        parent = parent if rows is None else rows[parent]
        return _Candidates(parent, (scores[:, None] + values).reshape(-1), tokens, col, None)

    def _cut_is_safe(self, scores, values, limit, child_scores) -> bool:
        """True when no dropped candidate can reach the score of the B-th kept one."""
        cut = limit < values.numel()
        if not bool(cut.any()):
            return True
        if child_scores.numel() < self.budget:
            return False
        kth = child_scores.topk(self.budget).values[-1]
        first_dropped = scores[cut] + values[limit[cut]]  # the best candidate each cut row lost
        return not bool((first_dropped >= kth).any())

    def _best_of(self, child_scores: torch.Tensor) -> torch.Tensor | None:
        """Indices of the best B candidates (candidate order = rank-path order), ascending; None
        when there are no more than B."""
        total = child_scores.numel()
        if total <= self.budget:
            return None
        if total <= _STABLE_SORT_MAX:  # a stable sort keeps tied candidates in rank-path order
            best = torch.sort(child_scores, descending=True, stable=True).indices[: self.budget]
        else:
            key = order_key(child_scores, torch.arange(total, device=self.device))
            best = key.topk(self.budget, largest=False, sorted=False).indices
        return best.sort().values

    def _remember(self, scores: torch.Tensor) -> None:
        """Keep the best B-1 non-root scores found so far (the expansion threshold)."""
        merged = torch.cat([self.best, scores])
        keep = self.budget - 1
        self.best = merged if merged.numel() <= keep else merged.topk(keep, sorted=False).values

    # ------------------------------------------------------------------ global selection
    def _preorder(self) -> torch.Tensor:
        """[P] every pool node's position in the depth-first (lexicographic rank-path) order.

        What precedes x: at each shallower depth, its ancestor and the ancestor's lex-smaller
        cousins (``prefix``); its own lex-smaller cousins (its lex position); and every pool node
        hanging below those cousins (their descendant counts, ``before``).
        """
        desc = [torch.zeros_like(self.levels[-1].tokens)]  # pool descendants per node, deepest first
        for child, parent in zip(self.levels[:0:-1], self.levels[-2::-1]):
            desc.append(torch.zeros_like(parent.tokens).index_add_(0, child.parent_rows, desc[-1] + 1))
        pieces, above = [], None  # above: prefix + lexpos + 1 of the previous level
        for level, count in zip(self.levels, desc[::-1]):
            lexpos = torch.arange(count.numel(), device=self.device)
            prefix = torch.zeros_like(lexpos) if above is None else above[level.parent_rows]
            pieces.append(prefix + lexpos + count.cumsum(0) - count)
            above = prefix + lexpos + 1
        return torch.cat(pieces)

    def select(self) -> tuple[torch.Tensor, ...]:
        """(order [m], tokens, scores, depths, parents): the best min(B, P - 1) pool nodes in
        canonical order, and the pool's node fields (pool index 0 is the root)."""
        tokens = torch.cat([lv.tokens for lv in self.levels])
        scores = torch.cat([lv.scores for lv in self.levels])
        parents = torch.cat([lv.parents for lv in self.levels])
        depths = torch.cat([torch.full_like(lv.tokens, d) for d, lv in enumerate(self.levels)])
        m = min(self.budget, self.size - 1)
        order = None if self.static else self._order_without_ties(scores, m)
        if order is None:
            order = order_key(scores[1:], self._preorder()[1:]).topk(m, largest=False, sorted=True).indices
        return order + 1, tokens, scores, depths, parents

    def _order_without_ties(self, scores: torch.Tensor, m: int) -> torch.Tensor | None:
        """The best m non-root nodes by score alone, or None if a score tie could need the rank paths."""
        extra = min(m + 1, self.size - 1)
        top = scores[1:].topk(extra, sorted=True)
        if bool((top.values[1:] == top.values[:-1]).any()):
            return None
        return top.indices[:m]


def frontier_selection(draft: DraftOutput, source: CandidateSource, budget: int, *,
                       static: bool) -> tuple[torch.Tensor, ...]:
    """(order, tokens, scores, depths, parents): the pool and its best min(B, P-1) nodes, canonical."""
    frontier = _Frontier(draft, source, budget, static)
    frontier.grow(draft.depth)
    return frontier.select()


def expand_frontier(draft: DraftOutput, source: CandidateSource, budget: int,
                    stop: StopRule | None = None, *, static: bool = False) -> DraftTree:
    """The torch backend: the same tree as `grow_reference`, built level by level."""
    order, tokens, scores, depths, parents = frontier_selection(draft, source, budget, static=static)
    if stop is not None:
        order = order[: int(stop.keep(draft, scores[order]))]
        order = order[: stop.trim(draft, scores[order])]
    return assemble(order, tokens, scores, depths, parents)


def assemble(order, tokens, scores, depths, parents) -> DraftTree:
    """The DraftTree of pool nodes ``order`` (canonical order, prefix-closed) under pool node 0."""
    index = torch.zeros_like(tokens)  # pool index -> tree index (the root stays 0)
    index[order] = torch.arange(1, order.numel() + 1, device=tokens.device)
    head = torch.zeros(1, dtype=torch.int64, device=tokens.device)
    return DraftTree(torch.cat([tokens[:1], tokens[order]]),
                     torch.cat([head - 1, index[parents[order]]]),
                     torch.cat([head, depths[order]]),
                     torch.cat([scores[:1], scores[order]]), check=False)
