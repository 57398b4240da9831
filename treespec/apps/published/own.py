"""treespec's own bench records as `HarnessRecord`s, so its runs can be written in a paper's layout.

Contract: one record per `BenchRecord`, harness ``"treespec"``, the method's display name, the run
order of the records file per (dataset, temperature, method), tokens/s = new tokens / decode time,
the mean and per-round tau, and the output hash as the signature.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from treespec.apps.bench.records import BenchRecord
from treespec.apps.published.records import HarnessRecord

__all__ = ["harness_records"]


def harness_records(records: Iterable[BenchRecord]) -> list[HarnessRecord]:
    order: dict[tuple, int] = defaultdict(int)
    out = []
    for r in records:
        key = (r.dataset, r.temperature, r.method)
        out.append(HarnessRecord(
            "treespec", r.method, r.dataset, r.temperature, r.prompt_id, r.turn, order[key],
            r.new_tokens / r.decode_time if r.decode_time > 0 else float("nan"), r.new_tokens, r.decode_time,
            r.mean_tau if r.taus else None, tuple(r.taus) if r.taus else None, r.hash))
        order[key] += 1
    return out
