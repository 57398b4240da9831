"""Offline trace replay: record what the drafters produce along the target's greedy trajectory once,
then measure any tree policy's T = 0 acceptance lengths from the recording, without the target.

Contract
--------
Recording (`record_trace`).  For each prompt the target decodes ``max_new_tokens`` tokens greedily
in the live harness (`SpeculativeDecoder` with a root-only tree every round: autoregressive
decoding, no stop tokens), and every drafter drafts at every anchor the live decoder could land on:
the prompt's last token, then each generated token but the last.  Each draft gets the
`DraftContext` the live loop builds (the committed tokens up to the anchor, the taps of the tokens
committed since its previous draft).  Per anchor and drafter the trace keeps

* the marginals: for every depth the best tokens of ``DraftOutput.logprobs`` (value descending,
  ties by token id) -- at least ``min_k`` of them, and every token that can enter a best-first tree
  over the marginals with up to ``max_budget`` nodes (all V of them when ``max_budget >= V``);
* for a Domino drafter (`DominoScorer`): the drafted rows z [L, H], the top-``top_m`` base logits of
  every depth and the top-``top_m`` base log-probs of the pure-draft depths; once per drafter, the
  correction head's weights and the GRU input row (W_ih e(t) from the drafter's table, or e(t)
  when it has none) of every token a replayed scorer can read;

and, per prompt, the trajectory (prompt and generated tokens).  A trace is one safetensors file
whose header carries the JSON metadata (`Trace.meta`); no pickles.

Replay (`replay_prompt`, `evaluate`).  Walk each trajectory as the live loop does: with c tokens
committed the anchor is trajectory token P - 1 + c; rebuild its `DraftOutput` (marginal entries
outside the recorded tokens are -inf; the scorer reads recorded rows only, NaN elsewhere), build
the policy's tree, prune it to the depth still usable (as the decoder does), and take tau = 1 +
the depth reached by the match verifier's walk with the trajectory as the target's tokens.
Commit tau tokens; stop after ``max_new_tokens`` or at a stop token when given (the trajectory runs
on past stop tokens, so tau counts what the live verifier would accept).

Exactness.  A rebuilt draft gives the live draft's tree bit for bit for best-first policies over
the marginals (DDTree, CaDDTree, the chain) with budget <= ``max_budget``, for the scorer policies
(Chain, DominoTree, static-corrected over a Domino draft) with ``top_m`` <= the recorded one, and
for any policy that reads only the top ``min_k`` tokens of each depth.  Replay refuses budgets and
top-M beyond those, and fails on a tree holding an unrecorded token (a -inf score, or NaN from an
unrecorded scorer row).  Replayed tau equals live tau when the live drafts and target tokens equal
the recorded ones; in floating point the live taps differ from the recorded ones by the rounding of
a tree forward against a one-token step, so float64 runs agree exactly and low-precision runs
nearly always (benchmarks/bench_replay.py reports the agreement).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import attrs
import torch
from torch import nn

from treespec import registry
from treespec.cost import CostModel, cost_model_from_dict
from treespec.decoding import DRAFT_BACKOFF, DraftGate, SpeculativeDecoder, limit_depth
from treespec.interfaces import DraftContext, Drafter, DraftOutput, TreePolicy
from treespec.methods import Method, build_policy, parse_method
from treespec.profile import machine_profile
from treespec.reach import best_chain, reachable
from treespec.target import TargetModel
from treespec.topk import exact_topk
from treespec.tree import DraftTree

__all__ = [
    "RECORD_PRESETS", "DrafterRecord", "RecordConfig", "ReplayDrafts", "ReplayResult", "ScorerRecord", "Trace",
    "TraceError", "accepted_length", "check_replayable", "evaluate", "merge_traces", "record_trace", "replay_prompt",
]

FORMAT, VERSION = "treespec-trace", 1
META_KEY = "treespec_trace"  # safetensors header entry holding the JSON metadata
_HEAD_KEYS = ("prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight")


class TraceError(ValueError):
    """A trace file that cannot be read, or a replay the trace cannot answer exactly."""


def _positive(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an integer >= 1, got {value!r}")


@attrs.frozen
class RecordConfig:
    """What a recording keeps; it bounds which policies replay exactly (module docstring)."""

    max_new_tokens: int = attrs.field(default=128, validator=_positive)  # greedy tokens generated per prompt
    max_budget: int = attrs.field(default=1024, validator=_positive)  # marginal best-first budgets replayable up to this
    min_k: int = attrs.field(default=64, validator=_positive)  # marginal tokens kept per depth at least
    top_m: int = attrs.field(default=64, validator=_positive)  # scorer candidates kept per depth (largest top_m)


RECORD_PRESETS: dict[str, RecordConfig] = {
    "default": RecordConfig(),
    "quick": RecordConfig(max_new_tokens=64, max_budget=256, min_k=16),  # small traces for the demo methods
    "wide": RecordConfig(max_budget=4096, min_k=256, top_m=256),  # large budgets and top-M sweeps
}


# ---------------------------------------------------------------------------- the recording
@attrs.frozen(eq=False)
class ScorerRecord:
    """A Domino scorer's inputs at every anchor of one drafter, and what it shares across anchors."""

    rows: torch.Tensor  # [R, L, H] drafted hidden states z, in the drafter's dtype
    base_tokens: torch.Tensor  # [R, L, M] int32 top-M tokens by base logit (ties: token id)
    base_logits: torch.Tensor  # [R, L, M] float32 their base logits lm_head(z)
    prefix_tokens: torch.Tensor  # [R, p, M] int32 top-M tokens by base log-prob of the p pure-draft depths
    prefix_logprobs: torch.Tensor  # [R, p, M] float32 their log-probs, as the scorer computes them
    input_tokens: torch.Tensor  # [U] int64 every token whose GRU input a replayed scorer can read, ascending
    input_rows: torch.Tensor  # [U, W] W_ih e(t) rows (W = 3G) with a table, else embeddings e(t) (W = H)
    weights: dict[str, torch.Tensor]  # the correction head (_HEAD_KEYS), in the drafter's dtype


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

    def drafts(self, kind: str) -> ReplayDrafts:
        """The draft rebuilder of drafter ``kind`` ("dflash", "domino")."""
        if kind not in self.drafters:
            raise TraceError(f"the trace recorded no {kind} drafter; it has {sorted(self.drafters) or 'none'}")
        return ReplayDrafts(self.drafters[kind], self.meta["drafters"][kind])

    def save(self, path: str | Path) -> Path:
        """Write one safetensors file (metadata as JSON in its header)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(_flatten(self), str(path), metadata={META_KEY: json.dumps(self.meta)})
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
        return _unflatten(_read_meta(header, path), tensors)


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
            fields = attrs.asdict(rec.scorer, recurse=False)
            weights = fields.pop("weights")
            out |= {f"{kind}.scorer.{name}": value for name, value in fields.items()}
            out |= {f"{kind}.scorer.weights.{name}": value for name, value in weights.items()}
    return {key: value.contiguous() for key, value in out.items()}


def _unflatten(meta: dict, tensors: dict[str, torch.Tensor]) -> Trace:
    lengths = tensors["trajectory.lengths"].tolist()
    sequences = tuple(tensors["trajectory.tokens"].split(lengths))
    drafters = {}
    for kind, info in meta["drafters"].items():
        scorer = None
        if info["scorer"] is not None:
            prefix = f"{kind}.scorer."
            fields = {f.name: tensors[prefix + f.name] for f in attrs.fields(ScorerRecord) if f.name != "weights"}
            weights = {name: tensors[f"{prefix}weights.{name}"] for name in _HEAD_KEYS}
            scorer = ScorerRecord(**fields, weights=weights)
        drafters[kind] = DrafterRecord(tensors[f"{kind}.counts"], tensors[f"{kind}.tokens"],
                                       tensors[f"{kind}.logprobs"], scorer)
    return Trace(meta, sequences, drafters)


# ---------------------------------------------------------------------------- recording
def _budget_floor(draft: DraftOutput, budget: int) -> torch.Tensor:
    """Score of DDTree(budget)'s last node; every node of a tree of at most ``budget`` nodes reaches it."""
    marginal = DraftOutput(draft.logprobs, draft.root_token, draft.position)
    tree = registry.create("policy", "ddtree", budget=budget).build(marginal)
    return tree.scores[-1]  # canonical order pops scores in descending order


def _marginal_counts(draft: DraftOutput, config: RecordConfig) -> torch.Tensor:
    """[L] tokens to keep per depth: min_k, or every token that can reach the max_budget tree.

    A node at depth d scores float32(parent + logp) with parent <= the best chain score above it,
    so a token is needed only if float32(chain + logp) reaches the floor (rounding is monotone).
    """
    depth, vocab = draft.logprobs.shape
    if config.max_budget >= vocab:
        return torch.full((depth,), vocab, dtype=torch.int64)
    floor = _budget_floor(draft, config.max_budget)
    reach = reachable(draft.logprobs, best_chain(draft.logprobs.amax(-1)), floor).sum(-1)  # [L]
    return reach.clamp_min(min(config.min_k, vocab)).cpu()


class _Capture:
    """Accumulates one drafter's records, anchor by anchor."""

    def __init__(self, config: RecordConfig) -> None:
        self.config = config
        self.counts: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []
        self.scorer: _ScorerCapture | None = None
        self.depth = self.vocab = None

    def add(self, draft: DraftOutput) -> None:
        self._check_shape(draft)
        counts = _marginal_counts(draft, self.config)
        values, ids = exact_topk(draft.logprobs, int(counts.max()))  # [L, k_max]
        keep = (torch.arange(ids.shape[1]) < counts[:, None]).to(ids.device)  # [L, k_max], row-major = depth order
        self.counts.append(counts)
        self.tokens.append(ids[keep].to(torch.int32).cpu())
        self.logprobs.append(values[keep].cpu())
        if draft.scorer is not None:
            self.scorer = self.scorer or _ScorerCapture(draft, self.config.top_m)
            self.scorer.add(draft)

    def _check_shape(self, draft: DraftOutput) -> None:
        if self.depth is None:
            self.depth, self.vocab = draft.depth, draft.vocab_size
        if (draft.depth, draft.vocab_size) != (self.depth, self.vocab):
            raise TraceError(f"draft shape changed from [{self.depth}, {self.vocab}] to "
                             f"[{draft.depth}, {draft.vocab_size}]; a trace needs a fixed drafted depth")

    def finish(self) -> tuple[DrafterRecord, dict]:
        scorer, scorer_meta = self.scorer.finish() if self.scorer is not None else (None, None)
        record = DrafterRecord(torch.stack(self.counts), torch.cat(self.tokens), torch.cat(self.logprobs), scorer)
        meta = {"depth": self.depth, "vocab_size": self.vocab, "max_budget": self.config.max_budget,
                "min_k": self.config.min_k, "full_rows": self.config.max_budget >= self.vocab, "scorer": scorer_meta}
        return record, meta


class _ScorerCapture:
    """Accumulates a `DominoScorer`'s per-anchor inputs and the token rows its GRU reads."""

    def __init__(self, draft: DraftOutput, top_m: int) -> None:
        # drafters/ is imported only when a scorer is recorded
        from drafters.domino import DominoScorer

        scorer = draft.scorer
        if not isinstance(scorer, DominoScorer):
            raise TraceError(f"cannot record a {type(scorer).__name__}: replay rebuilds DominoScorer only")
        self.top_m = min(top_m, draft.vocab_size)
        self.prefix_len = min(scorer.prefix_len, draft.depth)
        self.source = scorer.gru_table if scorer.gru_table is not None else scorer.embed.weight  # [V, W]
        self.seen = torch.zeros(draft.vocab_size, dtype=torch.bool, device=self.source.device)
        weights = (scorer.w_ih, scorer.w_hh, scorer.embed_proj[0].weight, scorer.w2)
        self.weights = {key: w.detach().cpu().clone() for key, w in zip(_HEAD_KEYS, weights, strict=True)}
        self.table = scorer.gru_table is not None
        self.parts: dict[str, list] = {name: [] for name in ("rows", "base", "prefix")}  # per anchor

    def add(self, draft: DraftOutput) -> None:
        scorer = draft.scorer
        base_values, base_ids = exact_topk(scorer.base_logits, self.top_m)  # [L, M]
        prefix = [scorer.base_logprobs(d) for d in range(self.prefix_len)]
        rows = torch.stack(prefix) if prefix else scorer.base_logits[:0]  # [p, V]
        prefix_values, prefix_ids = exact_topk(rows, self.top_m)  # [p, M]
        self.parts["rows"].append(scorer.rows.detach().cpu().clone())
        self.parts["base"].append((base_ids.to(torch.int32).cpu(), base_values.cpu()))
        self.parts["prefix"].append((prefix_ids.to(torch.int32).cpu(), prefix_values.cpu()))
        for ids in (base_ids, prefix_ids, torch.tensor([scorer.anchor])):
            self.seen[ids.reshape(-1).to(self.seen.device)] = True

    def finish(self) -> tuple[ScorerRecord, dict]:
        tokens = self.seen.nonzero().flatten()  # [U] ascending
        base, prefix = zip(*self.parts["base"], strict=True), zip(*self.parts["prefix"], strict=True)
        (base_ids, base_values), (prefix_ids, prefix_values) = map(torch.stack, base), map(torch.stack, prefix)
        record = ScorerRecord(torch.stack(self.parts["rows"]), base_ids, base_values, prefix_ids, prefix_values,
                              tokens.cpu(), self.source[tokens].detach().cpu().clone(), self.weights)
        meta = {"kind": "domino", "prefix_len": self.prefix_len, "top_m": self.top_m, "gru_table": self.table,
                "dtype": str(record.rows.dtype).removeprefix("torch.")}
        return record, meta


class _RootOnly(TreePolicy):
    """The empty tree every round: the live loop then decodes autoregressively."""

    name = "root-only"

    def build(self, draft: DraftOutput, *, backend: str = "torch") -> DraftTree:
        return DraftTree.root_only(draft.root_token, device=draft.logprobs.device)


class _Recorder(Drafter):
    """Runs every wrapped drafter on the live context of each anchor and captures its output."""

    def __init__(self, drafters: Mapping[str, Drafter], config: RecordConfig) -> None:
        self.drafters = dict(drafters)
        self.tap_layers = tuple(sorted({t for d in self.drafters.values() for t in d.tap_layers}))
        self.captures = {kind: _Capture(config) for kind in self.drafters}
        self.hidden = 0

    def bind(self, target: TargetModel) -> None:
        self.hidden = target.hidden_size
        for drafter in self.drafters.values():
            drafter.bind(target)

    def reset(self) -> None:
        for drafter in self.drafters.values():
            drafter.reset()

    def observe(self, accepted: torch.Tensor) -> None:
        for drafter in self.drafters.values():
            drafter.observe(accepted)

    def draft(self, ctx: DraftContext) -> DraftOutput:
        out = None
        for kind, drafter in self.drafters.items():
            out = drafter.draft(self._context_for(drafter, ctx))
            self.captures[kind].add(out)
        return out

    def _context_for(self, drafter: Drafter, ctx: DraftContext) -> DraftContext:
        """The context the live loop would give ``drafter``: its own taps, in its own order."""
        if ctx.features is None or tuple(drafter.tap_layers) == self.tap_layers:
            return ctx
        h = self.hidden
        cols = torch.cat([torch.arange(self.tap_layers.index(t) * h, (self.tap_layers.index(t) + 1) * h)
                          for t in drafter.tap_layers]).to(ctx.features.device)  # [len(taps) * H]
        return DraftContext(ctx.sequence, ctx.features.index_select(1, cols), ctx.feature_start)


def record_trace(target: TargetModel, drafters: Mapping[str, Drafter], prompts: Sequence[torch.Tensor], *,
                 config: RecordConfig = RECORD_PRESETS["default"], prompt_ids: Sequence[str] | None = None,
                 target_name: str = "", progress: bool = False, parts_dir: str | Path | None = None) -> Trace:
    """Record ``drafters`` (kind -> drafter, e.g. {"dflash": ..., "domino": ...}) along the greedy
    trajectory of ``target`` for each prompt ([P] token ids); see the module docstring.

    ``parts_dir``: record prompt by prompt into one part file each there (written whole, then
    renamed), reuse the parts an interrupted run left (same prompt, settings, target and drafter
    weights, else `TraceError`) and merge them: an interrupted recording resumes.
    """
    if not drafters:
        raise ValueError("record_trace needs at least one drafter")
    prompt_ids = [str(i) for i in range(len(prompts))] if prompt_ids is None else list(prompt_ids)
    if len(prompt_ids) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(prompt_ids)} prompt ids")
    target_meta = {"name": target_name, "vocab_size": target.vocab_size, "max_positions": target.max_positions,
                   "dtype": str(target.dtype).removeprefix("torch.")}
    items = list(zip(prompt_ids, prompts, strict=True))
    if parts_dir is None:
        trace = _record_prompts(target, drafters, items, config, target_meta, progress)
    else:
        identity = {kind: _weights_digest(d) for kind, d in drafters.items()}
        parts = [_part(target, drafters, item, config, target_meta, Path(parts_dir), i, identity)
                 for i, item in enumerate(_progress(items, progress, "record"))]
        trace = merge_traces(parts)
    profile = machine_profile(target, list(drafters.values()))  # what cost-aware policies replay with
    meta = trace.meta | {"cost_models": {kind: profile.cost_model(d).to_dict() for kind, d in drafters.items()},
                         "calibrations": {kind: profile.calibration(d) for kind, d in drafters.items()}}
    return attrs.evolve(trace, meta=meta)


def _record_prompts(target: TargetModel, drafters: Mapping[str, Drafter], items: Sequence[tuple[str, torch.Tensor]],
                    config: RecordConfig, target_meta: dict, progress: bool = False) -> Trace:
    """The trace of ``items`` ((prompt id, prompt) pairs), without cost models."""
    recorder = _Recorder(drafters, config)
    decoder = SpeculativeDecoder(target, recorder, _RootOnly(), draft_backoff=0)  # a draft at every anchor
    sequences = [_record_prompt(decoder, prompt, config.max_new_tokens)
                 for _, prompt in _progress(items, progress, "record")]
    records = {kind: capture.finish() for kind, capture in recorder.captures.items()}
    meta = {"format": FORMAT, "version": VERSION, "config": attrs.asdict(config), "target": target_meta,
            "prompts": [{"id": pid, "prompt_len": int(p.numel())} for pid, p in items],
            "drafters": {kind: meta for kind, (_, meta) in records.items()}}
    return Trace(meta, tuple(sequences), {kind: rec for kind, (rec, _) in records.items()})


def _weights_digest(drafter: Drafter) -> str:
    """sha256 over a drafter's tensors (names, shapes, dtypes and bytes), or its class name."""
    import hashlib

    model = getattr(drafter, "model", None)
    if not isinstance(model, nn.Module):
        return type(drafter).__name__
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _part(target, drafters, item: tuple[str, torch.Tensor], config: RecordConfig, target_meta: dict,
          parts_dir: Path, index: int, identity: dict) -> Trace:
    """Prompt ``index``'s one-prompt trace: read from its part file when it fits, else recorded and stored."""
    import hashlib

    pid, prompt = item
    key = {"prompt": pid, "prompt_sha256": hashlib.sha256(prompt.to(torch.int64).numpy().tobytes()).hexdigest(),
           "config": attrs.asdict(config), "target": target_meta, "drafters": identity}
    path = parts_dir / f"part-{index:05d}.safetensors"
    if path.exists():
        part = Trace.load(path)
        stored = part.meta.get("part")
        if stored != json.loads(json.dumps(key)):
            wrong = sorted(k for k in key if (stored or {}).get(k) != json.loads(json.dumps(key[k])))
            raise TraceError(f"{path} was recorded with other {', '.join(wrong)}; record into another --out "
                             f"or pass --overwrite")
        return part
    part = _record_prompts(target, drafters, [item], config, target_meta)
    part = attrs.evolve(part, meta=part.meta | {"part": key})
    parts_dir.mkdir(parents=True, exist_ok=True)
    tmp = part.save(parts_dir / f".part-{index:05d}.tmp")
    tmp.replace(path)
    return part


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
    drafters = {kind: _merge_records([t.drafters[kind] for t in traces]) for kind in first.drafters}
    return Trace(meta, tuple(s for t in traces for s in t.sequences), drafters)


def _merge_records(records: Sequence[DrafterRecord]) -> DrafterRecord:
    scorers = [r.scorer for r in records]
    scorer = None if scorers[0] is None else _merge_scorers(scorers)
    return DrafterRecord(torch.cat([r.counts for r in records]), torch.cat([r.tokens for r in records]),
                         torch.cat([r.logprobs for r in records]), scorer)


def _merge_scorers(scorers: Sequence[ScorerRecord]) -> ScorerRecord:
    """Anchors concatenated; the GRU input rows of every token any part read, once each, ascending."""
    tokens = torch.cat([s.input_tokens for s in scorers])  # [U'] with repeats
    rows = torch.cat([s.input_rows for s in scorers])
    unique, inverse = torch.unique(tokens, return_inverse=True)  # ascending
    first = torch.full((unique.numel(),), tokens.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(tokens.numel()), reduce="amin")
    cat = lambda name: torch.cat([getattr(s, name) for s in scorers])  # noqa: E731
    return ScorerRecord(cat("rows"), cat("base_tokens"), cat("base_logits"), cat("prefix_tokens"),
                        cat("prefix_logprobs"), unique, rows[first], scorers[0].weights)


def _record_prompt(decoder: SpeculativeDecoder, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    prompt = torch.as_tensor(prompt, dtype=torch.int64).reshape(-1)
    out = decoder.generate(prompt, max_new_tokens=max_new_tokens, stop_token_ids=())
    if len(out.stats.rounds) != max_new_tokens:  # one anchor per generated token: the rows replay indexes
        raise RuntimeError(f"recording drafted {len(out.stats.rounds)} times for {max_new_tokens} tokens")
    return torch.cat([prompt.cpu(), out.tokens.cpu()])


def _progress(items, enabled: bool, label: str):
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=label, unit="prompt")


# ---------------------------------------------------------------------------- rebuilding drafts
def _dense(ids: torch.Tensor, values: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] rows holding ``values`` [R, k] at ``ids`` and -inf elsewhere."""
    out = torch.full((ids.shape[0], vocab), float("-inf"), dtype=values.dtype)
    return out.scatter_(1, ids.long(), values)


def _module_from(module: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """``module`` (built on the meta device) holding the tensors of ``state`` themselves."""
    module.load_state_dict(state, assign=True)
    return module.requires_grad_(False).eval()


class _ScorerParts:
    """The modules and GRU input rows a replayed `DominoScorer` shares across anchors."""

    def __init__(self, record: ScorerRecord, vocab: int, table: bool) -> None:
        # drafters/ is imported only when a scorer is replayed (here, before any replay is timed)
        from drafters.domino import DominoScorer

        self.scorer_class = DominoScorer
        w = record.weights
        w_ih, w_hh, w1 = w["prefix_gru.weight_ih_l0"], w["prefix_gru.weight_hh_l0"], w["embed_proj.0.weight"]
        hidden, state = w_ih.shape[1], w_hh.shape[1]
        with torch.device("meta"):
            gru = nn.GRU(hidden, state, num_layers=1, batch_first=True, bias=False)
            proj = nn.Sequential(nn.Linear(hidden + state, w1.shape[0], bias=False), nn.SiLU(),
                                 nn.Linear(w1.shape[0], vocab, bias=False))
            embed = nn.Embedding(vocab, hidden)
        self.gru = _module_from(gru, {"weight_ih_l0": w_ih, "weight_hh_l0": w_hh})
        self.proj = _module_from(proj, {"0.weight": w1, "2.weight": w["embed_proj.2.weight"]})
        rows = torch.full((vocab, record.input_rows.shape[1]), float("nan"), dtype=record.input_rows.dtype)
        rows[record.input_tokens] = record.input_rows  # [V, W]; NaN marks tokens never recorded
        self.table = rows if table else None
        # with a table the scorer never reads the embedding, so a meta-device module (a shape) serves
        self.embed = embed if table else _module_from(embed, {"weight": rows})


class ReplayDrafts:
    """Rebuilds the `DraftOutput` recorded at any anchor of one drafter."""

    def __init__(self, record: DrafterRecord, meta: dict) -> None:
        self.record, self.meta = record, meta
        self.depth, self.vocab = int(meta["depth"]), int(meta["vocab_size"])
        self.starts = torch.cat([torch.zeros(1, dtype=torch.int64), record.counts.sum(1).cumsum(0)]).tolist()
        scorer = meta["scorer"]
        self.parts = _ScorerParts(record.scorer, self.vocab, scorer["gru_table"]) if scorer is not None else None

    @property
    def num_anchors(self) -> int:
        return self.record.counts.shape[0]

    def draft(self, index: int, anchor: int, position: int) -> DraftOutput:
        """The draft of anchor row ``index`` (token ``anchor`` at absolute ``position``)."""
        if not 0 <= index < self.num_anchors:
            raise IndexError(f"anchor {index} out of range: the trace holds {self.num_anchors}")
        logprobs = self._marginals(index)
        scorer = self._scorer(index, anchor) if self.parts is not None else None
        return DraftOutput(logprobs=logprobs, root_token=anchor, position=position, scorer=scorer)

    def _marginals(self, index: int) -> torch.Tensor:
        start, end = self.starts[index], self.starts[index + 1]
        depth_of = torch.repeat_interleave(torch.arange(self.depth), self.record.counts[index])  # [n]
        flat = torch.full((self.depth * self.vocab,), float("-inf"))
        flat[depth_of * self.vocab + self.record.tokens[start:end].long()] = self.record.logprobs[start:end]
        return flat.view(self.depth, self.vocab)  # [L, V]

    def _scorer(self, index: int, anchor: int):
        rec, parts = self.record.scorer, self.parts
        return parts.scorer_class(
            rows=rec.rows[index], base_logits=_dense(rec.base_tokens[index], rec.base_logits[index], self.vocab),
            prefix_gru=parts.gru, embed_proj=parts.proj, embed=parts.embed, anchor=anchor,
            pure_draft_prefix_len=int(self.meta["scorer"]["prefix_len"]), gru_table=parts.table,
            prefix_logprobs=_dense(rec.prefix_tokens[index], rec.prefix_logprobs[index], self.vocab))


# ---------------------------------------------------------------------------- replay
def accepted_length(tree: DraftTree, future: Sequence[int]) -> int:
    """tau of the match verifier's walk when the target's tokens are ``future`` (the trajectory
    after the root): from the root, step to the lowest-index child holding the next token."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    node, depth = 0, 0
    for i in range(1, len(tokens)):  # a child's index exceeds its parent's: one pass finds the walk
        if parents[i] == node and depth < len(future) and tokens[i] == future[depth]:
            node, depth = i, depth + 1
    return depth + 1


def check_replayable(policy: TreePolicy | None, meta: dict) -> None:
    """Raise `TraceError` when the trace cannot rebuild what ``policy`` reads (module docstring)."""
    if policy is None:
        return
    uses_scorer = meta["scorer"] is not None and policy.uses_scorer != "never"
    budget, top_m, limit = getattr(policy, "budget", None), getattr(policy, "top_m", None), meta["max_budget"]
    if not uses_scorer and not meta["full_rows"] and budget is not None and budget > limit:
        raise TraceError(f"{policy.name} budget {budget} exceeds the trace's max_budget {limit}; "
                         f"record with --max-budget {budget} or more")
    recorded = meta["scorer"]["top_m"] if meta["scorer"] is not None else None
    if uses_scorer and top_m is not None and min(top_m, meta["vocab_size"]) > recorded:
        raise TraceError(f"{policy.name} top_m {top_m} exceeds the {recorded} scorer candidates recorded; "
                         f"record with --top-m {top_m} or more")


def _check_recorded(tree: DraftTree) -> None:
    if bool(torch.isinf(tree.scores).any()):
        raise TraceError("the policy built a node from a token the trace did not record (score -inf); "
                         "it reads beyond the recorded top tokens (raise --min-k or --max-budget when recording)")


def replay_prompt(trace: Trace, drafts: ReplayDrafts | None, policy: TreePolicy | None, prompt: int, *,
                  backend: str = "torch", stop_token_ids: Iterable[int] = (),
                  gate: DraftGate | None = None) -> list[int]:
    """Per-round tau of ``policy`` (None: autoregressive) on one recorded prompt, as the live loop
    counts; ``gate`` is the decoder's `DraftGate` (default: a fresh one, as the bench starts each
    conversation; pass one across prompts to mirror a decoder used for several generations)."""
    seq, start, total = trace.sequences[prompt].tolist(), trace.prompt_len(prompt) - 1, trace.max_new_tokens
    stops, room = frozenset(stop_token_ids), int(trace.meta["target"]["max_positions"])
    taus, done, gate = [], 0, gate if gate is not None else DraftGate(DRAFT_BACKOFF)
    while done < total:
        anchor = start + done  # absolute position of the round's root
        if policy is None or not gate.drafts_now():
            tau = 1
        else:
            draft = drafts.draft(trace.anchor_index(prompt, done), seq[anchor], anchor)
            built = policy.build(draft, backend=backend)
            gate.record(len(built))  # the policy's answer, before the length cut, as the live loop
            tree = limit_depth(built, min(total - done - 1, room - 1 - anchor))
            _check_recorded(tree)
            tau = accepted_length(tree, seq[anchor + 1:])
        taus.append(tau)
        if stops.intersection(seq[anchor + 1:anchor + 1 + tau]):
            break
        done += tau
    return taus


@attrs.frozen
class ReplayResult:
    """One method's replayed acceptance lengths."""

    method: str  # method name as given
    taus: tuple[tuple[int, ...], ...]  # per prompt, per round
    seconds: float  # wall-clock seconds of the replay (rebuilding drafts and trees included)

    @property
    def rounds(self) -> int:
        return sum(len(t) for t in self.taus)

    @property
    def mean_tau(self) -> float:
        return sum(map(sum, self.taus)) / self.rounds if self.rounds else 0.0


def _drafts_for(trace: Trace, method: Method, cache: dict[str, ReplayDrafts]) -> ReplayDrafts | None:
    if method.autoregressive:
        return None
    if method.drafter not in trace.drafters:
        raise TraceError(f"method {method.name!r} needs the {method.drafter} drafter; the trace recorded "
                         f"{sorted(trace.drafters) or 'none'}")
    if method.drafter not in cache:
        cache[method.drafter] = trace.drafts(method.drafter)
    return cache[method.drafter]


def _pricing(trace: Trace, method: Method, given: CostModel | None) -> tuple[CostModel | None, float]:
    """(cost model, calibration): the one given, else those measured when the trace was recorded."""
    if given is not None or method.drafter is None:
        return given, 1.0
    recorded = trace.meta.get("cost_models", {}).get(method.drafter)
    kappa = float(trace.meta.get("calibrations", {}).get(method.drafter, 1.0))
    return (None if recorded is None else cost_model_from_dict(recorded, "the trace's cost model")), kappa


def evaluate(trace: Trace, methods: Sequence[str | Method], *, backend: str = "torch",
             stop_token_ids: Iterable[int] = (), prompts: Sequence[int] | None = None,
             cost_model: CostModel | None = None) -> list[ReplayResult]:
    """Replay each method (``"ddtree@16"``, ``"dominotree@32"``, ...; see treespec.methods) on the
    trace; ``cost_model`` prices the trees of cost-aware policies, by default with the cost models
    measured on the recording machine (``trace.meta["cost_models"]``, one per drafter kind)."""
    parsed = [parse_method(m) if isinstance(m, str) else m for m in methods]
    cache: dict[str, ReplayDrafts] = {}
    chosen = range(trace.num_prompts) if prompts is None else prompts
    stops = tuple(stop_token_ids)
    results = []
    for method in parsed:
        drafts, policy = _drafts_for(trace, method, cache), build_policy(method, *_pricing(trace, method, cost_model))
        if drafts is not None:
            check_replayable(policy, drafts.meta)
        start = time.perf_counter()  # each prompt with a fresh gate, as the bench measures conversations
        taus = tuple(tuple(replay_prompt(trace, drafts, policy, i, backend=backend, stop_token_ids=stops))
                     for i in chosen)
        results.append(ReplayResult(method.name, taus, time.perf_counter() - start))
    return results
