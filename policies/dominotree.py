"""DominoTree: conditional best-first, each node scored under its own path's scorer state.

Contract
--------
``DominoTree(budget=16, top_m=64, node_topk=8, stop=None)``.  The draft must carry a
`ConditionalScorer`.  A node at depth d gets its children from ``scorer.expand(states, d,
top_m=M, k=node_topk)``: the scorer uses the base log-probs at depths inside its pure-draft
prefix, and otherwise renormalises the correction over the top-M base candidates of that depth
and returns the best node_topk with their own path states.  The heap semantics are DDTree's.
``DominoTree(..., stop=CostAwareStop(model))`` is the cost-aware variant.

The torch backend expands every frontier node of a depth in one ``expand`` call; it returns the
networkx tree bit for bit when the scorer's rows do not depend on the batch they were computed in.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from treespec.interfaces import DraftOutput
from treespec.policies.engine.best_first import BestFirstPolicy, budget_field, count_field
from treespec.policies.engine.candidates import ScorerSource
from treespec.policies.engine.stop import StopRule

__all__ = ["DominoTree", "check_node_topk", "corrected_source", "require_scorer"]


def require_scorer(draft: DraftOutput, policy: str) -> None:
    if draft.scorer is None:
        raise ValueError(f"{policy} needs a draft with a ConditionalScorer (e.g. from the Domino drafter); "
                         f"this DraftOutput has scorer=None")


def check_node_topk(node_topk: int, top_m: int) -> None:
    if node_topk > top_m:
        raise ValueError(f"node_topk ({node_topk}) cannot exceed top_m ({top_m})")


def corrected_source(draft: DraftOutput, top_m: int, node_topk: int) -> ScorerSource:
    """DominoTree's candidates, for it and the policies built on its tree: each node's best
    ``node_topk`` children under the correction along its own path, over the depth's top-``top_m``
    base candidates (both capped at the vocabulary)."""
    check_node_topk(node_topk, top_m)
    top_m = min(top_m, draft.vocab_size)
    return ScorerSource(draft.scorer, top_m, min(node_topk, top_m))


@attrs.frozen
class DominoTree(BestFirstPolicy):
    """Path-dependent best-first (see the module docstring)."""

    name: ClassVar[str] = "dominotree"
    uses_scorer: ClassVar[str] = "required"

    budget: int = budget_field(16)  # non-root nodes per round
    top_m: int = count_field(64)  # base candidates per depth the correction is normalised over
    node_topk: int = count_field(8)  # children kept per expanded node
    stop: StopRule | None = None  # optional early stop rule

    def __attrs_post_init__(self) -> None:
        check_node_topk(self.node_topk, self.top_m)

    def validate(self, draft: DraftOutput) -> None:
        require_scorer(draft, "DominoTree")

    def candidates(self, draft: DraftOutput) -> ScorerSource:
        return corrected_source(draft, self.top_m, self.node_topk)
