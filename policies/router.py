"""Router: per request, the registered policy among ``arms`` that the first rounds say accepts most.

Contract
--------
``Router(budget=16, arms="dominotree|ddtree|pruned-dominotree", probe=2)``.  Each arm is a registered
policy built at ``budget``.  At the start of a generation (`TreePolicy.begin_generation`) the router
forgets the last request; its first drafted rounds try each arm in turn, ``probe`` rounds each, and
the rest of the generation uses the arm whose probe rounds accepted most tokens per round (ties: the
earlier arm).  The choice is made before each round (`TreePolicy.begin_round`) and learned after it
(`TreePolicy.observe_round`, which also reaches the arm that built the round, so an arm that
learns, such as ``learned-dominotree``, keeps learning).  An arm that needs a scorer is skipped on a
draft without one.  Without the hooks (a bare ``build``) the first arm builds.  The choice belongs to
one request: in a batch each request gets its own router (`TreePolicy.for_request`) over the same arms,
so what an arm learns per drafter it learns from every request.
A per-request router by task (math, code, chat) would need the request's task, which a policy is
not told; the acceptance of the first rounds stands in for it.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from treespec import registry
from treespec.interfaces import DraftOutput, RoundReport, TreePolicy, backend_field
from treespec.policies.engine.best_first import budget_field, count_field
from treespec.tree import DraftTree

__all__ = ["Router"]


@attrs.define(eq=False)
class _Choice:
    """A generation's rounds per arm, and the arm of the round under way."""

    taus: list[list[int]] = attrs.field(factory=list)  # per arm: the drafted rounds' τ this generation
    current: int = 0  # the arm that builds the next round

    def choose(self, probe: int) -> int:
        """The arm still probing the fewest rounds, else the best mean τ (ties: the earlier arm)."""
        counts = [len(t) for t in self.taus]
        if min(counts) < probe:
            return counts.index(min(counts))
        means = [sum(t[:probe]) / probe for t in self.taus]
        return means.index(max(means))


@attrs.frozen
class Router(TreePolicy):
    """The arm the first rounds of a request favour (module docstring)."""

    name: ClassVar[str] = "router"
    uses_scorer: ClassVar[str] = "optional"
    learns: ClassVar[bool] = True

    budget: int = budget_field(16)  # non-root nodes per round, for every arm
    backend: str = backend_field()  # "torch" (vectorised) or "networkx" (the readable reference)
    arms: str = "dominotree|ddtree|pruned-dominotree"  # registered policies, '|'-separated
    probe: int = count_field(2)  # drafted rounds each arm is tried at a request's start
    choice: _Choice = attrs.field(factory=_Choice, metadata={"option": False})  # learned per request
    policies: tuple = attrs.field(init=False, default=(), eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        names = [n for n in self.arms.split("|") if n]
        if not names or self.name in names:
            raise ValueError(f"arms must name one or more registered policies other than the router, got {self.arms!r}")
        built = tuple(registry.create("policy", n, budget=self.budget).with_backend(self.backend) for n in names)
        object.__setattr__(self, "policies", built)
        if len(self.choice.taus) != len(built):
            self.choice.taus = [[] for _ in built]

    def begin_generation(self) -> None:
        self.choice.taus = [[] for _ in self.policies]
        self.choice.current = 0
        for arm in self.policies:
            arm.begin_generation()

    def for_request(self) -> Router:
        """A router of its own choice for one request, over these same arms."""
        copy = attrs.evolve(self, choice=_Choice([[] for _ in self.policies]))
        object.__setattr__(copy, "policies", self.policies)
        return copy

    def begin_round(self) -> None:
        self.choice.current = self.choice.choose(self.probe)

    def observe_round(self, report: RoundReport) -> None:
        if report.drafted:
            self.choice.taus[self.choice.current].append(report.result.tau)
        self.policies[self.choice.current].observe_round(report)

    def build(self, draft: DraftOutput) -> DraftTree:
        return self._arm(draft).build(draft)

    def _arm(self, draft: DraftOutput) -> TreePolicy:
        """The current arm, or the first one this draft can feed (a scorer arm needs a scorer)."""
        usable = [i for i, arm in enumerate(self.policies) if arm.uses_scorer != "required" or draft.scorer is not None]
        if not usable:
            raise ValueError(f"no arm of {self.arms!r} can build from a draft without a scorer")
        return self.policies[self.choice.current if self.choice.current in usable else usable[0]]
