"""The target on llama.cpp: a GGUF file run by the engine CPU users deploy, driven through llama-cpp-python.

Contract
--------
`LlamaCppTarget(path)` is a `treespec.target.Target` and the engine's `treespec.target.Engine` (registry
kind "engine", name "llama.cpp"), backed by llama.cpp through its binding's C API: the GGUF file runs as
it is, quantized or not.

* **A tree in one decode.**  A tree of k leaves is k sequences of llama.cpp's unified KV cache: leaf j is
  sequence j, every node belongs to the sequences of the leaves below it, the cached prefix to all
  (`llama_memory_seq_cp` copies nothing), node i sits at position ``length + depth(i)``; a token then
  attends to the prefix, its ancestors and itself.  Every node's logits are kept.
* **Commit.**  The leaf s below the accepted path's end alone is kept in every cell, cut after the path and
  renamed sequence 0; a path among the holes of rejected nodes is moved next to the prefix in position
  order (`_compact`), so the cache equals a run of the committed tokens.
* **Exactness.**  K/V are cached in q8_0 by default (``cache_type``; f16 where the heads' width does not
  fit q8_0's 32-element blocks): ggml's flash attention then sums a one-token step as it sums a batch
  (with f16 it splits a step's keys over threads past 512 cells), so trees equal one-token steps bit for
  bit; `numerics` measures it (docs/engines.md).
* **Taps.**  Tap t > 0 is the output of decoder layer t - 1 (``l_out-(t-1)``; 0 ``embd``, the last
  ``result_norm``), copied out by the evaluation callback as computed; a context with taps pays a Python
  call per graph node, so each tap set gets its own context, made on first use.
* **The torch side.**  The input embedding and LM head are dequantized from the file (``gguf``) into
  torch modules of ``dtype`` for the drafters.
* **Limits.**  ``n_ctx`` positions (default the model's, at most 4096; ``n_batch`` more cells hold a tree
  at the last position), ``max_leaves`` leaves a tree, a context overflow refused before the engine runs;
  a file that is not a causal LM's GGUF is refused in one line naming it.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from treespec.numerics import measured_numerics
from treespec.target import ContextOverflowError, EngineUnavailable, ModelShapes, Numerics, TargetOutput, check_finite
from treespec.tree import DraftTree

logger = logging.getLogger(__name__)

__all__ = ["BUILD_FLAGS", "CACHE_TYPES", "ENGINE", "REQUIREMENT", "GgufModel", "LlamaCppTarget", "binding", "read_gguf"]

ENGINE = "llama.cpp"
REQUIREMENT = "llama-cpp-python==0.3.36"  # the binding, built from source for this CPU (pyproject's "engine" extra)
# the build trimmed to the library this engine calls: native CPU kernels; no tests, examples, tools, server or
# multimodal library (about 2.5 min on 2 cores instead of about 10)
BUILD_FLAGS = ("-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF "
               "-DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF")
_F32 = 0  # ggml_type of a float32 tensor
# the K/V cache's element type (llama.cpp's ``--cache-type-k/v``) -> the binding's ggml_type name
CACHE_TYPES = {"q8_0": "GGML_TYPE_Q8_0", "f16": "GGML_TYPE_F16", "f32": "GGML_TYPE_F32"}
FLASH_ATTENTION = {"auto": "LLAMA_FLASH_ATTN_TYPE_AUTO", "on": "LLAMA_FLASH_ATTN_TYPE_ENABLED",
                   "off": "LLAMA_FLASH_ATTN_TYPE_DISABLED"}
_CAUSAL_ARCHS_HINT = "a causal language model llama.cpp runs (llama, qwen2, qwen3, gemma, phi3, ...)"


def binding():
    """The ``llama_cpp`` module, its backend initialised once; `EngineUnavailable` in one line if absent."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise EngineUnavailable(f"the llama.cpp engine needs llama-cpp-python, which is not installed here ({exc}); "
                                "`treespec install-engine` builds it") from None
    except OSError as exc:  # the shared library is there but does not load
        raise EngineUnavailable(f"llama-cpp-python is installed but its library does not load ({exc})") from None
    if not _STARTED:
        llama_cpp.llama_backend_init()
        _STARTED.append(llama_cpp.llama_log_callback(_quiet))  # kept alive: llama.cpp holds the pointer
        llama_cpp.llama_log_set(_STARTED[0], ctypes.c_void_p())
    return llama_cpp


def _quiet(level, text, user_data) -> None:
    """llama.cpp's log lines (model loading, context sizes) would drown the run's own: dropped."""


_STARTED: list = []  # the log callback, once the backend is initialised


@attrs.frozen
class GgufModel:
    """What a GGUF file says of its model (its metadata, read without loading the weights)."""

    path: Path  # the file
    arch: str  # general.architecture
    n_layer: int  # decoder layers
    n_embd: int  # hidden size
    n_ff: int  # MLP width
    n_head: int  # attention heads
    n_head_kv: int  # key/value heads
    n_ctx_train: int  # the context it was trained for
    n_vocab: int  # tokens in its vocabulary
    file_type: str  # the weights' quantization, as gguf names it
    eos_token_id: int | None = None  # tokenizer.ggml.eos_token_id (None: the file states none)

    def to_dict(self) -> dict:
        """What the cost profile keys this model by: the engine, the shapes and quantization, and the
        file (its name and size; forward costs depend on shapes, not on the weights' values)."""
        return ({k: v for k, v in attrs.asdict(self).items() if k not in ("path", "eos_token_id")}
                | {"engine": ENGINE, "file": self.path.name, "bytes": self.path.stat().st_size})

    def shapes(self) -> ModelShapes:
        """Its shapes as the dtype probe reads them (its weights are no torch dtype: ``dtype`` None)."""
        return ModelShapes(self.n_embd, self.n_ff, self.n_head, self.n_head_kv, self.n_layer, self.n_vocab)


def read_gguf(path: str | os.PathLike) -> GgufModel:
    """The model a GGUF file holds; a ValueError naming the file when it is not GGUF, or not a causal LM."""
    return _read(path)[0]


def _read(path: str | os.PathLike):
    """(`GgufModel`, the file's `gguf.GGUFReader`)."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    with path.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # gguf raises bare errors on a damaged file
        raise ValueError(f"{path}: a damaged GGUF file ({exc})") from None
    fields = reader.fields

    def value(key: str, default: Any = None) -> Any:
        field = fields.get(key)
        if field is None:
            return default
        return field.contents()

    arch = value("general.architecture")
    needed = [f"{arch}.block_count", f"{arch}.embedding_length", f"{arch}.attention.head_count"]
    missing = [k for k in needed if k not in fields]
    if arch is None or missing or "token_embd.weight" not in {t.name for t in reader.tensors}:
        raise ValueError(f"{path} is a GGUF file but not {_CAUSAL_ARCHS_HINT}: "
                         f"architecture {arch!r}, missing {', '.join(missing) or 'token_embd.weight'}")
    tokens = value("tokenizer.ggml.tokens")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    n_head = int(value(f"{arch}.attention.head_count"))
    model = GgufModel(path, str(arch), int(value(f"{arch}.block_count")), int(value(f"{arch}.embedding_length")),
                      int(value(f"{arch}.feed_forward_length", 4 * int(value(f"{arch}.embedding_length")))),
                      n_head, int(value(f"{arch}.attention.head_count_kv", n_head)),
                      int(value(f"{arch}.context_length", 2048)),
                      len(tokens) if tokens is not None else int(embd.shape[-1]),
                      str(value("general.file_type", "")), value("tokenizer.ggml.eos_token_id"))
    return model, reader


def _dequantized(reader, name: str) -> torch.Tensor | None:
    """The GGUF tensor ``name`` as float32 [rows, cols] (None when the file has none)."""
    from gguf.quants import dequantize

    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        return None
    values = dequantize(tensor.data, tensor.tensor_type)  # numpy, gguf's own layout: [rows, cols]
    return torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy


class _Tensor(ctypes.Structure):
    """The head of ggml.h's ``struct ggml_tensor``: what the evaluation callback reads."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


class _Taps:
    """The evaluation callback of one context: it asks for the tap tensors by name and copies each
    ubatch's rows out as the graph computes them."""

    def __init__(self, llama_cpp, names: dict[str, int]) -> None:
        from llama_cpp._ggml import libggml

        self.names = names  # graph tensor name -> tap index
        self.rows: dict[int, list[np.ndarray]] = {}
        self.error: BaseException | None = None  # raised in the callback (Ctrl-C): re-raised after the decode
        get = libggml.ggml_backend_tensor_get
        get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        get.restype = None
        self._get = get

        def callback(tensor, ask, user_data):
            try:
                return self._copy(tensor, ask)
            except BaseException as exc:  # noqa: BLE001 -- a ctypes callback cannot raise: keep it, stop the graph
                self.error = self.error or exc
                return False

        self.callback = llama_cpp.ggml_backend_sched_eval_callback(callback)

    def _copy(self, tensor, ask: bool) -> bool:
        head = _Tensor.from_address(tensor)
        name = head.name.decode()
        if ask:
            return name in self.names
        if head.type != _F32:
            raise RuntimeError(f"tap {name} is not float32")
        width, count = int(head.ne[0]), int(head.ne[1])
        out = np.empty((count, width), dtype=np.float32)
        self._get(tensor, out.ctypes.data, 0, out.nbytes)
        self.rows.setdefault(self.names[name], []).append(out)
        return True

    def raise_pending(self) -> None:
        """Re-raise what the callback caught during the last decode (a KeyboardInterrupt), its rows dropped."""
        error, self.error = self.error, None
        if error is not None:
            self.rows = {}
            raise error

    def take(self, taps: Sequence[int], rows: int) -> np.ndarray:
        """[rows, len(taps) * H] float32: the taps copied since the last take, concatenated in ``taps`` order."""
        parts = [np.concatenate(self.rows.get(t, [])) if self.rows.get(t) else None for t in taps]
        self.rows = {}
        if any(p is None or p.shape[0] != rows for p in parts):
            raise RuntimeError("the engine computed fewer tap rows than tokens")
        return np.concatenate(parts, axis=1)


class LlamaCppTarget:
    """A GGUF model on llama.cpp as a tree-verifying target (see the module docstring)."""

    engine = ENGINE  # its registry name
    file_suffix = ".gguf"  # it runs one GGUF file
    batch_class = None  # one sequence at a time (a batch of trees on one context is not built yet)

    def __init__(self, path: str | os.PathLike, *, n_ctx: int | None = None, max_leaves: int = 64,
                 threads: int | None = None, dtype: torch.dtype = torch.float32, n_batch: int = 512,
                 cache_type: str | None = None, flash_attention: str = "auto") -> None:
        self.llama_cpp = binding()
        self.gguf, reader = _read(path)
        cache_type = _exact_cache_type(self.gguf, None) if cache_type is None else cache_type
        if cache_type not in CACHE_TYPES:
            raise ValueError(f"unknown K/V cache type {cache_type!r}; the engine takes {', '.join(CACHE_TYPES)}")
        if flash_attention not in FLASH_ATTENTION:
            raise ValueError(f"flash_attention is one of {', '.join(FLASH_ATTENTION)}, got {flash_attention!r}")
        if cache_type == "q8_0" and flash_attention == "off":
            raise ValueError("a q8_0 K/V cache needs llama.cpp's flash attention: use flash_attention 'auto' or 'on'")
        self.cache_type, self.flash_attention = cache_type, flash_attention
        self.path = self.gguf.path
        self.hidden_size, self.num_hidden_layers = self.gguf.n_embd, self.gguf.n_layer
        self.max_positions = int(n_ctx or min(self.gguf.n_ctx_train, 4096))
        self.max_leaves, self.n_batch = max_leaves, n_batch
        self.threads = threads
        self._dtype = dtype
        self.model = self._load_model()
        self._owns_model = True  # a `sibling` shares it and leaves it to this target to free
        self.vocab_size = int(self.llama_cpp.llama_vocab_n_tokens(self.llama_cpp.llama_model_get_vocab(self.model)))
        self.embed_tokens, self.lm_head = self._torch_side(reader, dtype)
        del reader
        self._contexts: dict[tuple[int, ...], tuple[Any, _Taps | None, int]] = {}  # taps -> (ctx, hooks, threads)
        self._ctx, self._taps, self._tap_set = None, None, ()
        self._batch = self.llama_cpp.llama_batch_init(max(n_batch, 1), 0, max_leaves + 1)
        self.length = 0
        self._tree: DraftTree | None = None  # the last tree forward, until committed or dropped
        self._numerics: dict[tuple[int, int], Numerics] = {}  # (tree tokens, threads) -> measured (`numerics`)
        self._tree_sets: list[tuple[int, ...]] = []  # its nodes' sequences (`_leaf_sets`)

    # ------------------------------------------------------------------ loading
    def _load_model(self):
        params = self.llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        model = self.llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not model:
            raise ValueError(f"llama.cpp cannot load {self.path} as {_CAUSAL_ARCHS_HINT} "
                             f"(architecture {self.gguf.arch!r})")
        if self.llama_cpp.llama_model_has_encoder(model):
            self.llama_cpp.llama_model_free(model)
            raise ValueError(f"{self.path} holds an encoder-decoder model; a target must be a causal LM")
        return model

    def _torch_side(self, reader, dtype: torch.dtype) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
        """The input embedding and LM head as torch modules, dequantized from the file (one tensor
        shared when the head is tied to the embedding, as the file stores it)."""
        embed = _dequantized(reader, "token_embd.weight").to(dtype)  # [V, H]
        head = _dequantized(reader, "output.weight")  # [V, H], or None: tied
        embedding = torch.nn.Embedding.from_pretrained(embed, freeze=True)
        linear = torch.nn.Linear(self.hidden_size, embed.shape[0], bias=False, device="meta")
        linear.weight = embedding.weight if head is None else torch.nn.Parameter(head.to(dtype), requires_grad=False)
        return embedding, linear

    # ------------------------------------------------------------------ the engine's entry (`treespec.target.Engine`)
    @classmethod
    def model_path(cls, model: str | os.PathLike) -> Path:
        """The GGUF file ``model`` names: the file itself, or the one ``.gguf`` file of a folder."""
        path = Path(model)
        if path.is_file():
            return path
        if not path.exists():
            raise FileNotFoundError(f"no GGUF file or folder at {path}")
        files = sorted(path.glob("*.gguf")) if path.is_dir() else []
        if len(files) != 1:
            found = "no .gguf file" if not files else f"{len(files)} .gguf files"
            raise FileNotFoundError(f"the {ENGINE} engine runs a GGUF file: {path} holds {found}; name the file")
        return files[0]

    @classmethod
    def read_shapes(cls, path: Path) -> ModelShapes:
        """What the file holds, read from its metadata only (the apps' dtype choice reads its shapes)."""
        return read_gguf(path).shapes()

    @classmethod
    def load(cls, path: str | os.PathLike, *, dtype: torch.dtype | str = "checkpoint",
             device: str | torch.device = "cpu", float32_head: bool | None = None, exact: bool | None = None,
             **kwargs: Any) -> LlamaCppTarget:
        """The target of a GGUF file, its torch side in ``dtype`` ("checkpoint" or "auto": float32, the
        values the file dequantizes to); ``float32_head`` has nothing to do here (the engine's head is its own);
        ``exact`` (None: True) keeps K/V in q8_0, where trees equal one-token steps bit for bit, False in
        llama.cpp's own f16 (module docstring)."""
        if torch.device(device).type != "cpu":
            raise ValueError(f"the {ENGINE} engine runs on the CPU here, not on {device}")
        if isinstance(dtype, str):
            from treespec.target import DTYPE_NAMES

            dtype = DTYPE_NAMES.get(dtype, torch.float32)
        if "cache_type" not in kwargs:
            kwargs["cache_type"] = "f16" if exact is False else _exact_cache_type(read_gguf(path), exact)
        return cls(path, dtype=dtype, **kwargs)

    @staticmethod
    def install_recipe() -> tuple[str, dict[str, str]]:
        """(pip requirement, build environment) of this engine's binding (`treespec install-engine`)."""
        return REQUIREMENT, {"CMAKE_ARGS": BUILD_FLAGS}

    @staticmethod
    def installed() -> bool:
        """Whether the binding imports here (without initialising it)."""
        try:
            import llama_cpp  # noqa: F401
        except (ImportError, OSError):
            return False
        return True

    # ------------------------------------------------------------------ what it is (`treespec.target.Target`)
    def shapes(self) -> ModelShapes:
        return self.gguf.shapes()

    def identity(self) -> dict:
        return self.gguf.to_dict() | ({"cache_type": self.cache_type} if self.cache_type != "f16" else {})

    def describe(self) -> str:
        return f"{self.path.name}, file type {self.gguf.file_type}, {self.cache_type} K/V cache"

    def eos_token_ids(self) -> list[int]:
        return [] if self.gguf.eos_token_id is None else [int(self.gguf.eos_token_id)]

    def numerics(self, tokens: int = 17) -> Numerics:
        """How trees of ``tokens`` tokens compare with one-token steps on this file, cache type and thread count:
        measured once per size and thread count on a sibling, past 256 cached cells
        (`treespec.numerics.measured_numerics`; this target's cache is left alone)."""
        key = (tokens, self._thread_count())
        if key not in self._numerics:
            path = f"{self.path.name}, {self.cache_type} K/V cache, {key[1]} threads"
            self._numerics[key] = measured_numerics(self.sibling(), path, depth=max(1, (tokens - 1) // 2))
        return self._numerics[key]

    def _context(self, taps: tuple[int, ...]):
        """The llama.cpp context of this tap set (made on first use)."""
        if taps not in self._contexts:
            params = self.llama_cpp.llama_context_default_params()
            params.n_ctx = self.max_positions + self.n_batch  # cells: a tree takes one per node, not per position
            params.n_batch = params.n_ubatch = self.n_batch
            params.n_seq_max = self.max_leaves + 1  # and a scratch sequence (`_compact`)
            params.kv_unified = True
            params.no_perf = True
            params.type_k = params.type_v = getattr(self.llama_cpp, CACHE_TYPES[self.cache_type])
            params.flash_attn_type = getattr(self.llama_cpp, FLASH_ATTENTION[self.flash_attention])
            threads = self._thread_count()
            params.n_threads = params.n_threads_batch = threads
            hooks = None
            if taps:
                hooks = _Taps(self.llama_cpp, {self._tap_name(t): t for t in taps})
                params.cb_eval = hooks.callback
                params.cb_eval_user_data = None
            ctx = self.llama_cpp.llama_init_from_model(self.model, params)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not make a context of {self.max_positions} positions and "
                                   f"{self.max_leaves} sequences for {self.path}")
            self._contexts[taps] = (ctx, hooks, threads)
        ctx, hooks, threads = self._contexts[taps]
        if threads != self._thread_count():  # torch's threads follow the machine's free cores: so does the engine
            threads = self._thread_count()
            self.llama_cpp.llama_set_n_threads(ctx, threads, threads)
            self._contexts[taps] = (ctx, hooks, threads)
        return ctx, hooks

    def _thread_count(self) -> int:
        return int(self.threads or torch.get_num_threads())

    def check_taps(self, taps: tuple[int, ...]) -> None:
        """A ValueError naming the taps outside 0..num_hidden_layers."""
        bad = [t for t in taps if not 0 <= t <= self.num_hidden_layers]
        if bad:
            raise ValueError(f"tap layers {bad} are outside 0..{self.num_hidden_layers} (the target's layers)")

    def _tap_name(self, tap: int) -> str:
        if not 0 <= tap <= self.num_hidden_layers:
            raise ValueError(f"tap {tap} is outside 0..{self.num_hidden_layers} (the target's layers)")
        if tap == self.num_hidden_layers:
            return "result_norm"
        return "embd" if tap == 0 else f"l_out-{tap - 1}"

    # ------------------------------------------------------------------ properties
    @property
    def dtype(self) -> torch.dtype:
        """The torch side's dtype: the embedding, the LM head and the taps (the engine runs the file's own)."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    # ------------------------------------------------------------------ forwards
    def prefill(self, input_ids: torch.Tensor, taps: tuple[int, ...] = ()) -> TargetOutput:
        """Start a new sequence with ``input_ids`` [P] (or [1, P]); the last position's logits [1, V] and
        every position's taps [P, F]."""
        ids = torch.as_tensor(input_ids).reshape(-1).tolist()
        self.check_room(len(ids) - 1)
        taps = tuple(taps)
        self._ctx, self._taps = self._context(taps)
        self._tap_set = taps
        self.reset()
        if not ids:
            features = torch.empty(0, len(taps) * self.hidden_size, dtype=self.dtype) if taps else None
            return TargetOutput(torch.empty(0, self.vocab_size), features)
        all_logits = any(t >= self.num_hidden_layers for t in taps)  # the last layer keeps output rows only
        logits = None
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start:start + self.n_batch]
            last = start + len(chunk) == len(ids)
            self._fill(chunk, [start + i for i in range(len(chunk))], [(0,)] * len(chunk),
                       [all_logits or (last and i == len(chunk) - 1) for i in range(len(chunk))])
            self._decode(len(chunk))
            if last:
                logits = self._logits(len(chunk) if all_logits else 1)[-1:]
        self.length = len(ids)
        check_finite(logits, str(self.path))
        return TargetOutput(logits, self._features(len(ids)) if taps else None)

    def forward_tree(self, tree: DraftTree, taps: tuple[int, ...] = ()) -> TargetOutput:
        """One decode over every tree node on top of the cache: logits [N, V] and taps [N, F]."""
        if self._ctx is None:
            raise RuntimeError("forward_tree before prefill: start a sequence first")
        if tuple(taps) != self._tap_set:
            raise ValueError(f"taps {tuple(taps)} differ from the prefill's {self._tap_set}: prefill again with them")
        self.check_room(self.length + tree.max_depth)
        tokens = tree.tokens.tolist()
        if max(tokens) >= self.vocab_size:
            raise ValueError(f"tree token {max(tokens)} is outside the target's vocabulary of {self.vocab_size}")
        if len(tree) > self.n_batch:
            raise ValueError(f"a tree of {len(tree)} nodes exceeds the engine's batch of {self.n_batch} tokens")
        leaf_sets = _leaf_sets(tree) if len(tree) > 1 else [(0,)]  # an AR step: the one sequence
        leaves = len(leaf_sets[0])  # the root belongs to every leaf's sequence
        if leaves > self.max_leaves:
            raise ValueError(f"a tree of {leaves} leaves exceeds the engine's {self.max_leaves} sequences: use "
                             f"a budget of at most {self.max_leaves} nodes on llama.cpp")
        memory = self.llama_cpp.llama_get_memory(self._ctx)
        for s in range(1, leaves):
            self.llama_cpp.llama_memory_seq_cp(memory, 0, s, -1, -1)
        depths = tree.depths.tolist()
        self._fill(tokens, [self.length + d for d in depths], leaf_sets, [True] * len(tree))
        self._decode(len(tree))
        self._tree, self._tree_sets = tree, leaf_sets
        return TargetOutput(self._logits(len(tree)), self._features(len(tree)) if self._tap_set else None)

    def commit(self, accepted: torch.Tensor) -> None:
        """Keep the accepted path (node indices, root first) in the cache and free every other node."""
        if self._tree is None:
            raise ValueError("commit without a tree forward")
        accepted = [int(i) for i in torch.as_tensor(accepted).reshape(-1)]
        if not accepted or accepted[0] != 0:
            raise ValueError("accepted node indices must start with the root (node 0)")
        if max(accepted) >= len(self._tree):
            raise ValueError(f"accepted node {max(accepted)} was not in the last tree forward "
                             f"({len(self._tree)} nodes)")
        keep = self._tree_sets[accepted[-1]][0]  # a leaf below the accepted path's end
        if len(self._tree) == 1:  # an AR step: its one cell is the committed token already
            self.length, self._tree = self.length + 1, None
            return
        lib, memory = self.llama_cpp, self.llama_cpp.llama_get_memory(self._ctx)
        lib.llama_memory_seq_keep(memory, keep)  # every other sequence out of every cell (emptied cells freed)
        end = self.length + len(accepted)
        lib.llama_memory_seq_rm(memory, keep, end, -1)
        if accepted != list(range(len(accepted))):  # holes among the path's cells: close them
            self._compact(memory, keep, end)
        if keep != 0:
            lib.llama_memory_seq_cp(memory, keep, 0, -1, -1)
            lib.llama_memory_seq_rm(memory, keep, -1, -1)
        self.length = end
        self._tree = None

    def _compact(self, memory, keep: int, end: int) -> None:
        """Move the accepted path's cells (positions ``length .. end - 1`` of sequence ``keep``) next to
        the prefix, in position order, as a run of those tokens would have placed them.

        Attention sums over cells in cell order, and a quantized engine's activations round to int8
        blocks, so a path whose cells sit among the holes of rejected nodes (and the tokens that later
        fill the holes) gives the next decode other logits than a plain run.  The path's cells are
        copied out through the sequence-state API (a scratch sequence holding just them: their K/V
        bytes and positions), every tree cell is freed, and they are read back into the first free
        cells, which are the tree's own first cells."""
        lib, scratch = self.llama_cpp, self.max_leaves  # a sequence no tree uses
        lib.llama_memory_seq_cp(memory, keep, scratch, self.length, end)
        size = lib.llama_state_seq_get_size(self._ctx, scratch)
        buffer = (ctypes.c_uint8 * size)()
        if lib.llama_state_seq_get_data(self._ctx, buffer, size, scratch) != size:
            raise RuntimeError("llama.cpp could not copy the accepted path's cache cells")
        lib.llama_memory_seq_rm(memory, scratch, -1, -1)
        lib.llama_memory_seq_rm(memory, keep, self.length, -1)
        if lib.llama_state_seq_set_data(self._ctx, buffer, size, scratch) != size:
            raise RuntimeError("llama.cpp could not put the accepted path's cache cells back")
        lib.llama_memory_seq_cp(memory, scratch, keep, -1, -1)
        lib.llama_memory_seq_rm(memory, scratch, -1, -1)

    def drop_tree(self) -> None:
        """Forget the last tree forward: the cache holds the committed tokens only (a profile's timing loop)."""
        if self._tree is not None:
            memory = self.llama_cpp.llama_get_memory(self._ctx)
            self.llama_cpp.llama_memory_seq_keep(memory, 0)  # the other leaves' sequences out of every cell
            self.llama_cpp.llama_memory_seq_rm(memory, 0, self.length, -1)  # and leaf 0's branch
            self._tree = None

    def reset(self) -> None:
        """Drop the sequence: an empty cache, length 0."""
        if self._ctx is not None:
            self.llama_cpp.llama_memory_clear(self.llama_cpp.llama_get_memory(self._ctx), True)
        if self._taps is not None:
            self._taps.rows = {}
        self.length, self._tree = 0, None

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` committed tokens (a tree forward not committed is dropped too)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot keep {length} of {self.length} committed tokens")
        self.drop_tree()
        if self._ctx is not None:
            self.llama_cpp.llama_memory_seq_rm(self.llama_cpp.llama_get_memory(self._ctx), 0, length, -1)
        self.length = length

    def sibling(self) -> LlamaCppTarget:
        """A target over the same loaded model with contexts of its own (the model is freed by its owner)."""
        twin = object.__new__(type(self))
        twin.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("_contexts", "_batch")})
        twin._contexts, twin._owns_model, twin._owner = {}, False, self  # the owner outlives its siblings
        twin._numerics = {}
        twin._ctx, twin._taps, twin._tap_set, twin._tree, twin.length = None, None, (), None, 0
        twin._batch = self.llama_cpp.llama_batch_init(max(self.n_batch, 1), 0, self.max_leaves + 1)
        return twin

    def cache_length(self) -> int:
        """Positions held for sequence 0 (equals ``length`` between rounds)."""
        if self._ctx is None:
            return 0
        return int(self.llama_cpp.llama_memory_seq_pos_max(self.llama_cpp.llama_get_memory(self._ctx), 0)) + 1

    def close(self) -> None:
        """Free the engine's contexts, batch and model."""
        for ctx, _, _ in self._contexts.values():
            self.llama_cpp.llama_free(ctx)
        self._contexts = {}
        if self._batch is not None:
            self.llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self.model and self._owns_model:
            self.llama_cpp.llama_model_free(self.model)
        self.model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ the batch
    def _fill(self, tokens: list[int], positions: list[int], seqs: Sequence[Sequence[int]], logits: list[bool]) -> None:
        batch = self._batch
        batch.n_tokens = len(tokens)
        for i, (token, pos, ids, keep) in enumerate(zip(tokens, positions, seqs, logits, strict=True)):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = len(ids)
            for j, s in enumerate(ids):
                batch.seq_id[i][j] = s
            batch.logits[i] = keep

    def _decode(self, n: int) -> None:
        code = self.llama_cpp.llama_decode(self._ctx, self._batch)
        if self._taps is not None:
            self._taps.raise_pending()  # an interrupt the tap callback caught stops the run here
        if code != 0:
            raise RuntimeError(f"llama_decode of {n} tokens failed (code {code}) at {self.length} cached positions "
                               f"of {self.max_positions}")

    def _logits(self, rows: int) -> torch.Tensor:
        """[rows, V] float32: the kept rows' logits of the last decode, in batch order."""
        pointer = self.llama_cpp.llama_get_logits(self._ctx)
        values = np.ctypeslib.as_array(pointer, shape=(rows, self.vocab_size))
        return torch.from_numpy(values.copy())

    def _features(self, rows: int) -> torch.Tensor:
        return torch.from_numpy(self._taps.take(self._tap_set, rows)).to(self.dtype)

    def check_room(self, last_position: int) -> None:
        if last_position >= self.max_positions:
            raise ContextOverflowError(f"position {last_position} exceeds the engine's context of "
                                       f"{self.max_positions} positions")


def _exact_cache_type(model: GgufModel, asked: bool | None) -> str:
    """q8_0, where ggml's attention sums a one-token step as it sums a batch (module docstring); f16 for a
    model whose head dimension q8_0's 32-element blocks do not divide (said in one line when asked for)."""
    head_dim = model.n_embd // model.n_head
    if head_dim % 32 == 0:
        return "q8_0"
    if asked:
        logger.warning(f"{model.path.name}: heads of {head_dim} dimensions do not fit q8_0's 32-element blocks; its "
                       "K/V cache stays f16, where trees agree with one-token steps up to a measured tolerance")
    return "f16"


def _leaf_sets(tree: DraftTree) -> list[tuple[int, ...]]:
    """Per node, the leaves below it (itself when it is one) as sequence ids 0..k-1, in leaf order
    (`DraftTree.leaves`); a node's first sequence is the one its attention follows."""
    below = tree.ancestor_mask[tree.leaves].T.tolist()  # [N, k]: leaf s is node i or lies below it
    return [tuple(s for s, hit in enumerate(row) if hit) for row in below]
