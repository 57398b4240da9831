"""A/B benchmarking of methods: raw JSONL records, derived tables with paired intervals, plots.

One module per job: `config` (what a run measures), `measure` (every method on one prompt turn), `batched` (S turns at a time),
`runner` (a shard's run, resumable), `lossless` (every response against AR's), `outdir`
(the output folder), `merge` (joining shards), `summary` (per-cell statistics), `report` (the
derived files) and `plots`.  What every method of a run shares (the target, the drafters, the chat
template, the costs) is the run's `treespec.apps.assembly.session.Session`.  The names below are the
public face.
"""

from treespec.apps.bench.config import (
                                        BENCH_PRESETS,
                                        METHODS,
                                        BenchConfig,
                                        Shard,
                                        bench_prompts,
                                        expand_methods,
                                        pair_seed,
)
from treespec.apps.bench.lossless import Divergence, decision_gap, first_difference, read_divergences
from treespec.apps.bench.merge import merge_shards
from treespec.apps.bench.outdir import (
                                        DIVERGENCES,
                                        RECORDS,
                                        SETTINGS,
                                        abandon_out,
                                        lock_out,
                                        measured_settings,
                                        open_out,
                                        prepare_out,
                                        run_settings,
                                        shard_paths,
                                        weights_identity,
                                        write_settings,
)
from treespec.apps.bench.records import BenchRecord, read_records
from treespec.apps.bench.report import Report, write_report
from treespec.apps.bench.runner import resume_shard, run_shard

__all__ = [
    "BENCH_PRESETS", "DIVERGENCES", "METHODS", "RECORDS", "SETTINGS", "BenchConfig", "BenchRecord",
    "Divergence", "Report", "Shard", "abandon_out", "bench_prompts", "decision_gap", "expand_methods",
    "first_difference", "lock_out", "measured_settings", "merge_shards", "open_out", "pair_seed", "prepare_out",
    "read_divergences", "read_records", "resume_shard",
    "run_settings", "run_shard", "shard_paths", "weights_identity", "write_report", "write_settings",
]
