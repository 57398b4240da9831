"""How a target's tree forwards compare with its one-token steps, measured through the `Target` protocol.

Contract
--------
`step_agreement(target)` runs one probe on any engine's target and returns the largest absolute
difference between logits the target computed two ways (0.0: equal bit for bit):

1. a random prefix past ``prefix`` cached positions (past 256: where ggml's attention changes path);
2. a tree of ``depth`` chained nodes with one sibling beside each (so a node's ancestors sit among
   other branches' nodes), verified in one forward, against each node's path run as one-token steps;
3. the chain committed from that forward, then ``after`` one-token steps on top of it, against the
   same steps on top of the chain committed one token at a time (the cache a tree leaves is AR's).

The target's cache is left empty.  `measured_numerics` turns the result into a `Numerics`: exact
when every logit agreed, else a tolerance of twice the largest difference (two logits move) times a
margin: what a bench or a demo judges a divergence from AR by where exactness does not hold.
"""

from __future__ import annotations

import torch

from treespec.target import Numerics, Target
from treespec.tree import DraftTree

__all__ = ["MARGIN", "measured_numerics", "step_agreement"]

MARGIN = 2.0  # how much wider than twice the largest measured logit shift a stated tolerance is


def _steps(target: Target, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: the logits after each of ``tokens`` run as one-token steps, each committed."""
    rows = []
    for token in tokens:
        rows.append(target.forward_tree(DraftTree.root_only(token)).logits[0].clone())
        target.commit(torch.zeros(1, dtype=torch.int64))
    return torch.stack(rows)


def _probe_tree(root: int, chain: list[int], siblings: list[int]) -> DraftTree:
    """The tree ``root -> chain[0] -> chain[1] ...`` with ``siblings[d]`` beside ``chain[d]``, node order by
    depth (each depth's chain node, then its sibling)."""
    tokens, parents, last = [root], [-1], 0
    for own, other in zip(chain, siblings, strict=True):
        tokens += [own, other]
        parents += [last, last]
        last = len(tokens) - 2  # the chain node just added
    return DraftTree.build(tokens=tokens, parents=parents)


def step_agreement(target: Target, *, prefix: int = 300, depth: int = 8, after: int = 8, seed: int = 0) -> float:
    """The largest |logit difference| between tree forwards and one-token steps (module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = min(target.vocab_size, 32000)  # ids every tokenizer of the model maps (an engine's may pad)
    prefix = max(1, min(prefix, target.max_positions - 2 * depth - after - 2))
    ids = torch.randint(0, vocab, (prefix + 2 * depth + after + 1,), generator=generator).tolist()
    head, root = ids[:prefix], ids[prefix]
    chain, siblings = ids[prefix + 1:prefix + 1 + depth], ids[prefix + 1 + depth:prefix + 1 + 2 * depth]
    later = ids[prefix + 1 + 2 * depth:]
    tree = _probe_tree(root, chain, siblings)
    try:
        target.prefill(torch.tensor(head))
        start = target.length
        together = target.forward_tree(tree).logits.clone()  # [N, V]
        target.drop_tree()
        alone = _walk(target, root, chain, siblings)  # [N, V], the same rows as one-token steps
        worst = float((together - alone).abs().max())
        if later:  # the cache the tree's commit left, against the chain's own steps (the walk ends there)
            after_steps = _steps(target, later)
            target.truncate(start)
            target.forward_tree(tree)
            target.commit(torch.tensor([0, *range(1, 2 * depth, 2)]))  # the root and the chain
            worst = max(worst, float((_steps(target, later) - after_steps).abs().max()))
        return worst
    finally:
        target.reset()


def _walk(target: Target, root: int, chain: list[int], siblings: list[int]) -> torch.Tensor:
    """[N, V]: each node's logits of `_probe_tree` as one-token steps, in node order: down the chain, each
    sibling stepped before its chain node and taken back; the root and the chain are left committed."""
    rows = [_steps(target, [root])[0]]
    for own, other in zip(chain, siblings, strict=True):
        beside = _steps(target, [other])[0]
        target.truncate(target.length - 1)
        rows += [_steps(target, [own])[0], beside]
    return torch.stack(rows)


def measured_numerics(target: Target, how: str, **probe) -> Numerics:
    """`Numerics` from `step_agreement`: exact, or a tolerance of 2 x the shift x `MARGIN`; ``how`` names the
    path measured (a dtype, a cache type, threads)."""
    shift = step_agreement(target, **probe)
    if shift == 0.0:
        return Numerics(True, 0.0, f"{how}: tree forwards equal one-token steps bit for bit (measured)")
    return Numerics(False, 2.0 * shift * MARGIN, f"{how}: tree forwards move logits by up to {shift:.3g} against "
                                                   "one-token steps (measured)")
