"""One call from a local model to generated text: ``treespec.generate(...)``.

Contract
--------
``generate(model, prompt, *, drafter=None, policy="ddtree", max_new_tokens=..., ...)`` loads what it is
given (local files only, never remote code) and decodes through a `treespec.apps.assembly.session.Session`,
as every command does.  Keywords follow Hugging Face ``generate`` (``max_new_tokens``, ``do_sample``,
``temperature``, ``top_k``, ``top_p``, ``stop_token_ids``), plus ``seed`` (a reproducible generator) and
``threads`` (checked as ``--threads`` is).

* ``model``: a local model directory (a GGUF file with ``engine="llama.cpp"``), a transformers causal LM,
  or a target (`treespec.target.Target`).  ``engine``: the registry's default (torch) or ``"llama.cpp"``;
  ``exact``: the engine's path where trees equal its one-token steps bit for bit (None: the engine's
  default); ``dtype``: ``"auto"`` (the faster of bf16 and fp32 here, measured once), ``"checkpoint"``, or one.
* ``prompt``: a string (the model's tokenizer or ``tokenizer=``; ``chat=True`` wraps it as one user turn)
  or token ids; a list of prompts is one batch (`treespec.batch_decoding.BatchDecoder`), each output equal
  to that prompt's own ``generate`` with the same arguments.
* ``drafter``: None (AR), a `Drafter`, a registered name (with ``drafter_kwargs``; ``"dflash"`` /
  ``"domino"`` alone: the checkpoints shipped for the embedded default) or a checkpoint directory.
* ``policy``: a `TreePolicy` or a registered name (with ``budget`` and ``policy_kwargs``); a cost-aware one
  prices its trees as ``cost_model`` says: ``"live"`` (the machine's profile corrected while decoding),
  ``"profile"``, a `CostModel`, a JSON file or ``preset:NAME`` (`treespec.apps.assembly.cost_source`).

``do_sample=False`` (default) decodes greedily; ``do_sample=True`` samples at ``temperature`` (1.0 by
default).  Contradictions are refused in one line (a temperature with ``do_sample=False``, a top-k/top-p
filter on greedy decoding); ``sampling=SamplingParams(...)`` gives all of them as one value instead
(`SamplingParams.of`).  Without ``stop_token_ids`` the tokenizer's or the config's EOS ids stop
generation; ``stop_token_ids=[]`` runs the full length.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import attrs
import torch

from treespec import registry
from treespec.apps.assembly.cost_source import CostSource
from treespec.apps.assembly.loading import load_drafter, load_target, load_tokenizer
from treespec.apps.assembly.methods import MethodSpec
from treespec.apps.assembly.session import Chat, Session
from treespec.interfaces import Drafter, SamplingParams, TreePolicy, Verifier
from treespec.pricing.conditions import ThreadControl
from treespec.pricing.cost import CostModel
from treespec.stats import GenerationStats
from treespec.registry import DEFAULT_ENGINE
from treespec.target import Target

__all__ = ["GenerateOutput", "encode_prompt", "generate"]

PathLike = str | os.PathLike
_GIVEN = "given"  # the session's name for the drafter the caller gave


@attrs.frozen(eq=False)
class GenerateOutput:
    """What `generate` returns."""

    tokens: torch.Tensor  # [n_new] int64 generated ids (prompt excluded)
    text: str | None  # the decoded tokens when a tokenizer is known, else None
    stats: GenerationStats  # per-round tau and stage times, prefill time


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


def encode_prompt(prompt: str | torch.Tensor | Iterable[int], tokenizer: Any, chat: bool = False) -> torch.Tensor:
    """[P] int64 token ids of a text prompt (in the chat template with ``chat``) or of given ids, as
    `generate` encodes it."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer: pass a model directory or tokenizer=")
        if chat:  # one user turn in the tokenizer's chat template, ending with the assistant's prompt
            return Chat(tokenizer).encode([prompt])
        return torch.tensor(tokenizer(prompt)["input_ids"], dtype=torch.int64)
    if chat:
        raise ValueError("chat=True wraps a text prompt in the chat template; token ids are used as given")
    ids = torch.as_tensor(prompt)
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"prompt token ids must be integers, got dtype {ids.dtype}")
    return ids.to(torch.int64)


def _stop_ids(stop_token_ids: Iterable[int] | int | None, session: Session) -> list[int]:
    if stop_token_ids is not None:
        return [stop_token_ids] if isinstance(stop_token_ids, int) else list(stop_token_ids)
    return session.stop_ids


def _costs(cost_model: str | CostModel | CostSource) -> CostSource:
    if isinstance(cost_model, CostSource):
        return cost_model
    if isinstance(cost_model, CostModel):
        return CostSource(live=False, fixed=cost_model, spec="given")
    return CostSource.parse(cost_model)


def _is_batch(prompt: Any) -> bool:
    """A list or tuple of prompts (strings, tensors, lists of ints), not one prompt of token ids."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(
        isinstance(p, (str, torch.Tensor, list, tuple)) for p in prompt)


def _method(policy: TreePolicy | str, budget: int | None, options: dict[str, Any], drafted: bool) -> MethodSpec:
    """The method the arguments name (AR without a drafter); a given policy instance is used as it is."""
    if not drafted:
        return MethodSpec(None, None)
    if isinstance(policy, TreePolicy):
        return MethodSpec(policy.name, _GIVEN)
    return MethodSpec(policy, _GIVEN, budget, options)


def generate(model: PathLike | Target | torch.nn.Module, prompt: str | torch.Tensor | Iterable[int], *,
             drafter: Drafter | PathLike | None = None, policy: TreePolicy | str = "ddtree",
             budget: int | None = None, verifier: Verifier | str = "match", max_new_tokens: int = 128,
             do_sample: bool = False, temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, stop_token_ids: Iterable[int] | int | None = None,
             seed: int | None = None, tokenizer: Any = None, dtype: torch.dtype | str = "auto",
             device: str | torch.device = "cpu", position_keyed: bool | None = None,
             drafter_kwargs: dict[str, Any] | None = None, policy_kwargs: dict[str, Any] | None = None,
             cost_model: str | CostModel | CostSource = "live", threads: int | None = None,
             sampling: SamplingParams | None = None, chat: bool = False,
             engine: str = DEFAULT_ENGINE, exact: bool | None = None) -> GenerateOutput | list[GenerateOutput]:
    """Generate a continuation of ``prompt``, or of each prompt of a list (see the module docstring).

    ``sampling`` (a `SamplingParams`) gives temperature, top-k, top-p and position keying as one typed
    value, in place of the Hugging Face style ``do_sample`` / ``temperature`` / ``top_k`` / ``top_p``
    (which must then be left out).  ``chat=True`` wraps each text prompt in the tokenizer's chat
    template as one user turn (an instruct model answers it; a raw prompt may get an end-of-turn
    token at once)."""
    sampling = SamplingParams.of(sampling, temperature, top_k, top_p, position_keyed,
                                 do_sample=do_sample if sampling is None or do_sample else None)
    control = ThreadControl.start(threads, reason="as asked (threads=)") if threads is not None else ThreadControl.keep()
    batch = _is_batch(prompt)
    prompts = list(prompt) if batch else [prompt]
    method = _method(policy, budget, policy_kwargs or {}, drafter is not None)  # a bad budget: refused before loading
    given = load_drafter(drafter, model=model, **(drafter_kwargs or {}))
    target = load_target(model, dtype=dtype, device=device, engine=engine, exact=exact)
    tokenizer = _tokenizer(model, tokenizer, needed=any(isinstance(p, str) for p in prompts))
    session = Session(target, tokenizer, {_GIVEN: given} if given is not None else {}, costs=_costs(cost_model),
                      threads=control)
    checker = verifier if isinstance(verifier, Verifier) else registry.create("verifier", verifier)
    fixed = policy if isinstance(policy, TreePolicy) else None
    options = {"max_new_tokens": max_new_tokens, "sampling": sampling,
               "stop_token_ids": _stop_ids(stop_token_ids, session)}
    ids = [encode_prompt(p, tokenizer, chat) for p in prompts]
    with session:  # what the live cost models measured is saved at its end
        if batch:
            generators = [torch.Generator().manual_seed(seed) if seed is not None else None for _ in ids]
            decoder = session.decoder(method, batched=True, policy=fixed, verifier=checker)
            results = decoder.generate(ids, generators=generators, **options)
        else:
            generator = torch.Generator().manual_seed(seed) if seed is not None else None
            decoder = session.decoder(method, policy=fixed, verifier=checker)
            results = [decoder.generate(ids[0], generator=generator, **options)]
    outputs = [GenerateOutput(r.tokens, tokenizer.decode(r.tokens.tolist(), skip_special_tokens=True)
                              if tokenizer is not None else None, r.stats) for r in results]
    return outputs if batch else outputs[0]
