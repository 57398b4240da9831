"""Data-pass throughput: generated tokens per second with and without continuous batching, side by side.

Both arms answer the same training prompts with the same target, greedy, ``--batch-size`` rows:

- ``static``: the prompts in groups of ``--batch-size``, sorted by length; a row leaves its group
  when it stops, but nothing takes its place, so the group's last steps run few rows;
- ``continuous``: one `ContinuousBatch` of ``--batch-size`` rows over all prompts (what
  ``treespec distill-data`` does): a row that stops hands its place to the next prompt.

Arms alternate ``--repeats`` times so a change in the machine's load hits both.  Prints, per arm,
the generated tokens, the wall time, tokens per second, forward calls and the mean share of the
batch's rows that a decode step ran (occupancy).  Pin threads (``--threads``) for a per-core figure.

    OMP_NUM_THREADS=1 python benchmarks/bench_distill.py --prompts 96 --batch-size 48 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

from treespec.apps.assembly.loading import load_frozen_model
from treespec.apps.commands.distill_data import _encoded_prompts, _stop_and_pad
from treespec.apps.data.continuous_batch import ContinuousBatch, Job
from treespec.apps.data.selfdistill import DistillConfig
from treespec.pricing.conditions import ThreadControl
from treespec.pricing.hardware import machine_identity


class _Rows:
    """Forwards to a model; counts decode steps and the rows they ran."""

    def __init__(self, model):
        self.model, self.steps, self.rows, self.calls = model, 0, 0, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *, input_ids, **kwargs):
        self.calls += 1
        if input_ids.shape[1] == 1:
            self.steps, self.rows = self.steps + 1, self.rows + input_ids.shape[0]
        return self.model(input_ids=input_ids, **kwargs)


def _decode(model, groups: list[list[list[int]]], args, stops: list[int], pad: int) -> int:
    """Tokens generated answering ``groups``, one continuous batch per group."""
    tokens = 0
    for group in groups:
        batch = ContinuousBatch(model, size=args.batch_size, max_new_tokens=args.max_new_tokens, stop_ids=stops,
                                pad_id=pad)
        for i, prompt in enumerate(group):
            batch.submit(Job(i, prompt))
        tokens += sum(len(done.response) for done in batch.run())
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=96, help="Alpaca training prompts answered by each arm")
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="times each arm runs (alternating)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        ThreadControl.start(args.threads)
    model, tokenizer, _ = load_frozen_model(None, args.dtype)
    stops, pad = _stop_and_pad(model, tokenizer)
    prompts, _, _ = _encoded_prompts(DistillConfig(num_prompts=args.prompts), tokenizer)
    ids = [list(p) for _, p in prompts]
    by_length = sorted(ids, key=len)
    arms = {"static": [by_length[i:i + args.batch_size] for i in range(0, len(ids), args.batch_size)],
            "continuous": [ids]}
    print(f"machine: {machine_identity()}; {str(model.dtype).removeprefix('torch.')}, {len(ids)} prompts, "
          f"batch {args.batch_size}, up to {args.max_new_tokens} new tokens, greedy", flush=True)
    results: dict[str, list[tuple[int, float, _Rows]]] = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, groups in arms.items():
            counted = _Rows(model)
            start = time.perf_counter()
            tokens = _decode(counted, groups, args, stops, pad)
            results[name].append((tokens, time.perf_counter() - start, counted))
    print(f"{'arm':<12}{'tokens':>8}{'seconds':>9}{'tok/s':>8}{'forwards':>10}{'occupancy':>11}")
    for name, runs in results.items():
        tokens, seconds, counted = runs[0][0], statistics.median(r[1] for r in runs), runs[0][2]
        occupancy = counted.rows / max(counted.steps * args.batch_size, 1)
        print(f"{name:<12}{tokens:>8}{seconds:>9.1f}{tokens / seconds:>8.1f}{counted.calls:>10}{occupancy:>11.0%}")
    rate = {name: runs[0][0] / statistics.median(r[1] for r in runs) for name, runs in results.items()}
    ratio = rate["continuous"] / rate["static"]
    print(f"continuous / static tokens per second: {ratio:.2f}x (same prompts; token counts differ only "
          f"where batch rounding flips a near-tie)")


if __name__ == "__main__":
    main()
