"""The cost profile of this machine: C_v(n; ctx) of a target and C_d of its drafters, measured here.

Contract
--------
`machine_profile(target, drafters)` returns a `CostProfile`: the median seconds of one target
forward over a tree of n tokens on top of ctx cached tokens, for n in `PROFILE_SIZES` and each of
``contexts`` (the sizes of one context timed in turn within each repeat, `time_verify_sizes`), and
the median seconds of one round of each drafter.  It is measured on first use
(about 20 s for the embedded default on a 2-core CPU) and cached in the treespec cache directory
under a key naming the machine (`treespec.pricing.hardware.machine_identity`), the target's architecture
and dtype, and each drafter's identity (`Drafter.identity`): forward costs depend on shapes, not
weights.  A profile made on another machine, architecture or dtype is never used: its key does
not match, and it is measured again; a corrupt cache file is measured again with a one-line
warning.  Drafters missing from a cached profile are measured and added.

What a profile may say is bounded by what a machine can do, one rule per figure, checked on reading,
before writing (`implausible`: nothing implausible is cached) and on the live curve a run leaves:
a verify of n tokens costs between `VERIFY_FLOOR` one-token verifies and `VERIFY_CEILING` n of them
(`implausible_curve`), a drafter's round between the fractions `DRAFT_RANGE` of one
(`implausible_drafts`), round counts are whole and >= 0, and a live correction stays near the
measured curve (`implausible_live`).  A cached profile that breaks them heals instead of being
believed: its curve, or the drafter's round, is measured again; its calibrations and learned states
stay.  A cached curve within the bounds but wrong for this machine as it is now (made under other
conditions, or edited) is caught at start by `spot_check`, which times the one-token and the
17-token verify again (a fraction of a second) and has the profile measured again when either lies
beyond `SPOT_BOUND` of its cached figure.

``profile.cost_model(drafter)`` is what cost-aware policies price trees with: per context, the
measured median at every profiled size, linear between them (`treespec.pricing.cost.fit_verify_curve`),
with that drafter's C_d.  The sizes are every tree of up to 17 tokens (a 16-node tree and all the
trims a cost rule may choose) and two beyond, because measured verify times are neither smooth nor
monotone: on a 2-core Zen 5 in bf16, forwards of 3, 7 and 11 tokens took 25 % longer than forwards
of 4, 8 and 12, and an earlier profile at 1, 2, 3, 5, 9, 17, 33 with a convex fit through them
priced those slow sizes as cheap.  ``shape="convex"`` gives that fit (CaDDTree's regression).
``profile.verify_in_steps(n)`` is C_v(n) / C_v(1) at the shortest profiled context, the figure
the demo prints.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs
import torch

from treespec.interfaces import DraftContext, Drafter
from treespec.pricing.calibration import Calibration, to_calibration
from treespec.pricing.conditions import current_meter
from treespec.pricing.cost import ConvexCost, fit_verify_curve
from treespec.pricing.hardware import digest, machine_file, machine_identity, read_cached, set_aside, write_cached
from treespec.target import Target
from treespec.tree import DraftTree

logger = logging.getLogger(__name__)  # one line per event; the CLI shows them as "treespec: ..."

__all__ = ["DRAFT_RANGE", "LIVE_BOUND", "LIVE_DRAFT_BOUND", "LIVE_SHAPE_BOUND", "PROFILE_CONTEXTS", "PROFILE_SIZES",
           "SPOT_BOUND", "VERIFY_CEILING", "VERIFY_FLOOR", "CostProfile", "calibration_key", "check_profile",
           "implausible", "implausible_curve", "implausible_drafts", "implausible_live", "learned_key", "machine_profile",
           "refresh_profile", "save_profile", "spot_check", "target_identity", "time_draft", "time_verify",
           "time_verify_sizes"]

PROFILE_SIZES = (*range(1, 18), 24, 33)  # tree tokens n (root included) of the verify samples
PROFILE_CONTEXTS = (128, 512)  # cached context lengths of the verify samples
LIVE_BOUND = 3.0  # a live-corrected verify time lies within this factor of the measured one, either way
LIVE_SHAPE_BOUND = 1.5  # ... and its price in AR steps within this factor of the measured price, either way
LIVE_DRAFT_BOUND = 8.0  # a live draft + build time is at most this many times the measured draft
# What any curve may say of a machine, in its own one-token verifies C_v(1; c) (the smallest size's, per
# context): a forward over more tokens never runs far faster than one over fewer, and never costs more
# than a few one-token forwards per token (memory-bound engines: a 17-token verify at 1.5 steps;
# compute-bound: 10 steps).
VERIFY_FLOOR = 0.5  # C_v(n) >= this times C_v(1)
VERIFY_CEILING = 4.0  # C_v(n) <= this times n C_v(1)
DRAFT_RANGE = (1 / 1000, 20.0)  # a drafter's round, in the one-token verifies of the shortest context
SPOT_BOUND = LIVE_BOUND  # a cached curve's smallest and 17-token verify within this factor of a quick measurement
_SPOT_SIZE = 17  # the tree size the start-up spot check times beside the smallest one
_SPOT_REPEATS = 5
_FORMAT = 1  # version of the cached JSON


def target_identity(target: Target) -> str:
    """A digest of what the target's costs depend on (`treespec.target.Target.identity`: its architecture,
    the file an engine runs)."""
    return digest(target.identity())


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one call of ``fn``, the device synchronised before the clock stops."""
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _median_seconds(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    _seconds(fn, device)  # warm-up
    return statistics.median(_seconds(fn, device) for _ in range(repeats))


def time_verify(target: Target, n: int, ctx: int, repeats: int, generator: torch.Generator) -> float:
    """Median seconds of one forward over an n-node chain on top of ``ctx`` cached tokens."""
    return time_verify_sizes(target, (n,), ctx, repeats, generator)[n]


def time_verify_sizes(target: Target, sizes: Sequence[int], ctx: int, repeats: int,
                      generator: torch.Generator) -> dict[int, float]:
    """Median seconds of one forward over an n-node chain on top of ``ctx`` cached tokens, for each n
    in ``sizes``.  The sizes are timed in turn within every repeat (each repeat starting one size
    later), so a drift of the machine's speed during the profile (another process, a clock change)
    reaches every size alike instead of making some sizes look cheaper than others."""
    prompt = torch.randint(0, target.vocab_size, (ctx + 1,), generator=generator)
    target.prefill(prompt[:-1])  # the last token is the tree's root, as in decoding
    trees = {n: DraftTree.chain(int(prompt[-1]), torch.randint(0, target.vocab_size, (n - 1,), generator=generator))
             for n in sizes}

    def timed(n: int) -> float:
        seconds = _seconds(lambda: target.forward_tree(trees[n]), target.device)
        target.drop_tree()  # the next forward sees the same cache
        return seconds

    order = list(trees)
    for n in order:
        timed(n)  # warm-up
    samples: dict[int, list[float]] = {n: [] for n in order}
    for r in range(repeats):
        for n in order[r % len(order):] + order[:r % len(order)]:
            samples[n].append(timed(n))
    return {n: statistics.median(xs) for n, xs in samples.items()}


def time_draft(target: Target, drafter: Drafter, ctx: int, repeats: int, generator: torch.Generator) -> float:
    """Median seconds of one drafter round with ``ctx`` cached context positions."""
    drafter.bind(target)
    drafter.reset()
    sequence = torch.randint(0, target.vocab_size, (ctx + 1,), generator=generator)
    out = target.prefill(sequence[:-1], drafter.tap_layers)  # taps of every token before the anchor
    drafter.draft(DraftContext(sequence, out.features, 0))
    seconds = _median_seconds(lambda: drafter.draft(DraftContext(sequence, None, ctx)), repeats, target.device)
    drafter.reset()
    return seconds


@attrs.frozen
class CostProfile:
    """Measured verify samples of one target and the draft cost of its drafters, on this machine."""

    verify: tuple[tuple[int, int, float], ...]  # (n tokens, context length, median seconds)
    drafts: Mapping[str, float] = attrs.field(factory=dict)  # drafter identity -> median seconds per round
    calibrations: Mapping[str, Calibration] = attrs.field(factory=dict)  # `calibration_key` -> the drafter's (κ, β)
    # the live-corrected curve decoding runs left (`with_live`): (n, context, seconds, rounds it rests on)
    live_verify: tuple[tuple[int, int, float, int], ...] = ()
    live_drafts: Mapping[str, tuple[float, int]] = attrs.field(factory=dict)  # identity -> (draft + build s, rounds)
    disturbed: str = ""  # measured while another process took its cores (what it took): not cached
    learned: Mapping[str, dict] = attrs.field(factory=dict)  # `learned_key` -> a policy's learned state for a drafter

    def calibration(self, drafter: Drafter | str | None) -> Calibration:
        """The drafter's fitted calibration (`treespec.pricing.calibration`), the identity (its probabilities
        taken as they are) when none was fitted."""
        if drafter is None:
            return Calibration()
        return self.calibrations.get(drafter if isinstance(drafter, str) else calibration_key(drafter), Calibration())

    def pricing(self, drafter: Drafter) -> tuple[ConvexCost, Calibration]:
        """(cost model, calibration) a cost-aware policy over ``drafter`` prices its trees with."""
        return self.cost_model(drafter), self.calibration(drafter)

    def with_calibration(self, drafter: Drafter | str, calibration: Calibration | float) -> CostProfile:
        key = drafter if isinstance(drafter, str) else calibration_key(drafter)
        return attrs.evolve(self, calibrations={**self.calibrations, key: to_calibration(calibration)})

    def learned_state(self, policy: str, drafter: Drafter) -> dict | None:
        """What the ``policy`` learned over ``drafter`` on the calibration prompts (None: nothing kept)."""
        return self.learned.get(learned_key(policy, drafter))

    def with_learned(self, policy: str, drafter: Drafter, state: dict) -> CostProfile:
        return attrs.evolve(self, learned={**self.learned, learned_key(policy, drafter): state})

    def cost_model(self, drafter: Drafter | str | None = None, *, live: bool = True,
                   shape: str = "measured") -> ConvexCost:
        """C_v with this drafter's C_d (0 without a drafter); ``live``: corrected by what earlier
        decoding runs measured (`with_live`) where they left a correction; ``shape``: the measured
        value at every profiled size, or ``"convex"``, CaDDTree's fit (`fit_verify_curve`)."""
        draft = 0.0
        if drafter is not None:
            ident = drafter if isinstance(drafter, str) else drafter.identity()
            if ident not in self.drafts:
                raise KeyError("this profile has not measured that drafter: pass it to machine_profile")
            draft = self.live_drafts[ident][0] if live and ident in self.live_drafts else self.drafts[ident]
        verify = [(n, c, s) for n, c, s, _ in self.live_verify] if live and self.live_verify else self.verify
        contexts = sorted({c for _, c, _ in verify})
        curves = [fit_verify_curve([(n, s) for n, c, s in verify if c == ctx], shape=shape) for ctx in contexts]
        return ConvexCost(draft, tuple(contexts), tuple(k for k, _ in curves), tuple(v for _, v in curves))

    @property
    def live_rounds(self) -> int:
        """Rounds of decoding the live correction rests on (0: the profile as measured)."""
        if not self.live_verify:
            return 0
        first = self.live_verify[0][1]
        return sum(r for _, c, _, r in self.live_verify if c == first)

    def with_live(self, live) -> CostProfile:
        """This profile with the verify curve a `treespec.pricing.live_cost.LiveCost` ended with, at the profiled
        sizes and contexts, its round counts added to those already stored."""
        curve, support = live.snapshot(), live.support()
        before = {(n, c): r for n, c, _, r in self.live_verify}
        rows = tuple((n, c, float(curve.verify_cost(torch.tensor([float(n)]), c)[0]),
                      before.get((n, c), 0) + support.get(n, 0)) for n, c, _ in self.verify)
        return attrs.evolve(self, live_verify=rows)

    def with_live_draft(self, live, drafter: Drafter | str) -> CostProfile:
        """This profile with the draft + build seconds a `LiveCost` that priced ``drafter`` ended with."""
        if not live.draft_support:
            return self
        ident = drafter if isinstance(drafter, str) else drafter.identity()
        rounds = self.live_drafts.get(ident, (0.0, 0))[1] + live.draft_support
        return attrs.evolve(self, live_drafts={**self.live_drafts, ident: (live.snapshot().draft_cost, rounds)})

    def verify_in_steps(self, n: int, *, live: bool = True) -> float:
        """C_v(n) / C_v(1) at the shortest profiled context: a tree verify in AR steps."""
        model = self.cost_model(live=live)
        costs = model.verify_costs(n, model.contexts[0])
        return float(costs[n] / costs[1])

    def break_even_tau(self, drafter: Drafter | str, nodes: int, *, live: bool = True) -> float:
        """The mean τ a tree of ``nodes`` non-root nodes needs to match AR: (C_d + C_v(nodes + 1)) / C_v(1)."""
        model = self.cost_model(drafter, live=live)
        costs = model.verify_costs(nodes + 1, model.contexts[0])
        return float((model.draft_cost + costs[nodes + 1]) / costs[1])

    def to_record(self) -> dict:
        return {"format": _FORMAT, "verify": [list(s) for s in self.verify], "drafts": dict(self.drafts),
                "calibrations": {k: c.to_record() for k, c in self.calibrations.items()},
                "live_verify": [list(s) for s in self.live_verify],
                "live_drafts": {k: list(v) for k, v in self.live_drafts.items()}, "learned": dict(self.learned)}

    @classmethod
    def from_record(cls, record: Mapping) -> CostProfile:
        """The profile a record holds; a ValueError naming the rule its values break (`check_profile`)."""
        if record.get("format") != _FORMAT:
            raise ValueError(f"profile format {record.get('format')!r}, expected {_FORMAT}")
        verify = tuple((int(n), int(c), float(s)) for n, c, s in record["verify"])
        calibrations = {str(k): Calibration.from_record(v) for k, v in dict(record.get("calibrations", {})).items()}
        live = tuple((int(n), int(c), float(s), _rounds(r)) for n, c, s, r in record.get("live_verify", []))
        live_drafts = {str(k): (float(s), _rounds(r)) for k, (s, r) in dict(record.get("live_drafts", {})).items()}
        learned = {str(k): dict(v) for k, v in dict(record.get("learned", {})).items()}
        profile = cls(verify, {str(k): float(v) for k, v in dict(record["drafts"]).items()}, calibrations, live,
                      live_drafts, learned=learned)
        broken = check_profile(profile)
        if broken is not None:
            raise ValueError(broken)
        return profile


def _seconds_ok(values) -> bool:
    return all(math.isfinite(s) and s > 0 for s in values)


def _rounds(value) -> int | float:
    """A stored round count as read: an int when whole (`implausible_live` refuses the rest)."""
    number = float(value)
    return int(number) if number.is_integer() else number


def check_profile(profile: CostProfile) -> str | None:
    """The rule a profile's stored values break as data, or None: at least one verify sample, every
    tree size >= 1 and context >= 0, every time (verify, draft, live) finite and positive.  What the
    values say of the machine is `implausible_curve`'s, `implausible_drafts`' and `implausible_live`'s."""
    if not profile.verify:
        return "it holds no verify samples"
    if any(n < 1 or c < 0 for n, c, _ in profile.verify):
        return "a verify sample's tree size is below 1 or its context below 0"
    if not _seconds_ok(s for _, _, s in profile.verify):
        return "verify seconds must be finite and positive"
    if not _seconds_ok(profile.drafts.values()):
        return "draft seconds must be finite and positive"
    if not _seconds_ok([s for _, _, s, _ in profile.live_verify] + [s for s, _ in profile.live_drafts.values()]):
        return "live-corrected seconds must be finite and positive"
    return None


def implausible_curve(samples: Sequence[tuple[int, int, float]], what: str = "verify") -> str | None:
    """The rule a verify curve ((n, context, seconds) samples) breaks against what a machine can do,
    or None: per context, with m its smallest size, VERIFY_FLOOR C_v(m) <= C_v(n) <= VERIFY_CEILING
    (n / m) C_v(m) (a forward over more tokens is never far cheaper than one over fewer, and never
    dearer than a few of the smaller forwards per token)."""
    by_context: dict[int, dict[int, float]] = {}
    for n, c, s in samples:
        by_context.setdefault(c, {})[n] = s
    for c, curve in sorted(by_context.items()):
        m = min(curve)
        for n, s in sorted(curve.items()):
            steps = s / curve[m]
            if not VERIFY_FLOOR <= steps <= VERIFY_CEILING * n / m:
                return (f"its {what} of {n} tokens at context {c} costs {steps:.3g} {m}-token verifies (a machine "
                        f"can do {VERIFY_FLOOR:g} to {VERIFY_CEILING * n / m:g})")
    return None


def _one_token_seconds(samples: Sequence[tuple[int, int, float]]) -> float:
    """C_v of the smallest size at the shortest context: the unit the draft bounds are stated in."""
    c = min(c for _, c, _ in samples)
    return min(((n, s) for n, cc, s in samples if cc == c))[1]


def _short(ident: str) -> str:
    """A drafter identity as a line names it: its class and a digest of the rest."""
    kind, _, rest = ident.partition(":")
    return f"{kind} ({digest(rest)[:8]})" if rest else kind


def implausible_drafts(profile: CostProfile) -> dict[str, str]:
    """Drafter identity -> the rule its measured round breaks, for every drafter whose round lies
    outside `DRAFT_RANGE` times the profile's one-token verify."""
    one = _one_token_seconds(profile.verify)
    low, high = DRAFT_RANGE
    return {ident: (f"a round of drafter {_short(ident)} is {s / one:.3g} one-token verifies (a machine can do "
                    f"{low:g} to {high:g})")
            for ident, s in profile.drafts.items() if not low <= s / one <= high}


def implausible_live(profile: CostProfile) -> str | None:
    """The rule a profile's live correction breaks, or None.

    Its round counts are whole and >= 0, it lies near the profile measured quietly, and its curve is
    one a machine can have (`implausible_curve`).  A live curve corrects each size of the measured
    one by what decoding rounds cost, and a CPU's own dips (a 5-token verify cheaper than a 2-token
    one) are measured and stay; what a busy machine teaches is not that.  So, per context: each size's
    live time lies within `LIVE_BOUND` times the measured one either way, and its price in AR steps
    (C_v(n) / C_v(1)) within `LIVE_SHAPE_BOUND` times the measured price either way (a 17-token verify
    learned at a quarter of a one-token step, where the profile measured 1.6, is an artifact of a
    load on the one-token steps); each drafter's live draft + build time lies within
    [1/2, `LIVE_DRAFT_BOUND`] times its measured draft (the live figure adds the build)."""
    counts = [r for *_, r in profile.live_verify] + [r for _, r in profile.live_drafts.values()]
    if any(not isinstance(r, int) or r < 0 for r in counts):
        return "a round count of its live correction is not a whole number >= 0"
    measured = {(n, c): s for n, c, s in profile.verify}
    live = {(n, c): s for n, c, s, _ in profile.live_verify}
    for (n, c), s in sorted(live.items()):
        base = measured.get((n, c))
        if base is None:
            return f"its live curve has a size (n = {n}, context {c}) the profile did not measure"
        if not 1 / LIVE_BOUND <= s / base <= LIVE_BOUND:
            return (f"its live {n}-token verify at context {c} is {s / base:.2f}x the measured one "
                    f"(bound: {LIVE_BOUND:g}x either way)")
        one, one_base = live.get((1, c)), measured.get((1, c))
        if n > 1 and one and one_base:
            shape = (s / one) / (base / one_base)
            if not 1 / LIVE_SHAPE_BOUND <= shape <= LIVE_SHAPE_BOUND:
                return (f"its live {n}-token verify at context {c} costs {s / one:.2f} AR steps where the profile "
                        f"measured {base / one_base:.2f} (bound: {LIVE_SHAPE_BOUND:g}x either way)")
    for ident, (seconds, _) in profile.live_drafts.items():
        base = profile.drafts.get(ident)
        if base is not None and not 0.5 <= seconds / base <= LIVE_DRAFT_BOUND:
            return (f"its live draft + build is {seconds / base:.2f}x the measured draft "
                    f"(bound: 1/2 to {LIVE_DRAFT_BOUND:g}x)")
    if profile.live_verify:
        return implausible_curve([(n, c, s) for n, c, s, _ in profile.live_verify], "live verify")
    return None


def implausible(profile: CostProfile) -> str | None:
    """The first rule anywhere in ``profile`` breaks (data, measured curve, drafts, live correction): what
    is never written to the cache."""
    broken = check_profile(profile) or implausible_curve(profile.verify)
    return broken or next(iter(implausible_drafts(profile).values()), None) or implausible_live(profile)


def spot_check(target: Target, profile: CostProfile, generator: torch.Generator,
               repeats: int = _SPOT_REPEATS) -> str | None:
    """A quick look at a cached profile against the machine as it is: the smallest size and the 17-token
    verify (or the largest profiled size below it) timed at the shortest profiled context, as the
    profile was; the disagreement beyond `SPOT_BOUND` either way, or None."""
    c = min(c for _, c, _ in profile.verify)
    stored = {n: s for n, cc, s in profile.verify if cc == c}
    sizes = sorted({min(stored), max((n for n in stored if n <= _SPOT_SIZE), default=min(stored))})
    now = time_verify_sizes(target, sizes, c, repeats, generator)
    target.reset()
    for n in sizes:
        if not 1 / SPOT_BOUND <= now[n] / stored[n] <= SPOT_BOUND:
            return (f"a {n}-token verify at context {c} takes {now[n]:.3g} s now where it holds {stored[n]:.3g} s "
                    f"(bound: {SPOT_BOUND:g}x either way)")
    return None


def calibration_key(drafter: Drafter) -> str:
    """What a drafter's calibration is stored under: its `Drafter.identity` and its weights (a drafter
    trained further promises differently, and starts uncalibrated)."""
    return f"{drafter.identity()}@{drafter.weights_digest()}"


def learned_key(policy: str, drafter: Drafter) -> str:
    """What a policy's learned state over a drafter is kept under: the policy and the drafter's
    `calibration_key` (its identity and weights)."""
    return f"{policy}@{calibration_key(drafter)}"


def refresh_profile(target: Target, drafters: Sequence[Drafter] = (), *, sizes: Sequence[int] = PROFILE_SIZES,
                    contexts: Sequence[int] = PROFILE_CONTEXTS, repeats: int = 9, cache_dir: Path | None = None,
                    progress: bool = False) -> CostProfile:
    """Measure this machine's profile anew and replace the cached one with it: the timings and the live
    correction made over them go; the drafters' calibrations (keyed by their weights) stay."""
    fresh = machine_profile(target, drafters, sizes=sizes, contexts=contexts, repeats=repeats, cache=False,
                            cache_dir=cache_dir, progress=progress)
    if fresh.disturbed:
        return fresh  # used, never cached (machine_profile said so)
    path, key, _ = _profile_file(target, sizes, contexts, cache_dir)
    previous = _cached_profile(path, key)
    if previous is not None:
        fresh = attrs.evolve(fresh, calibrations=previous.calibrations, learned=previous.learned)
    _write_profile(path, key, fresh)
    return fresh


def save_profile(target: Target, profile: CostProfile, *, sizes: Sequence[int] = PROFILE_SIZES,
                 contexts: Sequence[int] = PROFILE_CONTEXTS, cache_dir: Path | None = None) -> None:
    """Write ``profile`` (a calibration added, say) where `machine_profile` finds it; a profile measured
    under a load or with implausible figures (``disturbed``) is not written (one line says so), and an
    implausible one not so marked is a ValueError naming the rule (`implausible`): nothing implausible
    is cached."""
    path, key, _ = _profile_file(target, sizes, contexts, cache_dir)
    if profile.disturbed:
        logger.warning(f"not saving the cost profile {path}: it was measured while {profile.disturbed}")
        return
    _write_profile(path, key, profile)


def _profile_file(target: Target, sizes: Sequence[int], contexts: Sequence[int],
                  cache_dir: Path | None) -> tuple[Path, dict, list[int]]:
    """(cache file, key, contexts as measured): contexts are cut so the largest tree still fits."""
    room = target.max_positions - max(sizes)  # the longest context a sample's tree still fits after
    if room < 1:
        raise ValueError(f"a {max(sizes)}-token tree does not fit the target's {target.max_positions} positions")
    contexts = sorted({min(c, room - 1) for c in contexts})
    key = {"machine": machine_identity(target.device), "target": target_identity(target),
           "dtype": str(target.dtype).removeprefix("torch."), "device": str(target.device),
           "sizes": list(sizes), "contexts": list(contexts), "timing": "interleaved"}
    return machine_file("profile", key, cache_dir), key, contexts


_CHECKED: set[tuple[str, int]] = set()  # (profile file, its mtime) spot-checked or written by this process


def _stamp(path: Path) -> tuple[str, int]:
    try:
        return str(path), path.stat().st_mtime_ns
    except OSError:
        return str(path), -1


def _write_profile(path: Path, key: dict, profile: CostProfile, *, checked: bool = True) -> None:
    broken = implausible(profile)
    if broken is not None:
        raise ValueError(f"refusing to cache the cost profile {path}: {broken}")
    write_cached(path, key, profile.to_record())
    if checked:  # its timings were measured or spot-checked by this process (a healed file's were not)
        _CHECKED.add(_stamp(path))


def _timings_dropped(profile: CostProfile) -> CostProfile:
    """``profile`` with every timing gone (measured again by `machine_profile`): what it learned stays."""
    return attrs.evolve(profile, verify=(), drafts={}, live_verify=(), live_drafts={})


def _cached_profile(path: Path, key: dict) -> CostProfile | None:
    """The cached profile, healed: None when its data fails `check_profile` (set aside, naming the file
    and the rule); its timings dropped (an empty ``verify``: measure again) when its measured curve is
    implausible (`implausible_curve`); an implausible drafter's round dropped (measured again); a live
    correction that breaks `implausible_live` dropped (the file rewritten without it).  One line each."""
    record = read_cached(path, key)
    if record is None:
        return None
    try:
        profile = CostProfile.from_record(record)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        set_aside(path, str(exc) or type(exc).__name__)
        return None
    broken = implausible_curve(profile.verify)
    if broken is not None:
        logger.warning(f"measuring the cached cost profile {path} again: {broken}")
        return _timings_dropped(profile)
    for ident, rule in implausible_drafts(profile).items():
        logger.warning(f"measuring a drafter's round in the cached cost profile {path} again: {rule}")
        profile = attrs.evolve(profile, drafts={k: v for k, v in profile.drafts.items() if k != ident},
                               live_drafts={k: v for k, v in profile.live_drafts.items() if k != ident})
    broken = implausible_live(profile)
    if broken is not None:
        logger.warning(f"dropping the live correction of the cached cost profile {path}: {broken}; pricing "
                       "with the profile as measured")
        profile = attrs.evolve(profile, live_verify=(), live_drafts={})
        _write_profile(path, key, profile, checked=False)  # the timings left are still to be spot-checked
    return profile


def _spot_checked(target: Target, profile: CostProfile, path: Path, generator: torch.Generator,
                  meter: Callable[[], object] | None) -> CostProfile:
    """``profile`` if a quick measurement now agrees with it (`spot_check`; once per file and version in
    a process, and not judged while another process takes the cores), else its timings dropped, said."""
    if not profile.verify or _stamp(path) in _CHECKED:
        return profile
    load_meter = (meter or current_meter)()
    load_meter.start()
    disagreement = spot_check(target, profile, generator)
    if load_meter.stop().disturbed:
        return profile  # a busy machine says nothing about the cached figures
    _CHECKED.add(_stamp(path))
    if disagreement is None:
        return profile
    logger.warning(f"measuring the cached cost profile {path} again: {disagreement}")
    return _timings_dropped(profile)


def machine_profile(target: Target, drafters: Sequence[Drafter] = (), *, sizes: Sequence[int] = PROFILE_SIZES,
                    contexts: Sequence[int] = PROFILE_CONTEXTS, repeats: int = 9, cache: bool = True,
                    cache_dir: Path | None = None, progress: bool = False,
                    meter: Callable[[], object] | None = None, spot: bool = True) -> CostProfile:
    """This machine's `CostProfile` of ``target`` and ``drafters`` (cached; see the module docstring).
    A cached profile is healed on reading (`_cached_profile`) and, with ``spot``, checked once per
    process against a quick measurement (`spot_check`), its timings measured again where either
    finds them wrong (its calibrations and learned states kept).  A profile measured while another
    process took the cores it ran on (``meter``: a `treespec.pricing.conditions.LoadMeter` factory, by
    default over torch's threads), or one whose figures no machine has (`implausible`), is used but
    not cached, and says so (``disturbed``)."""
    if any(n < 1 for n in sizes) or not sizes or not contexts or repeats < 1:
        raise ValueError("a profile needs sizes >= 1, at least one context and repeats >= 1")
    path, key, contexts = _profile_file(target, sizes, contexts, cache_dir)
    generator = torch.Generator().manual_seed(0)
    profile = _cached_profile(path, key) if cache else None
    if profile is not None and spot:
        profile = _spot_checked(target, profile, path, generator, meter)
    measure_verify = profile is None or not profile.verify
    missing = [d for d in drafters if profile is None or d.identity() not in profile.drafts]
    if not measure_verify and not missing:
        return profile
    bar = _bar((len(contexts) if measure_verify else 0) + len(missing), progress)
    load_meter = (meter or current_meter)()
    load_meter.start()
    if measure_verify:
        verify = _measured_curve(target, sizes, contexts, repeats, generator, bar)
        profile = attrs.evolve(profile, verify=verify) if profile is not None else CostProfile(verify)
    drafts = dict(profile.drafts)
    for drafter in missing:
        drafts[drafter.identity()] = time_draft(target, drafter, min(contexts), repeats, generator)
        bar.update(1)
    bar.close()
    target.reset()
    load = load_meter.stop()
    profile = attrs.evolve(profile, drafts=drafts, disturbed=load.describe() if load.disturbed else "")
    broken = implausible(profile)
    if load.disturbed:
        logger.warning(f"the cost profile was measured while {load.describe()}: used for this run, not "
                       "cached")
    elif broken is not None:
        logger.warning(f"the cost profile measured now is implausible ({broken}): used for this run, not cached")
        profile = attrs.evolve(profile, disturbed=f"the machine gave implausible figures ({broken})")
    elif cache:
        _write_profile(path, key, profile)
    return profile



def _measured_curve(target: Target, sizes: Sequence[int], contexts: Sequence[int], repeats: int,
                    generator: torch.Generator, bar) -> tuple[tuple[int, int, float], ...]:
    """The verify samples of every context; a curve no machine has (a forward descheduled among few
    repeats) is measured once more before it is taken as it is."""
    for attempt in range(2):
        verify = []
        for c in contexts:
            seconds = time_verify_sizes(target, sizes, c, repeats, generator)
            verify += [(n, c, seconds[n]) for n in sizes]
            if attempt == 0:
                bar.update(1)
        if implausible_curve(verify) is None:
            break
    return tuple(verify)


def _bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc="cost profile of this machine", unit="point", leave=False)
