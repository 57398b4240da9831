"""Which parameters of a test the default tier runs: one value, the slow tier the others."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def by_default(values: Iterable, *keep) -> list:
    """``values`` as parameters, the ones in ``keep`` run by default and every other one marked slow
    (a tuple value is one parameter set of a multi-name parametrize)."""
    return [v if v in keep else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
            for v in values]
