"""The kernel names no implementation: its source imports nothing from policies/, drafters/ or
verifiers/, at module level, inside functions, or through importlib; only apps do, by registry name.

The kernel is the tree, the interfaces, the decoding loop, the target wrapper, the registry,
sampling, stats and the machine runtime (cost models, dtype choice, cost profile).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "treespec"
KERNEL = ["tree.py", "interfaces.py", "decoding.py", "target.py", "registry.py", "sampling.py", "stats.py",
          "cost.py", "hardware.py", "profile.py", "reach.py"]
IMPLEMENTATIONS = ("policies", "drafters", "verifiers")


def implementation_imports(source: str) -> list[str]:
    """Every import of an implementation package in ``source``: statements at any depth, and
    ``importlib.import_module`` / ``__import__`` calls on a literal name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [f"line {node.lineno}: {n}" for n in names if n.split(".")[0] in IMPLEMENTATIONS]
    return found


@pytest.mark.parametrize("module", KERNEL)
def test_the_kernel_imports_no_implementation(module):
    assert implementation_imports((ROOT / module).read_text()) == []


def test_the_scanner_finds_planted_imports():
    planted = '''
import importlib

def build():
    from policies.ddtree import DDTree
    import verifiers.match
    return importlib.import_module("drafters.dflash"), __import__("policies")
'''
    assert [line.split(": ")[1] for line in implementation_imports(planted)] == [
        "policies.ddtree", "verifiers.match", "drafters.dflash", "policies"]
