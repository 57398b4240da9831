"""The DFlash draft network: Qwen3-style layers whose keys/values are prefixed by the target's context.

Contract
--------
`DFlashModel` holds exactly the parameters of a released z-lab DFlash checkpoint, under the same
names (``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``norm.weight``); it has no embedding table and no
LM head (the target's are used).  The maths of one forward:

    c     = hidden_norm(fc(features))                      context feature of each committed token
    K_ctx = rope(k_norm(k_proj_l(c)), p),  V_ctx = v_proj_l(c)      per layer l, at positions p
    x_0   = embed([anchor, mask, ..., mask])                the block, positions P .. P + B - 1
    x_l   = Qwen3 layer l over x_{l-1}, keys [K_ctx ; K_blk], values [V_ctx ; V_blk], no mask
    z     = norm(x_L)                                        one hidden state per block position

Attention is bidirectional inside the block and sees the whole context.  Positions are arguments
of every call; RoPE and RMSNorm are written here (default RoPE, Qwen3's rotate-half convention).
`ContextCache` keeps K_ctx / V_ctx of committed positions so a round only projects new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from treespec.drafters.config import DFlashConfig

__all__ = ["ContextCache", "DFlashModel", "KV", "RMSNorm", "apply_rope", "rope_cos_sin"]

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [..., n_kv_heads, T, head_dim] each


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), the statistics taken in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., T, head_dim] of default RoPE at absolute ``positions`` [..., T]."""
    # inv_freq_j = theta^(-2j / d), angle = p * inv_freq_j, duplicated over the two halves
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # [d/2]
    angles = positions.float()[..., None] * inv_freq  # [..., T, d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [..., T, d]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., T, d] by the per-position angles: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DraftAttention(nn.Module):
    """Qwen3 attention whose keys/values are [context ; block]; the block attends bidirectionally."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.unflatten(-1, (heads, self.head_dim)).transpose(-3, -2)  # [..., heads, T, d]

    def key_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV:
        """Keys (k_norm, then RoPE) and values of ``x`` [..., T, H]; used for context and block alike."""
        k = apply_rope(self.k_norm(self._split(self.k_proj(x), self.kv_heads)), cos, sin)
        return k, self._split(self.v_proj(x), self.kv_heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: KV,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [..., B, H] block states; ``context`` keys/values [..., n_kv, T_ctx, d]."""
        q = apply_rope(self.q_norm(self._split(self.q_proj(x), self.heads)), cos, sin)  # [..., nh, B, d]
        k_blk, v_blk = self.key_values(x, cos, sin)
        k = torch.cat([context[0].to(k_blk.dtype), k_blk], dim=-2)  # [..., n_kv, T_ctx + B, d]
        v = torch.cat([context[1].to(v_blk.dtype), v_blk], dim=-2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(-3, -2).flatten(-2))  # [..., B, H]


class DraftMLP(nn.Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Pre-norm residual block: attention over [context ; block], then the MLP."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: KV,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModel(nn.Module):
    """The DFlash draft network (see the module docstring); parameter names match the checkpoints."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.draft_vocab_size is not None:  # target id of draft id i = i + d2t[i] (EAGLE-3's layout)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, d] of positions [T]; [S, 1, T, d] (broadcast over heads) of per-row positions [S, T]."""
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)
        return (cos, sin) if positions.dim() == 1 else (cos.unsqueeze(-3), sin.unsqueeze(-3))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Per-layer context keys/values of target ``features`` [..., n, k*H] at ``positions`` [n]."""
        c = self.hidden_norm(self.fc(features))  # [..., n, H]
        cos, sin = self.rope(positions, c.dtype)
        return [layer.self_attn.key_values(c, cos, sin) for layer in self.layers]

    def forward(self, block: torch.Tensor, positions: torch.Tensor, context: Sequence[KV],
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Normed hidden states [..., B, H] of the block embeddings ``block`` [..., B, H].

        ``context[l]`` holds layer l's context keys/values; ``attn_mask`` (optional, bool or additive,
        broadcastable to [..., B, T_ctx + B]) restricts what block positions see (training only).
        """
        if len(context) != len(self.layers):
            raise ValueError(f"context has {len(context)} layers of keys/values, the model {len(self.layers)}")
        cos, sin = self.rope(positions, block.dtype)
        x = block
        for layer, kv in zip(self.layers, context, strict=True):
            x = layer(x, cos, sin, kv, attn_mask)
        return self.norm(x)


class ContextCache:
    """Context keys/values of the committed positions 0 .. length-1, per draft layer.

    Storage grows by doubling, so appending n positions costs O(n) amortised; the block's own
    keys/values are never stored.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._store: list[KV] | None = None  # per layer: [n_kv, capacity, d] keys and values
        self.length = 0

    def reset(self) -> None:
        self._store, self.length = None, 0

    def truncate(self, length: int) -> None:
        """Forget positions >= ``length`` (a no-op when the cache is shorter)."""
        self.length = min(self.length, length)

    def append(self, kv: Sequence[KV]) -> None:
        """Add keys/values [n_kv, n, d] for the next n positions of every layer."""
        n = kv[0][0].shape[-2]
        self._reserve(self.length + n, kv[0][0])
        for (k_store, v_store), (k, v) in zip(self._store, kv, strict=True):
            k_store[:, self.length:self.length + n] = k
            v_store[:, self.length:self.length + n] = v
        self.length += n

    def layer(self, i: int) -> KV:
        """Views [n_kv, length, d] of layer ``i``'s keys and values."""
        if self._store is None:
            raise RuntimeError("the context cache is empty: no features have been appended")
        k, v = self._store[i]
        return k[:, :self.length], v[:, :self.length]

    def layers(self) -> list[KV]:
        return [self.layer(i) for i in range(self.num_layers)]

    def _reserve(self, needed: int, like: torch.Tensor) -> None:
        capacity = 0 if self._store is None else self._store[0][0].shape[-2]
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity, 64)
        shape = (like.shape[0], new_capacity, like.shape[-1])
        grown = [(like.new_empty(shape), like.new_empty(shape)) for _ in range(self.num_layers)]
        for (k_new, v_new), (k_old, v_old) in zip(grown, self._store or [], strict=False):
            k_new[:, :self.length] = k_old[:, :self.length]
            v_new[:, :self.length] = v_old[:, :self.length]
        self._store = grown
