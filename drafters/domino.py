"""Domino: the DFlash backbone plus a GRU over the drafted path that corrects each depth's logits.

Contract
--------
`DominoDrafter` loads Domino checkpoints (``Huang2020/Qwen3-4B-Domino-b16`` layout: the DFlash keys
plus ``prefix_gru.weight_ih_l0`` [3G, H], ``prefix_gru.weight_hh_l0`` [3G, G],
``embed_proj.0.weight`` [E, H+G], ``embed_proj.2.weight`` [V, E]; no biases) and drafts like
`DFlashDrafter`; its `DraftOutput` additionally carries a `DominoScorer`.

The maths (s_i = GRU state after reading the target embeddings of anchor, d_1 .. d_i; z_i = the
drafted hidden state for depth i+1, i.e. ``DraftOutput`` row i):

    logits(d_{i+1} | path) = lm_head(z_i) + W2 silu(W1 [z_i ; s_i])        (W1 = [W1_z | W1_s])
    s_0 = GRU(0, e(anchor)),   s_{i+1} = GRU(s_i, e(d_{i+1}))

`DominoScorer.expand(states, depth, top_m=M, k=k)` scores the children (depth+1) of n parents at
``depth`` at once.  Children within the pure-draft prefix (depth + 1 <= pure_draft_prefix_len)
take the base log_softmax over the full vocabulary.  Otherwise the candidates are the top-M base
tokens of row ``depth``; once per round and depth the scorer gathers their base logits and their
M rows of W2 in (at least) float32, so a node costs O((H + G) E + M E) for the correction plus
the GRU update of its k children, not O(V).  As the released head computes it: the first
projection W1 [z_i ; s_i] is one matmul in the drafter's dtype, its silu is cast to float32 and
the last matmul (the M gathered W2 rows) runs in float32.  The log-softmax is over the M
candidates.  In reduced precision (bf16/fp16 GRU weights) the children's GRU states come from
the ``nn.GRU`` module itself, as in the released builder, so the bf16 states are its bits; in
float32/float64 they come from `gru_step` (the same maths) over the precomputed input table.  Rows are sorted by
log-prob descending, ties by token id ascending.  `expand_reference` is the plain full-vocabulary
evaluation through the ``nn`` modules themselves (``M = V``), for tests.  The top-M set of a row
comes from one two-stage top-(M+1) selection; only a tie across the M-th place falls back to the
per-row tie rule.

`expand_deferred` scores children like `expand` but leaves their GRU steps pending (states
[n, k, G + 1]: the parent's state and the child's token id); `advance(pending)` [n, G + 1] -> [n, G]
completes them.  A tree policy expands few of the children it scores, so it pays the GRU update
only for those (policies/engine/candidates.py drives a scorer this way when it offers both methods).

The GRU input projection W_ih e(t) is precomputed for every vocabulary token at bind time
(``gru_input_table=True``, the default: a [V, 3G] table; float32/float64 only) so a child's update is a gather; per
node it measured 2-7x faster at SmolLM2 sizes and 5-14x at Qwen3-4B sizes (benchmarks/
bench_expand.py, docs/drafters.md).  ``gru_input_table=False`` projects each child's embedding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from treespec.drafters._layers import DFlashModel
from treespec.drafters.config import ConfigError, DFlashConfig
from treespec.drafters.dflash import DFlashDrafter
from treespec.interfaces import Expansion, RecordableScorer
from treespec.target import reduced_precision
from treespec.topk import exact_topk, top_set

if TYPE_CHECKING:
    from treespec.target import Target

__all__ = ["DominoDrafter", "DominoModel", "DominoScorer", "DominoStack", "gru_step"]


class DominoModel(DFlashModel):
    """DFlash backbone plus ``prefix_gru`` and ``embed_proj`` under their checkpoint names."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__(cfg)
        head, hidden = cfg.domino, cfg.hidden_size
        self.prefix_gru = nn.GRU(hidden, head.gru_hidden_dim, num_layers=1, batch_first=True, bias=False)
        self.embed_proj = nn.Sequential(
            nn.Linear(hidden + head.gru_hidden_dim, head.emb_dim, bias=False),
            nn.SiLU(),
            nn.Linear(head.emb_dim, cfg.vocab_size, bias=False),
        )


def gru_step(gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """One bias-free GRU update from input gates ``gi`` = W_ih x and hidden gates ``gh`` = W_hh h.

    PyTorch's gate order (r, z, n):  r = sigmoid(gi_r + gh_r),  z = sigmoid(gi_z + gh_z),
    n = tanh(gi_n + r * gh_n),  h' = (1 - z) * n + z * h = lerp(n, h, z).  Shapes broadcast:
    gates [..., 3G], state [..., G]; r and z come from one fused slice to keep the op count low.
    """
    size = h.shape[-1]
    rz = torch.sigmoid(gi[..., :2 * size] + gh[..., :2 * size])  # [..., 2G]
    n = torch.tanh(torch.addcmul(gi[..., 2 * size:], rz[..., :size], gh[..., 2 * size:]))  # [..., G]
    return torch.lerp(n, h.expand_as(n), rz[..., size:])


class DominoScorer(RecordableScorer):
    """Path-dependent child distributions of one round (see the module docstring)."""

    record_kind: ClassVar[str] = "domino"

    def __init__(self, *, rows: torch.Tensor, base_logits: torch.Tensor, prefix_gru: nn.GRU,
                 embed_proj: nn.Sequential, embed: nn.Embedding, anchor: int | torch.Tensor,
                 pure_draft_prefix_len: int, gru_table: torch.Tensor | None = None,
                 prefix_logprobs: torch.Tensor | None = None) -> None:
        self.rows = rows  # [L, H] drafted hidden states z
        self.base_logits = base_logits  # [L, V] float32 lm_head(z)
        self.prefix_logprobs = prefix_logprobs  # [prefix_len, V] float32 base log-probs given (None: computed)
        self.prefix_gru, self.embed_proj, self.embed = prefix_gru, embed_proj, embed
        self.anchor = anchor  # the round's anchor token id: an int, or a [1] int64 tensor on the device
        self.prefix_len = pure_draft_prefix_len
        self.gru_table = gru_table  # [V, 3G] W_ih e(t) for every token, or None
        self.w_ih, self.w_hh = prefix_gru.weight_ih_l0, prefix_gru.weight_hh_l0  # [3G, H], [3G, G]
        self.w1 = embed_proj[0].weight  # [E, H + G]
        self.w2 = embed_proj[2].weight  # [V, E]
        self.module_gru = reduced_precision(self.w_hh.dtype)  # states from nn.GRU (see docstring)
        self._prefix: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._gathered: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    @property
    def depth(self) -> int:
        """L, the number of drafted depths."""
        return self.rows.shape[0]

    @property
    def state_size(self) -> int:
        return self.w_hh.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.base_logits.shape[1]

    # ------------------------------------------------------------------ ConditionalScorer
    @torch.no_grad()
    def root_state(self) -> torch.Tensor:
        anchor = self._anchor_ids()
        if self.module_gru:
            return self._module_step(self.w_hh.new_zeros(1, self.state_size), anchor)[0]
        gi = self._input_gates(anchor)[0]  # [3G]
        return gru_step(gi, torch.zeros_like(gi), gi.new_zeros(self.state_size))  # from h = 0: W_hh h = 0

    @torch.no_grad()
    def expand(self, states: torch.Tensor, depth: int, *, top_m: int, k: int) -> Expansion:
        tokens, logprobs = self._children(states, depth, top_m, k)
        return Expansion(tokens=tokens, logprobs=logprobs, states=self._child_states(states, tokens))

    @torch.no_grad()
    def expand_deferred(self, states: torch.Tensor, depth: int, *, top_m: int, k: int) -> Expansion:
        """`expand` with every child's GRU step left pending: states [n, k, G + 1] hold the parent's
        state and the child's token id; `advance` completes the rows that are actually expanded."""
        tokens, logprobs = self._children(states, depth, top_m, k)
        return Expansion(tokens=tokens, logprobs=logprobs, states=self._pending(states, tokens))

    @torch.no_grad()
    def advance(self, pending: torch.Tensor) -> torch.Tensor:
        """[n, G] GRU states of the pending children ``pending`` [n, G + 1] (see `expand_deferred`)."""
        size = self.state_size
        if pending.dim() != 2 or pending.shape[1] != size + 1:
            raise ValueError(f"pending states must be [n, {size + 1}], got {tuple(pending.shape)}")
        h = pending[:, :size].to(self.w_hh.dtype)  # [n, G] parent states
        if self.module_gru:
            return self._module_step(h, pending[:, size].long())
        gh = h @ self.w_hh.T  # [n, 3G]
        return gru_step(self._input_gates(pending[:, size].long()), gh, h)

    @torch.no_grad()
    def expand_reference(self, states: torch.Tensor, depth: int, *, k: int) -> Expansion:
        """Full-vocabulary evaluation through the modules themselves (M = V), node batch at once."""
        self._check(states, depth, k)
        n = states.shape[0]
        logits = self.base_logits[depth].expand(n, -1)  # [n, V]
        if not self._is_pure_draft(depth):
            z = self.rows[depth].expand(n, -1)  # [n, H]
            correction = self.embed_proj(torch.cat([z, states], dim=-1))  # [n, V]
            logits = logits.to(self._score_dtype(correction)) + correction
        logprobs = torch.log_softmax(logits.to(self._score_dtype(logits)), dim=-1)
        chosen, tokens = exact_topk(logprobs, k)  # [n, k] each, ties by token id
        x = self.embed(tokens).to(states.dtype).reshape(n * k, 1, -1)  # [n*k, 1, H]
        _, h = self.prefix_gru(x, states.repeat_interleave(k, dim=0)[None])  # [1, n*k, G]
        return Expansion(tokens=tokens, logprobs=chosen.float(), states=h[0].view(n, k, -1))

    # ------------------------------------------------------------------ pieces
    def _check(self, states: torch.Tensor, depth: int, k: int) -> None:
        if not 0 <= depth < self.depth:
            raise ValueError(f"depth {depth} out of range: children exist for depths 0..{self.depth - 1}")
        if states.dim() != 2 or states.shape[1] != self.state_size:
            raise ValueError(f"states must be [n, {self.state_size}], got {tuple(states.shape)}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")

    def _is_pure_draft(self, depth: int) -> bool:
        return depth + 1 <= self.prefix_len

    @staticmethod
    def _score_dtype(t: torch.Tensor) -> torch.dtype:
        return torch.promote_types(t.dtype, torch.float32)

    def _input_gates(self, tokens: torch.Tensor) -> torch.Tensor:
        """W_ih e(t) [..., 3G] for token ids ``tokens`` [...]."""
        if self.gru_table is not None:
            return self.gru_table[tokens]
        return self.embed(tokens).to(self.w_ih.dtype) @ self.w_ih.T

    def _children(self, states: torch.Tensor, depth: int, top_m: int,
                  k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and float32 log-probs [n, k] of the children of parents ``states`` [n, G]."""
        self._check(states, depth, k)
        if self._is_pure_draft(depth):
            tokens, logprobs = self._prefix_children(depth, k)  # [k], [k], cached for the round
            n = states.shape[0]
            return tokens.repeat(n, 1), logprobs.repeat(n, 1)  # copies: callers may write to them
        return self._corrected_children(states, depth, top_m, k)

    def _pending(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[n, k, G + 1]: each parent's state next to each child's token id (exact in the dtype)."""
        n, k = tokens.shape
        dtype = torch.promote_types(states.dtype, torch.float32 if self.vocab_size <= 2 ** 24 else torch.float64)
        pending = states.new_empty((n, k, self.state_size + 1), dtype=dtype)
        pending[:, :, :-1] = states[:, None]
        pending[:, :, -1] = tokens
        return pending

    def _child_states(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """GRU states [n, k, G] of each parent's path extended by each of its child tokens [n, k]."""
        if self.module_gru:
            n, k = tokens.shape
            return self._module_step(states.repeat_interleave(k, dim=0), tokens.reshape(-1)).view(n, k, -1)
        gh = states @ self.w_hh.T  # [n, 3G], shared by a parent's k children
        return gru_step(self._input_gates(tokens), gh[:, None], states[:, None])

    def _module_step(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[r, G] one step of the ``nn.GRU`` module from ``states`` [r, G] on tokens [r] (reduced precision)."""
        x = self.embed(tokens).to(self.w_ih.dtype)[:, None]  # [r, 1, H]
        _, h = self.prefix_gru(x, states.to(self.w_hh.dtype)[None].contiguous())  # [1, r, G]
        return h[0]

    def base_logprobs(self, depth: int) -> torch.Tensor:
        """[V] float32 base log-probs of a pure-draft ``depth``: the rows given, else log_softmax of the logits.

        Trace replay (treespec/apps/replay/) records these rows and gives them back, because its base
        logits hold only the top-M candidates and cannot be renormalised over the vocabulary.
        """
        if self.prefix_logprobs is not None:
            return self.prefix_logprobs[depth]
        return torch.log_softmax(self.base_logits[depth], dim=-1)

    def _prefix_children(self, depth: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The best k tokens of the base distribution at ``depth`` (identical for every parent)."""
        key = (depth, k)
        if key not in self._prefix:
            logprobs = self.base_logprobs(depth)  # [V]
            chosen, tokens = exact_topk(logprobs[None], min(k, logprobs.numel()))
            self._prefix[key] = (tokens[0], chosen[0])
        return self._prefix[key]

    def _hidden(self, z: torch.Tensor, states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """silu(W1 [z ; s]) [..., E] of rows z [..., H] and states [..., G]: the first projection in
        the drafter's dtype, then cast to ``dtype`` (that of the gathered W2 rows)."""
        return F.silu(torch.cat([z, states.to(z.dtype)], dim=-1) @ self.w1.T).to(dtype)

    def _candidates(self, depth: int, top_m: int) -> tuple[torch.Tensor, ...]:
        """Once per round and depth: top-M ids [M], their base logits [M] and W2 rows [M, E], in >= float32."""
        m = min(top_m, self.vocab_size)
        key = (depth, m)
        if key not in self._gathered:
            row = self.base_logits[depth]  # [V]
            ids = top_set(row[None], m)[0]  # [M] ascending
            dtype = self._score_dtype(self.w2)
            self._gathered[key] = (ids, row[ids].to(dtype), self.w2[ids].to(dtype))
        return self._gathered[key]

    def _corrected_children(self, states: torch.Tensor, depth: int, top_m: int,
                            k: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, base, w2_rows = _checked_candidates(self._candidates, depth, top_m, k)
        hidden = self._hidden(self.rows[depth].expand(states.shape[0], -1), states, w2_rows.dtype)  # [n, E]
        correction = hidden @ w2_rows.T  # [n, M] in >= float32
        logprobs = torch.log_softmax(base + correction, dim=-1)  # [n, M]
        chosen, order = exact_topk(logprobs, k)  # columns are ids ascending: ties go to the lower id
        return ids[order], chosen.float()

    def _anchor_ids(self) -> torch.Tensor:
        """[1] int64 anchor id on the rows' device (a tensor anchor, as `with_round_inputs` gives, is used as is)."""
        if isinstance(self.anchor, torch.Tensor):
            return self.anchor.reshape(1)
        return torch.tensor([self.anchor], device=self.rows.device)

    def round_inputs(self) -> dict[str, torch.Tensor] | None:
        """The drafted rows z [L, H], the base logits [L, V] and the anchor [1]; None for a replayed
        round (its base log-probs are given, not computed)."""
        if self.prefix_logprobs is not None:
            return None
        return {"rows": self.rows, "base_logits": self.base_logits, "anchor": self._anchor_ids()}

    def with_round_inputs(self, inputs: Mapping[str, torch.Tensor]) -> DominoScorer:
        return DominoScorer(rows=inputs["rows"], base_logits=inputs["base_logits"], prefix_gru=self.prefix_gru,
                            embed_proj=self.embed_proj, embed=self.embed, anchor=inputs["anchor"],
                            pure_draft_prefix_len=self.prefix_len, gru_table=self.gru_table)

    @classmethod
    def stack(cls, scorers: Sequence[DominoScorer]) -> DominoStack | None:
        """S rounds' scorers as one `DominoStack`, when they share one drafter's modules and shapes."""
        first = scorers[0]
        shared = all(s.prefix_gru is first.prefix_gru and s.embed_proj is first.embed_proj and s.embed is first.embed
                     and s.gru_table is first.gru_table and s.prefix_len == first.prefix_len
                     and s.rows.shape == first.rows.shape and s.rows.dtype == first.rows.dtype for s in scorers)
        return DominoStack(scorers) if shared else None

    # ------------------------------------------------------------------ RecordableScorer (trace replay)
    def record_round(self, top_m: int) -> dict[str, torch.Tensor]:
        """The drafted rows z [L, H], the top-M base logits of every depth and the top-M base
        log-probs of the pure-draft depths (ties by token id), and the anchor, on the CPU."""
        m, prefix_len = min(top_m, self.vocab_size), min(self.prefix_len, self.depth)
        base_values, base_ids = exact_topk(self.base_logits, m)  # [L, M]
        prefix = [self.base_logprobs(d) for d in range(prefix_len)]
        prefix_rows = torch.stack(prefix) if prefix else self.base_logits[:0]  # [p, V]
        prefix_values, prefix_ids = exact_topk(prefix_rows, m)  # [p, M]
        tensors = {"rows": self.rows, "base_tokens": base_ids.to(torch.int32), "base_logits": base_values,
                   "prefix_tokens": prefix_ids.to(torch.int32), "prefix_logprobs": prefix_values,
                   "anchor": self._anchor_ids().cpu()}
        return {name: t.detach().cpu().clone() for name, t in tensors.items()}

    def record_shared(self, rounds: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
        """The correction head's weights and the GRU input row (W_ih e(t) from the table, else e(t))
        of every token a replayed round can read: its candidates and its anchor."""
        read = torch.cat([rounds[name].reshape(-1).long() for name in ("base_tokens", "prefix_tokens", "anchor")])
        tokens = torch.unique(read)  # [U] ascending
        source = self.gru_table if self.gru_table is not None else self.embed.weight  # [V, W]
        weights = (self.w_ih, self.w_hh, self.w1, self.w2)
        shared = {name: w.detach().cpu().clone() for name, w in zip(_HEAD_KEYS, weights, strict=True)}
        shared |= {"input_tokens": tokens, "input_rows": source[tokens.to(source.device)].detach().cpu().clone()}
        meta = {"prefix_len": min(self.prefix_len, self.depth), "gru_table": self.gru_table is not None,
                "dtype": str(self.rows.dtype).removeprefix("torch.")}
        return shared, meta

    @classmethod
    def merge_shared(cls, parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The weights of the first part; the input rows of every token any part read, once each, ascending."""
        tokens = torch.cat([p["input_tokens"] for p in parts])  # [U'] with repeats
        rows = torch.cat([p["input_rows"] for p in parts])
        unique, inverse = torch.unique(tokens, return_inverse=True)
        first = torch.full((unique.numel(),), tokens.numel(), dtype=torch.int64)
        first.scatter_reduce_(0, inverse, torch.arange(tokens.numel()), reduce="amin")
        return {name: parts[0][name] for name in _HEAD_KEYS} | {"input_tokens": unique, "input_rows": rows[first]}

    @classmethod
    def check_record(cls, rounds: Mapping[str, torch.Tensor], shared: Mapping[str, torch.Tensor], meta: Mapping,
                     vocab_size: int) -> str | None:
        """Every tensor a replay reads present; token ids inside the vocabulary; every round's tensors
        one per anchor; one input row per input token."""
        missing = [n for n in ("rows", "base_tokens", "base_logits", "prefix_tokens", "prefix_logprobs", "anchor")
                   if n not in rounds] + [n for n in (*_HEAD_KEYS, "input_tokens", "input_rows") if n not in shared]
        if missing:
            return f"it lacks {', '.join(missing)}"
        if len({t.shape[0] for t in rounds.values()}) != 1:
            return "its round tensors hold different numbers of anchors"
        for name in ("base_tokens", "prefix_tokens", "anchor", "input_tokens"):
            ids = rounds[name] if name in rounds else shared[name]
            if ids.numel() and bool((ids.min() < 0) | (ids.max() >= vocab_size)):
                return f"{name} holds a token id outside the vocabulary ({vocab_size})"
        for ids, values in (("base_tokens", "base_logits"), ("prefix_tokens", "prefix_logprobs")):
            if rounds[ids].shape != rounds[values].shape:
                return f"{ids} and {values} differ in shape"
        if shared["input_rows"].shape[0] != shared["input_tokens"].numel():
            return "input_rows and input_tokens differ in number"
        return None

    @classmethod
    def replayer(cls, shared: Mapping[str, torch.Tensor], meta: Mapping,
                 vocab_size: int) -> Callable[[Mapping[str, torch.Tensor], int], DominoScorer]:
        """Modules built once around the recorded weights; each round's scorer reads its recorded
        candidates only (-inf elsewhere) and the recorded input rows (NaN for tokens never read)."""
        gru, proj, embed, table = _replay_modules(shared, vocab_size, bool(meta["gru_table"]))
        prefix_len = int(meta["prefix_len"])

        def scorer(round_: Mapping[str, torch.Tensor], anchor: int) -> DominoScorer:
            return cls(rows=round_["rows"], base_logits=_dense(round_["base_tokens"], round_["base_logits"], vocab_size),
                       prefix_gru=gru, embed_proj=proj, embed=embed, anchor=anchor, pure_draft_prefix_len=prefix_len,
                       gru_table=table,
                       prefix_logprobs=_dense(round_["prefix_tokens"], round_["prefix_logprobs"], vocab_size))

        return scorer


_HEAD_KEYS = ("prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight")


def _checked_candidates(candidates: Callable, depth: int, top_m: int, k: int) -> tuple[torch.Tensor, ...]:
    """``candidates(depth, top_m)`` (ids [..., M], base logits, W2 rows) after checking that
    ``top_m`` >= 1 and that the M candidates hold the ``k`` children asked for."""
    if top_m < 1:
        raise ValueError(f"top_m must be >= 1, got {top_m}")
    ids, base, w2_rows = candidates(depth, top_m)
    if k > ids.shape[-1]:
        raise ValueError(f"k = {k} children requested but only top_m = {ids.shape[-1]} candidates exist")
    return ids, base, w2_rows


class DominoStack:
    """S `DominoScorer`s of one drafter as one stacked scorer (`ConditionalScorer.stack`): the
    correction of every sequence's parents in one batched matmul, the GRU steps of all S in one.

    Sequence s's rows are what its own scorer returns: the first projection and the GRU step are
    row-wise products with the shared weights, the last projection multiplies each sequence's
    parents by that sequence's own M gathered W2 rows, and the log-softmax and top-k are per row.
    """

    def __init__(self, scorers: Sequence[DominoScorer]) -> None:
        self.scorers = list(scorers)
        self.first = scorers[0]  # holds the shared weights
        self.rows = torch.stack([s.rows for s in scorers])  # [S, L, H]
        self._prefix: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._gathered: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def root_state(self) -> torch.Tensor:
        return torch.stack([s.root_state() for s in self.scorers])  # [S, G]

    @torch.no_grad()
    def expand(self, states: torch.Tensor, depth: int, *, top_m: int, k: int) -> Expansion:
        tokens, logprobs = self._children(states, depth, top_m, k)
        flat = self.first._child_states(states.flatten(0, 1), tokens.flatten(0, 1))  # [S n, k, G]
        return Expansion(tokens=tokens, logprobs=logprobs, states=flat.view(*tokens.shape, -1))

    @torch.no_grad()
    def expand_deferred(self, states: torch.Tensor, depth: int, *, top_m: int, k: int) -> Expansion:
        tokens, logprobs = self._children(states, depth, top_m, k)
        pending = self.first._pending(states.flatten(0, 1), tokens.flatten(0, 1))  # [S n, k, G + 1]
        return Expansion(tokens=tokens, logprobs=logprobs, states=pending.view(*tokens.shape, -1))

    @torch.no_grad()
    def advance(self, pending: torch.Tensor) -> torch.Tensor:
        """[S, n, G] states of the pending children ``pending`` [S, n, G + 1]."""
        return self.first.advance(pending.flatten(0, 1)).view(*pending.shape[:2], -1)

    def _children(self, states: torch.Tensor, depth: int, top_m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and float32 log-probs [S, n, k] of the children of parents ``states`` [S, n, G]."""
        s, n = states.shape[:2]
        self.first._check(states.flatten(0, 1), depth, k)
        if self.first._is_pure_draft(depth):
            tokens, logprobs = self._prefix_children(depth, k)  # [S, k]
            return tokens[:, None].repeat(1, n, 1), logprobs[:, None].repeat(1, n, 1)  # copies: callers may write
        ids, base, w2_rows = _checked_candidates(self._candidates, depth, top_m, k)
        hidden = self.first._hidden(self.rows[:, depth, None].expand(-1, n, -1), states, w2_rows.dtype)  # [S, n, E]
        correction = hidden @ w2_rows.transpose(1, 2)  # [S, n, M]: each sequence's own candidates
        logprobs = torch.log_softmax(base[:, None] + correction, dim=-1)  # [S, n, M]
        chosen, order = exact_topk(logprobs.flatten(0, 1), k)  # [S n, k], ties to the lower id
        tokens = ids.gather(1, order.reshape(s, n * k)).view(s, n, k)
        return tokens, chosen.float().reshape(s, n, k)

    def _prefix_children(self, depth: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`DominoScorer._prefix_children` of every sequence: one top-k over the S base rows [S, V]."""
        key = (depth, k)
        if key not in self._prefix:
            rows = torch.stack([sc.base_logprobs(depth) for sc in self.scorers])  # [S, V]
            chosen, tokens = exact_topk(rows, min(k, rows.shape[1]))
            self._prefix[key] = (tokens, chosen)
        return self._prefix[key]

    def _candidates(self, depth: int, top_m: int) -> tuple[torch.Tensor, ...]:
        """`DominoScorer._candidates` of every sequence: ids [S, M], base logits [S, M], W2 rows [S, M, E]
        from one top-M selection over the S base rows."""
        m = min(top_m, self.first.vocab_size)
        key = (depth, m)
        if key not in self._gathered:
            rows = torch.stack([sc.base_logits[depth] for sc in self.scorers])  # [S, V]
            ids = top_set(rows, m)  # [S, M] ascending
            dtype = self.first._score_dtype(self.first.w2)
            self._gathered[key] = (ids, rows.gather(1, ids).to(dtype), self.first.w2[ids].to(dtype))
        return self._gathered[key]


def _dense(ids: torch.Tensor, values: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] rows holding ``values`` [R, k] at ``ids`` and -inf elsewhere."""
    out = torch.full((ids.shape[0], vocab), float("-inf"), dtype=values.dtype)
    return out.scatter_(1, ids.long(), values)


def _module_from(module: nn.Module, state: Mapping[str, torch.Tensor]) -> nn.Module:
    """``module`` (built on the meta device) holding the tensors of ``state`` themselves."""
    module.load_state_dict(dict(state), assign=True)
    return module.requires_grad_(False).eval()


def _replay_modules(shared: Mapping[str, torch.Tensor], vocab: int, table: bool):
    """(GRU, correction head, embedding, input table or None) around the recorded tensors."""
    w_ih, w_hh, w1 = shared["prefix_gru.weight_ih_l0"], shared["prefix_gru.weight_hh_l0"], shared["embed_proj.0.weight"]
    hidden, state = w_ih.shape[1], w_hh.shape[1]
    with torch.device("meta"):
        gru = nn.GRU(hidden, state, num_layers=1, batch_first=True, bias=False)
        proj = nn.Sequential(nn.Linear(hidden + state, w1.shape[0], bias=False), nn.SiLU(),
                             nn.Linear(w1.shape[0], vocab, bias=False))
        embed = nn.Embedding(vocab, hidden)
    gru = _module_from(gru, {"weight_ih_l0": w_ih, "weight_hh_l0": w_hh})
    proj = _module_from(proj, {"0.weight": w1, "2.weight": shared["embed_proj.2.weight"]})
    recorded = shared["input_rows"]
    rows = torch.full((vocab, recorded.shape[1]), float("nan"), dtype=recorded.dtype)
    rows[shared["input_tokens"]] = recorded  # [V, W]; NaN marks tokens never recorded
    if table:  # with a table the scorer never reads the embedding: a meta-device module (a shape) serves
        return gru, proj, embed, rows
    return gru, proj, _module_from(embed, {"weight": rows}), None


class DominoDrafter(DFlashDrafter):
    """A DFlash drafter whose output carries the Domino `DominoScorer` (see module docstring)."""

    role = "conditional"  # its drafts carry a ConditionalScorer

    kind: ClassVar[str] = "Domino"

    def __init__(self, config: DFlashConfig | None = None, *, path: str | Path | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 gru_input_table: bool = True) -> None:
        super().__init__(config, path=path, dtype=dtype, device=device)
        self.gru_input_table = gru_input_table  # precompute W_ih e(t) for the whole vocabulary at bind
        self._gru_table: torch.Tensor | None = None

    def _build_model(self, config: DFlashConfig) -> nn.Module:
        return DominoModel(config)

    def _check_kind(self, config: DFlashConfig) -> None:
        if not config.is_domino:
            raise ConfigError("not a Domino checkpoint: dflash_config.projector_type is absent; load it with "
                              "DFlashDrafter (registry name 'dflash'), not DominoDrafter")

    def bind(self, target: Target) -> None:
        super().bind(target)
        reduced = reduced_precision(self.dtype)  # the scorer then steps nn.GRU itself
        self._gru_table = self._build_gru_table() if self.gru_input_table and not reduced else None

    @torch.no_grad()
    def _build_gru_table(self, chunk: int = 8192) -> torch.Tensor:
        """[V, 3G] = E_target W_ih^T, computed in vocabulary chunks to bound the peak memory."""
        embed, w_ih = self._target.embed_tokens.weight, self.model.prefix_gru.weight_ih_l0
        table = w_ih.new_empty((embed.shape[0], w_ih.shape[0]))
        for start in range(0, embed.shape[0], chunk):
            table[start:start + chunk] = embed[start:start + chunk].to(w_ih.dtype) @ w_ih.T
        return table

    def _scorer(self, anchor: int, rows: torch.Tensor, logits: torch.Tensor) -> DominoScorer:
        return DominoScorer(rows=rows, base_logits=logits, prefix_gru=self.model.prefix_gru,
                            embed_proj=self.model.embed_proj, embed=self._target.embed_tokens, anchor=anchor,
                            pure_draft_prefix_len=self.config.domino.pure_draft_prefix_len,
                            gru_table=self._gru_table)
