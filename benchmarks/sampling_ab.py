"""A/B at T > 0 on the embedded default: deterministic trees under match verification against
sampled trees under recursive rejection sampling and traversal verification, on the same prompts
(docs/sampling.md).

For each temperature, every prompt is answered by DDTree@16 + match, ddtree-sampled@16 +
recursive-rejection, ddtree-sampled@16 + traversal, and the same three arms of DominoTree@16 (same
seed per prompt); prints mean tau per arm and the paired 95 % bootstrap intervals of the tau
differences, prompt by prompt: each sampled arm minus the deterministic one, and traversal minus
recursive rejection.

    python3 benchmarks/sampling_ab.py [--prompts 8] [--tokens 64] [--temperatures 0.6,1.0]
"""

from __future__ import annotations

import argparse

import torch

import treespec
from treespec.apps.assembly.embedded import embedded_model_dir
from treespec.apps.assembly.loading import embedded_drafter_dir, load_drafter, load_target
from treespec.apps.data.datasets import encode_chat, load_prompts

ARMS = [("ddtree", "match", "dflash"), ("ddtree-sampled", "recursive-rejection", "dflash"),
        ("ddtree-sampled", "traversal", "dflash"), ("dominotree", "match", "domino"),
        ("dominotree-sampled", "recursive-rejection", "domino"), ("dominotree-sampled", "traversal", "domino")]
PAIRS = [(("{0}-sampled", "recursive-rejection"), ("{0}", "match")), (("{0}-sampled", "traversal"), ("{0}", "match")),
         (("{0}-sampled", "traversal"), ("{0}-sampled", "recursive-rejection"))]


def paired_interval(diffs: torch.Tensor, resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, diffs.numel(), (resamples, diffs.numel()), generator=gen)
    means = diffs[idx].mean(1)
    return float(means.quantile(0.025)), float(means.quantile(0.975))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per dataset")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per answer")
    parser.add_argument("--temperatures", default="0.6,1.0")
    parser.add_argument("--datasets", default="gsm8k,humaneval,mt-bench,alpaca")
    args = parser.parse_args()
    model_dir = embedded_model_dir()
    target = load_target(model_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    drafters = {kind: load_drafter(embedded_drafter_dir(kind)) for kind in ("dflash", "domino")}
    prompts = [encode_chat(tokenizer, record.turns[:1]) for name in args.datasets.split(",")
               for record in load_prompts(name, limit=args.prompts)]
    print(f"{len(prompts)} prompts x {args.tokens} tokens; {torch.get_num_threads()} threads")
    for temperature in (float(t) for t in args.temperatures.split(",")):
        taus = {}
        for policy, verifier, kind in ARMS:
            taus[policy, verifier] = torch.tensor([
                treespec.generate(target, torch.tensor(ids), drafter=drafters[kind], policy=policy, budget=16,
                                  verifier=verifier, do_sample=True, temperature=temperature, seed=i,
                                  max_new_tokens=args.tokens).stats.mean_tau
                for i, ids in enumerate(prompts)], dtype=torch.float64)
            print(f"T={temperature} {policy}+{verifier}: tau {float(taus[policy, verifier].mean()):.3f}", flush=True)
        for base in ("ddtree", "dominotree"):
            for (a, va), (b, vb) in PAIRS:
                a, b = a.format(base), b.format(base)
                diff = taus[a, va] - taus[b, vb]
                lo, hi = paired_interval(diff)
                print(f"T={temperature} {a}+{va} - {b}+{vb}: {float(diff.mean()):+.3f} [{lo:+.3f}, {hi:+.3f}]",
                      flush=True)


if __name__ == "__main__":
    main()
