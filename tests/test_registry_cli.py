"""The registry resolves names lazily and accepts run-time and entry-point registrations."""

from __future__ import annotations

import subprocess
import sys

import pytest

from treespec import registry
from treespec.apps.cli import main


def test_importing_treespec_does_not_import_implementations():
    code = ("import sys, treespec, treespec.apps.cli; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('policies', 'drafters', 'verifiers')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_unknown_names_and_kinds_are_clear_errors():
    with pytest.raises(registry.RegistryError, match="unknown policy 'nope'.*ddtree"):
        registry.resolve("policy", "nope")
    with pytest.raises(registry.RegistryError, match="unknown kind"):
        registry.resolve("planner", "ddtree")


def test_runtime_registration_wins(monkeypatch):
    monkeypatch.setitem(registry._RUNTIME["policy"], "mine", "collections:OrderedDict")
    assert "mine" in registry.available("policy")
    assert registry.create("policy", "mine") == {}


def test_entry_point_registration(monkeypatch, tmp_path):
    """A distribution's entry point is found by name, and so is one installed while the process runs
    (the registry reads the entry points again when a folder of the import path changes)."""
    from collections import Counter

    monkeypatch.syspath_prepend(str(tmp_path))
    assert "third-party" not in registry.available("policy")
    info = tmp_path / "thirdparty-1.0.dist-info"  # what pip writes for a package declaring the entry point
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[treespec.policies]\nthird-party = collections:Counter\n")
    assert registry.resolve("policy", "third-party") is Counter
    assert "third-party" in registry.available("policy")


def test_cli_list_and_example(capsys):
    assert main(["list", "policy"]) == 0
    assert "ddtree" in capsys.readouterr().out
    assert main(["list", "command"]) == 0
    assert {"bench", "demo", "list", "replay"} <= set(capsys.readouterr().out.split(": ")[1].strip().split(", "))
    assert main(["example", "--prompts", "1", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "every method's output equals AR's token for token" in out and "dominotree@16" in out


def test_training_recipes_are_reached_by_name(capsys, tmp_path):
    """`treespec train-drafter` finds its recipe through the registry (kind "recipe"): the block
    drafters' is listed, its presets are the recipe's own, and an unknown recipe or preset is refused
    by name before anything loads."""
    from treespec import registry
    from treespec.training import TrainingRecipe

    assert main(["list", "recipe"]) == 0
    assert capsys.readouterr().out.strip() == "recipe: block"
    block = registry.resolve("recipe", "block")
    assert issubclass(block, TrainingRecipe) and "smollm2-domino-v8k-l1" in block.presets
    with pytest.raises(SystemExit, match="unknown recipe 'nosuch'; available: block"):
        main(["train-drafter", "--recipe", "nosuch", "--teacher", str(tmp_path), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="unknown preset 'nope' of recipe block; available: smollm2-dflash"):
        main(["train-drafter", "--preset", "nope", "--teacher", str(tmp_path), "--out", str(tmp_path / "o")])
