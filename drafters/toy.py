"""Test drafters with known distributions: fixed marginals, and a small random path-dependent scorer.

Contract
--------
`MarginalDrafter(logits)` drafts ``log_softmax(logits)`` in float32 every round; ``logits`` is a
fixed [L, V] tensor or a function of the `DraftContext` returning one (``MarginalDrafter.random``
makes seeded random rows, optionally quantised so that ties are common).

`ToyConditionalDrafter(config, seed=...)` is Domino in miniature, with random weights drawn from a
seeded ``torch.Generator``.  Each round it draws base log-probs [L, V] and base features z [L, H]
keyed by (seed, anchor, position), and its `ToyScorer` implements `ConditionalScorer`:

    s_0 = GRU(0, e(anchor)),  s_{i+1} = GRU(s_i, e(d_{i+1}))
    correction_i(t) = W2[t] . act(W1_z z_i + W1_s s_i)        (rank R; W1_s = 0 if path-independent)

A parent at depth d inside the pure-draft prefix (d < pure_draft_prefix_len) gets the best k
tokens of base row d with their base log-probs.  Otherwise its candidates are the top-M base
tokens of row d, scored ``log_softmax(base_logprob + correction)`` over those M, best k kept;
rows sorted by log-prob descending, ties by token id ascending.

Two arithmetic modes.  ``exact=True`` (default, for tests): weights on a 2^-8 grid, activations
and states on a 2^-12 grid, hard gates (hard-sigmoid / hard-tanh) and float64 products, so every
sum is exact and a row's result does not depend on the batch it is computed in -- which is what
makes the torch and networkx backends agree bit for bit.  ``exact=False``: a float32 GRU with
sigmoid / tanh / SiLU, for realistic timings (benchmarks).

A state is deferred: [parent's GRU state (G) ; token id] (S = G + 1), and the GRU step runs when
the node is expanded, so only expanded nodes pay for it (children that are never expanded don't).
``embed_rows`` bounds the embedding table (token t reads row t mod embed_rows) for large vocabularies;
``correction_rows`` does the same for W2 (a few rows make tokens share corrections: forced ties).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from treespec.interfaces import (
    ConditionalScorer,
    DraftContext,
    Drafter,
    DraftOutput,
    Expansion,
)
from treespec.topk import exact_topk, order_key

__all__ = ["TOY_PRESETS", "MarginalDrafter", "ToyConditionalDrafter", "ToyConfig", "ToyScorer"]

_W_BITS, _A_BITS = 8, 12  # grid of weights / of activations and states in exact mode


def _generator(*keys: int) -> torch.Generator:
    seed = 0
    for key in keys:
        seed = (seed * 1_000_003 + int(key) + 1) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


def _on_grid(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Round to the nearest multiple of 2^-bits (exact: scaling by a power of two is exact)."""
    return torch.round(x * 2.0**bits) / 2.0**bits


# ---------------------------------------------------------------------------- marginal drafter
class MarginalDrafter(Drafter):
    """Drafts fixed (or context-dependent) marginals: ``log_softmax(logits)`` in float32."""

    def __init__(self, logits: torch.Tensor | Callable[[DraftContext], torch.Tensor]) -> None:
        if isinstance(logits, torch.Tensor) and (logits.dim() != 2 or logits.shape[0] < 1):
            raise ValueError(f"logits must be [L, V], got shape {tuple(logits.shape)}")
        self.logits = logits

    @property
    def reach(self) -> int | None:
        """The rows of fixed logits (None: a function of the context gives them)."""
        return int(self.logits.shape[0]) if isinstance(self.logits, torch.Tensor) else None

    @classmethod
    def random(cls, depth: int, vocab_size: int, *, scale: float = 3.0, quantum: float | None = None,
               seed: int = 0) -> MarginalDrafter:
        """Seeded N(0, scale^2) logits; ``quantum`` rounds them to its multiples (forcing ties)."""
        logits = scale * torch.randn(depth, vocab_size, generator=_generator(seed))
        return cls(logits if quantum is None else torch.round(logits / quantum) * quantum)

    def draft(self, ctx: DraftContext) -> DraftOutput:
        logits = self.logits(ctx) if callable(self.logits) else self.logits
        logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
        return DraftOutput(logprobs=logprobs, root_token=ctx.anchor, position=ctx.position)


# ---------------------------------------------------------------------------- conditional toy
@attrs.frozen
class ToyConfig:
    """Sizes and behaviour of the toy conditional drafter."""

    vocab_size: int = 64  # V
    depth: int = 6  # L, drafted positions per round
    hidden_size: int = 16  # H, width of base features and token embeddings
    gru_size: int = 8  # G, path state width
    rank: int = 4  # R, correction bottleneck
    pure_draft_prefix_len: int = 1  # parents shallower than this use the base rows unchanged
    path_independent: bool = False  # correction ignores the path state (factorized)
    exact: bool = True  # batch-invariant exact arithmetic (see module docstring)
    logit_scale: float = 3.0  # standard deviation of the base logits
    quantum: float | None = None  # round base logits to multiples of this (forces ties)
    embed_rows: int | None = None  # embedding table rows (None: one per token)
    correction_rows: int | None = None  # W2 rows, token t reads row t mod this (None: one per token)
    correction_gain: float = 2.0  # scale of the correction's weights

    def __attrs_post_init__(self) -> None:
        for name in ("vocab_size", "depth", "hidden_size", "gru_size", "rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pure_draft_prefix_len < 0:
            raise ValueError(f"pure_draft_prefix_len must be >= 0, got {self.pure_draft_prefix_len}")


TOY_PRESETS: dict[str, ToyConfig] = {
    "tiny": ToyConfig(),
    "smollm2-sized": ToyConfig(vocab_size=49152, depth=16, hidden_size=576, gru_size=256, rank=64,
                               exact=False, embed_rows=4096),
    "qwen3-4b-sized": ToyConfig(vocab_size=151936, depth=16, hidden_size=2560, gru_size=1024, rank=256,
                                exact=False, embed_rows=4096),
}


@attrs.frozen(eq=False)
class _Weights:
    """The toy's parameters (float64 on grids in exact mode, float32 otherwise)."""

    embed: torch.Tensor  # [rows, H] token embeddings e(t) = embed[t mod rows]
    w_ih: torch.Tensor  # [3G, H] GRU input weights (gates r, z, n)
    w_hh: torch.Tensor  # [3G, G] GRU state weights
    w1_z: torch.Tensor  # [R, H] correction: base-feature part
    w1_s: torch.Tensor  # [R, G] correction: state part (zero when path-independent)
    w2: torch.Tensor  # [rows, R] correction row of token t: w2[t mod rows]


def _init_weights(cfg: ToyConfig, gen: torch.Generator) -> _Weights:
    dtype = torch.float64 if cfg.exact else torch.float32

    def uniform(rows: int, cols: int, gain: float, bits: int = _W_BITS) -> torch.Tensor:
        w = (torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 2 - 1) * gain / cols**0.5
        return (_on_grid(w, bits) if cfg.exact else w).to(dtype)

    g, h = cfg.gru_size, cfg.hidden_size
    rows = cfg.vocab_size if cfg.embed_rows is None else min(cfg.embed_rows, cfg.vocab_size)
    w1_s = uniform(cfg.rank, g, 1.5)
    return _Weights(embed=uniform(rows, h, h**0.5, _A_BITS), w_ih=uniform(3 * g, h, 2.0),
                    w_hh=uniform(3 * g, g, 2.0), w1_z=uniform(cfg.rank, h, 1.5),
                    w1_s=torch.zeros_like(w1_s) if cfg.path_independent else w1_s,
                    w2=uniform(cfg.correction_rows or cfg.vocab_size, cfg.rank, cfg.correction_gain * cfg.rank**0.5))


class ToyConditionalDrafter(Drafter):
    """Domino in miniature with random weights (see the module docstring)."""

    role = "conditional"  # its drafts carry a ConditionalScorer

    def __init__(self, config: ToyConfig | None = None, *, seed: int = 0,
                 generator: torch.Generator | None = None, **overrides) -> None:
        self.config = attrs.evolve(config or ToyConfig(), **overrides)
        self.seed = seed
        self.weights = _init_weights(self.config, generator or _generator(seed, 1))

    @property
    def reach(self) -> int:
        return self.config.depth

    def draft(self, ctx: DraftContext) -> DraftOutput:
        cfg = self.config
        gen = _generator(self.seed, 2, ctx.anchor, ctx.position)
        logits = cfg.logit_scale * torch.randn(cfg.depth, cfg.vocab_size, generator=gen)
        if cfg.quantum is not None:
            logits = torch.round(logits / cfg.quantum) * cfg.quantum
        z = torch.rand(cfg.depth, cfg.hidden_size, generator=gen, dtype=torch.float64) * 2 - 1  # [L, H]
        z = (_on_grid(z, _A_BITS) if cfg.exact else z).to(self.weights.embed.dtype)
        logprobs = torch.log_softmax(logits, dim=-1)
        scorer = ToyScorer(self.weights, cfg, logprobs, z, ctx.anchor)
        return DraftOutput(logprobs=logprobs, root_token=ctx.anchor, position=ctx.position, scorer=scorer)


class ToyScorer(ConditionalScorer):
    """One round's path-dependent children (see the module docstring)."""

    def __init__(self, weights: _Weights, config: ToyConfig, logprobs: torch.Tensor, z: torch.Tensor,
                 anchor: int) -> None:
        self.w, self.cfg = weights, config
        self.logprobs = logprobs  # [L, V] float32 base log-probs
        self.z = z  # [L, H] base features
        self.anchor = anchor
        self._cache: dict[tuple, tuple] = {}

    # ------------------------------------------------------------------ ConditionalScorer
    def root_state(self) -> torch.Tensor:
        """Deferred: the zero state and the anchor, so the first expansion reads e(anchor)."""
        state = torch.zeros(self.cfg.gru_size + 1)
        state[-1] = self.anchor
        return state

    @torch.no_grad()
    def expand(self, states: torch.Tensor, depth: int, *, top_m: int, k: int) -> Expansion:
        self._check(states, depth, top_m, k)
        n = states.shape[0]
        path = self._advance(states)  # [n, G] each parent's own path state
        if depth < self.cfg.pure_draft_prefix_len:
            tokens, logprobs = self._prefix_children(depth, k)
            tokens, logprobs = tokens.expand(n, -1), logprobs.expand(n, -1)
        else:
            tokens, logprobs = self._corrected_children(path, depth, top_m, k)
        kept = tokens.shape[1]
        child_states = torch.cat([path.float()[:, None].expand(n, kept, -1), tokens.float()[..., None]], dim=-1)
        return Expansion(tokens=tokens, logprobs=logprobs, states=child_states)

    # ------------------------------------------------------------------ pieces
    def _check(self, states: torch.Tensor, depth: int, top_m: int, k: int) -> None:
        if not 0 <= depth < self.cfg.depth:
            raise ValueError(f"depth {depth} out of range: children exist for depths 0..{self.cfg.depth - 1}")
        if states.dim() != 2 or states.shape[1] != self.cfg.gru_size + 1:
            raise ValueError(f"states must be [n, {self.cfg.gru_size + 1}], got {tuple(states.shape)}")
        if top_m < 1 or k < 1:
            raise ValueError(f"top_m and k must be >= 1, got top_m={top_m}, k={k}")

    def _advance(self, states: torch.Tensor) -> torch.Tensor:
        """Run the deferred GRU step: [n, S] -> [n, G] (skipped when path-independent)."""
        g = self.cfg.gru_size
        h = states[:, :g].to(self.w.w_hh.dtype)
        if self.cfg.path_independent:
            return h
        x = self.w.embed[states[:, g].long() % self.w.embed.shape[0]]  # [n, H]
        gi, gh = x @ self.w.w_ih.T, h @ self.w.w_hh.T  # [n, 3G] each
        if not self.cfg.exact:
            rz = torch.sigmoid(gi[:, :2 * g] + gh[:, :2 * g])
            cand = torch.tanh(gi[:, 2 * g:] + rz[:, :g] * gh[:, 2 * g:])
            return torch.lerp(cand, h, rz[:, g:])
        rz = _on_grid((0.25 * (gi[:, :2 * g] + gh[:, :2 * g]) + 0.5).clamp(0, 1), _W_BITS)  # hard sigmoid
        cand = _on_grid((gi[:, 2 * g:] + rz[:, :g] * gh[:, 2 * g:]).clamp(-1, 1), _A_BITS)  # hard tanh
        return _on_grid((1 - rz[:, g:]) * cand + rz[:, g:] * h, _A_BITS)

    def _prefix_children(self, depth: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("prefix", depth, k)
        if key not in self._cache:
            values, tokens = exact_topk(self.logprobs[depth][None], min(k, self.cfg.vocab_size))
            self._cache[key] = (tokens[0], values[0])
        return self._cache[key]

    def _candidates(self, depth: int, m: int) -> tuple[torch.Tensor, ...]:
        """Once per round and depth: top-M tokens [M], their base log-probs [M], W2 rows [M, R], W1_z z."""
        key = ("cand", depth, m)
        if key not in self._cache:
            values, tokens = exact_topk(self.logprobs[depth][None], m)
            w2_rows = self.w.w2[tokens[0] % self.w.w2.shape[0]]  # [M, R]
            self._cache[key] = (tokens[0], values[0], w2_rows, self.w.w1_z @ self.z[depth])
        return self._cache[key]

    def _activation(self, pre: torch.Tensor) -> torch.Tensor:
        if self.cfg.exact:
            return _on_grid(pre.clamp(-1, 1), _A_BITS)
        return torch.nn.functional.silu(pre)

    def _corrected_children(self, path: torch.Tensor, depth: int, top_m: int,
                            k: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = min(top_m, self.cfg.vocab_size)
        if k > m:
            raise ValueError(f"k = {k} children requested but only top_m = {m} candidates exist")
        tokens, base, w2_rows, z_part = self._candidates(depth, m)
        rows = path[:1] if self.cfg.path_independent else path  # one row serves every parent when independent
        hidden = self._activation(z_part + rows @ self.w.w1_s.T)  # [n or 1, R]
        logits = base + (hidden @ w2_rows.T).to(torch.float32)  # [n or 1, M] float32
        logprobs = torch.log_softmax(logits, dim=-1)
        best = order_key(logprobs, tokens).topk(k, dim=-1, largest=False, sorted=True).indices  # [., k]
        n = path.shape[0]
        return tokens[best].expand(n, -1), logprobs.gather(-1, best).expand(n, -1)
