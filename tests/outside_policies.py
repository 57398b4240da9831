"""Policies written as an outside author would write them from docs/tutorial-policy.md alone.

`BeamByDepth` is not best-first: per depth it keeps the ``width`` best nodes by path score and
numbers its nodes depth by depth, ties its own way (token descending), so its order is not the
engine's.  `CappedDDTree` is DDTree no deeper than ``max_depth`` (fewer candidate lists than the
draft has depths).  `SureChildren` is DominoTree with a fan-out per node: a scorer wrapper gives a
parent only the children within ``ratio`` of its best (the others' log-probs set to -inf).
"""

from __future__ import annotations

import math

import attrs
import torch

from treespec import ConditionalScorer, DraftOutput, DraftTree, TreePolicy
from treespec.interfaces import Expansion
from treespec.policies.engine.best_first import BestFirstPolicy, budget_field, check_logprobs, count_field
from treespec.policies.engine.candidates import ScorerSource, TopTokens
from treespec.topk import exact_topk


@attrs.frozen
class BeamByDepth(TreePolicy):
    """Per depth, the ``width`` best children (by path score) of the nodes kept above."""

    name = "beam-by-depth"

    budget: int = budget_field(16)  # non-root nodes at most
    width: int = count_field(4)  # nodes kept per depth

    def build(self, draft: DraftOutput) -> DraftTree:
        check_logprobs(draft)
        tokens, parents, depths, scores = [draft.root_token], [-1], [0], [0.0]
        level = [0]  # node indices of the last depth
        for depth in range(draft.depth):
            room = min(self.width, self.budget + 1 - len(tokens))
            if room <= 0:
                break
            values, ids = exact_topk(draft.logprobs[depth:depth + 1], room)  # [1, room]
            children = [(float(torch.tensor(scores[p], dtype=torch.float32) + v), int(t), p)
                        for p in level for v, t in zip(values[0], ids[0].tolist())]
            children.sort(key=lambda c: (-c[0], -c[1]))  # score descending, ties by token descending
            level = []
            for score, token, parent in children[:room]:
                level.append(len(tokens))
                tokens.append(token), parents.append(parent), depths.append(depth + 1), scores.append(score)
        return DraftTree.build(tokens, parents, depths, scores, device=draft.logprobs.device)


@attrs.frozen
class CappedDDTree(BestFirstPolicy):
    """DDTree no deeper than ``max_depth``."""

    name = "capped-ddtree"

    budget: int = budget_field(16)  # non-root nodes per round
    max_depth: int = count_field(2)  # the deepest depth the tree may reach
    stop = None

    def validate(self, draft: DraftOutput) -> None:
        check_logprobs(draft)

    def candidates(self, draft: DraftOutput) -> TopTokens:
        return TopTokens(draft.logprobs[:self.max_depth], self.budget)


class _WithinRatio(ConditionalScorer):
    """The draft's scorer, each parent's children cut to those within ``ratio`` of its best."""

    def __init__(self, inner: ConditionalScorer, ratio: float) -> None:
        self.inner, self.cut = inner, math.log(ratio)

    def root_state(self) -> torch.Tensor:
        return self.inner.root_state()

    def expand(self, states: torch.Tensor, depth: int, *, top_m: int, k: int) -> Expansion:
        out = self.inner.expand(states, depth, top_m=top_m, k=k)
        far = out.logprobs < out.logprobs[:, :1] - self.cut  # [n, k]: not within the ratio of the best
        return Expansion(out.tokens, out.logprobs.masked_fill(far, -math.inf), out.states)


@attrs.frozen
class SureChildren(BestFirstPolicy):
    """DominoTree whose nodes keep only the children within ``ratio`` of their best (a per-node fan-out)."""

    name = "sure-children"
    uses_scorer = "required"

    budget: int = budget_field(16)  # non-root nodes per round
    ratio: float = 8.0  # a child is kept when p(best) / p(child) <= ratio
    node_topk: int = count_field(8)  # children a node may have at most
    stop = None

    def validate(self, draft: DraftOutput) -> None:
        if draft.scorer is None:
            raise ValueError("sure-children needs a draft with a ConditionalScorer")

    def candidates(self, draft: DraftOutput) -> ScorerSource:
        top_m = min(64, draft.vocab_size)
        return ScorerSource(_WithinRatio(draft.scorer, self.ratio), top_m, min(self.node_topk, top_m))
