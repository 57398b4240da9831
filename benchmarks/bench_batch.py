"""Batched decoding on the embedded default: throughput at S = 1, 2, 4, 8, and the cache layout.

For each batch size S (each in a fresh process, so its peak resident memory is its own) the same
N prompts are decoded S at a time by `BatchDecoder` for AR and each method, after one untimed
warm-up batch per method; it prints generated tokens per second over the batches (prefill
included), the speedup over AR at the same S, mean τ and the peak RSS, and checks that every
method's tokens equal AR's.  ``--layouts`` times one verify forward of S trees over caches of
different lengths in the two layouts `TreeBatch` offers: padded (one cache row per sequence, what
`TorchBatch` runs) and ragged (every sequence's cache in one row, the trees' nodes in one
block-diagonal mask).

    OMP_NUM_THREADS=1 python benchmarks/bench_batch.py --threads 1
    python benchmarks/bench_batch.py --sizes 1 4 --prompts 4 --max-new-tokens 32
    python benchmarks/bench_batch.py --layouts
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from treespec.pricing.conditions import ThreadControl

METHODS = ("ar", "ddtree@16", "dominotree@16")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 4, 8], help="batch sizes S")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--prompts", type=int, default=8, help="prompts decoded at every S (a multiple of each S)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--layouts", action="store_true", help="time the padded and the ragged verify forward")
    parser.add_argument("--one-size", type=int, default=None, help=argparse.SUPPRESS)  # a child process
    return parser.parse_args()


def load(dtype: str):
    from treespec.apps.assembly.embedded import embedded_model_dir
    from treespec.apps.assembly.loading import embedded_drafter_dir
    from treespec.apps.assembly.session import Session

    harness = Session.load(embedded_model_dir(), {k: embedded_drafter_dir(k) for k in ("dflash", "domino")},
                           dtype=dtype)
    return harness


def prompts_of(harness, n: int) -> list[torch.Tensor]:
    from treespec.apps.data.datasets import load_prompts

    records = [p for name in ("gsm8k", "alpaca", "humaneval", "mt-bench") for p in load_prompts(name, seed=0, limit=n)]
    return [harness.chat.encode(r.turns[:1], []) for r in records[:n]]


def run_size(args: argparse.Namespace, size: int) -> dict:
    """Every method at batch size ``size``: tokens, seconds, τ; the process's peak RSS."""
    from treespec.apps.assembly.methods import parse_method

    harness = load(args.dtype)
    prompts = prompts_of(harness, args.prompts)
    methods = [parse_method(m) for m in args.methods]
    decoders = harness.decoders(methods, batched=True)
    stops = harness.stop_ids
    out = {"size": size, "methods": {}}
    for m in methods:  # warm-up: one short batch each
        decoders[m.name].generate(prompts[:size], max_new_tokens=8, stop_token_ids=stops)
    tokens: dict[str, list[list[int]]] = {}
    for m in methods:
        seconds, taus, tokens[m.name] = 0.0, [], []
        for start in range(0, len(prompts), size):
            begin = time.perf_counter()
            results = decoders[m.name].generate(prompts[start:start + size], max_new_tokens=args.max_new_tokens,
                                                stop_token_ids=stops)
            seconds += time.perf_counter() - begin
            tokens[m.name] += [r.tokens.tolist() for r in results]
            taus += [t for r in results for t in r.stats.taus]
        out["methods"][m.name] = {"tokens": sum(map(len, tokens[m.name])), "seconds": seconds,
                                  "tau": statistics.fmean(taus),
                                  "equal_ar": tokens[m.name] == tokens[methods[0].name]}
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def table(results: list[dict]) -> str:
    names = list(results[0]["methods"])
    head = "| S | " + " | ".join(f"{n} tok/s" for n in names) + " | " + \
        " | ".join(f"{n} speedup (τ)" for n in names[1:]) + " | peak RSS MiB | = AR |"
    lines = [head, "|" + "---|" * (3 + 2 * len(names) - 1)]
    for r in results:
        ms = r["methods"]
        rate = {n: ms[n]["tokens"] / ms[n]["seconds"] for n in names}
        speed = " | ".join(f"{rate[n] / rate[names[0]]:.2f}x ({ms[n]['tau']:.2f})" for n in names[1:])
        equal = "yes" if all(ms[n]["equal_ar"] for n in names) else "NO"
        lines.append(f"| {r['size']} | " + " | ".join(f"{rate[n]:.1f}" for n in names) + f" | {speed} | "
                     f"{r['peak_rss_mb']:.0f} | {equal} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the two layouts
def layouts(args: argparse.Namespace) -> None:
    """One verify forward of four trees of 17 nodes over caches of 32..1800 tokens: padded vs ragged."""
    from treespec.engines.torch import TorchBatch, crop_cache

    target = load(args.dtype).target
    gen = torch.Generator().manual_seed(0)
    for lengths in ((128, 128, 128, 128), (64, 128, 256, 512), (32, 32, 32, 480), (1024, 1024, 1024, 1024),
                    (256, 512, 1024, 1800)):
        prompts = [torch.randint(0, 1000, (n + 1,), generator=gen) for n in lengths]
        trees = [_bushy(int(p[-1]), gen) for p in prompts]
        batch = TorchBatch(target)
        batch.prefill(prompts)
        width = batch.width()

        def padded():
            batch.forward_trees(trees)
            crop_cache(batch.cache, width)

        ragged_cache, ragged_call = _ragged(target, prompts, trees)

        def ragged():
            ragged_call()
            crop_cache(ragged_cache, sum(lengths))

        times = {name: _median_ms(fn) for name, fn in (("padded", padded), ("ragged", ragged))}
        print(f"cache lengths {lengths}, 4 trees of 17 nodes: padded {times['padded']:.1f} ms, "
              f"ragged {times['ragged']:.1f} ms per verify forward", flush=True)


def _bushy(root: int, gen: torch.Generator):
    from treespec.tree import DraftTree

    parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, 17)]
    return DraftTree.build([root] + torch.randint(0, 1000, (16,), generator=gen).tolist(), parents)


def _ragged(target, prompts, trees):
    """Every sequence's cache in one row (prefilled under a block-diagonal causal mask) and a
    function running all trees' nodes at once under the block-diagonal tree mask."""
    from treespec.batch import TreeBatch
    from treespec.tree import additive_mask

    heads = [p[:-1] for p in prompts]
    total = sum(h.numel() for h in heads)
    cache = target.new_cache()
    causal = torch.block_diag(*(torch.ones(h.numel(), h.numel()).tril() for h in heads)).bool()
    positions = torch.cat([torch.arange(h.numel()) for h in heads])[None]
    target.run(torch.cat(heads)[None], additive_mask(causal, target.dtype)[None, None], positions, (),
                 logits_to_keep=1, cache=cache)
    batch = TreeBatch(trees)
    starts = torch.tensor([0] + [h.numel() for h in heads]).cumsum(0)
    sizes = [len(t) for t in trees]
    sees_prefix = torch.zeros(sum(sizes), total, dtype=torch.bool)
    row = 0
    for s, n in enumerate(sizes):
        sees_prefix[row:row + n, starts[s]:starts[s + 1]] = True
        row += n
    mask = additive_mask(torch.cat([sees_prefix, batch.block_mask()], dim=1), target.dtype)[None, None]
    node_positions = torch.cat([t.depths + h.numel() for t, h in zip(trees, heads, strict=True)])[None]
    tokens = torch.cat([t.tokens for t in trees])[None]
    return cache, lambda: target.run(tokens, mask, node_positions, (), cache=cache)


def _median_ms(fn, repeats: int = 7) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        ThreadControl.start(args.threads)
    torch.set_grad_enabled(False)
    if args.layouts:
        layouts(args)
        return
    if args.one_size is not None:
        print(json.dumps(run_size(args, args.one_size)))
        return
    from treespec.pricing.hardware import _cpu_model

    print(f"CPU: {_cpu_model()}; threads {torch.get_num_threads()}; dtype {args.dtype}; {args.prompts} prompts x "
          f"{args.max_new_tokens} new tokens at every S", flush=True)
    results = []
    for size in args.sizes:
        child = [sys.executable, str(Path(__file__).resolve()), "--one-size", str(size), "--prompts",
                 str(args.prompts), "--max-new-tokens", str(args.max_new_tokens), "--dtype", args.dtype,
                 "--methods", *args.methods] + (["--threads", str(args.threads)] if args.threads else [])
        done = subprocess.run(child, capture_output=True, text=True, check=False)
        if done.returncode:
            sys.exit(f"S = {size} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"S = {size} done", flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
