"""``treespec list``: the names the registry resolves, and every subcommand (treespec's own and
those other packages register)."""

from __future__ import annotations

import argparse

from treespec import registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", nargs="?", choices=registry.KINDS, help="only this kind")


def names(kind: str) -> list[str]:
    """What ``kind`` lists: the registry's names; for commands, treespec's own subcommands too."""
    if kind != "command":
        return registry.available(kind)
    from treespec.apps.commands import SUBCOMMANDS

    return sorted(set(SUBCOMMANDS) | set(registry.available("command")))


def run(args: argparse.Namespace) -> int:
    for kind in [args.kind] if args.kind else registry.KINDS:
        print(f"{kind}: {', '.join(names(kind))}")
    return 0
