"""``treespec bench``: A/B comparison of decoding methods in one harness, paired, with derived tables.

``treespec bench --methods ... --out DIR`` measures and then derives the report;
``treespec bench report DIR`` (or ``--report-only``) re-derives it from ``DIR/records.jsonl``;
``treespec bench merge DIR`` merges the per-rank shards of a sharded run and derives the report.
Under ``torchrun --nproc_per_node K -m treespec.apps.cli bench ...`` rank r measures prompts r::K, and
rank 0 merges after a gloo barrier.  Exit status 1 flags a divergence from AR beyond the stated
tolerance (see `treespec.apps.bench.lossless`); 2 a usage error.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import attrs
import torch

from treespec.apps import bench
from treespec.apps.commands import (
    DTYPES,
    add_engine_argument,
    add_exact_argument,
    add_threads_argument,
    check_model_digest,
    exit_status,
    start_threads,
)
from treespec.decoding import FIRST_TOKENS


def _csv(kind):
    return lambda text: tuple(kind(v) for v in text.split(",") if v.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    run = parser.add_argument_group("what to measure (defaults: the preset's)")
    run.add_argument("--preset", default=None, choices=sorted(bench.BENCH_PRESETS), help="start from a preset")
    run.add_argument("--methods", type=_csv(str), help="comma-separated: ar,dflash,domino,ddtree,ddtree@64,...")
    run.add_argument("--budgets", type=_csv(int), help="budgets for tree methods given without @B, e.g. 16,64")
    run.add_argument("--temperatures", type=_csv(float), help="e.g. 0,1")
    run.add_argument("--datasets", type=_csv(str), help="benchmark names or local .json/.jsonl files")
    run.add_argument("--prompts", type=int, help="prompts per dataset")
    run.add_argument("--max-new-tokens", type=int)
    run.add_argument("--seed", type=int, help="prompt shuffle and paired sampling streams")
    run.add_argument("--warmup-tokens", type=int, help="tokens of the untimed warm-up generation per method")
    run.add_argument("--gap-tolerance", type=float, help="T = 0 divergence tolerance on the AR top-two logit gap")
    run.add_argument("--batch-size", type=int,
                     help="prompt turns decoded together per method (default 1); speedups are throughput ratios at that size")
    run.add_argument("--first-token", choices=FIRST_TOKENS,
                     help="prefill: the first token from the prefill and τ counted from the rounds after it, as "
                          "the published loops count it (default round: the first round yields it)")
    run.add_argument("--enable-thinking", action="store_const", const=True, default=None,
                     help="Qwen3 templates: turn thinking on (off by default, as the published harnesses run)")
    run.add_argument("--no-stop", dest="stop_at_eos", action="store_const", const=False,
                     help="ignore EOS: every response is --max-new-tokens long")
    models = parser.add_argument_group("models (local directories; defaults: the embedded SmolLM2 and its drafters)")
    models.add_argument("--model", type=Path, default=None, help="target model directory")
    models.add_argument("--dflash", type=Path, default=None, help="DFlash drafter checkpoint directory")
    models.add_argument("--domino", type=Path, default=None, help="Domino drafter checkpoint directory")
    models.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR",
                        help="the checkpoint of any registered drafter a method names (ddtree@16:NAME, or NAME "
                             "alone for its chain); repeatable; --dflash DIR is --drafter dflash=DIR")
    models.add_argument("--dtype", default="auto", choices=sorted(DTYPES),
                        help="target dtype (auto: the faster of bf16 and fp32 here, measured once; bf16 on CUDA)")
    models.add_argument("--cost-model", default="live",
                        help="cost model of cost-aware methods: live (default: this machine's profile, measured "
                             "once and cached, corrected by the round times measured while decoding), profile "
                             "(the profile as measured), or a JSON file / preset:NAME (fixed)")
    models.add_argument("--device", default="cpu", help="cpu or cuda (under torchrun: cuda:LOCAL_RANK)")
    add_threads_argument(models)
    add_engine_argument(models)
    add_exact_argument(models, True)  # pairing is what a bench is for
    models.add_argument("--logits-dtype", choices=("float32", "model"), default="float32",
                        help="a bf16/fp16 target's final norm and LM head: in float32 (default; fewer exact "
                             "logit ties) or in the model's dtype")
    out = parser.add_argument_group("output")
    out.add_argument("--out", type=Path, default=None, help="output directory")
    out.add_argument("--report-only", action="store_true", help="only re-derive the report from --out")
    out.add_argument("--overwrite", action="store_true",
                     help="replace results of another configuration in --out (default: refuse; the same "
                          "configuration resumes)")
    out.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples of the intervals")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument("--dist-timeout", type=float, default=24.0, help="hours ranks may wait for each other")
    sub = parser.add_subparsers(dest="action", metavar="{report,merge,import,reproduce}")
    for name, text in (("report", "re-derive tables and plots from DIR/records.jsonl (or a paper's tables from "
                                  "imported records)"),
                       ("merge", "merge DIR/records-rank*.jsonl shards, then derive the report")):
        action = sub.add_parser(name, help=text)
        action.add_argument("dir", type=Path, help="the bench output directory")
        action.add_argument("--resamples", type=int, default=argparse.SUPPRESS, help="bootstrap resamples")
        if name == "report":
            _published_report_arguments(action)
    _import_arguments(sub.add_parser("import", help="read another harness's raw per-prompt records into DIR"))
    _reproduce_arguments(sub.add_parser("reproduce", help="a paper's tables from its repository's raw records, "
                                                          "diffed against its CSVs"))


def _published_report_arguments(parser: argparse.ArgumentParser) -> None:
    from treespec.apps.published.tables import CONVENTIONS

    group = parser.add_argument_group("a paper's layout (docs/reproduce.md)")
    group.add_argument("--layout", choices=("table1",), default=None,
                       help="also write Table 1 (and the pairwise table) in the DominoTree paper's layout; "
                            "implied for a folder of imported records")
    group.add_argument("--convention", choices=sorted(CONVENTIONS), default=None,
                       help="the table's conventions (default: treespec; dominotree-4b / -8b: the paper's)")
    group.add_argument("--conv", action="append", default=[], metavar="KEY=VALUE",
                       help="change one convention of the preset: speedup=mean-tps|totals, ar=own|common, "
                            "paired=true|false, best_mode=true|false, warmup=HARNESS:first-row|first-prompt "
                            "(or none), resamples=N, seed=N, bootstrap=numpy|python, focus=ROW (repeatable)")
    group.add_argument("--expect", type=Path, default=None,
                       help="a published table1_cells.csv: diff every cell at its printed precision, exit 1 on "
                            "any difference")
    group.add_argument("--expect-pairwise", type=Path, default=None, help="a published pairwise_ci.csv, the same")
    group.add_argument("--model-label", default="model", help="the Model column of the table")


def _import_arguments(parser: argparse.ArgumentParser) -> None:
    from treespec.apps.published.records import FORMATS

    parser.add_argument("--from", dest="fmt", required=True, choices=FORMATS, help="what wrote the records")
    parser.add_argument("raw", nargs="+", type=Path, help="raw record files or folders of them")
    parser.add_argument("--out", type=Path, required=True, help="the folder to import into (several imports add up)")
    parser.add_argument("--overwrite", action="store_true", help="replace this format's earlier import in --out")


def _reproduce_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paper", choices=("dominotree",), help="which paper's repository")
    parser.add_argument("clone", type=Path, help="a clone (or extracted snapshot) of its repository")
    parser.add_argument("--out", type=Path, default=Path("runs/reproduce-dominotree"),
                        help="where the derived tables go (a folder that holds files is refused without --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of an existing --out")
    parser.add_argument("--resamples", type=int, default=None,
                        help="bootstrap resamples of the pairwise intervals (default: the paper's 10,000)")


def config_from_args(args: argparse.Namespace) -> bench.BenchConfig:
    """The preset (or the defaults) with every option given on the command line applied."""
    base = bench.BENCH_PRESETS[args.preset] if args.preset else bench.BenchConfig()
    given = {f.name: getattr(args, f.name) for f in attrs.fields(bench.BenchConfig)
             if getattr(args, f.name, None) is not None}
    return attrs.evolve(base, **given)


def _report(out_dir: Path, resamples: int) -> int:
    report = bench.write_report(out_dir, resamples=resamples)
    print(report.table)
    print(report.lossless)
    print(f"wrote {', '.join(p.name for p in report.files)} in {out_dir}")
    return 1 if report.unacceptable else 0


def _drafter_dirs(args: argparse.Namespace, methods) -> dict[str, Path]:
    """The checkpoint of each drafter the methods name: --drafter NAME=DIR (or --dflash / --domino),
    else the embedded one where the embedded target ships it."""
    from treespec.apps.assembly.loading import drafter_dirs

    return drafter_dirs(sorted({m.drafter for m in methods if m.drafter}), args.drafter,
                        {"dflash": args.dflash, "domino": args.domino})


def _device(args: argparse.Namespace, shard: bench.Shard) -> str:
    if shard.world > 1 and args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return f"cuda:{local}"
    return args.device


def _batching_engines() -> list[str]:
    """The registered engines that decode several sequences in one forward (`Engine.batch_class`)."""
    from treespec.apps.assembly.loading import engine_class, engines

    return [e for e in engines() if engine_class(e).batch_class is not None]


def _measure(args: argparse.Namespace, config: bench.BenchConfig, shard: bench.Shard) -> None:
    from treespec.apps.assembly.embedded import embedded_model_dir

    methods = bench.expand_methods(config.methods, config.budgets)  # a bad method fails here, before loading
    bench.bench_prompts(config)  # and so does a missing dataset
    from treespec.apps.assembly.cost_source import CostSource
    from treespec.apps.assembly.loading import engine_class
    from treespec.apps.assembly.session import Session

    costs = CostSource.parse(args.cost_model)
    if config.batch_size > 1 and engine_class(args.engine).batch_class is None:
        raise ValueError(f"--batch-size {config.batch_size}: the {args.engine} engine decodes one sequence at a time "
                         f"here; use --batch-size 1, or an engine that batches ({', '.join(_batching_engines())})")
    check_model_digest(args)
    if shard.rank == 0:
        bench.lock_out(args.out)  # one writer at a time, before anything loads
    try:
        model = args.model or embedded_model_dir()
        drafters = _drafter_dirs(args, methods)
        threads = start_threads(args, ranks=shard.world)
        session = Session.load(model, drafters, dtype=DTYPES[args.dtype], device=_device(args, shard),
                               engine=args.engine, exact=args.exact, float32_head=args.logits_dtype == "float32",
                               costs=costs,
                               threads=threads, progress=not args.no_progress, profile_repeats=3,
                               enable_thinking=config.enable_thinking)
        # the weights (the file the engine runs) and the dtype actually used: a resume never mixes records
        settings = bench.measured_settings(config, methods, session, model=model, drafters=drafters,
                                           engine=args.engine, logits_dtype=args.logits_dtype,
                                           cost_model=costs.describe(), device=args.device)
        state = bench.open_out(args.out, settings, overwrite=args.overwrite) if shard.rank == 0 else "new"
    except BaseException:
        if shard.rank == 0:
            bench.abandon_out(args.out)  # nothing measured: nothing left behind
        raise
    if shard.rank == 0:
        if state != "new":
            print(f"treespec bench: {'resuming the run' if state == 'resume' else 'replacing the results'} in "
                  f"{args.out}", file=sys.stderr)
    bench.run_shard(config, session, args.out, shard, progress=not args.no_progress)
    if session.close() is None and session.not_saved:  # else the next run starts from what this one learned
        print(f"treespec bench: live-corrected costs not saved: {session.not_saved}", file=sys.stderr)


def _run_distributed(args: argparse.Namespace, config: bench.BenchConfig, shard: bench.Shard) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=args.dist_timeout))
    try:
        _measure(args, config, shard)
        dist.barrier()  # every shard written before rank 0 merges
    finally:
        dist.destroy_process_group()
    if shard.rank != 0:
        return 0
    bench.merge_shards(args.out)
    return _report(args.out, args.resamples)


def _imported(out_dir: Path) -> list[Path]:
    return sorted(out_dir.glob("imported-*.jsonl"))


def _import(args: argparse.Namespace) -> int:
    from collections import Counter

    from treespec.apps.published.records import read_records, write_imported

    records = read_records(args.fmt, args.raw)
    if not records:
        raise ValueError(f"no {args.fmt} records in {', '.join(map(str, args.raw))}")
    path = args.out / f"imported-{args.fmt}.jsonl"
    if path.exists() and not args.overwrite:
        raise ValueError(f"{path} exists (an earlier import of {args.fmt}); pass --overwrite to replace it")
    args.out.mkdir(parents=True, exist_ok=True)
    write_imported(records, path)
    methods = Counter(r.method for r in records)
    lacks = [f"{what}: {n} of {len(records)}" for what, n in (
        ("no token ids (only a count)", sum(r.new_tokens is not None for r in records)),
        ("no output signature", sum(r.signature is None for r in records)),
        ("no per-round tau", sum(r.taus is None for r in records)),
        ("no decode time", sum(r.decode_time is None for r in records))) if n]
    print(f"imported {len(records)} {args.fmt} records ({', '.join(f'{m} {n}' for m, n in sorted(methods.items()))}) "
          f"into {path}; what they do not hold: {'; '.join(lacks) or 'nothing'}")
    return 0


def _signature_check(records) -> str:
    """Losslessness from imported records: outputs whose signature equals their AR's at T = 0, where
    signatures exist; "not measurable" otherwise."""
    signed = [r for r in records if r.signature is not None and r.temperature == 0.0]
    if not signed:
        return "losslessness: not measurable (the imported records hold no output ids or signatures)"
    ar = {(r.harness, r.dataset, r.key): r.signature for r in signed if r.method == "ar"}
    mine = [r for r in signed if r.method != "ar" and (r.harness, r.dataset, r.key) in ar]
    same = sum(r.signature == ar[(r.harness, r.dataset, r.key)] for r in mine)
    return (f"losslessness at T = 0, from the records' output signatures: {same} of {len(mine)} responses equal "
            f"their AR's (records without a signature: not measurable)")


def _published_report(args: argparse.Namespace) -> int:
    from treespec.apps.published.records import read_imported
    from treespec.apps.published.report import diff_pairwise, diff_table1, write_tables
    from treespec.apps.published.tables import CONVENTIONS, TableRow, pairwise, table1, with_settings

    conv = with_settings(CONVENTIONS[args.convention or "treespec"], args.conv)  # its own bootstrap resamples
    if _imported(args.dir):
        records = [r for path in _imported(args.dir) for r in read_imported(path)]
        pairs = pairwise(records, conv)
    else:
        from treespec.apps.published.own import harness_records

        records = harness_records(bench.read_records(args.dir / bench.RECORDS))
        methods = sorted({r.method for r in records}, key=lambda m: (m != "ar", m))
        conv = attrs.evolve(conv, rows=tuple(TableRow(m, "treespec", m) for m in methods),
                             datasets=tuple(sorted({r.dataset for r in records})), groups={}, against=())
        pairs = None
    cells = table1(records, conv)
    files = write_tables(args.dir, cells, pairs, conv, args.model_label)
    print((args.dir / "table1.md").read_text())
    print(_signature_check(records))
    print(f"wrote {', '.join(p.name for p in files)} in {args.dir}")
    failed = 0
    for label, expected, diff, found in (("Table 1", args.expect, diff_table1, cells),
                                         ("pairwise", args.expect_pairwise, diff_pairwise, pairs)):
        if expected is None:
            continue
        if found is None:
            raise ValueError("--expect-pairwise needs imported records with the paper's rows")
        total, differences = diff(found, expected)
        print(f"{label}: {total - len({d.where for d in differences})} of {total} cells match {expected}")
        for d in differences:
            print(f"  {d.where}: {d.field} {d.mine} here, {d.published} published")
        failed |= bool(differences)
    return 1 if failed else 0


def _reproduce(args: argparse.Namespace) -> int:
    from treespec.apps.published.reproduce import reproduce_dominotree

    if args.out.exists() and any(args.out.iterdir()) and not args.overwrite:
        raise ValueError(f"{args.out} holds files; pass --overwrite to replace them")
    results = reproduce_dominotree(args.clone, args.out, resamples=args.resamples,
                                   progress=lambda line: print(line, file=sys.stderr, flush=True))
    for r in results:
        table_bad = len({d.where for d in r.table_differences})
        pair_bad = len({d.where for d in r.pair_differences})
        print(f"{r.model}: Table 1 {r.table_cells - table_bad} of {r.table_cells} cells match; pairwise "
              f"{r.pair_cells - pair_bad} of {r.pair_cells} comparisons match (delta, interval and verdict)")
        for d in (*r.table_differences, *r.pair_differences):
            print(f"  {d.where}: {d.field} {d.mine} here, {d.published} published")
        print(f"  {r.shift}")
    print(f"wrote the tables under {args.out}")
    return 0 if all(r.matched for r in results) else 1


def _dispatch(args: argparse.Namespace) -> int:
    if args.action == "import":
        return _import(args)
    if args.action == "reproduce":
        return _reproduce(args)
    if args.action == "report" and (args.layout or args.convention or args.conv or args.expect
                                    or args.expect_pairwise or _imported(args.dir)):
        return _published_report(args)
    if args.action == "report":
        return _report(args.dir, args.resamples)
    if args.action == "merge":
        bench.merge_shards(args.dir)
        return _report(args.dir, args.resamples)
    if args.out is None:
        raise ValueError("--out DIR is required")
    if args.report_only:
        return _report(args.out, args.resamples)
    config, shard = config_from_args(args), bench.Shard.from_env()
    if shard.world > 1:
        return _run_distributed(args, config, shard)
    _measure(args, config, shard)
    bench.merge_shards(args.out)
    return _report(args.out, args.resamples)


def run(args: argparse.Namespace) -> int:
    try:
        return _dispatch(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"treespec bench: {exc}", file=sys.stderr)
        return exit_status(exc)
    except KeyboardInterrupt:
        where = getattr(args, "out", None) or getattr(args, "dir", None)
        print(f"\ntreespec bench: interrupted; the completed conversations are saved in {where}: run the same "
              "command again to resume", file=sys.stderr)
        return 130
