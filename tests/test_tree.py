"""Properties of DraftTree on random trees, and its errors on malformed input."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treespec import DraftTree, TreeError


@st.composite
def random_trees(draw, max_nodes: int = 40) -> DraftTree:
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))  # small range: repeated tokens
    steps = draw(st.lists(st.floats(-30, 0, width=32), min_size=n - 1, max_size=n - 1))  # log-probs <= 0
    scores = [0.0]
    for parent, step in zip(parents[1:], steps):
        scores.append(float(np.float32(scores[parent]) + np.float32(step)))  # a path's float32 sum
    return DraftTree.build(tokens, parents, None, scores)


def ancestors_by_walking(tree: DraftTree, i: int) -> set[int]:
    out, parents = {i}, tree.parents.tolist()
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@given(random_trees())
@settings(max_examples=200, deadline=None)
def test_mask_rows_are_ancestors_plus_self(tree):
    mask = tree.ancestor_mask
    for i in range(len(tree)):
        assert set(mask[i].nonzero().flatten().tolist()) == ancestors_by_walking(tree, i)
    assert torch.equal(tree.depths, mask.sum(1) - 1)


@given(random_trees())
@settings(max_examples=200, deadline=None)
def test_networkx_round_trip(tree):
    graph = tree.to_networkx()
    assert nx.is_arborescence(graph)
    assert all(graph.nodes[i]["depth"] == int(tree.depths[i]) for i in graph)
    assert DraftTree.from_networkx(graph).equal(tree)


@given(random_trees())
@settings(max_examples=200, deadline=None)
def test_choices_round_trip(tree):
    choices = tree.to_choices()
    assert len(set(choices)) == len(choices) == tree.budget
    back = DraftTree.from_choices(choices, root_token=tree.root_token, tokens=tree.tokens[1:], scores=tree.scores[1:])
    assert back.equal(tree)


@given(random_trees())
@settings(max_examples=150, deadline=None)
def test_retrieve_indices_are_root_to_leaf_paths(tree):
    ri = tree.retrieve_indices
    leaves = [i for i in range(len(tree)) if not tree.children[i]]
    assert ri.shape == (len(leaves), tree.max_depth + 1)
    for row, leaf in zip(ri.tolist(), leaves):
        assert [j for j in row if j >= 0] == tree.path(leaf)
        assert row[len(tree.path(leaf)):] == [-1] * (len(row) - len(tree.path(leaf)))


@given(random_trees())
@settings(max_examples=150, deadline=None)
def test_first_child_next_sibling_walk_the_child_lists(tree):
    first, nxt = tree.first_child.tolist(), tree.next_sibling.tolist()
    for i, kids in enumerate(tree.children):
        walked, c = [], first[i]
        while c >= 0:
            walked.append(c)
            c = nxt[c]
        assert walked == list(kids)
    assert tree.num_children.tolist() == [len(k) for k in tree.children]


@given(random_trees(), st.integers(0, 12), st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
@settings(max_examples=100, deadline=None)
def test_attention_mask_and_positions(tree, prefix, dtype):
    m = tree.attention_mask(prefix, dtype)
    n = len(tree)
    assert m.shape == (1, 1, n, prefix + n) and m.dtype == dtype
    visible = m[0, 0] == 0
    assert visible[:, :prefix].all()
    assert torch.equal(visible[:, prefix:], tree.ancestor_mask)
    assert (m[0, 0][~visible] == torch.finfo(dtype).min).all()
    assert torch.equal(tree.position_ids(prefix)[0], tree.depths + prefix)


@given(random_trees(max_nodes=12))
@settings(max_examples=100, deadline=None)
def test_rank_paths_follow_score_then_token(tree):
    scores, tokens = tree.scores.tolist(), tree.tokens.tolist()
    for kids in tree.children:
        ordered = sorted(kids, key=lambda c: (-scores[c], tokens[c]))
        assert [tree.ranks[c] for c in ordered] == list(range(len(kids)))


def test_chain_is_a_degenerate_tree():
    lp = torch.tensor([-0.5, -0.25, -1.0])
    tree = DraftTree.chain(3, [5, 6, 7], lp)
    assert tree.parents.tolist() == [-1, 0, 1, 2] and tree.depths.tolist() == [0, 1, 2, 3]
    assert tree.scores.tolist() == [0.0, -0.5, -0.75, -1.75]
    assert tree.retrieve_indices.tolist() == [[0, 1, 2, 3]]
    assert DraftTree.root_only(9).budget == 0


def test_topk_choices_build_medusa_tree():
    topk_tokens = torch.tensor([[10, 11], [20, 21]])
    topk_lp = torch.tensor([[-0.1, -2.0], [-0.3, -1.0]])
    tree = DraftTree.from_topk_choices([(0,), (1,), (0, 1)], root_token=1, topk_tokens=topk_tokens, topk_logprobs=topk_lp)
    assert tree.tokens.tolist() == [1, 10, 11, 21]
    assert tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.scores[3].item() == pytest.approx(-1.1)
    with pytest.raises(TreeError, match="outside"):
        DraftTree.from_topk_choices([(2,)], root_token=1, topk_tokens=topk_tokens)


def _vectors(n=4):
    return dict(tokens=torch.arange(n), parents=torch.tensor([-1, 0, 0, 1]),
                depths=torch.tensor([0, 1, 1, 2]), scores=torch.zeros(n))


@pytest.mark.parametrize("change, message", [
    (dict(parents=torch.tensor([-1, 0, 3, 1])), "not topological"),
    (dict(parents=torch.tensor([-1, 0, -1, 1])), "second root"),
    (dict(parents=torch.tensor([0, 0, 0, 1])), "node 0 must be the root"),
    (dict(depths=torch.tensor([0, 1, 2, 2])), "depths disagree"),
    (dict(depths=torch.tensor([1, 2, 2, 3])), "root must have depth 0"),
    (dict(scores=torch.zeros(3)), "length mismatch"),
    (dict(scores=torch.tensor([0.0, float("nan"), 0.0, 0.0])), "NaN"),
    (dict(tokens=torch.arange(4, dtype=torch.int32)), "dtype"),
    (dict(scores=torch.zeros(4, dtype=torch.float64)), "dtype"),
    (dict(tokens=torch.tensor([0, -1, 2, 3])), "non-negative"),
    (dict(tokens=torch.arange(4)[None]), "1-D"),
    (dict(parents=[-1, 0, 0, 1]), "torch.Tensor"),
])
def test_malformed_trees_raise_clear_errors(change, message):
    fields = _vectors() | change
    with pytest.raises(TreeError, match=message):
        DraftTree(**fields)


def test_import_errors_name_the_problem():
    with pytest.raises(TreeError, match="before its parent"):
        DraftTree.from_choices([(0, 0), (0,)], root_token=0, tokens=[1, 2])
    with pytest.raises(TreeError, match="twice"):
        DraftTree.from_choices([(0,), (0,)], root_token=0, tokens=[1, 2])
    with pytest.raises(TreeError, match="length mismatch"):
        DraftTree.from_choices([(0,)], root_token=0, tokens=[1, 2])
    g = nx.DiGraph([(0, 1), (2, 1)])
    nx.set_node_attributes(g, 0, "token")
    with pytest.raises(TreeError, match="two parents"):
        DraftTree.from_networkx(g)
    g = nx.DiGraph([(0, 1)])
    g.add_node(2, token=0)
    nx.set_node_attributes(g, 0, "token")
    with pytest.raises(TreeError, match="exactly one root"):
        DraftTree.from_networkx(g)
    with pytest.raises(TreeError, match="'token'"):
        DraftTree.from_networkx(nx.DiGraph([(0, 1)]))


def test_equal_compares_score_bits():
    a = DraftTree.build([1, 2], [-1, 0], None, [0.0, -0.0])
    b = DraftTree.build([1, 2], [-1, 0], None, [0.0, 0.0])
    assert a.equal(a) and not a.equal(b)
