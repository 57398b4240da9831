"""The docs' tutorials run: every ```python block of a tutorial page executes, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from treespec import registry

DOCS = Path(__file__).resolve().parents[1] / "docs"
TUTORIALS = ["tutorial-policy.md"]


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


@pytest.mark.parametrize("name", TUTORIALS)
def test_tutorial_runs(name, monkeypatch):
    monkeypatch.setattr(registry, "_RUNTIME", {kind: {} for kind in registry.KINDS})  # registrations stay local
    blocks = python_blocks(DOCS / name)
    assert len(blocks) >= 3, f"{name} lost its code blocks"
    namespace: dict = {"__name__": f"docs.{name}"}
    for block in blocks:
        exec(compile(block, f"{name}", "exec"), namespace)  # noqa: S102 - the docs' own code
