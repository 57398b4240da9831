"""Drive a draft controller with recorded rounds, priced by recorded cost curves, on a deterministic clock.

Contract
--------
`recorded_rounds()` are rounds of DominoTree@16 over the embedded default's Domino drafter, as a live
run verified them (treespec/assets/controller/rounds.json, written by ``benchmarks/bench_controller.py
--record``): per round the 16 candidates' path log-probabilities in pop order and which of them the
target accepted.  Any prefix of the pop order is a tree (best-first adds a node after its parent), so
a round replays at every size: CaDDTree's cost rule (the registry's policy's stop rule) keeps the
first j candidates under a price, and the round commits 1 + (accepted among them) tokens.

`regimes()` are the machines the controller is tested on (treespec/assets/controller/curves.json:
each a `ConvexCost` recorded by a profile, its source named there): ``torch-bf16`` (memory-bound:
a tree verify costs little more than an AR step, so trees pay), ``llama.cpp-q4_1`` (compute-bound:
a verify of n tokens costs nearly n AR steps, no tree pays), ``torch-bf16-icelake`` (a CPU without
bf16 units: a 17-token verify at 4.8 AR steps), and derived from them ``halving`` (torch-bf16,
every second doubled from a given round on), ``trees-dearer`` (torch-bf16 whose tree verifies
become 3x dearer mid-run, the one-token step unchanged) and ``busy`` (torch-bf16 with 30 % of
rounds 3.5x slower, as a CPU hog makes them).

`simulate(controller, regime, ...)` runs ``generations`` generations of ``tokens`` tokens through
the round protocol the decoding loop runs (`treespec.steering.Steering`: its reports' stage seconds
come from the regime's curve at the round's context and the regime's schedule) and returns every round
(`SimRound`).  `fixed_rate(regime, choice)` is the tokens per second of a fixed choice (`FixedChoice`:
"ar", "full": the whole budget every round, "priced": the cost rule at the true curve every round)
simulated over the same rounds, the yardstick of the controller's regret.  Everything is deterministic
in the seed.  It is a library feature for whoever writes a draft controller: a new rule is scored on
the recorded machines in seconds, with no model (tests/test_control.py, benchmarks/bench_controller.py).
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

from treespec import registry
from treespec.interfaces import Decision, DraftController, DraftOutput, RoundReport, VerifyResult
from treespec.pricing.calibration import Calibration, fit_calibration
from treespec.pricing.cost import ConvexCost, CostModel, cost_model_from_dict
from treespec.steering import Steering
from treespec.tree import DraftTree

__all__ = ["FIXED_CHOICES", "FixedChoice", "RecordedRound", "Regime", "SimRound", "fixed_rate", "recorded_calibration",
           "recorded_rounds", "regimes", "simulate", "summary"]

FIXED_CHOICES = ("ar", "full", "priced")  # the fixed choices a controller's regret is measured against
PROMPT_TOKENS = 128  # the context a generation starts at


@attrs.frozen
class RecordedRound:
    """One verified round of a best-first tree (module docstring)."""

    scores: tuple[float, ...]  # [B] path log-probs of the candidates, pop order
    accepted: frozenset[int]  # the accepted path's candidates (1-based pop-order indices)

    def tau(self, kept: int) -> int:
        """Tokens the round commits when its tree holds the first ``kept`` candidates."""
        return 1 + sum(1 for a in self.accepted if a <= kept)


@attrs.frozen
class Regime:
    """A machine: what rounds truly cost, what the controller is told, and how it changes."""

    name: str
    cost: ConvexCost  # C_d (draft + build) and C_v(n; ctx) the clock charges
    prior: CostModel  # the profile the controller starts from
    change_at: int | None = None  # the tokens committed (over the run) from which the factors apply
    step_factor: float = 1.0  # the one-token step's seconds multiplied from `change_at`
    tree_factor: float = 1.0  # a tree round's seconds multiplied from `change_at`
    busy: float = 0.0  # share of rounds that run `busy_factor` times slower
    busy_factor: float = 3.5
    noise: float = 0.05  # the spread of a quiet machine's round times (lognormal sigma)
    taps: float = 0.0  # the share a verify costs more when the engine computes the drafter's taps

    def step(self, done: int, ctx: int) -> float:
        """The one-token step after ``done`` tokens at ``ctx``, noise left out: what an AR round pays."""
        late = self.change_at is not None and done >= self.change_at
        return self.cost.verify_seconds(1, ctx) * (self.step_factor if late else 1.0)

    def seconds(self, done: int, n: int, ctx: int, drafted: bool, rng: random.Random,
                tapped: bool = False) -> tuple[float, float]:
        """(verify seconds, draft + build seconds) of a round of ``n`` tree tokens at ``ctx`` after ``done``
        tokens committed over the run, in a generation whose forwards compute the taps or not."""
        verify = self.cost.verify_seconds(n, ctx) * (1.0 + self.taps if tapped else 1.0)
        draft = self.cost.draft_cost if drafted else 0.0
        if self.change_at is not None and done >= self.change_at:
            factor = self.tree_factor if n > 1 else self.step_factor
            verify, draft = verify * factor, draft * factor
        slow = self.busy_factor if rng.random() < self.busy else 1.0
        jitter = math.exp(rng.gauss(0.0, self.noise)) * slow
        return verify * jitter, draft * jitter


@attrs.frozen
class SimRound:
    """One simulated round."""

    tau: int
    size: int  # tree tokens, root included (1: an AR step)
    seconds: float
    drafted: bool
    explored: bool
    step: float  # the true one-token step at the round's context and time (what AR would have paid)


_DATA = Path(__file__).resolve().parents[2] / "assets" / "controller"


def _data(name: str) -> dict:
    return json.loads((_DATA / name).read_text())


@functools.cache
def recorded_rounds() -> tuple[RecordedRound, ...]:
    """The recorded rounds (module docstring), in their order."""
    data = _data("rounds.json")
    return tuple(RecordedRound(tuple(r["scores"]), frozenset(r["accepted"])) for r in data["rounds"])


@functools.cache
def recorded_calibration() -> Calibration:
    """The (κ, β) fitted on the recorded rounds' nodes, as a profile fits a drafter's (what the cost rule
    and the controller's promises are calibrated with in `simulate`)."""
    rounds = [(torch.tensor(r.scores, dtype=torch.float64),
               torch.tensor([i + 1 in r.accepted for i in range(len(r.scores))])) for r in recorded_rounds()]
    return fit_calibration(rounds)


@functools.cache
def _curves() -> dict[str, ConvexCost]:
    return {name: cost_model_from_dict(entry["curve"], name) for name, entry in _data("curves.json")["curves"].items()}


def regimes(*, prior_error: float = 1.0) -> dict[str, Regime]:
    """The regimes of the module docstring; ``prior_error`` scales the prior each controller is told
    (1: the profile is right; 1.4: it says every round costs 40 % more than it does)."""
    curves = _curves()

    def told(cost: ConvexCost) -> ConvexCost:
        return ConvexCost(cost.draft * prior_error, cost.contexts, cost.knots,
                          tuple(tuple(v * prior_error for v in vs) for vs in cost.values))

    torch_bf16 = curves["torch-bf16"]
    out = {name: Regime(name, cost, told(cost)) for name, cost in curves.items()}
    out["llama.cpp-q4_1"] = attrs.evolve(out["llama.cpp-q4_1"], taps=0.087)  # 13.16 against 12.11 ms a step
    half = 6 * 64  # half of `simulate`'s default run
    out["halving"] = Regime("halving", torch_bf16, told(torch_bf16), change_at=half, step_factor=2.0, tree_factor=2.0)
    out["trees-dearer"] = Regime("trees-dearer", torch_bf16, told(torch_bf16), change_at=half, tree_factor=3.0)
    out["busy"] = Regime("busy", torch_bf16, told(torch_bf16), busy=0.3)
    return out


def _stub(ctx: int) -> DraftOutput:
    """A draft the cost rule reads the context of (its rows are never read)."""
    return DraftOutput(torch.zeros(1, 2), 0, position=ctx)


@functools.lru_cache(maxsize=64)
def _rule(curve: CostModel, budget: int):
    """The cost rule of CaDDTree (the registry's, the treespec convention) at ``curve``, calibrated as recorded."""
    policy = registry.create("policy", "caddtree", budget=budget, cost_model=curve, calibration=recorded_calibration())
    return policy.stop


def _kept(curve: CostModel, scores: Sequence[float], ctx: int, budget: int) -> int:
    """Candidates the cost rule keeps at ``curve`` among the recorded ones (pop order: its trim)."""
    return _rule(curve, budget).trim(_stub(ctx), torch.tensor(scores[:budget], dtype=torch.float32))


def _tree(scores: Sequence[float]) -> DraftTree:
    """A verified tree of the kept candidates, their recorded path log-probs as its scores (a chain: the
    controller reads its size and its scores, never its shape)."""
    steps = [scores[0], *(b - a for a, b in zip(scores, scores[1:]))] if scores else []
    return DraftTree.chain(0, list(range(1, len(scores) + 1)), steps)


def simulate(controller: DraftController, regime: Regime, *, generations: int = 12, tokens: int = 64,
             budget: int = 16, seed: int = 0) -> list[SimRound]:
    """Every round of ``generations`` generations of ``tokens`` tokens under ``controller``, through the round
    protocol (`treespec.steering.Steering`) as the decoding loop runs it (module docstring)."""
    rng, recorded, out, total = random.Random(seed), recorded_rounds(), [], 0
    for _ in range(generations):
        steering, done = Steering(controller), 0
        tapped = steering.start()  # the engine computes taps for the whole generation its prefill asked them for
        while done < tokens:
            record, ctx = recorded[len(out) % len(recorded)], PROMPT_TOKENS + done
            decision = steering.decide()
            kept = _kept(decision.price or regime.prior, record.scores, ctx, budget) if decision.draft else 0
            tau = min(record.tau(kept), tokens - done)
            verify, draft = regime.seconds(total, kept + 1, ctx, decision.draft, rng, tapped)
            times = ({"draft": draft * 0.8, "build": draft * 0.2, "verify": verify} if decision.draft
                     else {"verify": verify})
            report = RoundReport(_tree(record.scores[:kept]), VerifyResult(torch.arange(tau), 0), ctx, times,
                                 decision.draft, decision.explore, tapped=tapped)
            steering.report(report)
            out.append(SimRound(tau, kept + 1, report.seconds, decision.draft, decision.explore,
                                regime.step(total, ctx)))
            done += tau
            total += tau
    return out


class FixedChoice(DraftController):
    """A controller that always makes one of `FIXED_CHOICES`: ``"ar"`` (no generation drafts), ``"full"`` (the
    whole budget every round: a flat curve) or ``"priced"`` (the cost rule at ``curve``, the true one)."""

    def __init__(self, choice: str, curve: CostModel) -> None:
        if choice not in FIXED_CHOICES:
            raise ValueError(f"choice must be one of {FIXED_CHOICES}, got {choice!r}")
        flat = ConvexCost(curve.draft_cost, (PROMPT_TOKENS,), ((1.0,),), ((curve.verify_seconds(1, PROMPT_TOKENS),),))
        self.choice, self._decision = choice, Decision(price=flat if choice == "full" else curve)

    def start_generation(self) -> bool:
        return self.choice != "ar"

    def decide(self) -> Decision:
        return self._decision


def fixed_rate(regime: Regime, choice: str, *, generations: int = 12, tokens: int = 64, budget: int = 16,
               seed: int = 0) -> float:
    """Tokens per second of a fixed choice (`FIXED_CHOICES`) over the rounds `simulate` runs."""
    return summary(simulate(FixedChoice(choice, regime.cost), regime, generations=generations, tokens=tokens,
                            budget=budget, seed=seed))["rate"]


def summary(rounds: Sequence[SimRound]) -> dict[str, float]:
    """Tokens, seconds, tokens per second, drafted / AR / exploring rounds of a simulation."""
    tokens, seconds = sum(r.tau for r in rounds), sum(r.seconds for r in rounds)
    return {"tokens": tokens, "seconds": seconds, "rate": tokens / seconds,
            "drafted": sum(r.drafted for r in rounds), "ar": sum(not r.drafted for r in rounds),
            "explored": sum(r.explored for r in rounds)}
