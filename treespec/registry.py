"""Name -> implementation lookup for policies, drafters, verifiers, recordable scorers, training recipes,
CLI commands and target engines.

Contract: built-in names map to ``"module:attribute"`` strings that are imported only when the name
is resolved, so the kernel never imports ``policies``, ``drafters`` or ``verifiers``.
Third-party packages register more names through the entry-point groups ``treespec.policies``,
``treespec.drafters``, ``treespec.verifiers``, ``treespec.scorers``, ``treespec.recipes``,
``treespec.commands`` and ``treespec.engines`` (value
``"pkg.mod:Class"``; a command is a module, ``"pkg.mod"``), or at run time with `register`.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.metadata import entry_points
from typing import Any

__all__ = ["DEFAULT_ENGINE", "KINDS", "RegistryError", "available", "builtin", "create", "register", "resolve"]

KINDS = ("policy", "drafter", "verifier", "scorer", "recipe", "command", "engine")
_GROUPS = {"policy": "treespec.policies", "drafter": "treespec.drafters", "verifier": "treespec.verifiers",
           "scorer": "treespec.scorers", "recipe": "treespec.recipes", "command": "treespec.commands",
           "engine": "treespec.engines"}

# Built-ins, resolved lazily.  A new policy is one file in policies/ plus one line here.
_BUILTIN: dict[str, dict[str, str]] = {
    "policy": {
        "chain": "treespec.policies.chain:Chain",
        "ddtree": "treespec.policies.ddtree:DDTree",
        "caddtree": "treespec.policies.caddtree:CaDDTree",
        "dominotree": "treespec.policies.dominotree:DominoTree",
        "cost-aware-dominotree": "treespec.policies.cost_aware_dominotree:CostAwareDominoTree",
        "static-corrected": "treespec.policies.static_corrected:StaticCorrected",
        "eagle2": "treespec.policies.eagle2:Eagle2",
        "static": "treespec.policies.static:Static",
        "sequoia": "treespec.policies.sequoia:Sequoia",
        "hardware-aware-sequoia": "treespec.policies.sequoia:HardwareAwareSequoia",
        "ddtree-sampled": "treespec.policies.sampled:DDTreeSampled",
        "dominotree-sampled": "treespec.policies.sampled:DominoTreeSampled",
        "pruned-dominotree": "treespec.policies.pruned_dominotree:PrunedDominoTree",
        "learned-ddtree": "treespec.policies.learned:LearnedDDTree",
        "learned-dominotree": "treespec.policies.learned:LearnedDominoTree",
        "confident-ddtree": "treespec.policies.confident:ConfidentDDTree",
        "confident-dominotree": "treespec.policies.confident:ConfidentDominoTree",
        "gap-ddtree": "treespec.policies.gap_ddtree:GapDDTree",
        "router": "treespec.policies.router:Router",
    },
    "drafter": {
        "dflash": "treespec.drafters.dflash:DFlashDrafter",
        "domino": "treespec.drafters.domino:DominoDrafter",
        "marginal": "treespec.drafters.toy:MarginalDrafter",
        "toy-conditional": "treespec.drafters.toy:ToyConditionalDrafter",
        "oracle": "treespec.drafters.oracle:OracleDrafter",
        "checkpoint": "treespec.drafters.auto:from_checkpoint",  # a DFlash or Domino checkpoint directory, by its config
    },
    "verifier": {
        "match": "treespec.verifiers.match:MatchVerifier",
        "rejection": "treespec.verifiers.rejection:RejectionVerifier",
        "recursive-rejection": "treespec.verifiers.recursive:RecursiveRejectionVerifier",
        "traversal": "treespec.verifiers.traversal:TraversalVerifier",
    },
    "scorer": {  # RecordableScorer classes: trace replay rebuilds their recorded rounds by this name
        "domino": "treespec.drafters.domino:DominoScorer",
    },
    "recipe": {  # treespec.training.TrainingRecipe classes: how `treespec train-drafter` trains a drafter family
        "block": "treespec.drafters.training:BlockRecipe",
    },
    "command": {},  # `treespec NAME` subcommands of other packages (modules: add_arguments, run)
    "engine": {  # what runs the target (`treespec.target.Engine` classes): `--engine NAME`, DEFAULT_ENGINE by default
        "torch": "treespec.engines.torch:TargetModel",
        "llama.cpp": "treespec.engines.llama_cpp:LlamaCppTarget",
    },
}
DEFAULT_ENGINE = "torch"  # the engine a target runs on when none is named (the one place that says so)
_RUNTIME: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
_FOUND: dict[str, tuple[tuple, dict[str, Any]]] = {}  # group -> (the import path's state, its entry points)


class RegistryError(LookupError):
    """An unknown kind or name, or an entry that cannot be imported."""


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise RegistryError(f"unknown kind {kind!r}; expected one of {KINDS}")


def register(kind: str, name: str, target: Any) -> None:
    """Register ``target`` (a class, a factory, or a ``"module:attr"`` string) under ``name``."""
    _check_kind(kind)
    _RUNTIME[kind][name] = target


def _import_path_state() -> tuple:
    """What the installed entry points depend on: each folder of the import path and when it last
    changed (an install adds a ``*.dist-info`` folder to one of them)."""
    state = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            state.append((entry, None))
    return tuple(state)


def _entry_point_targets(kind: str) -> dict[str, Any]:
    """The entry points of ``kind``'s group, read again only when the import path changed (reading
    them scans every installed distribution: about 15 ms with 143 of them)."""
    group, state = _GROUPS[kind], _import_path_state()
    cached = _FOUND.get(group)
    if cached is None or cached[0] != state:
        cached = _FOUND[group] = (state, {ep.name: ep for ep in entry_points(group=group)})
    return cached[1]


def available(kind: str) -> list[str]:
    """Every name that `resolve` accepts for ``kind``, sorted."""
    _check_kind(kind)
    return sorted(set(_BUILTIN[kind]) | set(_entry_point_targets(kind)) | set(_RUNTIME[kind]))


def _import(spec: str) -> Any:
    """The object ``"module:attr.path"`` names, or the module itself for ``"module"``."""
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise RegistryError(f"cannot import {spec!r}: {exc}") from exc
    return obj


def builtin(kind: str) -> list[str]:
    """The names of ``kind`` that ship with treespec, sorted (entry points and registrations aside)."""
    _check_kind(kind)
    return sorted(_BUILTIN[kind])


def resolve(kind: str, name: str) -> Any:
    """The class or factory registered as ``name``; run-time registrations win, then entry points."""
    _check_kind(kind)
    target = _RUNTIME[kind].get(name)
    if target is None:
        ep = _entry_point_targets(kind).get(name)
        target = ep.load() if ep is not None else _BUILTIN[kind].get(name)
    if target is None:
        raise RegistryError(f"unknown {kind} {name!r}; available: {', '.join(available(kind))}")
    return _import(target) if isinstance(target, str) else target


def create(kind: str, name: str, /, **kwargs: Any) -> Any:
    """Instantiate the registered ``name`` with ``kwargs``."""
    return resolve(kind, name)(**kwargs)
