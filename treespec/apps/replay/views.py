"""Several policies' trees built from one recorded draft: what `treespec draw --trace` shows.

Contract
--------
A position is a point of a prompt's recorded greedy trajectory: ``position`` response tokens are
committed and the round's root is the last of them (0: the first round after the prompt).  Two
policies replayed live reach different positions after their first divergence, so comparing "each
one's N-th round" compares different drafts; here every method builds its tree from the same draft.

* `views_at(trace, methods, prompt, position)`: per method a `TreeView`: the tree its policy builds
  from the draft recorded there (priced, for cost-aware methods, as replay prices them), cut to the
  depth the live loop could use, the match verifier's accepted path along the trajectory, and
  ``only`` = the nodes whose root-to-node token path no other view's tree holds.
* `node_paths(tree)`: each node's token path from the root (the root's is empty): the identity of a
  node across trees built from one draft.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from treespec.analysis import accepted_path
from treespec.apps.assembly.methods import MethodSpec, naming, parse_method
from treespec.apps.replay.evaluate import policy_for
from treespec.apps.replay.rebuild import ReplayDrafts
from treespec.apps.replay.trace import Trace, TraceError
from treespec.decoding import built_tree, limit_depth
from treespec.tree import DraftTree

__all__ = ["TreeView", "node_paths", "views_at"]


@attrs.frozen
class TreeView:
    """One method's tree at one position of a trace."""

    method: str  # method string
    tree: DraftTree
    accepted: tuple[int, ...]  # node indices of the accepted path, root first
    only: frozenset[int]  # nodes whose token path no other view's tree holds

    @property
    def tau(self) -> int:
        return len(self.accepted)


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """[N] each node's tokens from the root's child down to the node (the root: ())."""
    tokens, paths = tree.tokens.tolist(), []
    for i, parent in enumerate(tree.parents.tolist()):
        paths.append(() if parent < 0 else (*paths[parent], tokens[i]))  # parents come first (canonical order)
    return paths


def check_position(trace: Trace, prompt: int, position: int) -> None:
    """`TraceError` naming the valid range when ``prompt`` or ``position`` is outside the trace."""
    if not 0 <= prompt < trace.num_prompts:
        raise TraceError(f"prompt {prompt} is not in the trace: it has prompts 0..{trace.num_prompts - 1}")
    if not 0 <= position < trace.max_new_tokens:
        raise TraceError(f"position {position} is not in the trace: it recorded positions 0..{trace.max_new_tokens - 1} "
                         "(response tokens committed before the round)")


def views_at(trace: Trace, methods: Sequence[str | MethodSpec], prompt: int, position: int, *,
             cache: dict[str, ReplayDrafts] | None = None) -> list[TreeView]:
    """Each method's tree from the draft at ``position`` of ``prompt`` (module docstring), built by the
    networkx reference (the same tree as the torch build, bit for bit); ``cache`` keeps the draft
    rebuilders between calls (one per drafter), as a page of every position does."""
    check_position(trace, prompt, position)
    parsed = [parse_method(m) if isinstance(m, str) else m for m in methods]
    if any(m.autoregressive for m in parsed):
        raise TraceError("AR builds no draft tree; name policy methods, e.g. ddtree@16,eagle2@16")
    seq = trace.sequences[prompt].tolist()
    anchor = trace.prompt_len(prompt) - 1 + position  # absolute position of the round's root
    room = min(trace.max_new_tokens - position - 1, int(trace.meta["target"]["max_positions"]) - 1 - anchor)
    cache = {} if cache is None else cache
    built = []
    for method in parsed:
        drafts, policy = policy_for(trace, method, cache)
        draft = drafts.draft(trace.anchor_index(prompt, position), seq[anchor], anchor)
        with naming(method):
            tree = limit_depth(built_tree(policy.with_backend("networkx"), draft), room)
        built.append((method.name, tree, tuple(accepted_path(tree, seq[anchor + 1:]))))
    paths = [node_paths(tree) for _, tree, _ in built]
    views = []
    for k, (name, tree, accepted) in enumerate(built):
        others = [set(p) for j, p in enumerate(paths) if j != k]
        only = frozenset(i for i, path in enumerate(paths[k]) if others and not any(path in o for o in others))
        views.append(TreeView(name, tree, accepted, only))
    return views
