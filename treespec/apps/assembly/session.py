"""One run's assembly: the parts it decodes with, and the one place a method becomes decoders.

Contract
--------
A `Session` holds what every method of a run shares: the target, its tokenizer, the drafters (by
registered name), the cost source (``--cost-model``), this machine's cost profile (measured or read
from the cache on first need) and the run's threads.  Every app gets its policies and decoders from
it: ``session.decoder(method)`` (``batched=True``: a decoder of several sequences at once) or
``session.decoders(methods)``, and the ids a generation stops at from ``session.stop_ids``.  A
method's policy is built there and nowhere else: a cost-aware policy is priced as the cost source
says (`treespec.apps.assembly.cost_source`), a learning policy starts from what it learned over its
drafter on this machine (``treespec profile-cost --calibrate``), and ``session.close()`` (or leaving
``with session:``) writes what the live cost models measured back into the profile cache, once, at
the end of the run, unless the run was disturbed by another process or the curve is implausible
(``not_saved`` then says why).

`Session.load(model_dir, drafter_dirs)` loads the drafters first (a missing or unloadable checkpoint
fails, naming it, before the target's weights are read), then the target (the embedded SmolLM2 when
``model_dir`` is None) and its tokenizer.  A method is a `MethodSpec` or its text
(`treespec.apps.assembly.methods.parse_method`); ``drafter=`` and ``policy=`` give an instance in
place of the method's registered drafter or of the policy it would build (the API's given objects).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from treespec import registry
from treespec.apps.assembly.cost_source import CostSource, method_policy, persist_live, restore_learned
from treespec.apps.assembly.loading import (
    DEFAULT_ENGINE,
    EMBEDDED_NAME,
    eos_ids,
    load_drafter,
    load_target,
    load_tokenizer,
)
from treespec.apps.assembly.methods import MethodSpec, parse_method
from treespec.batch_decoding import BatchDecoder
from treespec.decoding import SpeculativeDecoder
from treespec.interfaces import Drafter, TreePolicy, Verifier
from treespec.pricing.conditions import ThreadControl
from treespec.pricing.cost import CostModel
from treespec.pricing.profile import CostProfile, machine_profile
from treespec.target import Target

__all__ = ["Chat", "Session"]

Method = MethodSpec | str


class Chat:
    """Prompt turns to token ids with a tokenizer's chat template, and answers back to text."""

    def __init__(self, tokenizer, *, enable_thinking: bool = False) -> None:
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking  # the Qwen3 template's switch

    def encode(self, user_turns: Sequence[str], answers: Sequence[str] = ()) -> torch.Tensor:
        from treespec.apps.data.datasets import encode_chat

        ids = encode_chat(self.tokenizer, user_turns, answers, enable_thinking=self.enable_thinking)
        return torch.tensor(ids, dtype=torch.int64)  # [P]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)


def _current_threads() -> ThreadControl:
    """The threads torch runs with now, kept as they are (a session made without the CLI's choice)."""
    return ThreadControl.keep()


@attrs.define(eq=False)
class Session:
    """What every method of a run shares, and where its policies and decoders come from."""

    target: Target  # one KV cache, reset per generation
    tokenizer: Any = None  # the target's tokenizer; None for a bare model directory (prompts as token ids)
    drafters: dict[str, Drafter] = attrs.field(factory=dict)  # registered drafter name -> drafter
    name: str = ""  # how records name the target (the embedded default's name, else its directory)
    costs: CostSource = attrs.field(factory=CostSource)  # how cost-aware policies are priced (--cost-model)
    threads: ThreadControl = attrs.field(factory=_current_threads)  # the run's threads (the CLI's choice)
    progress: bool = False  # a progress bar while the profile is measured
    profile_repeats: int = 9  # timings per point of a profile measured for this session (bench: 3)
    enable_thinking: bool = False  # Qwen3 chat templates: thinking on
    profile: CostProfile | None = None  # this machine's, measured (or read from the cache) on first need
    disturbed: int = 0  # measurements another process disturbed in this run (a run with any saves no costs)
    not_saved: str = ""  # why `close` wrote nothing (empty: it wrote, or had nothing to write)
    live_curves: list[tuple[CostModel, Drafter]] = attrs.field(factory=list, init=False)  # the cost models priced by (saved at close)
    closed: bool = attrs.field(default=False, init=False)

    @classmethod
    def load(cls, model_dir: str | Path | None, drafter_dirs: Mapping[str, str | Path] | None = None, *,
             dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu", float32_head: bool | None = None,
             tokenizer_required: bool = True, engine: str = DEFAULT_ENGINE, exact: bool | None = None,
             **fields: Any) -> Session:
        """The parts of the module docstring from local files, drafters first; ``engine`` and ``exact``: what
        runs the target and on which numeric path (`treespec.apps.assembly.loading.load_target`); ``fields``
        set the rest."""
        from treespec.apps.assembly.embedded import embedded_model_dir

        drafters = {name: load_drafter(name, path) for name, path in (drafter_dirs or {}).items()}
        path = Path(model_dir) if model_dir is not None else embedded_model_dir()
        target = load_target(path, dtype=dtype, device=device, float32_head=float32_head, engine=engine, exact=exact)
        try:
            tokenizer = load_tokenizer(path)
        except (OSError, ValueError):
            if tokenizer_required:
                raise
            tokenizer = None  # a bare model directory: prompts must come as token ids
        name = EMBEDDED_NAME if model_dir is None else str(model_dir)
        return cls(target, tokenizer, drafters, name if engine == DEFAULT_ENGINE else f"{name} on {engine}", **fields)

    # ------------------------------------------------------------------ what the run shares
    @property
    def chat(self) -> Chat:
        """The tokenizer's chat template (prompt turns to ids, answers to text)."""
        return Chat(self.tokenizer, enable_thinking=self.enable_thinking)

    @property
    def stop_ids(self) -> list[int]:
        """The ids a generation stops at: the tokenizer's EOS, else the target model's (the one rule the
        API, the CLI and the bench stop by)."""
        return eos_ids(self.tokenizer, self.target)

    def machine_profile(self) -> CostProfile:
        """This machine's cost profile of the target and every loaded drafter (measured once)."""
        if self.profile is None:
            self.profile = machine_profile(self.target, list(self.drafters.values()), repeats=self.profile_repeats,
                                           progress=self.progress, meter=self.threads.meter)
        return self.profile

    def _profile_with(self, drafter: Drafter) -> CostProfile:
        """The machine profile, measured for ``drafter`` too when it is not one of the session's."""
        if any(d is drafter for d in self.drafters.values()):
            return self.machine_profile()
        return machine_profile(self.target, [*self.drafters.values(), drafter], repeats=self.profile_repeats,
                               progress=self.progress, meter=self.threads.meter)

    # ------------------------------------------------------------------ methods to policies and decoders
    def drafter(self, method: Method) -> Drafter | None:
        """The loaded drafter ``method`` runs over (None for AR)."""
        method = _spec(method)
        if method.autoregressive:
            return None
        if method.drafter not in self.drafters:
            raise ValueError(f"method {method.name!r} needs a {method.drafter} drafter, and none was loaded")
        return self.drafters[method.drafter]

    def parts(self, method: Method, *, drafter: Drafter | None = None,
              policy: TreePolicy | None = None) -> tuple[Drafter | None, TreePolicy | None]:
        """(drafter, policy) of ``method`` (None, None for AR): the given instances, else the session's
        drafter and the method's policy, priced and started from what it learned (module docstring)."""
        method = _spec(method)
        if method.autoregressive:
            return None, None
        drafter = drafter if drafter is not None else self.drafter(method)
        if policy is not None:
            return drafter, policy
        profile = functools.cache(lambda: self._profile_with(drafter))
        built, cost = method_policy(method, drafter, self.costs, profile)
        if cost is not None:
            self.live_curves.append((cost, drafter))
        restore_learned(built, drafter, profile)
        return drafter, built

    def decoder(self, method: Method, *, batched: bool = False, drafter: Drafter | None = None,
                policy: TreePolicy | None = None, verifier: Verifier | None = None,
                **options: Any) -> SpeculativeDecoder | BatchDecoder:
        """A decoder of ``method`` over the session's target (``batched``: a `BatchDecoder`, several
        sequences at once; else a `SpeculativeDecoder`); ``options`` go to its constructor."""
        method = _spec(method)
        parts = self.parts(method, drafter=drafter, policy=policy)
        cls = BatchDecoder if batched else SpeculativeDecoder
        return cls(self.target, *parts, verifier or registry.create("verifier", method.verifier), **options)

    def decoders(self, methods: Sequence[MethodSpec], *, batched: bool = False) -> dict[str, Any]:
        """One decoder per method, by name (`decoder`)."""
        return {m.name: self.decoder(m, batched=batched) for m in methods}

    # ------------------------------------------------------------------ the end of the run
    def close(self) -> CostProfile | None:
        """Write what the live cost models learned into this machine's profile cache (once; later calls
        do nothing); nothing from a run another process disturbed (its rounds priced the load, not the
        machine) or a curve that breaks the plausibility rules: ``not_saved`` then says why."""
        if self.closed:
            return None
        self.closed = True
        if not self.costs.uses_profile or self.profile is None:
            return None
        if self.disturbed:
            self.not_saved = f"{self.disturbed} measurement(s) of this run were disturbed by another process"
            return None
        updated, self.not_saved = persist_live(self.target, self.profile, self.live_curves)
        self.profile = updated or self.profile
        return updated

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:  # a run that failed measured nothing worth keeping
            self.close()


def _spec(method: Method) -> MethodSpec:
    return parse_method(method) if isinstance(method, str) else method
