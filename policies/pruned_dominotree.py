"""Pruned DominoTree: DominoTree whose every node keeps only the children a rule allows.

Contract
--------
``PrunedDominoTree(budget=16, top_m=64, node_topk=8, rule="mass", mass=0.9, ratio=8.0)``.  DominoTree
restricts each node's children to its best ``node_topk`` under the correction along the node's own
path (normalised over the depth's top-``top_m`` base candidates); this policy prunes further, node by
node, by what the node's own distribution says:

* ``rule="mass"``: the fewest children, best first, whose probabilities sum to at least ``mass``
  (top-p: a sure node keeps one child, an unsure one up to ``node_topk``);
* ``rule="ratio"``: the children within ``ratio`` of the node's best, p(best) / p(child) <= ratio
  (the top-1/top-2 gap rule, generalised: a node whose best leads by more keeps it alone).

Pruned children get log-prob -inf and are no candidates (policies/engine/candidates.py); the
budget then goes to other nodes' children, deeper or wider.  Scores are the children's own path
log-probs, unchanged.  A draft without a scorer is refused.
"""

from __future__ import annotations

import math
from typing import ClassVar

import attrs
import torch

from treespec.interfaces import DraftOutput
from treespec.policies.dominotree import corrected_source, require_scorer
from treespec.policies.engine.best_first import BestFirstPolicy, budget_field, count_field
from treespec.policies.engine.candidates import ScorerSource
from treespec.policies.engine.scorers import RescoredScorer
from treespec.policies.engine.stop import StopRule

__all__ = ["RULES", "PrunedDominoTree", "prune"]

RULES = ("mass", "ratio")


def prune(logprobs: torch.Tensor, rule: str, mass: float, ratio: float) -> torch.Tensor:
    """[n, k] ``logprobs`` (rows best first) with the children ``rule`` prunes set to -inf."""
    if rule == "mass":
        before = torch.cumsum(logprobs.double().exp(), dim=1) - logprobs.double().exp()  # [n, k] mass ahead of each
        keep = before < mass  # the first child always: nothing is ahead of it
    else:
        keep = logprobs >= logprobs[:, :1] - math.log(ratio)
    return logprobs.masked_fill(~keep, -math.inf)


def _positive(instance, attribute, value) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{attribute.name} must be a number > 0, got {value!r}")


@attrs.frozen
class PrunedDominoTree(BestFirstPolicy):
    """DominoTree with each node's children pruned by ``rule`` (module docstring)."""

    name: ClassVar[str] = "pruned-dominotree"
    uses_scorer: ClassVar[str] = "required"

    budget: int = budget_field(16)  # non-root nodes per round
    top_m: int = count_field(64)  # base candidates per depth the correction is normalised over
    node_topk: int = count_field(8)  # children a node may keep at most
    rule: str = attrs.field(default="mass", validator=attrs.validators.in_(RULES))  # "mass" (top-p) or "ratio"
    mass: float = attrs.field(default=0.9, validator=_positive)  # rule "mass": the probability a node's children hold
    ratio: float = attrs.field(default=8.0, validator=_positive)  # rule "ratio": p(best) / p(child) at most
    stop: StopRule | None = None  # optional early stop rule

    def validate(self, draft: DraftOutput) -> None:
        require_scorer(draft, "pruned DominoTree")

    def candidates(self, draft: DraftOutput) -> ScorerSource:
        base = corrected_source(draft, self.top_m, self.node_topk)
        rule, mass, ratio = self.rule, self.mass, self.ratio
        pruned = RescoredScorer(base.scorer, lambda depth, tokens, logprobs, main: prune(logprobs, rule, mass, ratio))
        return ScorerSource(pruned, base.top_m, base.k)
