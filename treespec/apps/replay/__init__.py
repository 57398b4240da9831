"""Offline trace replay: record what the drafters produce along the target's greedy trajectory once,
then measure any tree policy's T = 0 acceptance lengths from the recording, without the target.

Six modules, one job each: `trace` (the file format and joining traces), `record` (recording),
`rebuild` (a recorded anchor's `DraftOutput`), `evaluate` (replaying policies; `replay_priced`
replays a cost-aware run whose costs were corrected live, round by round with the curves its bench
record names), `compare` (sweeps, per-prompt tau and paired intervals against a baseline, or against
the same methods replayed from another trace of the same answers), `simulate` (a draft controller
driven by recorded rounds priced by recorded cost curves on a deterministic clock).  Replay knows a path-dependent
scorer only through `treespec.interfaces.RecordableScorer` and the registry.

Exactness.  A rebuilt draft gives the live draft's tree bit for bit for best-first policies over
the marginals (DDTree, CaDDTree, the chain) with budget <= ``max_budget``, for the scorer policies
(Chain, DominoTree, static-corrected over a Domino draft) with ``top_m`` <= the recorded one, and
for any policy that reads only the top ``min_k`` tokens of each depth.  Replay refuses budgets and
top-M beyond those, and fails on a tree holding an unrecorded token (a -inf score, or NaN from an
unrecorded scorer row).  Replayed tau equals live tau when the live drafts and target tokens equal
the recorded ones; in floating point the live taps differ from the recorded ones by the rounding of
a tree forward against a one-token step, so float64 runs agree exactly and low-precision runs
nearly always (benchmarks/bench_replay.py reports the agreement).
"""

from treespec.apps.replay.acceptance import Acceptance, fit_acceptance, load_acceptance
from treespec.apps.replay.compare import ComparisonRow, compare, compare_traces, expand_sweep
from treespec.apps.replay.evaluate import (
    ReplayResult,
    ReplayRound,
    check_replayable,
    evaluate,
    replay_priced,
    replay_prompt,
    replay_rounds,
)
from treespec.apps.replay.rebuild import ReplayDrafts
from treespec.apps.replay.record import RECORD_PRESETS, RecordConfig, record_trace
from treespec.apps.replay.trace import DrafterRecord, ScorerRecord, Trace, TraceError, check_paired, merge_traces

__all__ = [
    "RECORD_PRESETS", "Acceptance", "ComparisonRow", "DrafterRecord", "RecordConfig", "ReplayDrafts", "ReplayResult",
    "ReplayRound", "ScorerRecord", "Trace", "TraceError", "check_paired", "check_replayable", "compare",
    "compare_traces", "evaluate", "expand_sweep", "fit_acceptance", "load_acceptance", "merge_traces", "record_trace",
    "replay_priced", "replay_prompt", "replay_rounds",
]
