"""treespec.apps.kit.testing.check_policy: every registered policy passes it, an outside package's policy
can use it in one line, and each kind of broken policy is caught naming the check."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import attrs
import pytest
import torch

from treespec import registry
from treespec.apps.kit.testing import PolicyCheckError, check_policy
from treespec.interfaces import DraftContext, DraftOutput, TreePolicy, backend_field
from treespec.policies.ddtree import DDTree
from treespec.tree import DraftTree


@pytest.mark.parametrize("name", registry.available("policy"))
def test_every_registered_policy_passes_the_kit(name):
    report = check_policy(name, budgets=(1, 16), seeds=range(3), prompts=1, tokens=24)
    assert report.mean_tau > 1.0 and report.budgets == (1, 16)


OUTSIDE = '''
"""An outside package's policy: DDTree with at most `width` candidates per depth."""
import attrs

from treespec.policies.engine.best_first import BestFirstPolicy, budget_field, count_field, check_logprobs
from treespec.policies.engine.candidates import TopTokens


@attrs.frozen
class WidthCapped(BestFirstPolicy):
    name = "width-capped"

    budget: int = budget_field(16)  # non-root nodes per round
    width: int = count_field(3)  # candidates per depth
    stop = None

    def validate(self, draft):
        check_logprobs(draft)

    def candidates(self, draft):
        return TopTokens(draft.logprobs, min(self.budget, self.width, draft.vocab_size))
'''

TEST = '''
from treespec.apps.kit.testing import check_policy
from widthcapped import WidthCapped


def test_width_capped():
    report = check_policy(WidthCapped)
    assert report.name == "width-capped"
'''


@pytest.mark.slow
def test_an_outside_package_checks_its_policy_in_one_line(tmp_path):
    """A policy in a package outside the repository (about 20 lines on the public helpers) runs the kit
    from its own pytest."""
    (tmp_path / "widthcapped.py").write_text(textwrap.dedent(OUTSIDE))
    (tmp_path / "test_outside.py").write_text(textwrap.dedent(TEST))
    assert len(OUTSIDE.strip().splitlines()) <= 40
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout


@attrs.frozen
class Shuffled(TreePolicy):
    """DDTree's tree with its last two nodes swapped: a valid tree, but not in canonical order."""

    budget: int = 16
    backend: str = backend_field()
    name = "shuffled"

    def build(self, draft: DraftOutput) -> DraftTree:
        tree = DDTree(budget=self.budget, backend=self.backend).build(draft)
        a, b = len(tree) - 2, len(tree) - 1  # the last two nodes, swapped when both hang above them
        if a < 1 or max(int(tree.parents[a]), int(tree.parents[b])) >= a or tree.scores[a] == tree.scores[b]:
            return tree
        order = torch.tensor(list(range(a)) + [b, a])
        return DraftTree(tree.tokens[order], tree.parents[order], tree.depths[order], tree.scores[order])


@attrs.frozen
class BackendsDiffer(TreePolicy):
    """The networkx backend builds a smaller tree than the torch one."""

    budget: int = 16
    backend: str = backend_field()
    name = "backends-differ"

    def build(self, draft: DraftOutput) -> DraftTree:
        return DDTree(budget=self.budget if self.backend == "torch" else max(1, self.budget - 1)).build(draft)


@attrs.frozen
class OverBudget(TreePolicy):
    budget: int = 16
    name = "over-budget"

    def build(self, draft: DraftOutput) -> DraftTree:
        return DDTree(budget=self.budget + 1).build(draft)


@attrs.frozen
class RisingScores(TreePolicy):
    """Scores that rise from parent to child: not path log-probs."""

    budget: int = 16
    name = "rising"

    def build(self, draft: DraftOutput) -> DraftTree:
        tree = DDTree(budget=self.budget).build(draft)
        return DraftTree(tree.tokens, tree.parents, tree.depths, -tree.scores)


@pytest.mark.parametrize("broken, check", [(OverBudget, "a valid tree"), (RisingScores, "a valid tree"),
                                           (BackendsDiffer, "both backends")])
def test_a_broken_policy_is_caught_naming_the_check(broken, check):
    with pytest.raises(PolicyCheckError, match=check):
        check_policy(broken, budgets=(4, 16), seeds=range(3), prompts=1, tokens=16)


def test_a_valid_tree_in_an_order_of_its_own_passes_and_canonical_restores_the_engines():
    """Node order is the engine's convention, not a contract: the kit passes a policy that orders its
    nodes otherwise, and `DraftTree.canonical` puts its tree into the engine's order bit for bit."""
    check_policy(Shuffled, budgets=(16,), seeds=range(6), prompts=1, tokens=16)
    draft = registry.resolve("drafter", "marginal").random(depth=6, vocab_size=64, seed=0).draft(
        DraftContext(sequence=torch.tensor([1, 2, 3]), features=None))
    shuffled, ddtree = Shuffled().build(draft), DDTree(budget=16).build(draft)
    assert not shuffled.equal(ddtree) and shuffled.canonical().equal(ddtree) and shuffled.same_tree(ddtree)
