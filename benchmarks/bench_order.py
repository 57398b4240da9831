"""Do the arms of a turn share the weather? An A/A test of the bench's order within a turn.

K identical arms (AR decoding of the embedded default, each its own decoder) answer the same
prompt turn after turn, while a CPU hog on another process comes and goes at random (on and off
for `--on` / `--off` seconds on average, exponential, seeded).  Identical arms must come out equal:
any arm whose pooled time per token differs from the others' beyond its interval is favoured or
hurt by its place in the order.  Two orders are measured side by side, turn by turn alternately:
"fixed" (every turn arm 1, 2, ..., K: the bench's earlier order, AR first) and "rotated" (turn t
starts at arm t mod K, as `treespec.apps.bench.measure.rotated` does now).  For each, the table
gives every arm's time per token over the mean of all arms, over all turns and over the turns no
other process disturbed (`treespec.pricing.conditions.LoadMeter`), with paired 95 % intervals
(turns resampled), and the spread of an arm's ratio turn by turn.

    python benchmarks/bench_order.py --turns 40 --threads 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import torch

from treespec.apps.assembly.embedded import embedded_model_dir
from treespec.apps.assembly.loading import load_target, load_tokenizer
from treespec.apps.bench.summary import bootstrap_interval
from treespec.apps.data.datasets import encode_chat, load_prompts
from treespec.decoding import SpeculativeDecoder
from treespec.pricing.conditions import LoadMeter, ThreadControl


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", type=int, default=4, help="identical AR arms per turn")
    parser.add_argument("--turns", type=int, default=40, help="turns per order")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the hog takes one of the cores)")
    parser.add_argument("--on", type=float, default=3.0, help="mean seconds the hog runs at a time")
    parser.add_argument("--off", type=float, default=3.0, help="mean seconds the hog rests at a time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resamples", type=int, default=2000)
    return parser.parse_args()


class Weather:
    """A CPU hog in another process that comes and goes at random (exponential on and off spells)."""

    def __init__(self, on: float, off: float, seed: int) -> None:
        self.on, self.off, self.rng = on, off, random.Random(seed)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            self.stop.wait(self.rng.expovariate(1 / self.on))
            hog.kill()
            hog.wait()
            self.stop.wait(self.rng.expovariate(1 / self.off))

    def __enter__(self) -> Weather:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def measure(args, decoders, prompts) -> dict[str, list[list[tuple[float, int, bool]]]]:
    """order -> per turn, per arm (in arm order): (seconds, tokens, disturbed); the two orders alternate."""
    rows = {"fixed": [], "rotated": []}
    k = len(decoders)
    for t in range(2 * args.turns):
        order_name = "fixed" if t % 2 == 0 else "rotated"
        ids = prompts[(t // 2) % len(prompts)]
        start = (t // 2) % k if order_name == "rotated" else 0
        row = [None] * k
        for arm in [(start + i) % k for i in range(k)]:
            meter = LoadMeter(args.threads)
            meter.start()
            out = decoders[arm].generate(ids, max_new_tokens=args.max_new_tokens, stop_token_ids=[])
            row[arm] = (out.stats.decode_time, out.stats.new_tokens, meter.stop().disturbed)
        rows[order_name].append(row)
    return rows


def report(name: str, rows: list[list[tuple[float, int, bool]]], resamples: int) -> None:
    """Each arm's time per token over the mean of the arms, all turns and undisturbed ones."""
    k = len(rows[0])
    clean = [row for row in rows if not any(cell[2] for cell in row)]
    print(f"\n{name} order: {len(rows)} turns, {len(rows) - len(clean)} disturbed")
    print("| arm | over the arms' mean, all turns [95% CI] | undisturbed turns [95% CI] | turn-by-turn spread |")
    print("|---|---|---|---|")
    for arm in range(k):
        cells = []
        for subset in (rows, clean):
            if not subset:
                cells.append("--")
                continue
            secs = np.array([[cell[0] / cell[1] for cell in row] for row in subset])  # [turns, arms] s/token

            def ratio(idx, secs=secs):
                return float(secs[idx, arm].sum() / (secs[idx].sum() / k))

            lo, hi = bootstrap_interval(ratio, len(subset), resamples, seed=arm)
            cells.append(f"{ratio(np.arange(len(subset))):.3f} [{lo:.3f}, {hi:.3f}]")
        per_turn = [row[arm][0] / row[arm][1] / statistics.fmean(c[0] / c[1] for c in row) for row in rows]
        print(f"| {arm + 1} | {cells[0]} | {cells[1]} | {statistics.pstdev(per_turn):.3f} |")


def main() -> None:
    args = parse_args()
    ThreadControl.start(args.threads)
    model = embedded_model_dir()
    target, tokenizer = load_target(model), load_tokenizer(model)
    prompts = [torch.tensor(encode_chat(tokenizer, p.turns[:1])) for p in load_prompts("humaneval", limit=8)]
    decoders = [SpeculativeDecoder(target) for _ in range(args.arms)]
    for decoder in decoders:  # warm-up
        decoder.generate(prompts[0], max_new_tokens=4)
    print(f"{args.arms} identical AR arms, {args.turns} turns per order, {args.max_new_tokens} tokens, "
          f"{args.threads} threads, {target.dtype}; hog on {args.on:g} s / off {args.off:g} s on average")
    start = time.perf_counter()
    with Weather(args.on, args.off, args.seed):
        rows = measure(args, decoders, prompts)
    print(f"({time.perf_counter() - start:.0f} s)")
    for name, measured in rows.items():
        report(name, measured, args.resamples)


if __name__ == "__main__":
    main()
