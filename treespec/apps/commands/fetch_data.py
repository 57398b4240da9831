"""``treespec fetch-data``: put a benchmark's prompts into the data folder once, from the hub or a local file.

The data folder is ``$TREESPEC_DATA_DIR``, else ``data/`` in the treespec cache
(`treespec.apps.data.datasets.data_dir`); bench, replay and the training tools read a benchmark
there first, offline.  ``--from FILE`` copies a file you have (checked to hold that benchmark's
rows); without it the rows come from the Hugging Face hub through the ``datasets`` library
(``pip install treespec[data]``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from treespec.apps.data.datasets import BENCHMARKS

    kept = sorted(n for n, s in BENCHMARKS.items() if s.local_file)
    parser.add_argument("names", nargs="+", choices=kept, metavar="NAME", help=f"benchmarks: {', '.join(kept)}")
    parser.add_argument("--from", dest="source", type=Path, default=None,
                        help="a local .json/.jsonl file of the benchmark's rows (one NAME only)")
    parser.add_argument("--overwrite", action="store_true", help="replace a file the data folder holds already")


def run(args: argparse.Namespace) -> int:
    from treespec.apps.data.datasets import DatasetError, data_dir, fetch_benchmark

    if args.source is not None and len(args.names) != 1:
        print("treespec fetch-data: --from names the file of one benchmark; give one NAME", file=sys.stderr)
        return 2
    for name in args.names:
        try:
            path = fetch_benchmark(name, args.source, overwrite=args.overwrite)
        except DatasetError as exc:
            print(f"treespec fetch-data: {exc}", file=sys.stderr)
            return 2 if args.source is not None else 1
        print(f"{name}: {path}")
    print(f"data folder: {data_dir()}")
    return 0
