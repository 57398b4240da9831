"""The A/B bench runner: every method in one harness, paired prompts and random streams, JSONL out.

Contract
--------
`run_shard(config, harness, out_dir, shard)` measures methods x prompt turns x temperatures over
one `TargetModel` and one drafter per kind ("dflash", "domino"), each loaded once:

* Methods come from `expand_methods`: a method without ``@B`` runs at every budget of the config,
  chains (``dflash``, ``domino``, ``chain``) and ``ar`` at none; ``ar`` always runs, first in every
  cell, since speedups and the losslessness check are taken against it.
* Paired: every method sees the same prompt ids and a generator seeded with
  ``pair_seed(seed, dataset, prompt id, turn, temperature)``; with position-keyed sampling the
  outputs at T > 0 are then token-for-token comparable as well.
* Prompt-major order (prompt, temperature, turn, method), so machine noise hits every method alike.
  MT-Bench turns are measured separately; turn 2's prompt holds turn 1's question and the AR answer
  of turn 1 at the same temperature, so it is identical for every method.
* One untimed warm-up generation per method precedes the measurements.
* Rank r of K takes prompts r::K and streams ``records-rank{r}.jsonl`` (a `BenchRecord` per method x
  prompt turn x temperature) and ``divergences-rank{r}.jsonl``; `merge_shards` concatenates the
  shards in the canonical order (`canonical_key`), so a sharded run merges to the records an
  unsharded run writes (times aside).

Losslessness (docs/decoding.md, "Verification"): every response that differs from AR's gets a `Divergence` giving
the first differing position and AR's decision margin there (`decision_gap`: the logits' top-two
gap at T = 0; at T > 0 that of the position-keyed Gumbel-max scores, in logit units), measured by
one fresh forward of the prompt and AR's prefix.  It is acceptable only when the margin is within
the stated tolerance (`GAP_TOLERANCE` per dtype, or the config's); in float64 nothing may differ.

`write_report(out_dir)` derives summary.csv, pairs.csv, summary.md, lossless.md and the plots from
``records.jsonl`` (and ``divergences.jsonl``) alone; rerunning it gives identical bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import attrs
import torch

from treespec.bench.plots import plot_budget_curves, plot_tau_histograms
from treespec.bench.records import BenchRecord, read_records, write_records
from treespec.bench.report import AR, compare_pairs, markdown_table, summarize, write_csv
from treespec.datasets import PromptRecord, encode_chat, load_prompts
from treespec.decoding import SpeculativeDecoder
from treespec.interfaces import Drafter, SamplingParams
from treespec.cost import CostModel
from treespec.methods import Method, build_policy, parse_method, policy_class, with_budget
from treespec.profile import CostProfile, machine_profile
from treespec.sampling import gumbel_noise, sampling_key, work_dtype
from treespec.target import ContextOverflowError, TargetModel

__all__ = [
    "BENCH_PRESETS", "GAP_TOLERANCE", "BenchConfig", "Chat", "Divergence", "Harness", "Report", "Shard",
    "bench_prompts", "canonical_key", "decision_gap", "expand_methods", "find_divergence", "first_difference",
    "load_harness", "merge_shards", "pair_seed", "read_divergences", "resolve_tolerance", "run_shard",
    "prepare_out", "resume_shard", "run_settings", "shard_paths", "write_report", "write_settings",
]

RECORDS, DIVERGENCES, SETTINGS = "records.jsonl", "divergences.jsonl", "bench.json"
METHODS = ("ar", "dflash", "domino", "ddtree", "caddtree", "dominotree")  # the published systems, any budget

# Largest AR decision margin (top-two gap, logit units; see `decision_gap`) at which a divergence
# from AR is put down to rounding: a tree forward and a one-token step sum in different orders.
# Roughly a few units in the last place of logits of magnitude 10-30 (bf16 spacing there is
# 0.0625-0.125; fp16 8x finer; fp32 ~2e-6).
GAP_TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-3,
    torch.float16: 0.05,
    torch.bfloat16: 0.5,
}


# ---------------------------------------------------------------------------- configuration
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
    gap_tolerance: float | None = None  # tolerance on AR's decision margin at a divergence; None: GAP_TOLERANCE
    backend: str = "torch"  # policy backend: "torch" or "networkx"
    stop_at_eos: bool = True  # stop responses at the tokenizer's EOS (False: always max_new_tokens)
    enable_thinking: bool = False  # the Qwen3 chat template's thinking switch (off, as published)
    first_token: str = "round"  # "prefill": the first token from the prefill, τ counted as the papers count it

    def __attrs_post_init__(self) -> None:
        _check_positive(prompts=self.prompts, max_new_tokens=self.max_new_tokens)
        if not self.methods or not self.datasets or not self.temperatures:
            raise ValueError("a bench run needs at least one method, one dataset and one temperature")
        if any(b < 1 for b in self.budgets):
            raise ValueError(f"budgets must be >= 1, got {self.budgets}")
        if any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")
        if self.warmup_tokens < 0:
            raise ValueError(f"warmup_tokens must be >= 0, got {self.warmup_tokens}")
        if self.first_token not in ("round", "prefill"):
            raise ValueError(f"first_token must be 'round' or 'prefill', got {self.first_token!r}")


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


# ---------------------------------------------------------------------------- methods and seeds
def expand_methods(names: Iterable[str], budgets: Iterable[int]) -> list[Method]:
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


# ---------------------------------------------------------------------------- harness
class Chat:
    """Prompt turns to token ids with a tokenizer's chat template, and answers back to text."""

    def __init__(self, tokenizer, *, enable_thinking: bool = False) -> None:
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking  # the Qwen3 template's switch

    def encode(self, user_turns: Sequence[str], answers: Sequence[str]) -> torch.Tensor:
        ids = encode_chat(self.tokenizer, user_turns, answers, enable_thinking=self.enable_thinking)
        return torch.tensor(ids, dtype=torch.int64)  # [P]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    @property
    def stop_ids(self) -> list[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


@attrs.define
class Harness:
    """What every method of a run shares: the target, the drafters, the chat template, the costs."""

    target: TargetModel  # one KV cache, reset per generation
    chat: Chat  # prompt encoding
    drafters: dict[str, Drafter] = attrs.field(factory=dict)  # "dflash" / "domino" -> drafter
    cost_override: CostModel | None = None  # prices cost-aware trees instead of this machine's profile
    profile: CostProfile | None = None  # this machine's, measured (or read from the cache) on first need
    progress: bool = False  # progress bar while the profile is measured

    def decoders(self, methods: Sequence[Method]) -> dict[str, SpeculativeDecoder]:
        """One decoder per method over the shared target (AR: no drafter, no policy)."""
        return {m.name: self._decoder(m) for m in methods}

    def machine_profile(self) -> CostProfile:
        """This machine's cost profile of the target and every loaded drafter."""
        if self.profile is None:
            self.profile = machine_profile(self.target, list(self.drafters.values()), repeats=3,
                                           progress=self.progress)
        return self.profile

    def pricing(self, kind: str) -> tuple[CostModel, float]:
        """(cost model, calibration) a cost-aware policy over the ``kind`` drafter prices trees with."""
        if self.cost_override is not None:
            return self.cost_override, 1.0
        return self.machine_profile().pricing(self.drafters[kind])

    def _decoder(self, method: Method) -> SpeculativeDecoder:
        if method.autoregressive:
            return SpeculativeDecoder(self.target)
        if method.drafter not in self.drafters:
            raise ValueError(f"method {method.name!r} needs a {method.drafter} drafter, and none was loaded")
        drafter = self.drafters[method.drafter]
        if not getattr(policy_class(method.policy), "uses_cost_model", False):
            return SpeculativeDecoder(self.target, drafter, build_policy(method))
        return SpeculativeDecoder(self.target, drafter, build_policy(method, *self.pricing(method.drafter)))


def load_harness(model_dir: str | Path, drafter_dirs: dict[str, str | Path], *, dtype: torch.dtype | str = "auto",
                 device: str | torch.device = "cpu", float32_head: bool | None = None) -> Harness:
    """The target, its tokenizer and the drafters ("dflash" / "domino" -> checkpoint), from local files."""
    from transformers import AutoTokenizer

    from treespec.api import load_target

    target = load_target(model_dir, dtype=dtype, device=device, float32_head=float32_head)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    drafters = {kind: _load_drafter(kind, Path(path)) for kind, path in drafter_dirs.items()}
    return Harness(target, Chat(tokenizer), drafters)


def _load_drafter(kind: str, path: Path) -> Drafter:
    from treespec import registry

    if not path.is_dir():
        raise FileNotFoundError(f"no {kind} drafter checkpoint at {path}: pass --{kind} DIR, or leave out the "
                                f"methods that need a {kind} drafter")
    return registry.resolve("drafter", kind).from_pretrained(path)


# ---------------------------------------------------------------------------- losslessness
@attrs.frozen
class Divergence:
    """A response that differs from AR's, with AR's decision margin where it first does."""

    method: str  # the diverging method
    dataset: str
    prompt_id: str
    turn: int
    temperature: float
    position: int  # index of the first differing generated token
    ar_token: int | None  # AR's token there (None: AR's answer ended before)
    method_token: int | None  # the method's token there (None: its answer ended before)
    gap: float  # AR's decision margin at that position (`decision_gap`, logit units)
    tolerance: float  # the stated tolerance the gap is judged against

    @property
    def acceptable(self) -> bool:
        return self.gap <= self.tolerance

    def describe(self) -> str:
        verdict = "within tolerance" if self.acceptable else "BEYOND TOLERANCE: not lossless"
        return (f"{self.method} {self.dataset}/{self.prompt_id} turn {self.turn} T={self.temperature:g}: first "
                f"difference at token {self.position} (AR {self.ar_token}, {self.method} {self.method_token}); "
                f"AR top-two gap {self.gap:.3g} vs tolerance {self.tolerance:g}: {verdict}")


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token lists differ (a length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decision_gap(target: TargetModel, ids: torch.Tensor, temperature: float, seed: int) -> float:
    """Top-1 minus top-2 of the scores the target's token after ``ids`` [P] is chosen by, in logit units.

    One fresh forward.  T = 0: the logits.  T > 0: T * (logits / T + G) = logits + T * G, with G the
    position-keyed Gumbel noise of that position under ``seed`` (Gumbel-max picks the argmax of
    logits / T + G); scaling by T keeps one rounding tolerance valid at every temperature.
    """
    logits = target.prefill(ids).logits[-1:]  # [1, V]
    scores = logits.double()
    if temperature > 0:
        generator = torch.Generator().manual_seed(seed)
        sampling = SamplingParams(temperature, key=sampling_key(generator))  # the key the decoder drew
        noise = gumbel_noise(torch.tensor([ids.numel()]), logits.shape[-1], sampling, generator, logits.device,
                             work_dtype(logits))  # [1, V], the noise of the token's absolute position
        scores = (logits.to(noise.dtype) / temperature + noise).double() * temperature
    top = scores[0].topk(2).values
    return float(top[0] - top[1])


def resolve_tolerance(config: BenchConfig, dtype: torch.dtype) -> float:
    """The config's gap tolerance, else the stated default for the target's dtype."""
    return config.gap_tolerance if config.gap_tolerance is not None else GAP_TOLERANCE.get(dtype, 0.0)


def find_divergence(target: TargetModel, prompt: torch.Tensor, ar: BenchRecord, rec: BenchRecord,
                    tolerance: float) -> Divergence | None:
    """The `Divergence` of ``rec`` from the AR record of the same turn (``prompt`` [P] its ids), or None."""
    k = first_difference(ar.tokens, rec.tokens)
    if k is None:
        return None
    prefix = torch.cat([prompt.cpu(), torch.tensor(ar.tokens[:k], dtype=torch.int64)])
    return Divergence(rec.method, rec.dataset, rec.prompt_id, rec.turn, rec.temperature, k, _token_at(ar.tokens, k),
                      _token_at(rec.tokens, k), decision_gap(target, prefix, rec.temperature, rec.seed), tolerance)


def _token_at(tokens: Sequence[int], k: int) -> int | None:
    return tokens[k] if k < len(tokens) else None


def read_divergences(path: Path) -> list[Divergence]:
    if not path.is_file():
        return []
    with open(path) as fh:
        return [Divergence(**json.loads(line)) for line in fh if line.strip()]


def _write_jsonl(fh, rows: Iterable) -> None:
    for row in rows:
        fh.write(json.dumps(attrs.asdict(row), sort_keys=True) + "\n")
    fh.flush()


# ---------------------------------------------------------------------------- the run
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


def shard_paths(out_dir: Path, rank: int) -> tuple[Path, Path]:
    return out_dir / f"records-rank{rank}.jsonl", out_dir / f"divergences-rank{rank}.jsonl"


def bench_prompts(config: BenchConfig) -> list[PromptRecord]:
    """Every measured prompt, dataset by dataset, each dataset shuffled with the run's seed."""
    return [p for name in config.datasets for p in load_prompts(name, seed=config.seed, limit=config.prompts)]


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
    runner = _Runner(config, harness, methods)
    if todo:
        runner.warm_up(todo[0][0])
    total = sum(len(p.turns) for p, _ in todo)
    with open(rec_path, "a") as rec_fh, open(div_path, "a") as div_fh, \
            tqdm(total=total, disable=not progress, unit="turn", desc=f"bench rank {shard.rank}") as bar:
        for prompt, temperature in todo:
            finished = list(runner.conversation(prompt, temperature))  # a conversation is the unit of resumption
            for records, divergences in finished:
                _write_jsonl(div_fh, divergences)  # divergences first: a conversation counts once its records do
                _write_jsonl(rec_fh, records)
                bar.update(1)
    for line in runner.skipped:
        print(f"treespec bench: skipped (context window) {line}", file=sys.stderr)
    return rec_path


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


# ---------------------------------------------------------------------------- merge
def _rank_of(path: Path) -> int:
    return int(re.search(r"rank(\d+)", path.name).group(1))


def _shards(out_dir: Path, stem: str) -> list[Path]:
    return sorted(out_dir.glob(f"{stem}-rank*.jsonl"), key=_rank_of)


def _check_unique(records: Sequence[BenchRecord]) -> None:
    seen = set()
    for r in records:
        key = (r.method, *r.key)
        if key in seen:
            raise ValueError(f"duplicate record {key} while merging: shards of different runs in one folder?")
        seen.add(key)


def merge_shards(out_dir: str | Path) -> Path:
    """Concatenate ``records-rank*.jsonl`` (and divergences) in canonical order; the shards are removed."""
    out_dir = Path(out_dir)
    shards = _shards(out_dir, "records")
    if not shards:
        raise FileNotFoundError(f"no records-rank*.jsonl shards in {out_dir} to merge")
    records = sorted(read_records(*shards), key=canonical_key)
    _check_unique(records)
    found = (d for path in _shards(out_dir, "divergences") for d in read_divergences(path))
    divergences = sorted(found, key=canonical_key)
    write_records(out_dir / RECORDS, records)
    with open(out_dir / DIVERGENCES, "w") as fh:
        _write_jsonl(fh, divergences)
    for path in shards + _shards(out_dir, "divergences"):
        path.unlink()
    return out_dir / RECORDS


# ---------------------------------------------------------------------------- report
@attrs.frozen
class Report:
    """What `write_report` wrote, and the losslessness verdict."""

    files: tuple[Path, ...]  # every derived file
    table: str  # summary.md's text
    lossless: str  # lossless.md's text
    unacceptable: int  # divergences from AR beyond tolerance (or with no measured gap)


def _ar_index(records: Sequence[BenchRecord]) -> dict[tuple, BenchRecord]:
    return {r.key: r for r in records if r.method == AR}


_LOSSLESS_INTRO = (
    "Every method's output must equal AR's: at T = 0, and at T > 0 too (position-keyed sampling, paired "
    "seeds). In float64 exactly; in float32 / bf16 a divergence is acceptable only where AR's decision "
    "margin at the first differing token (top-two gap of the logits, at T > 0 of logits + T x Gumbel "
    "noise) is within the stated tolerance.")


def _lossless_section(temperature: float, compared: Sequence[BenchRecord], ar: dict[tuple, BenchRecord],
                      measured: dict[tuple, Divergence]) -> tuple[list[str], int]:
    """Markdown lines listing every response of one temperature that differs from AR's; unacceptable count."""
    lines, bad = [f"### T = {temperature:g}", ""], 0
    differing = [r for r in compared if r.hash != ar[r.key].hash]
    for r in differing:
        d = measured.get((r.method, *r.key))
        bad += d is None or not d.acceptable
        unmeasured = f"{r.method} {r.dataset}/{r.prompt_id} turn {r.turn}: differs from AR, gap not measured"
        lines.append(f"- {d.describe() if d else unmeasured}")
    lines += [""] if differing else []
    count = f"{len(differing)} of {len(compared)} responses differ from AR's; "
    lines += [count + f"{len(differing) - bad} within the stated tolerance, {bad} not.", ""]
    return lines, bad


def _lossless_text(records: Sequence[BenchRecord], divergences: Sequence[Divergence]) -> tuple[str, int]:
    """Markdown of the check against AR per temperature, and the count of unacceptable divergences."""
    ar = _ar_index(records)
    measured = {(d.method, d.dataset, d.temperature, d.prompt_id, d.turn): d for d in divergences}
    lines, bad = ["## Losslessness: equality with AR", "", _LOSSLESS_INTRO, ""], 0
    for temperature in sorted({r.temperature for r in records}):
        compared = [r for r in records if r.temperature == temperature and r.method != AR and r.key in ar]
        section, n_bad = _lossless_section(temperature, compared, ar, measured)
        lines, bad = lines + section, bad + n_bad
    return "\n".join(lines), bad


def write_report(out_dir: str | Path, *, resamples: int = 1000) -> Report:
    """Derive the tables and plots from ``records.jsonl`` (+ ``divergences.jsonl``), byte for byte."""
    out_dir = Path(out_dir)
    if not (out_dir / RECORDS).is_file():
        hint = " (run `treespec bench merge` first)" if _shards(out_dir, "records") else ""
        raise FileNotFoundError(f"no {RECORDS} in {out_dir}{hint}")
    records = list(read_records(out_dir / RECORDS))
    if not records:
        raise ValueError(f"{out_dir / RECORDS} holds no records")
    summaries = summarize(records, resamples=resamples)
    table = markdown_table(summaries)
    lossless, bad = _lossless_text(records, read_divergences(out_dir / DIVERGENCES))
    write_csv(summaries, out_dir / "summary.csv")
    write_csv(compare_pairs(records, resamples=resamples), out_dir / "pairs.csv")
    (out_dir / "summary.md").write_text(table)
    (out_dir / "lossless.md").write_text(lossless)
    plots = [plot_tau_histograms(records, out_dir / f"tau_hist.{ext}") for ext in ("svg", "png")]
    plots += [plot_budget_curves(summaries, out_dir / f"budget_curves.{ext}") for ext in ("svg", "png")]
    names = ("summary.csv", "pairs.csv", "summary.md", "lossless.md")
    return Report(tuple(out_dir / n for n in names) + tuple(plots), table, lossless, bad)


def run_settings(config: BenchConfig, methods: Sequence[Method], extra: dict) -> dict:
    """What a run measures, as JSON-ready data: the config, the expanded methods and ``extra``."""
    settings = attrs.asdict(config) | {"expanded_methods": [m.name for m in methods]} | extra
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def write_settings(out_dir: Path, settings: dict) -> Path:
    """``bench.json``: the run's settings (the report does not read them; a resumed run checks them)."""
    (out_dir / SETTINGS).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return out_dir / SETTINGS


_RESULTS = (RECORDS, DIVERGENCES, "summary.csv", "pairs.csv", "summary.md", "lossless.md", "tau_hist.svg",
            "tau_hist.png", "budget_curves.svg", "budget_curves.png")


def prepare_out(out_dir: Path, settings: dict, *, overwrite: bool = False) -> str:
    """Check ``out_dir`` against this run's ``settings`` before anything is measured.

    Returns "new" (nothing there), "resume" (the same configuration: completed conversations are
    kept) or "overwrite" (another configuration's results removed, as asked); raises ValueError for
    another configuration's results without ``overwrite``.  A merged single-process run is turned
    back into its shard so it can be resumed or extended.
    """
    results = [out_dir / n for n in _RESULTS if (out_dir / n).exists()] + _shards(out_dir, "records") + \
        _shards(out_dir, "divergences")
    if not results:
        return "new"
    previous = _read_settings(out_dir)
    if previous == settings:
        if (out_dir / RECORDS).is_file() and not _shards(out_dir, "records"):
            (out_dir / RECORDS).replace(shard_paths(out_dir, 0)[0])
            if (out_dir / DIVERGENCES).is_file():
                (out_dir / DIVERGENCES).replace(shard_paths(out_dir, 0)[1])
        return "resume"
    if not overwrite:
        differ = sorted(k for k in set(settings) | set(previous or {}) if (previous or {}).get(k) != settings.get(k))
        what = f"differs in {', '.join(differ)}" if previous is not None else "has no bench.json"
        raise ValueError(f"{out_dir} holds the results of another bench configuration ({what}); choose another "
                         "--out, or pass --overwrite to replace them")
    for path in results:
        path.unlink()
    return "overwrite"


def _read_settings(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / SETTINGS).read_text())
    except (OSError, ValueError):
        return None
