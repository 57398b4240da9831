"""Batched speculative decoding: S sequences per round, each with its own tree, one target forward.

Contract
--------
``BatchDecoder(target, drafter, policy, verifier).generate(prompts, ...)`` decodes every prompt
of ``prompts`` (their lengths may differ) and returns one `GenerationResult` per prompt, in order:
each is what `SpeculativeDecoder.generate` returns for that prompt alone, token for token (a
sequence's tokens are the target's own choices at every step, whatever the others do).
``drafter=None, policy=None`` is batched autoregressive decoding.

A round is the single-sequence decoder's own (`treespec.decoding.RoundRunner`) over all the
unfinished sequences: each sequence is a generation of its own, steered by a draft controller of its
own (`treespec.steering`; row s keeps the s-th of the decoder's controllers across calls), the drafting
sequences' drafts come from one ``Drafter.draft_batch`` over the sequences' forks (``Drafter.fork``: one
context cache each), the trees of sequences sharing a policy from one ``TreePolicy.build_batch``
(a policy that samples its trees at T > 0 samples each with its sequence's generator), and all
trees are verified in one forward of the engine's `treespec.target.TargetBatch`; then each
sequence's verifier walk, commit, tokens, drafter feedback and round report are its own.  Each
sequence's round goes to the policy `TreePolicy.for_request` gave it: by default the decoder's
policy itself, so what a learning policy learns per drafter it learns from every row; what it keeps
per request stays with the row.  The reports say how many sequences one forward verified (a batch's
times are the batch's, not a row's).  A
sequence that reaches a stop token or its ``max_new_tokens`` leaves the batch.  Sampling at T > 0:
sequence s uses ``generators[s]`` (and, position-keyed, a key drawn from it as the single-sequence
decoder draws it), so per-row equality with single runs holds at any temperature when the same
generators are given.

Times: ``stats.prefill_time`` is the batch's prefill; a sequence's ``decode_time`` runs from the
first round to the round it finished in, and its rounds carry the batch's stage times.  The
throughput of a batch is its generated tokens over the wall time of `generate` (``last_wall_time``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import attrs
import torch

from treespec.decoding import (
    RoundRunner,
    Row,
    SequenceState,
    Stopwatch,
    check_first_token,
    check_request,
    checked_parts,
    generator_for,
)
from treespec.interfaces import DraftController, Drafter, SamplingParams, TreePolicy, Verifier
from treespec.sampling import sampling_key
from treespec.stats import GenerationResult
from treespec.steering import Steering
from treespec.target import Target, TargetBatch, TargetOutput, batch_class
from treespec.tree import DraftTree

__all__ = ["BatchDecoder", "BatchSide"]


class BatchSide:
    """The target side of a batched round: the engine's `TargetBatch` and the drafter's taps."""

    def __init__(self, batch: TargetBatch, taps: tuple[int, ...]) -> None:
        self.batch, self.taps = batch, taps

    def forward(self, trees: Sequence[DraftTree]) -> list[TargetOutput]:
        return self.batch.forward_trees(trees, self.taps)

    def commit(self, accepted: Sequence[torch.Tensor]) -> None:
        self.batch.commit(list(accepted))


class BatchDecoder:
    """Batched AR and speculative decoding over one target (see the module docstring)."""

    def __init__(self, target: Target, drafter: Drafter | None = None, policy: TreePolicy | None = None,
                 verifier: Verifier | None = None, *, controller: DraftController | None = None) -> None:
        self.batch_class = batch_class(target)  # how its engine batches (refused here when it does not)
        self.target, self.drafter, self.policy = target, drafter, policy
        self.verifier = checked_parts(drafter, policy, verifier)
        # whether and at what price the first row drafts (default: the policy's); each further row gets one more
        # of the policy's (`_controller`), all kept across generate calls
        self.controller = controller if controller is not None or policy is None else policy.draft_controller()
        self.controllers: list[DraftController] = [] if self.controller is None else [self.controller]
        self.taps = tuple(drafter.tap_layers) if drafter is not None else ()
        if drafter is not None:
            drafter.bind(target)
            self.controller.bind(drafter.reach)
        self.last_wall_time = 0.0  # seconds of the last generate, prefill included

    # ------------------------------------------------------------------ public entry
    def generate(self, prompts: Sequence[torch.Tensor], *, max_new_tokens: int | Sequence[int],
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 stop_token_ids: Iterable[int] | None = None,
                 generators: Sequence[torch.Generator | None] | None = None,
                 position_keyed: bool | None = None, first_token: str = "round",
                 sampling: SamplingParams | None = None) -> list[GenerationResult]:
        """Up to ``max_new_tokens`` (one value, or one per prompt) new tokens after each prompt;
        ``first_token`` as in `SpeculativeDecoder.generate` (``"prefill"``: each sequence's first
        token is the target's after its prompt, from one batched forward timed with the prefill);
        ``sampling`` in place of the four sampling keywords, as there."""
        start = time.perf_counter()
        check_first_token(first_token)
        sampling = SamplingParams.of(sampling, temperature, top_k, top_p, position_keyed)
        rows = self._start(prompts, max_new_tokens, sampling, frozenset(stop_token_ids or ()), generators)
        drafting = any(r.drafter is not None for r in rows)  # one forward for all: taps when any row reads them
        taps = self.taps if drafting else ()
        batch = self.batch_class(self.target)
        rounds = RoundRunner(self.target, self.drafter if drafting else None, self.verifier, BatchSide(batch, taps),
                             batched=True)
        clock = Stopwatch(self.target.device)
        features = clock.run("prefill", batch.prefill, [r.seq.tokens[:r.seq.length] for r in rows], taps)
        for row, feats in zip(rows, features, strict=True):
            row.seq.features = feats
        if first_token == "prefill":
            clock.run("first", rounds.first_tokens, rows)
        for row in rows:
            row.stats.prefill_time = clock.times["prefill"] + clock.times.get("first", 0.0)
        active, began = self._leave(batch, list(rows)), clock.now()
        while active:
            rounds.run(active)
            now = clock.now()
            for row in active:
                row.stats.decode_time = now - began
            active = self._leave(batch, active)
        self.last_wall_time = time.perf_counter() - start
        return [self._result(row) for row in rows]

    @staticmethod
    def _leave(batch: TargetBatch, active: list[Row]) -> list[Row]:
        """The rows still decoding; finished ones leave the batch (their cache rows dropped)."""
        staying = [i for i, row in enumerate(active) if not row.seq.done]
        if len(staying) < len(active):
            batch.keep(staying)
        return [active[i] for i in staying]

    # ------------------------------------------------------------------ set-up
    def _start(self, prompts: Sequence[torch.Tensor], max_new_tokens: int | Sequence[int], sampling: SamplingParams,
               stops: frozenset[int], generators: Sequence[torch.Generator | None] | None) -> list[Row]:
        if not prompts:
            raise ValueError("generate needs at least one prompt")
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        gens = [None] * len(prompts) if generators is None else list(generators)
        if len(budgets) != len(prompts) or len(gens) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts need as many max_new_tokens and generators "
                             f"(got {len(budgets)} and {len(gens)})")
        return [self._row(i, p, n, sampling, stops, g) for i, (p, n, g) in enumerate(zip(prompts, budgets, gens))]

    def _controller(self, index: int) -> DraftController:
        """Row ``index``'s draft controller: the decoder's own for the first, one more of the policy's for each
        further row, kept across calls (each row is a generation of its own, decided as one)."""
        while len(self.controllers) <= index:
            controller = self.policy.draft_controller()
            controller.bind(self.drafter.reach)
            self.controllers.append(controller)
        return self.controllers[index]

    def _row(self, index: int, prompt: torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
             stops: frozenset[int], generator: torch.Generator | None) -> Row:
        """One request's row, its generation started with its own controller; one that may not draft is an AR
        row (no drafter fork, no policy: its controller finds no tree that pays)."""
        prompt = torch.as_tensor(prompt, dtype=torch.int64).reshape(-1).to(self.target.device)
        if prompt.numel() == 0:
            raise ValueError(f"prompt {index} is empty")
        check_request(self.target, prompt, max_new_tokens, where=f"prompt {index}: ")
        generator = generator_for(sampling, generator)
        if sampling.position_keyed and not sampling.greedy:  # the key a single-sequence run draws first
            sampling = attrs.evolve(sampling, key=sampling_key(generator))
        steering = None if self.drafter is None else Steering(self._controller(index), self.policy.for_request())
        drafting = steering is not None and steering.start()
        seq = SequenceState.start(prompt, max_new_tokens, stops)
        row = Row(seq, self.drafter.fork() if drafting else None, steering.policy if drafting else None, steering,
                  sampling, generator)
        row.stats.undrafted = self.drafter is not None and not drafting
        return row

    @staticmethod
    def _result(row: Row) -> GenerationResult:
        seq = row.seq
        row.stats.new_tokens = seq.length - seq.prompt_len
        return GenerationResult(seq.tokens[seq.prompt_len:seq.length].clone(), row.stats)
