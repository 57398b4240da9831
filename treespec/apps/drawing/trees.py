"""Drawing draft trees: SVG/PNG through networkx + matplotlib, DOT and Mermaid text for docs.

Contract: every renderer takes a `DraftTree`, optional node labels (a callable ``token -> str``,
e.g. a tokenizer's decode, or a sequence of strings per node) and an optional accepted path (node
indices from the root); `write_side_by_side` draws several trees in one figure and outlines
the nodes it is told to mark.  Every non-root node shows its label and, below it, its path log-prob
score.  Accepted nodes and the edges between them are highlighted.  Output is deterministic for a
given tree, so generated docs are reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from treespec.tree import DraftTree

__all__ = ["Panel", "node_labels", "to_dot", "to_mermaid", "tree_layout", "write_figure", "write_side_by_side"]

Labels = Callable[[int], str] | Sequence[str] | None

_ACCEPTED = "#2e7d32"  # green: accepted path
_PLAIN = "#90a4ae"  # grey-blue: drafted, not accepted


def node_labels(tree: DraftTree, labels: Labels = None, *, scores: bool = True) -> list[str]:
    """One display string per node: its label (the token id, a callable's text for it, or the given
    string) and, below it, its path log-prob score (the root has none)."""
    tokens, values = tree.tokens.tolist(), tree.scores.tolist()
    if labels is not None and not callable(labels):
        if len(labels) != len(tree):
            raise ValueError(f"got {len(labels)} labels for a tree of {len(tree)} nodes")
        text = [str(s) for s in labels]
    else:
        text = [labels(t) if labels else str(t) for t in tokens]
    if not scores:
        return text
    return [t if i == 0 else f"{t}\n{values[i]:.2f}" for i, t in enumerate(text)]


def tree_layout(tree: DraftTree) -> dict[int, tuple[float, float]]:
    """Layered layout: leaves on consecutive x slots in depth-first order, parents centred above."""
    pos: dict[int, tuple[float, float]] = {}
    next_slot = 0.0

    def place(node: int) -> float:
        nonlocal next_slot
        kids = tree.children[node]
        if kids:
            xs = [place(c) for c in kids]
            x = (xs[0] + xs[-1]) / 2
        else:
            x, next_slot = next_slot, next_slot + 1.0
        pos[node] = (x, -float(tree.depths[node]))
        return x

    place(0)
    return pos


def _accepted_sets(tree: DraftTree, accepted: Sequence[int] | None) -> tuple[set[int], set[tuple[int, int]]]:
    nodes = [int(i) for i in accepted] if accepted is not None else []
    if nodes and nodes != tree.path(nodes[-1]):
        raise ValueError(f"accepted nodes {nodes} are not a root-to-node path of the tree")
    return set(nodes), set(zip(nodes[:-1], nodes[1:]))


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def to_dot(tree: DraftTree, labels: Labels = None, accepted: Sequence[int] | None = None) -> str:
    """Graphviz DOT text: top-down, accepted path in green."""
    names = node_labels(tree, labels)
    on_path, path_edges = _accepted_sets(tree, accepted)
    lines = ["digraph draft_tree {", "  rankdir=TB;", '  node [shape=box, style="rounded,filled", fontname="Helvetica"];']
    for i, name in enumerate(names):
        color = _ACCEPTED if i in on_path else _PLAIN
        lines.append(f'  n{i} [label="{_escape(name)}", fillcolor="{color}"];')
    for i, p in enumerate(tree.parents.tolist()):
        if p >= 0:
            style = f' [color="{_ACCEPTED}", penwidth=2.5]' if (p, i) in path_edges else ""
            lines.append(f"  n{p} -> n{i}{style};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _mermaid_text(text: str) -> str:
    return text.replace('"', "#quot;").replace("\n", "<br/>")


def to_mermaid(tree: DraftTree, labels: Labels = None, accepted: Sequence[int] | None = None) -> str:
    """Mermaid flowchart text (renders in GitHub Markdown): accepted path in green."""
    names = node_labels(tree, labels)
    on_path, path_edges = _accepted_sets(tree, accepted)
    lines = ["flowchart TD"]
    lines += [f'  n{i}["{_mermaid_text(name)}"]' for i, name in enumerate(names)]
    edges = [(p, i) for i, p in enumerate(tree.parents.tolist()) if p >= 0]
    lines += [f"  n{p} --> n{i}" for p, i in edges]
    lines.append(f"  classDef accepted fill:{_ACCEPTED},color:#fff")
    if on_path:
        lines.append("  class " + ",".join(f"n{i}" for i in sorted(on_path)) + " accepted")
    for k, edge in enumerate(edges):
        if edge in path_edges:
            lines.append(f"  linkStyle {k} stroke:{_ACCEPTED},stroke-width:3px")
    return "\n".join(lines) + "\n"


_ONLY = "#ef6c00"  # orange outline: a node no other tree of a side-by-side figure holds


def _draw_tree(ax, tree: DraftTree, labels: Labels, accepted: Sequence[int] | None,
               marked: frozenset[int] = frozenset()) -> None:
    """Draw ``tree`` into the matplotlib axes ``ax``: accepted path filled green, ``marked`` nodes
    outlined orange."""
    import networkx as nx

    graph, pos = tree.to_networkx(), tree_layout(tree)
    on_path, path_edges = _accepted_sets(tree, accepted)
    nx.draw_networkx_edges(graph, pos, ax=ax, arrows=False,
                           edge_color=[_ACCEPTED if e in path_edges else _PLAIN for e in graph.edges],
                           width=[2.5 if e in path_edges else 1.0 for e in graph.edges])
    nodes = list(graph.nodes)
    nx.draw_networkx_nodes(graph, pos, ax=ax, nodelist=nodes, node_size=900, node_shape="s",
                           node_color=[_ACCEPTED if n in on_path else "#eceff1" for n in nodes],
                           edgecolors=[_ONLY if n in marked else "none" for n in nodes],
                           linewidths=[2.5 if n in marked else 0.0 for n in nodes])
    nx.draw_networkx_labels(graph, pos, dict(enumerate(node_labels(tree, labels))), ax=ax, font_size=7)
    ax.set_axis_off()


def _width(tree: DraftTree) -> float:
    return max(4.0, 1.1 * (1 + max(x for x, _ in tree_layout(tree).values())))


def _save(fig, path: Path) -> Path:
    from treespec.apps.bench.plots import save_figure  # stable SVG ids, no date: reproducible files

    fig.tight_layout()
    return save_figure(fig, path)


def _figure_path(path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    path = Path(path)
    if path.suffix not in (".svg", ".png"):
        raise ValueError(f"figure format must be .svg or .png, got {path.suffix!r}")
    return path


def write_figure(tree: DraftTree, path: str | Path, labels: Labels = None,
                 accepted: Sequence[int] | None = None, *, title: str | None = None) -> Path:
    """Render to ``path`` (.svg or .png) with networkx and matplotlib (Agg backend, no display)."""
    path = _figure_path(path)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(_width(tree), 1.2 * (tree.max_depth + 1) + 0.6))
    _draw_tree(ax, tree, labels, accepted)
    if title:
        ax.set_title(title, fontsize=9)
    return _save(fig, path)


@attrs.frozen
class Panel:
    """One tree of a side-by-side figure."""

    title: str
    tree: DraftTree
    labels: Labels = None
    accepted: Sequence[int] | None = None  # node indices of the accepted path, root first
    marked: frozenset[int] = frozenset()  # nodes to outline (e.g. held by no other panel's tree)


def write_side_by_side(panels: Sequence[Panel], path: str | Path, *, title: str | None = None) -> Path:
    """Several trees in one figure, left to right, each with its own title; widths follow the trees."""
    path = _figure_path(path)
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError("a side-by-side figure needs at least one tree")
    widths = [_width(p.tree) for p in panels]
    height = 1.2 * (max(p.tree.max_depth for p in panels) + 1) + 1.0
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(widths), height), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    for ax, panel in zip(axes[0], panels):
        _draw_tree(ax, panel.tree, panel.labels, panel.accepted, panel.marked)
        ax.set_title(panel.title, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)
