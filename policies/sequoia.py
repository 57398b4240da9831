"""Sequoia's tree (Chen et al. 2024, "Sequoia: Scalable, Robust, and Hardware-aware Speculative
Decoding"): the tree shape that maximises the expected accepted length under a positional
acceptance vector, found by dynamic programming, filled each round with the draft's ranked tokens.

Contract
--------
``Sequoia(budget=16, acceptance=PRESET, depth=None)``, and ``HardwareAwareSequoia(..., cost_model=)``.
``acceptance`` p_1, p_2, ... is the chance that the target's token is the rank-k candidate of a node's marginal (greedy
verification accepts at most one child; ranks by log-prob, ties by token id), the same at every
node: Sequoia's positional acceptance model.  The expected tokens a tree T yields in a round
(accepted draft tokens plus the bonus) is

    F(T) = sum over nodes v of T of  prod over the edges (u -> child of rank k) on the root-to-v path of p_k,

the root counting 1.  With c(n, d) the largest F over trees of n nodes (root included) and depth at
most d, and g(n, d, i) the best sum_k>=i p_k c(n_k, d - 1) over child subtrees of sizes n_k >= 1
summing to n on the ranks i, i + 1, ... (children take a prefix of the ranks):

    c(1, d) = 1;   c(n, d) = 1 + g(n - 1, d, 1)  (n >= 2, d >= 1);   c(n >= 2, 0) = -inf
    g(0, d, i) = 0;   g(n, d, i) = max( max_{1 <= m <= n} p_i c(m, d - 1) + g(n - m, d, i + 1),  [n = 0] )

(ranks past the vector have p = 0) solved exactly for every n up to budget + 1 (numpy, once per
settings; tested against enumerating every tree) and backtracked into rank
paths: the tree of n nodes is the `treespec.policies.static.Static` tree of those choices (both backends,
canonical order).  Ties between equally good allocations go to the earlier rank and the smaller m.

Hardware-aware size (the paper's choice of tree size for the machine; registered as
``hardware-aware-sequoia``): each round takes the size n <= budget + 1 maximising c(n, L) / (C_d +
C_v(n; ctx)) with ctx the draft's position (ties to the smaller tree), and the root-only tree when
that does not beat AR's 1 / C_v(1; ctx).  ``sequoia`` always builds the full budget.
`fit_acceptance` (treespec/apps/replay) estimates p from a replay trace.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import ClassVar

import attrs
import numpy as np

from treespec.interfaces import DraftController, DraftOutput, TreePolicy, backend_field
from treespec.policies.engine.best_first import budget_field
from treespec.policies.engine.cost import check_cost_model, require_cost_model
from treespec.policies.static import Static
from treespec.pricing.control import PricedController
from treespec.pricing.cost import CostModel
from treespec.tree import DraftTree

__all__ = ["ACCEPTANCE_PRESETS", "HardwareAwareSequoia", "Sequoia", "optimal_trees"]

# Positional acceptance vectors (p_1, p_2, ...): measured with `fit_acceptance` (see docs/policies/sequoia.md).
ACCEPTANCE_PRESETS: dict[str, tuple[float, ...]] = {
    # the embedded SmolLM2's shipped DFlash drafter: 16 held-out prompts (4 each of GSM8K, Alpaca, HumanEval,
    # MT-Bench), 64 greedy tokens each, all 7 depths pooled, 6,832 cells (docs/policies/sequoia.md)
    "smollm2-dflash": (0.1164, 0.0758, 0.0455, 0.0340, 0.0278, 0.0239, 0.0228, 0.0173, 0.0165, 0.0139, 0.0127,
                       0.0113, 0.0121, 0.0088, 0.0086, 0.0088),
}


def _acceptance(value) -> tuple[float, ...]:
    """A preset name, the path of a vector file (`fit_acceptance`'s ``save``), or the chances themselves."""
    if isinstance(value, str):
        if value in ACCEPTANCE_PRESETS:
            return ACCEPTANCE_PRESETS[value]
        try:
            data = json.loads(Path(value).read_text())
        except (OSError, json.JSONDecodeError):
            raise ValueError(f"acceptance {value!r} is neither a preset ({', '.join(ACCEPTANCE_PRESETS)}) nor a "
                             "readable acceptance vector file") from None
        value = data.get("vector", ()) if isinstance(data, dict) else ()
    p = tuple(float(x) for x in value)
    if not p or any(not 0.0 <= x <= 1.0 for x in p) or sum(p) > 1.0 + 1e-9:
        raise ValueError(f"acceptance must be chances p_1, p_2, ... in [0, 1] summing to at most 1, got {list(p)}")
    return p


def _depth_limit(instance, attribute, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"depth must be an integer >= 1 or None (the draft's depth), got {value!r}")


@functools.lru_cache(maxsize=64)
def optimal_trees(acceptance: tuple[float, ...], nodes: int, depth: int) -> tuple[tuple[float, ...], tuple]:
    """(c(n, depth) for n = 0..nodes, the rank paths of the best tree of each size n): the module's DP."""
    k = max(1, nodes - 1)  # a tree of n nodes uses at most n - 1 ranks; ranks past the vector have p = 0
    p = np.zeros(k)
    p[:min(k, len(acceptance))] = acceptance[:k]  # [K]
    neg = -np.inf
    c = np.full((depth + 1, nodes + 1), neg)  # c[d, n]
    c[:, 1] = 1.0
    choice = {}  # (d, n, i) -> m: the rank-i child's subtree size (0: no more children)
    for d in range(1, depth + 1):
        g = np.full((k + 2, nodes + 1), neg)  # g[i, n], ranks 1-based
        g[:, 0] = 0.0
        below = c[d - 1]  # [nodes + 1] c(m, d - 1)
        for i in range(k, 0, -1):
            nxt = g[i + 1]
            for n in range(1, nodes + 1):
                m = np.arange(1, n + 1)
                sub = below[m]  # [n] c(m, d - 1): -inf where no such subtree fits (0 * -inf must stay -inf)
                totals = np.where(sub > neg, p[i - 1] * np.where(sub > neg, sub, 0.0), neg) + nxt[n - m]  # [n]
                best = int(np.argmax(totals))  # the first maximum: the smallest m
                if totals[best] > neg:
                    g[i, n], choice[d, n, i] = totals[best], best + 1
        c[d, 2:] = 1.0 + g[1, 1:nodes]
    trees = tuple(_backtrack(choice, depth, n, k) if c[depth, n] > neg else () for n in range(nodes + 1))
    return tuple(float(x) for x in c[depth]), trees


def _backtrack(choice: dict, depth: int, n: int, k: int) -> tuple[tuple[int, ...], ...]:
    """The rank paths (0-based ranks, parents first) of the best tree of n nodes and depth <= depth."""
    paths: list[tuple[int, ...]] = []

    def grow(prefix: tuple[int, ...], d: int, size: int) -> None:  # size: nodes below the node at prefix
        i, left, kids = 1, size, []
        while left > 0 and i <= k and (d, left, i) in choice:
            m = choice[d, left, i]
            kids.append((prefix + (i - 1,), m))
            left, i = left - m, i + 1
        for path, _ in kids:
            paths.append(path)
        for path, m in kids:
            grow(path, d - 1, m - 1)

    grow((), depth, n - 1)
    return tuple(sorted(paths, key=lambda q: (len(q), q)))


@attrs.frozen
class Sequoia(TreePolicy):
    """The DP-optimal tree for a positional acceptance vector, at the full budget (module docstring)."""

    name: ClassVar[str] = "sequoia"

    budget: int = budget_field(16)  # non-root nodes of the tree
    backend: str = backend_field()  # "torch" (vectorised) or "networkx" (the readable reference)
    acceptance: tuple[float, ...] = attrs.field(default="smollm2-dflash", converter=_acceptance)  # p_1, p_2, ...
    depth: int | None = attrs.field(default=None, validator=_depth_limit)  # depth limit; None: the draft's

    def tables(self, draft: DraftOutput) -> tuple[tuple[float, ...], tuple]:
        """(expected tokens c(n), best tree) for every size n up to budget + 1 at this draft's depth."""
        return optimal_trees(self.acceptance, self.budget + 1, min(draft.depth, self.depth or draft.depth))

    def size(self, draft: DraftOutput) -> int:
        """Nodes of this round's tree, root included: the largest the budget and depth allow."""
        values, _ = self.tables(draft)
        return max(n for n in range(1, len(values)) if values[n] > -np.inf)

    def build(self, draft: DraftOutput) -> DraftTree:
        n = self.size(draft)
        if n == 1:
            return DraftTree.root_only(draft.root_token, device=draft.logprobs.device)
        return Static(self.tables(draft)[1][n], backend=self.backend).build(draft)


@attrs.frozen
class HardwareAwareSequoia(Sequoia):
    """Sequoia with the tree size chosen per round by the machine's cost model (module docstring)."""

    name: ClassVar[str] = "hardware-aware-sequoia"
    uses_cost_model: ClassVar[bool] = True

    cost_model: CostModel | None = attrs.field(default=None, validator=check_cost_model, kw_only=True)  # C_d, C_v

    def size(self, draft: DraftOutput) -> int:
        """The size n <= budget + 1 with the most expected tokens per second, or 1 (root only) when no
        tree beats AR at this context."""
        cost = require_cost_model(self.name, self.cost_model)
        values, _ = self.tables(draft)
        costs = (cost.draft_cost + cost.verify_costs(len(values) - 1, draft.position)).tolist()
        rate = [values[n] / costs[n] if values[n] > -np.inf else -np.inf for n in range(len(values))]
        best = max(range(2, len(values)), key=lambda n: (rate[n], -n), default=1)
        ar = 1.0 / float(cost.verify_costs(1, draft.position)[1])
        return best if rate[best] > ar else 1

    def draft_controller(self) -> DraftController:
        """Whether and at what price each round drafts (`treespec.pricing.control.PricedController`)."""
        return PricedController(require_cost_model(self.name, self.cost_model), None, self.budget)

    def priced(self, price: CostModel | None, calibration=None) -> HardwareAwareSequoia:
        """This policy sizing its trees at ``price`` (None keeps its own)."""
        return self if price is None else attrs.evolve(self, cost_model=price)
