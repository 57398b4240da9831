"""One call from a local model to generated text: ``treespec.generate(...)``.

Contract
--------
``generate(model, prompt, *, drafter=None, policy="ddtree", max_new_tokens=..., ...)`` loads what it
is given by path (local files only, never remote code), builds a `SpeculativeDecoder` and runs it.
Keyword names follow Hugging Face ``generate``: ``max_new_tokens``, ``do_sample``, ``temperature``,
``top_k``, ``top_p``, ``eos_token_id`` / ``stop_token_ids``, plus ``seed`` for a reproducible
``torch.Generator``.

* ``model``: a local model directory, a transformers causal LM, or a `TargetModel`.
* ``prompt``: a string (tokenized with the model directory's tokenizer, or ``tokenizer=``; with
  ``chat=True`` wrapped in its chat template as one user turn, as ``treespec generate --chat``), or
  token ids ([P] / [1, P] tensor or a list of ints).  A list of prompts (strings, tensors or lists
  of ints) is decoded as one batch (`treespec.batch_decoding.BatchDecoder`: one target forward per
  round for all of them) and gives a list of outputs, each equal to that prompt's own ``generate``
  with the same arguments (``seed`` seeds each row's generator alike).
* ``drafter``: None (autoregressive decoding), a `Drafter`, a registered drafter name (built with
  ``drafter_kwargs``), or a local DFlash / Domino checkpoint directory.
* ``policy``: a `TreePolicy` or a registered name, built with ``budget`` (when given) and
  ``policy_kwargs``; a cost-aware one (CaDDTree, the cost-aware DominoTree) named here prices its
  trees as ``cost_model`` says: ``"live"`` (default) this machine's measured cost profile
  (`treespec.pricing.profile`, cached) corrected by the round times of this generation, which are then
  saved with the profile; ``"profile"`` the profile as measured; a `CostModel`, a JSON file or
  ``preset:NAME`` that model (`treespec.apps.cost_source`).  Ignored for autoregressive decoding.
* ``dtype``: ``"auto"`` (default) is the faster of bf16 and fp32 for this model on this CPU
  (measured once and cached, `treespec.pricing.hardware`), bf16 on CUDA; ``"checkpoint"`` keeps the
  stored dtype.

``do_sample=False`` (the default) decodes greedily whatever ``temperature`` says, as in Hugging Face;
``do_sample=True`` needs ``temperature > 0``.  Without ``stop_token_ids``, the tokenizer's or the
config's EOS ids stop generation; pass ``stop_token_ids=[]`` to run the full length.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch

from treespec import registry
from treespec.apps.cost_source import CostSource, method_policy, persist_live, restore_learned
from treespec.apps.datasets import encode_chat
from treespec.apps.loading import load_drafter, load_target, load_tokenizer
from treespec.apps.methods import MethodSpec
from treespec.batch_decoding import BatchDecoder
from treespec.decoding import SpeculativeDecoder
from treespec.interfaces import Drafter, SamplingParams, TreePolicy, Verifier
from treespec.pricing.cost import CostModel
from treespec.stats import GenerationStats
from treespec.target import TargetModel
from treespec.tree import check_budget

__all__ = ["GenerateOutput", "generate"]

PathLike = str | os.PathLike


@attrs.frozen(eq=False)
class GenerateOutput:
    """What `generate` returns."""

    tokens: torch.Tensor  # [n_new] int64 generated ids (prompt excluded)
    text: str | None  # the decoded tokens when a tokenizer is known, else None
    stats: GenerationStats  # per-round tau and stage times, prefill time


def _policy(policy: TreePolicy | str, budget: int | None, kwargs: dict[str, Any], target: TargetModel,
            drafter: Drafter, costs: CostSource) -> tuple[TreePolicy, Callable[[], None]]:
    """The policy, and what to call once it has decoded: a cost-aware one by name is priced as ``costs``
    says (by default its own live model over this machine's profile, `treespec.apps.cost_source`), and what
    the live model learned is then saved with the profile."""
    if isinstance(policy, TreePolicy):
        return policy, lambda: None
    from treespec.pricing.profile import machine_profile

    spec = MethodSpec(policy, None, None if budget is None else check_budget(budget, "generate"), kwargs)
    profile = functools.cache(lambda: machine_profile(target, [drafter]))  # measured once, if pricing asks
    built, cost = method_policy(spec, drafter, costs, profile)
    restore_learned(built, drafter, profile)
    if cost is None or not costs.uses_profile:
        return built, lambda: None
    return built, lambda: persist_live(target, profile(), [(cost, drafter)])


def _tokenizer(model: Any, tokenizer: Any, needed: bool) -> Any:
    """The given tokenizer, or the model directory's; a directory without one is fine for token ids."""
    if tokenizer is not None or not isinstance(model, (str, os.PathLike)):
        return tokenizer
    try:
        return load_tokenizer(model)
    except ValueError:
        if needed:
            raise
        return None


def _input_ids(prompt: str | torch.Tensor | Iterable[int], tokenizer: Any, chat: bool) -> torch.Tensor:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer: pass a model directory or tokenizer=")
        if chat:  # one user turn in the tokenizer's chat template, ending with the assistant's prompt
            return torch.tensor(encode_chat(tokenizer, [prompt]), dtype=torch.int64)
        return torch.tensor(tokenizer(prompt)["input_ids"], dtype=torch.int64)
    if chat:
        raise ValueError("chat=True wraps a text prompt in the chat template; token ids are used as given")
    ids = torch.as_tensor(prompt)
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"prompt token ids must be integers, got dtype {ids.dtype}")
    return ids.to(torch.int64)


def _stop_ids(stop_token_ids: Iterable[int] | int | None, tokenizer: Any, target: TargetModel) -> list[int]:
    if stop_token_ids is not None:
        return [stop_token_ids] if isinstance(stop_token_ids, int) else list(stop_token_ids)
    from treespec.apps.models import eos_ids

    return eos_ids(tokenizer, target.config)


def _sampling(sampling: SamplingParams | None, do_sample: bool, temperature: float, top_k: int, top_p: float,
              position_keyed: bool) -> SamplingParams:
    """The one typed sampling value: ``sampling`` as given, or built from the Hugging Face style flags."""
    if sampling is not None:
        if (do_sample, temperature, top_k, top_p, position_keyed) != (False, 1.0, 0, 1.0, True):
            raise ValueError("give either sampling=SamplingParams(...) or do_sample/temperature/top_k/top_p/"
                             "position_keyed, not both")
        return sampling
    if do_sample and temperature <= 0.0:
        raise ValueError(f"do_sample=True needs temperature > 0, got {temperature}")
    return SamplingParams(temperature if do_sample else 0.0, top_k, top_p, position_keyed)


def _is_batch(prompt: Any) -> bool:
    """A list or tuple of prompts (strings, tensors, lists of ints), not one prompt of token ids."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(
        isinstance(p, (str, torch.Tensor, list, tuple)) for p in prompt)


def generate(model: PathLike | TargetModel | torch.nn.Module, prompt: str | torch.Tensor | Iterable[int], *,
             drafter: Drafter | PathLike | None = None, policy: TreePolicy | str = "ddtree",
             budget: int | None = None, verifier: Verifier | str = "match", max_new_tokens: int = 128,
             do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             stop_token_ids: Iterable[int] | int | None = None, eos_token_id: Iterable[int] | int | None = None,
             seed: int | None = None, tokenizer: Any = None, dtype: torch.dtype | str = "auto",
             device: str | torch.device = "cpu", backend: str = "torch", position_keyed: bool = True,
             drafter_kwargs: dict[str, Any] | None = None, policy_kwargs: dict[str, Any] | None = None,
             cost_model: str | CostModel | CostSource = "live",
             sampling: SamplingParams | None = None, chat: bool = False) -> GenerateOutput | list[GenerateOutput]:
    """Generate a continuation of ``prompt``, or of each prompt of a list (see the module docstring).

    ``sampling`` (a `SamplingParams`) gives temperature, top-k, top-p and position keying as one typed
    value, in place of the Hugging Face style ``do_sample`` / ``temperature`` / ``top_k`` / ``top_p``
    (which must then be left at their defaults).  ``chat=True`` wraps each text prompt in the
    tokenizer's chat template as one user turn (an instruct model answers it; a raw prompt may get
    an end-of-turn token at once)."""
    sampling = _sampling(sampling, do_sample, temperature, top_k, top_p, position_keyed)
    batch = _is_batch(prompt)
    prompts = list(prompt) if batch else [prompt]
    target = load_target(model, dtype=dtype, device=device)
    tokenizer = _tokenizer(model, tokenizer, needed=any(isinstance(p, str) for p in prompts))
    draft_model = load_drafter(drafter, **(drafter_kwargs or {}))
    costs = cost_model if isinstance(cost_model, CostSource) else (
        CostSource(live=False, fixed=cost_model, spec="given") if isinstance(cost_model, CostModel)
        else CostSource.parse(cost_model))
    tree_policy, decoded = (_policy(policy, budget, policy_kwargs or {}, target, draft_model, costs)
                            if draft_model is not None else (None, lambda: None))
    checker = verifier if isinstance(verifier, Verifier) else registry.create("verifier", verifier)
    stops = _stop_ids(stop_token_ids if stop_token_ids is not None else eos_token_id, tokenizer, target)
    options = {"max_new_tokens": max_new_tokens, "sampling": sampling, "stop_token_ids": stops, "backend": backend}
    ids = [_input_ids(p, tokenizer, chat) for p in prompts]
    if batch:
        generators = [torch.Generator().manual_seed(seed) if seed is not None else None for _ in ids]
        results = BatchDecoder(target, draft_model, tree_policy, checker).generate(ids, generators=generators, **options)
    else:
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        results = [SpeculativeDecoder(target, draft_model, tree_policy, checker).generate(ids[0], generator=generator,
                                                                                        **options)]
    decoded()
    outputs = [GenerateOutput(r.tokens, tokenizer.decode(r.tokens.tolist(), skip_special_tokens=True)
                              if tokenizer is not None else None, r.stats) for r in results]
    return outputs if batch else outputs[0]
