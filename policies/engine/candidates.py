"""What a best-first policy hands the build engine: its children as data, and the contract they follow.

Contract
--------
A best-first policy's ``candidates(draft)`` returns one of three kinds of candidates:

* `TopTokens(logprobs, k)` -- the top-``k`` tokens of row ``d - 1`` of ``logprobs`` [L', V] are the
  children of every node at depth ``d - 1``: the same ranked list under every parent of a depth
  (marginals: DDTree, CaDDTree, the DFlash chain).  ``logprobs`` is usually the draft's own, or a
  policy's re-weighting of it (float32, one row per depth, the draft's vocabulary).
* `FactorizedSource(tokens, logprobs)` -- explicit per-depth lists: ``tokens[d - 1]`` [K_d] int64 and
  ``logprobs[d - 1]`` [K_d] float32, sorted by log-prob descending, ties by token ascending.  Lists
  may differ in length from depth to depth (a fan-out per depth).
* `ScorerSource(scorer, top_m, k)` -- each parent's children from the draft's `ConditionalScorer`
  (Domino's correction along the parent's own path): a fan-out per node.

**Depths.** Lists are indexed by depth: list ``d - 1`` holds the candidates at depth ``d``.  There
may be fewer lists than the draft has depths (``L' <= draft.depth``): the tree then goes no deeper
than ``L'`` (a depth cap is ``TopTokens(draft.logprobs[:cap], k)``); an empty list at some depth
stops every branch there.  More lists than the draft's depths, rows of another vocabulary, a
dtype other than float32/int64, unsorted lists or ``k < 1`` are refused when the build starts, by
`check_candidates`, naming the policy, the depth and what was expected.

**Scores.** A child's score is ``float32(score(parent) + logp(child))``: the path log-probability
under whatever the lists say.  A child whose log-prob is ``-inf`` is no child (a scorer can give a
parent fewer children than ``k`` that way: a per-node fan-out); NaN or positive log-probs are refused.

**Order.** The engine returns the nodes in pop order of a best-first max-heap (score descending,
ties by rank path); nothing downstream of a build depends on that order (decoding, verification,
replay, drawing read the tree's parents), and `treespec.tree.DraftTree.canonical` puts any tree into
it, so a policy of one's own that orders its nodes otherwise is equally valid.

A `CandidateSource` is what the engine builds from (``resolve`` in frontier.py turns the three kinds
into one for a build mode): given the scorer states of n parent nodes at ``depth``, ``expand``
returns `Expansion`: tokens and log-probs [n, k], each row sorted by log-prob descending (ties by
token ascending), and the children's own states [n, k, S] (None for factorized sources).  ``k`` may
differ between depths but not between the parents of one call.

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

__all__ = ["CandidateSource", "Candidates", "FactorizedSource", "ScorerSource", "TopTokens", "check_candidates",
           "check_children", "padded", "scorer_children"]


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


def check_candidates(candidates, draft, owner: str) -> Candidates:
    """``candidates`` of the policy ``owner`` for ``draft``, or a ValueError naming the policy, the depth
    and what was expected (the module docstring's contract)."""
    where = f"the {owner} policy's candidates"
    if isinstance(candidates, ScorerSource):
        return candidates
    if isinstance(candidates, TopTokens):
        rows = candidates.logprobs
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
            raise ValueError(f"{where}: TopTokens.logprobs must be a [L, V] tensor, one row per depth, got "
                             f"{tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__}")
        _check_depths(where, "TopTokens.logprobs", rows.shape[0], draft.depth)
        if rows.shape[1] != draft.vocab_size or rows.dtype != torch.float32:
            raise ValueError(f"{where}: TopTokens.logprobs rows must be float32 over the draft's {draft.vocab_size} "
                             f"tokens, got {rows.dtype} rows of {rows.shape[1]}")
        if isinstance(candidates.k, bool) or not isinstance(candidates.k, int) or candidates.k < 1:
            raise ValueError(f"{where}: TopTokens.k must be an integer >= 1 (children per depth), got {candidates.k!r}")
        return candidates
    if isinstance(candidates, FactorizedSource):
        _check_depths(where, "FactorizedSource", len(candidates.tokens), draft.depth)
        for d, (tokens, logprobs) in enumerate(zip(candidates.tokens, candidates.logprobs, strict=True), start=1):
            _check_list(where, d, tokens, logprobs, draft.vocab_size)
        return candidates
    raise ValueError(f"{where}: expected TopTokens, a FactorizedSource or a ScorerSource, got "
                     f"{type(candidates).__name__}")


def _check_depths(where: str, what: str, lists: int, depth: int) -> None:
    if lists > depth:
        raise ValueError(f"{where}: {what} has {lists} depths; the draft has {depth} (one list per depth, "
                         "at most as many as the draft)")


def _check_list(where: str, depth: int, tokens, logprobs, vocab: int) -> None:
    """One depth's explicit list: [K] int64 tokens in the vocabulary and [K] float32 log-probs, best first."""
    at = f"{where} at depth {depth}"
    if tokens.dim() != 1 or logprobs.shape != tokens.shape:
        raise ValueError(f"{at}: tokens and logprobs must be [K] lists of one length, got {tuple(tokens.shape)} "
                         f"and {tuple(logprobs.shape)}")
    if tokens.dtype != torch.int64 or logprobs.dtype != torch.float32:
        raise ValueError(f"{at}: tokens must be int64 and logprobs float32, got {tokens.dtype} and {logprobs.dtype}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"{at}: a token outside the draft's vocabulary [0, {vocab})")
    if tokens.numel() > 1 and bool((logprobs[1:] > logprobs[:-1]).any()):
        raise ValueError(f"{at}: logprobs must be sorted best first (descending)")


def padded(source: CandidateSource, depth: int) -> CandidateSource:
    """A factorized ``source`` with empty lists up to ``depth`` (the tree goes no deeper than its lists)."""
    if not isinstance(source, FactorizedSource) or len(source.tokens) >= depth:
        return source
    missing = depth - len(source.tokens)
    device = source.tokens[0].device if source.tokens else torch.device("cpu")
    empty_tokens = torch.empty(0, dtype=torch.int64, device=device)
    empty_logprobs = torch.empty(0, dtype=torch.float32, device=device)
    return FactorizedSource(source.tokens + (empty_tokens,) * missing, source.logprobs + (empty_logprobs,) * missing)
