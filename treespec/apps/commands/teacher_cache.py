"""``treespec teacher-cache``: run the frozen target once over distill-data shards and store what
drafter training needs (hidden-state taps in bf16, the top-K next-token log-probs and the rest).

``treespec train-drafter --teacher DIR`` then trains without running the target.  Resumable: a
rerun skips the shards already written; a directory made with other settings is refused.  Layout
and contract: `treespec.apps.training.teacher`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from treespec.apps.commands import CPU_DTYPES, add_threads_argument, start_threads


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, required=True, help="directory of distill-data shards")
    parser.add_argument("--out", type=Path, required=True, help="cache directory (resumed if present)")
    parser.add_argument("--target", type=Path, default=None, help="local HF target directory (default: the embedded SmolLM2)")
    parser.add_argument("--layers", default=None,
                        help="comma-separated 0-based target layers to store (default: the training presets' "
                             "taps plus the last layer)")
    parser.add_argument("--top-k", type=int, default=32, help="teacher log-probs kept per position")
    parser.add_argument("--max-seq-len", type=int, default=384, help="sequences are cut at this length")
    parser.add_argument("--dtype", choices=CPU_DTYPES, default="auto", help="dtype of the target forward")
    add_threads_argument(parser)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the target runs")


def run(args: argparse.Namespace) -> int:
    from treespec.apps.assembly.loading import load_frozen_model
    from treespec.apps.training.teacher import TeacherCacheError, TeacherSpec, build_teacher_cache, default_cache_layers

    start_threads(args)
    try:
        layers = None if args.layers is None else tuple(int(x) for x in args.layers.split(","))
    except ValueError:
        print(f"treespec teacher-cache: --layers {args.layers!r} must be comma-separated integers", file=sys.stderr)
        return 2
    if not any(args.data.glob("shard-*.safetensors")):
        print(f"treespec teacher-cache: --data {args.data}: no distill-data shards (shard-*.safetensors)",
              file=sys.stderr)
        return 1
    try:
        target, _, identity = load_frozen_model(args.target, args.dtype, args.device, tokenizer=False)
        spec = TeacherSpec(layers or default_cache_layers(target.config.num_hidden_layers), args.top_k, args.max_seq_len)
        print(f"teacher cache of {identity['name']} (sha256 {identity['sha256'][:12]}…): layers "
              f"{list(spec.target_layer_ids)}, top {spec.top_k}, sequences cut at {spec.max_seq_len}", flush=True)
        paths = build_teacher_cache(target, args.data, args.out, spec, identity)
    except (TeacherCacheError, OSError, ValueError) as exc:
        print(f"treespec teacher-cache: {exc}", file=sys.stderr)
        return 1
    print(f"done: {len(paths)} shards in {args.out}")
    return 0
