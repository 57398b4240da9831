"""Replaying a trace: any tree policy's T = 0 acceptance lengths from the recording, without the target.

Contract
--------
Walk each trajectory as the live loop does: with c tokens committed the anchor is trajectory token
P - 1 + c; rebuild its `DraftOutput` (treespec/apps/replay/rebuild.py), build the policy's tree, prune it
to the depth still usable (as the decoder does), and take tau = 1 + the depth reached by the match
verifier's walk with the trajectory as the target's tokens.  Commit tau tokens; stop after
``max_new_tokens`` or at a stop token when given (the trajectory runs on past stop tokens, so tau
counts what the live verifier would accept).  `check_replayable` refuses budgets and top-M beyond
what the trace recorded; a tree holding an unrecorded token (a -inf score) fails.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence

import attrs
import torch

from treespec.analysis import accepted_length, accepted_path
from treespec.apps.assembly.methods import MethodSpec, build_policy, naming, parse_method
from treespec.apps.replay.rebuild import ReplayDrafts
from treespec.apps.replay.trace import Trace, TraceError
from treespec.decoding import built_tree, limit_depth
from treespec.interfaces import DraftController, RoundReport, TreePolicy, VerifyResult
from treespec.pricing.calibration import Calibration
from treespec.pricing.cost import CostModel, cost_model_from_dict
from treespec.steering import AR_ROUND, Steering
from treespec.tree import DraftTree

__all__ = ["ReplayResult", "ReplayRound", "check_replayable", "evaluate", "policy_for", "replay_priced",
           "replay_prompt", "replay_rounds"]


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


@attrs.frozen
class ReplayRound:
    """One replayed round: what the live loop would have verified and committed."""

    tau: int  # tokens committed (accepted draft tokens + the bonus)
    tree_size: int  # tokens of the verified tree, root included (1: an AR step or a root-only tree)
    drafted: bool  # whether the round asked the drafter (False: its controller decided an AR step)


def replay_rounds(trace: Trace, drafts: ReplayDrafts | None, policy: TreePolicy | None, prompt: int, *,
                  stop_token_ids: Iterable[int] = (), controller: DraftController | None = None) -> list[ReplayRound]:
    """The rounds of ``policy`` (None: autoregressive) on one recorded prompt, as the live loop runs
    them: the round protocol with its draft controller (`treespec.steering.Steering`; ``controller``,
    default a fresh one from the policy, told the recorded drafts' depth; pass one across prompts to
    mirror a decoder used for several generations, as `evaluate` and the bench do), each report
    without stage times (a priced controller counts rounds at its curve's prices, so it decides as
    live; a live curve learns nothing here)."""
    seq, start, total = trace.sequences[prompt].tolist(), trace.prompt_len(prompt) - 1, trace.max_new_tokens
    stops, room = frozenset(stop_token_ids), int(trace.meta["target"]["max_positions"])
    rounds, done = [], 0
    if policy is not None and controller is None:
        controller = policy.draft_controller()
        controller.bind(drafts.depth if drafts is not None else None)  # the recorded drafts' depth, as live
    steering = Steering(controller, policy) if policy is not None else None
    drafting = steering is not None and steering.start()
    while done < total:
        anchor = start + done  # absolute position of the round's root
        decision = steering.decide() if steering is not None else AR_ROUND
        if not decision.draft:
            tree, drafted = DraftTree.root_only(seq[anchor]), False
        else:
            draft = drafts.draft(trace.anchor_index(prompt, done), seq[anchor], anchor)
            built = built_tree(policy.priced(decision.price, decision.calibration), draft)
            tree, drafted = limit_depth(built, min(total - done - 1, room - 1 - anchor)), True
            _check_recorded(tree)
        path = accepted_path(tree, seq[anchor + 1:])
        if steering is not None:
            result = VerifyResult(torch.tensor(path), seq[anchor + len(path)] if anchor + len(path) < len(seq) else 0)
            steering.report(RoundReport(tree, result, anchor, {}, drafted, decision.explore, tapped=drafting))
        tau = len(path)
        rounds.append(ReplayRound(tau, len(tree), drafted))
        if stops.intersection(seq[anchor + 1:anchor + 1 + tau]):
            break
        done += tau
    return rounds


def replay_prompt(trace: Trace, drafts: ReplayDrafts | None, policy: TreePolicy | None, prompt: int, *,
                  stop_token_ids: Iterable[int] = (), controller: DraftController | None = None) -> list[int]:
    """Per-round tau of ``policy`` on one recorded prompt (`replay_rounds`)."""
    return [r.tau for r in replay_rounds(trace, drafts, policy, prompt, stop_token_ids=stop_token_ids,
                                         controller=controller)]


def replay_priced(trace: Trace, drafts: ReplayDrafts, method: MethodSpec, prompt: int,
                  schedule: Sequence[dict | None], *, calibration: Calibration | None = None) -> list[int]:
    """Per-round tau of a cost-aware ``method`` on one recorded prompt, each round priced with the cost
    model a live run priced it with: ``schedule`` has one entry per live round, the model's
    `CostModel.to_dict` form, or None for a round that drafted nothing (`BenchRecord.priced_rounds`);
    an entry's ``"calibration"`` (a round calibrated live) replaces ``calibration`` for that round.
    So a run whose costs were corrected live builds the same trees again (the drafting decisions
    are the recorded ones, `treespec.pricing.control`)."""
    seq, start, total = trace.sequences[prompt].tolist(), trace.prompt_len(prompt) - 1, trace.max_new_tokens
    room = int(trace.meta["target"]["max_positions"])
    policies: dict[str, TreePolicy] = {}
    taus, done = [], 0
    for r, priced in enumerate(schedule):
        if done >= total:
            raise TraceError(f"the schedule has {len(schedule)} rounds; the replay ended after round {r}")
        anchor = start + done
        tau = 1
        if priced is not None:
            key = json.dumps(priced, sort_keys=True)
            if key not in policies:
                policies[key] = _round_policy(method, priced, calibration, f"round {r}")
            draft = drafts.draft(trace.anchor_index(prompt, done), seq[anchor], anchor)
            tree = limit_depth(built_tree(policies[key], draft), min(total - done - 1, room - 1 - anchor))
            _check_recorded(tree)
            tau = accepted_length(tree, seq[anchor + 1:])
        taus.append(tau)
        done += tau
    return taus


def _round_policy(method: MethodSpec, priced: dict, calibration: Calibration | None, where: str) -> TreePolicy:
    """The policy of one scheduled round: its recorded cost model, and its live calibration if recorded."""
    priced = dict(priced)
    recorded = priced.pop("calibration", None)
    if recorded is not None:
        try:
            calibration = Calibration.from_record(recorded)
        except ValueError as exc:
            raise TraceError(f"{where}'s calibration: {exc}") from None
    return build_policy(method, cost_model_from_dict(priced, f"{where}'s cost model"), calibration)


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


def _drafts_for(trace: Trace, method: MethodSpec, cache: dict[str, ReplayDrafts]) -> ReplayDrafts | None:
    if method.autoregressive:
        return None
    if method.drafter not in trace.drafters:
        raise TraceError(f"method {method.name!r} needs the {method.drafter} drafter; the trace recorded "
                         f"{sorted(trace.drafters) or 'none'}")
    if method.drafter not in cache:
        cache[method.drafter] = ReplayDrafts.of(trace, method.drafter)
    return cache[method.drafter]


def _pricing(trace: Trace, method: MethodSpec, given: CostModel | None) -> tuple[CostModel | None, Calibration]:
    """(cost model, calibration): the one given, else those measured when the trace was recorded."""
    if given is not None or method.drafter is None:
        return given, Calibration()
    recorded = trace.meta.get("cost_models", {}).get(method.drafter)
    calibration = trace.meta.get("calibrations", {}).get(method.drafter)
    try:
        calibration = Calibration() if calibration is None else Calibration.from_record(calibration)
    except ValueError as exc:
        raise TraceError(f"the trace's calibration of {method.drafter}: {exc}") from None
    return (None if recorded is None else cost_model_from_dict(recorded, "the trace's cost model")), calibration


def policy_for(trace: Trace, method: MethodSpec, cache: dict[str, ReplayDrafts] | None = None,
               cost_model: CostModel | None = None) -> tuple[ReplayDrafts | None, TreePolicy | None]:
    """(the draft rebuilder, the policy) that replay uses for ``method`` (None, None for AR): the
    policy priced with ``cost_model`` or the trace's recorded cost model, checked replayable;
    ``cache`` shares rebuilders between methods of one drafter."""
    drafts = _drafts_for(trace, method, {} if cache is None else cache)
    policy = build_policy(method, *_pricing(trace, method, cost_model))
    if drafts is not None:
        check_replayable(policy, drafts.meta)
    return drafts, policy


def evaluate(trace: Trace, methods: Sequence[str | MethodSpec], *, stop_token_ids: Iterable[int] = (),
             prompts: Sequence[int] | None = None,
             cost_model: CostModel | None = None) -> list[ReplayResult]:
    """Replay each method (``"ddtree@16"``, ``"dominotree@32"``, ...; see treespec.apps.assembly.methods) on the
    trace; ``cost_model`` prices the trees of cost-aware policies, by default with the cost models
    measured on the recording machine (``trace.meta["cost_models"]``, one per drafter kind)."""
    parsed = [parse_method(m) if isinstance(m, str) else m for m in methods]
    cache: dict[str, ReplayDrafts] = {}
    chosen = range(trace.num_prompts) if prompts is None else prompts
    stops = tuple(stop_token_ids)
    results = []
    for method in parsed:
        drafts, policy = policy_for(trace, method, cache, cost_model)
        controller = policy.draft_controller() if policy is not None else None  # one over the prompts, as live
        if controller is not None:
            controller.bind(drafts.depth if drafts is not None else None)
        start = time.perf_counter()
        with naming(method):
            taus = tuple(tuple(replay_prompt(trace, drafts, policy, i, stop_token_ids=stops, controller=controller))
                         for i in chosen)
        results.append(ReplayResult(method.name, taus, time.perf_counter() - start))
    return results
