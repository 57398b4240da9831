"""The decoder's draft back-off against the pricing of the cost-aware methods, side by side, on this CPU.

Every arm runs over the same prompts in one process, prompt-major (a slow moment of the machine hits
every arm alike): AR, the fixed DominoTree@16, and each cost-aware method of ``--methods`` once per
``--arms`` item ``PRICING:BACKOFF:PATIENCE`` -- PRICING ``profile`` (this machine's cached profile
and calibration, fixed), ``live`` (a `treespec.pricing.live_cost.LiveCost` over it and a
`treespec.pricing.calibration.LiveCalibration` from the profile's calibration: the CLI's default),
``live-cost`` (the live cost model, the profile's calibration fixed) or ``true-cd`` (the profile with
C_d set to ``--draft-steps`` AR steps: draft + build, what a drafted round really pays);
BACKOFF the most AR rounds between drafts (`treespec.decoding.DraftGate`, 0: draft every round);
PATIENCE the drafted rounds in a row that may fail to pay before the first back-off.  Each drafter
starts from the calibration stored with the profile.  Printed per arm: speed over AR (whole run),
the rounds that did not draft, and the calibration the arm ended with.  docs/decoding.md reports its figures.

    python benchmarks/bench_backoff.py --arms live:32:1 live:0:1 profile:32:1 true-cd:32:1 true-cd:0:1
    python benchmarks/bench_backoff.py --dataset gsm8k --dataset mt-bench --dataset humaneval \\
        --dataset alpaca --prompts 3 --passes 1 --arms live:32:1 live:32:3 live:0:1
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import attrs
import torch

from treespec.apps.assembly.cost_source import CostSource
from treespec.apps.assembly.embedded import embedded_model_dir
from treespec.apps.assembly.loading import embedded_drafter_dir
from treespec.apps.assembly.methods import build_policy, parse_method
from treespec.apps.assembly.session import Session
from treespec.apps.commands.demo import _DATASETS
from treespec.apps.data.datasets import load_prompts
from treespec.decoding import SpeculativeDecoder
from treespec.pricing.conditions import ThreadControl
from treespec.pricing.live_cost import LiveCost
from treespec.pricing.profile import machine_profile

PRICINGS = ("profile", "live", "live-cost", "true-cd")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=["live:32:1", "live:0:1", "profile:32:1"],
                        help="PRICING:BACKOFF:PATIENCE per arm, PRICING one of " + ", ".join(PRICINGS))
    parser.add_argument("--methods", nargs="+", default=["cost-aware-dominotree@16"])
    parser.add_argument("--dataset", action="append", default=None,
                        help="benchmark name or prompt file (repeatable; default: the demo's chat, math and code)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per dataset")
    parser.add_argument("--passes", type=int, default=2, help="passes over the prompts")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--draft-steps", type=float, default=0.33, help="C_d of the true-cd pricing, in AR steps")
    parser.add_argument("--threads", type=int, default=None)
    for kind in ("dflash", "domino"):
        parser.add_argument(f"--{kind}", default=None, metavar="DIR",
                            help=f"a {kind} drafter directory (default: the embedded one)")
    return parser.parse_args()


def parse_arm(text: str) -> tuple[str, int, int]:
    try:
        pricing, backoff, patience = text.split(":")
        arm = pricing, int(backoff), int(patience)
    except ValueError:
        sys.exit(f"--arms: expected PRICING:BACKOFF:PATIENCE, got {text!r}")
    if pricing not in PRICINGS or arm[1] < 0 or arm[2] < 1:
        sys.exit(f"--arms: PRICING one of {PRICINGS}, BACKOFF >= 0, PATIENCE >= 1; got {text!r}")
    return arm


def decoders(harness, profile, methods, arms, draft_steps: float) -> dict[str, SpeculativeDecoder]:
    """AR, the fixed DominoTree@16, and every cost-aware method under every arm."""
    target = harness.target
    out = {"ar": SpeculativeDecoder(target),
           "dominotree@16": SpeculativeDecoder(target, harness.drafters["domino"],
                                               build_policy(parse_method("dominotree@16")))}
    for name in methods:
        method = parse_method(name)
        drafter = harness.drafters[method.drafter]
        model = profile.cost_model(drafter, live=False)
        true_cd = attrs.evolve(model, draft=draft_steps * float(model.verify_costs(1, model.contexts[0])[1]))
        calibration = profile.calibration(drafter)
        for pricing, backoff, patience in arms:
            if pricing == "live":  # the CLI's default rule
                cost, calibrated = CostSource().price(lambda: (model, calibration))
            else:
                cost, calibrated = {"profile": model, "true-cd": true_cd}.get(pricing) or LiveCost(model), calibration
            decoder = SpeculativeDecoder(target, drafter, build_policy(method, cost, calibrated),
                                         draft_backoff=backoff)
            decoder.gate.patience = patience
            out[f"{method.name} {pricing} back-off {backoff} patience {patience}"] = decoder
    return out


def main() -> None:
    args = parse_args()
    if args.threads:
        ThreadControl.start(args.threads)
    arms = [parse_arm(a) for a in args.arms]
    dirs = {k: getattr(args, k) or embedded_drafter_dir(k) for k in ("dflash", "domino")}
    harness = Session.load(embedded_model_dir(), dirs)
    ids = [harness.chat.encode(p.turns[:1], []) for name in args.dataset or _DATASETS
           for p in load_prompts(name, limit=args.prompts)]
    profile = machine_profile(harness.target, list(harness.drafters.values()))
    runs = decoders(harness, profile, args.methods, arms, args.draft_steps)
    print(f"{torch.get_num_threads()} threads, {harness.target.dtype}, {len(ids)} prompts x {args.max_new_tokens} "
          f"tokens, {args.passes} passes")
    for decoder in runs.values():  # warm-up
        decoder.generate(ids[0], max_new_tokens=8)
    seconds, tokens, undrafted = defaultdict(float), defaultdict(int), defaultdict(int)
    for _ in range(args.passes):
        for prompt in ids:
            for name, decoder in runs.items():
                decoder.gate.reset()
                out = decoder.generate(prompt, max_new_tokens=args.max_new_tokens)
                seconds[name] += out.stats.decode_time
                tokens[name] += out.stats.new_tokens
                undrafted[name] += sum(not r.drafted for r in out.stats.rounds)
    ar = seconds["ar"] / tokens["ar"]
    print("\n| arm | speed over AR | rounds that did not draft | calibration at the end |\n|---|---|---|---|")
    for name, decoder in runs.items():
        calibration = getattr(decoder.policy, "calibration", None)
        described = "" if calibration is None else calibration.describe()
        print(f"| {name} | {ar / (seconds[name] / tokens[name]):.3f}× | {undrafted[name]} | {described} |")


if __name__ == "__main__":
    main()
