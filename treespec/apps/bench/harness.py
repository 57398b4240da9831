"""What every method of a bench run shares: the target, the drafters, the chat template, the costs.

Contract
--------
`Harness` holds one `TargetModel`, one drafter per kind ("dflash", "domino", reached through the
registry by `load_harness`) and a `Chat` (prompt turns to ids with the tokenizer's template).
``decoders(methods)`` gives one `SpeculativeDecoder` per method over the shared target; a policy
that declares ``uses_cost_model`` is priced as the harness's `CostSource` says (by default its own
live cost model over this machine's profile), and ``persist_live`` writes what those models learned
back into the profile cache at the end of a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

from treespec import registry
from treespec.apps.cost_source import CostSource, method_policy, persist_live, restore_learned
from treespec.apps.datasets import encode_chat
from treespec.apps.methods import MethodSpec
from treespec.batch_decoding import BatchDecoder
from treespec.decoding import SpeculativeDecoder
from treespec.interfaces import Drafter, TreePolicy
from treespec.pricing.conditions import ThreadChoice, ThreadControl
from treespec.pricing.cost import CostModel
from treespec.pricing.profile import CostProfile, machine_profile
from treespec.target import TargetModel

__all__ = ["Chat", "Harness", "load_harness"]


class Chat:
    """Prompt turns to token ids with a tokenizer's chat template, and answers back to text."""

    def __init__(self, tokenizer, *, enable_thinking: bool = False) -> None:
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking  # the Qwen3 template's switch

    def encode(self, user_turns: Sequence[str], answers: Sequence[str]) -> torch.Tensor:
        ids = encode_chat(self.tokenizer, user_turns, answers, enable_thinking=self.enable_thinking)
        return torch.tensor(ids, dtype=torch.int64)  # [P]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    @property
    def stop_ids(self) -> list[int]:
        from treespec.apps.models import eos_ids

        return eos_ids(self.tokenizer)


@attrs.define
class Harness:
    """What every method of a run shares: the target, the drafters, the chat template, the costs."""

    target: TargetModel  # one KV cache, reset per generation
    chat: Chat  # prompt encoding
    drafters: dict[str, Drafter] = attrs.field(factory=dict)  # registered drafter name -> drafter
    costs: CostSource = attrs.field(factory=CostSource)  # how cost-aware policies are priced (--cost-model)
    profile: CostProfile | None = None  # this machine's, measured (or read from the cache) on first need
    progress: bool = False  # progress bar while the profile is measured
    priced: list[tuple[CostModel, Drafter]] = attrs.field(factory=list)  # every policy priced, with its drafter
    threads: ThreadControl = attrs.field(factory=lambda: ThreadControl(
        ThreadChoice(torch.get_num_threads(), "torch's count"), fixed=True))  # chosen by the CLI from free cores
    disturbed: int = 0  # measurements another process disturbed in this run (a run with any saves no costs)
    not_saved: str = ""  # why persist_live wrote nothing (empty: it wrote, or was not asked)

    def decoders(self, methods: Sequence[MethodSpec]) -> dict[str, SpeculativeDecoder]:
        """One decoder per method over the shared target (AR: no drafter, no policy)."""
        return {m.name: self._decoder(m) for m in methods}

    def batch_decoders(self, methods: Sequence[MethodSpec]) -> dict[str, BatchDecoder]:
        """One batched decoder per method, with the drafter and policy `decoders` gives it."""
        return {m.name: BatchDecoder(self.target, *self._parts(m), registry.create("verifier", m.verifier))
                for m in methods}

    def machine_profile(self) -> CostProfile:
        """This machine's cost profile of the target and every loaded drafter."""
        if self.profile is None:
            self.profile = machine_profile(self.target, list(self.drafters.values()), repeats=3,
                                           progress=self.progress)
        return self.profile

    def persist_live(self) -> CostProfile | None:
        """Write what the live cost models learned into this machine's profile cache (end of a run);
        nothing from a run another process disturbed (its rounds priced the load, not the machine) or
        a curve that breaks the plausibility rules; ``not_saved`` then says why."""
        if not self.costs.uses_profile or self.profile is None:
            return None
        if self.disturbed:
            self.not_saved = f"{self.disturbed} measurement(s) of this run were disturbed by another process"
            return None
        updated, self.not_saved = persist_live(self.target, self.profile, self.priced)
        self.profile = updated or self.profile
        return updated

    def _decoder(self, method: MethodSpec) -> SpeculativeDecoder:
        return SpeculativeDecoder(self.target, *self._parts(method), registry.create("verifier", method.verifier))

    def _parts(self, method: MethodSpec) -> tuple[Drafter | None, TreePolicy | None]:
        """The method's drafter and policy (None, None for AR); a cost-aware policy priced on this machine."""
        if method.autoregressive:
            return None, None
        if method.drafter not in self.drafters:
            raise ValueError(f"method {method.name!r} needs a {method.drafter} drafter, and none was loaded")
        drafter = self.drafters[method.drafter]
        policy, cost = method_policy(method, drafter, self.costs, self.machine_profile)
        if cost is not None:
            self.priced.append((cost, drafter))
        restore_learned(policy, drafter, self.machine_profile)
        return drafter, policy


def load_harness(model_dir: str | Path, drafter_dirs: dict[str, str | Path], *, dtype: torch.dtype | str = "auto",
                 device: str | torch.device = "cpu", float32_head: bool | None = None) -> Harness:
    """The target, its tokenizer and the drafters ("dflash" / "domino" -> checkpoint), from local files."""
    from treespec.apps.loading import Parts

    parts = Parts.load(model_dir, drafter_dirs, dtype=dtype, device=device, float32_head=float32_head)
    return Harness(parts.target, Chat(parts.tokenizer), dict(parts.drafters))
