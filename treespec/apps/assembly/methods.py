"""Named decoding methods for A/B runs: which drafter feeds which policy at which budget.

Contract
--------
A method string is ``POLICY[@BUDGET][+KEY=VALUE...][:DRAFTER][/VERIFIER]`` or one of the aliases below;
`parse_method` turns it into a `MethodSpec`, whose name is made from its fields again (`method_name`),
never parsed back.  Each method names the registered drafter it runs over (by default the one of the
role its policy needs: "dflash" for factorized policies, "domino" for conditional ones; None for
autoregressive decoding), so one harness can run every method of a comparison over the same target
and drafters:

* ``ar``: autoregressive decoding (a root-only tree each round).
* ``dflash``: the chain over the DFlash drafter (the DFlash decoder).
* ``domino``: the chain over the Domino drafter (greedy GRU rollout: the Domino decoder).
  Any registered drafter's name alone is the chain over it.
* ``POLICY[@B]``: any registered policy; over the default drafter of the role it needs
  (`DEFAULT_DRAFTERS`: Domino when the policy declares that it needs a scorer, ``uses_scorer =
  "required"``: DominoTree, static-corrected, the cost-aware DominoTree; otherwise DFlash);
  ``POLICY@B:NAME`` runs it over any registered drafter (a marginal drafter cannot feed a policy
  that needs a scorer, and is refused by name), and
  ``+KEY=VALUE`` sets one of the policy's own fields (``eagle2@16+topk=4``), typed by the field's
  default and refused, naming the policy's options, when it has no such field.
* ``/VERIFIER`` names the registered verifier that checks the method's trees (default ``match``),
  e.g. ``ddtree-sampled@16/recursive-rejection``; AR and the chains take one too.

A policy that declares ``uses_cost_model`` gets the machine's cost model from `build_policy`'s
caller (the harness measures it, `treespec.pricing.profile`), never a built-in preset.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from treespec import registry
from treespec.decoding import PolicyError
from treespec.interfaces import TreePolicy
from treespec.pricing.calibration import Calibration, to_calibration
from treespec.pricing.cost import CostModel
from treespec.tree import check_budget

__all__ = ["DEFAULT_DRAFTERS", "DEMO_METHODS", "MethodSpec", "build_policy", "default_drafter", "drafter_names",
           "drafter_role", "method_name", "naming", "needed_role", "parse_method", "policy_class", "prices_trees", "with_budget",
           "with_options"]

# The drafter a method runs over when it names none, by what its policy needs (its ``uses_scorer``).
DEFAULT_DRAFTERS = {"marginal": "dflash", "conditional": "domino"}

# The comparison of the README's demo: the published systems on the embedded default.
DEMO_METHODS = ("ar", "dflash", "domino", "ddtree@16", "caddtree@16", "dominotree@16", "cost-aware-dominotree@16")


@attrs.frozen
class MethodSpec:
    """One decoding method of a comparison, as fields; its name is derived from them (`method_name`)."""

    policy: str | None  # registry policy name ("chain" for a drafter's own chain; None: autoregressive)
    drafter: str | None  # registered drafter name it runs over (None: autoregressive)
    budget: int | None = attrs.field(default=None, validator=lambda _, __, value: value is None or check_budget(value))
    # tree budget (None: the policy's default); the one check of a method's budget, wherever it comes from
    options: Mapping[str, Any] = attrs.field(factory=dict)  # extra policy keyword arguments, typed
    verifier: str = "match"  # registered verifier that checks the trees

    @property
    def name(self) -> str:
        """The display name, the form `parse_method` reads: ``ddtree@16``, ``eagle2@8+topk=4:domino``."""
        return method_name(self.policy, self.drafter, self.budget, self.options, self.verifier)

    @property
    def family(self) -> str:
        """The name with the budget taken out (``ddtree:domino``, ``eagle2+topk=4``): the line of a
        budget curve, which keeps options, drafters and verifiers apart."""
        return method_name(self.policy, self.drafter, None, self.options, self.verifier)

    @property
    def autoregressive(self) -> bool:
        return self.policy is None

    @property
    def cost_aware(self) -> bool:
        """Whether the method's policy prices its trees (declares ``uses_cost_model``)."""
        return self.policy is not None and prices_trees(self.policy)


def method_name(policy: str | None, drafter: str | None, budget: int | None = None,
                options: Mapping[str, Any] | None = None, verifier: str = "match") -> str:
    """The name of a method from its fields: ``ar``, a drafter's name alone for its chain, else
    ``POLICY[@B][+K=V...][:DRAFTER]`` with the drafter left out when it is the default of the role the
    policy needs; ``/VERIFIER`` unless it is ``match``.  The one place a name is made."""
    if policy is None or policy == "ar":
        head = "ar"
    elif policy == "chain" and drafter:
        head = drafter
    else:
        head = policy + (f"@{budget}" if budget is not None else "")
        head += "".join(f"+{k}={_option_text(v)}" for k, v in (options or {}).items())
        if drafter and drafter != default_drafter(policy):
            head += f":{drafter}"
    return head + (f"/{verifier}" if verifier and verifier != "match" else "")


def _option_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def needed_role(policy: str) -> str:
    """The drafter role the registered ``policy`` needs: "conditional" when it declares that it needs
    a scorer (``uses_scorer = "required"``), else "marginal"."""
    return "conditional" if policy_class(policy).uses_scorer == "required" else "marginal"


def default_drafter(policy: str) -> str | None:
    """The drafter a method over ``policy`` runs on when it names none (None for a policy that is not
    registered, e.g. one of an imported published record)."""
    return DEFAULT_DRAFTERS[needed_role(policy)] if policy in registry.available("policy") else None


def with_budget(method: MethodSpec, budget: int) -> MethodSpec:
    """``method`` at tree budget ``budget``."""
    try:
        return attrs.evolve(method, budget=budget)
    except ValueError as exc:
        raise ValueError(f"{method.name}: {exc}") from None


def with_options(method: MethodSpec, options: Mapping[str, str]) -> MethodSpec:
    """``method`` with more options given as text (typed and checked as `parse_method` does); options
    it sets already are kept as they are."""
    extra = {k: _option_value(method.policy, k, v) for k, v in options.items() if k not in method.options}
    return attrs.evolve(method, options={**method.options, **extra})


def _option_value(policy: str, key: str, text: str) -> Any:
    """``text`` as the type of the policy's field ``key`` (its default's type; bool, int, float, str),
    checked by the field's own validator (`_checked`), so a bad value is refused while the method
    string is parsed, before anything loads."""
    value = _typed_option(policy, key, text)
    field = attrs.fields_dict(policy_class(policy))[key]
    return _checked(policy, field, value, text)


def _checked(policy: str, field: attrs.Attribute, value: Any, text: str) -> Any:
    """``value`` after the field's validator passed it; a validator that reads the instance (a rule
    between fields) is left to the policy's construction."""
    if field.validator is None:
        return value
    try:
        field.validator(None, field, value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{policy} option {field.name}={text!r}: {exc}") from None
    except AttributeError:
        pass
    return value


def _typed_option(policy: str, key: str, text: str) -> Any:
    """``text`` as the type of the policy's field ``key``."""
    cls = policy_class(policy)
    fields = attrs.fields_dict(cls) if attrs.has(cls) else {}
    settable = {n for n, f in fields.items()
                if f.init and n not in ("budget", "cost_model", "stop") and f.metadata.get("option", True)}
    if key not in settable:
        raise ValueError(f"{policy} has no option {key!r}; its options: {', '.join(sorted(settable)) or 'none'}")
    default = fields[key].default
    default = None if isinstance(default, attrs.Factory) else default
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError("expected true or false")
            return text.lower() in ("true", "1")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if default is None:  # an optional field: a number if it reads as one
            return int(text) if text.lstrip("-").isdigit() else float(text) if _is_float(text) else text
        return text
    except ValueError as exc:
        raise ValueError(f"{policy} option {key}={text!r}: not a valid {type(default).__name__} ({exc})") from None


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _options(policy: str, parts: list[str], text: str) -> dict[str, Any]:
    """``K=V`` parts of a method string -> the policy's typed keyword arguments (checked against its fields)."""
    options = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or not key or not value:
            raise ValueError(f"method {text!r}: an option is KEY=VALUE, got {part!r}")
        if key in options:
            raise ValueError(f"method {text!r}: option {key!r} given twice")
        options[key] = _option_value(policy, key, value)
    return options


def parse_method(text: str) -> MethodSpec:
    """``ar`` | ``dflash`` | ``domino`` | ``POLICY[@BUDGET][+KEY=VALUE...][:DRAFTER]``, each optionally
    followed by ``/VERIFIER`` -> `MethodSpec`.

    Options set the policy's own fields, typed by their defaults and checked against them
    (``eagle2@16+topk=4``, ``sequoia@32+depth=4``); ``+``, ``=`` and ``/`` need no quoting in a shell
    and keep the comma free for method lists."""
    text = text.strip()
    head, slash, verifier = text.partition("/")
    if slash and verifier not in registry.available("verifier"):
        raise ValueError(f"method {text!r}: unknown verifier {verifier!r}; available: "
                         f"{', '.join(registry.available('verifier'))}")
    return attrs.evolve(_parse_head(head, text), verifier=verifier or "match")


def _parse_head(head: str, text: str) -> MethodSpec:
    """The method ``head`` names (everything before ``/VERIFIER``); errors quote the whole ``text``."""
    if head == "ar":
        return MethodSpec(None, None)
    names = drafter_names()
    if head in names:
        return MethodSpec("chain", head)  # a drafter alone: the chain over it (its own decoder)
    spec, _, drafter = head.partition(":")
    spec, *option_parts = spec.split("+")
    policy, _, budget = spec.partition("@")
    if drafter and drafter not in names:
        raise ValueError(f"method {text!r}: unknown drafter {drafter!r}; available: {', '.join(names)}")
    if policy not in registry.available("policy"):
        raise ValueError(f"method {text!r}: unknown policy {policy!r}; available: "
                         f"{', '.join(registry.available('policy'))}")
    if drafter and needed_role(policy) == "conditional" and drafter_role(drafter) == "marginal":
        raise ValueError(f"method {text!r}: {policy} needs a conditional drafter (one whose drafts carry a "
                         f"ConditionalScorer); {drafter} is marginal")
    number = (int(budget) if budget.isdigit() else budget) if budget else None
    try:
        return MethodSpec(policy, drafter or default_drafter(policy), number, _options(policy, option_parts, text))
    except ValueError as exc:
        raise ValueError(f"method {text!r}: {exc}") from None


def drafter_names() -> list[str]:
    """Registered drafters that a method can name: the classes (which declare a ``role``)."""
    return [n for n in registry.available("drafter") if isinstance(registry.resolve("drafter", n), type)]


def drafter_role(name: str) -> str | None:
    """The registered drafter's ``role`` ("marginal" / "conditional"; None: decided per instance)."""
    role = getattr(registry.resolve("drafter", name), "role", "marginal")
    return role if isinstance(role, str) else None


def prices_trees(policy: str) -> bool:
    """Whether the registered policy ``policy`` declares ``uses_cost_model`` (needs a cost model):
    the one place the apps ask."""
    return bool(getattr(policy_class(policy), "uses_cost_model", False))


@contextlib.contextmanager
def naming(method: MethodSpec) -> Iterator[None]:
    """Within it, a policy's error (`treespec.decoding.PolicyError`) names ``method`` too: bench, replay
    and draw build every method's trees inside one."""
    try:
        yield
    except PolicyError as exc:
        raise PolicyError(f"method {method.name}: {exc}") from exc


def policy_class(name: str) -> type[TreePolicy]:
    """The registered policy class (or factory) of ``name``."""
    return registry.resolve("policy", name)


def build_policy(method: MethodSpec, cost_model: CostModel | None = None,
                 calibration: Calibration | float | None = None) -> TreePolicy | None:
    """The method's policy instance (None for AR); ``cost_model`` and the drafter's ``calibration``
    go to a policy that uses a cost model."""
    if method.autoregressive:
        return None
    kwargs = dict(method.options)
    if method.budget is not None:
        kwargs["budget"] = method.budget
    if method.cost_aware and "cost_model" not in kwargs:
        kwargs["cost_model"] = cost_model
        calibration = None if calibration is None else to_calibration(calibration)
        if calibration is not None and not calibration.identity:
            kwargs.setdefault("calibration", calibration)
    try:
        return registry.create("policy", method.policy, **kwargs)
    except (ValueError, TypeError) as exc:  # a field's own check: name the method it came from
        raise ValueError(f"method {method.name!r}: {exc}") from exc
