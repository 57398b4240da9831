"""``treespec generate``: generate from a local model directory (optionally with a drafter), print text and stats."""

from __future__ import annotations

import argparse
import json
import sys

import attrs
import torch

from treespec import registry
from treespec.apps.assembly.methods import MethodSpec
from treespec.apps.commands import (
    DTYPES,
    add_engine_argument,
    add_exact_argument,
    add_threads_argument,
    check_model_digest,
    start_threads,
)
from treespec.interfaces import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="local Hugging Face model directory (see `treespec fetch-model`)")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--drafter", default=None,
                        help="DFlash/Domino checkpoint directory, or a registered drafter name (dflash, domino: the "
                             "checkpoints shipped for the embedded default; default: none, AR)")
    parser.add_argument("--policy", default="ddtree", choices=registry.available("policy"),
                        help="tree policy (cost-aware ones price trees with this machine's measured profile)")
    parser.add_argument("--budget", type=int, default=None, help="tree budget: non-root nodes (default: the policy's)")
    parser.add_argument("--verifier", default="match", choices=registry.available("verifier"),
                        help="match (any tree), rejection (chains only; point proposal), recursive-rejection or "
                             "traversal (sampled trees: ddtree-sampled, dominotree-sampled)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily; > 0 samples")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1: off)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    parser.add_argument("--stop-token-id", type=int, action="append", default=None,
                        help="stop at this id (repeatable; default: the tokenizer's EOS)")
    parser.add_argument("--dtype", default="auto", choices=sorted(DTYPES),
                        help="target dtype (auto: the faster of bf16 and fp32 here, measured once; bf16 on CUDA; "
                             "checkpoint: as stored)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    add_engine_argument(parser)
    add_exact_argument(parser, None)
    parser.add_argument("--cost-model", default="live",
                        help="what cost-aware policies price trees with: live (default: this machine's profile, "
                             "corrected by this generation's round times and saved), profile (as measured), or a "
                             "cost model JSON file / preset:NAME")
    parser.add_argument("--json", action="store_true", help="print the stats as JSON instead of a summary")
    parser.add_argument("--check", action="store_true",
                        help="also decode with the target alone (its AR, T = 0) and say whether the output equals it "
                             "token for token; where it does not, whether AR's top two logits there lay within the "
                             "engine's rounding (a near-tie decided the token: exit 0) or not (exit 1)")
    add_threads_argument(parser)


def typed_settings(args: argparse.Namespace) -> SamplingParams:
    """The numbers given, typed and checked once before anything loads (a ValueError names the flag)."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        MethodSpec(args.policy, None, args.budget)  # the method's budget rule
    except ValueError as exc:
        raise ValueError(f"--budget: {exc}") from None
    if args.check and args.temperature != 0:
        raise ValueError("--check compares with AR's greedy output: it takes --temperature 0")
    try:
        return SamplingParams.of(None, args.temperature, args.top_k, args.top_p)
    except ValueError as exc:  # named as the flags are
        raise ValueError("--" + str(exc).replace("top_k", "top-k").replace("top_p", "top-p")) from None


def _summary(stats) -> str:
    stages = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in stats.stage_totals().items())
    return (f"{stats.new_tokens} tokens, {len(stats.rounds)} rounds, mean tau {stats.mean_tau:.2f}, "
            f"{stats.tokens_per_second:.1f} tok/s (prefill {stats.prefill_time * 1e3:.1f} ms; {stages})")


def run(args: argparse.Namespace) -> int:
    from treespec.apps.api import generate
    from treespec.apps.assembly.cost_source import CostSource
    from treespec.apps.assembly.loading import drafter_source, load_target, load_tokenizer, model_path

    try:
        sampling = typed_settings(args)
        drafter = drafter_source(args.drafter, args.model)  # a bad drafter name refused before anything loads
        costs = CostSource.parse(args.cost_model)
        check_model_digest(args)
        start_threads(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"treespec generate: {'--drafter: ' if 'drafter' in str(exc) else ''}{exc}", file=sys.stderr)
        return 2
    try:
        target = load_target(args.model, dtype=DTYPES[args.dtype], device=args.device, engine=args.engine,
                             exact=args.exact)
        tokenizer = load_tokenizer(model_path(args.model, args.engine))  # after the file's own checks
    except (OSError, ValueError) as exc:
        print(f"treespec generate: cannot load {args.model}: {exc}", file=sys.stderr)
        return 2  # a model that does not load is a bad argument, as in bench and replay
    bad = [t for t in args.stop_token_id or () if not 0 <= t < target.vocab_size]
    if bad:
        print(f"treespec generate: --stop-token-id {bad[0]} is outside the vocabulary [0, {target.vocab_size})",
              file=sys.stderr)
        return 2
    try:
        out = generate(target, args.prompt, chat=args.chat, tokenizer=tokenizer,
                       drafter=drafter, policy=args.policy, budget=args.budget, verifier=args.verifier,
                       max_new_tokens=args.max_new_tokens, sampling=sampling,
                       stop_token_ids=args.stop_token_id, seed=args.seed, cost_model=costs)
    except (OSError, ValueError, TypeError, LookupError) as exc:
        print(f"treespec generate: {exc}", file=sys.stderr)
        return 1
    print(out.text)
    print(json.dumps(out.stats.as_dict()) if args.json else _summary(out.stats), file=sys.stderr)
    return _check(args, target, tokenizer, out.tokens.tolist()) if args.check and drafter is not None else 0


def _tree_tokens(args: argparse.Namespace) -> int:
    """The most tokens a tree of this run verifies: the budget asked for, else the policy's default, plus the root
    (a policy with no fixed budget, a chain: 16, the released drafters' block)."""
    cls = registry.resolve("policy", args.policy)
    field = attrs.fields_dict(cls).get("budget") if attrs.has(cls) else None
    default = field.default if field is not None and isinstance(field.default, int) else None
    return (args.budget or default or 16) + 1


def _check(args: argparse.Namespace, target, tokenizer, tokens: list[int]) -> int:
    """``--check``: the output against the target's own AR output; at the first difference, AR's top-two
    gap there against the target's rounding for trees of this budget (`treespec.target.Target.numerics`)."""
    from treespec.apps.api import encode_prompt, generate
    from treespec.apps.bench.lossless import decision_gap, first_difference

    ar = generate(target, args.prompt, chat=args.chat, tokenizer=tokenizer, max_new_tokens=args.max_new_tokens,
                  stop_token_ids=args.stop_token_id).tokens.tolist()
    k = first_difference(ar, tokens)
    if k is None:
        print(f"check: equal to AR's output token for token ({len(ar)} tokens)", file=sys.stderr)
        return 0
    ids = encode_prompt(args.prompt, tokenizer, args.chat)
    gap = decision_gap(target, ids, ar[:k], 0.0, 0)
    rounding = target.numerics(_tree_tokens(args)).tolerance
    where = (f"token {k} differs from AR's ({ar[k] if k < len(ar) else 'end'} there, "
             f"{tokens[k] if k < len(tokens) else 'end'} here); AR's top-two gap {gap:.4g}")
    if gap <= rounding:
        print(f"check: {where} is within the engine's rounding ({rounding:.3g}): a near-tie decided it",
              file=sys.stderr)
        return 0
    print(f"check: {where} exceeds the engine's rounding ({rounding:.3g}): NOT AR's output", file=sys.stderr)
    return 1
