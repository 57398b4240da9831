"""Comparing replayed methods: per-prompt tau, paired bootstrap intervals against a baseline, sweeps.

Contract
--------
* `expand_sweep(methods, budgets, settings)`: every method at every budget of ``budgets`` (a chain
  or a method whose budget is given keeps its own), crossed with every combination of the option
  values in ``settings`` (``{"topk": ["2", "4"]}``) that its policy has as fields; an option no
  named policy has is refused, naming the policies.
* `compare(results, baseline=...)`: one `ComparisonRow` per replayed method.  tau is pooled (tokens
  committed / rounds, over the chosen prompts), with a 95 % percentile bootstrap interval that
  resamples prompts with replacement; ``diff`` = tau(method) - tau(baseline) on the same resample
  of prompts (paired), with its interval; > 0 means the method accepts more per round than the
  baseline.  A baseline named without a budget (``ddtree``) is taken at each method's own budget.
* `compare_traces(results, others, ...)`: the same rows, each method paired with itself replayed from
  another trace of the same prompts and target answers (``diff`` = tau here - tau there), the
  comparison of two drafters, or two versions of one.
* `markdown_table`, `per_prompt_rows` and `plot_sweep` are pure functions of the rows / results,
  deterministic for given inputs (the bootstrap draws from its own seeded generator).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import numpy as np

from treespec.apps.assembly.methods import MethodSpec, parse_method, policy_class, with_budget, with_options
from treespec.apps.bench.summary import bootstrap_interval
from treespec.apps.replay.evaluate import ReplayResult

__all__ = ["ComparisonRow", "baselines", "compare", "compare_traces", "expand_sweep", "markdown_table", "per_prompt_rows",
           "plot_sweep", "pooled_tau"]


@attrs.frozen
class ComparisonRow:
    """One replayed method, against the baseline at its budget."""

    method: str  # method string as replayed
    policy: str  # registry policy name ("ar" for autoregressive)
    budget: int  # tree budget (0: a chain or AR, which take none)
    options: str  # the method's policy options, "k=v;k=v" ("" when none)
    prompts: int  # prompts replayed
    rounds: int  # rounds over all prompts
    tau: float  # pooled tau: tokens committed / rounds
    tau_lo: float  # 95 % bootstrap interval of tau (prompts resampled)
    tau_hi: float
    baseline: str  # method compared against ("" when none)
    diff: float  # tau(method) - tau(baseline), same prompts (nan without a baseline)
    diff_lo: float  # 95 % paired bootstrap interval of diff
    diff_hi: float
    ms_per_round: float  # replay milliseconds per round (draft rebuild + tree build; this machine)
    family: str = ""  # the method without its budget (`MethodSpec.family`): one curve of a sweep
    baseline_family: str = ""  # the baseline without its budget ("" when none)


def _option_grid(policy: str, settings: Mapping[str, Sequence[str]]) -> list[dict[str, str]]:
    """Every combination of the ``settings`` the policy has as fields ([{}] when it has none of them)."""
    cls = policy_class(policy)
    own = [k for k in settings if attrs.has(cls) and k in attrs.fields_dict(cls)]
    return [dict(zip(own, values)) for values in itertools.product(*(settings[k] for k in own))]


def expand_sweep(methods: Sequence[str], budgets: Sequence[int] = (),
                 settings: Mapping[str, Sequence[str]] | None = None) -> list[MethodSpec]:
    """The methods of a sweep (module docstring), each parsed and validated once."""
    settings = dict(settings or {})
    parsed = [parse_method(m) for m in methods]
    policies = sorted({m.policy for m in parsed if m.policy not in (None, "chain")})
    for key in settings:
        if not any(key in _option_grid(p, {key: ["x"]})[0] for p in policies):
            raise ValueError(f"--set {key}: none of the swept policies ({', '.join(policies) or 'none'}) "
                             f"has an option {key!r}")
    out: list[MethodSpec] = []
    for method in parsed:
        if method.autoregressive or method.policy == "chain":
            out.append(method)
            continue
        for grid in _option_grid(method.policy, settings):
            variant = with_options(method, grid)
            chosen = [variant] if method.budget is not None or not budgets else [with_budget(variant, b) for b in budgets]
            out += chosen
    names = [m.name for m in out]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"the sweep names {', '.join(repeated)} more than once")
    return out


def pooled_tau(taus: Sequence[Sequence[int]], idx) -> float:
    """Tokens committed / rounds over the prompts ``idx`` (repeats count again: a bootstrap resample)."""
    rounds = sum(len(taus[i]) for i in idx)
    return sum(sum(taus[i]) for i in idx) / rounds if rounds else float("nan")


def _per_budget(baseline: MethodSpec) -> bool:
    """Whether ``baseline`` is taken at each compared method's budget: a tree policy named without one."""
    return baseline.budget is None and baseline.policy != "chain" and not baseline.autoregressive


def baselines(baseline: str, methods: Sequence[MethodSpec]) -> list[MethodSpec]:
    """The baseline methods a comparison of ``methods`` against ``baseline`` needs replayed."""
    base = parse_method(baseline)
    if not _per_budget(base):
        return [base]
    return [with_budget(base, b) for b in sorted({m.budget for m in methods if m.budget is not None})]


def _baseline_for(method: MethodSpec, baseline: MethodSpec | None, by_name: Mapping[str, ReplayResult]) -> str | None:
    if baseline is None:
        return None
    if _per_budget(baseline):
        if method.budget is None:
            return None  # a chain has no budget to compare at
        name = with_budget(baseline, method.budget).name
    else:
        name = baseline.name
    if name not in by_name:
        raise ValueError(f"baseline {name} was not replayed; add it to the methods")
    return name


def _options_text(method: MethodSpec) -> str:
    return ";".join(f"{k}={v}" for k, v in sorted(method.options.items()))


def compare(results: Sequence[ReplayResult], methods: Sequence[MethodSpec], *, baseline: str | None = None,
            resamples: int = 2000, seed: int = 0) -> list[ComparisonRow]:
    """One row per result (``methods[i]`` replayed as ``results[i]``), diff against ``baseline``."""
    by_name = {r.method: r for r in results}
    base = parse_method(baseline) if baseline else None
    rows = []
    for method, result in zip(methods, results):
        against = _baseline_for(method, base, by_name)
        theirs = (by_name[against], against, base.family) if against is not None else None
        rows.append(_row(method, result, theirs, resamples, seed))
    return rows


def compare_traces(results: Sequence[ReplayResult], others: Sequence[ReplayResult], methods: Sequence[MethodSpec],
                   label: str, *, resamples: int = 2000, seed: int = 0) -> list[ComparisonRow]:
    """Each method against itself replayed from another trace of the same prompts and target answers.

    ``others[i]`` is ``methods[i]`` replayed from the trace called ``label``: the rows' ``diff`` is
    tau(this trace) - tau(that one), paired prompt by prompt, e.g. a retrained drafter against the
    one it replaces.
    """
    return [_row(method, result, (other, f"{method.name} @ {label}", f"{method.family} @ {label}"), resamples, seed)
            for method, result, other in zip(methods, results, others, strict=True)]


def _row(method: MethodSpec, result: ReplayResult, theirs: tuple[ReplayResult, str, str] | None,
         resamples: int, seed: int) -> ComparisonRow:
    """Pooled tau of one method with its interval, and the paired diff against ``theirs`` (result, name, family)."""
    n = len(result.taus)
    mine = result.taus
    lo, hi = bootstrap_interval(lambda idx: pooled_tau(mine, idx), n, resamples, seed)
    diff = diff_lo = diff_hi = float("nan")
    name = family = ""
    if theirs is not None:
        other, name, family = theirs
        if len(other.taus) != n:
            raise ValueError(f"{method.name} and {name} were replayed on different prompts")
        delta = lambda idx: pooled_tau(mine, idx) - pooled_tau(other.taus, idx)  # noqa: E731
        diff, (diff_lo, diff_hi) = delta(range(n)), bootstrap_interval(delta, n, resamples, seed)
    return ComparisonRow(
        method.name, method.policy if method.policy else "ar", method.budget or 0, _options_text(method), n,
        result.rounds, result.mean_tau, lo, hi, name, diff, diff_lo, diff_hi,
        1e3 * result.seconds / max(1, result.rounds), method.family, family)


def markdown_table(rows: Sequence[ComparisonRow]) -> str:
    """Pooled tau [95 % CI], and tau - baseline [95 % paired CI] when a baseline was named."""
    with_base = any(r.baseline for r in rows)
    head = "| method | prompts | rounds | tau [95% CI] |" + (" tau − baseline [95% paired CI] | baseline |" if with_base else "")
    lines = [head + " ms/round |", "|---|---:|---:|---|" + ("---|---|" if with_base else "") + "---:|"]
    for r in rows:
        cells = f"| {r.method} | {r.prompts} | {r.rounds} | {r.tau:.3f} [{r.tau_lo:.3f}, {r.tau_hi:.3f}] |"
        if with_base:
            cells += (f" {r.diff:+.3f} [{r.diff_lo:+.3f}, {r.diff_hi:+.3f}] | {r.baseline} |" if r.baseline
                      else " | |")
        lines.append(cells + f" {r.ms_per_round:.2f} |")
    return "\n".join(lines) + "\n"


def per_prompt_rows(results: Sequence[ReplayResult], prompt_ids: Sequence[str]) -> list[dict]:
    """One row per (method, prompt): the prompt's rounds, tokens and tau (tokens / rounds)."""
    return [{"method": r.method, "prompt_id": prompt_ids[i], "rounds": len(t), "tokens": sum(t),
             "tau": round(sum(t) / len(t), 6) if t else float("nan")}
            for r in results for i, t in enumerate(r.taus)]


def plot_sweep(rows: Sequence[ComparisonRow], path: str | Path) -> Path:
    """tau against budget with 95 % intervals, one line per policy and options (chains dashed,
    level), and, with a baseline, tau - baseline with its paired intervals around a zero line."""
    import matplotlib.pyplot as plt

    from treespec.apps.bench.plots import budget_axis, interval_axes, save_figure

    with_base = any(r.baseline for r in rows)
    fig, axes = plt.subplots(1, 2 if with_base else 1, figsize=(10 if with_base else 5.5, 3.8), squeeze=False)
    ax_tau, ax_diff = axes[0, 0], axes[0, 1] if with_base else None
    curves = sorted({r.family for r in rows if r.budget})
    budgets = sorted({r.budget for r in rows if r.budget}) or [1]
    for key in curves:
        mine = sorted((r for r in rows if r.budget and r.family == key), key=lambda r: r.budget)
        x = [r.budget for r in mine]
        ax_tau.errorbar(x, [r.tau for r in mine], yerr=_yerr(mine, "tau"), marker="o", capsize=3, label=key)
        if ax_diff is not None and all(r.baseline for r in mine):
            ax_diff.errorbar(x, [r.diff for r in mine], yerr=_yerr(mine, "diff"), marker="o", capsize=3, label=key)
    for r in (r for r in rows if not r.budget):
        ax_tau.hlines(r.tau, budgets[0], budgets[-1], linestyles="dashed", colors="#78909c")
        ax_tau.annotate(r.method, (budgets[0], r.tau), fontsize=7, va="bottom")
    interval_axes(ax_tau, "mean τ (replayed, T = 0)", [v for r in rows for v in (r.tau_lo, r.tau_hi)])
    if ax_diff is not None:
        ax_diff.axhline(0.0, color="black", linewidth=0.8)
        base = sorted({r.baseline_family for r in rows if r.baseline})
        interval_axes(ax_diff, f"τ − {', '.join(base)} (same B) [paired 95% CI]",
                      [v for r in rows if r.baseline for v in (r.diff_lo, r.diff_hi)] + [0.0])
    for ax in axes[0]:
        budget_axis(ax, budgets)
    if curves:
        ax_tau.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, Path(path))


def _yerr(rows: Sequence[ComparisonRow], stat: str) -> np.ndarray:
    """[2, n] distances from each point to its interval's ends, as errorbar wants them."""
    mid = np.array([getattr(r, stat) for r in rows])
    return np.array([mid - [getattr(r, f"{stat}_lo") for r in rows], [getattr(r, f"{stat}_hi") for r in rows] - mid])
