"""The torch engine: any Hugging Face causal LM, driven as a tree verifier over a KV cache.

Contract
--------
`TargetModel` is the `treespec.target.Target` of the torch engine (registry kind "engine", name
"torch") and its `treespec.target.Engine`.  It owns one sequence's KV cache (a transformers
`DynamicCache`); ``forward_tree`` runs every node of a tree in one model call with the tree's 4D
additive mask (each node sees the cached prefix, its ancestors and itself) and position ids
``length + depth``, both passed as arguments to the model call; ``commit`` moves the accepted
nodes' K/V rows into place right after the prefix and crops the rest, so the cache again equals a
plain prefill of the committed tokens.

`TorchBatch` (``TargetModel.batch_class``) is S sequences over the same model: one right-padded cache
whose row s holds sequence s's ``lengths[s]`` cached tokens in columns ``0 .. lengths[s] - 1``
(columns past that are garbage every mask hides; benchmarks/bench_batch.py measures this layout
against a ragged one), one forward per round over a `treespec.batch.TreeBatch`, each sequence's
accepted rows moved after its own prefix, finished sequences dropped with ``keep``.  It uses the
target's public members only (``check_taps``, ``check_room``, ``new_cache``, ``run``).

Hidden-state taps: tap t is ``hidden_states[t]`` of the model (0 = embedding output, t = output of
decoder layer t, the last one after the final norm, as transformers returns it).

Reduced precision: for a bf16/fp16 model, ``float32_head`` (default on) runs the final norm and
the LM head in float32: the model's own norm module on float32 input, then the head on a float32
copy of its weight (the trunk stays in the model's dtype; a tied embedding stays as it is).  The
swap is made once on the model passed in, so the logits are float32 and the last tap too.

Attention: the custom 4D mask needs the ``eager`` or ``sdpa`` implementation (``from_local``
loads with sdpa); sliding-window layers are refused because one mask serves every layer.
Overflowing ``max_positions`` raises `ContextOverflowError` before the model is called.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

from treespec.batch import TreeBatch
from treespec.engines import torch_exact
from treespec.target import (
    DTYPE_NAMES,
    ContextOverflowError,
    ModelShapes,
    Numerics,
    TargetOutput,
    check_device,
    check_finite,
    reduced_precision,
    stored_dtype,
)
from treespec.numerics import measured_numerics
from treespec.tree import DraftTree, additive_mask

logger = logging.getLogger(__name__)

__all__ = ["SUPPORTED_ATTENTION", "Float32Head", "Float32Norm", "TargetModel", "TorchBatch",
           "crop_cache", "tap_features", "use_float32_head"]

SUPPORTED_ATTENTION = ("eager", "sdpa", torch_exact.ATTENTION)  # implementations that take a custom 4D mask

class TorchBatch:
    """S sequences over one torch target's model, one right-padded cache (module docstring)."""

    def __init__(self, target: TargetModel) -> None:
        self.target = target
        self.cache = None
        self.lengths: list[int] = []
        self._tree_start = 0  # cache width before the last tree forward: where its nodes' rows begin
        self._tree_sizes: tuple[int, ...] = ()  # node counts of the last tree forward

    @property
    def device(self) -> torch.device:
        return self.target.device

    def __len__(self) -> int:
        return len(self.lengths)

    def width(self) -> int:
        """Columns of the cache (>= every length)."""
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    # ------------------------------------------------------------------ forwards
    @torch.inference_mode()
    def prefill(self, prompts: Sequence[torch.Tensor], taps: tuple[int, ...] = ()) -> list[torch.Tensor | None]:
        """Start ``prompts`` ([P_s] each); returns each one's taps [P_s - 1, F] (None without taps)."""
        if not prompts:
            raise ValueError("a batch needs at least one prompt")
        heads = [torch.as_tensor(p, dtype=torch.int64).reshape(-1)[:-1].to(self.device) for p in prompts]
        self.target.check_taps(taps)
        for head in heads:
            self.target.check_room(max(head.numel() - 1, 0))
        self.cache, self.lengths = self.target.new_cache(), [h.numel() for h in heads]
        width = max(self.lengths)
        if width == 0:  # one-token prompts only: nothing to cache yet
            empty = torch.empty(0, len(taps) * self.target.hidden_size, dtype=self.target.dtype, device=self.device)
            return [empty if taps else None for _ in heads]
        ids = torch.zeros(len(heads), width, dtype=torch.int64, device=self.device)
        for s, head in enumerate(heads):
            ids[s, :head.numel()] = head
        out = self.target.run(ids, self._prefill_mask(width), torch.arange(width, device=self.device).expand(len(heads), -1),
                                taps, logits_to_keep=1, cache=self.cache, prefill=True)
        features = tap_features(out, taps)
        return [None if features is None else features[s, :n] for s, n in enumerate(self.lengths)]

    def _prefill_mask(self, width: int) -> torch.Tensor:
        """[S, 1, W, W] additive: causal within each prompt; a padding position sees itself only."""
        index = torch.arange(width, device=self.device)
        lengths = torch.tensor(self.lengths, device=self.device)[:, None, None]
        causal = (index[None, :, None] >= index[None, None, :]) & (index[None, None, :] < lengths)  # [S, W, W]
        visible = causal | torch.eye(width, dtype=torch.bool, device=self.device)[None]
        return additive_mask(visible, self.target.dtype)[:, None]

    @torch.inference_mode()
    def forward_trees(self, trees: Sequence[DraftTree], taps: tuple[int, ...] = ()) -> list[TargetOutput]:
        """One forward over every node of every tree (one per sequence): per tree, logits [N_s, V] and
        features [N_s, F]."""
        batch = TreeBatch(list(trees))
        if self.cache is None:
            raise RuntimeError("forward_trees before prefill: start the sequences first")
        if len(batch) != len(self):
            raise ValueError(f"{len(batch)} trees for {len(self)} sequences")
        self.target.check_taps(taps)
        for length, tree in zip(self.lengths, batch.trees, strict=True):
            self.target.check_room(length + tree.max_depth)
        top = max(int(t.tokens.max()) for t in batch.trees)
        if top >= self.target.vocab_size:
            raise ValueError(f"tree token {top} is outside the target's vocabulary of {self.target.vocab_size}")
        self._tree_start, self._tree_sizes = self.width(), batch.sizes
        mask = batch.attention_mask(self.lengths, self.width(), self.target.dtype)
        out = self.target.run(batch.tokens.to(self.device), mask.to(self.device),
                                batch.position_ids(self.lengths).to(self.device), taps, cache=self.cache)
        features = tap_features(out, taps)
        logits = batch.split(out.logits)
        feats = [None] * len(batch) if features is None else batch.split(features)
        return [TargetOutput(lg, ft) for lg, ft in zip(logits, feats, strict=True)]

    @torch.inference_mode()
    def commit(self, accepted: Sequence[torch.Tensor]) -> None:
        """Keep each sequence's accepted nodes' K/V rows (node indices, root first) after its prefix."""
        if len(accepted) != len(self._tree_sizes):
            raise ValueError(f"{len(accepted)} accepted paths for the {len(self._tree_sizes)} trees of the last forward")
        start = self._tree_start
        rows, sources, targets = [], [], []
        for s, nodes in enumerate(accepted):
            nodes = nodes.to(self.device)
            if nodes.numel() == 0 or int(nodes[0]) != 0:
                raise ValueError(f"sequence {s}: accepted node indices must start with the root (node 0)")
            if int(nodes.max()) >= self._tree_sizes[s]:
                raise ValueError(f"sequence {s}: accepted node {int(nodes.max())} was not in its tree "
                                 f"({self._tree_sizes[s]} nodes)")
            rows.append(torch.full_like(nodes, s))
            sources.append(start + nodes)
            targets.append(self.lengths[s] + torch.arange(nodes.numel(), device=self.device))
        rows_t, sources_t, targets_t = torch.cat(rows), torch.cat(sources), torch.cat(targets)
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name)  # [S, H, width, D]
                tensor[rows_t, :, targets_t] = tensor[rows_t, :, sources_t]  # the right side is gathered first
        self.lengths = [n + a.numel() for n, a in zip(self.lengths, accepted, strict=True)]
        self._tree_sizes = ()
        crop_cache(self.cache, max(self.lengths))

    @torch.inference_mode()
    def keep(self, rows: Sequence[int]) -> None:
        """Only the sequences ``rows`` stay, in that order (finished sequences leave the batch)."""
        index = torch.as_tensor(list(rows), dtype=torch.int64, device=self.device)
        self.lengths = [self.lengths[r] for r in rows]
        if not self.lengths:
            self.cache = None
            return
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        crop_cache(self.cache, max(self.lengths))


class TargetModel:
    """A Hugging Face causal LM with a KV cache, tree forwards and accepted-path compaction: the `Target`
    of the torch engine (registry kind "engine", name "torch"), and its `Engine`."""

    engine = "torch"  # its registry name
    file_suffix = None  # it loads a model folder

    batch_class = TorchBatch  # several sequences in one forward

    def __init__(self, model: torch.nn.Module, *, max_positions: int | None = None,
                 float32_head: bool | None = None, exact: bool | None = None) -> None:
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
        self._numerics: dict[tuple[int, int], Numerics] = {}  # (tree tokens, threads) -> measured
        self.exact = self.config._attn_implementation == torch_exact.ATTENTION  # None: the model's kernels as they are
        if exact and not self.exact:
            reason = torch_exact.install(model)
            if reason is not None:
                logger.warning(f"no exact path for this model here ({reason}): trees agree with AR up to a "
                               "measured tolerance")
            self.exact = reason is None
        elif exact is False and self.exact:
            torch_exact.uninstall(model)
            self.exact = False

    @classmethod
    def from_local(cls, path: str | os.PathLike, *, dtype: torch.dtype | str = "checkpoint",
                   device: str | torch.device = "cpu",
                   attn_implementation: str = "sdpa", max_positions: int | None = None,
                   float32_head: bool | None = None, exact: bool | None = None) -> TargetModel:
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
        return cls(model.to(device), max_positions=max_positions, float32_head=float32_head, exact=exact)

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
             device: str | torch.device = "cpu", float32_head: bool | None = None,
             exact: bool | None = None) -> TargetModel:
        """The target of a model folder (`from_local`) or of a transformers module as it is."""
        if isinstance(path, torch.nn.Module):
            return cls(path, float32_head=float32_head, exact=exact)
        return cls.from_local(path, dtype=dtype, device=device, float32_head=float32_head, exact=exact)

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
        """The model's architecture (its config without paths and dtypes) and its kernels (exact or not)."""
        config = {k: v for k, v in self.config.to_dict().items()
                  if not k.startswith("_") and k not in ("dtype", "torch_dtype", "transformers_version")}
        return config | ({"kernels": "batch-invariant"} if self.exact else {})

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}, {self.device}{', batch-invariant kernels' if self.exact else ''}"

    def eos_token_ids(self) -> list[int]:
        eos = getattr(self.config, "eos_token_id", None)
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def numerics(self, tokens: int = 17) -> Numerics:
        """How trees of ``tokens`` tokens compare with one-token steps here, measured once per size and thread
        count on a sibling (`treespec.numerics.measured_numerics`; this target's cache is left alone)."""
        key = (tokens, torch.get_num_threads())
        if key not in self._numerics:
            path = (f"{'batch-invariant kernels' if self.exact else 'transformers kernels'}, "
                    f"{str(self.dtype).removeprefix('torch.')}, {key[1]} threads")
            self._numerics[key] = measured_numerics(self.sibling(), path, depth=max(1, (tokens - 1) // 2))
        return self._numerics[key]

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
        self.check_room(ids.numel() - 1)
        self.check_taps(taps)
        self.reset()
        if ids.numel() == 0:  # nothing to run: a one-token prompt leaves only the root
            width = len(taps) * self.hidden_size
            features = torch.empty(0, width, dtype=self.dtype, device=self.device) if taps else None
            return TargetOutput(torch.empty(0, self.vocab_size, dtype=self.lm_head.weight.dtype, device=self.device), features)
        out = self.run(ids[None], None, None, taps, logits_to_keep=1, prefill=True)
        self.length = ids.numel()
        logits = out.logits[0].clone()
        check_finite(logits, type(self.model).__name__)
        return TargetOutput(logits, self._features(out, taps))

    @torch.inference_mode()
    def forward_tree(self, tree: DraftTree, taps: tuple[int, ...] = ()) -> TargetOutput:
        """One forward over every tree node on top of the cache: logits [N, V] and features [N, F]."""
        if self.cache is None:
            raise RuntimeError("forward_tree before prefill: start a sequence first")
        self.check_room(self.length + tree.max_depth)
        self.check_taps(taps)
        if int(tree.tokens.max()) >= self.vocab_size:
            raise ValueError(f"tree token {int(tree.tokens.max())} is outside the target's vocabulary of {self.vocab_size}")
        tree = tree if tree.device == self.device else tree.to(self.device)
        mask = tree.attention_mask(self.length, self.dtype)  # [1, 1, N, length + N]
        out = self.run(tree.tokens[None], mask, tree.position_ids(self.length), taps)
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
        self.cache = self.new_cache()
        self.length = 0

    def cache_length(self) -> int:
        """Rows held by the KV cache (equals ``length`` between rounds)."""
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` committed tokens (a tree forward not committed is dropped too)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot keep {length} of {self.length} committed tokens")
        crop_cache(self.cache, length)
        self.length = length

    def sibling(self) -> TargetModel:
        """A target over the same model (weights shared, float32 head and kernels kept) with a cache of its own."""
        return type(self)(self.model, max_positions=self.max_positions, float32_head=False)

    # ------------------------------------------------------------------ helpers
    def new_cache(self):
        """An empty transformers cache for this model (full-attention dynamic layers only)."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.config)
        if any(type(layer) is not DynamicLayer for layer in cache.layers):
            kinds = sorted({type(layer).__name__ for layer in cache.layers})
            raise ValueError(f"only full-attention dynamic cache layers are supported, got {kinds}")
        return cache

    def run(self, ids: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor | None,
            taps: tuple[int, ...], logits_to_keep: int = 0, cache=None, *, prefill: bool = False):
        """One model call over ``self.cache`` (or ``cache``: a `TorchBatch`'s), positions and mask as arguments;
        a ``prefill`` (which a run and its AR share) takes the model's plain attention."""
        kwargs = {self.cache_kwarg: self.cache if cache is None else cache}
        if self.exact:
            kwargs["treespec_exact"] = not prefill
        return self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                          output_hidden_states=bool(taps), logits_to_keep=logits_to_keep, **kwargs)

    @staticmethod
    def _features(out, taps: tuple[int, ...]) -> torch.Tensor | None:
        features = tap_features(out, taps)
        return None if features is None else features[0]  # [n, len(taps) * H]

    def check_taps(self, taps: tuple[int, ...]) -> None:
        bad = [t for t in taps if not 0 <= t <= self.num_hidden_layers]
        if bad:
            raise ValueError(f"tap layers {bad} out of range: hidden_states has indices 0..{self.num_hidden_layers}")

    def check_room(self, last_position: int) -> None:
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




class Float32Head(torch.nn.Linear):
    """A linear LM head evaluated in float32 on a float32 copy of its weight (a linear of its own input's
    dtype: `treespec.engines.torch_exact` makes it batch-invariant as any linear)."""

    def __init__(self, head: torch.nn.Linear) -> None:
        super().__init__(head.in_features, head.out_features, bias=getattr(head, "bias", None) is not None,
                         device="meta")
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




def tap_features(out, taps: tuple[int, ...]) -> torch.Tensor | None:
    """[B, n, len(taps) * H]: a model output's hidden states ``taps`` side by side (None without taps)."""
    if not taps:
        return None
    return torch.cat([out.hidden_states[t] for t in taps], dim=-1)




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

