"""The trees of S drafts: one compact build per draft against the stacked frontier, side by side.

For each policy, budget B and batch size S it times, on the same S fresh drafts, (a) what
`grow_batch` does without stacking -- the top-k of all drafts at once, then one compact build per
draft -- and (b) the stacked static frontier that grows the S trees together
(policies/engine/stacked.py), alternating the two, and prints the median ms per batch, their ratio and
whether the trees are identical.  `policies/engine/frontier.py`'s ``_STACKED_CELLS_MAX`` (the CPU rule
for which to use) is read off this table.

Drafts: marginal rows N(0, scale^2) over V = 49152 (SmolLM2); DominoTree over random Domino parts
of SmolLM2 size (H 576, G 256, E 64, M 64, node_topk 8), depth 7 (block 8) as the embedded drafters.

    python benchmarks/bench_build_batch.py --threads 1
    python benchmarks/bench_build_batch.py --sizes 8 --budgets 16 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_build import SIZES, DominoParts, marginal_draft

from treespec.policies.ddtree import DDTree
from treespec.policies.dominotree import DominoTree
from treespec.policies.engine.frontier import expand_frontier, expand_frontier_batch, resolve_batch
from treespec.policies.engine.stacked import stack_sources
from treespec.pricing.conditions import ThreadControl
from treespec.pricing.hardware import machine_identity

VOCAB, DEPTH = 49152, 7


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[2, 4, 8], help="batch sizes S")
    parser.add_argument("--budgets", nargs="+", type=int, default=[16, 64, 256])
    parser.add_argument("--rounds", type=int, default=9, help="timed batches per cell (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return parser.parse_args()


def alone(policy, drafts):
    budgets = [policy.max_nodes(d) for d in drafts]
    sources = resolve_batch([policy.candidates(d) for d in drafts], budgets, "compact")
    return [expand_frontier(d, s, b, policy.stop) for d, s, b in zip(drafts, sources, budgets, strict=True)]


def stacked(policy, drafts):
    budgets = [policy.max_nodes(d) for d in drafts]
    stack = stack_sources(resolve_batch([policy.candidates(d) for d in drafts], budgets, "static"))
    return expand_frontier_batch(drafts, stack, budgets, policy.stop)


def cell(policy, make_drafts, rounds: int) -> tuple[float, float, bool]:
    times = {"alone": [], "stacked": []}
    same = True
    for r in range(rounds):
        trees = {}
        for name, build in (("alone", alone), ("stacked", stacked))[:: 1 if r % 2 else -1]:
            drafts = make_drafts(r)  # fresh: a scorer caches its per-round gathers
            start = time.perf_counter()
            trees[name] = build(policy, drafts)
            times[name].append(1e3 * (time.perf_counter() - start))
        same &= all(a.equal(b) for a, b in zip(trees["alone"], trees["stacked"], strict=True))
    return statistics.median(times["alone"]), statistics.median(times["stacked"]), same


def main() -> None:
    args = parse_args()
    if args.threads:
        ThreadControl.start(args.threads)
    print(f"machine: {machine_identity()}; V = {VOCAB}, L = {DEPTH}")
    parts = DominoParts(VOCAB, **SIZES[VOCAB], scale=4.0)
    print("| policy | B | S | cells per level | S compact builds (ms) | stacked (ms) | stacked / compact "
          "| same trees |")
    print("|---|---|---|---|---|---|---|---|")
    for budget in args.budgets:
        for name, policy, draft, width in (
                ("ddtree", DDTree(budget=budget), lambda s: marginal_draft(VOCAB, 4.0, s, DEPTH), budget),
                ("dominotree", DominoTree(budget=budget), lambda s: parts.draft(s, DEPTH), 64)):
            for size in args.sizes:
                def make(r, size=size, draft=draft):
                    return [draft(1000 * r + i) for i in range(size)]
                compact_ms, stacked_ms, same = cell(policy, make, args.rounds)
                print(f"| {name} | {budget} | {size} | {budget * width} | {compact_ms:.2f} | {stacked_ms:.2f} | "
                      f"{stacked_ms / compact_ms:.2f} | {'yes' if same else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
