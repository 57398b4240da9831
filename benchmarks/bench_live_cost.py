"""Live-corrected against profile-only pricing of the cost-aware methods, side by side, on this CPU.

For each of ``--profiles`` fresh cost profiles of the embedded SmolLM2 (measured anew, never read from
the cache), every method runs over the demo's prompts (chat, math and code; prompt-major, so a
slow moment of the machine hits every method alike): AR, the fixed 16-node trees, and CaDDTree and
the cost-aware DominoTree priced twice -- by the profile alone (``:profile``) and by their own live
cost model over it (``:live``).  Printed per profile and method: τ, tokens/s, speedup over AR, and for
the cost-aware ones the mean absolute error of the predicted round time of their drafted rounds
(C_d + C_v(n; ctx) against the measured draft + build + verify seconds; exploring rounds left out),
by the profile alone and by the curve each round was priced with (the live-corrected one for
``:live``).

``--hog F`` starts a CPU hog (a busy Python process) once a fraction F of the prompts is done and
stops it at the end, so the second part of the run is measured on a machine that suddenly got
slower.  One process, the torch threads as given (``--threads``; default torch's, the demo's).

    python benchmarks/bench_live_cost.py --profiles 3
    python benchmarks/bench_live_cost.py --profiles 1 --hog 0.5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch

from treespec.apps.bench import load_harness
from treespec.apps.commands.demo import _DATASETS
from treespec.apps.datasets import load_prompts
from treespec.apps.embedded import embedded_model_dir
from treespec.apps.methods import build_policy, embedded_drafter_dir, parse_method
from treespec.decoding import SpeculativeDecoder
from treespec.live_cost import LiveCost
from treespec.profile import machine_profile

FIXED = ["ar", "ddtree@16", "dominotree@16"]
COST_AWARE = ["caddtree@16", "cost-aware-dominotree@16"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=int, default=3, help="fresh cost profiles, each with a full run")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per domain (chat, math, code)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--hog", type=float, default=None, help="start a CPU hog after this fraction of the prompts")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    return parser.parse_args()


def predicted(model, ctx: int, drafted: bool, n: int) -> float:
    """C_d + C_v(n; ctx) of a drafted round (C_v alone for one that drafted nothing)."""
    costs = model.verify_costs(max(n, 1), ctx)
    return float(costs[n]) + (model.draft_cost if drafted else 0.0)


def round_errors(result, prompt_len: int, profile_model) -> tuple[list[float], list[float]]:
    """|predicted - measured| / measured per drafted round: by the profile alone, by the curve it was priced with."""
    alone, live = [], []
    ctx = prompt_len - 1
    for r in result.stats.rounds:
        measured = r.times["verify"] + (r.times.get("draft", 0.0) + r.times["build"] if r.drafted else 0.0)
        model = r.priced_with
        if model is not None and not r.explored:
            alone.append(abs(predicted(profile_model, ctx, r.drafted, r.tree_size) - measured) / measured)
            live.append(abs(predicted(model, ctx, r.drafted, r.tree_size) - measured) / measured)
        ctx += r.tau
    return alone, live


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    harness = load_harness(embedded_model_dir(), {k: embedded_drafter_dir(k) for k in ("dflash", "domino")},
                           dtype=args.dtype)
    target, drafters = harness.target, harness.drafters
    prompts = [p for name in _DATASETS for p in load_prompts(name, limit=args.prompts)]
    ids = [harness.chat.encode(p.turns[:1], []) for p in prompts]
    print(f"{torch.get_num_threads()} threads, {target.dtype}, {len(ids)} prompts x {args.max_new_tokens} tokens")
    for rep in range(args.profiles):
        start = time.perf_counter()
        profile = machine_profile(target, list(drafters.values()), repeats=9, cache=False)
        steps = " / ".join(f"{profile.verify_in_steps(n, live=False):.2f}" for n in (1, 2, 5, 17))
        print(f"\n## profile {rep + 1} ({time.perf_counter() - start:.0f} s): verify of 1 / 2 / 5 / 17 tokens = "
              f"{steps} AR steps", flush=True)
        decoders, models = {}, {}
        for name in FIXED + [f"{m}:{how}" for m in COST_AWARE for how in ("profile", "live")]:
            method = parse_method(name.partition(":")[0])
            drafter = drafters.get(method.drafter) if method.drafter else None
            pricing = ()
            if name.partition(":")[2]:
                model = profile.cost_model(drafter, live=False)
                models[name] = model
                pricing = (LiveCost(model) if name.endswith(":live") else model, 1.0)
            decoders[name] = SpeculativeDecoder(target, drafter, build_policy(method, *pricing))
        for decoder in decoders.values():  # warm-up
            decoder.generate(ids[0], max_new_tokens=8)
        times, tokens, taus, errors = defaultdict(float), defaultdict(int), defaultdict(list), defaultdict(list)
        hog = None
        for i, prompt in enumerate(ids):
            if args.hog is not None and hog is None and i >= args.hog * len(ids):
                hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                print(f"(CPU hog started before prompt {i + 1})", flush=True)
            for name, decoder in decoders.items():
                decoder.gate.reset()
                out = decoder.generate(prompt, max_new_tokens=args.max_new_tokens)
                times[name] += out.stats.decode_time
                tokens[name] += out.stats.new_tokens
                taus[name] += out.stats.taus
                if name in models:
                    alone, live = round_errors(out, prompt.numel(), models[name])
                    errors[name, "profile"] += alone
                    errors[name, "live"] += live
        if hog is not None:
            hog.kill()
        ar = times["ar"] / tokens["ar"]
        print("| method | tau | tok/s | speedup | round-time error: profile alone | priced with |")
        print("|---|---|---|---|---|---|")
        for name in decoders:
            per = times[name] / tokens[name]
            if name in models:
                err = (f"{100 * statistics.fmean(errors[name, 'profile']):.0f} % | "
                       f"{100 * statistics.fmean(errors[name, 'live']):.0f} %")
            else:
                err = "- | -"
            print(f"| {name} | {statistics.fmean(taus[name]):.2f} | {1 / per:.1f} | {ar / per:.2f}x | {err} |",
                  flush=True)


if __name__ == "__main__":
    main()
