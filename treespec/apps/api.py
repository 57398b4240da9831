"""One call from a local model to generated text: ``treespec.generate(...)``.

Contract
--------
``generate(model, prompt, *, drafter=None, policy="ddtree", max_new_tokens=..., ...)`` loads what it
is given by path (local files only, never remote code), builds a `SpeculativeDecoder` and runs it.
Keyword names follow Hugging Face ``generate``: ``max_new_tokens``, ``do_sample``, ``temperature``,
``top_k``, ``top_p``, ``stop_token_ids``, plus ``seed`` for a reproducible ``torch.Generator`` and
``threads`` for torch's CPU threads (checked as ``--threads`` is; default: as torch has them).  The run
is assembled by a `treespec.apps.assembly.session.Session`, as every command's is.

* ``model``: a local model directory (or a GGUF file, with ``engine="llama.cpp"``), a transformers causal
  LM, or a target (`treespec.target.Target`).
* ``prompt``: a string (tokenized with the model directory's tokenizer, or ``tokenizer=``; with
  ``chat=True`` wrapped in its chat template as one user turn, as ``treespec generate --chat``), or
  token ids ([P] / [1, P] tensor or a list of ints).  A list of prompts (strings, tensors or lists
  of ints) is decoded as one batch (`treespec.batch_decoding.BatchDecoder`: one target forward per
  round for all of them) and gives a list of outputs, each equal to that prompt's own ``generate``
  with the same arguments (``seed`` seeds each row's generator alike).
* ``drafter``: None (autoregressive decoding), a `Drafter`, a registered drafter name (built with
  ``drafter_kwargs``; ``"dflash"`` / ``"domino"`` alone: the checkpoints shipped for the embedded
  default, for that model only), or a local DFlash / Domino checkpoint directory.
* ``policy``: a `TreePolicy` or a registered name, built with ``budget`` (when given) and
  ``policy_kwargs``; a cost-aware one (CaDDTree, the cost-aware DominoTree) named here prices its
  trees as ``cost_model`` says: ``"live"`` (default) this machine's measured cost profile
  (`treespec.pricing.profile`, cached) corrected by the round times of this generation, which are then
  saved with the profile; ``"profile"`` the profile as measured; a `CostModel`, a JSON file or
  ``preset:NAME`` that model (`treespec.apps.assembly.cost_source`).  Ignored for autoregressive decoding.
* ``engine``: ``"torch"`` (default) runs the model's transformers modules; ``"llama.cpp"`` runs its
  GGUF file (a ``.gguf`` path, or the folder holding one; the embedded default's folder keeps its
  own) on llama.cpp through llama-cpp-python (`treespec.engines.llama_cpp`), the drafters staying
  torch modules; with ``drafter=None`` that is the engine's own AR.
* ``dtype``: ``"auto"`` (default) is the faster of bf16 and fp32 for this model on this CPU
  (measured once and cached, `treespec.pricing.hardware`), bf16 on CUDA; ``"checkpoint"`` keeps the
  stored dtype.

``do_sample=False`` (the default) decodes greedily, as in Hugging Face; ``do_sample=True`` samples at
``temperature`` (default 1.0, > 0).  What the two would contradict is refused in one line, never
dropped silently (Hugging Face only warns): a temperature > 0 without ``do_sample=True``, a top-k or
top-p filter on greedy decoding, a temperature that is not a number >= 0.  ``sampling=SamplingParams(...)``
gives them as one typed value instead; with it, the loose keywords must be left out
(`SamplingParams.of`, the one rule, which the CLI's flags pass through too).  Without
``stop_token_ids``, the tokenizer's or the config's EOS ids stop generation; pass ``stop_token_ids=[]``
to run the full length.
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
             engine: str = DEFAULT_ENGINE) -> GenerateOutput | list[GenerateOutput]:
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
    target = load_target(model, dtype=dtype, device=device, engine=engine)
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
