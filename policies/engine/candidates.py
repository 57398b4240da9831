"""Where a best-first policy's child candidates come from.

Contract
--------
A `CandidateSource` answers one question for both backends: given the scorer states of n parent
nodes at ``depth``, which children can they have?  ``expand`` returns `Expansion`: tokens and
log-probs [n, k], each row sorted by log-prob descending (ties by token ascending), and the
children's own states [n, k, S] (None for factorized sources).  ``k`` may differ between depths
but not between the parents of one call.

* `FactorizedSource` -- the same ranked list for every parent at a depth (marginals; DDTree,
  CaDDTree, the DFlash chain, and the static-corrected ablation).  Its lists are held per depth
  (``tokens``/``logprobs``, [K_d] each) so the torch expander can exploit that parents share them.
* `ScorerSource` -- a `ConditionalScorer` (Domino's GRU correction): each parent's children depend
  on its own path state.

Scorers are driven through `ConditionalScorer`'s deferred-expansion protocol (``expand_deferred``
and ``advance``, no-ops by default): a scorer that overrides them (drafters/domino.py's
`DominoScorer`) leaves its children's states pending (cheap to make) and `ScorerSource` completes
only the rows it is asked to expand, so the many children a tree never expands cost no state update.

The networkx reference calls ``expand`` with n = 1 per popped node; the torch expander calls it
with every frontier node of a depth at once.  Both backends agree bit for bit only if the scorer
computes each row independently of the batch it came in (see drafters/toy.py for one that does).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import attrs
import torch

from treespec.interfaces import ConditionalScorer, Expansion

__all__ = ["CandidateSource", "Candidates", "FactorizedSource", "ScorerSource", "TopTokens", "check_children",
           "scorer_children"]


class CandidateSource(ABC):
    """Child candidates for the best-first skeleton and the frontier expander."""

    @abstractmethod
    def root_state(self) -> torch.Tensor | None:
        """[S] the root's path state (None for factorized sources)."""

    @abstractmethod
    def expand(self, states: torch.Tensor | None, n: int, depth: int) -> Expansion:
        """Expansion at ``depth + 1`` of n parents at ``depth`` whose states are ``states`` [n, S]."""


@attrs.frozen(eq=False)
class FactorizedSource(CandidateSource):
    """One ranked candidate list per depth, shared by every parent at that depth."""

    tokens: tuple[torch.Tensor, ...]  # per depth d-1: [K_d] int64 candidates at depth d, best first
    logprobs: tuple[torch.Tensor, ...]  # per depth: [K_d] float32, descending, ties by token ascending

    @classmethod
    def from_rows(cls, tokens: torch.Tensor, logprobs: torch.Tensor) -> FactorizedSource:
        """From [L, K] matrices (the same K at every depth)."""
        return cls(tuple(tokens.unbind(0)), tuple(logprobs.unbind(0)))

    def root_state(self) -> None:
        return None

    def expand(self, states: torch.Tensor | None, n: int, depth: int) -> Expansion:
        tokens, logprobs = self.tokens[depth], self.logprobs[depth]
        return Expansion(tokens.expand(n, -1), logprobs.expand(n, -1), None)


@attrs.frozen(eq=False)
class ScorerSource(CandidateSource):
    """Expansion from ``scorer.expand(states, depth, top_m, k)``, checked on the way out."""

    scorer: ConditionalScorer  # the draft's path-dependent scorer
    top_m: int  # candidates per depth the correction is normalised over
    k: int  # children kept per parent
    check_values: bool = True  # also reject NaN / positive log-probs (a host sync; off in static mode)

    def root_state(self) -> torch.Tensor:
        state = self.scorer.root_state()
        if state.dim() != 1:
            raise ValueError(f"scorer.root_state() must be a [S] tensor, got shape {tuple(state.shape)}")
        return state

    def expand(self, states: torch.Tensor | None, n: int, depth: int) -> Expansion:
        out = scorer_children(self.scorer, states, depth, self.top_m, self.k)
        check_children(out.tokens, out.logprobs, out.states, (n,), depth, self.check_values)
        return out


@attrs.frozen(eq=False)
class TopTokens:
    """Children at depth d: the top-k tokens of ``logprobs`` row d - 1 under every parent."""

    logprobs: torch.Tensor  # [L, V] float32 log-probs (the draft's marginals, or a policy's own rows)
    k: int  # candidates per depth (at most V)


Candidates = TopTokens | FactorizedSource | ScorerSource  # what a best-first policy's ``candidates`` returns


def scorer_children(scorer, states: torch.Tensor, depth: int, top_m: int, k: int) -> Expansion:
    """``scorer``'s children of parents ``states`` through the deferred-expansion protocol of
    `ConditionalScorer`: states below the root are pending children, completed first (only the
    rows being expanded pay for their completion; a scorer that defers nothing completes nothing)."""
    states = states if depth == 0 else scorer.advance(states)
    return scorer.expand_deferred(states, depth, top_m=top_m, k=k)


def check_children(tokens, logprobs, states, lead: tuple[int, ...], depth: int, check_values: bool) -> None:
    """Refuse a scorer's children that are not tokens / log-probs [*lead, k] and states [*lead, k, S]
    (``lead`` is (n,) for one scorer, (S, n) for a stack), with NaN or positive log-probs if asked."""
    where, want = f"scorer.expand at depth {depth}", ", ".join(map(str, lead))
    if tokens.shape[:-1] != lead or tokens.dim() != len(lead) + 1 or logprobs.shape != tokens.shape:
        raise ValueError(f"{where} must return tokens and logprobs of shape [{want}, k], "
                         f"got {tuple(tokens.shape)} and {tuple(logprobs.shape)}")
    if tokens.dtype != torch.int64 or logprobs.dtype != torch.float32:
        raise ValueError(f"{where} must return int64 tokens and float32 logprobs, "
                         f"got {tokens.dtype} and {logprobs.dtype}")
    if states.shape[:-1] != tokens.shape:
        raise ValueError(f"{where} must return states [{want}, k, S], got {tuple(states.shape)}")
    if check_values and logprobs.numel():
        worst = logprobs.amax()
        if torch.isnan(worst) or worst > 0:
            raise ValueError(f"{where} returned log-probs that are NaN or positive (max {float(worst)})")

