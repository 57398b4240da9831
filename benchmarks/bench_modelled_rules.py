"""Modelled speed of tree policies on a replay trace: every replayed round timed by a cost model.

No target runs.  For each method every recorded prompt is replayed as the live loop runs it, the
policy's draft controller included (`treespec.apps.replay.evaluate.replay_rounds`, one controller
over the prompts in order, as the bench keeps one), and each round is charged what the cost model
says it costs: a drafted round of an n-token tree C_d + C_v(n; ctx), an AR step C_v(1; ctx).  AR is charged
C_v(1; ctx) per token, so the modelled speed over AR is

    speed = Σ tokens / Σ modelled seconds  ÷  (1 / C_v(1; ctx)).

The cost model is the one recorded with the trace for each drafter (the recording machine's
profile), or ``--cost-model FILE`` for all.  A profile's C_d is the drafter's forward alone; a
live round also pays the build, so ``--draft-steps KIND=S`` (or one number for every drafter)
sets C_d to S AR steps (C_v(1) at the profile's shortest context): the live rounds of
`benchmarks/bench_live_cost.py` measure it.  Cost-aware methods price their trees with the same
model, so the figure is what their rule gains by its own account, free of the machine's noise
and exactly as right as the model (docs/decoding.md measures the model's error live).
``--charge-with FILE`` charges the rounds by another model than the one the policies price with
(say, the verify time measured at every tree size against a profile's fitted curve): what a
rule loses to the curve it prices with.  Printed per
method: τ, the share of rounds that drafted, the mean verified tree size, the modelled speed over
AR with a 95 % bootstrap interval over prompts, and the paired interval of its ratio to the first
method's.

    python benchmarks/bench_modelled_rules.py TRACE --methods dominotree@16 cost-aware-dominotree@16 \\
        --draft-steps dflash=0.24 --draft-steps domino=0.32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import attrs
import numpy as np

from treespec.apps.assembly.methods import parse_method
from treespec.apps.bench.summary import bootstrap_interval
from treespec.apps.replay.evaluate import policy_for, replay_rounds
from treespec.apps.replay.trace import Trace, TraceError
from treespec.pricing.cost import ConvexCost, CostModel, cost_model_from_dict, load_cost_model

DEFAULT_METHODS = ("ddtree@16", "caddtree@16", "dominotree@16", "cost-aware-dominotree@16")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="trace file written by `treespec replay record`")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS))
    parser.add_argument("--cost-model", type=Path, default=None,
                        help="cost model JSON for every method (default: the trace's, one per drafter)")
    parser.add_argument("--charge-with", type=Path, default=None,
                        help="charge the rounds by this cost model JSON instead of the one the policies price with "
                             "(e.g. verify times measured at every tree size): what a rule's pricing costs it")
    parser.add_argument("--draft-steps", action="append", default=[],
                        help="C_d in AR steps: KIND=S for one drafter, or S for all (repeatable)")
    parser.add_argument("--resamples", type=int, default=2000)
    return parser.parse_args()


def draft_steps(items: list[str]) -> dict[str | None, float]:
    """``["0.3"]`` -> {None: 0.3}; ``["domino=0.32"]`` -> {"domino": 0.32}; a malformed item exits."""
    steps: dict[str | None, float] = {}
    for item in items:
        kind, _, value = item.rpartition("=")
        try:
            steps[kind or None] = float(value)
        except ValueError:
            sys.exit(f"--draft-steps: expected KIND=S or S (AR steps), got {item!r}")
        if not steps[kind or None] >= 0:
            sys.exit(f"--draft-steps: AR steps must be >= 0, got {item!r}")
    return steps


def model_of(trace: Trace, kind: str, given: CostModel | None, steps: dict[str | None, float]) -> CostModel:
    """The cost model rounds over drafter ``kind`` are charged with, C_d set from ``steps`` if given."""
    if given is not None:
        model = given
    else:
        recorded = trace.meta.get("cost_models", {}).get(kind)
        if recorded is None:
            sys.exit(f"the trace recorded no cost model for {kind}: pass --cost-model")
        model = cost_model_from_dict(recorded, "the trace's cost model")
    s = steps.get(kind, steps.get(None))
    if s is None:
        return model
    if not isinstance(model, ConvexCost):
        sys.exit("--draft-steps needs a fitted cost model (ConvexCost)")
    return attrs.evolve(model, draft=s * float(model.verify_costs(1, model.contexts[0])[1]))


def prompt_seconds(trace: Trace, prompt: int, rounds, model: CostModel) -> tuple[float, float, int]:
    """(modelled seconds of ``rounds``, AR's modelled seconds for the same tokens, tokens) of one prompt."""
    ctx, spent, ar = trace.prompt_len(prompt) - 1, 0.0, 0.0
    for r in rounds:
        costs = model.verify_costs(r.tree_size, ctx)  # [n + 1] C_v(0..n; ctx)
        spent += float(costs[r.tree_size]) + (model.draft_cost if r.drafted else 0.0)
        ar += sum(float(model.verify_costs(1, ctx + i)[1]) for i in range(r.tau))
        ctx += r.tau
    return spent, ar, sum(r.tau for r in rounds)


def main() -> None:
    args = parse_args()
    try:
        trace = Trace.load(args.trace)
        given = load_cost_model(args.cost_model) if args.cost_model else None
        charged = load_cost_model(args.charge_with) if args.charge_with else None
        methods = [parse_method(m) for m in args.methods]
    except (OSError, ValueError, TraceError) as exc:
        sys.exit(f"bench_modelled_rules: {exc}")
    steps = draft_steps(args.draft_steps)
    print(f"{args.trace}: {trace.num_prompts} prompts x {trace.max_new_tokens} tokens; C_d "
          + (", ".join(f"{k or 'all'} {v:.2f} AR steps" for k, v in steps.items()) or "as the profile measured"))
    print("\n| method | τ | drafted rounds | mean tree (tokens, root included) | modelled speed over AR "
          "| ratio to the first |")
    print("|---|---|---|---|---|---|")
    cache, first = {}, None
    for method in methods:
        spent, ar, rounds = modelled_rows(args, trace, method, cache, given, charged, steps)
        first = first or (spent, ar)
        print(table_row(method.name, spent, ar, rounds, None if first[0] is spent else first, args.resamples),
              flush=True)


def modelled_rows(args, trace, method, cache, given, charged, steps):
    """([n] modelled seconds, [n] AR seconds) per prompt of ``method`` replayed, and every replayed round."""
    drafts, policy = policy_for(trace, method, cache, given)
    model = model_of(trace, method.drafter, given, steps) if method.drafter else None
    if model is not None and type(policy).uses_cost_model:
        policy = attrs.evolve(policy, cost_model=model)  # priced with the model given (C_d as set)
    if model is not None and charged is not None:
        model = model_of(trace, method.drafter, charged, steps)
    rows, rounds_all = [], []
    controller = policy.draft_controller() if policy is not None else None
    for p in range(trace.num_prompts):
        rounds = replay_rounds(trace, drafts, policy, p, controller=controller)
        rounds_all += rounds
        rows.append(prompt_seconds(trace, p, rounds, model) if model is not None else (1.0, 1.0, 1))
    return np.array([r[0] for r in rows]), np.array([r[1] for r in rows]), rounds_all


def table_row(name: str, spent, ar, rounds, first, resamples: int) -> str:
    """One markdown row: τ, drafted share, mean tree, modelled speed over AR with its interval, and the
    ratio to the first method paired by prompt (``first``: its (spent, ar); None for the first itself)."""
    speed = lambda idx: float(ar[idx].sum() / spent[idx].sum())  # noqa: E731
    n = len(spent)
    lo, hi = bootstrap_interval(speed, n, resamples, seed=0)
    ratio = "--"
    if first is not None:
        s0, a0 = first
        paired = lambda idx: speed(idx) / float(a0[idx].sum() / s0[idx].sum())  # noqa: E731
        rlo, rhi = bootstrap_interval(paired, n, resamples, seed=1)
        ratio = f"{paired(np.arange(n)):.3f} [{rlo:.3f}, {rhi:.3f}]"
    tau = sum(r.tau for r in rounds) / len(rounds)
    drafted = sum(r.drafted for r in rounds) / len(rounds)
    size = sum(r.tree_size for r in rounds if r.drafted) / max(1, sum(r.drafted for r in rounds))
    return (f"| {name} | {tau:.2f} | {100 * drafted:.0f} % | {size:.1f} | "
            f"{speed(np.arange(n)):.3f}× [{lo:.3f}, {hi:.3f}] | {ratio} |")


if __name__ == "__main__":
    main()
