"""Test-session settings shared by every test module."""

import os
from pathlib import Path

import pytest
import torch
from bigram_drafter import NAME as BIGRAM
from bigram_drafter import BigramDrafter
from sibling_capped import NAME, SiblingCapped

from treespec import register

# The tests run tiny models whose ops are too small to gain from intra-op threads; on a shared CPU
# extra threads only add synchronisation stalls (seen here: 20-40x slower small ops under load).
torch.set_num_threads(1)
os.environ["TREESPEC_THREADS"] = "1"  # and the commands run in-process keep it (their default: the free cores)
# The benchmark prompts the tests read (GSM8K, MT-Bench, Alpaca): the offline copies beside the checkout,
# unless the variable names another folder (.ci/run sets it; a user fills one with `treespec fetch-data`).
os.environ.setdefault("TREESPEC_DATA_DIR", str(Path(__file__).resolve().parents[2] / "shared" / "datasets"))

# A policy added as a user adds one (tests/sibling_capped.py): registered, never listed elsewhere.
register("policy", NAME, SiblingCapped)

# A drafter added the same way (tests/bigram_drafter.py): it declares its role and its loader.
register("drafter", BIGRAM, BigramDrafter)


@pytest.fixture(autouse=True)
def _unread_load(monkeypatch):
    """A test does not read the machine's real load (what else runs must not change a test's result):
    the kernel's accounting reads as unavailable, so nothing is marked disturbed.  The tests of that
    accounting pass readers of their own (tests/test_conditions.py)."""
    from treespec.pricing import conditions

    monkeypatch.setattr(conditions, "read_cpu_times", lambda *args, **kwargs: None)


@pytest.fixture
def steady_timings(monkeypatch):
    """For tests of what a profile's cache does with its figures: every verify runs its forwards as a
    measured one does, then reads as 1 ms plus 5 % a token, so a figure that another worker's load
    made implausible (not cached) or a spot check that finds the machine changed cannot decide them.
    The figures' own checks are tests/test_plausible_costs.py's, on real timings."""
    from treespec.pricing import profile

    measured = profile.time_verify_sizes

    def steady(target, sizes, ctx, repeats, generator):
        measured(target, sizes, ctx, 1, generator)
        return {n: 1e-3 * (1 + 0.05 * n) for n in sizes}

    monkeypatch.setattr(profile, "time_verify_sizes", steady)
