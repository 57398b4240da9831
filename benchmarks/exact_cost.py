"""What exactness costs: each engine's one-token step and 17-token verify on its exact path and its plain one.

Prints one Markdown table.  torch: the embedded SmolLM2 in ``--dtype`` with transformers' kernels against
treespec's batch-invariant ones (`treespec.engines.torch_exact`).  llama.cpp: the embedded Q4_1 file with
its own f16 K/V cache against the q8_0 one treespec runs by default, through treespec's target and, for the
one-token step, through a bare llama-cpp-python loop on a context of the same settings (what a user of the
binding would run).  Every arm decodes after the same 300-token prefix; the arms alternate, ``--repeats``
rounds of ``--steps`` calls each, and the median per call is printed.  Then treespec's whole AR loop on
llama.cpp (`SpeculativeDecoder` without a drafter: rounds, verifier, commit, stats) against a bare
binding loop (decode one token, argmax its logits) on the same q8_0 context, ``--tokens`` tokens after the
prefix, per token, alternating.

    python benchmarks/exact_cost.py [--dtype float32] [--threads N] [--repeats 7] [--steps 8]

Run it with the machine otherwise idle, and name the CPU when quoting it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from treespec.apps.assembly.embedded import embedded_gguf, embedded_model_dir
from treespec.apps.assembly.loading import load_target
from treespec.pricing.conditions import ThreadControl
from treespec.tree import DraftTree

PREFIX = 300


def _arms_torch(dtype: str) -> dict[str, Callable[[int], None]]:
    arms = {}
    for exact in (False, True):
        target = load_target(embedded_model_dir(), dtype=dtype, exact=exact)
        target.prefill(torch.randint(0, 30000, (PREFIX,), generator=torch.Generator().manual_seed(0)))
        name = "batch-invariant" if exact else "transformers"
        arms[f"torch {dtype}, {name}"] = _tree_calls(target)
    return arms


def _tree_calls(target) -> Callable[[int], None]:
    """size -> one forward of a chain of that many tokens on ``target``, dropped again."""
    def call(size: int) -> None:
        target.forward_tree(DraftTree.chain(5, list(range(6, 5 + size))))
        target.drop_tree()
    return call


def _arms_llama_cpp() -> dict[str, Callable[[int], None]]:
    arms = {}
    for cache in ("f16", "q8_0"):
        target = load_target(embedded_gguf(), engine="llama.cpp", exact=cache == "q8_0")
        target.prefill(torch.randint(0, 30000, (PREFIX,), generator=torch.Generator().manual_seed(0)))
        arms[f"llama.cpp, {cache} K/V (treespec)"] = _tree_calls(target)
        arms[f"llama.cpp, {cache} K/V (bare binding)"] = _bare_step(target)
    return arms


def _bare_step(target) -> Callable[[int], None]:
    """size -> a one-token llama_decode on ``target``'s own context through the binding alone (the cell
    removed after it, as the treespec arm drops its tree); None for trees (the bare loop is AR only)."""
    lib = target.llama_cpp
    batch = lib.llama_batch_init(1, 0, 1)

    def call(size: int) -> None:
        if size != 1:
            return
        batch.n_tokens, batch.token[0], batch.pos[0], batch.n_seq_id[0] = 1, 5, target.length, 1
        batch.seq_id[0][0], batch.logits[0] = 0, True
        lib.llama_decode(target._ctx, batch)
        lib.llama_get_logits_ith(target._ctx, -1)
        lib.llama_memory_seq_rm(lib.llama_get_memory(target._ctx), 0, target.length, -1)
    return call


def _ar_loops(tokens: int, repeats: int) -> tuple[float, float]:
    """(treespec's AR seconds per token, the bare loop's) on llama.cpp with a q8_0 cache, prefill left out."""
    import numpy as np

    from treespec.decoding import SpeculativeDecoder

    target = load_target(embedded_gguf(), engine="llama.cpp", exact=True)
    prompt = torch.randint(0, 30000, (PREFIX,), generator=torch.Generator().manual_seed(0))
    decoder, lib = SpeculativeDecoder(target), target.llama_cpp
    batch = lib.llama_batch_init(1, 0, 1)

    def bare() -> float:
        target.prefill(prompt[:-1])
        token, position, start = int(prompt[-1]), PREFIX - 1, time.perf_counter()
        for _ in range(tokens):
            batch.n_tokens, batch.token[0], batch.pos[0], batch.n_seq_id[0] = 1, token, position, 1
            batch.seq_id[0][0], batch.logits[0] = 0, True
            lib.llama_decode(target._ctx, batch)
            row = np.ctypeslib.as_array(lib.llama_get_logits_ith(target._ctx, -1), shape=(target.vocab_size,))
            token, position = int(row.argmax()), position + 1
        return (time.perf_counter() - start) / tokens

    def ours() -> float:
        stats = decoder.generate(prompt, max_new_tokens=tokens).stats
        return stats.decode_time / stats.new_tokens

    runs = [(ours(), bare()) for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: this machine's free cores)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--engines", default="torch,llama.cpp")
    parser.add_argument("--tokens", type=int, default=96, help="tokens of the AR loops on llama.cpp")
    args = parser.parse_args()
    threads = ThreadControl.start(args.threads).choice.threads
    engines = args.engines.split(",")
    arms = {**(_arms_torch(args.dtype) if "torch" in engines else {}),
            **(_arms_llama_cpp() if "llama.cpp" in engines else {})}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for name, call in arms.items():
            for size in (1, 17):
                call(size)  # warm
                start = time.perf_counter()
                for _ in range(args.steps):
                    call(size)
                times.setdefault((name, size), []).append((time.perf_counter() - start) / args.steps)
    print(f"{threads} threads, prefix {PREFIX} tokens, median of {args.repeats} x {args.steps} calls\n")
    print("| engine and path | one-token step (ms) | 17-token verify (ms) | verify in steps |")
    print("|---|---|---|---|")
    for name in arms:
        step, tree = (statistics.median(times[name, s]) * 1e3 for s in (1, 17))
        shown = f"{tree:.1f}" if "bare" not in name else "-"
        ratio = f"{tree / step:.2f}" if "bare" not in name else "-"
        print(f"| {name} | {step:.2f} | {shown} | {ratio} |")
    if "llama.cpp" in engines:
        ours, bare = _ar_loops(args.tokens, args.repeats)
        print(f"\nllama.cpp AR, {args.tokens} tokens (q8_0 K/V): treespec's loop {ours * 1e3:.2f} ms/token, a bare "
              f"binding loop {bare * 1e3:.2f} ms/token: {ours / bare:.3f}x")


if __name__ == "__main__":
    main()
