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

from treespec import registry
from treespec.batch import TreeBatch
from treespec.batch_target import BatchTarget
from treespec.decoding import DRAFT_BACKOFF, DraftGate, _generator_for, _Sequence, _Stopwatch, limit_depth
from treespec.interfaces import (
    BACKENDS,
    DraftContext,
    Drafter,
    DraftOutput,
    SamplingParams,
    TreePolicy,
    Verifier,
    VerifyResult,
)
from treespec.sampling import sampling_key
from treespec.stats import GenerationResult, GenerationStats, RoundStats
from treespec.target import ContextOverflowError, TargetModel
from treespec.tree import DraftTree

__all__ = ["BatchDecoder"]


@attrs.define
class _Row:
    """One sequence of the batch: its state, drafter fork, gate, sampling and measurements."""

    seq: _Sequence
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
        if (drafter is None) != (policy is None):
            raise ValueError("give both a drafter and a policy for speculative decoding, or neither for AR")
        if draft_backoff < 0:
            raise ValueError(f"draft_backoff must be >= 0, got {draft_backoff}")
        self.target, self.drafter, self.policy = target, drafter, policy
        self.verifier = verifier if verifier is not None else registry.create("verifier", "match")
        if policy is not None and self.verifier.requires_sampled_tree and not policy.samples_from_draft:
            raise ValueError(f"the {self.verifier.name} verifier as configured needs trees sampled from the draft; "
                             f"the {policy.name} policy chooses its tokens deterministically")
        self.draft_backoff = draft_backoff
        self.taps = tuple(drafter.tap_layers) if drafter is not None else ()
        if drafter is not None:
            drafter.bind(target)
        self.last_wall_time = 0.0  # seconds of the last generate, prefill included

    # ------------------------------------------------------------------ public entry
    def generate(self, prompts: Sequence[torch.Tensor], *, max_new_tokens: int | Sequence[int],
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 stop_token_ids: Iterable[int] | None = None,
                 generators: Sequence[torch.Generator | None] | None = None, backend: str = "torch",
                 position_keyed: bool = True) -> list[GenerationResult]:
        """Up to ``max_new_tokens`` (one value, or one per prompt) new tokens after each prompt."""
        start = time.perf_counter()
        rows = self._start(prompts, max_new_tokens, SamplingParams(temperature, top_k, top_p, position_keyed),
                           frozenset(stop_token_ids or ()), generators, backend)
        batch = BatchTarget(self.target)
        clock = _Stopwatch(self.target.device)
        features = clock.run("prefill", batch.prefill, [r.seq.tokens[:r.seq.length] for r in rows], self.taps)
        for row, feats in zip(rows, features, strict=True):
            row.seq.features = feats
            row.stats.prefill_time = clock.times["prefill"]
        active, began = list(rows), clock.now()
        while active:
            self._round(batch, active, backend)
            now = clock.now()
            for row in active:
                row.stats.decode_time = now - began
            staying = [i for i, row in enumerate(active) if not row.seq.done]
            if len(staying) < len(active):
                batch.keep(staying)
                active = [active[i] for i in staying]
        self.last_wall_time = time.perf_counter() - start
        return [self._result(row) for row in rows]

    # ------------------------------------------------------------------ set-up
    def _start(self, prompts: Sequence[torch.Tensor], max_new_tokens: int | Sequence[int], sampling: SamplingParams,
               stops: frozenset[int], generators: Sequence[torch.Generator | None] | None, backend: str) -> list[_Row]:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
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
        if max_new_tokens < 1:
            raise ValueError(f"prompt {index}: max_new_tokens must be >= 1, got {max_new_tokens}")
        if int(prompt.max()) >= self.target.vocab_size or int(prompt.min()) < 0:
            raise ValueError(f"prompt {index}: token ids must lie in [0, {self.target.vocab_size})")
        if prompt.numel() + max_new_tokens > self.target.max_positions:
            raise ContextOverflowError(f"prompt {index}: {prompt.numel()} tokens + max_new_tokens={max_new_tokens} "
                                       f"exceeds the target's context of {self.target.max_positions} positions")
        generator = _generator_for(sampling, generator)
        if sampling.position_keyed and not sampling.greedy:  # the key a single-sequence run draws first
            sampling = attrs.evolve(sampling, key=sampling_key(generator))
        buffer = torch.empty(prompt.numel() + max_new_tokens, dtype=torch.int64, device=prompt.device)
        buffer[:prompt.numel()] = prompt
        fork = None if self.drafter is None else self.drafter.fork()
        seq = _Sequence(buffer, prompt.numel(), prompt.numel(), stops)
        return _Row(seq, fork, DraftGate(self.draft_backoff), sampling, generator)

    # ------------------------------------------------------------------ one round
    def _round(self, batch: BatchTarget, rows: list[_Row], backend: str) -> None:
        clock = _Stopwatch(self.target.device)
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
        contexts = [DraftContext(r.seq.tokens[:r.seq.length], r.seq.features, r.seq.feature_start) for r in drafting]
        for row, draft in zip(drafting, self.drafter.draft_batch([r.drafter for r in drafting], contexts), strict=True):
            if draft.vocab_size != self.target.vocab_size:
                raise ValueError(f"the drafter's vocabulary ({draft.vocab_size}) differs from the target's "
                                 f"({self.target.vocab_size})")
            row.draft = draft

    def _build(self, rows: list[_Row], backend: str) -> None:
        """Each row's tree: the policy's for the drafting rows (one ``build_batch``), the root alone otherwise."""
        drafted = [r for r in rows if r.draft is not None]
        built = self.policy.build_batch([r.draft for r in drafted], backend=backend) if drafted else []
        for row in rows:
            row.tree = DraftTree.root_only(int(row.seq.tokens[row.seq.length - 1]), device=self.target.device)
        for row, tree in zip(drafted, built, strict=True):
            row.gate.record(len(tree))
            anchor = int(row.seq.tokens[row.seq.length - 1])
            if tree.root_token != anchor:
                raise ValueError(f"the tree's root token {tree.root_token} is not the anchor {anchor}")
            room = self.target.max_positions - 1 - row.seq.anchor_position
            row.tree = limit_depth(tree, min(row.seq.remaining - 1, room))

    def _commit(self, row: _Row, result: VerifyResult, features: torch.Tensor | None) -> None:
        seq, tree, drafted = row.seq, row.tree, row.draft is not None
        accepted = result.accepted.to(tree.device)
        if features is not None:
            kept = features[accepted.to(features.device)]  # [tau, F], root first
            undrafted = not drafted and seq.features is not None  # taps since the last draft go on growing
            seq.features = torch.cat([seq.features, kept]) if undrafted else kept
        if drafted or row.drafter is None:
            seq.feature_start = seq.anchor_position
        path_tokens = tree.tokens[accepted]
        seq.append(path_tokens[1:].tolist() + [result.bonus_token])
        if drafted:
            row.drafter.observe(path_tokens)

    @staticmethod
    def _result(row: _Row) -> GenerationResult:
        seq = row.seq
        row.stats.new_tokens = seq.length - seq.prompt_len
        return GenerationResult(seq.tokens[seq.prompt_len:seq.length].clone(), row.stats)
