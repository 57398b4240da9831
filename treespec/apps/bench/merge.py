"""Merging a sharded bench run: the shards' records in canonical order, as an unsharded run writes them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from treespec.apps.bench.config import canonical_key
from treespec.apps.bench.lossless import read_divergences, write_jsonl
from treespec.apps.bench.outdir import DIVERGENCES, RECORDS, shard_files
from treespec.apps.bench.records import BenchRecord, read_records, write_records

__all__ = ["merge_shards"]


def _check_unique(records: Sequence[BenchRecord]) -> None:
    seen = set()
    for r in records:
        key = (r.method, *r.key)
        if key in seen:
            raise ValueError(f"duplicate record {key} while merging: shards of different runs in one folder?")
        seen.add(key)


def merge_shards(out_dir: str | Path) -> Path:
    """Concatenate ``records-rank*.jsonl`` (and divergences) in canonical order; the shards are removed."""
    out_dir = Path(out_dir)
    shards = shard_files(out_dir, "records")
    if not shards:
        raise FileNotFoundError(f"no records-rank*.jsonl shards in {out_dir} to merge")
    records = sorted(read_records(*shards), key=canonical_key)
    _check_unique(records)
    found = (d for path in shard_files(out_dir, "divergences") for d in read_divergences(path))
    divergences = sorted(found, key=canonical_key)
    write_records(out_dir / RECORDS, records)
    with open(out_dir / DIVERGENCES, "w") as fh:
        write_jsonl(fh, divergences)
    for path in shards + shard_files(out_dir, "divergences"):
        path.unlink()
    return out_dir / RECORDS
