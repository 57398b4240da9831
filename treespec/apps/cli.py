"""The ``treespec`` command.  Each subcommand lives in its own module, imported only when used.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``.  The apps' own
subcommands are listed in `treespec.apps.commands.SUBCOMMANDS`; those of other packages come from the registry (kind ``"command"``),
their help line from the first line of the module's docstring.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
from types import ModuleType

from treespec import registry
from treespec.apps.commands import SUBCOMMANDS, threads_from_env
from treespec.target import EngineUnavailable


def _registered() -> list[str]:
    """Subcommands registered by other packages (kind "command"), the apps' own names excluded."""
    return [name for name in registry.available("command") if name not in SUBCOMMANDS]


def _load(name: str) -> tuple[ModuleType, str]:
    """(module, one-line help) of subcommand ``name``."""
    if name in SUBCOMMANDS:
        module_name, help_text = SUBCOMMANDS[name]
        return importlib.import_module(module_name), help_text
    module = registry.resolve("command", name)
    return module, _help_line(module)


def _help_line(module: ModuleType) -> str:
    """The first sentence of a command module's docstring, without its ``treespec NAME`` prefix."""
    first = (module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    return re.sub(r"^``treespec [\w-]+``:\s*", "", first).split(". ")[0].rstrip(".")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: lists the subcommands (their own arguments load with them)."""
    parser = argparse.ArgumentParser(prog="treespec", description="Tree-based speculative decoding.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    for name in _registered():
        sub.add_parser(name, help=_load(name)[1], add_help=False)
    return parser


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (a test's capture, a redirected run)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def show_library_lines() -> None:
    """The library's log lines (``logging.getLogger("treespec")``: what it measured, what it healed) on
    stderr as ``treespec: MESSAGE``, from INFO up: what the commands show.  Once per process."""
    library = logging.getLogger("treespec")
    if not any(isinstance(h, _Stderr) for h in library.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("treespec: %(message)s"))
        library.addHandler(handler)
    if library.level in (logging.NOTSET, logging.WARNING):
        library.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    show_library_lines()
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in _registered()):
        build_parser().parse_args(argv or ["--help"])  # prints help or the "invalid choice" error
        return 2
    name, rest = argv[0], argv[1:]
    module, help_text = _load(name)
    parser = argparse.ArgumentParser(prog=f"treespec {name}", description=help_text)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    threads_from_env(args, parser)
    try:
        return int(module.run(args) or 0)
    except EngineUnavailable as exc:  # --engine NAME where its binding is missing: one line, whatever the command
        print(f"treespec {name}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line; what a command wrote as it went (records, shards) stays
        print(f"treespec {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
