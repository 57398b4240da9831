"""A test kit for tree policies: the checks every built-in policy passes, in one call.

Contract
--------
``check_policy(policy)`` takes a registered name, a policy class or factory (called with
``budget=B``, and ``cost_model=`` when it declares ``uses_cost_model``), or one instance, and
raises `PolicyCheckError` (an AssertionError, so pytest shows it as a failure) naming the first
check that failed, the budget and the draft.  The checks, over random drafts of the registry's toy
drafters (``marginal``, and ``toy-conditional`` when the policy reads a scorer), with ties forced
in some of them:

1. **a valid tree**: `DraftTree`'s invariants, the draft's root token, tokens in the vocabulary, at
   most ``budget`` non-root nodes and no deeper than the draft, finite scores that never rise
   from a parent to its child;
2. **canonical order**: nodes sorted by score descending, ties by rank path (`treespec.tree`);
3. **both backends**: the torch and networkx builds are equal bit for bit (tokens, parents, depths,
   order, score bits);
4. **determinism**: a second build of the same draft, and ``build_batch`` over several drafts,
   give the same trees;
5. **greedy losslessness**: on a tiny random float64 target, `SpeculativeDecoder` with the
   ``oracle`` drafter (marginal, and conditional when the policy reads a scorer) gives the
   target's own greedy output token for token.

``check_policy`` returns a `PolicyReport` (what was checked, and the mean τ of the lossless runs).
From a third party's tests: ``def test_mine(): check_policy(MyPolicy)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import attrs
import torch

from treespec import registry
from treespec.apps.tiny import tiny_causal_lm
from treespec.decoding import SpeculativeDecoder
from treespec.interfaces import BACKENDS, DraftContext, DraftOutput, TreePolicy
from treespec.pricing.cost import LinearCost
from treespec.target import TargetModel
from treespec.tree import DraftTree

__all__ = ["PolicyCheckError", "PolicyReport", "check_policy", "check_tree", "tiny_target"]

# a machine where trees pay (a verified token costs 0.2 % of a forward), for cost-aware policies
PAYING = LinearCost(draft=0.001, base=0.05, per_token=1e-4)


class PolicyCheckError(AssertionError):
    """A policy failed one of `check_policy`'s checks (the message names which, and where)."""


@attrs.frozen
class PolicyReport:
    """What `check_policy` checked."""

    name: str  # the policy's name
    budgets: tuple[int, ...]  # budgets built at
    drafts: int  # drafts built per budget and backend
    conditional: bool  # also over conditional drafts (the policy reads a scorer)
    mean_tau: float  # over the greedy lossless runs


def tiny_target(seed: int = 0, vocab: int = 128) -> TargetModel:
    """A random float64 Qwen3 target small enough for tests (no download)."""
    return TargetModel(tiny_causal_lm(vocab=vocab, hidden=32, layers=2, heads=4, kv_heads=2, seed=seed))


def _factory(policy) -> tuple[Callable[[int], TreePolicy], type]:
    """(budget -> policy instance, the policy's class) for a name, class, factory or instance."""
    if isinstance(policy, TreePolicy):
        return (lambda budget: policy), type(policy)
    target = registry.resolve("policy", policy) if isinstance(policy, str) else policy
    if not callable(target):
        raise TypeError(f"check_policy takes a policy name, class, factory or instance, got {policy!r}")
    accepts = inspect.signature(target).parameters

    def make(budget: int) -> TreePolicy:
        kwargs = {"cost_model": PAYING} if getattr(target, "uses_cost_model", False) else {}
        if "budget" in accepts:
            kwargs["budget"] = budget
        return target(**kwargs)

    return make, target


def _fail(check: str, where: str, detail: str) -> PolicyCheckError:
    return PolicyCheckError(f"{check} failed ({where}): {detail}")


def check_tree(tree: DraftTree, draft: DraftOutput, budget: int | None, where: str = "") -> None:
    """Checks 1 and 2 of the module docstring on one built tree."""
    if not isinstance(tree, DraftTree):
        raise _fail("a valid tree", where, f"build returned {type(tree).__name__}, not a DraftTree")
    if tree.root_token != draft.root_token:
        raise _fail("a valid tree", where, f"root token {tree.root_token}, the draft's is {draft.root_token}")
    if budget is not None and tree.budget > budget:
        raise _fail("a valid tree", where, f"{tree.budget} non-root nodes for budget {budget}")
    if tree.max_depth > draft.depth:
        raise _fail("a valid tree", where, f"depth {tree.max_depth} beyond the draft's {draft.depth}")
    if bool((tree.tokens < 0).any()) or bool((tree.tokens >= draft.vocab_size).any()):
        raise _fail("a valid tree", where, "a token outside the vocabulary")
    scores = tree.scores
    if not bool(torch.isfinite(scores).all()):
        raise _fail("a valid tree", where, "a non-finite score")
    if bool((scores[1:] > scores[tree.parents[1:]]).any()):
        raise _fail("a valid tree", where, "a child scores above its parent (scores are path log-probs)")
    paths = tree.rank_paths
    keys = [(-float(s), p) for s, p in zip(scores.tolist(), paths)]
    if keys[1:] != sorted(keys[1:]):
        first = next(i for i in range(2, len(keys)) if keys[i] < keys[i - 1])
        raise _fail("canonical order", where, f"node {first} (score {-keys[first][0]}, path {keys[first][1]}) comes "
                    f"after node {first - 1} (score {-keys[first - 1][0]}, path {keys[first - 1][1]})")


def _drafts(conditional: bool, seeds: Sequence[int]) -> list[DraftOutput]:
    """Random drafts of the toy drafters; every other one with ties forced (logits on a grid)."""
    drafts = []
    for seed in seeds:
        quantum = 1.0 if seed % 2 else None
        if conditional:
            drafter = registry.create("drafter", "toy-conditional", seed=seed, quantum=quantum)
        else:
            drafter = registry.resolve("drafter", "marginal").random(depth=6, vocab_size=64, seed=seed, quantum=quantum)
        context = DraftContext(sequence=torch.tensor([1, 2, 3 + seed % 7]), features=None)
        drafts.append(drafter.draft(context))
    return drafts


def _built(policy: TreePolicy, draft: DraftOutput, backend: str, where: str) -> DraftTree:
    """One build; an error it raises (an invalid tree refused by `DraftTree`, say) is a failed check."""
    try:
        return policy.build(draft, backend=backend)
    except (ValueError, TypeError, IndexError, RuntimeError) as exc:
        raise _fail("a valid tree", where, f"build raised {type(exc).__name__}: {exc}") from exc


def _check_builds(make, budgets, drafts, label: str) -> None:
    for budget in budgets:
        policy = make(budget)
        for i, draft in enumerate(drafts):
            where = f"{label} draft {i}, budget {budget}"
            trees = {backend: _built(policy, draft, backend, f"{where}, {backend}") for backend in BACKENDS}
            limit = getattr(policy, "budget", None)  # the policy's own (a static tree's None: its choices)
            for backend, tree in trees.items():
                check_tree(tree, draft, limit, f"{where}, {backend}")
            if not trees["torch"].equal(trees["networkx"]):
                raise _fail("both backends", where, "the torch and networkx trees differ")
            if not policy.build(draft).equal(trees["torch"]):
                raise _fail("determinism", where, "a second build of the same draft differs")
        batch = policy.build_batch(drafts)
        for i, (draft, tree) in enumerate(zip(drafts, batch, strict=True)):
            if not tree.equal(policy.build(draft)):
                raise _fail("determinism", f"{label} draft {i}, budget {budget}", "build_batch differs from build")


def _check_lossless(make, budgets, conditional: bool, prompts: int, tokens: int) -> list[int]:
    target = tiny_target()
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 128, (8,), generator=gen) for _ in range(prompts)]
    reference = [SpeculativeDecoder(target).generate(p, max_new_tokens=tokens).tokens for p in ids]
    taus = []
    for budget in budgets:
        oracle = registry.create("drafter", "oracle", config="typical", seed=budget, conditional=conditional)
        decoder = SpeculativeDecoder(target, oracle, make(budget))
        for i, (prompt, expected) in enumerate(zip(ids, reference, strict=True)):
            out = decoder.generate(prompt, max_new_tokens=tokens)
            if not torch.equal(out.tokens, expected):
                at = next(j for j in range(min(out.tokens.numel(), expected.numel()))
                          if out.tokens[j] != expected[j]) if out.tokens.numel() else 0
                kind = "conditional" if conditional else "marginal"
                raise _fail("greedy losslessness", f"{kind} oracle, budget {budget}, prompt {i}",
                            f"the output leaves the target's greedy output at token {at}")
            taus += out.stats.taus
    return taus


def check_policy(policy, *, budgets: Sequence[int] = (1, 4, 16, 48), seeds: Sequence[int] = range(6),
                 prompts: int = 2, tokens: int = 40) -> PolicyReport:
    """Run the kit's checks on ``policy`` (module docstring); raises `PolicyCheckError` on the first failure."""
    make, cls = _factory(policy)
    uses_scorer = getattr(cls, "uses_scorer", "never")
    kinds = {"never": (False,), "optional": (False, True), "required": (True,)}.get(uses_scorer)
    if kinds is None:
        raise PolicyCheckError(f"uses_scorer must be 'never', 'optional' or 'required', got {uses_scorer!r}")
    taus = []
    for conditional in kinds:
        label = "conditional" if conditional else "marginal"
        _check_builds(make, budgets, _drafts(conditional, seeds), label)
        taus += _check_lossless(make, budgets, conditional, prompts, tokens)
    name = getattr(make(budgets[0]), "name", cls.__name__)
    return PolicyReport(name, tuple(budgets), len(seeds), True in kinds, sum(taus) / max(1, len(taus)))
