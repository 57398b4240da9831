"""`treespec install-engine`: an installed engine is left alone; a build that fails ends in one line
(exit 1) and leaves the torch engine as it was."""

from __future__ import annotations

import pytest

from treespec import registry
from treespec.apps.cli import main


@pytest.fixture
def engine():
    return registry.resolve("engine", "llama.cpp")


def test_an_installed_engine_is_left_alone(engine, monkeypatch, capsys):
    monkeypatch.setattr(engine, "installed", staticmethod(lambda: True))
    monkeypatch.setattr(engine, "install_recipe", staticmethod(lambda: pytest.fail("pip was run")))
    assert main(["install-engine"]) == 0
    assert "llama.cpp is installed" in capsys.readouterr().out


def test_a_failed_build_is_one_line(engine, monkeypatch, capsys):
    """A requirement pip cannot satisfy stands for a build that fails (no network needed: --no-index)."""
    monkeypatch.setattr(engine, "installed", staticmethod(lambda: False))
    monkeypatch.setattr(engine, "install_recipe",
                        staticmethod(lambda: ("treespec-no-such-engine==0.0.1", {"PIP_NO_INDEX": "1"})))
    assert main(["install-engine"]) == 1
    err = capsys.readouterr().err
    assert "building treespec-no-such-engine==0.0.1 failed" in err and "the torch engine runs everything" in err
    assert "Traceback" not in err


def test_the_engine_declares_its_binding_and_build_as_the_package_does():
    import tomllib
    from pathlib import Path

    requirement, env = registry.resolve("engine", "llama.cpp").install_recipe()
    assert requirement.startswith("llama-cpp-python==") and "-DGGML_NATIVE=ON" in env["CMAKE_ARGS"]
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["engine"] == [requirement]  # one pin
