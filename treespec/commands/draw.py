"""``treespec draw``: render a draft tree as SVG/PNG, DOT or Mermaid.

The tree comes from a JSON record (``DraftTree.to_dict()`` fields, optionally ``"accepted"`` node
indices and ``"labels"``) or, with ``--model``, from a real round of a policy on a prompt.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from treespec import draw
from treespec.tree import DraftTree


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tree", type=Path, required=True, help="JSON file with tokens, parents[, scores, accepted, labels]")
    parser.add_argument("--out", type=Path, required=True, help="output file: .svg, .png, .dot or .mmd")
    parser.add_argument("--title", default=None, help="figure title (SVG/PNG only)")


def render(tree: DraftTree, out: Path, labels=None, accepted=None, title: str | None = None) -> Path:
    """Write ``tree`` to ``out`` in the format its suffix names."""
    writers = {".dot": draw.to_dot, ".mmd": draw.to_mermaid}
    if out.suffix in writers:
        out.write_text(writers[out.suffix](tree, labels, accepted))
        return out
    return draw.write_figure(tree, out, labels, accepted, title=title)


def run(args: argparse.Namespace) -> int:
    record = json.loads(args.tree.read_text())
    tree = DraftTree.from_dict(record)
    render(tree, args.out, record.get("labels"), record.get("accepted"), args.title)
    print(f"wrote {args.out} ({tree.budget} draft nodes, depth {tree.max_depth})")
    return 0
