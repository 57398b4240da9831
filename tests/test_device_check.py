"""benchmarks/device_check.py's end-to-end decoding part runs at tiny sizes on the CPU (--cpu-dry-run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_the_end_to_end_decoding_check_runs_dry_and_finds_every_output_equal_to_ar():
    run = subprocess.run([sys.executable, "device_check.py", "--cpu-dry-run", "--skip", "stacked", "train"],
                         cwd=BENCHMARKS, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and "/3 |" in line]
    assert len(rows) >= 8 and all(line.endswith("| 3/3 |") for line in rows), run.stdout
    assert "after 60 rounds" in run.stdout or "rounds (" in run.stdout
