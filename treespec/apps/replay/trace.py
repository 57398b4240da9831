"""The trace format: trajectories and drafter records in one safetensors file, and joining traces.

Contract
--------
A `Trace` holds, per prompt, the trajectory (prompt and greedy tokens) and, per drafter kind, a
`DrafterRecord`: the kept marginal tokens of every anchor and, for a `RecordableScorer`, a
`ScorerRecord` (its per-round tensors stacked, and what the rounds share).  `Trace.save` writes one
safetensors file whose header carries the JSON metadata (`Trace.meta`) and a sha256 digest of each
tensor (its dtype, shape and bytes); `Trace.load` reads it back, names what is wrong with a file that
is not a trace of this version, checks every tensor against its digest (a trace written before the
digests loads with one line saying it cannot be checked) and the tensors against each other and the
metadata (token ids inside the vocabulary, counts and lengths that add up, a scorer's own record
through `RecordableScorer.check_record`), so a damaged file is refused in one line naming it and
what failed instead of failing deep inside a replay.  No pickles.
`merge_traces` joins traces recorded prompt by prompt (the recording's resumable parts);
`check_paired` refuses to pair two traces unless they hold the same prompts and target answers.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import torch

from treespec import registry
from treespec.interfaces import RecordableScorer

logger = logging.getLogger(__name__)  # one line per event; the CLI shows them as "treespec: ..."

__all__ = ["DIGESTS_KEY", "FORMAT", "META_KEY", "VERSION", "DrafterRecord", "ScorerRecord", "Trace", "TraceError",
           "check_paired", "merge_traces", "scorer_class", "tensor_digest"]

FORMAT, VERSION = "treespec-trace", 2
META_KEY = "treespec_trace"  # safetensors header entry holding the JSON metadata
DIGESTS_KEY = "treespec_digests"  # header entry holding {tensor name: `tensor_digest`}


class TraceError(ValueError):
    """A trace file that cannot be read, or a replay the trace cannot answer exactly."""


@attrs.frozen(eq=False)
class ScorerRecord:
    """A `RecordableScorer`'s tensors at every anchor of one drafter, and what they share."""

    rounds: dict[str, torch.Tensor]  # name -> [R, ...]: `RecordableScorer.record_round`, stacked anchor by anchor
    shared: dict[str, torch.Tensor]  # name -> tensor: `RecordableScorer.record_shared`


@attrs.frozen(eq=False)
class DrafterRecord:
    """One drafter's outputs at every anchor; anchors are numbered prompt by prompt, step by step."""

    counts: torch.Tensor  # [R, L] int64 marginal tokens kept per anchor and depth
    tokens: torch.Tensor  # [T] int32 the kept tokens, anchor by anchor, depth by depth, best first
    logprobs: torch.Tensor  # [T] float32 their log-probs
    scorer: ScorerRecord | None = None  # Domino drafters only


@attrs.frozen(eq=False)
class Trace:
    """Trajectories and drafter records of a set of prompts (see the module docstring)."""

    meta: dict  # JSON metadata: format, config, target, prompts, drafters
    sequences: tuple[torch.Tensor, ...]  # per prompt [P + N] int64: the prompt, then N greedy tokens
    drafters: dict[str, DrafterRecord]  # drafter kind ("dflash", "domino") -> its record
    checked: bool = False  # loaded from a file whose every tensor matched its digest

    @property
    def max_new_tokens(self) -> int:
        return int(self.meta["config"]["max_new_tokens"])

    @property
    def num_prompts(self) -> int:
        return len(self.sequences)

    def prompt_len(self, prompt: int) -> int:
        return int(self.meta["prompts"][prompt]["prompt_len"])

    def anchor_index(self, prompt: int, committed: int) -> int:
        """Row of the anchor reached after ``committed`` generated tokens of ``prompt``."""
        return prompt * self.max_new_tokens + committed

    def save(self, path: str | Path) -> Path:
        """Write one safetensors file (metadata as JSON in its header)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = _flatten(self)
        digests = {name: tensor_digest(t) for name, t in tensors.items()}
        save_file(tensors, str(path), metadata={META_KEY: json.dumps(self.meta), DIGESTS_KEY: json.dumps(digests)})
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace written by `save`; `TraceError` names what is wrong with the file."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:
                header = handle.metadata() or {}
                names = handle.keys()
                tensors = {key: handle.get_tensor(key) for key in names}
        except Exception as exc:  # safetensors raises its own error types for a file that is not one
            raise TraceError(f"cannot read trace {path}: not a treespec trace file ({exc})") from None
        meta = _read_meta(header, path)
        checked = _check_digests(header, tensors, path)
        trace = attrs.evolve(_unflatten(meta, tensors, path), checked=checked)
        broken = _broken_ranges(trace)
        if broken is not None:
            raise TraceError(f"{path}: {broken}; the trace is damaged")
        return trace


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes."""
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    head = f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}".encode()
    return hashlib.sha256(head + data).hexdigest()


def _check_digests(header: Mapping[str, str], tensors: Mapping[str, torch.Tensor], path) -> bool:
    """True when every tensor matches its digest; False (said in one line) for a trace written without
    digests; a `TraceError` naming the first tensor that does not match."""
    if DIGESTS_KEY not in header:
        logger.warning(f"{path} was recorded without digests: its data cannot be checked")
        return False
    try:
        digests = json.loads(header[DIGESTS_KEY])
    except json.JSONDecodeError:
        raise TraceError(f"{path}: its digest header is not JSON; the trace is damaged") from None
    if not isinstance(digests, dict) or set(digests) != set(tensors):
        raise TraceError(f"{path}: its digests do not list the tensors it holds; the trace is damaged")
    for name in sorted(tensors):
        if tensor_digest(tensors[name]) != digests[name]:
            raise TraceError(f"{path}: tensor {name!r} does not match its digest; the trace is damaged")
    return True


def _outside(ids: torch.Tensor, vocab: int) -> bool:
    return ids.numel() > 0 and bool((ids.min() < 0) | (ids.max() >= vocab))


def _broken_ranges(trace: Trace) -> str | None:
    """What in ``trace``'s tensors disagrees with its metadata or with each other, or None."""
    meta, vocab = trace.meta, int(trace.meta["target"]["vocab_size"])
    if len(trace.sequences) != len(meta["prompts"]):
        return f"{len(trace.sequences)} trajectories for {len(meta['prompts'])} prompts"
    for i, sequence in enumerate(trace.sequences):
        if sequence.numel() <= trace.prompt_len(i) or _outside(sequence, vocab):
            return f"trajectory {i} is shorter than its prompt or holds a token id outside the vocabulary ({vocab})"
    for kind, record in trace.drafters.items():
        info = meta["drafters"][kind]
        if record.counts.dim() != 2 or record.counts.shape[1] != int(info["depth"]) or bool((record.counts < 0).any()):
            return f"the {kind} drafter's counts are not [anchors, {info['depth']}] of counts >= 0"
        kept = int(record.counts.sum())
        if not kept == record.tokens.numel() == record.logprobs.numel():
            return (f"the {kind} drafter's counts add up to {kept} tokens but it holds {record.tokens.numel()} tokens "
                    f"and {record.logprobs.numel()} log-probs")
        if _outside(record.tokens, int(info["vocab_size"])):
            return f"the {kind} drafter holds a token id outside its vocabulary ({info['vocab_size']})"
        if bool(record.logprobs.isnan().any() | (record.logprobs > 1e-3).any()):
            return f"the {kind} drafter holds a log-probability that is NaN or above 0"
        if record.scorer is not None:
            broken = scorer_class(info["scorer"]["kind"]).check_record(
                record.scorer.rounds, record.scorer.shared, info["scorer"], int(info["vocab_size"]))
            if broken is not None:
                return f"the {kind} drafter's scorer record: {broken}"
    return None


def _read_meta(header: Mapping[str, str], path) -> dict:
    if META_KEY not in header:
        raise TraceError(f"{path} is a safetensors file but not a treespec trace (no {META_KEY!r} header entry)")
    meta = json.loads(header[META_KEY])
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise TraceError(f"{path}: trace format {meta.get('format')!r} version {meta.get('version')!r}; "
                         f"this treespec reads {FORMAT!r} version {VERSION}")
    return meta


def _flatten(trace: Trace) -> dict[str, torch.Tensor]:
    out = {"trajectory.tokens": torch.cat(trace.sequences),
           "trajectory.lengths": torch.tensor([s.numel() for s in trace.sequences], dtype=torch.int64)}
    for kind, rec in trace.drafters.items():
        out |= {f"{kind}.counts": rec.counts, f"{kind}.tokens": rec.tokens, f"{kind}.logprobs": rec.logprobs}
        if rec.scorer is not None:
            out |= {f"{kind}.scorer.round.{name}": value for name, value in rec.scorer.rounds.items()}
            out |= {f"{kind}.scorer.shared.{name}": value for name, value in rec.scorer.shared.items()}
    return {key: value.contiguous() for key, value in out.items()}


def _unflatten(meta: dict, tensors: dict[str, torch.Tensor], path: object = "the trace") -> Trace:
    needed = ["trajectory.tokens", "trajectory.lengths"] + [f"{kind}.{name}" for kind in meta["drafters"]
                                                            for name in ("counts", "tokens", "logprobs")]
    missing = [name for name in needed if name not in tensors]
    if missing:
        raise TraceError(f"{path}: it lacks the tensor(s) {', '.join(missing)}; the trace is damaged")
    lengths = tensors["trajectory.lengths"]
    if lengths.dim() != 1 or bool((lengths < 0).any()) or int(lengths.sum()) != tensors["trajectory.tokens"].numel():
        raise TraceError(f"{path}: its trajectory lengths do not add up to its tokens; the trace is damaged")
    sequences = tuple(tensors["trajectory.tokens"].split(lengths.tolist()))
    drafters = {}
    for kind, info in meta["drafters"].items():
        scorer = None
        if info["scorer"] is not None:
            scorer = ScorerRecord(_with_prefix(tensors, f"{kind}.scorer.round."), _with_prefix(tensors, f"{kind}.scorer.shared."))
        drafters[kind] = DrafterRecord(tensors[f"{kind}.counts"], tensors[f"{kind}.tokens"],
                                       tensors[f"{kind}.logprobs"], scorer)
    return Trace(meta, sequences, drafters)


def _with_prefix(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {key.removeprefix(prefix): value for key, value in tensors.items() if key.startswith(prefix)}


def merge_traces(traces: Sequence[Trace]) -> Trace:
    """One trace of the prompts of ``traces`` in order (same config, target and drafters)."""
    if not traces:
        raise TraceError("no traces to merge")
    first = traces[0]
    for other in traces[1:]:
        for field in ("config", "target", "drafters"):
            if other.meta[field] != first.meta[field]:
                raise TraceError(f"cannot merge traces recorded with other {field}")
    meta = {k: v for k, v in first.meta.items() if k != "part"}
    meta["prompts"] = [p for t in traces for p in t.meta["prompts"]]
    drafters = {kind: _merge_records([t.drafters[kind] for t in traces], first.meta["drafters"][kind])
                for kind in first.drafters}
    return Trace(meta, tuple(s for t in traces for s in t.sequences), drafters)


def check_paired(trace: Trace, other: Trace, label: str = "the other trace") -> None:
    """Raise `TraceError` unless ``other`` holds the same prompts, target and target answers as ``trace``.

    Two such traces differ only in their drafters, so a method replayed from each is paired prompt by
    prompt.  The target's answers are compared token for token: a trace recorded with another dtype
    or on another CPU can follow another greedy path, and is then refused rather than mispaired.
    """
    if other.meta["target"] != trace.meta["target"]:
        raise TraceError(f"{label} was recorded with another target ({other.meta['target']} against "
                         f"{trace.meta['target']})")
    if other.max_new_tokens != trace.max_new_tokens:
        raise TraceError(f"{label} follows {other.max_new_tokens} target tokens per prompt, this one "
                         f"{trace.max_new_tokens}; record both with the same --max-new-tokens")
    ids, theirs = [p["id"] for p in trace.meta["prompts"]], [p["id"] for p in other.meta["prompts"]]
    if ids != theirs:
        raise TraceError(f"{label} holds other prompts ({len(theirs)} against {len(ids)}, or in another order); "
                         "record both with the same --dataset, --limit and --seed")
    differ = [ids[i] for i, (a, b) in enumerate(zip(trace.sequences, other.sequences)) if not torch.equal(a, b)]
    if differ:
        raise TraceError(f"the target's answers differ from {label}'s on {len(differ)} prompt(s), first "
                         f"{differ[0]} (another dtype or machine); record both on one machine with one --dtype")


def _merge_records(records: Sequence[DrafterRecord], meta: dict) -> DrafterRecord:
    scorers = [r.scorer for r in records]
    scorer = None if scorers[0] is None else _merge_scorers(scorers, meta["scorer"]["kind"])
    return DrafterRecord(torch.cat([r.counts for r in records]), torch.cat([r.tokens for r in records]),
                         torch.cat([r.logprobs for r in records]), scorer)


def _merge_scorers(scorers: Sequence[ScorerRecord], kind: str) -> ScorerRecord:
    """Anchors concatenated; the shared tensors joined by the scorer class itself."""
    rounds = {name: torch.cat([s.rounds[name] for s in scorers]) for name in scorers[0].rounds}
    return ScorerRecord(rounds, scorer_class(kind).merge_shared([s.shared for s in scorers]))


def scorer_class(kind: str) -> type[RecordableScorer]:
    """The `RecordableScorer` class registered as ``kind`` (registry kind "scorer")."""
    try:
        return registry.resolve("scorer", kind)
    except registry.RegistryError as exc:
        raise TraceError(f"the trace holds a {kind!r} scorer record, which no registered scorer reads ({exc})") from None
