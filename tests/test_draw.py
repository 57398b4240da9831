"""Tree drawing: DOT/Mermaid text structure, reproducible figures, accepted-path checks."""

from __future__ import annotations

import json

import pytest

from treespec import DraftTree
from treespec.apps.cli import main
from treespec.apps.drawing.trees import to_dot, to_mermaid, tree_layout, write_figure


@pytest.fixture
def tree():
    return DraftTree.build([1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, 1, 3], None, [0, -0.1, -0.5, -0.3, -0.9, -0.6])


def test_dot_has_every_node_and_edge_and_highlights_the_path(tree):
    dot = to_dot(tree, accepted=[0, 1, 3])
    assert dot.count(" -> ") == tree.budget
    assert dot.count("penwidth") == 2  # two accepted edges
    assert 'n2 [label="3\\n-0.50", fillcolor="#90a4ae"]' in dot


def test_mermaid_marks_accepted_nodes(tree):
    text = to_mermaid(tree, labels=lambda t: f"tok{t}", accepted=[0, 2])
    assert text.startswith("flowchart TD")
    assert "class n0,n2 accepted" in text and 'n5["tok6<br/>-0.60"]' in text


def test_given_string_labels_keep_the_scores(tree):
    names = ["root", "a", "b", "c", "d", "e"]
    text = to_mermaid(tree, labels=names)
    assert 'n0["root"]' in text and 'n4["d<br/>-0.90"]' in text
    with pytest.raises(ValueError, match="6 nodes"):
        to_dot(tree, labels=names[:3])


def test_layout_centres_parents_over_children(tree):
    pos = tree_layout(tree)
    for node, kids in enumerate(tree.children):
        if kids:
            assert pos[node][0] == pytest.approx((pos[kids[0]][0] + pos[kids[-1]][0]) / 2)
        assert pos[node][1] == -int(tree.depths[node])


def test_accepted_must_be_a_path(tree):
    with pytest.raises(ValueError, match="not a root-to-node path"):
        to_dot(tree, accepted=[0, 2, 3])


def test_svg_is_reproducible(tree, tmp_path):
    a = write_figure(tree, tmp_path / "a.svg", accepted=[0, 1]).read_bytes()
    b = write_figure(tree, tmp_path / "b.svg", accepted=[0, 1]).read_bytes()
    assert a == b and b"<svg" in a


def test_draw_command_writes_each_format(tree, tmp_path):
    record = tree.to_dict() | {"accepted": [0, 1, 3, 5]}
    src = tmp_path / "tree.json"
    src.write_text(json.dumps(record))
    for suffix in (".dot", ".mmd", ".png"):
        out = tmp_path / f"t{suffix}"
        assert main(["draw", "--tree", str(src), "--out", str(out)]) == 0
        assert out.stat().st_size > 0


def test_live_round_returns_the_verified_tree_of_that_round():
    import torch
    from test_drafters_support import tiny_config
    from test_target import tiny_model

    from treespec.apps.commands.draw import live_round
    from treespec.drafters.dflash import DFlashDrafter
    from treespec.policies.ddtree import DDTree
    from treespec.engines.torch import TargetModel

    target = TargetModel(tiny_model("qwen3", vocab=64, hidden=32, layers=4))
    config = tiny_config(vocab=64, hidden=32, num_target_layers=4, layer_ids=(0, 2), block_size=4)
    drafter = DFlashDrafter.random(config, dtype=torch.float64, seed=1)
    prompt = torch.tensor([3, 9, 4, 7])
    first, result = live_round(target, drafter, DDTree(budget=6), prompt, 1)
    assert first.root_token == 7 and first.budget == 6
    assert result.accepted.tolist() == first.path(int(result.accepted[-1]))  # a root-to-node path
    second, _ = live_round(target, drafter, DDTree(budget=6), prompt, 2)
    assert second.root_token == result.bonus_token  # round 2 starts from round 1's bonus token
    with pytest.raises(ValueError, match="--round must be >= 1"):
        live_round(target, drafter, DDTree(budget=6), prompt, 0)


def test_draw_command_refuses_ambiguous_or_unmatched_sources(tree, tmp_path, capsys):
    """Bad arguments exit 2 (as argparse does), naming the problem, before any model loads; an
    existing output is never replaced without --overwrite."""
    record = tmp_path / "tree.json"
    record.write_text(json.dumps(tree.to_dict()))
    for args, message in (
            (["--tree", str(record), "--drafter", str(tmp_path)], "one source of trees, not --tree and --drafter"),
            (["--model", str(tmp_path)], "--model needs --drafter"),
            (["--method", "ar"], "AR builds no draft tree")):
        assert main(["draw", *args, "--out", str(tmp_path / "t.dot")]) == 2
        assert message in capsys.readouterr().err
    assert main(["draw", "--tree", str(record), "--out", str(tmp_path / "t.dot")]) == 0
    before = (tmp_path / "t.dot").read_text()
    assert main(["draw", "--tree", str(record), "--out", str(tmp_path / "t.dot")]) == 2
    assert "--out" in capsys.readouterr().err and (tmp_path / "t.dot").read_text() == before
    assert main(["draw", "--tree", str(record), "--out", str(tmp_path / "t.dot"), "--overwrite"]) == 0
