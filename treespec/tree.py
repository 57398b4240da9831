"""The draft tree: one frozen, tensor-backed tree shared by every policy, verifier and backend.

Contract
--------
A `DraftTree` holds four 1-D tensors of length N (all on one device):

* ``tokens``  int64   -- node 0 is the root: the last committed (bonus) token.
* ``parents`` int64   -- ``parents[0] == -1`` and ``0 <= parents[i] < i`` (topological order).
* ``depths``  int64   -- ``depths[0] == 0`` and ``depths[i] == depths[parents[i]] + 1``.
* ``scores``  float32 -- cumulative draft log-probability of the root-to-node path (root 0.0).

The budget B counts non-root nodes, so N = B + 1.  Everything else (visibility mask, attention
mask, position ids, root-to-leaf paths, child maps, rank paths, graph views) is derived once and
cached.  Construction validates the invariants and raises `TreeError` naming the problem.

Canonical node order (what every policy backend returns): the order in which a best-first
max-heap pops nodes -- higher score first, ties broken by the rank path (the tuple of child
ranks from the root), lexicographically smaller first.  A child's rank is its index among its
parent's children sorted by score descending, ties by token id ascending.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["MAX_BUDGET", "DraftTree", "TreeError", "additive_mask", "check_budget", "check_count"]

MAX_BUDGET = 8192  # largest tree budget: an [N, N] float32 mask of 256 MiB, a verify forward over N tokens


class TreeError(ValueError):
    """A tree's tensors violate the DraftTree invariants."""


def check_count(value, name: str, *, most: int | None = None, meaning: str = "") -> int:
    """``value`` as an integer in [1, ``most``] (a width, a fan-out, a depth cap), else a ValueError
    naming ``name`` (and what it counts, ``meaning``)."""
    counted = f" ({meaning})" if meaning else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy integers are Integral
        raise ValueError(f"{name} must be an integer >= 1{counted}, got {value!r}")
    value = int(value)
    if value < 1:
        raise ValueError(f"{name} must be an integer >= 1{counted}, got {value}")
    if most is not None and value > most:
        raise ValueError(f"{name} {value} exceeds {most}{counted}")
    return value


def check_budget(value, where: str = "") -> int:
    """``value`` as a tree budget (non-root nodes): an integer in [1, `MAX_BUDGET`], else a ValueError
    naming ``where`` (a field, an option, a command-line flag).  The one budget check: policies'
    fields, method strings, ``--budget(s)``, bench configs and the API all call it."""
    name = f"{where}: budget" if where and where != "budget" else "budget"
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > MAX_BUDGET:
        raise ValueError(f"{name} {value} exceeds {MAX_BUDGET} nodes: a tree's [N, N] masks and the verify forward "
                         f"over N tokens would not fit in memory (the published harnesses cap trees at 1024)")
    return check_count(value, name, meaning="it counts non-root nodes")


def _as_tensor(values, dtype: torch.dtype, name: str) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        if values.dtype != dtype:
            raise TreeError(f"{name} must have dtype {dtype}, got {values.dtype}")
        return values
    raw = torch.as_tensor(values)
    if dtype == torch.int64 and raw.numel() and (raw.is_floating_point() or raw.is_complex() or raw.dtype == torch.bool):
        raise TreeError(f"{name} must be integers, got {raw.dtype} values")
    return raw.to(dtype)


def _check_vector(t: torch.Tensor, name: str, n: int, device: torch.device) -> None:
    if t.dim() != 1:
        raise TreeError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() != n:
        raise TreeError(f"length mismatch: tokens has {n} entries but {name} has {t.numel()}")
    if t.device != device:
        raise TreeError(f"{name} is on {t.device} but tokens is on {device}")


@attrs.frozen(eq=False)
class DraftTree:
    """A draft tree (batch of one).  See the module docstring for the invariants."""

    tokens: torch.Tensor  # [N] int64
    parents: torch.Tensor  # [N] int64, parents[0] = -1
    depths: torch.Tensor  # [N] int64, root 0
    scores: torch.Tensor  # [N] float32, cumulative path log-prob, root 0.0
    check: bool = attrs.field(default=True, kw_only=True, repr=False)  # validate on construction

    def __attrs_post_init__(self) -> None:
        if self.check:
            self._validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, tokens, parents, depths=None, scores=None, *, device=None) -> DraftTree:
        """Build from sequences or tensors; depths are derived when omitted, scores default to 0."""
        tokens = _as_tensor(tokens, torch.int64, "tokens").to(device)
        parents = _as_tensor(parents, torch.int64, "parents").to(tokens.device)
        if depths is None:
            depths = _depths_from_parents(parents)
        depths = _as_tensor(depths, torch.int64, "depths").to(tokens.device)
        if scores is None:
            scores = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        scores = _as_tensor(scores, torch.float32, "scores").to(tokens.device)
        return cls(tokens, parents, depths, scores)

    @classmethod
    def root_only(cls, token: int, *, device=None) -> DraftTree:
        """The empty draft (B = 0): autoregressive decoding is speculation with this tree (valid by
        construction: built without the general checks, every AR step makes one)."""
        if int(token) < 0:
            raise TreeError("tokens must be non-negative token ids")
        tokens = torch.tensor([int(token)], dtype=torch.int64, device=device)
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        return cls(tokens, zero - 1, zero, torch.zeros(1, dtype=torch.float32, device=device), check=False)

    @classmethod
    def chain(cls, root_token: int, tokens: Sequence[int] | torch.Tensor,
              logprobs: Sequence[float] | torch.Tensor | None = None, *, device=None) -> DraftTree:
        """A chain is a degenerate tree: node i's parent is i - 1."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64, device=device).reshape(-1)
        n = tokens.numel()
        all_tokens = torch.cat([tokens.new_tensor([root_token]), tokens])
        parents = torch.arange(-1, n, dtype=torch.int64, device=tokens.device)
        depths = torch.arange(0, n + 1, dtype=torch.int64, device=tokens.device)
        scores = torch.zeros(n + 1, dtype=torch.float32, device=tokens.device)
        if logprobs is not None:
            lp = torch.as_tensor(logprobs, dtype=torch.float32, device=tokens.device).reshape(-1)
            scores[1:] = _sequential_cumsum(lp)
        return cls(all_tokens, parents, depths, scores)

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]], *, root_token: int,
                     tokens: Sequence[int] | torch.Tensor,
                     scores: Sequence[float] | torch.Tensor | None = None, device=None) -> DraftTree:
        """Import EAGLE/Medusa/vLLM rank-path ``choices`` (one path per non-root node, in node order).

        ``tokens[j]`` (and optionally ``scores[j]``) belong to ``choices[j]``.  A path's parent
        (the path minus its last rank) must appear earlier in the list.
        """
        paths = [tuple(int(r) for r in c) for c in choices]
        tokens = list(torch.as_tensor(tokens).reshape(-1).tolist())
        if len(tokens) != len(paths):
            raise TreeError(f"length mismatch: {len(paths)} choices but {len(tokens)} tokens")
        parents = [-1] + _parents_of_paths(paths)
        all_scores = None if scores is None else [0.0] + list(torch.as_tensor(scores).reshape(-1).tolist())
        return cls.build([root_token] + tokens, parents, None, all_scores, device=device)

    @classmethod
    def from_topk_choices(cls, choices: Sequence[Sequence[int]], *, root_token: int,
                          topk_tokens: torch.Tensor, topk_logprobs: torch.Tensor | None = None) -> DraftTree:
        """Medusa-style static tree: node ``(r1..rd)`` takes the rank-``rd`` token of depth ``d``.

        ``topk_tokens`` is ``[L, K]`` (rank-sorted candidates per depth); scores accumulate
        ``topk_logprobs`` along each path when given.
        """
        paths = [tuple(int(r) for r in c) for c in choices]
        for p in paths:
            if len(p) > topk_tokens.shape[0] or max(p, default=0) >= topk_tokens.shape[1]:
                raise TreeError(f"choice {p} is outside the [L, K] = {tuple(topk_tokens.shape)} candidates")
        parents = [-1] + _parents_of_paths(paths)
        toks = [root_token] + [int(topk_tokens[len(p) - 1, p[-1]]) for p in paths]
        scores = None
        if topk_logprobs is not None:
            lp = topk_logprobs.to(torch.float32)
            scores = torch.zeros(len(toks), dtype=torch.float32)
            for j, p in enumerate(paths, start=1):
                scores[j] = scores[parents[j]] + lp[len(p) - 1, p[-1]]  # float32 + float32
        return cls.build(toks, parents, None, scores, device=topk_tokens.device)

    @classmethod
    def from_networkx(cls, graph: nx.DiGraph, *, device=None) -> DraftTree:
        """Inverse of `to_networkx`: integer nodes 0..N-1 with ``token`` (and ``score``) attributes."""
        n = graph.number_of_nodes()
        if sorted(graph.nodes) != list(range(n)):
            raise TreeError("graph nodes must be the integers 0..N-1 (node 0 the root)")
        parents = [-1] * n
        for u, v in graph.edges:
            if parents[v] != -1:
                raise TreeError(f"node {v} has two parents ({parents[v]} and {u})")
            parents[v] = u
        roots = [i for i in range(n) if parents[i] == -1]
        if roots != [0]:
            raise TreeError(f"graph must have exactly one root, node 0; roots found: {roots}")
        try:
            tokens = [int(graph.nodes[i]["token"]) for i in range(n)]
        except KeyError as exc:
            raise TreeError("every graph node needs a 'token' attribute") from exc
        scores = [float(graph.nodes[i].get("score", 0.0)) for i in range(n)]
        return cls.build(tokens, parents, None, scores, device=device)

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        tokens, parents, depths, scores = self.tokens, self.parents, self.depths, self.scores
        for name, t, dtype in (("tokens", tokens, torch.int64), ("parents", parents, torch.int64),
                               ("depths", depths, torch.int64), ("scores", scores, torch.float32)):
            if not isinstance(t, torch.Tensor):
                raise TreeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != dtype:
                raise TreeError(f"{name} must have dtype {dtype}, got {t.dtype}")
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise TreeError(f"tokens must be a non-empty 1-D tensor, got shape {tuple(tokens.shape)}")
        n = tokens.numel()
        for name, t in (("parents", parents), ("depths", depths), ("scores", scores)):
            _check_vector(t, name, n, tokens.device)
        self._validate_structure(n)
        if bool(torch.isnan(scores).any()):
            raise TreeError(f"scores contain NaN at nodes {torch.isnan(scores).nonzero().flatten().tolist()}")
        if float(scores[0]) != 0.0:
            raise TreeError(f"the root's score must be 0 (scores are path log-probabilities), got {float(scores[0])}")
        above = (scores[1:] > scores[parents[1:]]).nonzero().flatten()
        if above.numel():
            i = int(above[0]) + 1
            raise TreeError(f"node {i} scores {float(scores[i])} above its parent {int(parents[i])} "
                            f"({float(scores[int(parents[i])])}): a path log-probability cannot rise")
        if bool((tokens < 0).any()):
            raise TreeError("tokens must be non-negative token ids")

    def _validate_structure(self, n: int) -> None:
        parents, depths = self.parents, self.depths
        if int(parents[0]) != -1:
            raise TreeError(f"node 0 must be the root (parents[0] == -1), got parent {int(parents[0])}")
        if int(depths[0]) != 0:
            raise TreeError(f"the root must have depth 0, got {int(depths[0])}")
        idx = torch.arange(n, device=parents.device)
        rest = parents[1:]
        second_root = (rest == -1).nonzero().flatten()
        if second_root.numel():
            raise TreeError(f"second root: node {int(second_root[0]) + 1} has parent -1")
        bad = ((rest < 0) | (rest >= idx[1:])).nonzero().flatten()
        if bad.numel():
            i = int(bad[0]) + 1
            raise TreeError(f"parents are not topological: node {i} has parent {int(parents[i])} (need 0 <= parent < {i})")
        wrong = (depths[1:] != depths[rest] + 1).nonzero().flatten()
        if wrong.numel():
            i = int(wrong[0]) + 1
            raise TreeError(f"depths disagree with parents: node {i} has depth {int(depths[i])}, "
                            f"its parent {int(parents[i])} has depth {int(depths[parents[i]])}")

    # ------------------------------------------------------------------ basic views
    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def num_nodes(self) -> int:
        return self.tokens.numel()

    @property
    def budget(self) -> int:
        """Non-root node count B."""
        return self.tokens.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def root_token(self) -> int:
        return int(self.tokens[0])

    @functools.cached_property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def to(self, device) -> DraftTree:
        return DraftTree(self.tokens.to(device), self.parents.to(device), self.depths.to(device),
                         self.scores.to(device), check=False)

    def equal(self, other: DraftTree) -> bool:
        """Exact equality: same tokens, parents, depths, node order and score bits."""
        if len(self) != len(other):
            return False
        a, b = self.to("cpu"), other.to("cpu")
        return (torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
                and torch.equal(a.depths, b.depths)
                and torch.equal(a.scores.view(torch.int32), b.scores.view(torch.int32)))

    def select(self, keep: torch.Tensor) -> DraftTree:
        """The nodes where ``keep`` [N] bool is set, node order kept, parents re-indexed; ``keep`` must
        hold the root and be closed under ancestors (a depth cut, a score cut)."""
        if not bool(keep.all()):
            if not bool(keep[0]) or bool((keep[1:] & ~keep[self.parents[1:].clamp_min(0)]).any()):
                raise TreeError("select: the kept nodes must hold the root and every kept node's parent")
        elif len(keep) == len(self):
            return self
        new_index = torch.cumsum(keep.to(torch.int64), 0) - 1  # [N] old -> new index for kept nodes
        parents = self.parents[keep]
        parents = torch.where(parents >= 0, new_index[parents.clamp_min(0)], parents)
        return DraftTree(self.tokens[keep], parents, self.depths[keep], self.scores[keep], check=False)

    def canonical(self) -> DraftTree:
        """This tree with its nodes in canonical order: the pop order of a best-first max-heap, score
        descending, ties by rank path (`rank_paths`: sibling ranks by score, then token).  Every
        built-in policy returns it; any tree whose scores never rise from a parent to a child has
        one (a TreeError otherwise)."""
        scores = self.scores.tolist()
        order = sorted(range(1, len(self)), key=lambda i: (-scores[i], self.rank_paths[i]))
        if order == list(range(1, len(self))):
            return self
        position = {old: new for new, old in enumerate([0, *order])}
        parents = [-1] + [position[int(self.parents[i])] for i in order]
        if any(p >= i for i, p in enumerate(parents) if i):
            raise TreeError("no canonical order: a node scores above its parent (scores are path log-probs)")
        index = torch.tensor([0, *order], dtype=torch.int64, device=self.device)
        return DraftTree(self.tokens[index], torch.tensor(parents, dtype=torch.int64, device=self.device),
                         self.depths[index], self.scores[index], check=False)

    def same_tree(self, other: DraftTree) -> bool:
        """Equality up to node order: the canonical forms are `equal`."""
        return len(self) == len(other) and self.canonical().equal(other.canonical())

    # ------------------------------------------------------------------ derived, cached
    @functools.cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: ``mask[i, j]`` iff j is i or an ancestor of i (row i = mask[parent] | onehot(i))."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool, device=self.device)
        for d in range(1, self.max_depth + 1):
            rows = (self.depths == d).nonzero().flatten()  # nodes at depth d
            mask[rows] |= mask[self.parents[rows]]
        return mask

    def attention_mask(self, prefix_len: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[1, 1, N, prefix_len + N] additive mask: 0 where visible, the dtype's minimum elsewhere.

        Every tree node sees the whole committed prefix and its own ancestors (and itself).
        """
        n = len(self)
        visible = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool, device=self.device),
                             self.ancestor_mask], dim=1)
        return additive_mask(visible, dtype)[None, None]

    def position_ids(self, start: int) -> torch.Tensor:
        """[1, N] absolute positions: the root sits at ``start``, a node at ``start + depth``."""
        return (self.depths + start)[None]

    @functools.cached_property
    def num_children(self) -> torch.Tensor:
        """[N] int64 child counts."""
        counts = torch.zeros(len(self), dtype=torch.int64, device=self.device)
        return counts.index_add_(0, self.parents[1:], torch.ones_like(self.parents[1:]))

    @functools.cached_property
    def leaves(self) -> torch.Tensor:
        """[n_leaves] int64 indices of childless nodes, ascending."""
        return (self.num_children == 0).nonzero().flatten()

    @functools.cached_property
    def retrieve_indices(self) -> torch.Tensor:
        """[n_leaves, max_depth + 1] int64: each leaf's root-to-leaf node indices, padded with -1.

        Ancestors of a node have smaller indices and increasing depth, so sorting a mask row's
        member indices gives the path in root-to-leaf order.
        """
        n = len(self)
        rows = self.ancestor_mask[self.leaves]  # [n_leaves, N]
        idx = torch.arange(n, device=self.device).expand_as(rows)
        keyed = torch.where(rows, idx, torch.full_like(idx, n)).sort(dim=1).values
        keyed = keyed[:, : self.max_depth + 1]
        return torch.where(keyed == n, torch.full_like(keyed, -1), keyed)

    @functools.cached_property
    def first_child(self) -> torch.Tensor:
        """[N] int64: the smallest-index child of each node, -1 when none (SGLang layout)."""
        n = len(self)
        first = torch.full((n,), n, dtype=torch.int64, device=self.device)
        first.scatter_reduce_(0, self.parents[1:], torch.arange(1, n, device=self.device), reduce="amin")
        return torch.where(first == n, torch.full_like(first, -1), first)

    @functools.cached_property
    def next_sibling(self) -> torch.Tensor:
        """[N] int64: the next child (by index) of the same parent, -1 when none (SGLang layout)."""
        n = len(self)
        order = torch.sort(self.parents, stable=True).indices  # grouped by parent, index ascending
        nxt = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        same = self.parents[order[:-1]] == self.parents[order[1:]]
        nxt[order[:-1][same]] = order[1:][same]
        return nxt

    @functools.cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Child index lists per node (ascending index), as Python tuples for readable code."""
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            kids[p].append(i)
        return tuple(tuple(k) for k in kids)

    def path(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` inclusive."""
        parents = self.parents.tolist()
        out = [node]
        while parents[out[-1]] >= 0:
            out.append(parents[out[-1]])
        return out[::-1]

    @functools.cached_property
    def ranks(self) -> tuple[int, ...]:
        """Each node's rank among its siblings (score descending, token ascending); root 0."""
        scores, tokens = self.scores.tolist(), self.tokens.tolist()
        rank = [0] * len(self)
        for kids in self.children:
            for r, c in enumerate(sorted(kids, key=lambda c: (-scores[c], tokens[c]))):
                rank[c] = r
        return tuple(rank)

    @functools.cached_property
    def rank_paths(self) -> tuple[tuple[int, ...], ...]:
        """Each node's rank path from the root (root: the empty tuple)."""
        paths: list[tuple[int, ...]] = [()]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            paths.append(paths[p] + (self.ranks[i],))
        return tuple(paths)

    def to_choices(self) -> list[tuple[int, ...]]:
        """Export EAGLE/Medusa/vLLM ``choices``: the rank path of every non-root node, in node order."""
        return list(self.rank_paths[1:])

    def to_dict(self) -> dict[str, list]:
        """JSON-ready fields (scores as Python floats: float32 values round-trip exactly)."""
        return {"tokens": self.tokens.tolist(), "parents": self.parents.tolist(),
                "depths": self.depths.tolist(), "scores": self.scores.tolist()}

    @classmethod
    def from_dict(cls, data: dict, *, device=None) -> DraftTree:
        """Inverse of `to_dict`; ``depths`` and ``scores`` are optional."""
        missing = {"tokens", "parents"} - set(data)
        if missing:
            raise TreeError(f"tree record lacks {sorted(missing)}")
        return cls.build(data["tokens"], data["parents"], data.get("depths"), data.get("scores"), device=device)

    def to_networkx(self) -> nx.DiGraph:
        """A DiGraph with integer nodes 0..N-1, attributes token/depth/score, edges parent -> child."""
        import networkx as nx

        graph = nx.DiGraph()
        for i, (tok, dep, sc) in enumerate(zip(self.tokens.tolist(), self.depths.tolist(), self.scores.tolist())):
            graph.add_node(i, token=tok, depth=dep, score=sc)
        graph.add_edges_from((p, i) for i, p in enumerate(self.parents.tolist()) if p >= 0)
        return graph


def _depths_from_parents(parents: torch.Tensor) -> torch.Tensor:
    depths = [0] * parents.numel()
    for i, p in enumerate(parents.tolist()):
        if i == 0:
            continue
        if not 0 <= p < i:
            raise TreeError(f"parents are not topological: node {i} has parent {p} (need 0 <= parent < {i})")
        depths[i] = depths[p] + 1
    return torch.tensor(depths, dtype=torch.int64, device=parents.device)


def _parents_of_paths(paths: list[tuple[int, ...]]) -> list[int]:
    index = {(): 0}
    parents = []
    for j, p in enumerate(paths, start=1):
        if not p:
            raise TreeError("a choice must be a non-empty rank path (the root is implicit)")
        if p in index:
            raise TreeError(f"choice {p} appears twice")
        if p[:-1] not in index:
            raise TreeError(f"choice {p} comes before its parent {p[:-1]}")
        index[p] = j
        parents.append(index[p[:-1]])
    return parents


def _sequential_cumsum(logprobs: torch.Tensor) -> torch.Tensor:
    """float32 running sum with one rounding per step: score(child) = float32(score(parent) + logp)."""
    out = torch.empty_like(logprobs)
    acc = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    for i in range(logprobs.numel()):
        acc = acc + logprobs[i]
        out[i] = acc
    return out


def additive_mask(visible: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The additive attention mask of a bool ``visible`` mask: 0 where visible, the dtype's minimum elsewhere."""
    out = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return out.masked_fill_(~visible, torch.finfo(dtype).min)
