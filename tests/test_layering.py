"""The layering the docs claim, checked on the source: a kernel that names no implementation and no
app, and apps that reach policies/, drafters/, verifiers/ and engines/ through the registry only.

The kernel is every module of ``treespec/`` outside ``treespec/apps/`` (the tree, the interfaces,
the decoding loop, the target wrapper, the registry, sampling, stats, top-k, reachability, tree
analysis and the machine runtime); the apps are ``treespec/apps/``.  Imports are found at module
level, inside functions, and in ``importlib.import_module`` / ``__import__`` calls on a literal.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "treespec"
KERNEL = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                if p.parts[len(ROOT.parts)] != "apps" and p.name != "__init__.py")
APPS = sorted(str(p.relative_to(ROOT / "apps")) for p in (ROOT / "apps").rglob("*.py"))
IMPLEMENTATIONS = ("policies", "drafters", "verifiers", "engines")  # repository folders, installed as treespec.<name>
IMPLEMENTATION_MODULES = sorted(str(p.relative_to(ROOT.parent)) for package in IMPLEMENTATIONS
                                for p in (ROOT.parent / package).rglob("*.py"))


def is_implementation(name: str) -> bool:
    """Whether the dotted ``name`` lies in an implementation package (its installed name, or the
    bare folder name a stray import would use)."""
    parts = name.split(".")
    return parts[0] in IMPLEMENTATIONS or (parts[0] == "treespec" and len(parts) > 1 and parts[1] in IMPLEMENTATIONS)


def imported_names(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in ``source``: statements at any depth (``from a import b``
    gives ``a.b``), and ``importlib.import_module`` / ``__import__`` calls on a literal name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def implementation_imports(source: str) -> list[str]:
    return [f"line {n}: {name}" for n, name in imported_names(source) if is_implementation(name)]


def app_imports(source: str) -> list[str]:
    return [f"line {n}: {name}" for n, name in imported_names(source) if name.startswith("treespec.apps")]


def test_the_layout_is_what_the_checks_read():
    assert {"tree.py", "interfaces.py", "decoding.py", "target.py", "registry.py", "topk.py",
            "training.py"} <= set(KERNEL)
    assert {"api.py", "cli.py", "bench/runner.py", "replay/record.py", "assembly/methods.py", "training/trainer.py"} <= set(APPS)
    assert {"drafters/training.py", "policies/ddtree.py", "verifiers/match.py"} <= set(IMPLEMENTATION_MODULES)


@pytest.mark.parametrize("module", IMPLEMENTATION_MODULES)
def test_no_implementation_imports_an_app(module):
    """policies/, drafters/ and verifiers/ sit below the apps: they import the kernel, never an app
    (drafter training's loop, teacher cache and commands live in ``treespec/apps/training``)."""
    assert app_imports((ROOT.parent / module).read_text()) == []


@pytest.mark.parametrize("module", KERNEL)
def test_the_kernel_imports_no_implementation_and_no_app(module):
    source = (ROOT / module).read_text()
    assert implementation_imports(source) == [] and app_imports(source) == []


@pytest.mark.parametrize("module", APPS)
def test_the_apps_reach_implementations_through_the_registry_only(module):
    assert implementation_imports((ROOT / "apps" / module).read_text()) == []


def test_the_package_face_imports_the_kernel_and_the_api_only():
    names = [name for _, name in imported_names((ROOT / "__init__.py").read_text())]
    assert implementation_imports((ROOT / "__init__.py").read_text()) == []
    assert [n for n in names if n.startswith("treespec.apps")] == ["treespec.apps.api.generate"]


def test_importing_treespec_or_a_policy_loads_no_app():
    """The face is lazy (PEP 562): ``import treespec`` and a policy's imports load the kernel only,
    and ``treespec.generate`` still resolves to the api's function when asked for."""
    import subprocess
    import sys

    code = ("import sys, treespec, treespec.policies.ddtree, treespec.verifiers.match\n"
            "print(sorted(m for m in sys.modules if m.startswith('treespec.apps')))\n"
            "from treespec.apps.api import generate\n"
            "print(treespec.generate is generate)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent).stdout.split("\n")
    assert out[:2] == ["[]", "True"]


def test_the_scanner_finds_planted_imports():
    planted = '''
import importlib
from treespec import apps

def build():
    from treespec.policies.ddtree import DDTree
    import treespec.verifiers.match
    from treespec.apps.replay import evaluate
    return importlib.import_module("treespec.drafters.dflash"), __import__("policies")
'''
    assert [line.split(": ")[1] for line in implementation_imports(planted)] == [
        "treespec.policies.ddtree.DDTree", "treespec.verifiers.match", "treespec.drafters.dflash", "policies"]
    assert [line.split(": ")[1] for line in app_imports(planted)] == ["treespec.apps", "treespec.apps.replay.evaluate"]


def test_every_package_folder_is_installed_under_treespec():
    """pyproject.toml lists each package folder once, under the one top-level name ``treespec``
    (policies/, drafters/ and verifiers/ mapped to treespec.policies, .drafters, .verifiers)."""
    import tomllib

    tool = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {str(p.parent.relative_to(ROOT.parent)) for p in ROOT.parent.glob("*/**/__init__.py")
               if p.parts[len(ROOT.parent.parts)] in ("treespec", *IMPLEMENTATIONS)}
    mapping = tool["package-dir"]

    def folder(package: str) -> str:
        head = next((name for name in mapping if package == name or package.startswith(name + ".")), None)
        rest = package[len(head):].lstrip(".") if head else package
        base = mapping[head] if head else ""
        return "/".join(part for part in (base, rest.replace(".", "/")) if part)

    assert {p.split(".")[0] for p in tool["packages"]} == {"treespec"}
    assert sorted(folder(p) for p in tool["packages"]) == sorted(folders)


@pytest.mark.slow  # builds a wheel
def test_a_wheel_holds_treespec_alone(tmp_path):
    """What `pip install .` puts into site-packages: ``treespec`` and its dist-info, nothing else at top level."""
    import shutil
    import subprocess
    import sys
    import zipfile

    source = tmp_path / "src"  # a copy of the tracked files: a stale build/ of the checkout cannot leak in
    tracked = subprocess.run(["git", "ls-files", "pyproject.toml", "README.md", "treespec", *IMPLEMENTATIONS],
                             cwd=ROOT.parent, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT.parent / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(source)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("treespec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")} == {"treespec"}
    assert {"treespec/policies/ddtree.py", "treespec/drafters/domino.py", "treespec/verifiers/match.py",
            "treespec/assets/demo/chat.jsonl"} <= set(names)


def policy_probes(source: str) -> list[str]:
    """``getattr`` / ``hasattr`` calls on something named like a policy (``policy``, ``self.policy``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and node.args and "policy" in ast.unparse(node.args[0]).lower()):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("module", KERNEL)
def test_the_kernel_finds_nothing_on_a_policy_by_getattr(module):
    """The decoding loop reaches a policy through the methods `TreePolicy` declares (``build``,
    ``draft_controller``, ``priced``, ``observe_round``, ...), never by probing it for attributes."""
    assert policy_probes((ROOT / module).read_text()) == []


ENGINE_MODULES = [m for m in IMPLEMENTATION_MODULES if m.startswith("policies/engine/")]


@pytest.mark.parametrize("module", ENGINE_MODULES)
def test_the_build_engine_imports_no_policy(module):
    """policies/engine/ (the best-first skeleton, candidates, expanders, stop rules) is what policies
    build on; it never imports one of them."""
    policies = [name for _, name in imported_names((ROOT.parent / module).read_text())
                if name.startswith("treespec.policies.") and not name.startswith("treespec.policies.engine")]
    assert policies == []


def test_the_new_rules_catch_what_they_forbid():
    assert policy_probes("x = getattr(self.policy, 'cost_model', None)\ny = hasattr(policy, 'a')\nz = getattr(d, 'm')") \
        == ["line 1: getattr(self.policy, 'cost_model', None)", "line 2: hasattr(policy, 'a')"]
    assert len(ENGINE_MODULES) >= 6 and "policies/engine/best_first.py" in ENGINE_MODULES


# The steps that turn a method into a run's policy and keep what it measured: pricing a policy, restoring
# what a learning policy learned, saving what live cost models learned, measuring this machine's profile.
RUN_STEPS = {"method_policy", "restore_learned", "persist_live", "machine_profile", "refresh_profile", "price"}
STEP_HOMES = {"assembly/session.py", "assembly/cost_source.py"}  # the Session, and where the steps are written
PROFILE_TOOL = ("commands/profile_cost.py", {"machine_profile", "refresh_profile"})  # measuring it is its job


def run_steps(source: str) -> set[str]:
    """The run steps ``source`` names itself: bare names and imported names (``persist_live(...)``,
    ``measure = machine_profile``) and attribute calls on a cost source (``costs.price(...)``); a
    method of the session (``session.machine_profile()``) or of a policy is not a step taken here."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in RUN_STEPS:
            found.add(node.id)
        elif isinstance(node, ast.ImportFrom):
            found |= {alias.name for alias in node.names if alias.name in RUN_STEPS}
        elif (isinstance(node, ast.Attribute) and node.attr == "price" and isinstance(node.value, ast.Name)
              and "cost" in node.value.id):
            found.add("price")
    return found


def test_only_the_session_assembles_a_run():
    """Every app gets its policies and decoders from `treespec.apps.assembly.session.Session`: no other
    module prices a policy, restores what one learned, saves live costs or measures the profile."""
    for name in APPS:
        if name in STEP_HOMES:
            continue
        steps = run_steps((ROOT / "apps" / name).read_text())
        allowed = PROFILE_TOOL[1] if name == PROFILE_TOOL[0] else set()
        assert steps <= allowed, f"treespec/apps/{name} takes the run steps {sorted(steps - allowed)} itself"


def test_the_run_step_scan_sees_a_planted_step():
    planted = "from treespec.apps.assembly.cost_source import persist_live\npersist_live(t, p, [])\n"
    assert run_steps(planted) == {"persist_live"}
    assert run_steps("profile = machine_profile\nx = costs.price(f)\n") == {"machine_profile", "price"}
    assert run_steps("session.machine_profile()\npolicy.restore_learned(state)\n") == set()


ENGINE_NAMES = {"torch", "llama.cpp"}  # the registered engines' names


def engine_name_tests(source: str) -> list[str]:
    """Comparisons of a value with an engine's name (``engine == "torch"``, ``e != "llama.cpp"``,
    ``engine in ("torch", ...)``): the special cases an app would make of one engine."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            values = [side] + (list(side.elts) if isinstance(side, ast.Tuple | ast.List | ast.Set) else [])
            if any(isinstance(v, ast.Constant) and v.value in ENGINE_NAMES for v in values):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
                break
    return found


@pytest.mark.parametrize("module", APPS + KERNEL)
def test_no_app_or_kernel_module_tests_an_engines_name(module):
    """Every engine, torch included, is a registry entry implementing `treespec.target.Engine`: what an
    app needs of one it asks the engine (its target's shapes, description, files), never its name."""
    path = ROOT / "apps" / module if module in APPS else ROOT / module
    assert engine_name_tests(path.read_text()) == []


def test_the_engine_name_scan_sees_a_planted_test():
    planted = 'if engine != "torch":\n    pass\nx = e in ("torch", "llama.cpp")\ny = dtype == "torch"\n'
    assert [f.split(":")[0] for f in engine_name_tests(planted)] == ["line 1", "line 3", "line 4"]
