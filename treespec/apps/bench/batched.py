"""The bench's batched measurements: ``--batch-size S`` decodes S prompt turns together per method.

Contract
--------
The shard's conversations are taken S at a time (in order, one temperature per batch); turn t of
every conversation of a batch that has one is decoded in one `BatchDecoder.generate` call per method
(AR included, batched too, so speedups compare methods at the same S), each row with its own paired
generator, so every row's tokens are what the same turn gives alone.  Turn t + 1 is asked after AR's
answer to turn t, as unbatched.  A record's ``decode_time`` (and prefill and stage times) is its
share of its batch's time, in proportion to its tokens: summed over a cell, time per token is the
batch's, i.e. the methods' throughput at batch size S.  ``batch_size`` in each record says S.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from treespec.apps.assembly.methods import MethodSpec, naming
from treespec.apps.bench.measure import Runner, Turn, method_fields, regain_threads, rotated
from treespec.apps.bench.records import BenchRecord, decisions_of
from treespec.apps.bench.summary import AR
from treespec.apps.data.datasets import PromptRecord
from treespec.target import ContextOverflowError

__all__ = ["BatchRunner"]


class BatchRunner(Runner):
    """The measurements of one shard, S conversations at a time (see the module docstring)."""

    def make_decoders(self) -> dict:
        return self.session.decoders(self.methods, batched=True)  # one BatchDecoder per method

    def warm_up(self, prompt: PromptRecord) -> None:
        if self.config.warmup_tokens == 0:
            return
        ids = self.session.chat.encode(prompt.turns[:1], [])
        for m in self.methods:
            self.decoders[m.name].generate([ids] * self.config.batch_size, max_new_tokens=self.config.warmup_tokens,
                                           stop_token_ids=self.stops)

    def conversations(self, prompts: Sequence[PromptRecord], temperature: float) -> list[list[tuple[list, list]]]:
        """Per conversation, (records, divergences) per turn; a conversation that overflows the context
        window is skipped whole (its batch goes on without it)."""
        answers: list[list[str]] = [[] for _ in prompts]
        out: list[list[tuple[list, list]]] = [[] for _ in prompts]
        alive = set(range(len(prompts)))
        for t in range(max(len(p.turns) for p in prompts)):
            members = [i for i in sorted(alive) if len(prompts[i].turns) > t]
            if not members:
                break
            turns = [self._turn(prompts[i], t, temperature, answers[i]) for i in members]
            for i, turn in zip(members, turns, strict=True):  # one too long for the window leaves the batch
                if turn.ids.numel() + self.config.max_new_tokens > self.session.target.max_positions:
                    self.skipped.append(f"{turn.prompt.id} turn {t} T={temperature:g}: prompt of "
                                        f"{turn.ids.numel()} tokens + {self.config.max_new_tokens} new tokens")
                    alive.discard(i)
            kept = [(i, turn) for i, turn in zip(members, turns, strict=True) if i in alive]
            if not kept:
                continue
            try:
                records = self.measure_batch([turn for _, turn in kept])
            except ContextOverflowError as exc:
                self.skipped += [f"{turn.prompt.id} turn {t} T={temperature:g}: {exc}" for _, turn in kept]
                alive -= {i for i, _ in kept}
                continue
            for j, (i, turn) in enumerate(kept):
                row = {name: recs[j] for name, recs in records.items()}
                out[i].append((list(row.values()), self.divergences(turn, row)))
                answers[i].append(self.session.chat.decode(row[AR].tokens))
        return [out[i] if i in alive else [] for i in range(len(prompts))]

    def measure_batch(self, turns: Sequence[Turn]) -> dict[str, list[BenchRecord]]:
        """Every method on one batch of turns, in an order rotated from batch to batch; method name ->
        one record per turn (the methods' order); a disturbed batch is measured again once, as unbatched."""
        records = self._batch_once(turns)
        if any(r.disturbed for rows in records.values() for r in rows):
            self.session.disturbed += 1
            if self.session.threads.adapt():
                records = self._batch_once(turns)
        else:
            regain_threads(self.session.threads, (r for rows in records.values() for r in rows))
        return {m.name: records[m.name] for m in self.methods}

    def _batch_once(self, turns: Sequence[Turn]) -> dict[str, list[BenchRecord]]:
        return {m.name: self._batch_records(m, turns) for m in rotated(self.methods, turns[0].seed)}

    def _batch_records(self, method: MethodSpec, turns: Sequence[Turn]) -> list[BenchRecord]:
        temperature = turns[0].temperature
        meter = self.session.threads.meter()
        meter.start()
        with naming(method):
            results = self.decoders[method.name].generate(
                [t.ids for t in turns], max_new_tokens=self.config.max_new_tokens, temperature=temperature,
                stop_token_ids=self.stops, generators=[torch.Generator().manual_seed(t.seed) for t in turns],
                first_token=self.config.first_token)
        load = meter.stop().to_record()
        decode = max(r.stats.decode_time for r in results)  # the batch's wall time, first round to last
        longest = max(results, key=lambda r: len(r.stats.rounds)).stats.stage_totals()  # the batch's stage times
        total = max(1, sum(r.tokens.numel() for r in results))
        records = []
        for turn, result in zip(turns, results, strict=True):
            share = result.tokens.numel() / total
            records.append(BenchRecord(
                **method_fields(method), temperature=temperature, dataset=turn.prompt.dataset,
                prompt_id=turn.prompt.id, turn=turn.turn, seed=turn.seed, tokens=result.tokens.tolist(),
                taus=result.stats.taus, decode_time=decode * share, prefill_time=result.stats.prefill_time * share,
                stage_times={k: v * share for k, v in longest.items()}, batch_size=len(turns), run=self.run_id,
                threads=meter.threads, load=load,
                decisions={} if method.autoregressive else decisions_of(result.stats)))
        return records
