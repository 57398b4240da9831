"""Named decoding methods for A/B runs: which drafter feeds which policy at which budget.

Contract
--------
A method string is ``POLICY[@BUDGET]`` or one of the aliases below; `parse_method` turns it into a
`Method`.  Each method names the kind of drafter it needs ("dflash" for factorized policies,
"domino" for conditional ones, None for autoregressive decoding), so one harness can run every
method of a comparison over the same target with the same two drafters:

* ``ar``: autoregressive decoding (a root-only tree each round).
* ``dflash``: the chain over the DFlash drafter (the DFlash decoder).
* ``domino``: the chain over the Domino drafter (greedy GRU rollout: the Domino decoder).
* ``POLICY[@B]``: any registered policy; over Domino when the policy declares that it needs a
  scorer (``uses_scorer = "required"``: DominoTree, static-corrected, the cost-aware DominoTree),
  otherwise over DFlash; ``POLICY@B:domino`` / ``:dflash`` picks the drafter explicitly.

A policy that declares ``uses_cost_model`` gets the machine's cost model from `build_policy`'s
caller (the harness measures it, `treespec.profile`), never a built-in preset.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from treespec import registry
from treespec.cost import CostModel
from treespec.interfaces import TreePolicy

__all__ = ["DEMO_METHODS", "Method", "build_policy", "embedded_drafter_dir", "parse_method", "policy_class", "with_budget"]

# The comparison of the README's demo: the published systems on the embedded default.
DEMO_METHODS = ("ar", "dflash", "domino", "ddtree@16", "caddtree@16", "dominotree@16", "cost-aware-dominotree@16")


@attrs.frozen
class Method:
    """One decoding method of a comparison."""

    name: str  # display name, as given
    policy: str | None  # registry policy name (None: autoregressive)
    drafter: str | None  # "dflash" or "domino" (None: autoregressive)
    budget: int | None = None  # tree budget (None: the policy's default)
    options: Mapping[str, Any] = attrs.field(factory=dict)  # extra policy keyword arguments

    @property
    def autoregressive(self) -> bool:
        return self.policy is None


def with_budget(method: Method, budget: int) -> Method:
    """``method`` at tree budget ``budget``, named as `parse_method` would name ``POLICY@B[:DRAFTER]``."""
    spec, sep, drafter = method.name.partition(":")
    return attrs.evolve(method, name=f"{spec.partition('@')[0]}@{budget}{sep}{drafter}", budget=budget)


def parse_method(text: str) -> Method:
    """``ar`` | ``dflash`` | ``domino`` | ``POLICY[@BUDGET][:DRAFTER]`` -> `Method`."""
    text = text.strip()
    if text == "ar":
        return Method(text, None, None)
    if text in ("dflash", "domino"):
        return Method(text, "chain", text)
    spec, _, drafter = text.partition(":")
    policy, _, budget = spec.partition("@")
    if budget and not budget.isdigit():
        raise ValueError(f"method {text!r}: budget must be a positive integer, got {budget!r}")
    if drafter not in ("", "dflash", "domino"):
        raise ValueError(f"method {text!r}: drafter must be 'dflash' or 'domino', got {drafter!r}")
    if budget and int(budget) < 1:
        raise ValueError(f"method {text!r}: budget must be a positive integer, got {budget!r}")
    if policy not in registry.available("policy"):
        raise ValueError(f"method {text!r}: unknown policy {policy!r}; available: "
                         f"{', '.join(registry.available('policy'))}")
    kind = drafter or ("domino" if policy_class(policy).uses_scorer == "required" else "dflash")
    return Method(text, policy, kind, int(budget) if budget else None)


def policy_class(name: str) -> type[TreePolicy]:
    """The registered policy class (or factory) of ``name``."""
    return registry.resolve("policy", name)


def build_policy(method: Method, cost_model: CostModel | None = None, calibration: float = 1.0) -> TreePolicy | None:
    """The method's policy instance (None for AR); ``cost_model`` and the drafter's ``calibration``
    go to a policy that uses a cost model."""
    if method.autoregressive:
        return None
    kwargs = dict(method.options)
    if method.budget is not None:
        kwargs["budget"] = method.budget
    if getattr(policy_class(method.policy), "uses_cost_model", False) and "cost_model" not in kwargs:
        kwargs["cost_model"] = cost_model
        if calibration != 1.0:
            kwargs.setdefault("calibration", calibration)
    return registry.create("policy", method.policy, **kwargs)


def embedded_drafter_dir(kind: str) -> Path:
    """Directory of the drafter shipped for the embedded SmolLM2 target ("dflash" or "domino")."""
    if kind not in ("dflash", "domino"):
        raise ValueError(f"embedded drafters are 'dflash' and 'domino', got {kind!r}")
    return Path(__file__).resolve().parents[1] / "assets" / f"smollm2-135m-instruct-{kind}"
