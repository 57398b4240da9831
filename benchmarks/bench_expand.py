"""Micro-benchmark of `DominoScorer.expand`: cost per tree node versus top-M and node batch size.

For each model size (random weights of the right shapes) and each setting of the GRU input table,
it times ``expand(states [n, G], depth, top_m=M, k)`` at a corrected depth after the per-depth
gather is warm, and prints microseconds per parent node; the gather itself (once per round and
depth) and the full-vocabulary evaluation (M = V, through the ``nn`` modules) are printed
alongside.  Every figure in one table comes from the same run, so ratios are side by side.

    OMP_NUM_THREADS=1 python benchmarks/bench_expand.py --sizes smollm2 qwen3-4b
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from treespec.drafters.domino import DominoScorer
from treespec.pricing.conditions import ThreadControl

SIZES = {  # hidden H, GRU state G, correction bottleneck E, vocabulary V
    "smollm2": dict(hidden=576, gru=256, emb=256, vocab=49152),
    "qwen3-4b": dict(hidden=2560, gru=1024, emb=256, vocab=151936),
}
DEPTHS = 8  # drafted rows per round in the synthetic draft
DEPTH = 2  # a corrected depth (pure_draft_prefix_len = 1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--top-m", nargs="+", type=int, default=[16, 64, 256, 1024])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32, 128])
    parser.add_argument("--k", type=int, default=8, help="children per node (node_topk)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds of timed calls per cell")
    return parser.parse_args()


class Parts:
    """Random modules and one round's draft tensors at a given size."""

    def __init__(self, hidden: int, gru: int, emb: int, vocab: int, dtype: torch.dtype) -> None:
        torch.manual_seed(0)
        self.prefix_gru = nn.GRU(hidden, gru, batch_first=True, bias=False).to(dtype).requires_grad_(False)
        self.embed_proj = nn.Sequential(nn.Linear(hidden + gru, emb, bias=False), nn.SiLU(),
                                        nn.Linear(emb, vocab, bias=False)).to(dtype).requires_grad_(False)
        self.embed = nn.Embedding(vocab, hidden).to(dtype).requires_grad_(False)
        self.rows = torch.randn(DEPTHS, hidden).to(dtype)  # [L, H]
        self.base_logits = 3 * torch.randn(DEPTHS, vocab)  # [L, V] float32
        self.table: torch.Tensor | None = None

    def build_table(self) -> float:
        """Precompute W_ih e(t) for the whole vocabulary; returns the seconds it took."""
        start = time.perf_counter()
        w_ih = self.prefix_gru.weight_ih_l0
        self.table = torch.cat([chunk @ w_ih.T for chunk in self.embed.weight.split(8192)])  # [V, 3G]
        return time.perf_counter() - start

    def scorer(self, table: bool) -> DominoScorer:
        return DominoScorer(rows=self.rows, base_logits=self.base_logits, prefix_gru=self.prefix_gru,
                            embed_proj=self.embed_proj, embed=self.embed, anchor=1, pure_draft_prefix_len=1,
                            gru_table=self.table if table else None)


def timed(fn, min_time: float) -> float:
    """Median seconds of one call (after a warm-up call), repeating for at least ``min_time``."""
    return paired(fn, fn, min_time / 2)[0]


def paired(fn_a, fn_b, min_time: float) -> tuple[float, float]:
    """Median seconds of one call of each, calls alternated so machine noise hits both alike."""
    fn_a(), fn_b()
    samples: tuple[list[float], list[float]] = ([], [])
    while sum(samples[0]) + sum(samples[1]) < min_time or len(samples[0]) < 5:
        for fn, out in zip((fn_a, fn_b), samples, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(samples[0]), statistics.median(samples[1])


def per_node_table(parts: Parts, args: argparse.Namespace, states: dict[int, torch.Tensor]) -> None:
    print(f"  expand per node, microseconds (k = {args.k}); columns: batch n")
    print("  " + f"{'top_m':>7} {'table':>6} " + " ".join(f"{n:>9}" for n in args.batch))
    direct, tabled = parts.scorer(False), parts.scorer(True)
    for m in args.top_m:
        cells = [paired(lambda n=n, m=m: direct.expand(states[n], DEPTH, top_m=m, k=args.k),
                        lambda n=n, m=m: tabled.expand(states[n], DEPTH, top_m=m, k=args.k), 2 * args.min_time)
                 for n in args.batch]
        for index, label in ((0, "no"), (1, "yes")):
            print("  " + f"{m:>7} {label:>6} " + " ".join(f"{1e6 * c[index] / n:>9.1f}"
                                                         for c, n in zip(cells, args.batch, strict=True)))
        print("  " + f"{'':>7} {'ratio':>6} " + " ".join(f"{a / b:>8.1f}x" for a, b in cells))


def gather_and_reference(parts: Parts, args: argparse.Namespace, states: dict[int, torch.Tensor]) -> None:
    print("  once per round and depth: gather of the top-M candidates, milliseconds")
    for m in args.top_m:
        cost = timed(lambda m=m: parts.scorer(False)._candidates(DEPTH, m), args.min_time)
        print(f"  {m:>7} {1e3 * cost:>9.2f}")
    scorer = parts.scorer(False)
    for n in args.batch[:2]:
        cost = timed(lambda n=n: scorer.expand_reference(states[n], DEPTH, k=args.k), args.min_time) / n
        print(f"  full-vocabulary reference (M = V) per node at n = {n}: {1e6 * cost:.1f} us")


def main() -> None:
    args = parse_args()
    ThreadControl.start(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.dtype}")
    with torch.no_grad():
        for name in args.sizes:
            size = SIZES[name]
            print(f"\n{name}: H {size['hidden']}, G {size['gru']}, E {size['emb']}, V {size['vocab']}")
            parts = Parts(**size, dtype=dtype)
            print(f"  GRU input table [V, 3G] built in {parts.build_table():.2f} s, "
                  f"{parts.table.numel() * parts.table.element_size() / 2**20:.0f} MiB")
            gen = torch.Generator().manual_seed(1)
            states = {n: torch.randn(n, size["gru"], generator=gen).tanh().to(dtype) for n in args.batch}
            per_node_table(parts, args, states)
            gather_and_reference(parts, args, states)
            del parts


if __name__ == "__main__":
    main()
