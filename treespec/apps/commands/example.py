"""``treespec example``: speculative decoding end to end on a small random target, checked against AR.

Builds a seeded random Qwen3-style target in float64 (no download), and the oracle drafter of
``drafters/oracle.py`` (it knows the target's greedy continuation and corrupts it, seeded, so that
acceptance is long but imperfect; its conditional variant carries a path-dependent scorer as
Domino does).  Runs AR, the chain, DDTree, CaDDTree and DominoTree through one `SpeculativeDecoder`
harness (a `Session`) and prints the mean acceptance length per method and whether its output equals AR's token
for token (it must: verification is lossless).
"""

from __future__ import annotations

import argparse

import torch

from treespec import registry
from treespec.apps.assembly.methods import parse_method
from treespec.apps.assembly.session import Session
from treespec.apps.commands import add_threads_argument, start_threads
from treespec.target import Target

_METHODS = ("ar", "dflash", "ddtree@16", "caddtree@16", "dominotree@16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=4, help="random prompts")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens per response")
    parser.add_argument("--seed", type=int, default=0, help="seeds the target, prompts and drafter corruption")
    add_threads_argument(parser)


def tiny_target(seed: int) -> Target:
    """A random 2-layer Qwen3 target in float64 (vocab 512), on the default engine."""
    from treespec.apps.assembly.loading import load_target
    from treespec.apps.kit.tiny import tiny_causal_lm

    return load_target(tiny_causal_lm(vocab=512, hidden=64, layers=2, max_positions=1024, init=0.3, seed=seed))


def run(args: argparse.Namespace) -> int:
    threads = start_threads(args)
    target = tiny_target(args.seed)
    oracle = {"dflash": registry.create("drafter", "oracle", config="typical", seed=args.seed),
              "domino": registry.create("drafter", "oracle", config="typical", seed=args.seed, conditional=True)}
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, 512, (12,), generator=gen) for _ in range(args.prompts)]
    outputs: dict[str, list[list[int]]] = {}
    print(f"random Qwen3 target (float64), {args.prompts} prompts x {args.max_new_tokens} tokens, T = 0\n")
    print(f"{'method':<15}{'drafter':<22}{'tau':>6}  output = AR")
    session = Session(target, drafters=oracle, threads=threads)  # prices CaDDTree's trees on this machine
    for name in _METHODS:
        method = parse_method(name)
        drafter = session.drafter(method)
        decoder = session.decoder(method)
        results = [decoder.generate(p, max_new_tokens=args.max_new_tokens) for p in prompts]
        outputs[name] = [r.tokens.tolist() for r in results]
        taus = [t for r in results for t in r.stats.taus]
        same = sum(a == b for a, b in zip(outputs[name], outputs["ar"]))
        label = "oracle (conditional)" if method.drafter == "domino" else ("oracle" if drafter else "-")
        print(f"{name:<15}{label:<22}{sum(taus) / len(taus):>6.2f}  {same}/{len(prompts)}")
    lossless = all(outputs[m] == outputs["ar"] for m in _METHODS)
    print("\nevery method's output equals AR's token for token" if lossless else "\nMISMATCH with AR")
    return 0 if lossless else 1
