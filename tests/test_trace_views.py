"""Policies side by side on one recorded draft (treespec/apps/replay/views.py, treespec/apps/drawing/trace_page.py,
`treespec draw --trace`).

* Each view's tree is the tree the policy builds from the draft replay rebuilds at that position,
  and its accepted path is the match walk along the trajectory, the same tau replay counts there.
* ``only`` holds exactly the nodes whose token path no other view's tree holds (checked against a
  brute-force set comparison, and empty for a policy drawn beside itself).
* Bad prompts, positions and AR are refused naming the valid range.
* The HTML page holds every position's trees as data (equal to `views_at`), and in headless
  Chromium it opens at the position its address names and draws one box per node.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
from test_replay import World

from treespec.analysis import accepted_length
from treespec.apps.assembly.methods import build_policy, parse_method
from treespec.apps.cli import main
from treespec.apps.drawing.trace_page import page_data, trace_page
from treespec.apps.replay import RecordConfig, ReplayDrafts, TraceError, replay_prompt
from treespec.apps.replay.views import node_paths, views_at
from treespec.decoding import limit_depth


@pytest.fixture(scope="module")
def world():
    return World(16, RecordConfig(max_new_tokens=12, max_budget=64), n_prompts=2, seed=5)


@pytest.fixture(scope="module")
def trace_file(world, tmp_path_factory):
    return world.trace.save(tmp_path_factory.mktemp("trace") / "trace.safetensors")


@pytest.mark.parametrize("position", [0, 3, 11])
def test_views_are_the_policies_trees_on_one_draft(world, position):
    trace, prompt = world.trace, 1
    views = views_at(trace, ["ddtree@8", "eagle2@8+topk=2", "dominotree@8"], prompt, position)
    seq, anchor = trace.sequences[prompt].tolist(), trace.prompt_len(prompt) - 1 + position
    for view in views:
        method = parse_method(view.method)
        draft = ReplayDrafts.of(trace, method.drafter).draft(trace.anchor_index(prompt, position), seq[anchor], anchor)
        expected = limit_depth(build_policy(method).build(draft), trace.max_new_tokens - position - 1)
        assert view.tree.equal(expected)
        assert view.tau == accepted_length(view.tree, seq[anchor + 1:])
        assert view.tree.path(view.accepted[-1]) == list(view.accepted)
    paths = [node_paths(v.tree) for v in views]
    for k, view in enumerate(views):
        others = set().union(*(set(p) for j, p in enumerate(paths) if j != k))
        assert view.only == {i for i, p in enumerate(paths[k]) if p not in others}


def test_the_first_view_replays_the_first_round(world):
    views = views_at(world.trace, ["ddtree@8"], 0, 0)
    drafts = ReplayDrafts.of(world.trace, "dflash")
    assert views[0].tau == replay_prompt(world.trace, drafts, build_policy(parse_method("ddtree@8")), 0)[0]
    assert views[0].only == frozenset()  # nothing to differ from


def test_a_policy_beside_itself_marks_nothing(world):
    views = views_at(world.trace, ["ddtree@8", "ddtree@8:dflash"], 0, 2)
    assert views[0].tree.equal(views[1].tree) and not views[0].only and not views[1].only


def test_node_paths_are_token_paths():
    from treespec.tree import DraftTree

    tree = DraftTree.build(tokens=[7, 3, 9, 4], parents=[-1, 0, 0, 1])
    assert node_paths(tree) == [(), (3,), (9,), (3, 4)]


@pytest.mark.parametrize("prompt, position, methods, message", [
    (2, 0, ["ddtree@8"], "prompt 2 is not in the trace: it has prompts 0..1"),
    (0, 12, ["ddtree@8"], "position 12 is not in the trace: it recorded positions 0..11"),
    (0, -1, ["ddtree@8"], "position -1 is not in the trace"),
    (0, 0, ["ar"], "AR builds no draft tree"),
])
def test_bad_positions_are_refused(world, prompt, position, methods, message):
    with pytest.raises(TraceError, match=re.escape(message)):
        views_at(world.trace, methods, prompt, position)


def _page_json(text: str) -> dict:
    return json.loads(re.search(r"const DATA = (.*);\n", text).group(1).replace("<\\/", "</"))


def test_the_page_holds_every_positions_trees(world):
    methods = ["ddtree@8", "dominotree@8"]
    text = trace_page(world.trace, methods, 1, start=4)
    assert text == trace_page(world.trace, methods, 1, start=4)  # same inputs, same bytes
    data = _page_json(text)
    assert data == {**page_data(world.trace, methods, 1), "start": 4}
    assert len(data["positions"]) == world.trace.max_new_tokens
    for position in (0, 7):
        for tree, view in zip(data["positions"][position], views_at(world.trace, methods, 1, position)):
            assert [n[3] for n in tree["nodes"]] == [str(t) for t in view.tree.tokens.tolist()]
            assert [i for i, n in enumerate(tree["nodes"]) if n[5]] == list(view.accepted)
            assert {i for i, n in enumerate(tree["nodes"]) if n[6]} == view.only
    with pytest.raises(TraceError, match="position 12 is not in the trace"):
        trace_page(world.trace, methods, 1, start=12)


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("headless Chromium is not installed; .ci/run installs it (apt-get install chromium)")
        pytest.skip("headless Chromium is not installed (apt-get install chromium)")
    return path


def test_the_page_opens_at_its_addressed_position_in_chromium(world, tmp_path):
    chromium = _chromium()
    methods = ["ddtree@8", "eagle2@8+topk=2"]
    page = tmp_path / "page.html"
    page.write_text(trace_page(world.trace, methods, 0))
    dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          f"{page.as_uri()}#position=6"], capture_output=True, text=True, timeout=120).stdout
    assert 'data-position="6"' in dom and "position 6 of 12" in dom
    trees = re.findall(r'<svg [^>]*class="tree".*?</svg>', dom, flags=re.S)
    views = views_at(world.trace, methods, 0, 6)
    assert [t.count("<rect") for t in trees] == [len(v.tree) for v in views]
    assert [t.count('fill="#2e7d32"') for t in trees] == [v.tau for v in views]  # the accepted boxes
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1000,700",
                    f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000


def test_cli_draws_side_by_side_and_writes_the_page(world, trace_file, tmp_path, capsys):
    out, page = tmp_path / "side.svg", tmp_path / "page.html"
    assert main(["draw", "--trace", str(trace_file), "--prompt", "1", "--position", "3",
                 "--methods", "ddtree@8,dominotree@8", "--out", str(out), "--html", str(page)]) == 0
    printed = capsys.readouterr().out
    views = views_at(world.trace, ["ddtree@8", "dominotree@8"], 1, 3)
    assert "prompt 1 (1), position 3" in printed and f"ddtree@8 tau {views[0].tau}" in printed
    assert out.read_bytes().startswith(b"<?xml") and _page_json(page.read_text())["start"] == 3


@pytest.mark.parametrize("flags, message", [
    (["--methods", "ddtree@8", "--prompt", "first"], "--prompt is the prompt's index in the trace"),
    (["--out", "x.dot"], "needs --methods"),
    (["--methods", "ddtree@8", "--out", "x.dot"], "drawn as .svg or .png"),
    (["--methods", "ddtree@8", "--position", "99"], "position 99 is not in the trace"),
])
def test_cli_names_bad_trace_flags(trace_file, tmp_path, capsys, flags, message):
    args = ["draw", "--trace", str(trace_file), *flags]
    if "--out" not in flags:
        args += ["--out", str(tmp_path / "x.svg")]
    assert main(args) == 2  # a bad argument, as argparse exits
    assert message in capsys.readouterr().err


def test_cli_refuses_two_sources_and_a_page_without_a_trace(trace_file, tmp_path, capsys):
    assert main(["draw", "--trace", str(trace_file), "--tree", "t.json", "--out", "x.svg"]) == 2
    assert "not --tree and --trace" in capsys.readouterr().err
    assert main(["draw", "--html", str(tmp_path / "p.html")]) == 2
    assert "--html pages step through a trace" in capsys.readouterr().err
