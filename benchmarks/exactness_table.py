"""The exactness table of docs/sampling.md: every sampled (policy, verifier) pair at T > 0.

Prints one Markdown row per (pair, setting): the chi-square statistic of the first two committed
tokens against the target's law (`treespec.apps.kit.exactness`), its p-value, the observed and the
detectable total-variation distance, and the mean tokens committed per round; then the biased
controls of tests/test_sampled_trees.py in the flat world, where they fail.

    python3 benchmarks/exactness_table.py [--samples 20000]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from treespec import registry
from treespec.apps.kit.exactness import ToyWorld, check_exactness
from treespec.interfaces import SamplingParams
from treespec.pricing.conditions import ThreadControl

SETTINGS = {"T = 1.0": SamplingParams(1.0), "T = 0.6": SamplingParams(0.6),
            "T = 1.0, top-p 0.8": SamplingParams(1.0, top_p=0.8)}


def row(label: str, setting: str, report) -> str:
    verdict = "exact" if report.exact() else "**biased**"
    return (f"| {label} | {setting} | {report.statistic:.1f} ({report.dof}) | {report.pvalue:.3g} | "
            f"{report.tv:.3f} | {report.detectable_tv:.3f} | {report.mean_tau:.2f} | {verdict} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20000, help="rounds per pair and setting")
    args = parser.parse_args()
    ThreadControl.start(1)
    sampled = [n for n in registry.builtin("policy") if registry.resolve("policy", n).samples_from_draft]
    print("| pair (B = 4) | setting | chi-square (dof) | p | TV | detectable TV | tau | verdict |")
    print("|---|---|---|---|---|---|---|---|")
    world = ToyWorld()
    for policy in sampled:
        for verifier in ("match", "recursive-rejection", "traversal"):
            for setting, sampling in SETTINGS.items():
                report = check_exactness(registry.create("policy", policy, budget=4),
                                         registry.create("verifier", verifier), sampling, samples=args.samples,
                                         world=world)
                print(row(f"{policy} + {verifier}", setting, report), flush=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_sampled_trees import KeepsPathAcceptance, KeepsRejectedInQ, RemovedMassDenominator, UnnormalisedResidual

    flat = ToyWorld(scale=0.5)
    for policy in sampled:
        for biased in (KeepsRejectedInQ, UnnormalisedResidual, RemovedMassDenominator, KeepsPathAcceptance):
            report = check_exactness(registry.create("policy", policy, budget=8), biased(), SETTINGS["T = 1.0"],
                                     samples=args.samples // 4, world=flat)
            print(row(f"{policy} + {biased.__name__} (flat world, B = 8)", "T = 1.0", report), flush=True)


if __name__ == "__main__":
    main()
