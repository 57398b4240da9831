"""``treespec profile-cost``: measure verify (and draft) latency on this machine and fit a cost model.

Times one target forward over a tree of n nodes on top of a KV cache of ``ctx`` tokens, for several
n and ctx (median of repeats after a warm-up), and optionally one drafter round; fits the monotone
convex `ConvexCost` of policies/cost.py and writes it as JSON for cost-aware policies (CaDDTree).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from treespec.api import load_drafter, load_target
from treespec.commands import CPU_DTYPES, DTYPES
from treespec.interfaces import DraftContext
from treespec.target import TargetModel, crop_cache
from treespec.tree import DraftTree


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="local target directory (default: the embedded SmolLM2)")
    parser.add_argument("--drafter", type=Path, default=None, help="drafter checkpoint to time C_d (default: none, C_d = 0)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the cost model (JSON)")
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64", help="tree sizes n (nodes, root included)")
    parser.add_argument("--contexts", default="128,512", help="context lengths")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per point (median kept)")
    parser.add_argument("--dtype", choices=CPU_DTYPES, default="bfloat16")


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_verify(target: TargetModel, n: int, ctx: int, repeats: int, generator: torch.Generator) -> float:
    """Median seconds of one forward over an n-node chain on top of ``ctx`` cached tokens."""
    prompt = torch.randint(0, target.vocab_size, (ctx + 1,), generator=generator)
    target.prefill(prompt[:-1])  # the last token is the tree's root, as in decoding
    tree = DraftTree.chain(int(prompt[-1]), torch.randint(0, target.vocab_size, (n - 1,), generator=generator))

    def forward() -> None:
        target.forward_tree(tree)
        crop_cache(target.cache, target.length)  # drop the tree's rows: the next repeat sees the same cache

    return _median_seconds(forward, repeats)


def time_draft(target: TargetModel, drafter, ctx: int, repeats: int, generator: torch.Generator) -> float:
    """Median seconds of one drafter round with ``ctx`` cached context positions."""
    drafter.bind(target)
    sequence = torch.randint(0, target.vocab_size, (ctx + 1,), generator=generator)
    out = target.prefill(sequence[:-1], drafter.tap_layers)  # taps of every token before the anchor
    drafter.draft(DraftContext(sequence, out.features, 0))
    return _median_seconds(lambda: drafter.draft(DraftContext(sequence, None, ctx)), repeats)


def run(args: argparse.Namespace) -> int:
    from policies.cost import ConvexCost
    from treespec.embedded import embedded_model_dir

    target = load_target(args.model or embedded_model_dir(), dtype=DTYPES[args.dtype])
    gen = torch.Generator().manual_seed(0)
    sizes = [int(s) for s in args.sizes.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    samples = [(n, c, time_verify(target, n, c, args.repeats, gen)) for c in contexts for n in sizes]
    for n, c, s in samples:
        print(f"verify n={n:4d} ctx={c:5d}: {1e3 * s:8.2f} ms")
    draft = 0.0
    if args.drafter is not None:
        draft = time_draft(target, load_drafter(args.drafter, dtype=target.dtype), contexts[0], args.repeats, gen)
        print(f"draft ctx={contexts[0]}: {1e3 * draft:.2f} ms")
    model = ConvexCost.fit(samples, draft=draft)
    model.save(args.out)
    print(f"wrote {args.out}")
    return 0
