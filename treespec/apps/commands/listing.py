"""``treespec list``: the names the registry resolves."""

from __future__ import annotations

import argparse

from treespec import registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", nargs="?", choices=registry.KINDS, help="only this kind")


def run(args: argparse.Namespace) -> int:
    for kind in [args.kind] if args.kind else registry.KINDS:
        print(f"{kind}: {', '.join(registry.available(kind))}")
    return 0
