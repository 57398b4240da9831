"""What a bench run measures: its configuration, its methods, its prompts and its paired seeds.

Contract
--------
`BenchConfig` (named presets in `BENCH_PRESETS`) holds the methods, budgets, temperatures,
datasets and sizes of a run.  `expand_methods` turns method names into `MethodSpec`s: a method without
``@B`` runs at every budget of the config, chains (``dflash``, ``domino``, ``chain``) and ``ar`` at
none; ``ar`` always runs, first, since speedups and the losslessness check are taken against it.
`pair_seed` gives every method the same generator seed for one (prompt turn, temperature), so the
methods are paired; `canonical_key` is the order merged records are written in; `Shard` is one
process's slice of the prompts.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Sequence

import attrs

from treespec.apps.assembly.methods import MethodSpec, parse_method, with_budget
from treespec.apps.bench.summary import AR, POOLED
from treespec.apps.data.datasets import PromptRecord, load_prompts
from treespec.decoding import check_first_token
from treespec.tree import check_budget

__all__ = ["BENCH_PRESETS", "METHODS", "BenchConfig", "Shard", "bench_prompts", "canonical_key", "expand_methods",
           "pair_seed"]

METHODS = ("ar", "dflash", "domino", "ddtree", "caddtree", "dominotree")  # the published systems, any budget


def _tuple(kind):
    return lambda values: tuple(kind(v) for v in values)


@attrs.frozen
class BenchConfig:
    """What one bench run measures."""

    methods: tuple[str, ...] = attrs.field(default=METHODS, converter=_tuple(str))  # see expand_methods
    budgets: tuple[int, ...] = attrs.field(default=(16,), converter=_tuple(int))  # budgets for methods without @B
    temperatures: tuple[float, ...] = attrs.field(default=(0.0,), converter=_tuple(float))  # 0 = greedy
    datasets: tuple[str, ...] = attrs.field(default=("gsm8k",), converter=_tuple(str))  # benchmark names or files
    prompts: int = 10  # prompts per dataset (an MT-Bench prompt gives two measured turns)
    max_new_tokens: int = 128  # per response
    seed: int = 0  # prompt shuffle and the paired sampling streams
    warmup_tokens: int = 8  # new tokens of the untimed warm-up generation per method
    gap_tolerance: float | None = None  # tolerance on AR's decision margin at a divergence; None: the target's (`Target.numerics`)
    stop_at_eos: bool = True  # stop responses at the tokenizer's EOS (False: always max_new_tokens)
    enable_thinking: bool = False  # the Qwen3 chat template's thinking switch (off, as published)
    first_token: str = "round"  # "prefill": the first token from the prefill, τ counted as the papers count it
    batch_size: int = 1  # prompt turns decoded together per method (> 1: throughput over the batch)

    def __attrs_post_init__(self) -> None:
        _check_positive(prompts=self.prompts, max_new_tokens=self.max_new_tokens)
        if not self.methods or not self.datasets or not self.temperatures:
            raise ValueError("a bench run needs at least one method, one dataset and one temperature")
        for b in self.budgets:
            check_budget(b, "bench budgets")
        if any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")
        if self.warmup_tokens < 0:
            raise ValueError(f"warmup_tokens must be >= 0, got {self.warmup_tokens}")
        check_first_token(self.first_token)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


BENCH_PRESETS: dict[str, BenchConfig] = {
    # a few minutes on a laptop: does everything run and stay lossless?
    "smoke": BenchConfig(datasets=("gsm8k", "mt-bench"), prompts=2, max_new_tokens=32, temperatures=(0.0, 1.0)),
    # the published systems at two budgets on four kinds of prompts, greedy and sampled
    "demo": BenchConfig(budgets=(16, 64), temperatures=(0.0, 1.0), prompts=10,
                        datasets=("gsm8k", "mt-bench", "alpaca", "humaneval")),
}


@attrs.frozen
class Shard:
    """This process's slice of the prompts: rank r of K takes prompts r::K."""

    rank: int = 0  # this process
    world: int = 1  # processes in the run

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} outside a world of {self.world}")

    @classmethod
    def from_env(cls) -> Shard:
        """RANK / WORLD_SIZE as torch's distributed launcher sets them (a single process otherwise)."""
        return cls(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))

    def take(self, items: Sequence) -> list:
        return list(items[self.rank::self.world])


def expand_methods(names: Iterable[str], budgets: Iterable[int]) -> list[MethodSpec]:
    """AR first, then each method; one without ``@B`` at every budget (chains and AR at none)."""
    out = [parse_method("ar")]
    for name in names:
        method = parse_method(name)
        if method.autoregressive:
            continue
        if method.budget is not None or method.policy == "chain":
            out.append(method)
        else:
            out += [with_budget(method, b) for b in budgets]
    return list({m.name: m for m in out}.values())  # first occurrence wins, order kept


def pair_seed(seed: int, dataset: str, prompt_id: str, turn: int, temperature: float) -> int:
    """The seed every method's generator gets for one (prompt turn, temperature): a 63-bit hash."""
    key = f"{seed}\x00{dataset}\x00{prompt_id}\x00{turn}\x00{temperature!r}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") >> 1


def _natural(text: str) -> tuple:
    """Sort key that orders "gsm8k-9" before "gsm8k-10"."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def canonical_key(record) -> tuple:
    """The merged order: dataset, prompt, temperature, turn, then AR first and methods by name."""
    return (record.dataset, _natural(record.prompt_id), record.temperature, record.turn,
            record.method != AR, record.method)


def bench_prompts(config: BenchConfig) -> list[PromptRecord]:
    """Every measured prompt, dataset by dataset, each dataset shuffled with the run's seed.

    Records are told apart by dataset name, so two sources of one name (files ``a/qa.jsonl`` and
    ``b/qa.jsonl``) and the name of the pooled cell (`summary.POOLED`) are refused."""
    prompts, sources = [], {}
    for source in config.datasets:
        loaded = load_prompts(source, seed=config.seed, limit=config.prompts)
        name = loaded[0].dataset if loaded else source
        if name == POOLED:
            raise ValueError(f"dataset {source!r} is named {POOLED!r}, the name of the report's pooled cell; "
                             "rename the file")
        if name in sources:
            raise ValueError(f"datasets {sources[name]!r} and {source!r} are both named {name!r}, so their records "
                             "would mix; rename one file")
        sources[name] = source
        prompts += loaded
    return prompts
