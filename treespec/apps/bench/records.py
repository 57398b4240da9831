"""Raw benchmark records: one JSON line per (method, config, prompt turn).

Contract: records are the single source of truth of a bench run; every table and plot is derived
from them, byte for byte reproducibly.  A record holds the generated tokens and a hash of them, so
losslessness (equality with the autoregressive output) is checkable offline; the run that measured
it (``run``), so a report can say when a cell pools runs measured under different conditions; the
threads it ran with and what other processes took meanwhile (``threads``, ``load``), so a turn another
process disturbed is left out of speedups (`BenchRecord.disturbed`); and,
for a cost-aware method, the cost curve each round was priced with (``cost_models`` and
``cost_rounds``; `priced_rounds` gives one model per round; a round calibrated live stores its
calibration beside the curve, under ``"calibration"``), so a replay can build its trees again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs

from treespec.apps.assembly.methods import method_name
from treespec.pricing.conditions import Load

__all__ = ["BenchRecord", "cost_schedule", "output_hash", "read_records", "write_records"]


def output_hash(tokens: Iterable[int]) -> str:
    """Short stable hash of a token sequence."""
    data = ",".join(str(int(t)) for t in tokens).encode()
    return hashlib.sha256(data).hexdigest()[:16]


@attrs.frozen
class BenchRecord:
    """One measured response."""

    method: str  # display name, e.g. "ddtree@16" or "ar"
    policy: str  # registry name of the policy ("ar" for autoregressive)
    budget: int  # tree budget B (0 for AR)
    temperature: float  # sampling temperature
    dataset: str  # benchmark name
    prompt_id: str  # prompt identifier within the dataset
    turn: int  # 0-based turn (MT-Bench has two, measured separately)
    seed: int  # seed of the sampling stream (shared by every method: paired)
    tokens: list[int]  # generated tokens
    taus: list[int]  # acceptance length per round
    decode_time: float  # seconds, prefill excluded
    prefill_time: float  # seconds
    stage_times: dict[str, float]  # seconds per stage, summed over rounds
    hash: str = ""  # output_hash(tokens); filled in when empty
    batch_size: int = 1  # sequences decoded together (> 1: the times are this response's share of its batch's)
    run: str = ""  # the bench invocation that measured it (a resumed output folder holds several)
    options: dict = attrs.field(factory=dict)  # the policy options of the method (``eagle2@16+topk=4``: topk 4)
    verifier: str = "match"  # the verifier that checked the method's trees
    drafter: str | None = None  # the registered drafter it ran over (None: AR, or a record made before it was kept)
    cost_models: list[dict] = attrs.field(factory=list)  # the distinct curves (and live calibrations) it priced with
    cost_rounds: list[int] = attrs.field(factory=list)  # per round: index into cost_models (-1: not priced)
    threads: int = 0  # torch intra-op threads it ran with (0: a record made before they were kept)
    load: dict = attrs.field(factory=dict)  # what other processes took meanwhile (`Load.to_record`; empty: unknown)
    decisions: dict = attrs.field(factory=dict)  # what its decoder chose (`decisions_of`; empty: AR or older)

    def __attrs_post_init__(self) -> None:
        if not self.hash:
            object.__setattr__(self, "hash", output_hash(self.tokens))

    @property
    def key(self) -> tuple[str, float, str, int]:
        """What pairs records across methods: dataset, temperature, prompt, turn."""
        return (self.dataset, self.temperature, self.prompt_id, self.turn)

    @property
    def family(self) -> str:
        """The method's name with its budget taken out (`treespec.apps.assembly.methods.method_name` of the
        record's fields): the line of a budget curve, options, drafters and verifiers kept apart."""
        policy = None if self.policy == "ar" else self.policy
        return method_name(policy, self.drafter, None, self.options, self.verifier)

    @property
    def disturbed(self) -> bool:
        """Whether other processes competed for its cores while it ran (`treespec.pricing.conditions`):
        its time does not say what the method costs, and speedups leave its turn out."""
        return bool(self.load) and Load(**self.load).disturbed

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def mean_tau(self) -> float:
        return sum(self.taus) / len(self.taus) if self.taus else 0.0

    def priced_rounds(self) -> list[dict | None]:
        """Per round, the cost model (its `CostModel.to_dict` form) it was priced with, None if none."""
        return [self.cost_models[i] if i >= 0 else None for i in self.cost_rounds]


def decisions_of(stats) -> dict:
    """What a generation's decoder chose, from its `GenerationStats`: rounds that drafted, AR rounds (no
    draft: the controller's, or a generation decoded without drafting), explorations, the tree tokens
    verified over the drafted rounds, and whether the controller declined the generation."""
    drafted = [r for r in stats.rounds if r.drafted]
    return {"drafted": len(drafted), "ar": len(stats.rounds) - len(drafted),
            "explored": sum(r.explored for r in stats.rounds), "tree_tokens": sum(r.tree_size for r in drafted),
            "undrafted": bool(stats.undrafted)}


def cost_schedule(rounds) -> tuple[list[dict], list[int]]:
    """(distinct cost models, per-round index or -1) of a generation's `RoundStats` list."""
    models: list[dict] = []
    index = []
    for r in rounds:
        if r.priced_with is None:
            index.append(-1)
            continue
        model = r.priced_with.to_dict()
        if r.calibrated_with is not None:
            model["calibration"] = r.calibrated_with.to_record()
        if model not in models:
            models.append(model)
        index.append(models.index(model))
    return models, index


def write_records(path: str | Path, records: Iterable[BenchRecord], *, append: bool = False) -> None:
    """Write records as JSON lines with sorted keys."""
    with open(path, "a" if append else "w") as fh:
        for r in records:
            fh.write(json.dumps(attrs.asdict(r), sort_keys=True) + "\n")


def read_records(*paths: str | Path) -> Iterator[BenchRecord]:
    """Read the records of one or more JSONL files (e.g. shards to merge), in file order."""
    for path in paths:
        with open(path) as fh:
            for n, line in enumerate(fh, start=1):
                if line.strip():
                    try:
                        yield BenchRecord(**json.loads(line))
                    except (TypeError, json.JSONDecodeError) as exc:
                        raise ValueError(f"{path}:{n}: malformed bench record: {exc}") from exc
