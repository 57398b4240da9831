"""Batched speculative decoding: S sequences per round, each with its own tree, one target forward.

Contract
--------
``BatchDecoder(target, drafter, policy, verifier).generate(prompts, ...)`` decodes every prompt
of ``prompts`` (their lengths may differ) and returns one `GenerationResult` per prompt, in order:
each is what `SpeculativeDecoder.generate` returns for that prompt alone, token for token (a
sequence's tokens are the target's own choices at every step, whatever the others do).
``drafter=None, policy=None`` is batched autoregressive decoding.

A round: every unfinished sequence drafts unless its own `DraftGate` backs it off (each sequence
has its gate, as a fresh single-sequence decoder would), all drafts come from one
``Drafter.draft_batch`` over the sequences' forks (``Drafter.fork``: one context cache each), all
trees from one ``TreePolicy.build_batch``, and all trees are verified in one forward of a
`BatchTarget` (a `TreeBatch`, padded); then each sequence's verifier walk, commit, tokens and drafter
feedback are its own.  A sequence that reaches a stop token or its ``max_new_tokens`` leaves the
batch.  Sampling at T > 0: sequence s uses ``generators[s]`` (and, position-keyed, a key drawn from
it as the single-sequence decoder draws it), so per-row equality with single runs holds at any
temperature when the same generators are given.

Times: ``stats.prefill_time`` is the batch's prefill; a sequence's ``decode_time`` runs from the
first round to the round it finished in, and its rounds carry the batch's stage times.  The
throughput of a batch is its generated tokens over the wall time of `generate` (``last_wall_time``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import attrs
import torch

from treespec.batch import TreeBatch
from treespec.batch_target import BatchTarget
from treespec.decoding import (
    DRAFT_BACKOFF,
    DraftGate,
    SequenceState,
    Stopwatch,
    built_trees,
    check_first_token,
    check_request,
    checked_draft,
    checked_parts,
    commit_first_token,
    commit_round,
    fitted_tree,
    generator_for,
)
from treespec.interfaces import (
    Drafter,
    DraftOutput,
    SamplingParams,
    TreePolicy,
    Verifier,
    VerifyResult,
    check_backend,
)
from treespec.sampling import sampling_key
from treespec.stats import GenerationResult, GenerationStats, RoundStats
from treespec.target import TargetModel
from treespec.tree import DraftTree

__all__ = ["BatchDecoder"]


@attrs.define
class _Row:
    """One sequence of the batch: its state, drafter fork, gate, sampling and measurements."""

    seq: SequenceState
    drafter: Drafter | None
    gate: DraftGate
    sampling: SamplingParams
    generator: torch.Generator | None
    stats: GenerationStats = attrs.field(factory=GenerationStats)
    draft: DraftOutput | None = None  # this round's draft (None: an AR round for this sequence)
    tree: DraftTree | None = None  # this round's tree


class BatchDecoder:
    """Batched AR and speculative decoding over one target (see the module docstring)."""

    def __init__(self, target: TargetModel, drafter: Drafter | None = None, policy: TreePolicy | None = None,
                 verifier: Verifier | None = None, *, draft_backoff: int = DRAFT_BACKOFF) -> None:
        self.target, self.drafter, self.policy = target, drafter, policy
        self.verifier = checked_parts(drafter, policy, verifier, draft_backoff)
        self.draft_backoff = draft_backoff
        self.taps = tuple(drafter.tap_layers) if drafter is not None else ()
        if drafter is not None:
            drafter.bind(target)
        self.last_wall_time = 0.0  # seconds of the last generate, prefill included

    # ------------------------------------------------------------------ public entry
    def generate(self, prompts: Sequence[torch.Tensor], *, max_new_tokens: int | Sequence[int],
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 stop_token_ids: Iterable[int] | None = None,
                 generators: Sequence[torch.Generator | None] | None = None, backend: str = "torch",
                 position_keyed: bool | None = None, first_token: str = "round",
                 sampling: SamplingParams | None = None) -> list[GenerationResult]:
        """Up to ``max_new_tokens`` (one value, or one per prompt) new tokens after each prompt;
        ``first_token`` as in `SpeculativeDecoder.generate` (``"prefill"``: each sequence's first
        token is the target's after its prompt, from one batched forward timed with the prefill);
        ``sampling`` in place of the four sampling keywords, as there."""
        start = time.perf_counter()
        check_first_token(first_token)
        if self.policy is not None:
            self.policy.start_generation()  # one call for the batch: its rounds are not planned or reported
        sampling = SamplingParams.of(sampling, temperature, top_k, top_p, position_keyed)
        if self.policy is not None and self.policy.samples_from_draft and not sampling.greedy:
            raise ValueError(f"the {self.policy.name} policy samples its trees at temperature > 0, which batched "
                             "decoding does not do yet; decode its sequences one at a time (treespec.generate)")
        rows = self._start(prompts, max_new_tokens, sampling,
                           frozenset(stop_token_ids or ()), generators, backend)
        batch = BatchTarget(self.target)
        clock = Stopwatch(self.target.device)
        features = clock.run("prefill", batch.prefill, [r.seq.tokens[:r.seq.length] for r in rows], self.taps)
        for row, feats in zip(rows, features, strict=True):
            row.seq.features = feats
        if first_token == "prefill":
            clock.run("first", self._first_from_prefill, batch, rows)
        for row in rows:
            row.stats.prefill_time = clock.times["prefill"] + clock.times.get("first", 0.0)
        active, began = self._leave(batch, list(rows)), clock.now()
        while active:
            self._round(batch, active, backend)
            now = clock.now()
            for row in active:
                row.stats.decode_time = now - began
            active = self._leave(batch, active)
        self.last_wall_time = time.perf_counter() - start
        return [self._result(row) for row in rows]

    @staticmethod
    def _leave(batch: BatchTarget, active: list[_Row]) -> list[_Row]:
        """The rows still decoding; finished ones leave the batch (their cache rows dropped)."""
        staying = [i for i, row in enumerate(active) if not row.seq.done]
        if len(staying) < len(active):
            batch.keep(staying)
        return [active[i] for i in staying]

    def _first_from_prefill(self, batch: BatchTarget, rows: list[_Row]) -> None:
        """Every row's anchor in one forward of root-only trees; commit the target's token after it."""
        device = self.target.device
        outputs = batch.forward_trees(TreeBatch([DraftTree.root_only(r.seq.anchor, device=device) for r in rows]),
                                      self.taps)
        batch.commit([torch.zeros(1, dtype=torch.int64, device=device) for _ in rows])
        for row, out in zip(rows, outputs, strict=True):
            commit_first_token(row.seq, out.logits, out.features, row.sampling, row.generator)

    # ------------------------------------------------------------------ set-up
    def _start(self, prompts: Sequence[torch.Tensor], max_new_tokens: int | Sequence[int], sampling: SamplingParams,
               stops: frozenset[int], generators: Sequence[torch.Generator | None] | None, backend: str) -> list[_Row]:
        check_backend(backend)
        if not prompts:
            raise ValueError("generate needs at least one prompt")
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        gens = [None] * len(prompts) if generators is None else list(generators)
        if len(budgets) != len(prompts) or len(gens) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts need as many max_new_tokens and generators "
                             f"(got {len(budgets)} and {len(gens)})")
        return [self._row(i, p, n, sampling, stops, g) for i, (p, n, g) in enumerate(zip(prompts, budgets, gens))]

    def _row(self, index: int, prompt: torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
             stops: frozenset[int], generator: torch.Generator | None) -> _Row:
        prompt = torch.as_tensor(prompt, dtype=torch.int64).reshape(-1).to(self.target.device)
        if prompt.numel() == 0:
            raise ValueError(f"prompt {index} is empty")
        check_request(self.target, prompt, max_new_tokens, where=f"prompt {index}: ")
        generator = generator_for(sampling, generator)
        if sampling.position_keyed and not sampling.greedy:  # the key a single-sequence run draws first
            sampling = attrs.evolve(sampling, key=sampling_key(generator))
        fork = None if self.drafter is None else self.drafter.fork()
        seq = SequenceState.start(prompt, max_new_tokens, stops)
        return _Row(seq, fork, DraftGate(self.draft_backoff), sampling, generator)

    # ------------------------------------------------------------------ one round
    def _round(self, batch: BatchTarget, rows: list[_Row], backend: str) -> None:
        clock = Stopwatch(self.target.device)
        drafting = [r for r in rows if r.drafter is not None and r.gate.drafts_now()]
        clock.run("draft", self._draft, rows, drafting)
        clock.run("build", self._build, rows, backend)
        outputs = clock.run("verify", batch.forward_trees, TreeBatch([r.tree for r in rows]), self.taps)
        start = clock.now()
        results = [self.verifier.verify(r.tree, out.logits, sampling=r.sampling, generator=r.generator,
                                        position=r.seq.anchor_position + 1, draft=r.draft)
                   for r, out in zip(rows, outputs, strict=True)]
        clock.times["verify"] += clock.now() - start
        start = clock.now()
        batch.commit([res.accepted for res in results])
        for row, out, result in zip(rows, outputs, results, strict=True):
            self._commit(row, result, out.features)
        clock.times["commit"] = clock.now() - start
        for row, result in zip(rows, results, strict=True):
            row.stats.rounds.append(RoundStats(tau=result.tau, tree_size=len(row.tree), times=dict(clock.times)))

    def _draft(self, rows: list[_Row], drafting: list[_Row]) -> None:
        """Each row's draft this round: from one ``draft_batch`` over the drafting rows, None for the others."""
        for row in rows:
            row.draft = None
        if not drafting:
            return
        drafts = self.drafter.draft_batch([r.drafter for r in drafting], [r.seq.context() for r in drafting])
        for row, draft in zip(drafting, drafts, strict=True):
            row.draft = checked_draft(draft, self.target)

    def _build(self, rows: list[_Row], backend: str) -> None:
        """Each row's tree: the policy's for the drafting rows (one ``build_batch``), the root alone otherwise."""
        drafted = [r for r in rows if r.draft is not None]
        built = built_trees(self.policy, [r.draft for r in drafted], backend) if drafted else []
        for row in rows:
            row.tree = DraftTree.root_only(row.seq.anchor, device=self.target.device)
        for row, tree in zip(drafted, built, strict=True):
            row.gate.record(self.policy.pays_for_draft(row.draft, tree))
            row.tree = fitted_tree(tree, row.seq, self.target)

    def _commit(self, row: _Row, result: VerifyResult, features: torch.Tensor | None) -> None:
        drafted = row.draft is not None
        path_tokens = commit_round(row.seq, row.tree, result, features, drafted, row.drafter is None)
        if drafted:
            row.drafter.observe(path_tokens)

    @staticmethod
    def _result(row: _Row) -> GenerationResult:
        seq = row.seq
        row.stats.new_tokens = seq.length - seq.prompt_len
        return GenerationResult(seq.tokens[seq.prompt_len:seq.length].clone(), row.stats)
