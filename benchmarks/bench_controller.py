"""The draft controller's regret against the best fixed choice, per regime, on recorded rounds.

    python benchmarks/bench_controller.py [--seeds 4] [--prior-error 1.0]
    python benchmarks/bench_controller.py --record [--prompts 6 --tokens 64]
    python benchmarks/bench_controller.py --curves NAME=PROFILE.json ...
    python benchmarks/bench_controller.py --overhead [--prompts 6 --tokens 64]

The first form drives `treespec.pricing.control.PricedController` (a live cost model over the
regime's prior) through `treespec.apps.replay.simulate` for every regime and prints, per regime, its
tokens per second against each fixed choice (AR, the full 16-node tree every round, the cost rule at
the true curve every round), its regret against the best of them, and its drafted, AR and exploring
rounds; ``--prior-error`` tells every controller a profile that many times off.  No model is run:
the clock is the regime's curve.

``--record`` runs DominoTree@16 over the embedded default (torch, its profiled dtype) on the demo's
prompts and writes treespec/assets/controller/rounds.json (each round's candidates in pop order and
the accepted ones; the demo's chat and math prompts, half each). ``--curves`` writes
treespec/assets/controller/curves.json from profile files of this machine's cache (``treespec
profile-cost`` makes them), keeping the entries not named.
``--overhead`` records the Domino drafter's drafts along DominoTree@16's rounds on the embedded default
(torch) and times, round by round on the same drafts, DominoTree@16's build against the cost-aware
DominoTree@16's round of work beside it: its controller's decision, its build at the decided price
and its controller's observation (the live cost model's update included).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[1] / "treespec" / "assets" / "controller"


def record(prompts: int, tokens: int) -> None:
    from treespec.apps.assembly.embedded import embedded_model_dir
    from treespec.apps.assembly.loading import embedded_drafter_dir
    from treespec.apps.assembly.session import Session

    session = Session.load(embedded_model_dir(), {"domino": embedded_drafter_dir("domino")})
    decoder = session.decoder("dominotree@16")
    rounds = []

    def keep(tree, result) -> None:
        if len(tree) > 1:
            rounds.append({"scores": [round(float(s), 5) for s in tree.scores[1:].tolist()],
                           "accepted": sorted(int(i) for i in result.accepted.tolist()[1:])})

    decoder.on_round = keep
    for prompt in demo_prompts(prompts):
        decoder.generate(session.chat.encode(prompt.turns[:1]), max_new_tokens=tokens)
    taus = [1 + len(r["accepted"]) for r in rounds]
    out = {"source": f"DominoTree@16 over the embedded Domino drafter, torch {session.target.describe()}, "
                     f"{prompts} demo prompts x {tokens} tokens, {platform.processor() or platform.machine()}",
           "budget": 16, "mean_tau": round(statistics.fmean(taus), 3), "rounds": rounds}
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / "rounds.json").write_text(json.dumps(out) + "\n")
    print(f"{len(rounds)} rounds, mean tau {out['mean_tau']} -> {DATA / 'rounds.json'}; torch {torch.__version__}")


def demo_prompts(count: int) -> list:
    """The demo's chat and math prompts, half each."""
    from treespec.apps.data.datasets import load_prompts

    demo = DATA.parent / "demo"
    return [p for name in ("chat", "math") for p in load_prompts(str(demo / f"{name}.jsonl"), limit=count // 2)]


def curves(named: list[str]) -> None:
    from treespec.pricing.profile import CostProfile

    path = DATA / "curves.json"
    data = json.loads(path.read_text()) if path.exists() else {"curves": {}}
    for item in named:
        name, _, file = item.partition("=")
        raw = json.loads(Path(file).read_text())
        profile = CostProfile.from_record(raw)
        drafter = next(k for k in profile.drafts if k.startswith("DominoDrafter"))
        cost = profile.cost_model(drafter, live=False)
        data["curves"][name] = {"source": f"{raw['key']['machine']['cpu']}, {raw['key']['dtype']}, "
                                          f"{raw['key']['machine']['threads']} thread(s), profile {Path(file).name}",
                                "curve": cost.to_dict()}
    path.write_text(json.dumps(data, indent=1) + "\n")


def overhead(prompts: int, tokens: int) -> None:
    import time

    from treespec.apps.assembly.embedded import embedded_model_dir
    from treespec.apps.assembly.loading import embedded_drafter_dir
    from treespec.apps.assembly.session import Session
    from treespec.interfaces import RoundReport, VerifyResult
    from treespec.steering import Steering

    session = Session.load(embedded_model_dir(), {"domino": embedded_drafter_dir("domino")})
    fixed, priced = session.decoder("dominotree@16"), session.decoder("cost-aware-dominotree@16")
    drafter, drafts = fixed.drafter, []
    draft = drafter.draft
    drafter.draft = lambda ctx: drafts.append(draft(ctx)) or drafts[-1]
    for prompt in demo_prompts(prompts):
        fixed.generate(session.chat.encode(prompt.turns[:1]), max_new_tokens=tokens)
    drafter.draft = draft
    policy, steering = priced.policy, Steering(priced.controller, priced.policy)
    steering.start()
    times = {"fixed build": [], "cost-aware round": []}
    for d in drafts:
        start = time.perf_counter()
        fixed.policy.build(d)
        times["fixed build"].append(time.perf_counter() - start)
        start = time.perf_counter()
        decision = steering.decide()
        tree = policy.priced(decision.price, decision.calibration).build(d)
        report = RoundReport(tree, VerifyResult(torch.zeros(1, dtype=torch.int64), 0), d.position,
                             {"draft": 0.01, "build": 0.001, "verify": 0.06, "commit": 0.001}, True)
        steering.report(report)
        times["cost-aware round"].append(time.perf_counter() - start)
    for name, values in times.items():
        mean, median = 1e3 * statistics.fmean(values), 1e3 * statistics.median(values)
        print(f"{name:<18} mean {mean:.2f} ms, median {median:.2f} ms over {len(values)} drafts")
    extra = statistics.fmean(times["cost-aware round"]) - statistics.fmean(times["fixed build"])
    print(f"the cost-aware round's own work beyond the fixed build: {1e3 * extra:.2f} ms; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")


def regret(seeds: int, prior_error: float) -> None:
    from treespec.pricing.control import PricedController
    from treespec.pricing.live_cost import LiveCost
    from treespec.apps.replay.simulate import (
        FIXED_CHOICES,
        fixed_rate,
        recorded_calibration,
        regimes,
        simulate,
        summary,
    )

    print(f"{'regime':<20}{'controller':>11}" + "".join(f"{c:>9}" for c in FIXED_CHOICES)
          + f"{'regret':>9}{'drafted':>9}{'AR':>7}{'explored':>9}")
    for name, regime in regimes(prior_error=prior_error).items():
        runs = []
        for seed in range(seeds):
            controller = PricedController(LiveCost(regime.prior), recorded_calibration(), 16)
            runs.append((summary(simulate(controller, regime, seed=seed)),
                         {c: fixed_rate(regime, c, seed=seed) for c in FIXED_CHOICES}))
        rate = statistics.fmean(s["rate"] for s, _ in runs)
        fixed = {c: statistics.fmean(f[c] for _, f in runs) for c in FIXED_CHOICES}
        best = max(fixed.values())
        counts = [statistics.fmean(s[k] for s, _ in runs) for k in ("drafted", "ar", "explored")]
        ar = fixed["ar"]
        print(f"{name:<20}{rate / ar:>10.3f}x" + "".join(f"{fixed[c] / ar:>8.3f}x" for c in FIXED_CHOICES)
              + f"{1 - rate / best:>8.1%}{counts[0]:>9.0f}{counts[1]:>7.0f}{counts[2]:>9.1f}")
    print(f"(rates over AR's; regret = 1 - controller / best fixed; mean of {seeds} seeds; prior error x{prior_error})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help="record rounds.json from the embedded default")
    parser.add_argument("--curves", nargs="+", metavar="NAME=PROFILE", help="write curves.json entries")
    parser.add_argument("--overhead", action="store_true", help="time the cost-aware round's own work")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--prior-error", type=float, default=1.0)
    args = parser.parse_args()
    if args.record:
        record(args.prompts, args.tokens)
    elif args.curves:
        curves(args.curves)
    elif args.overhead:
        overhead(args.prompts, args.tokens)
    else:
        regret(args.seeds, args.prior_error)


if __name__ == "__main__":
    main()
