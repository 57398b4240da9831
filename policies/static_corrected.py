"""Static-corrected (ablation): the scorer's correction taken once per depth, then factorized DDTree.

Contract
--------
``StaticCorrected(budget=16, top_m=64)``.  Roll the draft's `ConditionalScorer` greedily from the
root: at each depth expand the chain node with ``top_m = M``, which gives one corrected
distribution over M candidates for that depth, and step to its best child.  Every node at that
depth shares that distribution, and DDTree runs over these per-depth lists.  It separates
"having the correction" from "path dependence": the correction is there, the path is not.

Only the best min(B, M) of each distribution are requested (``k``): deeper ranks can never make
a tree of B nodes, and the normalisation is over all M either way.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from treespec.interfaces import DraftOutput
from treespec.policies.dominotree import require_scorer
from treespec.policies.engine.best_first import BestFirstPolicy, budget_field, count_field
from treespec.policies.engine.candidates import FactorizedSource
from treespec.policies.engine.stop import StopRule

__all__ = ["StaticCorrected", "greedy_corrected_lists"]


def greedy_corrected_lists(draft: DraftOutput, top_m: int, keep: int | None = None) -> FactorizedSource:
    """Per-depth candidate lists from the scorer along its own greedy chain.

    Each depth's list is normalised over the top-M candidates; only its best ``keep`` (default M)
    are returned, which is all a tree of budget B <= M can use.
    """
    scorer, m = draft.scorer, min(top_m, draft.vocab_size)
    k = m if keep is None else min(keep, m)
    state, tokens, logprobs = scorer.root_state(), [], []
    for depth in range(draft.depth):
        out = scorer.expand(state[None], depth, top_m=m, k=k)
        tokens.append(out.tokens[0])
        logprobs.append(out.logprobs[0])
        state = out.states[0, 0]  # the greedy child carries the chain on
    return FactorizedSource(tuple(tokens), tuple(logprobs))


@attrs.frozen
class StaticCorrected(BestFirstPolicy):
    """Corrected but factorized (see the module docstring)."""

    name: ClassVar[str] = "static-corrected"
    uses_scorer: ClassVar[str] = "required"

    budget: int = budget_field(16)  # non-root nodes per round
    top_m: int = count_field(64)  # base candidates per depth the correction is normalised over
    stop: StopRule | None = None  # optional early stop rule

    def validate(self, draft: DraftOutput) -> None:
        require_scorer(draft, "StaticCorrected")

    def candidates(self, draft: DraftOutput) -> FactorizedSource:
        return greedy_corrected_lists(draft, self.top_m, keep=self.budget)  # ranks past B never make the tree
