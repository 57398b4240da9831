"""The shared builder's candidate resolution and the torch frontier expander: one home for both.

Contract
--------
A best-first policy says *what* its children are, as data (`Candidates`); this module decides
*how* they are computed for one build mode, and grows the tree:

* `TopTokens(logprobs, k)`: at depth d, the top-k tokens of row d - 1 (ties by token id), the same
  list under every parent (DDTree, CaDDTree, the chain over marginals).
* a `FactorizedSource`: explicit per-depth lists the policy computed itself (static-corrected).
* a `ScorerSource`: each parent's children from the draft's `ConditionalScorer` (DominoTree, the
  chain over a scorer).

`resolve(candidates, budget, mode)` turns them into the `CandidateSource` of one build.
``mode`` is ``"reference"`` (the networkx backend: one stable sort), ``"compact"`` (the torch
backend on the CPU: the exact top-k, lists cut to the tokens that can still enter a budget-B tree,
`reach`) or ``"static"`` (the torch backend elsewhere: shapes fixed by the budget, the depth and
the widths alone, no host synchronisation, so a GPU build can be captured in a CUDA graph,
policies/engine/cuda_graph.py).  Every mode gives the same tree, bit for bit.

`expand_frontier` is the torch backend itself: a per-depth beam of width B and one global
selection that return the networkx reference's tree (policies/engine/best_first.py) in canonical order.
Compact mode is `_Frontier` here; static mode is the stacked frontier of policies/engine/stacked.py over
one draft.  `grow_batch` builds several drafts' trees: together in the stacked frontier where
that is the cheaper build, else one compact build each.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import attrs
import torch

from treespec.interfaces import DraftOutput
from treespec.policies.engine.candidates import (
    Candidates,
    CandidateSource,
    FactorizedSource,
    ScorerSource,
    TopTokens,
    padded,
)
from treespec.policies.engine.stacked import SourceStack, assemble, stack_sources, stacked_selection
from treespec.policies.engine.stop import StopRule
from treespec.reach import best_chain, reachable
from treespec.topk import exact_topk, order_key, reference_topk
from treespec.tree import DraftTree

__all__ = ["MODES", "Mode", "assemble", "expand_frontier", "expand_frontier_batch", "finish",
           "frontier_selection", "grow_batch", "resolve", "resolve_batch"]

Mode = Literal["reference", "compact", "static"]
MODES = ("reference", "compact", "static")
_FIRST_PASS = 32  # compact mode: candidates per depth tried first when k is large
_HYPERBOLA_MIN = 4096  # factorized depths with more candidates than this get the pruned layout
_STABLE_SORT_MAX = 512  # up to this many candidates a stable sort beats building int64 keys
_CHUNK_MIN = 8  # fewest rows per scorer call when compact mode expands a depth in chunks
_STACKED_CELLS_MAX = 4096  # CPU: most candidates per stacked level for drafts to grow together (measured) ...
_STACKED_MIN_DRAFTS = 8  # ... and fewest drafts (benchmarks/bench_build_batch.py)


def resolve(candidates: Candidates, budget: int, mode: Mode) -> CandidateSource:
    """The `CandidateSource` of one build of at most ``budget`` nodes in ``mode`` (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"unknown build mode {mode!r}; expected one of {MODES}")
    if isinstance(candidates, ScorerSource):
        return attrs.evolve(candidates, check_values=mode != "static")  # value checks sync with the host
    if isinstance(candidates, FactorizedSource):
        return candidates
    if not isinstance(candidates, TopTokens):
        raise TypeError(f"a policy's candidates must be TopTokens, a FactorizedSource or a ScorerSource, "
                        f"got {type(candidates).__name__}")
    logprobs, k = candidates.logprobs, min(candidates.k, candidates.logprobs.shape[-1])
    if mode == "compact" and k > _FIRST_PASS:
        return _adaptive_source(logprobs, k, budget)
    values, tokens = (reference_topk if mode == "reference" else exact_topk)(logprobs, k)
    return FactorizedSource.from_rows(tokens, values)


def resolve_batch(candidates: Sequence[Candidates], budgets: Sequence[int], mode: Mode) -> list[CandidateSource]:
    """`resolve` of every (candidates, budget) pair, the same sources bit for bit; the top-k of the
    `TopTokens` that need one plain selection ([L, V] rows of one shape and one k) runs once over
    all their rows together (each row's selection does not depend on the others)."""
    sources: list[CandidateSource | None] = [None] * len(candidates)
    groups: dict[tuple, list[int]] = {}
    for i, (cand, budget) in enumerate(zip(candidates, budgets, strict=True)):
        k = min(cand.k, cand.logprobs.shape[-1]) if isinstance(cand, TopTokens) else 0
        if not isinstance(cand, TopTokens) or (mode == "compact" and k > _FIRST_PASS):
            sources[i] = resolve(cand, budget, mode)
        else:
            groups.setdefault((tuple(cand.logprobs.shape), cand.logprobs.device, k), []).append(i)
    for (shape, _, k), members in groups.items():
        rows = torch.cat([candidates[i].logprobs for i in members])  # [n L, V]
        values, tokens = (reference_topk if mode == "reference" else exact_topk)(rows, k)
        for i, v, t in zip(members, values.split(shape[0]), tokens.split(shape[0]), strict=True):
            sources[i] = FactorizedSource.from_rows(t, v)
    return sources


# ---------------------------------------------------------------------------- compact lists
def _adaptive_source(logprobs: torch.Tensor, k: int, budget: int) -> FactorizedSource:
    """Per-depth top-k lists that are only as long as they need to be.

    Any B distinct nodes bound the tree's B-th best score from below; `_score_floor` takes a
    cheap family of them.  A token at depth d can only enter the tree if float32(S + logp)
    reaches that floor, S being the best depth-(d-1) score (the top-1 chain; rounding is
    monotone).  Depths whose 33rd token cannot reach it keep their top 32; the others get exactly
    the tokens that can (at most min(k, B), best first).
    """
    values, tokens = exact_topk(logprobs, _FIRST_PASS + 1)  # [L, 33]
    chain = best_chain(values[:, 0])  # [L] best score of a parent at each depth
    floor = _score_floor(values[:, :_FIRST_PASS], chain, budget)
    narrow = FactorizedSource.from_rows(tokens[:, :_FIRST_PASS], values[:, :_FIRST_PASS])
    widen = reachable(values[:, _FIRST_PASS:_FIRST_PASS + 1], chain, floor)[:, 0].nonzero().flatten().tolist()
    if not widen:
        return narrow
    rows_t, rows_v = list(narrow.tokens), list(narrow.logprobs)
    for d in widen:
        rows_t[d], rows_v[d] = _reachable(logprobs[d], chain[d], floor, min(k, budget))
    return FactorizedSource(tuple(rows_t), tuple(rows_v))


def _score_floor(values: torch.Tensor, chain: torch.Tensor, budget: int) -> float:
    """The B-th best score among some B real nodes (-inf if the family is smaller than B).

    The family: every depth-1 node, every depth-2 node, and below that the top-1 chain ending in
    each candidate -- scores float32(parent + logp), exactly as the tree computes them.
    """
    family = [values[0], (values[0, :, None] + values[1:2].reshape(-1)[None, :]).reshape(-1),
              (chain[2:, None] + values[2:]).reshape(-1)]  # depths 1, 2 and 3..L
    scores = torch.cat(family)
    if scores.numel() < budget:
        return float("-inf")
    return float(scores.topk(budget, sorted=False).values.min())


def _reachable(row: torch.Tensor, parent: torch.Tensor, floor: float, most: int):
    """The best (at most ``most``) tokens t of ``row`` with float32(parent + row[t]) >= floor, best first."""
    ids = reachable(row[None], parent.reshape(1), floor)[0].nonzero().flatten()
    top = order_key(row[ids], ids).topk(min(most, ids.numel()), largest=False, sorted=True).indices
    return ids[top], row[ids[top]]


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


@functools.lru_cache(maxsize=512)
def _grid(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) [n * k] of each cell of a row-major [n, k] grid (cached: compact builds reuse them)."""
    index = torch.arange(n * k, device=device)
    return index // k, index % k


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

    def __init__(self, draft: DraftOutput, source: CandidateSource, budget: int) -> None:
        device = draft.logprobs.device
        self.source, self.budget, self.device = source, budget, device
        root = torch.full((1,), draft.root_token, dtype=torch.int64, device=device)
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
        if depth == 0:
            return None
        if self.budget == 1:
            return self.levels[-1].tokens.new_empty(0)  # the single best depth-1 node needs no children
        if self.best.numel() < self.budget - 1:
            return None
        rows = (self.levels[-1].scores >= self.best.min()).nonzero().flatten()
        return None if rows.numel() == self.levels[-1].tokens.numel() else rows

    def _step(self, depth: int, rows: torch.Tensor | None) -> None:
        level = self.levels[-1]
        if isinstance(self.source, FactorizedSource):
            cand = self._factorized(level.scores if rows is None else level.scores[rows], depth, rows)
        else:
            cand = self._expanded_in_chunks(rows, depth)
        parent_rows, child_scores, tokens, self.states = cand.take(self._best_of(cand.scores))
        level_start = self.size - level.tokens.numel()
        self.levels.append(_Level(tokens, child_scores, parent_rows, parent_rows + level_start))
        self.size += tokens.numel()
        if isinstance(self.source, FactorizedSource):
            self._remember(child_scores)

    def _expanded(self, scores: torch.Tensor, states: torch.Tensor | None, depth: int,
                  rows: torch.Tensor | None = None) -> _Candidates:
        """Every child of the nodes ``rows`` of the last level (None: all), from the source."""
        out = self.source.expand(states, scores.numel(), depth)
        n, k = out.tokens.shape
        parent, col = _grid(n, k, self.device)
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
        parent, col = _grid(n, width, self.device)
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
        order = self._order_without_ties(scores, m)
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
    """(order, tokens, scores, depths, parents): the pool and its best min(B, P-1) nodes, canonical;
    ``static``: the stacked frontier over this one draft (policies/engine/stacked.py)."""
    if static:
        stack = stack_sources([source])
        if stack is None:  # a single source always stacks; kept as a guard for new source kinds
            raise TypeError(f"cannot build {type(source).__name__} in static mode")
        root = torch.full((1, 1), draft.root_token, dtype=torch.int64, device=draft.logprobs.device)  # capturable
        orders, *pool = stacked_selection(root, stack, [budget], draft.depth)
        return orders[0], *(t[0] for t in pool)
    frontier = _Frontier(draft, source, budget)
    frontier.grow(draft.depth)
    return frontier.select()


def expand_frontier(draft: DraftOutput, source: CandidateSource, budget: int,
                    stop: StopRule | None = None, *, static: bool = False) -> DraftTree:
    """The torch backend: the same tree as `grow_reference`, built level by level."""
    order, tokens, scores, depths, parents = frontier_selection(draft, source, budget, static=static)
    return finish(draft, order, (tokens, scores, depths, parents), stop)


def grow_batch(drafts: Sequence[DraftOutput], candidates: Sequence[Candidates], budgets: Sequence[int],
               stop: StopRule | None = None) -> list[DraftTree]:
    """The torch backend's trees of several drafts (one device), each bit for bit its own build's.

    Drafts of one depth whose static build is cheap (`_stacks_cheaply`; always off the CPU) grow
    together in one stacked frontier; the others each grow alone in compact mode, their top-k
    selections still batched (`resolve_batch`).
    """
    kinds = {draft.logprobs.device.type for draft in drafts}
    if len(kinds) > 1:
        raise ValueError("the drafts of one batch must share a device")
    stacked = kinds != {"cpu"} or _stacks_cheaply(drafts[0], candidates, budgets)
    sources = [padded(s, d.depth) for s, d in zip(resolve_batch(candidates, budgets, "static" if stacked else "compact"),
                                                  drafts, strict=True)]
    if not stacked:
        return [expand_frontier(d, src, b, stop) for d, src, b in zip(drafts, sources, budgets, strict=True)]
    trees: list[DraftTree | None] = [None] * len(drafts)
    groups: dict[int, list[int]] = {}
    for i, draft in enumerate(drafts):
        groups.setdefault(draft.depth, []).append(i)
    for members in groups.values():
        stack = stack_sources([sources[i] for i in members]) if len(members) > 1 else None
        if stack is None:
            for i in members:
                trees[i] = expand_frontier(drafts[i], sources[i], budgets[i], stop, static=True)
            continue
        built = expand_frontier_batch([drafts[i] for i in members], stack, [budgets[i] for i in members], stop)
        for i, tree in zip(members, built, strict=True):
            trees[i] = tree
    return trees


def _stacks_cheaply(draft: DraftOutput, candidates: Sequence[Candidates], budgets: Sequence[int]) -> bool:
    """On the CPU: whether the stacked static build is expected to beat one compact build per draft.

    A static level scores every child of B parents -- B x k candidates for marginal lists, B
    corrections over M candidates for a scorer -- where compact mode scores only what can still
    enter the tree; stacking saves the per-tree operations.  benchmarks/bench_build_batch.py
    measured (2-core Zen 3, one thread, V = 49152, L = 7; docs/batching.md) stacked / compact
    0.70-0.81 at S = 8 and up to 4096 candidates per level, 0.84-1.03 at S = 4, 0.99-1.30 at S = 2,
    and 3.5 for DDTree at S = 8, B = 256 (65536 candidates per level)."""
    if len(candidates) < _STACKED_MIN_DRAFTS:
        return False
    first = candidates[0]
    per_level = max(budgets) * (first.top_m if isinstance(first, ScorerSource) else
                                min(first.k, draft.vocab_size) if isinstance(first, TopTokens) else
                                max(t.numel() for t in first.tokens))
    return per_level <= _STACKED_CELLS_MAX


def expand_frontier_batch(drafts: Sequence[DraftOutput], stack: SourceStack, budgets: Sequence[int],
                          stop: StopRule | None = None) -> list[DraftTree]:
    """The static torch backend for S drafts of one depth at once: each tree bit for bit
    `expand_frontier`'s for that draft alone (policies/engine/stacked.py)."""
    device = drafts[0].logprobs.device
    roots = torch.cat([torch.full((1, 1), d.root_token, dtype=torch.int64, device=device) for d in drafts])
    orders, *pool = stacked_selection(roots, stack, budgets, drafts[0].depth)
    return [finish(draft, order, tuple(t[i] for t in pool), stop)
            for i, (draft, order) in enumerate(zip(drafts, orders, strict=True))]


def finish(draft: DraftOutput, order: torch.Tensor, pool: tuple[torch.Tensor, ...],
           stop: StopRule | None) -> DraftTree:
    """The tree of pool nodes ``order`` (canonical) after the stop rule; pool = (tokens, scores, depths, parents)."""
    if stop is not None:
        scores = pool[1]
        order = order[: int(stop.keep(draft, scores[order]))]
        order = order[: stop.trim(draft, scores[order])]
    return assemble(order, *pool)
