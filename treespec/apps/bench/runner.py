"""The A/B bench run: every method in one harness, paired prompts and random streams, JSONL out.

Contract
--------
`run_shard(config, session, out_dir, shard)` measures methods x prompt turns x temperatures over
one `treespec.apps.assembly.session.Session`, a conversation at a time (bench/measure.py) or, with
``batch_size`` S > 1, S conversations at a time (bench/batched.py):

* Methods come from `expand_methods` (bench/config.py); AR is measured in every cell, the methods of a
  turn in an order rotated from turn to turn (bench/measure.py).
* Paired: every method sees the same prompt ids and a generator seeded with
  ``pair_seed(seed, dataset, prompt id, turn, temperature)``; with position-keyed sampling the
  outputs at T > 0 are then token-for-token comparable as well.
* Prompt-major order (prompt, temperature, turn, method), so machine noise hits every method alike.
  MT-Bench turns are measured separately; turn 2's prompt holds turn 1's question and the AR answer
  of turn 1 at the same temperature, so it is identical for every method.
* One untimed warm-up generation per method precedes the measurements; a cost-aware method's draft
  controller carries over between conversations (it learns the machine, `treespec.pricing.control`).
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

from treespec.apps.assembly.methods import MethodSpec
from treespec.apps.assembly.session import Session
from treespec.apps.bench.batched import BatchRunner
from treespec.apps.bench.config import BenchConfig, Shard, bench_prompts, expand_methods
from treespec.apps.bench.lossless import write_jsonl
from treespec.apps.bench.measure import Runner
from treespec.apps.bench.outdir import shard_paths
from treespec.apps.bench.records import BenchRecord, write_records
from treespec.apps.data.datasets import PromptRecord

__all__ = ["resume_shard", "run_shard"]


def run_shard(config: BenchConfig, session: Session, out_dir: str | Path, shard: Shard = Shard(), *,
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
    runner = _runner(config, session, methods)
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


def _runner(config: BenchConfig, session: Session, methods: list[MethodSpec]) -> Runner:
    return Runner(config, session, methods) if config.batch_size == 1 else BatchRunner(config, session, methods)


def _measured(runner: Runner, todo: Sequence[tuple[PromptRecord, float]], batch_size: int) -> Iterator[list]:
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
