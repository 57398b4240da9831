"""Sequoia's DP tree: exact against enumeration, its hardware-aware size, and the acceptance fit."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treespec.interfaces import DraftOutput
from treespec.policies.sequoia import HardwareAwareSequoia, Sequoia, optimal_trees
from treespec.pricing.cost import LinearCost


@functools.lru_cache(maxsize=None)
def shapes(n: int, depth: int) -> tuple:
    """Every tree of n nodes and depth <= depth whose children take a prefix of the ranks, as child lists."""
    if n == 1:
        return ((),)
    if depth == 0:
        return ()
    out = []

    def split(left: int, kids: tuple):
        if left == 0:
            out.append(kids)
            return
        for m in range(1, left + 1):
            for sub in shapes(m, depth - 1):
                split(left - m, kids + (sub,))

    split(n - 1, ())
    return tuple(out)


def value(tree: tuple, p: tuple[float, ...]) -> float:
    """F(T): 1 for the root plus p_k times the value of the rank-k child's subtree."""
    return 1.0 + sum((p[k] if k < len(p) else 0.0) * value(child, p) for k, child in enumerate(tree))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=5).map(lambda xs: tuple(x / max(1.0, sum(xs)) for x in xs)),
       st.integers(1, 4))
def test_the_dp_value_is_the_best_of_every_tree(p, depth):
    values, trees = optimal_trees(p, 7, depth)
    for n in range(1, 8):
        candidates = [value(t, p) for t in shapes(n, depth)]
        if not candidates:
            assert values[n] == float("-inf")
            continue
        assert values[n] == pytest.approx(max(candidates), rel=1e-12)
        paths = trees[n]
        assert len(paths) == n - 1 and all(len(q) <= depth for q in paths)
        assert all(q[:-1] in set(paths) | {()} for q in paths)  # a tree: every parent kept


def test_the_tree_is_filled_by_rank_and_the_cost_model_picks_the_size():
    p = (0.6, 0.2, 0.1)
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(0)) * 3
    draft = DraftOutput(logprobs=torch.log_softmax(logits, -1), root_token=3, position=100)
    full = Sequoia(budget=12, acceptance=p).build(draft)
    assert full.budget == 12 and full.equal(Sequoia(budget=12, acceptance=p).with_backend("networkx").build(draft))
    flat = LinearCost(draft=0.0, base=0.05, per_token=0.0)  # trees cost what an AR step costs: the whole budget
    assert HardwareAwareSequoia(budget=12, acceptance=p, cost_model=flat).build(draft).equal(full)
    dear = LinearCost(draft=0.05, base=0.05, per_token=0.05)  # nothing beats AR
    assert HardwareAwareSequoia(budget=12, acceptance=p, cost_model=dear).build(draft).budget == 0
    some = LinearCost(draft=0.0, base=0.05, per_token=0.02)
    values = optimal_trees(p, 13, 6)[0]
    costs = [0.05 + 0.02 * n for n in range(14)]
    best = max(range(2, 14), key=lambda n: values[n] / costs[n])
    assert HardwareAwareSequoia(budget=12, acceptance=p, cost_model=some).build(draft).budget == best - 1


def test_bad_acceptance_vectors_are_refused(tmp_path):
    with pytest.raises(ValueError, match="summing to at most 1"):
        Sequoia(acceptance=(0.7, 0.5))
    with pytest.raises(ValueError, match="neither a preset"):
        Sequoia(acceptance="nowhere.json")
    (tmp_path / "p.json").write_text('{"vector": [0.5, 0.25], "cells": 10, "drafter": "dflash"}')
    assert Sequoia(acceptance=str(tmp_path / "p.json")).acceptance == (0.5, 0.25)

    with pytest.raises(ValueError, match="needs the cost model"):
        HardwareAwareSequoia(acceptance=(0.5,)).build(DraftOutput(logprobs=torch.zeros(2, 3).log_softmax(-1),
                                                                  root_token=0))
