"""Builders shared by the drafter tests (this module holds no tests).

A tiny random Qwen3 target (transformers' Qwen3ForCausalLM) exposes exactly the attributes a
drafter's ``bind`` may read, plus ``features(tokens)`` = the concatenated hidden-state taps the
decoder would pass.  `Rounds` replays decoding rounds with random accepted tokens so cache tests
can compare an incrementally built drafter with one rebuilt from scratch.
"""

from __future__ import annotations

import torch
from transformers import Qwen3ForCausalLM

from treespec.apps.kit.tiny import tiny_causal_lm
from treespec.drafters.config import DFlashConfig, DominoHeadConfig
from treespec.interfaces import DraftContext

VOCAB, HIDDEN, TARGET_LAYERS = 61, 32, 4


def tiny_config(*, domino: bool = False, block_size: int = 4, shift_label: bool | None = None,
                prefix_len: int = 1, vocab: int = VOCAB, hidden: int = HIDDEN, layer_ids=(0, 2),
                num_target_layers: int = TARGET_LAYERS, mask_token_id: int | None = None) -> DFlashConfig:
    """A 2-layer drafter over a tiny target; Domino heads default to shift_label = True."""
    head = DominoHeadConfig(emb_dim=12, gru_hidden_dim=20, pure_draft_prefix_len=prefix_len) if domino else None
    return DFlashConfig(
        hidden_size=hidden, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=vocab, num_target_layers=num_target_layers,
        target_layer_ids=layer_ids, mask_token_id=vocab - 1 if mask_token_id is None else mask_token_id,
        block_size=block_size, shift_label=domino if shift_label is None else shift_label,
        rope_theta=10_000.0, domino=head)


class TinyTarget:
    """The target attributes a drafter may use, over a random Qwen3ForCausalLM."""

    def __init__(self, model: Qwen3ForCausalLM) -> None:
        self.model = model
        self.embed_tokens = model.model.embed_tokens
        self.lm_head = model.lm_head
        self.hidden_size = model.config.hidden_size
        self.vocab_size = model.config.vocab_size
        self.num_hidden_layers = model.config.num_hidden_layers
        self.dtype = model.dtype
        self.device = model.device

    @torch.no_grad()
    def features(self, tokens: torch.Tensor, taps: tuple[int, ...]) -> torch.Tensor:
        """[T, len(taps) * H]: hidden_states[t] for t in taps, concatenated on the last dim."""
        out = self.model(tokens[None], output_hidden_states=True)
        return torch.cat([out.hidden_states[t][0] for t in taps], dim=-1)


def tiny_target(*, vocab: int = VOCAB, hidden: int = HIDDEN, layers: int = TARGET_LAYERS,
                dtype: torch.dtype = torch.float64, seed: int = 0) -> TinyTarget:
    return TinyTarget(tiny_causal_lm(vocab=vocab, hidden=hidden, layers=layers, intermediate=64, head_dim=8,
                                     init=0.02, seed=seed, dtype=dtype))


class Rounds:
    """Replays decoding rounds: committed tokens grow by (accepted + bonus) each round."""

    def __init__(self, target: TinyTarget, taps: tuple[int, ...], *, prompt_len: int = 7, seed: int = 0) -> None:
        self.target, self.taps = target, taps
        self.generator = torch.Generator().manual_seed(seed)
        self.sequence = self._random(prompt_len + 1)  # the prompt and the first bonus token
        self.pending_start = 0  # first position whose features the drafter has not seen

    def _random(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.target.vocab_size - 1, (n,), generator=self.generator)

    def context(self) -> DraftContext:
        """The DraftContext of the current round (features of the positions not yet sent)."""
        anchor_position = self.sequence.numel() - 1
        feats = self.target.features(self.sequence[:anchor_position], self.taps)[self.pending_start:]
        ctx = DraftContext(sequence=self.sequence.clone(), features=feats, feature_start=self.pending_start)
        self.pending_start = anchor_position
        return ctx

    def commit(self, accepted: int) -> None:
        """Accept ``accepted`` drafted tokens and a bonus token after the current anchor."""
        self.sequence = torch.cat([self.sequence, self._random(accepted + 1)])

    def full_context(self) -> DraftContext:
        """All features 0..P-1 at once, as a freshly reset drafter would need them."""
        anchor_position = self.sequence.numel() - 1
        feats = self.target.features(self.sequence[:anchor_position], self.taps)
        return DraftContext(sequence=self.sequence.clone(), features=feats, feature_start=0)
