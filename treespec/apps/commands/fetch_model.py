"""``treespec fetch-model``: fetch and convert the embedded default model once, then greedy-check it."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from treespec.apps.assembly.embedded import EmbeddedError, embedded_model_dir, load_embedded

_CHECK_PROMPT = "What is the capital of France?"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="cache root (default $TREESPEC_CACHE or ~/.cache/treespec)")
    parser.add_argument("--no-check", action="store_true", help="skip the greedy generation check")


def _greedy_check(root: Path | None) -> str:
    model, tokenizer = load_embedded(torch.bfloat16, root=root)
    messages = [{"role": "user", "content": _CHECK_PROMPT}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids  # [1, P]
    out = model.generate(ids, max_new_tokens=32, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    try:
        model_dir = embedded_model_dir(root=args.cache_dir)
    except EmbeddedError as exc:
        print(f"treespec fetch-model: {exc}", file=sys.stderr)
        return 1
    print(f"embedded model ready at {model_dir} ({time.perf_counter() - start:.1f} s)")
    if not args.no_check:
        print(f"greedy check: {_CHECK_PROMPT!r} -> {_greedy_check(args.cache_dir)!r}")
    return 0
