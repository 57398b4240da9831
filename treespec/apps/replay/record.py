"""Recording a trace: the drafters' outputs at every anchor of the target's greedy trajectory.

Contract
--------
For each prompt the target decodes ``max_new_tokens`` tokens greedily in the live harness
(`SpeculativeDecoder` with a root-only tree every round: autoregressive decoding, no stop tokens),
and every drafter drafts at every anchor the live decoder could land on: the prompt's last token,
then each generated token but the last.  Each draft gets the `DraftContext` the live loop builds
(the committed tokens up to the anchor, the taps of the tokens committed since its previous draft).
Per anchor and drafter the trace keeps

* the marginals: for every depth the best tokens of ``DraftOutput.logprobs`` (value descending,
  ties by token id) -- at least ``min_k`` of them, and every token that can enter a best-first tree
  over the marginals with up to ``max_budget`` nodes (all V of them when ``max_budget >= V``);
* for a draft carrying a `RecordableScorer`: what its ``record_round(top_m)`` returns, and once per
  drafter what its ``record_shared`` returns (for Domino: the drafted rows, the top-M base logits,
  the correction head's weights and the GRU input rows of the tokens a replay can read);

and, per prompt, the trajectory.  ``parts_dir`` records prompt by prompt into part files and
reuses those an interrupted run left, so a recording resumes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import torch

from treespec import registry
from treespec.apps.assembly.session import Session
from treespec.apps.replay.trace import (
    FORMAT,
    VERSION,
    DrafterRecord,
    ScorerRecord,
    Trace,
    TraceError,
    merge_traces,
    scorer_class,
)
from treespec.decoding import SpeculativeDecoder
from treespec.interfaces import DraftContext, Drafter, DraftOutput, RecordableScorer, TreePolicy
from treespec.reach import best_chain, reachable
from treespec.target import Target, select_taps
from treespec.topk import exact_topk
from treespec.tree import DraftTree

__all__ = ["RECORD_PRESETS", "RecordConfig", "record_trace"]


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


# ---------------------------------------------------------------------------- capture
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
    """Accumulates a `RecordableScorer`'s per-round tensors; the shared ones are taken at the end."""

    def __init__(self, draft: DraftOutput, top_m: int) -> None:
        scorer = draft.scorer
        if not isinstance(scorer, RecordableScorer):
            raise TraceError(f"cannot record a {type(scorer).__name__}: trace replay rebuilds scorers that "
                             f"implement treespec.interfaces.RecordableScorer")
        scorer_class(scorer.record_kind)  # refuses a kind replay could not load, before any recording
        self.kind, self.top_m = scorer.record_kind, min(top_m, draft.vocab_size)
        self.rounds: list[dict[str, torch.Tensor]] = []
        self.last: RecordableScorer = scorer

    def add(self, draft: DraftOutput) -> None:
        self.rounds.append(draft.scorer.record_round(self.top_m))
        self.last = draft.scorer

    def finish(self) -> tuple[ScorerRecord, dict]:
        rounds = {name: torch.stack([r[name] for r in self.rounds]) for name in self.rounds[0]}
        shared, meta = self.last.record_shared(rounds)
        return ScorerRecord(rounds, shared), {"kind": self.kind, "top_m": self.top_m} | meta


class _RootOnly(TreePolicy):
    """The empty tree every round: the live loop then decodes autoregressively."""

    name = "root-only"

    def build(self, draft: DraftOutput) -> DraftTree:
        return DraftTree.root_only(draft.root_token, device=draft.logprobs.device)


class _Recorder(Drafter):
    """Runs every wrapped drafter on the live context of each anchor and captures its output."""

    def __init__(self, drafters: Mapping[str, Drafter], config: RecordConfig) -> None:
        self.drafters = dict(drafters)
        self.tap_layers = tuple(sorted({t for d in self.drafters.values() for t in d.tap_layers}))
        self.captures = {kind: _Capture(config) for kind in self.drafters}

    def bind(self, target: Target) -> None:
        for drafter in self.drafters.values():
            drafter.bind(target)

    def reset(self) -> None:
        for drafter in self.drafters.values():
            drafter.reset()

    def observe_accepted(self, accepted: torch.Tensor) -> None:
        for drafter in self.drafters.values():
            drafter.observe_accepted(accepted)

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
        return DraftContext(ctx.sequence, select_taps(ctx.features, self.tap_layers, drafter.tap_layers),
                            ctx.feature_start)


def record_trace(session: Session, prompts: Sequence[torch.Tensor], *,
                 config: RecordConfig = RECORD_PRESETS["default"], prompt_ids: Sequence[str] | None = None,
                 progress: bool = False, parts_dir: str | Path | None = None) -> Trace:
    """Record the session's drafters (kind -> drafter, e.g. {"dflash": ..., "domino": ...}) along the
    greedy trajectory of its target for each prompt ([P] token ids); see the module docstring.  The
    trace names the target as the session does, and keeps the cost models and calibrations of the
    session's machine profile.

    ``parts_dir``: record prompt by prompt into one part file each there (written whole, then
    renamed), reuse the parts an interrupted run left (same prompt, settings, target and drafter
    weights, else `TraceError`) and merge them: an interrupted recording resumes.
    """
    target, drafters = session.target, dict(session.drafters)
    if not drafters:
        raise ValueError("record_trace needs at least one drafter")
    prompt_ids = [str(i) for i in range(len(prompts))] if prompt_ids is None else list(prompt_ids)
    if len(prompt_ids) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(prompt_ids)} prompt ids")
    target_meta = {"name": session.name, "vocab_size": target.vocab_size, "max_positions": target.max_positions,
                   "dtype": str(target.dtype).removeprefix("torch.")}
    items = list(zip(prompt_ids, prompts, strict=True))
    if parts_dir is None:
        trace = _record_prompts(target, drafters, items, config, target_meta, progress)
    else:
        identity = {kind: d.weights_digest() for kind, d in drafters.items()}
        parts = [_part(target, drafters, item, config, target_meta, Path(parts_dir), i, identity)
                 for i, item in enumerate(_progress(items, progress, "record"))]
        trace = merge_traces(parts)
    # what cost-aware policies replay with: read from the cache, or measured now (about 20 s, with a bar)
    profile = session.machine_profile()
    meta = trace.meta | {"cost_models": {kind: profile.cost_model(d).to_dict() for kind, d in drafters.items()},
                         "calibrations": {kind: profile.calibration(d).to_record() for kind, d in drafters.items()}}
    return attrs.evolve(trace, meta=meta)


def _record_prompts(target: Target, drafters: Mapping[str, Drafter], items: Sequence[tuple[str, torch.Tensor]],
                    config: RecordConfig, target_meta: dict, progress: bool = False) -> Trace:
    """The trace of ``items`` ((prompt id, prompt) pairs), without cost models."""
    recorder = _Recorder(drafters, config)
    decoder = SpeculativeDecoder(target, recorder, _RootOnly())  # a draft at every anchor
    sequences = [_record_prompt(decoder, prompt, config.max_new_tokens)
                 for _, prompt in _progress(items, progress, "record")]
    records = {kind: capture.finish() for kind, capture in recorder.captures.items()}
    meta = {"format": FORMAT, "version": VERSION, "config": attrs.asdict(config), "target": target_meta,
            "prompts": [{"id": pid, "prompt_len": int(p.numel())} for pid, p in items],
            "drafters": {kind: meta for kind, (_, meta) in records.items()}}
    return Trace(meta, tuple(sequences), {kind: rec for kind, (rec, _) in records.items()})


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
