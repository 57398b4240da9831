"""The A/B bench run: every method in one harness, paired prompts and random streams, JSONL out.

Contract
--------
`run_shard(config, harness, out_dir, shard)` measures methods x prompt turns x temperatures over
one `Harness` (bench/harness.py):

* Methods come from `expand_methods` (bench/config.py); ``ar`` runs first in every cell.
* Paired: every method sees the same prompt ids and a generator seeded with
  ``pair_seed(seed, dataset, prompt id, turn, temperature)``; with position-keyed sampling the
  outputs at T > 0 are then token-for-token comparable as well.
* Prompt-major order (prompt, temperature, turn, method), so machine noise hits every method alike.
  MT-Bench turns are measured separately; turn 2's prompt holds turn 1's question and the AR answer
  of turn 1 at the same temperature, so it is identical for every method.
* One untimed warm-up generation per method precedes the measurements; every decoder's draft gate
  is reset per conversation, so records do not depend on the shard layout or prompt order.
* Rank r of K takes prompts r::K and streams ``records-rank{r}.jsonl`` (a `BenchRecord` per method x
  prompt turn x temperature) and ``divergences-rank{r}.jsonl`` (bench/lossless.py); a conversation
  is the unit of resumption (`resume_shard`).  `merge_shards` (bench/merge.py) joins the shards and
  `write_report` (bench/report.py) derives the tables.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import torch

from treespec.apps.bench.config import BenchConfig, Shard, bench_prompts, expand_methods, pair_seed
from treespec.apps.bench.harness import Harness
from treespec.apps.bench.lossless import Divergence, find_divergence, resolve_tolerance, write_jsonl
from treespec.apps.bench.outdir import shard_paths
from treespec.apps.bench.records import BenchRecord, write_records
from treespec.apps.bench.summary import AR
from treespec.apps.datasets import PromptRecord
from treespec.apps.methods import Method
from treespec.decoding import SpeculativeDecoder
from treespec.target import ContextOverflowError

__all__ = ["resume_shard", "run_shard"]


@attrs.frozen
class _Turn:
    """One measured prompt turn at one temperature: what every method is given."""

    prompt: PromptRecord
    turn: int
    temperature: float
    ids: torch.Tensor  # [P] prompt ids, chat template applied
    seed: int  # pair_seed of this turn


class _Runner:
    """The measurements of one shard: a decoder per method, and what happens on each prompt turn."""

    def __init__(self, config: BenchConfig, harness: Harness, methods: list[Method]) -> None:
        self.config, self.harness, self.methods = config, harness, methods
        self.decoders = harness.decoders(methods)
        self.stops = harness.chat.stop_ids if config.stop_at_eos else []
        self.tolerance = resolve_tolerance(config, harness.target.dtype)
        self.skipped: list[str] = []

    def generate(self, name: str, ids: torch.Tensor, max_new_tokens: int, temperature: float, seed: int):
        return self.decoders[name].generate(
            ids, max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=self.stops,
            generator=torch.Generator().manual_seed(seed), backend=self.config.backend,
            first_token=self.config.first_token)

    def warm_up(self, prompt: PromptRecord) -> None:
        """One short untimed generation per method (first-call allocations, lazy imports, caches)."""
        if self.config.warmup_tokens == 0:
            return
        ids = self.harness.chat.encode(prompt.turns[:1], [])
        for m in self.methods:
            self.generate(m.name, ids, self.config.warmup_tokens, 0.0, 0)

    def measure(self, turn: _Turn) -> dict[str, BenchRecord]:
        """Every method on one turn, AR first; method name -> record."""
        return {m.name: self._record(m, turn) for m in self.methods}

    def _record(self, method: Method, turn: _Turn) -> BenchRecord:
        out = self.generate(method.name, turn.ids, self.config.max_new_tokens, turn.temperature, turn.seed)
        s = out.stats
        return BenchRecord(
            method=method.name, policy=method.policy or AR, budget=method.budget or 0,
            temperature=turn.temperature, dataset=turn.prompt.dataset, prompt_id=turn.prompt.id, turn=turn.turn,
            seed=turn.seed, tokens=out.tokens.tolist(), taus=s.taus, decode_time=s.decode_time,
            prefill_time=s.prefill_time, stage_times=s.stage_totals())

    def divergences(self, turn: _Turn, records: dict[str, BenchRecord]) -> list[Divergence]:
        ar = records[AR]
        found = (find_divergence(self.harness.target, turn.ids, ar, r, self.tolerance)
                 for name, r in records.items() if name != AR)
        return [d for d in found if d is not None]

    def conversation(self, prompt: PromptRecord, temperature: float) -> Iterator[tuple[list, list]]:
        """(records, divergences) per turn; turn t + 1 is asked after AR's answer to turn t."""
        answers: list[str] = []
        for decoder in self.decoders.values():  # each conversation on its own: records independent of
            if isinstance(decoder, SpeculativeDecoder):  # the shard layout, resumption and prompt order
                decoder.gate.reset()
        for t in range(len(prompt.turns)):
            ids = self.harness.chat.encode(prompt.turns[:t + 1], answers)
            turn = _Turn(prompt, t, temperature, ids, pair_seed(self.config.seed, prompt.dataset, prompt.id, t,
                                                                temperature))
            try:
                records = self.measure(turn)
            except ContextOverflowError as exc:
                self.skipped.append(f"{prompt.id} turn {t} T={temperature:g}: {exc}")
                return
            yield list(records.values()), self.divergences(turn, records)
            answers.append(self.harness.chat.decode(records[AR].tokens))


def run_shard(config: BenchConfig, harness: Harness, out_dir: str | Path, shard: Shard = Shard(), *,
              progress: bool = True) -> Path:
    """Measure this shard's prompts; streams its records and divergences into ``out_dir``."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mine = shard.take(bench_prompts(config))
    methods = expand_methods(config.methods, config.budgets)
    rec_path, div_path = shard_paths(out_dir, shard.rank)
    done = resume_shard(rec_path, div_path, mine, config.temperatures, [m.name for m in methods])
    todo = [(p, t) for p in mine for t in config.temperatures if (p.dataset, p.id, t) not in done]
    runner = _runner(config, harness, methods)
    if todo:
        runner.warm_up(todo[0][0])
    total = sum(len(p.turns) for p, _ in todo)
    with open(rec_path, "a") as rec_fh, open(div_path, "a") as div_fh, \
            tqdm(total=total, disable=not progress, unit="turn", desc=f"bench rank {shard.rank}") as bar:
        for finished in _measured(runner, todo, config.batch_size):  # a conversation is the unit of resumption
            for records, divergences in finished:
                write_jsonl(div_fh, divergences)  # divergences first: a conversation counts once its records do
                write_jsonl(rec_fh, records)
                bar.update(1)
    for line in runner.skipped:
        print(f"treespec bench: skipped (context window) {line}", file=sys.stderr)
    return rec_path


def _runner(config: BenchConfig, harness: Harness, methods: list[Method]) -> _Runner:
    if config.batch_size == 1:
        return _Runner(config, harness, methods)
    from treespec.apps.bench.batched import BatchRunner

    return BatchRunner(config, harness, methods)


def _measured(runner: _Runner, todo: Sequence[tuple[PromptRecord, float]], batch_size: int) -> Iterator[list]:
    """Each conversation's (records, divergences) per turn, one conversation or one batch at a time."""
    if batch_size == 1:
        for prompt, temperature in todo:
            yield list(runner.conversation(prompt, temperature))
        return
    by_temperature: dict[float, list[PromptRecord]] = {}
    for prompt, temperature in todo:
        by_temperature.setdefault(temperature, []).append(prompt)
    for temperature, prompts in by_temperature.items():
        for start in range(0, len(prompts), batch_size):
            yield from runner.conversations(prompts[start:start + batch_size], temperature)


def _complete_lines(path: Path) -> list[str]:
    """The file's complete JSON lines; a last line cut by a crash (no newline) is dropped and reported."""
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        print(f"treespec bench: dropping a truncated last line of {path} (an interrupted write)", file=sys.stderr)
        lines = lines[:-1]
    return [line for line in lines if line.strip()]


def _conversation(row: dict) -> tuple[str, str, float]:
    """The (dataset, prompt id, temperature) a JSON record or divergence belongs to."""
    return row["dataset"], row["prompt_id"], row["temperature"]


def resume_shard(rec_path: Path, div_path: Path, prompts: Sequence[PromptRecord], temperatures: Sequence[float],
                 methods: Sequence[str]) -> set[tuple[str, str, float]]:
    """Keep the records of the conversations a previous run of this shard completed (every turn of every
    method) and rewrite the shard files with those only; returns their (dataset, prompt id, T) keys."""
    turns = {(p.dataset, p.id): len(p.turns) for p in prompts}
    records = [BenchRecord(**json.loads(line)) for line in _complete_lines(rec_path)]
    seen: dict[tuple, set] = {}
    for r in records:
        seen.setdefault((r.dataset, r.prompt_id, r.temperature), set()).add((r.method, r.turn))
    done = {key for key, got in seen.items() if (key[0], key[1]) in turns and key[2] in temperatures
            and got >= {(m, t) for m in methods for t in range(turns[key[0], key[1]])}}
    kept = [r for r in records if (r.dataset, r.prompt_id, r.temperature) in done]
    divergences = [line for line in _complete_lines(div_path) if _conversation(json.loads(line)) in done]
    write_records(rec_path.with_suffix(".tmp"), kept)
    rec_path.with_suffix(".tmp").replace(rec_path)
    div_path.with_suffix(".tmp").write_text("".join(divergences))
    div_path.with_suffix(".tmp").replace(div_path)
    return done
