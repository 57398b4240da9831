"""A new policy that needs a scorer works everywhere without touching the kernel or the apps.

`SiblingCapped` (tests/sibling_capped.py) is registered once, in tests/conftest.py, through the
public registry.  Bench runs it over the Domino drafter because it declares ``uses_scorer =
"required"``; replay rebuilds its trees from a trace; the lossless tests' arms include it.
"""

from __future__ import annotations

import attrs
import pytest
import test_lossless
from sibling_capped import NAME, SiblingCapped
from test_bench_runner import CONFIG, make_harness, prompt_files
from test_replay import World, assert_replay_equals_live

import treespec.apps.bench as ab
from treespec import registry
from treespec.apps.assembly.methods import parse_method
from treespec.apps.replay import RecordConfig


def test_it_is_registered_and_declares_its_needs():
    assert registry.resolve("policy", NAME) is SiblingCapped
    assert parse_method(f"{NAME}@8").drafter == "domino"  # picked from uses_scorer, no list edited


def test_the_lossless_tests_cover_it():
    assert (NAME, True) in test_lossless.ARMS and (NAME, False) not in test_lossless.ARMS


def test_bench_runs_it_over_domino_and_it_equals_ar(tmp_path):
    config = attrs.evolve(CONFIG, methods=("ar", f"{NAME}@6"), temperatures=(0.0, 1.0),
                          datasets=prompt_files(tmp_path))
    ab.run_shard(config, make_harness(), tmp_path / "out", progress=False)
    ab.merge_shards(tmp_path / "out")
    records = list(ab.read_records(tmp_path / "out" / ab.RECORDS))
    ours = [r for r in records if r.method == f"{NAME}@6"]
    ar = {r.key: r for r in records if r.method == "ar"}
    assert ours and all(r.policy == NAME and r.budget == 6 for r in ours)
    assert all(r.tokens == ar[r.key].tokens for r in ours)  # lossless at T = 0 and keyed T = 1
    assert all(r.stage_times["build"] > 0 for r in ours)  # the policy built every round's tree
    assert ab.read_divergences(tmp_path / "out" / ab.DIVERGENCES) == []


@pytest.fixture(scope="module")
def world():
    return World(16, RecordConfig(max_new_tokens=16, max_budget=64), n_prompts=2, seed=4)


@pytest.mark.parametrize("budget", [4, 24])
def test_replay_rebuilds_its_trees_and_taus(world, budget):
    assert_replay_equals_live(world, f"{NAME}@{budget}")
