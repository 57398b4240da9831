"""Tiny random-weight causal LMs for examples, tests and benchmarks (no download, no files).

`tiny_causal_lm` builds a Qwen3 or Llama model from a handful of sizes: seeded (``torch.manual_seed``
right before construction, so one seed always gives the same weights), in the dtype asked for, in
eval mode.  ``initializer_range`` (weight std) defaults large enough for varied greedy text.
Extra keyword arguments go to the transformers config (e.g. ``bos_token_id``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tiny_causal_lm"]


def tiny_causal_lm(family: str = "qwen3", *, vocab: int = 128, hidden: int = 32, layers: int = 2,
                   intermediate: int | None = None, heads: int = 4, kv_heads: int = 2, head_dim: int | None = None,
                   max_positions: int = 512, init: float = 0.5, seed: int = 0, dtype: torch.dtype = torch.float64,
                   attn: str = "sdpa", **config: Any) -> torch.nn.Module:
    """A random ``family`` ("qwen3" or "llama") causal LM of the given sizes (see the module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if family not in ("qwen3", "llama"):
        raise ValueError(f"family must be 'qwen3' or 'llama', got {family!r}")
    common = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate or 2 * hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim or hidden // heads, "max_position_embeddings": max_positions,
              "initializer_range": init, "attn_implementation": attn, "tie_word_embeddings": False} | config
    torch.manual_seed(seed)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    return model.to(dtype).eval()
