"""The drafter training recipe on a tiny random target: masks, labels, learning, resumption."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafters.training import DrafterTrainer, TrainConfig, decay_weights, init_from_target, new_drafter


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2)  # a head strong enough to give peaked distributions
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def sequences(n=4, length=48, seed=0, target=None):
    """Random prompts of 8 tokens; the rest is random, or the target's greedy continuation."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 64, (length,), generator=g)
        if target is not None:
            ids = target.generate(ids[None, :8], max_new_tokens=length - 8, do_sample=False, min_new_tokens=length - 8)[0]
        out.append((ids, 8))
    return out


def make(target, tmp_path, kind="dflash", **kw):
    settings = dict(block_size=4, num_layers=1, anchors_per_sequence=6, steps=30, warmup_steps=2, save_every=10,
                    lr=3e-3, gru_hidden_dim=16, emb_dim=8) | kw
    cfg = TrainConfig(kind=kind, **settings)
    drafter = new_drafter(target, cfg, mask_token_id=1)
    return DrafterTrainer(target, drafter, cfg, out_dir=tmp_path / kind)


def test_block_mask_sees_strict_past_context_and_own_block(target, tmp_path):
    trainer = make(target, tmp_path)
    anchors = torch.tensor([3, 7])
    mask = trainer.block_mask(anchors, context_len=10)  # [2*4, 10 + 8]
    assert mask.shape == (8, 18)
    assert mask[0, :10].tolist() == [True] * 3 + [False] * 7
    assert mask[5, :10].tolist() == [True] * 7 + [False] * 3
    assert mask[0, 10:].tolist() == [True] * 4 + [False] * 4
    assert mask[7, 10:].tolist() == [False] * 4 + [True] * 4


def test_labels_are_the_tokens_after_the_anchor(target, tmp_path):
    trainer = make(target, tmp_path)
    tokens, start = sequences(1)[0]
    batch = trainer.make_batch(tokens, start, torch.Generator().manual_seed(0))
    hard, soft, valid = trainer.labels(batch)
    a = int(batch.anchors[0])
    depth = trainer.drafter.config.num_drafted
    assert hard[0].tolist() == tokens[a + 1:a + 1 + depth].tolist()
    assert torch.allclose(soft.sum(-1), torch.ones_like(soft[..., 0]))
    assert bool(batch.anchors.min() >= start - 1) and valid.any()


def test_decay_weights_follow_the_published_formula():
    w = decay_weights(3, 4.0)
    assert torch.allclose(w, torch.tensor([1.0, torch.exp(torch.tensor(-0.25)), torch.exp(torch.tensor(-0.5))]))
    assert TrainConfig(block_size=16).gamma == 7.0 and TrainConfig(block_size=8).gamma == 4.0


@pytest.mark.parametrize("kind", ["dflash", "domino"])
def test_training_lowers_the_held_out_loss(target, tmp_path, kind):
    trainer = make(target, tmp_path, kind=kind, steps=60, soft_label_share=0.0, anchors_per_sequence=16,
                   top_m=16)  # Domino: candidates restricted to 16 of the 64 tokens
    data = sequences(2, target=target)  # self-distillation: the target's own greedy responses
    probe = trainer.make_batch(*data[0], torch.Generator().manual_seed(123))
    trainer.step = trainer.cfg.steps  # evaluate Domino on its corrected logits (lam = 0)
    with torch.no_grad():
        before = float(trainer.loss(probe)[0])
    trainer.step = 0
    trainer.train(data, progress=False)
    with torch.no_grad():
        after = float(trainer.loss(probe)[0])
    assert after < 0.7 * before, (before, after)


def test_resume_restores_weights_moments_and_step(target, tmp_path):
    trainer = make(target, tmp_path, steps=10)
    trainer.train(sequences(2), progress=False)
    again = make(target, tmp_path, steps=10)
    assert again.resume() and again.step == 10
    for p, q in zip(trainer.drafter.model.parameters(), again.drafter.model.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(trainer.optimizer.state[p]["exp_avg_sq"], again.optimizer.state[q]["exp_avg_sq"])


def test_init_from_target_copies_top_layers(target, tmp_path):
    trainer = make(target, tmp_path)
    copied = init_from_target(trainer.drafter, target)
    assert "layers.0.mlp.up_proj.weight" in copied and "norm.weight" in copied
    assert torch.equal(trainer.drafter.model.layers[0].mlp.up_proj.weight, target.model.layers[3].mlp.up_proj.weight)


@pytest.mark.parametrize("kind", ["dflash", "domino"])
def test_export_writes_the_trained_drafter_in_bf16(target, tmp_path, kind):
    from drafters.domino import DominoDrafter
    from treespec.api import load_drafter
    from treespec.commands.train_drafter import export_drafter

    trainer = make(target, tmp_path, kind=kind)
    trainer.train(sequences(), until=2, progress=False)
    out = export_drafter(tmp_path / kind / "drafter", tmp_path / "shipped", torch.bfloat16)
    shipped = load_drafter(out)
    assert isinstance(shipped, DominoDrafter) == (kind == "domino")
    trained = dict(trainer.drafter.model.state_dict())
    for name, value in shipped.model.state_dict().items():
        assert value.dtype == torch.bfloat16, name
        assert torch.equal(value, trained[name].to(torch.bfloat16)), name
