"""The speculative decoding loop: draft -> build -> verify -> commit, until the answer is complete.

Contract
--------
``SpeculativeDecoder(target, drafter, policy, verifier).generate(input_ids, ...)`` returns exactly
``max_new_tokens`` new tokens, or fewer when a stop token is produced (the stop token is included,
as in Hugging Face ``generate``).  ``drafter=None, policy=None`` is autoregressive decoding: the
same loop with a root-only tree, so AR and every policy run in one harness.

Sequence bookkeeping: the prompt's last token is the first round's root (anchor); everything before
it is prefilled.  Each round the root is the last committed token and is not yet in the target's
KV cache; the round commits the accepted draft tokens plus the bonus (tau tokens).  The drafter's
`DraftContext` holds every committed token (anchor last) and the taps of the tokens committed since
its previous draft, so ``feature_start + len(features) == anchor position`` always: the prompt's
taps (all but the anchor) in the first round, the accepted nodes' taps (root first) afterwards.

Whether and at what price a round drafts is its generation's round protocol with the policy's draft
controller (`treespec.steering.Steering`; the decoder keeps one controller across its ``generate``
calls): a generation that may not draft runs the target's AR steps without taps (``undrafted`` in the
stats); an AR round commits what the target chooses, and the drafter receives the taps of the tokens
committed meanwhile at its next draft.

A policy declaring ``samples_from_draft`` samples its tree at T > 0 (`TreePolicy.sample`): each
round draws a fresh seed from the caller's generator, the tree's `Proposals` go to the verifier
(cut with the tree), and the seed is kept in the round's stats, so the same draft and seed
rebuild the same tree.  At T = 0 it builds as every policy does.

Trees are pruned to the depth that can still be used (remaining tokens, context window) before the
target sees them; pruning a tree to a depth keeps it a tree and changes no accepted token.
Stage times are wall-clock seconds around each stage, synchronised on CUDA; the prefill is timed
separately.  A clear error is raised before the context window would overflow, on a vocabulary
mismatch between draft and target, and on NaN target logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import attrs
import torch

from treespec import registry
from treespec.interfaces import (
    Decision,
    DraftContext,
    DraftController,
    Drafter,
    DraftOutput,
    Proposals,
    RoundReport,
    SamplingParams,
    TreePolicy,
    Verifier,
    VerifyResult,
    check_single_batch,
)
from treespec.sampling import sampling_key, target_tokens
from treespec.stats import GenerationResult, GenerationStats, RoundStats
from treespec.steering import AR_ROUND, Steering
from treespec.target import ContextOverflowError, Target, TargetOutput
from treespec.tree import DraftTree

__all__ = ["FIRST_TOKENS", "OneTarget", "PolicyError", "RoundRunner",
           "Row", "SequenceState", "SpeculativeDecoder", "Stopwatch", "built_tree", "built_trees", "check_first_token",
           "check_request", "checked_draft", "checked_parts", "checked_tree", "commit_first_token", "commit_round",
           "cut_proposals", "fitted_tree", "generator_for", "limit_depth", "policy_tree"]

FIRST_TOKENS = ("round", "prefill")  # where the first new token comes from (see SpeculativeDecoder.generate)


@attrs.define
class SequenceState:
    """The mutable state of one generation."""

    tokens: torch.Tensor  # [P + max_new] int64 buffer; the committed tokens are tokens[:length]
    length: int  # committed tokens; the root (anchor) is tokens[length - 1]
    prompt_len: int  # P
    stops: frozenset[int]  # stop token ids
    features: torch.Tensor | None = None  # [n, F] taps of the tokens committed since the last draft
    feature_start: int = 0  # absolute position of features[0]
    done: bool = False

    @classmethod
    def start(cls, prompt: torch.Tensor, max_new_tokens: int, stops: frozenset[int]) -> SequenceState:
        """A sequence holding ``prompt`` [P] with room for ``max_new_tokens`` more."""
        buffer = torch.empty(prompt.numel() + max_new_tokens, dtype=torch.int64, device=prompt.device)
        buffer[:prompt.numel()] = prompt
        return cls(buffer, prompt.numel(), prompt.numel(), stops)

    @property
    def anchor_position(self) -> int:
        return self.length - 1

    @property
    def anchor(self) -> int:
        """The last committed token: this round's root."""
        return int(self.tokens[self.length - 1])

    def context(self) -> DraftContext:
        """What the drafter sees this round (module docstring)."""
        return DraftContext(self.tokens[:self.length], self.features, self.feature_start)

    @property
    def remaining(self) -> int:
        return self.tokens.numel() - self.length

    def append(self, new: list[int]) -> None:
        """Commit ``new`` tokens, cut at the first stop token or at the budget."""
        cut = min(len(new), self.remaining)
        stop_at = next((i for i, t in enumerate(new[:cut]) if t in self.stops), None)
        if stop_at is not None:
            cut, self.done = stop_at + 1, True
        if cut == 1:  # an AR step's token (a tensor built for one would cost more than the write)
            self.tokens[self.length] = new[0]
        else:
            self.tokens[self.length:self.length + cut] = torch.tensor(new[:cut], dtype=torch.int64)
        self.length += cut
        self.done = self.done or self.remaining == 0


class Stopwatch:
    """Wall-clock stage timer; synchronises CUDA so that queued kernels count in their stage."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> None:
        self.cuda = device.type == "cuda"
        self.clock = clock
        self.times: dict[str, float] = {}

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return self.clock()

    def run(self, stage: str, fn, *args):
        start = self.now()
        out = fn(*args)
        self.times[stage] = self.now() - start
        return out


def limit_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """The subtree of nodes at depth <= ``max_depth`` (node order kept, parents re-indexed)."""
    if tree.max_depth <= max_depth:
        return tree
    return tree.select(tree.depths <= max_depth)  # closed under ancestors: depths grow along every path


@attrs.define
class Row:
    """One sequence being decoded: its state, its drafter and policy, the steering of its generation,
    sampling and stats, and what the round under way made for it."""

    seq: SequenceState
    drafter: Drafter | None  # the decoder's drafter (a fork of it in a batch); None: this generation does not draft
    policy: TreePolicy | None  # the decoder's policy, or its `TreePolicy.for_request` copy in a batch
    steering: Steering | None  # its generation's round protocol with its draft controller (None: AR decoding)
    sampling: SamplingParams
    generator: torch.Generator | None
    stats: GenerationStats = attrs.field(factory=GenerationStats)
    decision: Decision = AR_ROUND  # this round's decision
    draft: DraftOutput | None = None  # this round's draft (None: an AR round for this sequence)
    tree: DraftTree | None = None  # this round's tree, cut to the depth the sequence can use
    proposals: Proposals | None = None  # what a sampled tree's children were drawn from


class OneTarget:
    """The target side of a round for one sequence: a `Target` and its taps."""

    def __init__(self, target: Target, taps: tuple[int, ...]) -> None:
        self.target, self.taps = target, taps

    def forward(self, trees: Sequence[DraftTree]) -> list[TargetOutput]:
        (tree,) = trees
        return [self.target.forward_tree(tree, self.taps)]

    def commit(self, accepted: Sequence[torch.Tensor]) -> None:
        (nodes,) = accepted
        self.target.commit(nodes)


class RoundRunner:
    """One decoding round over one row or many (module docstring): decide, draft, build, verify,
    commit, observe.  ``side`` runs the trees through the target (`OneTarget`, or a batch's) and
    ``batched`` says whether the rows' drafters are forks drafted together (``Drafter.draft_batch``)."""

    def __init__(self, target: Target, drafter: Drafter | None, verifier: Verifier, side, *, batched: bool,
                 clock: Callable[[], float] = time.perf_counter,
                 on_round: Callable[[DraftTree, VerifyResult], None] | None = None) -> None:
        self.target, self.drafter, self.verifier, self.side = target, drafter, verifier, side
        self.batched, self.clock, self.on_round = batched, clock, on_round

    def run(self, rows: list[Row]) -> None:
        """One round of every row of ``rows`` (each unfinished); appends each row's `RoundStats`."""
        clock = Stopwatch(self.target.device, self.clock)  # "verify": the trees' forward + the verifiers' walks
        for row in rows:
            row.decision = row.steering.decide() if row.steering is not None else AR_ROUND
        drafting = [r for r in rows if r.decision.draft]
        for row in rows:
            row.draft = None
        if drafting:
            clock.run("draft", self._draft, drafting)
        clock.run("build", self._build, rows)
        contexts = [r.seq.anchor_position for r in rows]  # cached tokens under each tree
        results, outputs = clock.run("verify", self._verify, rows)
        if self.on_round is not None:
            for row, result in zip(rows, results, strict=True):
                self.on_round(row.tree, result)
        clock.run("commit", self._commit, rows, results, outputs)
        for row, result, ctx in zip(rows, results, contexts, strict=True):
            if row.steering is not None:
                row.steering.report(RoundReport(row.tree, result, ctx, clock.times, row.draft is not None,
                                                row.decision.explore, batch_rows=len(rows),
                                                tapped=row.drafter is not None))
            row.stats.rounds.append(_round_stats(row, result, dict(clock.times)))

    def first_tokens(self, rows: list[Row]) -> None:
        """``first_token="prefill"``: every row's anchor in one forward of root-only trees; commit the
        target's token after it (argmax, or a draw at T > 0) as each row's first new token."""
        device = self.target.device
        outputs = self.side.forward([DraftTree.root_only(r.seq.anchor, device=device) for r in rows])
        self.side.commit([torch.zeros(1, dtype=torch.int64, device=device) for _ in rows])
        for row, out in zip(rows, outputs, strict=True):
            commit_first_token(row.seq, out.logits, out.features, row.sampling, row.generator)

    def _draft(self, drafting: list[Row]) -> None:
        """The drafting rows' drafts: one ``draft_batch`` over their forks, or each its own ``draft``."""
        contexts = [r.seq.context() for r in drafting]
        drafts = (self.drafter.draft_batch([r.drafter for r in drafting], contexts) if self.batched
                  else [r.drafter.draft(c) for r, c in zip(drafting, contexts, strict=True)])
        for row, draft in zip(drafting, drafts, strict=True):
            row.draft = checked_draft(draft, self.target)

    def _build(self, rows: list[Row]) -> None:
        """Each row's tree: its policy's at the decided price (sampled at T > 0 where it samples from the
        draft; trees of rows sharing a policy and price built together), checked, cut to the usable
        depth; the root alone for a row that did not draft."""
        built = _trees(rows, self.batched)
        for row in rows:
            tree, proposals = built.get(id(row), (None, None))
            if tree is None:
                row.tree, row.proposals = DraftTree.root_only(row.seq.anchor, device=self.target.device), None
                continue
            row.tree = fitted_tree(tree, row.seq, self.target)
            row.proposals = cut_proposals(proposals, tree, row.tree)

    def _verify(self, rows: list[Row]) -> tuple[list[VerifyResult], list[TargetOutput]]:
        outputs = self.side.forward([r.tree for r in rows])
        results = [self.verifier.verify(r.tree, out.logits, sampling=r.sampling, generator=r.generator,
                                        position=r.seq.anchor_position + 1, draft=r.draft, proposals=r.proposals)
                   for r, out in zip(rows, outputs, strict=True)]
        return results, outputs

    def _commit(self, rows: list[Row], results: list[VerifyResult], outputs: list[TargetOutput]) -> None:
        self.side.commit([res.accepted.to(r.tree.device) for r, res in zip(rows, results, strict=True)])
        for row, result, out in zip(rows, results, outputs, strict=True):
            drafted = row.draft is not None
            tapping = row.steering is not None and row.steering.tapping
            features = out.features if tapping else None  # a row that drafts no more keeps no taps
            path_tokens = commit_round(row.seq, row.tree, result, features, drafted, row.drafter is None)
            if drafted:
                row.drafter.observe_accepted(path_tokens)



def _round_policy(row: Row) -> TreePolicy:
    """The row's policy at the price its controller decided."""
    return row.policy.priced(row.decision.price, row.decision.calibration)


def _trees(rows: list[Row], batched: bool) -> dict[int, tuple[DraftTree, Proposals | None]]:
    """id(row) -> (tree, proposals) for every drafting row: sampled per row where its policy samples at
    T > 0, else built, the rows of one policy together (`built_trees`) in a batch."""
    out = {}
    groups: dict[tuple[int, int, int], list[Row]] = {}
    for row in (r for r in rows if r.draft is not None):
        if not batched or (row.policy.samples_from_draft and not row.sampling.greedy):
            out[id(row)] = policy_tree(_round_policy(row), row.draft, row.sampling, row.generator)
        else:
            key = (id(row.policy), id(row.decision.price), id(row.decision.calibration))
            groups.setdefault(key, []).append(row)
    for group in groups.values():
        trees = built_trees(_round_policy(group[0]), [r.draft for r in group])
        out.update({id(r): (t, None) for r, t in zip(group, trees, strict=True)})
    return out


def _round_stats(row: Row, result: VerifyResult, times: dict[str, float]) -> RoundStats:
    drafted = row.draft is not None
    return RoundStats(tau=result.tau, tree_size=len(row.tree), times=times, explored=row.decision.explore,
                      drafted=drafted, priced_with=row.decision.price if drafted else None,
                      calibrated_with=row.decision.calibration if drafted else None,
                      tree_seed=None if row.proposals is None else row.proposals.seed)


class SpeculativeDecoder:
    """One harness for autoregressive and speculative decoding over a `Target`."""

    def __init__(self, target: Target, drafter: Drafter | None = None, policy: TreePolicy | None = None,
                 verifier: Verifier | None = None,
                 on_round: Callable[[DraftTree, VerifyResult], None] | None = None, *,
                 controller: DraftController | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.target = target
        self.drafter = drafter
        self.policy = policy
        self.verifier = checked_parts(drafter, policy, verifier)
        self.on_round = on_round  # optional observer of each verified tree (drawing, debugging)
        self.clock = clock  # seconds; stage times are differences of it (a test may inject a fake one)
        # whether and at what price rounds draft (default: the policy's; kept across generations)
        self.controller = controller if controller is not None or policy is None else policy.draft_controller()
        self.taps = tuple(drafter.tap_layers) if drafter is not None else ()
        if drafter is not None:
            drafter.bind(target)
            self.controller.bind(drafter.reach)

    @property
    def autoregressive(self) -> bool:
        return self.drafter is None

    # ------------------------------------------------------------------ public entry
    def generate(self, input_ids: torch.Tensor, *, max_new_tokens: int, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, stop_token_ids: Iterable[int] | None = None,
                 generator: torch.Generator | None = None, position_keyed: bool | None = None,
                 first_token: str = "round",
                 sampling: SamplingParams | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids`` ([P] or [1, P]).

        ``first_token="round"`` (default): the first round anchors on the prompt's last token and
        yields the first new token.  ``"prefill"``: the published loops' counting: the whole prompt is
        prefilled, the target's own token after it (argmax, or a draw at T > 0) is the first new
        token and the first round's anchor, and rounds (so τ) start after it.  Same output.
        ``sampling`` gives temperature, top-k, top-p and position keying as one value, in place of
        the four keywords (`SamplingParams.of`)."""
        sampling = SamplingParams.of(sampling, temperature, top_k, top_p, position_keyed)
        prompt = check_single_batch(input_ids).to(self.target.device)
        check_request(self.target, prompt, max_new_tokens)
        generator = generator_for(sampling, generator)
        if sampling.position_keyed and not sampling.greedy:  # this call's noise key, fresh from the stream
            sampling = attrs.evolve(sampling, key=sampling_key(generator))
        check_first_token(first_token)
        steering = Steering(self.controller, self.policy) if self.drafter is not None else None
        drafting = steering is not None and steering.start()
        row = self._start(prompt, max_new_tokens, frozenset(stop_token_ids or ()), sampling, generator, steering)
        row.stats.undrafted = self.drafter is not None and not drafting
        rounds = RoundRunner(self.target, self.drafter if drafting else None, self.verifier,
                             OneTarget(self.target, self.taps if drafting else ()), batched=False, clock=self.clock,
                             on_round=self.on_round)
        if first_token == "prefill":
            clock = Stopwatch(self.target.device, self.clock)
            clock.run("prefill", rounds.first_tokens, [row])
            row.stats.prefill_time += clock.times["prefill"]  # the published loops time it with the prefill
        clock = Stopwatch(self.target.device, self.clock)
        start = clock.now()
        while not row.seq.done:
            rounds.run([row])
        row.stats.decode_time = clock.now() - start
        row.stats.new_tokens = row.seq.length - row.seq.prompt_len
        return GenerationResult(row.seq.tokens[row.seq.prompt_len:row.seq.length].clone(), row.stats)

    def _start(self, prompt: torch.Tensor, max_new_tokens: int, stops: frozenset[int], sampling: SamplingParams,
               generator: torch.Generator | None, steering: Steering | None) -> Row:
        """The generation's row, its prompt prefilled (all but the anchor), timed as the prefill; a generation
        that may not draft is an AR row (no drafter, no policy, no taps)."""
        drafting = steering is not None and steering.tapping
        if drafting:
            self.drafter.reset()
        clock = Stopwatch(self.target.device, self.clock)
        prefill: TargetOutput = clock.run("prefill", self.target.prefill, prompt[:-1], self.taps if drafting else ())
        row = Row(SequenceState.start(prompt, max_new_tokens, stops), self.drafter if drafting else None,
                  self.policy if drafting else None, steering, sampling, generator)
        row.stats.prefill_time = clock.times["prefill"]
        row.seq.features = prefill.features
        return row


# ---------------------------------------------------------------------------- checks and the steps of a round
def checked_parts(drafter: Drafter | None, policy: TreePolicy | None, verifier: Verifier | None) -> Verifier:
    """The verifier to use (default: match) once the parts are known to fit together."""
    if (drafter is None) != (policy is None):
        raise ValueError("give both a drafter and a policy for speculative decoding, or neither for AR")
    verifier = verifier if verifier is not None else registry.create("verifier", "match")
    if policy is not None and verifier.requires_sampled_tree and not policy.samples_from_draft:
        raise ValueError(
            f"the {verifier.name} verifier as configured is lossless only for trees sampled from the "
            f"draft, and the {policy.name} policy chooses its tokens deterministically, so the output would "
            "not follow the target's distribution; use RejectionVerifier(proposal='point') (the default) "
            "or the match verifier")
    return verifier


class PolicyError(ValueError):
    """A policy could not build a round's tree, or built one its draft does not allow; the message
    names the policy (the apps add the method)."""


_BUILD_ERRORS = (ValueError, TypeError, IndexError, KeyError, RuntimeError, AttributeError, NotImplementedError)


def policy_label(policy: TreePolicy) -> str:
    """How messages name a policy: its registered ``name``, or its class where it kept the default."""
    return policy.name if policy.name != TreePolicy.name else type(policy).__name__


def built_tree(policy: TreePolicy, draft: DraftOutput) -> DraftTree:
    """``policy.build(draft)``, checked (`checked_tree`); whatever the build raises comes back as a
    `PolicyError` naming the policy.  Live decoding, replay, drawing and the test kit build through it."""
    try:
        tree = policy.build(draft)
    except _BUILD_ERRORS as exc:
        raise PolicyError(f"the {policy_label(policy)} policy could not build its tree: "
                          f"{type(exc).__name__}: {exc}") from exc
    return checked_tree(tree, draft, policy)


def built_trees(policy: TreePolicy, drafts: Sequence[DraftOutput]) -> list[DraftTree]:
    """``policy.build_batch(drafts)``, each tree checked as `built_tree` checks it."""
    try:
        trees = policy.build_batch(drafts)
    except _BUILD_ERRORS as exc:
        raise PolicyError(f"the {policy_label(policy)} policy could not build its trees: "
                          f"{type(exc).__name__}: {exc}") from exc
    return [checked_tree(tree, draft, policy) for tree, draft in zip(trees, drafts, strict=True)]


def checked_tree(tree: DraftTree, draft: DraftOutput, policy: TreePolicy) -> DraftTree:
    """``tree`` if ``policy`` may have built it from ``draft``: a `DraftTree` (its own invariants
    hold), the draft's root token, at most the policy's ``budget`` non-root nodes, no deeper than
    the draft, every token in the draft's vocabulary; else a `PolicyError` naming what is wrong."""
    name = policy_label(policy)
    if not isinstance(tree, DraftTree):
        raise PolicyError(f"the {name} policy returned {type(tree).__name__}, not a DraftTree")
    if tree.root_token != draft.root_token:
        raise PolicyError(f"the {name} policy's tree has root token {tree.root_token}; its root must be the "
                          f"draft's anchor, token {draft.root_token}")
    if policy.budget is not None and tree.budget > policy.budget:
        raise PolicyError(f"the {name} policy's tree has {tree.budget} non-root nodes; its budget is {policy.budget}")
    if tree.max_depth > draft.depth:
        raise PolicyError(f"the {name} policy's tree reaches depth {tree.max_depth}; the draft has {draft.depth}")
    if int(tree.tokens.min()) < 0 or int(tree.tokens.max()) >= draft.vocab_size:
        raise PolicyError(f"the {name} policy's tree holds a token outside the vocabulary [0, {draft.vocab_size})")
    return tree


def policy_tree(policy: TreePolicy, draft: DraftOutput, sampling: SamplingParams,
                generator: torch.Generator | None) -> tuple[DraftTree, Proposals | None]:
    """The round's tree: sampled with a seed fresh from ``generator`` where the policy samples from
    the draft and T > 0, built otherwise (no proposals); checked as `built_tree` checks."""
    if not (policy.samples_from_draft and not sampling.greedy):
        return built_tree(policy, draft), None
    try:
        tree, proposals = policy.sample(draft, sampling=sampling, seed=sampling_key(generator))
    except _BUILD_ERRORS as exc:
        raise PolicyError(f"the {policy_label(policy)} policy could not sample its tree: "
                          f"{type(exc).__name__}: {exc}") from exc
    return checked_tree(tree, draft, policy), proposals


def cut_proposals(proposals: Proposals | None, tree: DraftTree, fitted: DraftTree) -> Proposals | None:
    """``proposals`` of ``tree`` for ``fitted``, the tree `limit_depth` cut from it."""
    if proposals is None or len(fitted) == len(tree):
        return proposals
    return proposals.select(tree.depths <= fitted.max_depth)


def check_request(target: Target, prompt: torch.Tensor, max_new_tokens: int, where: str = "") -> None:
    """Refuse a request the target cannot serve; ``where`` names the prompt in a batch ("prompt 3: ")."""
    if max_new_tokens < 1:
        raise ValueError(f"{where}max_new_tokens must be >= 1, got {max_new_tokens}")
    if int(prompt.max()) >= target.vocab_size or int(prompt.min()) < 0:
        ids = "token ids" if where else "prompt token ids"
        raise ValueError(f"{where}{ids} must lie in [0, {target.vocab_size})")
    total = prompt.numel() + max_new_tokens
    if total > target.max_positions:
        raise ContextOverflowError(
            f"{where}prompt of {prompt.numel()} tokens + max_new_tokens={max_new_tokens} = {total} exceeds the "
            f"target's context of {target.max_positions} positions")


def checked_draft(draft: DraftOutput, target: Target) -> DraftOutput:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the drafter's vocabulary ({draft.vocab_size}) differs from the target's "
                         f"({target.vocab_size})")
    return draft


def fitted_tree(tree: DraftTree, seq: SequenceState, target: Target) -> DraftTree:
    """The policy's tree, checked against the anchor and cut to the depth the sequence can still use."""
    if tree.root_token != seq.anchor:
        raise ValueError(f"the tree's root token {tree.root_token} is not the anchor {seq.anchor}")
    room = target.max_positions - 1 - seq.anchor_position  # deepest position still in the window
    return limit_depth(tree, min(seq.remaining - 1, room))


def commit_round(seq: SequenceState, tree: DraftTree, result: VerifyResult, features: torch.Tensor | None,
                 drafted: bool, autoregressive: bool) -> torch.Tensor:
    """The sequence's side of a commit: the taps the drafter sees next, the new tokens; returns the
    accepted path's tokens (root first) for ``Drafter.observe``."""
    accepted = result.accepted.to(tree.device)
    if features is not None:
        kept = features[accepted.to(features.device)]  # [tau, F], root first
        undrafted = not drafted and seq.features is not None  # taps since the last draft go on growing
        seq.features = torch.cat([seq.features, kept]) if undrafted else kept
    if drafted or autoregressive:
        seq.feature_start = seq.anchor_position
    path_tokens = tree.tokens[accepted]
    seq.append(path_tokens[1:].tolist() + [result.bonus_token])
    return path_tokens


def check_first_token(first_token: str) -> None:
    """Refuse a ``first_token`` that is not one of `FIRST_TOKENS`."""
    if first_token not in FIRST_TOKENS:
        raise ValueError(f"first_token must be 'round' or 'prefill', got {first_token!r}")


def commit_first_token(seq: SequenceState, logits: torch.Tensor, features: torch.Tensor | None,
                       sampling: SamplingParams, generator: torch.Generator | None) -> None:
    """``first_token="prefill"``: append the target's token after the anchor, from the root-only
    tree's ``logits`` [1, V] (argmax, or a draw at T > 0), and the anchor's ``features``."""
    chosen = target_tokens(logits, torch.tensor([seq.length], device=logits.device), sampling, generator)
    if features is not None:
        seq.features = features if seq.features is None else torch.cat([seq.features, features])
    seq.append([int(chosen[0])])


def generator_for(sampling: SamplingParams, generator: torch.Generator | None) -> torch.Generator | None:
    """The caller's generator, or a fresh non-deterministically seeded one when sampling without one."""
    if generator is not None or sampling.greedy:
        return generator
    fresh = torch.Generator()
    fresh.seed()
    return fresh
