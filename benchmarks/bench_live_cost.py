"""Live-corrected against profile-only pricing of the cost-aware methods, side by side, on this CPU.

For each of ``--profiles`` fresh cost profiles of the embedded SmolLM2 (measured anew, never read
from the cache), every method runs over the demo's prompts (chat, math and code; or
``--dataset``'s), prompt-major, so a slow moment of the machine hits every method alike: AR, the
fixed 16-node trees, and CaDDTree and the cost-aware DominoTree priced twice -- by the profile and
its calibration alone (``:profile``) and by their own live cost model over it with a calibration
learned live from the profile's (``:live``, the CLI's default). Printed per profile and method:
τ, tokens/s, speedup over AR, and for the cost-aware ones the mean absolute error of the predicted
round time of their drafted rounds (C_d + C_v(n; ctx) against the measured draft + build + verify
seconds; exploring rounds left out), by the profile alone and by the curve each round was priced
with (the live-corrected one for ``:live``).

``--hog F`` starts a CPU hog (a busy Python process) once a fraction F of the prompts is done and
stops it at the end, so the second part of the run is measured on a machine that suddenly got
slower; the table then gives each method's speed over AR before the hog and under it apart, beside
the whole run's, and the share of the drafted rounds that built a tree of more than one token
(a cost-aware method backs off to root-only trees when trees do not pay).  One process, the torch
threads as given (``--threads``; default torch's, the demo's).

``--root-only-arms`` adds each cost-aware method priced by the profile under the rule it had until
2026-12-03 (``:root-only``): a round whose best tree does not beat AR with its draft counted
returns the root-only tree, where the rule now verifies the tree that still gains over an AR step
once the draft is spent (policies/engine/cost.py); both back drafting off after such a round.

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

import attrs
import numpy as np
import torch

from treespec.apps.assembly.cost_source import CostSource
from treespec.apps.assembly.embedded import embedded_model_dir
from treespec.apps.assembly.loading import embedded_drafter_dir
from treespec.apps.assembly.methods import build_policy, parse_method
from treespec.apps.assembly.session import Session
from treespec.apps.bench.summary import bootstrap_interval
from treespec.apps.commands.demo import _DATASETS
from treespec.apps.data.datasets import load_prompts
from treespec.decoding import SpeculativeDecoder
from treespec.policies.ddtree import DDTree
from treespec.policies.dominotree import DominoTree
from treespec.policies.engine.cost import CostAwareStop
from treespec.pricing.conditions import ThreadControl
from treespec.pricing.profile import machine_profile

FIXED = ["ar", "ddtree@16", "dominotree@16"]
COST_AWARE = ["caddtree@16", "cost-aware-dominotree@16"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=int, default=3, help="fresh cost profiles, each with a full run")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per dataset")
    parser.add_argument("--dataset", action="append", default=None,
                        help="benchmark name or prompt file (repeatable; default: the demo's chat, math and code)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--hog", type=float, default=None, help="start a CPU hog after this fraction of the prompts")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--root-only-arms", action="store_true",
                        help="also price the cost-aware methods by the profile under the root-only rule of before")
    return parser.parse_args()


class RootOnlyStop(CostAwareStop):
    """The cost rule as it was until 2026-12-03: the root-only tree when the best does not beat AR."""

    def trim(self, draft, scores: torch.Tensor) -> int:
        theta = self._thetas(self._verify_table(draft, scores.numel()), self._phis(scores))  # [k + 1]
        best = int(theta.argmax())
        return best if float(theta[best]) > self._ar_rate(draft) else 0


def root_only_policy(method: str, model):
    """The method's tree under `RootOnlyStop`; the decoder's default verdict (any tree past the root
    paid) is then the rule's own."""
    stop = RootOnlyStop(model)
    return DDTree(budget=16, stop=stop) if method.startswith("caddtree") else DominoTree(budget=16, stop=stop)


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
        ThreadControl.start(args.threads)
    harness = Session.load(embedded_model_dir(), {k: embedded_drafter_dir(k) for k in ("dflash", "domino")},
                           dtype=args.dtype)
    target, drafters = harness.target, harness.drafters
    prompts = [p for name in args.dataset or _DATASETS for p in load_prompts(name, limit=args.prompts)]
    ids = [harness.chat.encode(p.turns[:1], []) for p in prompts]
    print(f"{torch.get_num_threads()} threads, {target.dtype}, {len(ids)} prompts x {args.max_new_tokens} tokens")
    cached = machine_profile(target, list(drafters.values()))  # only for the calibrations stored with it
    calibrations = {kind: cached.calibration(d) for kind, d in drafters.items()}
    print("calibrations (profile-cost --calibrate): "
          + ", ".join(f"{k} {c.describe()}" for k, c in calibrations.items()))
    for rep in range(args.profiles):
        start = time.perf_counter()
        profile = machine_profile(target, list(drafters.values()), repeats=9, cache=False)
        steps = " / ".join(f"{profile.verify_in_steps(n, live=False):.2f}" for n in (1, 2, 5, 17))
        print(f"\n## profile {rep + 1} ({time.perf_counter() - start:.0f} s): verify of 1 / 2 / 5 / 17 tokens = "
              f"{steps} AR steps", flush=True)
        decoders, models = make_arms(args, target, drafters, profile, calibrations)
        for decoder in decoders.values():  # warm-up
            decoder.generate(ids[0], max_new_tokens=8)
        tally, hogged = run_arms(args, decoders, models, ids)
        print_table(decoders, tally.times, tally.tokens, tally.taus, tally.errors, tally.trees, models,
                    tally.per_prompt, hogged=hogged)
        print_costs(tally.seconds, {name: d.policy.cost_model for name, d in decoders.items()
                                    if name.endswith(":live")}, models, ctx=int(statistics.median(p.numel() for p in ids)))
        print_stages(tally.stages)


def make_arms(args, target, drafters, profile, calibrations) -> tuple[dict, dict]:
    """(name -> decoder, name -> the profile's cost model of each priced arm): the fixed trees and every
    cost-aware method priced by the profile, live and (with --root-only-arms) by the root-only rule."""
    decoders, models = {}, {}
    hows = ("profile", "live") + (("root-only",) if args.root_only_arms else ())
    for name in FIXED + [f"{m}:{how}" for m in COST_AWARE for how in hows]:
        method = parse_method(name.partition(":")[0])
        drafter = drafters.get(method.drafter) if method.drafter else None
        pricing = ()
        if name.partition(":")[2]:
            model = profile.cost_model(drafter, live=False)
            models[name] = model
            priced = (model, calibrations[method.drafter])  # the CLI's rule, live or fixed
            pricing = CostSource(live=name.endswith(":live")).price(lambda: priced)
        policy = (root_only_policy(name, models[name]) if name.endswith(":root-only")
                  else build_policy(method, *pricing))
        decoders[name] = SpeculativeDecoder(target, drafter, policy)
    return decoders, models


@attrs.define
class Tally:
    """What the arms measured, keyed by arm (and by (arm, phase) where the hog splits a run)."""

    times: dict = attrs.field(factory=lambda: defaultdict(float))
    tokens: dict = attrs.field(factory=lambda: defaultdict(int))
    taus: dict = attrs.field(factory=lambda: defaultdict(list))
    errors: dict = attrs.field(factory=lambda: defaultdict(list))
    trees: dict = attrs.field(factory=lambda: defaultdict(list))  # whether each drafted round built past the root
    stages: dict = attrs.field(factory=lambda: defaultdict(lambda: defaultdict(float)))  # where decode time went
    seconds: dict = attrs.field(factory=lambda: defaultdict(list))  # (phase, what): fixed arms' stage seconds
    per_prompt: dict = attrs.field(factory=lambda: defaultdict(list))  # (seconds, tokens) per prompt, in order

    def add(self, name: str, phase: str, out, prompt_len: int, models: dict) -> None:
        for key in (name, (name, phase)):
            self.times[key] += out.stats.decode_time
            self.tokens[key] += out.stats.new_tokens
        self.per_prompt[name].append((out.stats.decode_time, out.stats.new_tokens))
        account(self.stages[name], out.stats)
        self.trees[name] += [r.tree_size > 1 for r in out.stats.rounds if r.drafted and not r.explored]
        if name in FIXED:
            collect(self.seconds, phase, name, out.stats.rounds)
        self.taus[name] += out.stats.taus
        if name in models:
            alone, live = round_errors(out, prompt_len, models[name])
            self.errors[name, "profile"] += alone
            self.errors[name, "live"] += live


def run_arms(args, decoders: dict, models: dict, ids) -> tuple[Tally, bool]:
    """Every arm on every prompt, prompt-major; the hog (--hog F) starts before prompt F * len(ids)."""
    tally, hog = Tally(), None
    for i, prompt in enumerate(ids):
        if args.hog is not None and hog is None and i >= args.hog * len(ids):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            print(f"(CPU hog started before prompt {i + 1})", flush=True)
        for name, decoder in decoders.items():
            out = decoder.generate(prompt, max_new_tokens=args.max_new_tokens)
            tally.add(name, "hog" if hog is not None else "quiet", out, prompt.numel(), models)
    if hog is not None:
        hog.kill()
    return tally, hog is not None


def collect(seconds, phase: str, name: str, rounds) -> None:
    """The fixed arms' measured stage seconds: AR steps, 17-token verifies, each drafter's draft + build."""
    for r in rounds:
        if not r.drafted and r.tree_size == 1:
            seconds[phase, "verify 1"].append(r.times["verify"])
        elif r.drafted and r.tree_size == 17:
            seconds[phase, "verify 17"].append(r.times["verify"])
            seconds[phase, f"draft {name}"].append(r.times.get("draft", 0.0) + r.times["build"])


def print_costs(seconds, live_models, models, ctx: int) -> None:
    """What the rounds cost, in AR steps of the same phase (mean and median), against the curves priced with."""
    print(f"\nmeasured, in AR steps of the same phase (mean / median; fixed arms' rounds), and the curves at "
          f"context {ctx}:")
    for phase in ("quiet", "hog"):
        ar = seconds[phase, "verify 1"]
        if not ar:
            continue
        mean, median = statistics.fmean(ar), statistics.median(ar)
        cells = [f"AR step {1000 * mean:.1f} / {1000 * median:.1f} ms"]
        for what in sorted({w for p, w in seconds if p == phase and w != "verify 1"}):
            xs = seconds[phase, what]
            cells.append(f"{what} {statistics.fmean(xs) / mean:.2f} / {statistics.median(xs) / median:.2f}")
        print(f"- {phase}: " + "; ".join(cells))
    for name, model in list(models.items()) + [(f"{n} (end)", m) for n, m in live_models.items()]:
        if name.endswith(":live"):
            continue
        costs = model.verify_costs(17, ctx)
        print(f"- {name}: verify 17 {float(costs[17] / costs[1]):.2f}, draft + build "
              f"{model.draft_cost / float(costs[1]):.2f} AR steps")


def account(into, stats) -> None:
    """Add one generation's decode time to ``into`` by where it went: the verify of trees and of AR
    steps (one-token forwards), draft + build, and the rest of the loop (commit, bookkeeping)."""
    staged = 0.0  # seconds of the verify, draft and build stages
    for r in stats.rounds:
        drafting = r.times.get("draft", 0.0) + r.times["build"]
        into["verify, trees" if r.tree_size > 1 else "verify, AR steps"] += r.times["verify"]
        into["draft + build"] += drafting
        staged += r.times["verify"] + drafting
        into["rounds"] += 1
    into["the rest"] += stats.decode_time - staged
    into["tokens"] += stats.new_tokens


def print_stages(stages) -> None:
    """Milliseconds per generated token, by stage, per method: where a method's time goes."""
    kinds = ("verify, trees", "verify, AR steps", "draft + build", "the rest")
    print("\n| method | rounds per token | " + " | ".join(f"{k} (ms/token)" for k in kinds) + " | total |")
    print("|---|---|" + "---|" * (len(kinds) + 1))
    for name, s in stages.items():
        cells = [f"{1000 * s[k] / s['tokens']:.1f}" for k in kinds]
        total = sum(s[k] for k in kinds)
        print(f"| {name} | {s['rounds'] / s['tokens']:.2f} | " + " | ".join(cells)
              + f" | {1000 * total / s['tokens']:.1f} |")


def speedup(times, tokens, key, ar_key) -> float:
    """Seconds per token of AR over the method's, on the same prompts."""
    return (times[ar_key] / tokens[ar_key]) / (times[key] / tokens[key])


def paired_interval(arm: list[tuple[float, int]], ar: list[tuple[float, int]], resamples: int = 2000,
                    digits: int = 2) -> str:
    """95 % bootstrap interval of the whole run's speedup over ``ar`` (AR, or another arm), prompts
    resampled in pairs."""
    a, b = np.array(arm), np.array(ar)  # [P, 2] (seconds, tokens)

    def ratio(idx) -> float:
        return float((b[idx, 0].sum() / b[idx, 1].sum()) / (a[idx, 0].sum() / a[idx, 1].sum()))

    lo, hi = bootstrap_interval(ratio, len(a), resamples, seed=0)
    return f"[{lo:.{digits}f}, {hi:.{digits}f}]"


def print_table(decoders, times, tokens, taus, errors, trees, models, per_prompt, hogged: bool) -> None:
    phases = " | before the hog | under the hog" if hogged else ""
    best = max((n for n in FIXED if n != "ar"), key=lambda n: speedup(times, tokens, n, "ar"))  # fastest fixed tree
    print(f"| method | tau | tok/s | speedup [95 % CI over prompts]{phases} | over {best} (paired) "
          "| trees of > 1 token | round-time error: profile alone | priced with |")
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if hogged else ""))
    for name in decoders:
        cells = [f"{statistics.fmean(taus[name]):.2f}", f"{tokens[name] / times[name]:.1f}",
                 f"{speedup(times, tokens, name, 'ar'):.2f}x {paired_interval(per_prompt[name], per_prompt['ar'])}"]
        if hogged:
            cells += [f"{speedup(times, tokens, (name, p), ('ar', p)):.2f}x" for p in ("quiet", "hog")]
        over = paired_interval(per_prompt[name], per_prompt[best], digits=3)
        cells.append(f"{speedup(times, tokens, name, best):.3f} {over}")
        cells.append(f"{100 * statistics.fmean(trees[name]):.0f} %" if trees[name] else "-")
        cells += [f"{100 * statistics.fmean(errors[name, how]):.0f} %" if errors[name, how] else "-"
                  for how in ("profile", "live")]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
