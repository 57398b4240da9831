"""``treespec example``: build a small draft tree from rank-path choices and show its derived views."""

from __future__ import annotations

import argparse

import torch

from treespec.tree import DraftTree

# A Medusa-style static tree over the top-3 candidates of 3 drafted depths.
_CHOICES = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="seed of the random per-depth logits")


def run(args: argparse.Namespace) -> int:
    gen = torch.Generator().manual_seed(args.seed)
    logprobs = torch.randn(3, 50, generator=gen).log_softmax(-1)  # [L, V]
    top = logprobs.topk(3, dim=-1)
    tree = DraftTree.from_topk_choices(_CHOICES, root_token=7, topk_tokens=top.indices, topk_logprobs=top.values)
    print(f"tree with {tree.budget} draft nodes, depth {tree.max_depth}")
    for i in range(len(tree)):
        print(f"  node {i}: token {int(tree.tokens[i]):3d} parent {int(tree.parents[i]):2d} "
              f"depth {int(tree.depths[i])} score {float(tree.scores[i]):8.4f} path {tree.rank_paths[i]}")
    print("ancestor mask:\n" + "\n".join("  " + "".join("x" if v else "." for v in row) for row in tree.ancestor_mask.tolist()))
    print("retrieve_indices:", tree.retrieve_indices.tolist())
    return 0
