"""``treespec replay``: record drafter traces along the target's greedy trajectory, then replay policies.

``treespec replay record --out FILE [--model DIR] [--dflash DIR] [--domino DIR] [--dataset NAME ...]``
runs the target once per prompt (the embedded SmolLM2 and its shipped drafters by default) and
writes one safetensors trace.  ``treespec replay eval FILE --methods ddtree@16 dominotree@16 ...``
replays each method's T = 0 acceptance lengths from the trace alone, in seconds.
``--budgets 4,8,16 --set topk=2,4`` sweeps budgets and policy options,
``--baseline ddtree`` adds paired bootstrap intervals against DDTree at each budget, ``--against
OTHER`` against the same methods replayed from another trace of the same prompts and target answers
(another drafter, or another version of one), and ``--out DIR`` writes the table (Markdown, CSV),
per-prompt tau and a budget-curve plot with intervals.
``treespec replay info FILE`` prints the trace's metadata.  See treespec/apps/replay/.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path

import attrs
import torch

from treespec.apps.commands import (
    DTYPES,
    add_engine_argument,
    add_exact_argument,
    add_threads_argument,
    check_model_digest,
    exit_status,
    start_threads,
)
from treespec.tree import check_budget

_KINDS = ("dflash", "domino")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    _record_arguments(sub.add_parser("record", help="record a trace (runs the target and the drafters)"))
    _eval_arguments(sub.add_parser("eval", help="replay methods from a trace (no target)"))
    info = sub.add_parser("info", help="print a trace's metadata")
    info.add_argument("trace", type=Path, help="trace file written by `treespec replay record`")


def _record_arguments(parser: argparse.ArgumentParser) -> None:
    from treespec.apps.replay import RECORD_PRESETS

    parser.add_argument("--out", type=Path, required=True, help="trace file to write (.safetensors)")
    parser.add_argument("--model", default=None, help="local target model directory (default: the embedded SmolLM2)")
    for kind in _KINDS:
        parser.add_argument(f"--{kind}", type=Path, default=None,
                            help=f"{kind} checkpoint directory (default with the embedded target: its shipped drafter)")
    parser.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR",
                        help="also record any registered drafter from its checkpoint (repeatable)")
    parser.add_argument("--dataset", action="append", default=None,
                        help="benchmark name or local prompt file (repeatable; default: gsm8k)")
    parser.add_argument("--prompt-ids", type=Path, default=None,
                        help="JSON file with a list of token-id lists, instead of --dataset (no tokenizer needed)")
    parser.add_argument("--limit", type=int, default=20, help="prompts per dataset")
    parser.add_argument("--seed", type=int, default=0, help="prompt shuffling seed")
    parser.add_argument("--preset", default="default", choices=sorted(RECORD_PRESETS), help="what the trace keeps")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="greedy tokens per prompt (overrides preset)")
    parser.add_argument("--max-budget", type=int, default=None, help="largest marginal tree budget to replay")
    parser.add_argument("--min-k", type=int, default=None, help="marginal tokens kept per depth at least")
    parser.add_argument("--top-m", type=int, default=None, help="Domino candidates kept per depth (largest top_m)")
    parser.add_argument("--dtype", default="auto", choices=sorted(DTYPES),
                        help="target dtype (auto: the faster of bf16 and fp32 on this CPU, measured once)")
    add_threads_argument(parser)
    add_engine_argument(parser)
    add_exact_argument(parser, True)  # the trace is AR's trajectory: replayed tau is live tau when trees equal AR
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out (and the parts of an interrupted run with other settings)")


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", type=Path, help="trace file written by `treespec replay record`")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="methods such as dflash domino ddtree@16 dominotree@16 eagle2+topk=4 (default: the demo "
                             "methods the trace's drafters support); commas also separate")
    parser.add_argument("--budgets", default=None,
                        help="sweep: every method without its own @B at each of these budgets, e.g. 4,8,16,32,64")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=V1,V2",
                        help="sweep: each value of a policy option, crossed with the budgets, for every method whose "
                             "policy has the option (repeatable: several keys make a grid)")
    parser.add_argument("--baseline", default=None,
                        help="paired 95%% bootstrap intervals of tau - tau(baseline) over prompts; a baseline without "
                             "@B (ddtree) is taken at each method's own budget (and replayed if not listed)")
    parser.add_argument("--against", type=Path, default=None, metavar="TRACE",
                        help="paired 95%% bootstrap intervals of tau - tau(the same method replayed from TRACE), a "
                             "trace of the same prompts and target answers recorded with other drafters")
    parser.add_argument("--out", type=Path, default=None,
                        help="write table.md, table.csv, per_prompt.csv and budget_curves.svg/png to this new folder")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the files of an existing --out folder and an existing --json file")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples of the intervals")
    parser.add_argument("--stop-token-id", type=int, action="append", default=None,
                        help="end a response at this token, as the live loop would (repeatable; default: none)")
    parser.add_argument("--json", type=Path, default=None, help="write per-round taus as JSON lines to this file")
    parser.add_argument("--cost-model", type=Path, default=None,
                        help="cost model JSON for cost-aware methods (default: the one measured when the trace was "
                             "recorded)")


def run(args: argparse.Namespace) -> int:
    from treespec.apps.replay import TraceError

    try:
        return {"record": _record, "eval": _eval, "info": _info}[args.action](args)
    except (TraceError, OSError, ValueError) as exc:
        print(f"treespec replay {args.action}: {exc}", file=sys.stderr)
        return exit_status(exc)


# ---------------------------------------------------------------------------- record
def _record(args: argparse.Namespace) -> int:
    from treespec.apps.replay import RECORD_PRESETS, record_trace

    threads = start_threads(args)
    overrides = {k: v for k, v in (("max_new_tokens", args.max_new_tokens), ("max_budget", args.max_budget),
                                   ("min_k", args.min_k), ("top_m", args.top_m)) if v is not None}
    config = attrs.evolve(RECORD_PRESETS[args.preset], **overrides)
    if args.out.exists() and not args.overwrite:
        raise ValueError(f"{args.out} exists; pass --overwrite to replace it")
    parts = args.out.with_name(args.out.name + ".parts")  # one file per recorded prompt: a rerun resumes
    if args.overwrite and parts.exists():
        shutil.rmtree(parts)
    if args.prompt_ids is not None:
        prompt_ids(args.prompt_ids)  # refused before the models load
    check_model_digest(args)
    from treespec.apps.assembly.session import Session

    session = Session.load(args.model, _drafter_dirs(args), dtype=DTYPES[args.dtype], tokenizer_required=False,
                           threads=threads, progress=True, engine=args.engine, exact=args.exact)
    prompts, ids = _prompts(args, session.tokenizer)
    start = time.perf_counter()
    try:
        trace = record_trace(session, prompts, config=config, prompt_ids=ids, progress=True, parts_dir=parts)
    except KeyboardInterrupt:
        done = len(list(parts.glob("part-*.safetensors"))) if parts.exists() else 0
        print(f"\ntreespec replay record: interrupted; {done} of {len(prompts)} prompts are kept in {parts}; "
              "rerun the same command to resume", file=sys.stderr)
        return 130
    path = trace.save(args.out.with_name(args.out.name + ".tmp"))
    path = path.replace(args.out)
    shutil.rmtree(parts, ignore_errors=True)
    print(f"recorded {len(prompts)} prompts x {config.max_new_tokens} tokens with {', '.join(session.drafters)} in "
          f"{time.perf_counter() - start:.1f} s -> {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


def prompt_ids(path: Path) -> list[list[int]]:
    """The prompts of a --prompt-ids file: a JSON list of non-empty lists of token ids (integers, not
    booleans, >= 0); anything else is refused naming the file and the first bad entry."""
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--prompt-ids {path}: not JSON ({exc})") from None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"--prompt-ids {path} must hold a non-empty JSON list of token-id lists")
    for i, row in enumerate(rows):
        if not isinstance(row, list) or not row:
            raise ValueError(f"--prompt-ids {path}: prompt {i} must be a non-empty list of token ids, got {row!r}")
        bad = next((t for t in row if isinstance(t, bool) or not isinstance(t, int) or t < 0), None)
        if bad is not None or any(isinstance(t, bool) for t in row):
            raise ValueError(f"--prompt-ids {path}: prompt {i} holds {bad!r}; token ids are whole numbers >= 0")
    return rows


def _drafter_dirs(args: argparse.Namespace) -> dict[str, Path]:
    """The drafters to record: --dflash / --domino (by default, with the embedded target, its shipped
    ones) and any --drafter NAME=DIR."""
    from treespec.apps.assembly.loading import drafter_dirs, embedded_drafter_dir

    dirs = {kind: getattr(args, kind) for kind in _KINDS}
    if args.model is None:
        dirs = {k: d or (embedded_drafter_dir(k) if embedded_drafter_dir(k).is_dir() else None) for k, d in dirs.items()}
    dirs = {k: d for k, d in dirs.items() if d is not None}
    dirs |= drafter_dirs([item.partition("=")[0] for item in args.drafter], args.drafter, embedded=False)
    if not dirs:
        raise ValueError("no drafter to record: pass --dflash DIR and/or --domino DIR "
                         "(the embedded target's drafters are not installed)")
    return dirs


def _prompts(args: argparse.Namespace, tokenizer) -> tuple[list[torch.Tensor], list[str]]:
    if args.prompt_ids is not None:
        rows = prompt_ids(args.prompt_ids)
        return [torch.tensor(r, dtype=torch.int64) for r in rows], [str(i) for i in range(len(rows))]
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer: give prompts as token ids with --prompt-ids")
    from treespec.apps.data.datasets import encode_chat, load_prompts

    prompts, ids = [], []
    for source in args.dataset or ["gsm8k"]:
        for record in load_prompts(source, seed=args.seed, limit=args.limit):
            prompts.append(torch.tensor(encode_chat(tokenizer, record.turns[:1]), dtype=torch.int64))
            ids.append(f"{record.dataset}/{record.id}")  # MT-Bench: the first turn only
    return prompts, ids


# ---------------------------------------------------------------------------- eval and info
def _methods(args: argparse.Namespace, trace) -> list[str]:
    from treespec.apps.assembly.methods import DEMO_METHODS, parse_method

    if args.methods:
        return [m for item in args.methods for m in item.split(",") if m]
    return [m for m in DEMO_METHODS if parse_method(m).drafter in (None, *trace.drafters)]


def _settings(items: list[str]) -> dict[str, list[str]]:
    """``--set KEY=V1,V2`` flags -> {KEY: [V1, V2]} (values stay text: each policy types its own)."""
    out: dict[str, list[str]] = {}
    for item in items:
        key, eq, values = item.partition("=")
        if not eq or not key or not all(values.split(",")):
            raise ValueError(f"--set takes KEY=V1[,V2...], got {item!r}")
        if key in out:
            raise ValueError(f"--set {key} given twice; list its values in one flag")
        out[key] = values.split(",")
    return out


def _budgets(text: str | None) -> list[int]:
    if text is None:
        return []
    return [check_budget(int(b) if b.strip().isdigit() else b, f"--budgets {text}") for b in text.split(",")]


def _sweep(args: argparse.Namespace, trace) -> list:
    """The methods to replay: the sweep of --methods x --budgets x --set, plus the baseline(s) it needs."""
    from treespec.apps.replay import expand_sweep
    from treespec.apps.replay.compare import baselines

    methods = expand_sweep(_methods(args, trace), _budgets(args.budgets), _settings(args.settings))
    if args.baseline is not None:
        named = {m.name for m in methods}
        methods = [m for m in baselines(args.baseline, methods) if m.name not in named] + methods
    return methods


def _eval(args: argparse.Namespace) -> int:
    from treespec.apps.replay import Trace, compare, compare_traces, evaluate
    from treespec.apps.replay.compare import markdown_table
    from treespec.pricing.cost import load_cost_model

    if args.against is not None and args.baseline is not None:
        raise ValueError("--against and --baseline are two kinds of comparison; name one")
    cost = load_cost_model(args.cost_model) if args.cost_model is not None else None
    trace = Trace.load(args.trace)
    other = _paired_trace(args.against, trace)
    methods = _sweep(args, trace)
    if args.out is not None:
        _check_out(args.out, args.overwrite)  # before the replay: a refusal costs nothing
    if args.json is not None and args.json.exists() and not args.overwrite:
        raise ValueError(f"--json {args.json} exists; pass --overwrite to replace it")
    replay = functools.partial(evaluate, methods=methods,
                               stop_token_ids=args.stop_token_id or (), cost_model=cost)
    results = replay(trace)
    if other is None:
        rows = compare(results, methods, baseline=args.baseline, resamples=args.resamples)
    else:
        rows = compare_traces(results, replay(other), methods, args.against.stem, resamples=args.resamples)
    print(markdown_table(rows), end="")
    ids = [p["id"] for p in trace.meta["prompts"]]
    if args.json is not None:
        lines = [json.dumps({"method": r.method, "prompt_id": ids[i], "taus": list(t)})
                 for r in results for i, t in enumerate(r.taus)]
        args.json.write_text("".join(line + "\n" for line in lines))
    if args.out is not None:
        _write_out(args.out, rows, results, ids)
        print(f"wrote {args.out}/table.md, table.csv, per_prompt.csv, budget_curves.svg and .png")
    return 0


def _paired_trace(path: Path | None, trace):
    """The trace named by --against, checked to hold the same prompts and target answers (None: none named)."""
    from treespec.apps.replay import Trace, check_paired

    if path is None:
        return None
    other = Trace.load(path)
    check_paired(trace, other, f"--against {path}")
    return other


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ValueError(f"{out} exists and is not an empty folder; pass --overwrite to replace its files")


def _write_out(out: Path, rows, results, ids) -> None:
    import csv

    from treespec.apps.bench.summary import write_csv
    from treespec.apps.replay.compare import markdown_table, per_prompt_rows, plot_sweep

    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(markdown_table(rows))
    write_csv(rows, out / "table.csv")
    per_prompt = per_prompt_rows(results, ids)
    with open(out / "per_prompt.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(per_prompt[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(per_prompt)
    for ext in ("svg", "png"):
        plot_sweep(rows, out / f"budget_curves.{ext}")


def _info(args: argparse.Namespace) -> int:
    from treespec.apps.replay import Trace

    trace = Trace.load(args.trace)
    meta = dict(trace.meta)
    prompts = meta.pop("prompts")
    print(json.dumps(meta, indent=2))
    tensors = sum(3 + (0 if r.scorer is None else len(r.scorer.rounds) + len(r.scorer.shared))
                  for r in trace.drafters.values()) + 2
    print(f"\ndata: {tensors} tensors, " + ("each matching its digest" if trace.checked else
                                             "recorded without digests (not checked)"))
    print(f"\n{len(prompts)} prompts (index, id, first words):")
    for i, (prompt, words) in enumerate(zip(prompts, _first_words(trace), strict=True)):
        print(f"{i:4d}  {prompt.get('id', '')}  {words}")
    return 0


def _first_words(trace, count: int = 10) -> list[str]:
    """Each recorded prompt's first words after what every prompt shares (a chat template's header),
    decoded with the target's tokenizer when it is on this machine, else its first token ids."""
    ids = [trace.sequences[i][:trace.prompt_len(i)].tolist() for i in range(trace.num_prompts)]
    tokenizer = _trace_tokenizer(trace)
    if tokenizer is None:
        return [" ".join(map(str, row[:count])) + (" ..." if len(row) > count else "") for row in ids]
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in ids]
    shared = os.path.commonprefix(texts) if len(texts) > 1 else ""
    cut = max((i for i, c in enumerate(shared) if c.isspace()), default=-1)  # a whole-word prefix
    shared = shared[:cut + 1]
    out = []
    for text in texts:
        words = text[len(shared):].split()
        out.append(" ".join(words[:count]) + (" ..." if len(words) > count else ""))
    return out


def _trace_tokenizer(trace):
    """The recorded target's tokenizer if its folder is on this machine (never fetched), else None."""
    from treespec.apps.assembly.loading import EMBEDDED_NAME, load_tokenizer

    name = str(trace.meta.get("target", {}).get("name", ""))
    folder = Path(name)
    if name == EMBEDDED_NAME:
        from treespec.apps.assembly.embedded import cache_root

        folder = cache_root() / EMBEDDED_NAME
    try:
        return load_tokenizer(folder) if folder.is_dir() else None
    except (OSError, ValueError):
        return None
