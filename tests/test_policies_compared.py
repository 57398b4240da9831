"""docs/policies-compared.md: its table is re-derived, byte for byte, from the committed replay records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare_policies import BEGIN, END, comparison_table  # noqa: E402

RECORDS = ROOT / "docs" / "figures" / "compared" / "records.json"


@pytest.mark.slow  # 12 s: the replay of every compared policy
def test_the_comparison_table_is_derived_from_the_committed_records():
    records = json.loads(RECORDS.read_text())
    doc = (ROOT / "docs" / "policies-compared.md").read_text()
    table = doc.partition(BEGIN)[2].partition(END)[0].strip("\n")
    assert table == comparison_table(records).strip("\n")


def test_the_records_cover_every_registered_policy_at_every_budget():
    from treespec import registry

    records = json.loads(RECORDS.read_text())
    budgets = {r["budget"] for r in records["methods"].values()} - {None}
    assert budgets == {4, 8, 16, 32, 64, 128} and records["prompts"] >= 40
    for name in registry.builtin("policy"):  # sampled trees are their parents' trees at T = 0, where replay runs
        if name != "chain" and not registry.resolve("policy", name).samples_from_draft:
            assert all(f"{name}@{b}" in records["methods"] for b in budgets), name
