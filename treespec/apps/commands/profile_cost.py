"""``treespec profile-cost``: measure this machine's verify and draft costs and fit the cost model.

Times one target forward over a tree of n tokens on top of ctx cached tokens (median of repeats
after a warm-up, the sizes taken in turn within each repeat) and one round of each drafter, caches
the profile where every treespec command finds it (`treespec.pricing.profile`: keyed by machine,
architecture and dtype) and prints C_v in ms and in AR steps with the break-even τ of a 16-node
tree, beside the live-corrected curve that decoding runs left in the cache (`treespec.pricing.live_cost`),
with the rounds each point rests on.  ``--out FILE`` also writes the fitted
`ConvexCost` (with the first drafter's C_d) as JSON, for ``--cost-model`` or `load_cost_model`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from treespec.apps.commands import (
    CPU_DTYPES,
    DTYPES,
    add_engine_argument,
    add_exact_argument,
    add_threads_argument,
    check_model_digest,
    start_threads,
)
from treespec.pricing.calibration import Calibration, fit_calibration, node_outcomes, promise_by_quartile
from treespec.pricing.profile import PROFILE_CONTEXTS, PROFILE_SIZES, time_draft, time_verify

__all__ = ["add_arguments", "run", "time_draft", "time_verify"]


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="local target directory (default: the embedded SmolLM2)")
    parser.add_argument("--drafter", type=Path, action="append", default=None,
                        help="drafter checkpoint to time C_d (repeatable; default: the embedded drafters "
                             "with the embedded target, none otherwise)")
    parser.add_argument("--out", type=Path, default=None, help="also write the fitted cost model here (JSON)")
    parser.add_argument("--sizes", type=_ints, default=PROFILE_SIZES, help="tree sizes n (tokens, root included)")
    parser.add_argument("--contexts", type=_ints, default=PROFILE_CONTEXTS, help="context lengths")
    parser.add_argument("--repeats", type=int, default=9,
                        help="timed repeats per point, sizes taken in turn (median kept)")
    parser.add_argument("--fresh", action="store_true", help="measure again even if this machine's profile is cached "
                        "(the live correction earlier runs left is dropped with it)")
    parser.add_argument("--calibrate", action="store_true",
                        help="also fit each drafter's calibration by confidence (κ, β: the promise of a path of "
                             "probability p taken as min(1, κ p^β)) from the nodes of 16-node trees on 12 benchmark "
                             "prompts the demo and the held-out sets do not use, and store it with the profile")
    add_threads_argument(parser)
    add_engine_argument(parser)
    add_exact_argument(parser, None)
    parser.add_argument("--dtype", choices=CPU_DTYPES, default="auto",
                        help="target dtype (auto: the faster of bf16 and fp32 here, measured once)")


def run(args: argparse.Namespace) -> int:
    from treespec.apps.assembly.embedded import embedded_model_dir
    from treespec.apps.assembly.loading import embedded_drafter_dir, load_drafter, load_target
    from treespec.pricing.profile import machine_profile, refresh_profile, save_profile

    try:
        check_model_digest(args)
        start_threads(args)
        target = load_target(args.model or embedded_model_dir(), dtype=DTYPES[args.dtype], engine=args.engine,
                             exact=args.exact)
        paths = args.drafter if args.drafter is not None else (
            [embedded_drafter_dir(k) for k in ("dflash", "domino")] if args.model is None else [])
        drafters = [load_drafter(p) for p in paths]
    except (OSError, ValueError) as exc:
        print(f"treespec profile-cost: {exc}", file=sys.stderr)
        return 2  # a model or drafter that does not load is a bad argument, as in bench and replay
    measure = refresh_profile if args.fresh else machine_profile
    profile = measure(target, drafters, sizes=args.sizes, contexts=args.contexts, repeats=args.repeats, progress=True)
    if args.calibrate and drafters:
        from treespec.apps.assembly.loading import load_tokenizer

        tokenizer = load_tokenizer(args.model or embedded_model_dir())
        for drafter, name in zip(drafters, paths):
            rounds = calibration_rounds(target, tokenizer, drafter)
            outcomes = [node_outcomes(tree, result) for tree, result in rounds]
            calibration = fit_calibration(outcomes)
            print(f"calibration {name}: {len(rounds)} rounds of 16-node trees, {calibration.describe()}")
            for label, used in (("as drafted", Calibration()), ("calibrated", calibration)):
                rows = ", ".join(f"{p:.2f} -> {a:.2f}" for p, a in promise_by_quartile(outcomes, used))
                print(f"  draft tokens promised -> accepted by quartile of the promise, {label}: {rows}")
            profile = profile.with_calibration(drafter, calibration)
            profile = learn_policies(profile, target, tokenizer, drafter, name)
        save_profile(target, profile, sizes=args.sizes, contexts=args.contexts)
    print(describe_profile(profile, drafters, [str(p) for p in paths]))
    if args.out is not None:
        profile.cost_model(drafters[0] if drafters else None).save(args.out)
        print(f"wrote {args.out}")
    return 0


# The calibration prompts: of each benchmark, those after the first CALIBRATION_SKIP (which the
# held-out sets, the replay traces and the demo read), so a drafter is never calibrated on the
# prompts it is then measured on.
CALIBRATION_SETS = ("gsm8k", "mt-bench", "humaneval", "alpaca")
CALIBRATION_SKIP = 16


def calibration_rounds(target, tokenizer, drafter, *, prompts: int = 3, tokens: int = 64, policy=None):
    """(tree, `VerifyResult`) of each round of ``policy`` (default: 16-node trees, DominoTree over a
    drafter whose drafts carry a scorer, DDTree otherwise), drafting every round, over ``prompts``
    prompts of each `CALIBRATION_SETS` benchmark."""
    from treespec import registry
    from treespec.apps.data.datasets import encode_chat, load_prompts
    from treespec.decoding import SpeculativeDecoder

    if policy is None:
        policy = registry.create("policy", "dominotree" if drafter.role == "conditional" else "ddtree", budget=16)
    rounds = []
    decoder = SpeculativeDecoder(target, drafter, policy,
                                 on_round=lambda tree, result: rounds.append((tree, result)))
    for name in CALIBRATION_SETS:
        for prompt in load_prompts(name, limit=CALIBRATION_SKIP + prompts)[CALIBRATION_SKIP:]:
            decoder.generate(torch.tensor(encode_chat(tokenizer, prompt.turns[:1])), max_new_tokens=tokens)
    return rounds


def learn_policies(profile, target, tokenizer, drafter, label: str):
    """``profile`` with what each built-in learning policy that ``drafter`` can feed learned over it on
    the calibration prompts (16-node trees), kept for later runs (`TreePolicy.learned_state`)."""
    from treespec import registry

    for name in registry.builtin("policy"):
        cls = registry.resolve("policy", name)
        needs = cls.uses_scorer == "required"
        if not cls.learns or needs != (drafter.role == "conditional"):
            continue
        policy = registry.create("policy", name, budget=16)
        if policy.learned_state() is None:
            continue
        rounds = calibration_rounds(target, tokenizer, drafter, policy=policy)
        profile = profile.with_learned(name, drafter, policy.learned_state())
        print(f"learned {name} over {label}: {len(rounds)} rounds")
    return profile


def describe_profile(profile, drafters, names) -> str:
    """The measured samples beside the live-corrected curve (with the rounds each point rests on), C_d of
    each drafter and the break-even τ of a 16-node tree, profiled and live-corrected."""
    live = {(n, c): (s, r) for n, c, s, r in profile.live_verify}
    lines = [f"live correction: {profile.live_rounds} decoding rounds" if live else
             "live correction: none yet (a decoding run with --cost-model live leaves one)"]
    for n, c, s in profile.verify:
        corrected = (f"   live {1e3 * live[n, c][0]:8.2f} ms ({live[n, c][1]} rounds)" if (n, c) in live else "")
        lines.append(f"verify n={n:3d} ctx={c:5d}: profiled {1e3 * s:8.2f} ms{corrected}")
    for label, flag in (("profiled", False), ("live-corrected", True)):
        if flag and not live:
            continue
        steps = ", ".join(f"{n}: {profile.verify_in_steps(n, live=flag):.2f}" for n in (1, 2, 5, 17))
        lines.append(f"verify cost in AR steps, {label} (tokens: steps) {steps}")
    for drafter, name in zip(drafters, names):
        ident = drafter.identity()
        drafted = (f"; live {1e3 * profile.live_drafts[ident][0]:.2f} ms with the build "
                   f"({profile.live_drafts[ident][1]} rounds)" if ident in profile.live_drafts else "")
        even = f"{profile.break_even_tau(drafter, 16, live=False):.2f} profiled"
        if live or ident in profile.live_drafts:
            even += f", {profile.break_even_tau(drafter, 16):.2f} live-corrected"
        lines.append(f"draft {name}: {1e3 * profile.drafts[ident]:.2f} ms per round{drafted}; a 16-node tree "
                     f"breaks even with AR at tau {even}; calibration {profile.calibration(drafter).describe()}")
    return "\n".join(lines)
