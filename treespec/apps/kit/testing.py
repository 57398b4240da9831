"""A test kit for tree policies: the checks every built-in policy passes, in one call.

Contract
--------
``check_policy(policy)`` takes a registered name, a policy class, any callable that returns a
policy (a factory, a ``functools.partial``; called with ``budget=B`` when it takes a budget, and
``cost_model=`` when the policy declares ``uses_cost_model``), or one instance, and raises
`PolicyCheckError` (an AssertionError, so pytest shows it as a failure) naming the first check that
failed, the budget and the draft.  The checks, over random drafts of the registry's toy drafters
(``marginal``, and ``toy-conditional`` when the policy reads a scorer), with ties forced in some:

1. **a valid tree**: what live decoding, replay and drawing check of every tree
   (`treespec.decoding.checked_tree`: `DraftTree`'s invariants, the draft's root token, at most the
   policy's ``budget`` non-root nodes, no deeper than the draft, tokens in the vocabulary), and
   finite scores that never rise from a parent to its child (path log-probabilities);
2. **both backends**: the torch and networkx builds are the same tree (tokens, parents, depths and
   score bits, up to node order: `DraftTree.same_tree`);
3. **determinism**: a second build of the same draft, and ``build_batch`` over several drafts,
   give the same trees, bit for bit;
4. **greedy losslessness**: on a tiny random float64 target, `SpeculativeDecoder` with the
   ``oracle`` drafter (marginal, and conditional when the policy reads a scorer) gives the
   target's own greedy output token for token.

The order of a tree's nodes is not checked: nothing downstream of a build depends on it, and
`DraftTree.canonical` puts any valid tree into the order the built-in policies return.

``check_policy`` returns a `PolicyReport` (what was checked, and the mean τ of the lossless runs).
From a third party's tests: ``def test_mine(): check_policy(MyPolicy)``.

``check_exact(policy)`` is the same losslessness on a real model: the embedded SmolLM2 (or the
``model`` given) on an engine's exact numeric path (``exact=True``, `treespec.target.Target.numerics`),
the shipped drafter of the role the policy reads, prompts that run past ``context`` positions, at T = 0
and at T = ``temperature`` (position-keyed draws, match verification): every output must equal the
engine's own AR output token for token, with no near-tie tolerance.  It returns the target's `Numerics`
and raises `PolicyCheckError` naming the first output that differs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import attrs
import torch

from treespec import registry
from treespec.apps.kit.tiny import tiny_causal_lm
from treespec.decoding import PolicyError, SpeculativeDecoder, built_tree, checked_tree
from treespec.interfaces import BACKENDS, DraftContext, DraftOutput, TreePolicy
from treespec.pricing.cost import LinearCost
from treespec.target import Target
from treespec.tree import DraftTree

__all__ = ["PolicyCheckError", "PolicyReport", "check_exact", "check_policy", "check_tree", "tiny_target"]

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


def tiny_target(seed: int = 0, vocab: int = 128) -> Target:
    """A random float64 Qwen3 target small enough for tests (no download), on the default engine."""
    from treespec.apps.assembly.loading import load_target

    return load_target(tiny_causal_lm(vocab=vocab, hidden=32, layers=2, heads=4, kv_heads=2, seed=seed))


def _factory(policy) -> tuple[Callable[[int], TreePolicy], type]:
    """(budget -> policy instance, the policy's class) for a name, class, callable or instance."""
    if isinstance(policy, TreePolicy):
        return (lambda budget: policy), type(policy)
    target = registry.resolve("policy", policy) if isinstance(policy, str) else policy
    if not callable(target):
        raise TypeError(f"check_policy takes a policy name, class, a callable returning a policy, or an instance, "
                        f"got {policy!r}")
    try:
        accepts = inspect.signature(target).parameters
    except (TypeError, ValueError):
        accepts = {}
    takes = lambda name: name in accepts or any(p.kind is p.VAR_KEYWORD for p in accepts.values())  # noqa: E731

    def make(budget: int) -> TreePolicy:
        kwargs = {"budget": budget} if takes("budget") else {}
        built = target(**kwargs)
        if not isinstance(built, TreePolicy):
            raise PolicyCheckError(f"{_label(target)} returned {type(built).__name__}, not a TreePolicy")
        if built.uses_cost_model and getattr(built, "cost_model", None) is None and takes("cost_model"):
            built = target(**kwargs, cost_model=PAYING)  # a machine where trees pay
        return built

    return make, type(make(1))


def _label(target) -> str:
    """A readable name of a policy factory (a class, a function, a functools.partial)."""
    inner = getattr(target, "func", target)
    return getattr(inner, "__name__", type(inner).__name__)


def _fail(check: str, where: str, detail: str) -> PolicyCheckError:
    return PolicyCheckError(f"{check} failed ({where}): {detail}")


def check_tree(tree: DraftTree, draft: DraftOutput, policy: TreePolicy, where: str = "") -> None:
    """Check 1 of the module docstring on one built tree."""
    try:
        checked_tree(tree, draft, policy)
    except PolicyError as exc:
        raise _fail("a valid tree", where, str(exc)) from exc
    scores = tree.scores
    if not bool(torch.isfinite(scores).all()):
        raise _fail("a valid tree", where, "a non-finite score")
    if bool((scores[1:] > scores[tree.parents[1:]]).any()):
        raise _fail("a valid tree", where, "a child scores above its parent (scores are path log-probs)")


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
    """One build by ``policy`` built with ``backend`` (`TreePolicy.with_backend`), as live decoding makes
    it (`treespec.decoding.built_tree`); an error it raises (an invalid tree refused by `DraftTree`, a
    tree its draft does not allow) is a failed check."""
    try:
        return built_tree(policy.with_backend(backend), draft)
    except PolicyError as exc:
        raise _fail("a valid tree", where, str(exc)) from exc


def _check_builds(make, budgets, drafts, label: str) -> None:
    for budget in budgets:
        policy = make(budget).with_backend("torch")
        for i, draft in enumerate(drafts):
            where = f"{label} draft {i}, budget {budget}"
            trees = {backend: _built(policy, draft, backend, f"{where}, {backend}") for backend in BACKENDS}
            for backend, tree in trees.items():
                check_tree(tree, draft, policy, f"{where}, {backend}")
            if not trees["torch"].same_tree(trees["networkx"]):
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
    uses_scorer = cls.uses_scorer
    kinds = {"never": (False,), "optional": (False, True), "required": (True,)}.get(uses_scorer)
    if kinds is None:
        raise PolicyCheckError(f"uses_scorer must be 'never', 'optional' or 'required', got {uses_scorer!r}")
    taus = []
    for conditional in kinds:
        label = "conditional" if conditional else "marginal"
        _check_builds(make, budgets, _drafts(conditional, seeds), label)
        taus += _check_lossless(make, budgets, conditional, prompts, tokens)
    return PolicyReport(make(budgets[0]).name, tuple(budgets), len(seeds), True in kinds, sum(taus) / max(1, len(taus)))


def _long_prompts(tokenizer, count: int, context: int, seed: int) -> list[torch.Tensor]:
    """``count`` prompts of more than ``context`` tokens: the shipped demo prompts, each after a passage of the
    others, cut to the last ``context + 8`` tokens (answers then run past ``context`` positions)."""
    import json
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[2] / "assets" / "demo"
    rows = [json.loads(line) for name in ("chat.jsonl", "math.jsonl")
            for line in (shipped / name).read_text().splitlines() if line.strip()]
    texts = [row.get("prompt") or row["question"] for row in rows]
    out = []
    for i in range(count):
        passage = " ".join(texts[(i + 1 + j) % len(texts)] for j in range(len(texts)))
        ids = tokenizer(f"{passage}\n\n{texts[(i + seed) % len(texts)]}", add_special_tokens=False).input_ids
        while len(ids) < context + 8:
            ids = ids + ids
        out.append(torch.tensor(ids[-(context + 8):], dtype=torch.int64))
    return out


def check_exact(policy: str | TreePolicy, *, engine: str | None = None, model=None, prompts: int = 2,
                tokens: int = 24, context: int = 520, temperature: float = 0.7, seed: int = 0):
    """``policy`` on a real model's exact numeric path against its AR, token for token (module docstring)."""
    from treespec.apps.assembly.loading import DEFAULT_ENGINE, drafter_dirs
    from treespec.apps.assembly.methods import DEFAULT_DRAFTERS
    from treespec.apps.assembly.session import Session
    from treespec.interfaces import SamplingParams

    made = registry.create("policy", policy) if isinstance(policy, str) else policy
    role = "conditional" if made.uses_scorer == "required" else "marginal"
    name = DEFAULT_DRAFTERS[role]
    session = Session.load(model, drafter_dirs([name], []), dtype="float32", engine=engine or DEFAULT_ENGINE,
                           exact=True)
    numerics = session.target.numerics()
    drafter = session.drafters[name]
    decoders = {"ar": SpeculativeDecoder(session.target), "policy": SpeculativeDecoder(session.target, drafter, made)}
    for i, prompt in enumerate(_long_prompts(session.tokenizer, prompts, context, seed)):
        for temp in (0.0, temperature):
            outs = {k: d.generate(prompt, max_new_tokens=tokens, sampling=SamplingParams(temp),
                                  generator=torch.Generator().manual_seed(seed + i)).tokens
                    for k, d in decoders.items()}
            if not torch.equal(outs["ar"], outs["policy"]):
                at = next((j for j, (a, b) in enumerate(zip(outs["ar"].tolist(), outs["policy"].tolist())) if a != b),
                          min(outs["ar"].numel(), outs["policy"].numel()))
                raise _fail("exact decoding", f"{session.target.describe()}, prompt {i} of {prompt.numel()} tokens, "
                            f"T = {temp:g}", f"the output leaves AR's at token {at} ({numerics.how})")
    return numerics
