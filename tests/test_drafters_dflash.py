"""The DFlash drafter on a tiny random Qwen3 target: maths, context cache, and errors."""

from __future__ import annotations

import pytest
import torch
from test_drafters_support import Rounds, tiny_config, tiny_target
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from treespec.drafters._layers import ContextCache
from treespec.drafters.dflash import DFlashDrafter, DrafterMismatchError
from treespec.interfaces import DraftContext


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def bound(config, target, **kwargs) -> DFlashDrafter:
    drafter = DFlashDrafter.random(config, dtype=torch.float64, **kwargs)
    drafter.bind(target)
    return drafter


def _loaded(module: torch.nn.Module, state: dict, prefix: str) -> torch.nn.Module:
    module.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    return module.to(torch.float64)


def reference_block_states(drafter: DFlashDrafter, target, ctx: DraftContext) -> torch.Tensor:
    """The upstream maths in one pass over [context ; block], built from transformers' Qwen3 modules."""
    cfg, state = drafter.config, drafter.model.state_dict()
    qcfg = Qwen3Config(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                       head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                       rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default"})
    norm = lambda name, dim: _loaded(Qwen3RMSNorm(dim, cfg.rms_norm_eps), state, name)  # noqa: E731
    p, b, d = ctx.position, cfg.block_size, cfg.head_dim
    context = norm("hidden_norm.", cfg.hidden_size)(ctx.features @ state["fc.weight"].T)  # [P, H]
    ids = torch.tensor([ctx.anchor] + [cfg.mask_token_id] * (b - 1))
    x = target.embed_tokens(ids)  # [B, H]
    cos, sin = Qwen3RotaryEmbedding(qcfg)(x, torch.arange(p + b)[None])  # [1, P+B, d]
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}."
        h = norm(pre + "input_layernorm.", cfg.hidden_size)(x)
        q = norm(pre + "self_attn.q_norm.", d)((h @ state[pre + "self_attn.q_proj.weight"].T).view(1, b, -1, d))
        keys_in = torch.cat([context, h])  # [P+B, H]: the context feature and the block share k/v projections
        k = (keys_in @ state[pre + "self_attn.k_proj.weight"].T).view(1, p + b, -1, d)
        k = norm(pre + "self_attn.k_norm.", d)(k)
        v = (keys_in @ state[pre + "self_attn.v_proj.weight"].T).view(1, p + b, -1, d).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos[:, p:], sin[:, p:])
        _, k = apply_rotary_pos_emb(k.transpose(1, 2), k.transpose(1, 2), cos, sin)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        weights = torch.softmax(q @ repeat_kv(k, groups).transpose(-1, -2) * d ** -0.5, dim=-1)  # no mask
        attended = (weights @ repeat_kv(v, groups)).transpose(1, 2).reshape(b, -1)
        x = x + attended @ state[pre + "self_attn.o_proj.weight"].T
        mlp = _loaded(Qwen3MLP(Qwen3Config(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size)),
                      state, pre + "mlp.")
        x = x + mlp(norm(pre + "post_attention_layernorm.", cfg.hidden_size)(x))
    return norm("norm.", cfg.hidden_size)(x)


@pytest.mark.parametrize("shift_label", [False, True])
def test_draft_matches_the_reference_maths(target, shift_label):
    drafter = bound(tiny_config(block_size=5, shift_label=shift_label), target)
    rounds = Rounds(target, drafter.tap_layers)
    ctx = rounds.context()
    out = drafter.draft(ctx)
    z = reference_block_states(drafter, target, ctx)
    expected = torch.log_softmax(target.lm_head(z[0 if shift_label else 1:]), dim=-1)
    assert out.logprobs.shape == (5 if shift_label else 4, target.vocab_size)
    torch.testing.assert_close(out.logprobs, expected.float(), rtol=0, atol=1e-5)


def test_one_round_gives_normalised_logprobs(target):
    drafter = bound(tiny_config(block_size=4), target)
    assert drafter.tap_layers == (1, 3)
    ctx = Rounds(target, drafter.tap_layers).context()
    out = drafter.draft(ctx)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (3, target.vocab_size)
    torch.testing.assert_close(out.logprobs.exp().sum(-1), torch.ones(3), rtol=0, atol=1e-5)
    assert (out.root_token, out.position, out.scorer) == (ctx.anchor, ctx.position, None)
    assert drafter.cache.length == ctx.position  # the block's keys/values are not kept


def test_cache_after_rounds_equals_a_rebuilt_cache(target):
    config = tiny_config(block_size=4)
    drafter = bound(config, target)
    rounds = Rounds(target, drafter.tap_layers, prompt_len=60, seed=3)  # the cache's storage grows past 64
    drafter.draft(rounds.context())
    for accepted in (2, 0, 3, 1):
        rounds.commit(accepted)
        incremental = drafter.draft(rounds.context())
    fresh = bound(config, target)
    rebuilt = fresh.draft(rounds.full_context())
    assert drafter.cache.length == fresh.cache.length == rounds.sequence.numel() - 1
    for (k1, v1), (k2, v2) in zip(drafter.cache.layers(), fresh.cache.layers(), strict=True):
        torch.testing.assert_close(k1, k2, rtol=0, atol=1e-12)
        torch.testing.assert_close(v1, v2, rtol=0, atol=1e-12)
    torch.testing.assert_close(incremental.logprobs, rebuilt.logprobs, rtol=0, atol=1e-6)


def test_context_cache_appends_in_chunks_like_one_concatenation():
    gen = torch.Generator().manual_seed(0)
    chunks = [[(torch.randn(2, n, 3, generator=gen), torch.randn(2, n, 3, generator=gen)) for _ in range(2)]
              for n in (50, 1, 30, 70)]
    cache = ContextCache(num_layers=2)
    for chunk in chunks:
        cache.append(chunk)
    assert cache.length == 151
    for layer in range(2):
        keys, values = cache.layer(layer)
        assert torch.equal(keys, torch.cat([c[layer][0] for c in chunks], dim=1))
        assert torch.equal(values, torch.cat([c[layer][1] for c in chunks], dim=1))
    cache.truncate(40)
    assert cache.layer(1)[0].shape == (2, 40, 3) and torch.equal(cache.layer(1)[0], chunks[0][1][0][:, :40])


def test_features_from_an_earlier_position_rewind_the_cache(target):
    config = tiny_config()
    drafter = bound(config, target)
    rounds = Rounds(target, drafter.tap_layers)
    drafter.draft(rounds.context())
    rounds.commit(2)
    drafter.draft(rounds.context())
    full = rounds.full_context()
    rewound = drafter.draft(DraftContext(sequence=full.sequence, features=full.features[3:], feature_start=3))
    torch.testing.assert_close(rewound.logprobs, bound(config, target).draft(full).logprobs, rtol=0, atol=1e-6)


def test_reset_forgets_the_sequence(target):
    drafter = bound(tiny_config(), target)
    rounds = Rounds(target, drafter.tap_layers)
    drafter.draft(rounds.context())
    drafter.reset()
    assert drafter.cache.length == 0
    rounds.commit(1)
    with pytest.raises(DrafterMismatchError, match="features start at position 7 but the drafter's context ends at 0"):
        drafter.draft(rounds.context())


def test_a_bfloat16_checkpoint_runs_in_the_targets_dtype(tmp_path):
    target32 = tiny_target(dtype=torch.float32)
    DFlashDrafter.random(tiny_config(), dtype=torch.bfloat16).save_pretrained(tmp_path)
    drafter = DFlashDrafter.from_pretrained(tmp_path)
    assert drafter.dtype == torch.bfloat16
    drafter.bind(target32)  # without dtype=, the drafter computes in the target's dtype
    assert drafter.dtype == torch.float32
    out = drafter.draft(Rounds(target32, drafter.tap_layers).context())
    assert out.logprobs.dtype == torch.float32 and torch.isfinite(out.logprobs).all()


# ---------------------------------------------------------------------------- errors
def test_draft_before_bind_is_an_error(target):
    drafter = DFlashDrafter.random(tiny_config())
    with pytest.raises(RuntimeError, match=r"bind\(target\) must be called before draft"):
        drafter.draft(Rounds(target, drafter.tap_layers).context())


@pytest.mark.parametrize(("target_kwargs", "config_kwargs", "message"), [
    ({"hidden": 48}, {}, "hidden size 32 does not match the target's hidden size 48"),
    ({"vocab": 70}, {}, "vocabulary 61 does not match the target's vocabulary 70"),
    ({"layers": 2}, {}, r"target_layer_ids \[2\] are beyond the target's 2 layers"),
    ({"layers": 6}, {}, "trained on a 4-layer target, the target has 6 layers"),
    ({}, {"vocab": 80, "mask_token_id": 70}, r"mask token 70 is outside the target's vocabulary \(61 tokens\)"),
])
def test_bind_refuses_a_mismatched_target(target_kwargs, config_kwargs, message):
    drafter = DFlashDrafter.random(tiny_config(**config_kwargs))
    with pytest.raises(DrafterMismatchError, match=message):
        drafter.bind(tiny_target(**target_kwargs))


def test_features_of_the_wrong_width_are_refused(target):
    drafter = bound(tiny_config(), target)
    ctx = Rounds(target, drafter.tap_layers).context()
    with pytest.raises(DrafterMismatchError, match=r"features must be \[n, 64\]"):
        drafter.draft(DraftContext(sequence=ctx.sequence, features=ctx.features[:, :32]))


def test_features_must_reach_the_anchor(target):
    drafter = bound(tiny_config(), target)
    ctx = Rounds(target, drafter.tap_layers).context()
    with pytest.raises(DrafterMismatchError, match="covers positions 0..5 but the anchor sits at position 7"):
        drafter.draft(DraftContext(sequence=ctx.sequence, features=ctx.features[:6]))


def test_attention_mask_argument_reaches_attention(target):
    """The optional mask argument reaches attention: masking the whole context equals an empty context."""
    drafter = bound(tiny_config(), target)
    model = drafter.model
    feats = torch.randn(5, 64, dtype=torch.float64)
    block = torch.randn(4, 32, dtype=torch.float64)
    context = model.context_kv(feats, torch.arange(5))
    no_context = [(k[:, :0], v[:, :0]) for k, v in context]
    mask = torch.cat([torch.zeros(4, 5, dtype=torch.bool), torch.ones(4, 4, dtype=torch.bool)], dim=1)
    masked = model(block, torch.arange(5, 9), context, attn_mask=mask)
    torch.testing.assert_close(masked, model(block, torch.arange(5, 9), no_context), rtol=0, atol=1e-12)
    assert not torch.allclose(masked, model(block, torch.arange(5, 9), context))


@pytest.mark.parametrize("domino", [False, True])
def test_a_one_token_prompt_drafts_from_an_empty_context(domino):
    from test_target import tiny_model

    from treespec.decoding import SpeculativeDecoder
    from treespec.drafters.domino import DominoDrafter
    from treespec.policies.ddtree import DDTree
    from treespec.policies.dominotree import DominoTree
    from treespec.engines.torch import TargetModel

    target = TargetModel(tiny_model("qwen3", vocab=64, hidden=32, layers=4))
    config = tiny_config(vocab=64, hidden=32, num_target_layers=4, layer_ids=(0, 2), block_size=4, domino=domino)
    drafter = (DominoDrafter if domino else DFlashDrafter).random(config, dtype=torch.float64, seed=1)
    policy = DominoTree(budget=8) if domino else DDTree(budget=8)
    prompt = torch.tensor([5])  # nothing precedes the anchor: the drafter's context is empty
    spec = SpeculativeDecoder(target, drafter, policy).generate(prompt, max_new_tokens=12)
    ar = SpeculativeDecoder(target).generate(prompt, max_new_tokens=12)
    assert torch.equal(spec.tokens, ar.tokens)


# --- a reduced draft vocabulary (draft_vocab_size + d2t) -------------------------------------------


def _reduced_pair(target, *, domino: bool = False, n: int = 9):
    """A full-vocabulary drafter and the same weights with a head over ``n`` scattered tokens."""
    import attrs

    from treespec.drafters.domino import DominoDrafter

    cls = DominoDrafter if domino else DFlashDrafter
    full = cls.random(tiny_config(domino=domino), dtype=torch.float64)
    reduced = cls(attrs.evolve(full.config, draft_vocab_size=n), dtype=torch.float64)
    reduced.model.load_state_dict(full.model.state_dict(), strict=False)
    ids = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(1))[:n]
    reduced.set_draft_vocab(ids)
    for d in (full, reduced):
        d.bind(target)
    return full, reduced, ids


@pytest.mark.parametrize("domino", [False, True])
def test_a_reduced_head_drafts_the_full_heads_logits_renormalised_over_its_tokens(target, domino):
    full, reduced, ids = _reduced_pair(target, domino=domino)
    ctx = Rounds(target, full.tap_layers).context()
    a, b = full.draft(ctx), reduced.draft(ctx)
    assert torch.equal(reduced.draft_token_ids, ids)
    outside = torch.ones(target.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(b.logprobs[:, outside]).all()
    torch.testing.assert_close(b.logprobs[:, ids], torch.log_softmax(a.logprobs[:, ids], dim=-1), rtol=0, atol=1e-6)
    if domino:  # the correction's candidates come from the reduced head's tokens only
        first = b.scorer.expand(b.scorer.root_state()[None], 0, top_m=4, k=4)
        second = b.scorer.expand(first.states[0], 1, top_m=4, k=4)
        assert torch.isin(first.tokens, ids).all() and torch.isin(second.tokens, ids).all()


def test_a_reduced_head_round_trips_and_loads_strictly(target, tmp_path):
    import json

    from treespec.drafters._checkpoint import CheckpointError

    full, reduced, ids = _reduced_pair(target)
    reduced.save_pretrained(tmp_path / "r")
    assert json.loads((tmp_path / "r" / "config.json").read_text())["draft_vocab_size"] == 9
    loaded = DFlashDrafter.from_pretrained(tmp_path / "r")
    loaded.bind(target)
    assert torch.equal(loaded.draft_token_ids, ids) and loaded.model.d2t.dtype == torch.int64
    full.save_pretrained(tmp_path / "f")
    assert "draft_vocab_size" not in json.loads((tmp_path / "f" / "config.json").read_text())
    assert DFlashDrafter.from_pretrained(tmp_path / "f").draft_token_ids is None
    raw = json.loads((tmp_path / "f" / "config.json").read_text())
    (tmp_path / "f" / "config.json").write_text(json.dumps(raw | {"draft_vocab_size": 9}))
    with pytest.raises(CheckpointError, match="missing keys: d2t"):
        DFlashDrafter.from_pretrained(tmp_path / "f")
    (tmp_path / "r" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="unexpected keys: d2t"):
        DFlashDrafter.from_pretrained(tmp_path / "r")


def test_a_draft_vocabulary_must_be_distinct_ids_of_the_right_count(target):
    import attrs

    from treespec.drafters.config import ConfigError

    drafter = DFlashDrafter.random(attrs.evolve(tiny_config(), draft_vocab_size=3), dtype=torch.float64)
    for bad, message in (([1, 2], "exactly draft_vocab_size = 3"), ([1, 1, 2], "distinct"),
                         ([1, 2, target.vocab_size], "distinct and in")):
        with pytest.raises(ValueError, match=message):
            drafter.set_draft_vocab(torch.tensor(bad))
    with pytest.raises(ConfigError, match="draft_vocab_size must be in 1..vocab_size"):
        attrs.evolve(tiny_config(), draft_vocab_size=0)
