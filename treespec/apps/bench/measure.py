"""The bench's measurements of one prompt turn: every method on it, paired, and its divergences from AR.

Contract
--------
`Runner(config, session, methods)` holds one decoder per method.  ``conversation(prompt, T)``
measures every turn of one conversation, the methods in an order rotated from turn to turn (so a
load that comes and goes hits every method alike), each record holding the threads it ran with and
what other processes took meanwhile; a turn another process disturbed is measured again once, after
the threads are chosen again from the cores free now.  Turn t + 1 is asked after AR's answer to
turn t, so it is the same prompt for every method.  Each method's generator is seeded with the turn's
``pair_seed``.  A cost-aware method's draft controller and live cost model learn the machine across
conversations, so its records depend on the order prompts were measured in (a fixed method's do not).  A turn that would overflow the context
window ends its conversation (``skipped`` names it).  bench/batched.py measures S turns at a time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs
import torch

from treespec.apps.assembly.methods import MethodSpec, naming
from treespec.apps.assembly.session import Session
from treespec.apps.bench.config import BenchConfig, pair_seed
from treespec.apps.bench.lossless import Divergence, find_divergence, resolve_tolerance, token_comparable
from treespec.apps.bench.records import BenchRecord, cost_schedule, decisions_of
from treespec.apps.bench.summary import AR
from treespec.apps.data.datasets import PromptRecord
from treespec.pricing.conditions import Load, ThreadControl, process_started
from treespec.target import ContextOverflowError

__all__ = ["Runner", "Turn", "method_fields", "rotated"]


def method_fields(method: MethodSpec) -> dict:
    """A record's fields that say which method made it: the spec's fields and its derived name."""
    return {"method": method.name, "policy": method.policy or AR, "budget": method.budget or 0,
            "options": dict(method.options), "verifier": method.verifier, "drafter": method.drafter}



def rotated(methods: list[MethodSpec], seed: int) -> list[MethodSpec]:
    """``methods`` rotated by a turn's ``seed`` (its pair seed, so a resumed or sharded run rotates each
    turn alike): over many turns every method runs at every place of the order equally often."""
    start = seed % len(methods)
    return methods[start:] + methods[:start]


@attrs.frozen
class Turn:
    """One measured prompt turn at one temperature: what every method is given."""

    prompt: PromptRecord
    turn: int
    temperature: float
    ids: torch.Tensor  # [P] prompt ids, chat template applied
    seed: int  # pair_seed of this turn


class Runner:
    """The measurements of one shard: a decoder per method, and what happens on each prompt turn."""

    def __init__(self, config: BenchConfig, session: Session, methods: list[MethodSpec]) -> None:
        self.config, self.session, self.methods = config, session, methods
        self.decoders = self.make_decoders()
        self.stops = session.stop_ids if config.stop_at_eos else []
        # the largest tree a method verifies (a chain: a block of 16, the released drafters')
        largest = max([m.budget or 16 for m in methods if not m.autoregressive] or [16]) + 1
        self.tolerance = resolve_tolerance(config, session.target, largest)
        self.skipped: list[str] = []
        self.run_id = run_identity()  # this invocation, named in its records

    def make_decoders(self) -> dict:
        """Method name -> the decoder this runner measures it with."""
        return self.session.decoders(self.methods)

    def generate(self, name: str, ids: torch.Tensor, max_new_tokens: int, temperature: float, seed: int):
        return self.decoders[name].generate(
            ids, max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=self.stops,
            generator=torch.Generator().manual_seed(seed),
            first_token=self.config.first_token)

    def warm_up(self, prompt: PromptRecord) -> None:
        """One short untimed generation per method (first-call allocations, lazy imports, caches)."""
        if self.config.warmup_tokens == 0:
            return
        ids = self.session.chat.encode(prompt.turns[:1], [])
        for m in self.methods:
            self.generate(m.name, ids, self.config.warmup_tokens, 0.0, 0)

    def measure(self, turn: Turn) -> dict[str, BenchRecord]:
        """Every method on one turn; method name -> record, in the methods' order.  The methods run in
        an order rotated from turn to turn (`rotated`), so a load that comes and goes falls on every
        place of the order alike; a turn another process disturbed is measured once more, after the
        threads are chosen again from the cores free now (`ThreadControl.adapt`); after a quiet turn that
        left the spare cores idle, threads chosen down are chosen again (`ThreadControl.regain`)."""
        records = self._measure_once(turn)
        if any(r.disturbed for r in records.values()):
            self.session.disturbed += 1
            if self.session.threads.adapt():
                records = self._measure_once(turn)
        else:
            regain_threads(self.session.threads, records.values())
        return {m.name: records[m.name] for m in self.methods}

    def _measure_once(self, turn: Turn) -> dict[str, BenchRecord]:
        return {m.name: self._record(m, turn) for m in rotated(self.methods, turn.seed)}

    def _record(self, method: MethodSpec, turn: Turn) -> BenchRecord:
        meter = self.session.threads.meter()
        meter.start()
        with naming(method):
            out = self.generate(method.name, turn.ids, self.config.max_new_tokens, turn.temperature, turn.seed)
        load = meter.stop()
        s = out.stats
        models, rounds = cost_schedule(s.rounds) if method.cost_aware else ([], [])
        return BenchRecord(
            **method_fields(method), temperature=turn.temperature, dataset=turn.prompt.dataset,
            prompt_id=turn.prompt.id, turn=turn.turn, seed=turn.seed, tokens=out.tokens.tolist(), taus=s.taus,
            decode_time=s.decode_time, prefill_time=s.prefill_time, stage_times=s.stage_totals(), run=self.run_id,
            cost_models=models, cost_rounds=rounds, threads=meter.threads, load=load.to_record(),
            decisions={} if method.autoregressive else decisions_of(s))

    def divergences(self, turn: Turn, records: dict[str, BenchRecord]) -> list[Divergence]:
        ar = records[AR]
        found = (find_divergence(self.session.target, turn.ids, ar, r, self.tolerance)
                 for name, r in records.items() if name != AR and token_comparable(r))
        return [d for d in found if d is not None]

    def conversation(self, prompt: PromptRecord, temperature: float) -> Iterator[tuple[list, list]]:
        """(records, divergences) per turn; turn t + 1 is asked after AR's answer to turn t."""
        answers: list[str] = []
        for t in range(len(prompt.turns)):
            turn = self._turn(prompt, t, temperature, answers)
            try:
                records = self.measure(turn)
            except ContextOverflowError as exc:
                self.skipped.append(f"{prompt.id} turn {t} T={temperature:g}: {exc}")
                return
            yield list(records.values()), self.divergences(turn, records)
            answers.append(self.session.chat.decode(records[AR].tokens))

    def _turn(self, prompt: PromptRecord, t: int, temperature: float, answers: list[str]) -> Turn:
        """Turn t of ``prompt``, asked after ``answers`` (AR's answers to the earlier turns)."""
        ids = self.session.chat.encode(prompt.turns[:t + 1], answers)
        return Turn(prompt, t, temperature, ids, pair_seed(self.config.seed, prompt.dataset, prompt.id, t, temperature))


def regain_threads(threads: ThreadControl, records: Iterable[BenchRecord]) -> bool:
    """`ThreadControl.regain` over the spans of a measurement's records (those whose load was read)."""
    return threads.regain([Load(**r.load) for r in records if r.load])


def run_identity(proc: Path = Path("/proc")) -> str:
    """This invocation's name in its records: its start time and process id; under a launcher
    (torchrun: WORLD_SIZE > 1) the launcher's, so every rank of one run names the same run (its
    start read from ``proc``; the day where that cannot be read)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    parent = os.getppid()
    started = process_started(parent, proc)
    stamp = time.strftime("%Y%m%d") if started is None else time.strftime("%Y%m%dT%H%M%S", time.localtime(started))
    return f"{stamp}-{parent}"
