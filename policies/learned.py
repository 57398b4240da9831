"""Acceptance learned online: DDTree and DominoTree rescored by what the target accepted, per depth,
sibling rank and whether the parent lies on the drafter's main path.

Contract
--------
``LearnedDDTree(budget=16, node_topk=16)`` (over marginals) and ``LearnedDominoTree(budget=16,
top_m=64, node_topk=8)`` (over the draft's scorer) build their parent's best-first trees with each
child's conditional probability p (the drafter's, given its parent) multiplied by a factor c of
its cell, capped at 1: the cell of a child is (its parent on the drafter's main path -- every
rank 0 from the root -- or not, its depth, its rank among its siblings by the drafter).  Within a
parent the drafter's order is kept (a running minimum along the ranks).  Scores are the path sums
of these log-probs, so the tree's own scores are what the policy expected of each node.

The factors (an `AcceptanceTable`, shared by the policy and its copies, starting at 1: the parent
policy's trees exactly) are learned through the loop's declared feedback
(`TreePolicy.observe_round`): after each drafted round, each node whose parent the target accepted
was tested, and its cell counts it, accepted or not, against the drafter's own probability of it
(the tree's probability divided by the factor it was built with: the factors change only at a
refit, so a round's tree was built with the current ones).  Every ``refit_every`` rounds each
factor becomes (A + a) / (E + a) over everything its cell has counted (A: accepted, E: the
drafter's expected acceptances, a: ``prior``, the evidence a factor away from 1 must gather), so a
drafter that prices off-path nodes as it prices the main path (a sibling's continuation accepted a
fifth as often as the main path's, in an independent study of DDTree) is re-priced cell by cell.
Factors stay within [1/16, 16].  The table is the policy's ``learned_state``: `treespec profile-cost --calibrate`
learns one per drafter on its calibration prompts and keeps it with the drafter's calibration, and
the bench, the demo and ``treespec.generate`` start a learning policy from it (``restore_learned``);
a run does not write it back.  The policies also take one as ``table=``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import attrs
import torch

from treespec.interfaces import DraftOutput, RoundReport
from treespec.policies.dominotree import corrected_source, require_scorer
from treespec.policies.engine.best_first import BestFirstPolicy, budget_field, check_logprobs, count_field
from treespec.policies.engine.candidates import ScorerSource
from treespec.policies.engine.scorers import RescoredScorer, RowScorer
from treespec.tree import DraftTree

__all__ = ["AcceptanceTable", "LearnedDDTree", "LearnedDominoTree"]

_BOUND = 16.0  # the factors stay within [1 / _BOUND, _BOUND]


@attrs.define(eq=False)
class AcceptanceTable:
    """Per cell (main path or not, depth, rank) a factor on the drafter's conditional probabilities."""

    depths: int = 16  # cells by depth (deeper children share the last)
    ranks: int = 8  # cells by sibling rank (lower ranks share the last)
    prior: float = 4.0  # a: the expected acceptances a factor away from 1 must gather
    refit_every: int = 8  # drafted rounds between refits
    factor: torch.Tensor = attrs.field(default=None)  # [2, depths, ranks] float64 (index 1: main path)
    accepted: torch.Tensor = attrs.field(default=None)  # [2, depths, ranks] tested children accepted
    expected: torch.Tensor = attrs.field(default=None)  # [2, depths, ranks] the drafter's probabilities of them, summed
    rounds: int = 0  # drafted rounds since the last refit
    refits: int = 0  # refits so far

    def __attrs_post_init__(self) -> None:
        shape = (2, self.depths, self.ranks)
        self.factor = torch.ones(shape, dtype=torch.float64) if self.factor is None else self.factor
        self.accepted = torch.zeros(shape, dtype=torch.float64) if self.accepted is None else self.accepted
        self.expected = torch.zeros(shape, dtype=torch.float64) if self.expected is None else self.expected

    def rescore(self, depth: int, tokens: torch.Tensor, logprobs: torch.Tensor, main: torch.Tensor) -> torch.Tensor:
        """[n, k] children's log-probs (rows in the drafter's order) times their cells' factors, at most 0,
        kept in order within each row."""
        k = logprobs.shape[1]
        ranks = torch.arange(k, device=logprobs.device).clamp_max(self.ranks - 1)
        factor = self.factor.to(logprobs.device)[main.long(), min(depth, self.depths - 1)][:, ranks]  # [n, k]
        out = (logprobs.double() + factor.log()).clamp_max(0.0)
        return torch.cummin(out, dim=1).values.to(logprobs.dtype)

    def observe(self, tree: DraftTree, accepted: list[int]) -> bool:
        """One verified tree's tested nodes into their cells; True when this round refitted the factors."""
        on = set(accepted)
        scores, parents, depths = tree.scores.tolist(), tree.parents.tolist(), tree.depths.tolist()
        for i in range(1, len(tree)):
            parent = parents[i]
            if parent not in on:
                continue  # never tested: the target's token at its parent was another's
            main = int(all(r == 0 for r in tree.rank_paths[parent]))
            cell = (main, min(depths[i] - 1, self.depths - 1), min(tree.ranks[i], self.ranks - 1))
            self.accepted[cell] += float(i in on)
            self.expected[cell] += math.exp(scores[i] - scores[parent]) / float(self.factor[cell])  # the drafter's p
        self.rounds += 1
        if self.rounds < self.refit_every:
            return False
        self.factor = ((self.accepted + self.prior) / (self.expected + self.prior)).clamp(1.0 / _BOUND, _BOUND)
        self.rounds, self.refits = 0, self.refits + 1
        return True

    def to_record(self) -> dict:
        return {"depths": self.depths, "ranks": self.ranks, "prior": self.prior, "refit_every": self.refit_every,
                "factor": self.factor.tolist(), "accepted": self.accepted.tolist(), "expected": self.expected.tolist(),
                "refits": self.refits}

    @classmethod
    def from_record(cls, record: dict) -> AcceptanceTable:
        shape = (2, int(record["depths"]), int(record["ranks"]))
        factor, accepted, expected = (torch.tensor(record[k], dtype=torch.float64)
                                      for k in ("factor", "accepted", "expected"))
        if {factor.shape, accepted.shape, expected.shape} != {shape} or not bool(
                ((factor >= 1 / _BOUND) & (factor <= _BOUND)).all()) or bool((accepted < 0).any() | (expected < 0).any()):
            raise ValueError(f"an acceptance table's factors must be [2, depths, ranks] within [1/{_BOUND:g}, "
                             f"{_BOUND:g}], its counts of that shape and >= 0")
        return cls(shape[1], shape[2], float(record["prior"]), int(record["refit_every"]), factor=factor,
                   accepted=accepted, expected=expected, refits=int(record.get("refits", 0)))


def _table_field():
    return attrs.field(factory=AcceptanceTable, metadata={"option": False})  # learned, not a method option


class _Learned:
    """What both policies share: a drafted round's verified tree into the table; the table kept."""

    learns: ClassVar[bool] = True

    table: AcceptanceTable

    def observe_round(self, report: RoundReport) -> None:
        if report.drafted and len(report.tree) > 1:
            self.table.observe(report.tree, report.result.accepted.tolist())

    def learned_state(self) -> dict:
        return self.table.to_record()

    def restore_learned(self, state) -> None:
        kept = AcceptanceTable.from_record(dict(state))
        for field in attrs.fields(AcceptanceTable):
            setattr(self.table, field.name, getattr(kept, field.name))


@attrs.frozen
class LearnedDDTree(_Learned, BestFirstPolicy):
    """DDTree with the drafter's marginals rescored per cell (module docstring)."""

    name: ClassVar[str] = "learned-ddtree"

    budget: int = budget_field(16)  # non-root nodes per round
    node_topk: int = count_field(16)  # children a node may have (the budget: DDTree's own tree)
    table: AcceptanceTable = _table_field()  # the factors, learned from verified rounds
    stop = None

    def validate(self, draft: DraftOutput) -> None:
        check_logprobs(draft)

    def candidates(self, draft: DraftOutput) -> ScorerSource:
        k = min(self.node_topk, draft.vocab_size)
        return ScorerSource(RescoredScorer(RowScorer(draft.logprobs), self.table.rescore), k, k)


@attrs.frozen
class LearnedDominoTree(_Learned, BestFirstPolicy):
    """DominoTree with the scorer's children rescored per cell (module docstring)."""

    name: ClassVar[str] = "learned-dominotree"
    uses_scorer: ClassVar[str] = "required"

    budget: int = budget_field(16)  # non-root nodes per round
    top_m: int = count_field(64)  # base candidates per depth the correction is normalised over
    node_topk: int = count_field(8)  # children kept per expanded node
    table: AcceptanceTable = _table_field()  # the factors, learned from verified rounds
    stop = None

    def validate(self, draft: DraftOutput) -> None:
        require_scorer(draft, "learned DominoTree")

    def candidates(self, draft: DraftOutput) -> ScorerSource:
        base = corrected_source(draft, self.top_m, self.node_topk)
        return ScorerSource(RescoredScorer(base.scorer, self.table.rescore), base.top_m, base.k)
