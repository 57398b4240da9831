"""The target model: any Hugging Face causal LM, driven as a tree verifier over a KV cache.

Contract
--------
`TargetModel` owns one sequence's KV cache (a transformers `DynamicCache`).  ``length`` is the
number of committed tokens whose keys/values are cached; the decoder keeps exactly one committed
token, the tree's root, outside the cache.

* ``prefill(input_ids, taps)`` starts a new sequence: it runs the tokens and caches them.
* ``forward_tree(tree, taps)`` runs every node of a `DraftTree` in one forward on top of the cache,
  with the tree's 4D additive mask (each node sees the cached prefix, its ancestors and itself) and
  position ids ``length + depth``, both passed as arguments to the model call.  Row i of the
  logits is the target's next-token distribution after node i's root-to-node path.
* ``commit(accepted)`` keeps the K/V rows of the accepted nodes (root first, a root-to-node path),
  moves them into place right after the prefix and drops the rest of the tree's rows, so the cache
  again equals a plain prefill of the committed tokens; ``drop_tree()`` drops them all.

`Target` is what the decoding loop, the cost profile and the drafters call on a target, whatever
runs it; `TargetModel` is the torch engine's, and each engine (this one included) is a registry entry
of kind ``"engine"`` whose class implements `Engine` (how the apps load it).  The drafters and the
dtype probe read a target's `ModelShapes`, never a transformers config.

Hidden-state taps: tap t is ``hidden_states[t]`` of the model (0 = embedding output, t = output of
decoder layer t, the last one after the final norm, as transformers returns it); the taps are
concatenated on the last dim, giving features of shape ``[n, len(taps) * hidden_size]``.

Reduced precision: for a bf16/fp16 model, ``float32_head`` (default on) runs the final norm and
the LM head in float32: the model's own norm module on float32 input, then the head on a float32
copy of its weight (the trunk stays in the model's dtype; a tied embedding stays as it is).  A
bf16 logit has 8 bits of mantissa, so two candidates within about 0.4% of each other often tie
exactly; float32 logits make a tie between AR's and a tree's forward rare.  The swap is made once
on the model passed in (``model.get_output_embeddings()`` then returns the float32 head), so the
logits are float32 and the last tap (after the final norm) too.

Attention: the custom 4D mask needs the ``eager`` or ``sdpa`` implementation (``from_local``
loads with sdpa); sliding-window layers are refused because one mask serves every layer.
Overflowing ``max_positions`` raises `ContextOverflowError` before the model is called.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from treespec.tree import DraftTree

__all__ = ["DTYPE_NAMES", "ROUNDING_GAP", "SUPPORTED_ATTENTION", "ContextOverflowError", "Engine", "EngineUnavailable", "Float32Head",
           "Float32Norm", "ModelShapes", "NonFiniteLogits", "Target", "TargetModel", "TargetOutput", "check_device",
           "check_finite", "crop_cache",
           "select_taps", "spread_layers", "tap_features", "use_float32_head"]

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float64": torch.float64}


def reduced_precision(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a 16-bit float (bf16 or fp16): where the kernels' float32 paths apply."""
    return dtype in (torch.bfloat16, torch.float16)


def stored_dtype(config) -> torch.dtype | None:
    """The dtype a Hugging Face config says its weights are stored in (None: it names none)."""
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        return DTYPE_NAMES.get(stored)
    return stored if isinstance(stored, torch.dtype) else None

SUPPORTED_ATTENTION = ("eager", "sdpa")  # implementations that accept a custom additive 4D mask


# Largest top-two gap of a one-token step's logits that a tree forward of the same tokens may flip,
# per dtype of the torch target (logit units): the two sum in different orders, so they differ by a few
# units in the last place of logits of magnitude 10-30 (bf16 spacing there is 0.0625-0.125; fp16 8x
# finer; fp32 ~2e-6).  At T = 0 a tree's output equals the target's own AR output except where AR's
# top two logits lie this close (`Target.rounding_gap`).
ROUNDING_GAP: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-3,
    torch.float16: 0.05,
    torch.bfloat16: 0.5,
}


class ContextOverflowError(ValueError):
    """The sequence would not fit in the target's context window."""


class EngineUnavailable(RuntimeError):
    """A target engine that cannot run here: its binding is not installed or does not load (the message
    says which, and how to install it)."""


@attrs.frozen(eq=False)
class TargetOutput:
    """Logits and tap features of one target forward."""

    logits: torch.Tensor  # [n, V] next-token logits (prefill: the last position only, n = 1)
    features: torch.Tensor | None  # [n, len(taps) * H] tap features, None when no taps were asked for


@attrs.frozen
class ModelShapes:
    """A target model's shapes, under the names a transformers config gives them: what its forward
    costs depend on (the dtype probe times its matmuls, `treespec.pricing.hardware.linear_shapes`)."""

    hidden_size: int  # H
    intermediate_size: int  # the MLP's width
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads
    num_hidden_layers: int  # decoder layers
    vocab_size: int  # the logits' width
    head_dim: int | None = None  # per head (None: hidden_size // num_attention_heads)
    dtype: torch.dtype | None = None  # what its weights are stored in, where that is a torch dtype (None: not)

    @classmethod
    def of_config(cls, config: Any) -> ModelShapes:
        """The shapes a transformers config states (an MLP of 4 H and as many KV heads as heads by default)."""
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        return cls(hidden, int(getattr(config, "intermediate_size", None) or 4 * hidden), heads,
                   int(getattr(config, "num_key_value_heads", None) or heads), int(config.num_hidden_layers),
                   int(config.vocab_size), getattr(config, "head_dim", None), stored_dtype(config))


@runtime_checkable
class Target(Protocol):
    """What the decoding loop, the cost profile and the drafters call on a target (module docstring)."""

    engine: str  # the registry name (kind "engine") of what runs it
    batches: bool  # whether `treespec.batch_decoding.BatchDecoder` can decode several sequences on it
    length: int  # committed tokens in its cache
    vocab_size: int  # the logits' width
    hidden_size: int  # the width of every tap
    num_hidden_layers: int  # taps run from 0 (the embedding) to this (after the final norm)
    max_positions: int  # its context window
    embed_tokens: torch.nn.Module  # the input embedding, in torch (the drafters share it)
    lm_head: torch.nn.Module  # the LM head, in torch (the drafters share it)

    @property
    def dtype(self) -> torch.dtype: ...  # the torch side's dtype (embedding, head, taps)

    @property
    def device(self) -> torch.device: ...

    def prefill(self, input_ids: torch.Tensor, taps: tuple[int, ...] = ()) -> TargetOutput: ...

    def forward_tree(self, tree: DraftTree, taps: tuple[int, ...] = ()) -> TargetOutput: ...

    def commit(self, accepted: torch.Tensor) -> None: ...

    def drop_tree(self) -> None: ...

    def reset(self) -> None: ...

    def cache_length(self) -> int: ...

    def shapes(self) -> ModelShapes: ...

    def identity(self) -> dict: ...  # what its cost profile is keyed by: the model's architecture, the file it runs

    def describe(self) -> str: ...  # what runs, in a few words ("bfloat16, cpu"; a GGUF file and its quantization)

    def eos_token_ids(self) -> list[int]: ...  # the end-of-sequence ids its model states (a tokenizer's come first)

    def rounding_gap(self, tokens: int = 17) -> float: ...  # the largest top-two gap a tree of ``tokens`` tokens
    # may flip against one-token steps (T = 0 output equals AR's except at a gap this small)


class Engine(Protocol):
    """The class an engine registers (kind "engine"): how the apps find, describe and load its target."""

    file_suffix: str | None  # the suffix of the one file it runs (".gguf"); None: it loads a model folder
    batches: bool  # whether several sequences decode together on it (`treespec.batch_decoding.BatchDecoder`)

    @classmethod
    def model_path(cls, model: str | os.PathLike) -> Path: ...  # the folder or file it runs for ``model``

    @classmethod
    def read_shapes(cls, path: Path) -> ModelShapes | None: ...  # from metadata only (None: unknown)

    @classmethod
    def load(cls, path: Path, *, dtype: torch.dtype | str, device: str | torch.device,
             float32_head: bool | None = None) -> Target: ...

    @staticmethod
    def installed() -> bool: ...  # whether it can run here

    @staticmethod
    def install_recipe() -> tuple[str, dict[str, str]] | None: ...  # (pip requirement, build env); None: nothing


class TargetModel:
    """A Hugging Face causal LM with a KV cache, tree forwards and accepted-path compaction: the `Target`
    of the torch engine (registry kind "engine", name "torch"), and its `Engine`."""

    engine = "torch"  # its registry name
    file_suffix = None  # it loads a model folder
    batches = True  # several sequences in one forward (treespec/batch_target.py)

    def __init__(self, model: torch.nn.Module, *, max_positions: int | None = None,
                 float32_head: bool | None = None) -> None:
        self.model = model.eval()
        self.config = model.config
        _check_attention(self.config)
        self.embed_tokens = model.get_input_embeddings()
        reduced = reduced_precision(self.embed_tokens.weight.dtype)
        if reduced and float32_head is not False:  # None (default) or True: on; float models are left alone
            use_float32_head(model)
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = int(self.lm_head.weight.shape[0])  # the logits' width (may exceed the tokenizer's)
        self.hidden_size = int(self.config.hidden_size)
        self.num_hidden_layers = int(self.config.num_hidden_layers)
        window = getattr(self.config, "max_position_embeddings", None)
        self.max_positions = int(max_positions or window or 0)
        if self.max_positions < 1:
            raise ValueError("the target's context size is unknown: pass max_positions")
        # the cache keyword of the model call ("past_key_values" before transformers 5)
        self.cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.cache = None
        self.length = 0

    @classmethod
    def from_local(cls, path: str | os.PathLike, *, dtype: torch.dtype | str = "checkpoint",
                   device: str | torch.device = "cpu",
                   attn_implementation: str = "sdpa", max_positions: int | None = None,
                   float32_head: bool | None = None) -> TargetModel:
        """Load a causal LM from a local directory (safetensors; never remote code).

        ``dtype``: a torch dtype, one of `DTYPE_NAMES`, or ``"checkpoint"`` (the stored dtype); the
        machine's faster dtype (``"auto"``) is chosen by the apps' loader (`treespec.apps.assembly.loading.load_target`,
        through `treespec.pricing.hardware`); ``float32_head``: see the module docstring (None: on for
        bf16/fp16)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"{path} holds no config.json: not a Hugging Face model directory")
        check_device(device)
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        dtype = _load_dtype(dtype, config)
        _check_safetensors(Path(path))
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True,
            trust_remote_code=False, use_safetensors=True)
        return cls(model.to(device), max_positions=max_positions, float32_head=float32_head)

    # ------------------------------------------------------------------ the engine's entry
    @classmethod
    def model_path(cls, model: str | os.PathLike) -> Path:
        """The local model folder ``model`` names (a FileNotFoundError when there is none)."""
        if not Path(model).is_dir():
            raise FileNotFoundError(f"no local model directory at {model}")
        return Path(model)

    @classmethod
    def read_shapes(cls, path: Path) -> ModelShapes | None:
        """The shapes its config.json states (None: the folder has none; `from_local` then names it)."""
        from transformers import AutoConfig

        if not (Path(path) / "config.json").is_file():
            return None
        return ModelShapes.of_config(AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False))

    @classmethod
    def load(cls, path: str | os.PathLike | torch.nn.Module, *, dtype: torch.dtype | str = "checkpoint",
             device: str | torch.device = "cpu", float32_head: bool | None = None) -> TargetModel:
        """The target of a model folder (`from_local`) or of a transformers module as it is."""
        if isinstance(path, torch.nn.Module):
            return cls(path, float32_head=float32_head)
        return cls.from_local(path, dtype=dtype, device=device, float32_head=float32_head)

    @staticmethod
    def installed() -> bool:
        return True  # torch and transformers are treespec's own dependencies

    @staticmethod
    def install_recipe() -> None:
        return None  # nothing to build

    # ------------------------------------------------------------------ what it is
    def shapes(self) -> ModelShapes:
        return attrs.evolve(ModelShapes.of_config(self.config), vocab_size=self.vocab_size)

    def identity(self) -> dict:
        """The model's architecture: its config without paths and dtypes."""
        return {k: v for k, v in self.config.to_dict().items()
                if not k.startswith("_") and k not in ("dtype", "torch_dtype", "transformers_version")}

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}, {self.device}"

    def eos_token_ids(self) -> list[int]:
        eos = getattr(self.config, "eos_token_id", None)
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def rounding_gap(self, tokens: int = 17) -> float:
        """`ROUNDING_GAP` of its dtype, whatever the tree's size."""
        return ROUNDING_GAP.get(self.dtype, 0.0)

    # ------------------------------------------------------------------ properties
    @property
    def dtype(self) -> torch.dtype:
        """The trunk's dtype (the logits are float32 under ``float32_head``)."""
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    # ------------------------------------------------------------------ forwards
    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, taps: tuple[int, ...] = ()) -> TargetOutput:
        """Start a new sequence with ``input_ids`` [P] (or [1, P]); returns the last position's logits [1, V]."""
        ids = _prompt_ids(input_ids).to(self.device)
        self._check_room(ids.numel() - 1)
        self._check_taps(taps)
        self.reset()
        if ids.numel() == 0:  # nothing to run: a one-token prompt leaves only the root
            width = len(taps) * self.hidden_size
            features = torch.empty(0, width, dtype=self.dtype, device=self.device) if taps else None
            return TargetOutput(torch.empty(0, self.vocab_size, dtype=self.lm_head.weight.dtype, device=self.device), features)
        out = self._call(ids[None], None, None, taps, logits_to_keep=1)
        self.length = ids.numel()
        logits = out.logits[0].clone()
        check_finite(logits, type(self.model).__name__)
        return TargetOutput(logits, self._features(out, taps))

    @torch.inference_mode()
    def forward_tree(self, tree: DraftTree, taps: tuple[int, ...] = ()) -> TargetOutput:
        """One forward over every tree node on top of the cache: logits [N, V] and features [N, F]."""
        if self.cache is None:
            raise RuntimeError("forward_tree before prefill: start a sequence first")
        self._check_room(self.length + tree.max_depth)
        self._check_taps(taps)
        if int(tree.tokens.max()) >= self.vocab_size:
            raise ValueError(f"tree token {int(tree.tokens.max())} is outside the target's vocabulary of {self.vocab_size}")
        tree = tree if tree.device == self.device else tree.to(self.device)
        mask = tree.attention_mask(self.length, self.dtype)  # [1, 1, N, length + N]
        out = self._call(tree.tokens[None], mask, tree.position_ids(self.length), taps)
        return TargetOutput(out.logits[0], self._features(out, taps))

    @torch.inference_mode()
    def commit(self, accepted: torch.Tensor) -> None:
        """Keep the accepted nodes' K/V rows (node indices, root first) and crop the rest of the tree."""
        start = self.length
        accepted = accepted.to(self.device)
        n_kept = accepted.numel()
        if n_kept == 0 or int(accepted[0]) != 0:
            raise ValueError("accepted node indices must start with the root (node 0)")
        if int(accepted.max()) >= self.cache_length() - start:
            raise ValueError(f"accepted node {int(accepted.max())} was not in the last tree forward "
                             f"({self.cache_length() - start} nodes)")
        for layer in self.cache.layers:
            rows = layer.keys.index_select(-2, start + accepted), layer.values.index_select(-2, start + accepted)
            layer.keys[..., start:start + n_kept, :] = rows[0]  # [B, H, a, D] moved after the prefix
            layer.values[..., start:start + n_kept, :] = rows[1]
        crop_cache(self.cache, start + n_kept)
        self.length = start + n_kept

    def drop_tree(self) -> None:
        """Forget the last tree forward's rows: the cache holds the committed tokens only (the profile's
        timing loop runs tree after tree on one prefix)."""
        crop_cache(self.cache, self.length)

    def reset(self) -> None:
        """Drop the sequence: an empty cache, length 0."""
        self.cache = self._new_cache()
        self.length = 0

    def cache_length(self) -> int:
        """Rows held by the KV cache (equals ``length`` between rounds)."""
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    # ------------------------------------------------------------------ helpers
    def _new_cache(self):
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.config)
        if any(type(layer) is not DynamicLayer for layer in cache.layers):
            kinds = sorted({type(layer).__name__ for layer in cache.layers})
            raise ValueError(f"only full-attention dynamic cache layers are supported, got {kinds}")
        return cache

    def _call(self, ids: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor | None,
              taps: tuple[int, ...], logits_to_keep: int = 0, cache=None):
        """One model call over ``self.cache`` (or ``cache``, a batch's: treespec/batch_target.py)."""
        kwargs = {self.cache_kwarg: self.cache if cache is None else cache}
        return self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                          output_hidden_states=bool(taps), logits_to_keep=logits_to_keep, **kwargs)

    @staticmethod
    def _features(out, taps: tuple[int, ...]) -> torch.Tensor | None:
        features = tap_features(out, taps)
        return None if features is None else features[0]  # [n, len(taps) * H]

    def _check_taps(self, taps: tuple[int, ...]) -> None:
        bad = [t for t in taps if not 0 <= t <= self.num_hidden_layers]
        if bad:
            raise ValueError(f"tap layers {bad} out of range: hidden_states has indices 0..{self.num_hidden_layers}")

    def _check_room(self, last_position: int) -> None:
        if last_position >= self.max_positions:
            raise ContextOverflowError(
                f"position {last_position} would overflow the target's context of {self.max_positions} positions")


class Float32Norm(torch.nn.Module):
    """Runs a norm module on float32 input, so its output stays float32 (see the module docstring)."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.inner = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.float())


class Float32Head(torch.nn.Module):
    """A linear LM head evaluated in float32 on a float32 copy of its weight."""

    def __init__(self, head: torch.nn.Linear) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(head.weight.detach().float(), requires_grad=False)  # [V, H]
        bias = getattr(head, "bias", None)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight, self.bias)


def use_float32_head(model: torch.nn.Module) -> None:
    """Swap in `Float32Norm` for the decoder's final ``norm`` (when it has one) and `Float32Head`."""
    head = model.get_output_embeddings()
    if isinstance(head, Float32Head):
        return
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"float32_head needs a linear LM head, this model's is {type(head).__name__}")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is not None and isinstance(getattr(decoder, "norm", None), torch.nn.Module):
        decoder.norm = Float32Norm(decoder.norm)
    model.set_output_embeddings(Float32Head(head))


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` rows of every layer of a dynamic cache (views, no copy)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]


class NonFiniteLogits(ValueError):
    """The target's logits after a prompt hold NaN or infinities: its weights do."""


def check_finite(logits: torch.Tensor, model: str) -> None:
    """`NonFiniteLogits` naming ``model`` when a prefill's logits [1, V] are not all finite (a model whose
    weights hold NaN or overflow: nothing it decodes would mean anything)."""
    if logits.numel() and not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogits(f"{model}: the model's logits after the prompt are not finite (NaN or infinite): "
                              "its weights hold NaN or infinities")


def check_device(device: str | torch.device) -> None:
    """A clear error for a device this torch build or machine does not have."""
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r} (cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} asked for, but this torch build sees no CUDA device "
                         f"(torch {torch.__version__}); use --device cpu")


def _check_safetensors(directory: Path) -> None:
    """Every safetensors file of the model opens (its header parses), else an error naming the file."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no *.safetensors weights (other formats are not loaded)")
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
        except Exception as exc:  # safetensors raises its own error types for a damaged header
            raise ValueError(f"{path} is not a readable safetensors file ({exc})") from None


def _prompt_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """[P] int64 from [P] or [1, P]; P may be 0 here (a one-token prompt prefills nothing)."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"prefill takes a [P] or [1, P] tensor, got shape {tuple(ids.shape)}")
    return ids


def _check_attention(config) -> None:
    impl = getattr(config, "_attn_implementation", None)
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(f"attention implementation {impl!r} cannot take a custom 4D tree mask; "
                         f"load the model with attn_implementation in {SUPPORTED_ATTENTION}")
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError("sliding-window attention layers are not supported (one tree mask serves every layer)")


def tap_features(out, taps: tuple[int, ...]) -> torch.Tensor | None:
    """[B, n, len(taps) * H]: a model output's hidden states ``taps`` side by side (None without taps)."""
    if not taps:
        return None
    return torch.cat([out.hidden_states[t] for t in taps], dim=-1)


def spread_layers(num_target_layers: int, taps: int = 4) -> tuple[int, ...]:
    """Evenly spread tap layers from layer 1 to the second-to-last (like the released drafters)."""
    last = num_target_layers - 2
    return tuple(sorted({round(1 + i * (last - 1) / (taps - 1)) for i in range(taps)}))


def select_taps(features: torch.Tensor, have: Sequence[int], want: Sequence[int]) -> torch.Tensor:
    """[n, len(want) * H]: the taps ``want`` (a subset of ``have``, any order) of ``features``
    [n, len(have) * H], whose columns hold the hidden states of layers ``have`` side by side."""
    have, want = tuple(have), tuple(want)
    if want == have:
        return features
    missing = sorted(set(want) - set(have))
    if missing:
        raise ValueError(f"taps {missing} are not among the features' taps {list(have)}")
    width = features.shape[1] // len(have)
    return torch.cat([features[:, have.index(t) * width:(have.index(t) + 1) * width] for t in want], dim=1)


def _load_dtype(dtype: torch.dtype | str, config) -> torch.dtype | str:
    """The dtype ``from_local`` loads with: ``dtype`` itself, a named one, or the stored one for
    ``"checkpoint"`` (transformers' ``"auto"`` where the config names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    if dtype == "checkpoint":
        return stored_dtype(config) or "auto"
    raise ValueError(f"unknown dtype {dtype!r} for TargetModel.from_local; expected checkpoint or one of "
                     f"{', '.join(DTYPE_NAMES)} (treespec.apps.assembly.loading.load_target also takes auto)")
