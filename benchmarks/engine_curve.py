"""The verify cost curve of each engine a target can run on: which regime a tree falls in.

For the torch target (the embedded default, in the dtype this machine chose) and each GGUF file on
llama.cpp (default: the embedded default's own Q4_1 file; ``--gguf`` adds others, a 16-bit
conversion say), a forward of 1, 2, 3, 5, 9, 17 and 33 tokens on top of a 128-token context, timed
as the cost profile times it (`treespec.pricing.profile.time_verify_sizes`: the sizes in turn within
each repeat, medians), printed in AR steps with the one-token step in ms and the tau a 16-node tree
would need to break even with AR (drafter cost left out: the verify alone).  Memory-bound engines
read their weights once for all the tree's rows (a 17-token verify near one or two steps);
compute-bound ones pay nearly per token (near 17).  ``--taps`` times the llama.cpp forwards with the
DFlash drafter's four taps copied out by the evaluation callback, as decoding with a drafter does.

    python benchmarks/engine_curve.py [--gguf FILE ...] [--threads N] [--repeats 9] [--taps]

Run it with the machine otherwise idle; it says the threads it used.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from treespec.apps.assembly.embedded import embedded_gguf, embedded_model_dir
from treespec.apps.assembly.loading import load_target
from treespec.pricing.conditions import ThreadControl
from treespec.pricing.profile import time_verify_sizes
from treespec.tree import DraftTree

SIZES = (1, 2, 3, 5, 9, 17, 33)
TAPS = (2, 11, 20, 29)  # the embedded DFlash drafter's (target_layer_ids 1, 10, 19, 28, plus one)


def curve(target, repeats: int, taps: tuple[int, ...] = ()) -> dict[int, float]:
    """Median seconds of a forward of each size on a 128-token context."""
    generator = torch.Generator().manual_seed(0)
    if not taps:
        return time_verify_sizes(target, SIZES, 128, repeats, generator)
    prompt = torch.randint(0, target.vocab_size, (129,), generator=generator)
    target.prefill(prompt[:-1], taps)
    seconds = {}
    for n in SIZES:
        tree = DraftTree.chain(int(prompt[-1]), torch.randint(0, target.vocab_size, (n - 1,), generator=generator))
        samples = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            target.forward_tree(tree, taps)
            samples.append(time.perf_counter() - start)
            target.drop_tree()
        seconds[n] = statistics.median(samples[1:])
    return seconds


def line(name: str, seconds: dict[int, float]) -> str:
    one = seconds[1]
    steps = " / ".join(f"{seconds[n] / one:.2f}" for n in SIZES)
    return f"{name:<58}{one * 1e3:>8.2f} ms   {steps}   {seconds[17] / one:>6.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", action="append", default=[], help="another GGUF file to time on llama.cpp")
    parser.add_argument("--threads", type=int, default=None, help="threads (default: the free cores)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--taps", action="store_true", help="also time llama.cpp with the drafter's taps")
    parser.add_argument("--no-torch", action="store_true", help="leave the torch target out")
    args = parser.parse_args()
    threads = ThreadControl.start(args.threads)
    print(f"threads: {threads.choice.describe()}")
    print(f"{'target (engine, weights)':<58}{'1 token':>11}   forward of {' / '.join(map(str, SIZES))} tokens in "
          "AR steps   16-node tree breaks even at tau")
    if not args.no_torch:
        torch_target = load_target(embedded_model_dir())
        print(line(f"torch, {str(torch_target.dtype).removeprefix('torch.')}", curve(torch_target, args.repeats)),
               flush=True)
        del torch_target
    for path in [embedded_gguf(), *args.gguf]:
        target = load_target(path, engine="llama.cpp")
        name = f"llama.cpp, {target.describe()}"
        print(line(name, curve(target, args.repeats)), flush=True)
        if args.taps:
            print(line(f"{name} + 4 taps", curve(target, args.repeats, TAPS)), flush=True)
        target.close()


if __name__ == "__main__":
    main()
