"""The tree rules past DominoTree (docs/tree-rules.md): pruning by mass or ratio, a confidence floor
learned from what the target accepted, acceptance learned per depth, rank and main path, a fan-out by
the top-1/top-2 gap, and a router.  Each reduces to its parent policy where its rule is idle, learns
what its feedback shows it, and replays as it runs live."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_replay import Capturing, World

from treespec import registry
from treespec.apps.replay import RecordConfig, ReplayDrafts
from treespec.apps.replay.evaluate import replay_rounds
from treespec.decoding import SpeculativeDecoder
from treespec.interfaces import DraftContext, RoundReport, VerifyResult
from treespec.policies.confident import ConfidentDominoTree, LearnedFloor, isotonic
from treespec.policies.ddtree import DDTree
from treespec.policies.dominotree import DominoTree
from treespec.policies.gap_ddtree import GapDDTree
from treespec.policies.learned import AcceptanceTable, LearnedDDTree, LearnedDominoTree
from treespec.policies.pruned_dominotree import PrunedDominoTree
from treespec.policies.router import Router
from treespec.tree import DraftTree


def drafts(conditional: bool, n: int = 6):
    out = []
    for seed in range(n):
        quantum = 1.0 if seed % 2 else None
        if conditional:
            drafter = registry.create("drafter", "toy-conditional", seed=seed, quantum=quantum)
        else:
            drafter = registry.resolve("drafter", "marginal").random(depth=6, vocab_size=64, seed=seed, quantum=quantum)
        out.append(drafter.draft(DraftContext(sequence=torch.tensor([1, 2, 3 + seed]), features=None)))
    return out


@pytest.mark.parametrize("budget", [1, 8, 24])
def test_each_rule_idle_builds_its_parents_tree(budget):
    for draft in drafts(False):
        ddtree = DDTree(budget=budget).build(draft)
        assert LearnedDDTree(budget=budget, node_topk=budget).build(draft).equal(ddtree)  # factors all 1
        assert GapDDTree(budget=budget, width=budget, ratio=1e30).build(draft).equal(ddtree)  # never sure
    for draft in drafts(True):
        domino = DominoTree(budget=budget).build(draft)
        assert LearnedDominoTree(budget=budget).build(draft).equal(domino)
        assert PrunedDominoTree(budget=budget, rule="ratio", ratio=1e30).build(draft).equal(domino)
        assert PrunedDominoTree(budget=budget, rule="mass", mass=2.0).build(draft).equal(domino)
        assert ConfidentDominoTree(budget=budget).build(draft).equal(domino)  # θ = 0 before any evidence
        assert Router(budget=budget, arms="dominotree").build(draft).equal(domino)


def test_pruning_keeps_the_children_its_rule_allows():
    for draft in drafts(True):
        for rule, setting in (("mass", {"mass": 0.5}), ("ratio", {"ratio": 2.0})):
            tree = PrunedDominoTree(budget=48, rule=rule, **setting).build(draft)
            full = DominoTree(budget=48).build(draft)
            assert tree.budget <= full.budget and bool(torch.isfinite(tree.scores).all())
            for node, kids in enumerate(tree.children):
                probs = [math.exp(float(tree.scores[c] - tree.scores[node])) for c in kids]
                if rule == "ratio" and probs:
                    assert min(probs) >= max(probs) / 2.0 - 1e-6  # every kept child within the ratio of the best
                if rule == "mass" and len(probs) > 1:
                    assert sum(sorted(probs, reverse=True)[:-1]) < 0.5 + 1e-6  # the last was needed to reach it


def test_the_gap_fans_out_where_the_drafter_is_unsure():
    draft = drafts(False)[0]
    lp = draft.logprobs.clone()
    lp[0] = torch.log_softmax(torch.tensor([8.0] + [0.0] * 63), 0)  # depth 1: sure; the others as drawn
    sure = type(draft)(lp, draft.root_token)
    tree = GapDDTree(budget=16, width=4, ratio=4.0).build(sure)
    assert sum(1 for d in tree.depths.tolist() if d == 1) == 1  # one child at the sure depth


def test_the_acceptance_table_learns_that_off_path_siblings_are_accepted_less():
    """Main-path children always accepted, their siblings never: after a refit the main-path cells'
    factors rise and the off-path ones fall, and the learned tree puts more nodes on the main path."""
    table = AcceptanceTable(refit_every=4)
    policy = LearnedDDTree(budget=16, table=table)
    draft = drafts(False)[0]
    for _ in range(4):
        tree = policy.build(draft)
        chain = [0]
        for i in range(1, len(tree)):
            if tree.parents[i] == chain[-1] and tree.ranks[i] == 0:
                chain.append(i)
        policy.observe_round(RoundReport(tree, VerifyResult(torch.tensor(chain), 0), 10, {}, True))
    assert table.refits == 1
    assert float(table.factor[1, 0, 0]) > 1.0 > float(table.factor[1, 0, 1])  # depth 1: the best child up, its sibling down
    before, after = DDTree(budget=16).build(draft), policy.build(draft)
    assert after.max_depth >= before.max_depth and not after.equal(before)
    record = table.to_record()
    assert torch.equal(AcceptanceTable.from_record(record).factor, table.factor)
    with pytest.raises(ValueError, match="within"):
        AcceptanceTable.from_record({**record, "factor": (table.factor * 100).tolist()})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=40))
def test_isotonic_fits_are_non_decreasing_and_keep_the_mean(values):
    fit = isotonic(np.array(values))
    assert len(fit) == len(values) and np.all(np.diff(fit) >= -1e-12)
    assert fit.mean() == pytest.approx(float(np.mean(values)), abs=1e-9)


def test_the_floor_is_where_the_acceptance_rate_falls_under_its_mark():
    floor = LearnedFloor(min_rate=0.2, min_nodes=64, refit_every=1)
    rng = np.random.default_rng(0)
    for _ in range(40):  # nodes of path probability under 0.05 are accepted 2 % of the time, above it 60 %
        probs = rng.uniform(0.001, 0.5, 15)
        accepted = [i + 1 for i, p in enumerate(probs) if rng.random() < (0.6 if p >= 0.05 else 0.02)]
        tree = DraftTree.build([0] * 16, [-1] + [0] * 15, None, [0.0, *np.log(probs).tolist()])
        floor.observe(tree, [0, *accepted])
    assert 0.02 < floor.floor < 0.1
    policy = ConfidentDominoTree(budget=48, floor=floor)
    draft = drafts(True)[0]
    kept = policy.build(draft)
    assert bool((kept.scores[1:] >= math.log(floor.floor) - 1e-6).all())
    assert kept.equal(policy.with_backend("networkx").build(draft))


def test_the_router_probes_each_arm_then_keeps_the_best():
    router = Router(budget=8, arms="ddtree|dominotree", probe=2)
    taus = {0: 2, 1: 4}  # dominotree accepts more
    chosen = []
    router.begin_generation()
    for _ in range(7):
        router.begin_round()
        chosen.append(router.choice.current)
        result = VerifyResult(torch.arange(taus[router.choice.current]), 0)
        router.observe_round(RoundReport(DraftTree.root_only(1), result, 0, {}, True))
    assert chosen == [0, 1, 0, 1, 1, 1, 1]
    router.begin_generation()
    router.begin_round()
    assert router.choice.current == 0  # a new request probes again
    with pytest.raises(ValueError, match="arms must name"):
        Router(arms="router")


@pytest.fixture(scope="module")
def world():
    return World(16, RecordConfig(max_new_tokens=24, max_budget=64), n_prompts=3, seed=6)


@pytest.mark.parametrize("make, drafter, learned", [
    (lambda: LearnedDominoTree(budget=8, table=AcceptanceTable(refit_every=1)), "domino", lambda p: p.table.refits),
    (lambda: LearnedDDTree(budget=8, table=AcceptanceTable(refit_every=1)), "dflash", lambda p: p.table.refits),
    (lambda: ConfidentDominoTree(budget=8, min_rate=0.3, floor=LearnedFloor(min_nodes=16, refit_every=1)), "domino",
     lambda p: p.floor.floor > 0),
    (lambda: Router(budget=8, arms="dominotree|learned-dominotree", probe=1), "domino",
     lambda p: p.policies[1].table.refits),
])
def test_learning_policies_replay_as_they_run_live(world, make, drafter, learned):
    """One policy across the prompts, learning from every round: replay feeds it the same reports as
    the live loop (start, begin, observe), so it builds the same trees and accepts the same tokens."""
    live_policy, replay_policy = Capturing(make()), make()
    decoder = SpeculativeDecoder(world.target, world.drafters[drafter], live_policy)
    drafts_of = ReplayDrafts.of(world.trace, drafter)
    controller = replay_policy.draft_controller()
    for i, prompt in enumerate(world.prompts):
        live = decoder.generate(prompt, max_new_tokens=world.trace.max_new_tokens).stats.taus
        replayed = [r.tau for r in replay_rounds(world.trace, drafts_of, replay_policy, i, controller=controller)]
        assert replayed == live, f"prompt {i}"
    assert learned(replay_policy) and learned(live_policy.inner)  # they did learn on the way


def test_what_a_policy_learned_is_kept_per_drafter_and_given_back():
    """A learning policy's state goes into the profile under the drafter's key, survives the cache's
    JSON and starts a later policy where the first left off; a damaged state is refused by name."""
    from treespec.apps.assembly.cost_source import restore_learned
    from treespec.pricing.profile import CostProfile

    drafter = registry.create("drafter", "toy-conditional", seed=3)
    first = LearnedDominoTree(budget=8, table=AcceptanceTable(refit_every=1))
    draft = drafter.draft(DraftContext(sequence=torch.tensor([1, 2, 3]), features=None))
    tree = first.build(draft)
    first.observe_round(RoundReport(tree, VerifyResult(torch.tensor([0, 1]), 0), 3, {}, True))
    profile = CostProfile(((1, 8, 0.01),), {drafter.identity(): 0.002})
    kept = CostProfile.from_record(profile.with_learned("learned-dominotree", drafter, first.learned_state()).to_record())
    later = LearnedDominoTree(budget=8)
    assert restore_learned(later, drafter, lambda: kept) and torch.equal(later.table.factor, first.table.factor)
    assert later.build(draft).equal(first.build(draft))
    assert not restore_learned(DominoTree(budget=8), drafter, lambda: kept)  # learns nothing: untouched
    with pytest.raises(ValueError, match="within"):
        later.restore_learned({**first.learned_state(), "factor": (first.table.factor * 100).tolist()})
    floor = ConfidentDominoTree(budget=8)
    floor.restore_learned({"floor": 0.05, "nodes": [[-1.0, 1.0], [-4.0, 0.0]]})
    assert floor.floor.floor == 0.05 and floor.learned_state()["nodes"] == [[-1.0, 1.0], [-4.0, 0.0]]
    with pytest.raises(ValueError, match="learned floor"):
        floor.restore_learned({"floor": 2.0, "nodes": []})


def test_the_page_tables_are_derived_from_the_committed_records():
    """docs/tree-rules.md's tables are what benchmarks/bench_tree_rules.py derives from its records."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    from bench_tree_rules import tables

    records = json.loads((root / "docs" / "figures" / "rules" / "records.json").read_text())
    page = (root / "docs" / "tree-rules.md").read_text()
    shown = page.partition("<!-- tables: benchmarks/bench_tree_rules.py -->\n")[2].partition("<!-- end of tables -->")[0]
    assert shown.strip() == tables(records).strip()
    assert records["turns"] == 50 and all(len(m["taus"]) == 50 for m in records["methods"].values())
