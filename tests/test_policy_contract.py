"""The policy author's contract, from the author's side: policies written from the tutorial alone
(tests/outside_policies.py, one of them ordering its nodes its own way) pass the kit and run through
replay, bench and drawing; and each kind of mistake an author can make is refused on every path,
naming the policy or the method and the problem."""

from __future__ import annotations

import functools

import attrs
import pytest
import torch
from outside_policies import BeamByDepth, CappedDDTree, SureChildren
from test_bench_runner import CONFIG, make_harness, prompt_files
from test_replay import World

import treespec.apps.bench as ab
from treespec import registry
from treespec.apps.cli import main
from treespec.apps.kit.testing import PolicyCheckError, check_policy
from treespec.apps.replay import RecordConfig, evaluate
from treespec.apps.replay.views import views_at
from treespec.decoding import PolicyError
from treespec.interfaces import DraftContext, DraftOutput, TreePolicy, backend_field
from treespec.policies.ddtree import DDTree
from treespec.policies.engine.best_first import BestFirstPolicy, budget_field
from treespec.policies.engine.candidates import TopTokens
from treespec.tree import DraftTree

OUTSIDE = {"beam-by-depth": BeamByDepth, "capped-ddtree": CappedDDTree, "sure-children": SureChildren}


@pytest.fixture(scope="module", autouse=True)
def registered():
    for name, cls in OUTSIDE.items():
        registry.register("policy", name, cls)
    yield
    for name in OUTSIDE:
        registry._RUNTIME["policy"].pop(name, None)


@pytest.fixture(scope="module")
def world():
    return World(16, RecordConfig(max_new_tokens=12, max_budget=64), n_prompts=2, seed=5)


def marginal_draft(seed: int = 0) -> DraftOutput:
    drafter = registry.resolve("drafter", "marginal").random(depth=6, vocab_size=64, seed=seed)
    return drafter.draft(DraftContext(sequence=torch.tensor([1, 2, 3]), features=None))


@pytest.mark.parametrize("factory", [BeamByDepth, functools.partial(BeamByDepth, width=2), CappedDDTree,
                                     functools.partial(CappedDDTree, max_depth=3), SureChildren, "sure-children"])
def test_outside_policies_pass_the_kit(factory):
    report = check_policy(factory, budgets=(1, 6, 16), seeds=range(3), prompts=1, tokens=16)
    assert report.mean_tau >= 1.0


def test_an_order_of_its_own_is_a_valid_tree_and_canonical_gives_the_engines():
    """BeamByDepth numbers its nodes depth by depth, ties by token descending: not the heap's pop
    order; its canonical form is, and is the same tree."""
    tree = BeamByDepth(budget=12, width=3).build(marginal_draft())
    canonical = tree.canonical()
    keys = [(-s, p) for s, p in zip(canonical.scores.tolist()[1:], canonical.rank_paths[1:])]
    assert not tree.equal(canonical) and keys == sorted(keys) and canonical.same_tree(tree)
    assert canonical.canonical() is canonical  # already in order: itself


def test_a_depth_cap_and_a_per_node_fan_out_shape_the_tree():
    draft = marginal_draft()
    assert CappedDDTree(budget=32, max_depth=2).build(draft).max_depth == 2  # two lists: no deeper
    conditional = registry.create("drafter", "toy-conditional", seed=1).draft(
        DraftContext(sequence=torch.tensor([1, 2, 3]), features=None))
    narrow = SureChildren(budget=32, ratio=1.5).build(conditional)
    wide = SureChildren(budget=32, ratio=1e9).build(conditional)
    assert narrow.budget < wide.budget and bool(torch.isfinite(narrow.scores).all())  # no -inf node kept


@pytest.mark.parametrize("method", ["beam-by-depth@8", "capped-ddtree@8", "sure-children@8"])
def test_they_run_through_replay_bench_and_drawing(world, tmp_path, method):
    (result,) = evaluate(world.trace, [method])
    assert all(t >= 1 for taus in result.taus for t in taus)
    views = views_at(world.trace, [method, "ddtree@8"], 0, 0)
    assert views[0].method == method and len(views[0].tree) >= 1
    config = attrs.evolve(CONFIG, methods=("ar", method), temperatures=(0.0,), prompts=1,
                          datasets=prompt_files(tmp_path)[:1], warmup_tokens=0)
    ab.run_shard(config, make_harness(), tmp_path / "out", progress=False)
    records = {r.method: r for r in ab.read_records(tmp_path / "out" / "records-rank0.jsonl")}
    assert records[method].tokens == records["ar"].tokens


# ---------------------------------------------------------------------------- mistakes
@attrs.frozen
class WrongRoot(TreePolicy):
    name = "wrong-root"
    budget: int = 8
    backend: str = backend_field()

    def build(self, draft: DraftOutput) -> DraftTree:
        tree = DDTree(budget=self.budget, backend=self.backend).build(draft)
        tokens = tree.tokens.clone()
        tokens[0] = (tokens[0] + 1) % draft.vocab_size
        return DraftTree(tokens, tree.parents, tree.depths, tree.scores)


@attrs.frozen
class TooManyLists(BestFirstPolicy):
    name = "too-many-lists"
    budget: int = budget_field(8)
    stop = None

    def validate(self, draft: DraftOutput) -> None:
        pass

    def candidates(self, draft: DraftOutput) -> TopTokens:
        return TopTokens(torch.cat([draft.logprobs, draft.logprobs]), self.budget)  # twice the draft's depths


@attrs.frozen
class BadParent(TreePolicy):
    name = "bad-parent"
    budget: int = 8

    def build(self, draft: DraftOutput) -> DraftTree:
        return DraftTree.build([draft.root_token, 5, 6], [-1, 2, 0])  # node 1's parent comes after it


MISTAKES = {"wrong-root": (WrongRoot, "root token"), "too-many-lists": (TooManyLists, "the draft has"),
            "bad-parent": (BadParent, "parents")}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_a_broken_tree_is_refused_on_every_path_naming_the_method(world, tmp_path, name):
    cls, problem = MISTAKES[name]
    registry.register("policy", name, cls)
    try:
        with pytest.raises(PolicyCheckError, match=f"a valid tree.*{problem}"):
            check_policy(cls, budgets=(8,), seeds=range(1), prompts=1, tokens=8)
        with pytest.raises(PolicyError, match=f"method {name}@8: the {name} policy.*{problem}"):
            evaluate(world.trace, [f"{name}@8"])
        with pytest.raises(PolicyError, match=f"method {name}@8: .*{problem}"):
            views_at(world.trace, [f"{name}@8"], 0, 0)
        config = attrs.evolve(CONFIG, methods=("ar", f"{name}@8"), temperatures=(0.0,), prompts=1,
                              datasets=prompt_files(tmp_path)[:1], warmup_tokens=0)
        with pytest.raises(PolicyError, match=f"method {name}@8: .*{problem}"):
            ab.run_shard(config, make_harness(), tmp_path / "out", progress=False)
    finally:
        registry._RUNTIME["policy"].pop(name, None)


@pytest.mark.parametrize("method, message", [
    ("eagle2@16+topk=x", "topk"), ("ddtree@0", "budget must be an integer >= 1"),
    ("ddtree@16+nosuch=1", "ddtree has no option 'nosuch'"), ("eagle2@16+topk=0", "topk must be an integer >= 1"),
])
@pytest.mark.parametrize("command", ["replay", "draw", "bench"])
def test_a_bad_method_exits_2_naming_it_on_every_command(world, tmp_path, capsys, command, method, message):
    trace = world.trace.save(tmp_path / "t.safetensors")
    argv = {"replay": ["replay", "eval", str(trace), "--methods", method],
            "draw": ["draw", "--trace", str(trace), "--methods", method, "--out", str(tmp_path / "x.svg")],
            "bench": ["bench", "--methods", method, "--datasets", prompt_files(tmp_path)[0], "--out",
                      str(tmp_path / "b")]}[command]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_folder_that_holds_no_drafter_is_refused_naming_it(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv in (["bench", "--methods", "ddtree@4", "--drafter", f"dflash={empty}", "--out", str(tmp_path / "b"),
                  "--datasets", prompt_files(tmp_path)[0]],
                 ["draw", "--drafter", str(empty), "--out", str(tmp_path / "x.svg")]):
        assert main(argv) == 2
        assert str(empty) in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ("[[1.5, 2.7, 3]]", "prompt 0 holds 1.5"), ("[[true, false, 3]]", "prompt 0 holds True"),
    ("[]", "non-empty JSON list"), ('[["a", "b"]]', "prompt 0 holds 'a'"), ("[[1, 2], []]", "prompt 1 must be"),
    ("[[1, -2]]", "prompt 0 holds -2"), ("{not json", "not JSON"),
])
def test_prompt_ids_are_checked_before_any_model_loads(tmp_path, capsys, content, message):
    ids = tmp_path / "ids.json"
    ids.write_text(content)
    argv = ["replay", "record", "--out", str(tmp_path / "t.safetensors"), "--model", str(tmp_path / "no-model"),
            "--dflash", str(tmp_path / "no-drafter"), "--prompt-ids", str(ids)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and str(ids) in err and "no-model" not in err  # refused before the folders are read


def test_replay_info_lists_the_prompts(world, tmp_path, capsys):
    trace = world.trace.save(tmp_path / "t.safetensors")
    assert main(["replay", "info", str(trace)]) == 0
    out = capsys.readouterr().out
    assert f"{world.trace.num_prompts} prompts (index, id, first words):" in out
    for i, prompt in enumerate(world.trace.meta["prompts"]):
        assert f"{i:4d}  {prompt['id']}  " in out


def test_bench_and_replay_record_run_exact_kernels_by_default_and_generate_the_engines_own():
    """Pairing is what a bench and a trace are for: both load the target on its exact numeric path unless told
    ``--no-exact``; generate and the demo keep the engine's default (llama.cpp exact, torch not)."""
    import argparse
    import importlib

    from treespec.apps.commands import SUBCOMMANDS

    def parsed(command: str, *rest: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(parser)
        return parser.parse_args(list(rest))

    assert parsed("bench", "--out", "x").exact is True and parsed("bench", "--no-exact").exact is False
    assert parsed("replay", "record", "--out", "t").exact is True
    assert parsed("generate", "m", "--prompt", "p").exact is None and parsed("demo").exact is None
    assert parsed("generate", "m", "--prompt", "p", "--exact").exact is True
