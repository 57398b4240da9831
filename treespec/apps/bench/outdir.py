"""A bench run's output folder: its file names, its settings, and what may happen to earlier results.

Contract
--------
A run writes ``bench.json`` (its settings), per shard ``records-rank{r}.jsonl`` and
``divergences-rank{r}.jsonl``, and after merging ``records.jsonl`` and ``divergences.jsonl``.
`prepare_out` checks a folder before anything is measured: the same settings resume, other
settings are refused unless ``overwrite`` is given; results are never silently replaced.  The
settings name the target and the drafters by `weights_identity` (path and sha256 of the weights), so
new weights saved over the same path are other settings, not a resume.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import attrs

from treespec.apps.assembly.methods import MethodSpec
from treespec.apps.bench.config import BenchConfig

__all__ = ["DIVERGENCES", "RECORDS", "SETTINGS", "prepare_out", "run_settings", "shard_files", "shard_paths",
           "weights_identity", "write_settings"]

RECORDS, DIVERGENCES, SETTINGS = "records.jsonl", "divergences.jsonl", "bench.json"


def shard_paths(out_dir: Path, rank: int) -> tuple[Path, Path]:
    return out_dir / f"records-rank{rank}.jsonl", out_dir / f"divergences-rank{rank}.jsonl"


def _rank_of(path: Path) -> int:
    return int(re.search(r"rank(\d+)", path.name).group(1))


def shard_files(out_dir: Path, stem: str) -> list[Path]:
    """The ``{stem}-rank*.jsonl`` files of ``out_dir``, by rank."""
    return sorted(out_dir.glob(f"{stem}-rank*.jsonl"), key=_rank_of)


def run_settings(config: BenchConfig, methods: Sequence[MethodSpec], extra: dict) -> dict:
    """What a run measures, as JSON-ready data: the config, the expanded methods and ``extra``."""
    settings = attrs.asdict(config) | {"expanded_methods": [m.name for m in methods]} | extra
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def weights_identity(model_dir: str | Path) -> dict[str, str]:
    """``{"path", "sha256"}`` of a model or drafter directory: where it is and what its weights are."""
    from treespec.apps.assembly.loading import model_identity

    return {"path": str(model_dir), "sha256": model_identity(str(model_dir), model_dir)["sha256"]}


def write_settings(out_dir: Path, settings: dict) -> Path:
    """``bench.json``: the run's settings (the report does not read them; a resumed run checks them)."""
    (out_dir / SETTINGS).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return out_dir / SETTINGS


_RESULTS = (RECORDS, DIVERGENCES, "summary.csv", "pairs.csv", "summary.md", "lossless.md", "tau_hist.svg",
            "tau_hist.png", "budget_curves.svg", "budget_curves.png")


def prepare_out(out_dir: Path, settings: dict, *, overwrite: bool = False) -> str:
    """Check ``out_dir`` against this run's ``settings`` before anything is measured.

    Returns "new" (nothing there), "resume" (the same configuration: completed conversations are
    kept) or "overwrite" (another configuration's results removed, as asked); raises ValueError for
    another configuration's results without ``overwrite``.  A merged single-process run is turned
    back into its shard so it can be resumed or extended.
    """
    results = [out_dir / n for n in _RESULTS if (out_dir / n).exists()] + shard_files(out_dir, "records") + \
        shard_files(out_dir, "divergences")
    if not results:
        return "new"
    previous = _read_settings(out_dir)
    if previous == settings:
        if (out_dir / RECORDS).is_file() and not shard_files(out_dir, "records"):
            (out_dir / RECORDS).replace(shard_paths(out_dir, 0)[0])
            if (out_dir / DIVERGENCES).is_file():
                (out_dir / DIVERGENCES).replace(shard_paths(out_dir, 0)[1])
        return "resume"
    if not overwrite:
        differ = sorted(k for k in set(settings) | set(previous or {}) if (previous or {}).get(k) != settings.get(k))
        what = f"differs in {', '.join(differ)}" if previous is not None else "has no bench.json"
        raise ValueError(f"{out_dir} holds the results of another bench configuration ({what}); choose another "
                         "--out, or pass --overwrite to replace them")
    for path in results:
        path.unlink()
    return "overwrite"


def _read_settings(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / SETTINGS).read_text())
    except (OSError, ValueError):
        return None
