"""The drafter training recipe on a tiny random target: masks, labels, learning, resumption."""

from __future__ import annotations

import json

import pytest
import torch
from tiers import by_default
from transformers import LlamaConfig, LlamaForCausalLM

from treespec.apps.training.trainer import DrafterTrainer
from treespec.drafters.training import BlockRecipe, TrainConfig, decay_weights, init_from_target, new_drafter


# the longer tests alternate which drafter family the default tier runs, so both train on every change
FAMILIES = ("dflash", "domino")


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
    # float32 unless a test asks for autocast: the same arithmetic on every machine (the machine's own
    # choice, a measurement, is tests/test_hardware.py's)
    settings = dict(block_size=4, num_layers=1, anchors_per_sequence=6, steps=30, warmup_steps=2, save_every=10,
                    lr=3e-3, gru_hidden_dim=16, emb_dim=8, autocast_bf16=False) | kw
    cfg = TrainConfig(kind=kind, **settings)
    drafter = new_drafter(target, cfg, mask_token_id=1)
    return DrafterTrainer(BlockRecipe(target, drafter, cfg), out_dir=tmp_path / kind)


def test_block_mask_sees_strict_past_context_and_own_block(target, tmp_path):
    trainer = make(target, tmp_path)
    anchors = torch.tensor([3, 7])
    mask = trainer.recipe.block_mask(anchors, context_len=10)  # [2*4, 10 + 8]
    assert mask.shape == (8, 18)
    assert mask[0, :10].tolist() == [True] * 3 + [False] * 7
    assert mask[5, :10].tolist() == [True] * 7 + [False] * 3
    assert mask[0, 10:].tolist() == [True] * 4 + [False] * 4
    assert mask[7, 10:].tolist() == [False] * 4 + [True] * 4


def test_labels_are_the_tokens_after_the_anchor(target, tmp_path):
    trainer = make(target, tmp_path)
    data = sequences(1)
    tokens, start = data[0]
    batch = trainer.recipe.make_batch(trainer.record(data, 0), torch.Generator().manual_seed(0))
    hard, soft, valid = trainer.recipe.labels(batch)
    a = int(batch.anchors[0])
    depth = trainer.drafter.config.num_drafted
    assert hard[0].tolist() == tokens[a + 1:a + 1 + depth].tolist()
    teacher = torch.softmax(target(input_ids=tokens[None]).logits[0].float(), dim=-1)  # [T, V]
    expected = teacher[a:a + depth]  # row a + d - 1 predicts the token at depth d
    kept = expected >= expected.topk(trainer.cfg.teacher_top_k, dim=-1).values[:, -1:]
    dense = soft.dense(trainer.drafter.config.vocab_size)
    torch.testing.assert_close(dense[0], expected * kept, rtol=1e-5, atol=1e-6)  # the top K, zero elsewhere
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
    probe = trainer.recipe.make_batch(trainer.record(data, 0), torch.Generator().manual_seed(123))
    trainer.step = trainer.cfg.steps  # evaluate Domino on its corrected logits (lam = 0)
    with torch.no_grad():
        before = float(trainer.recipe.batch_loss(probe, trainer.step)[0])
    trainer.step = 0
    trainer.train(data, progress=False)
    with torch.no_grad():
        after = float(trainer.recipe.batch_loss(probe, trainer.step)[0])
    assert after < 0.7 * before, (before, after)


def test_resume_restores_weights_moments_and_step(target, tmp_path):
    trainer = make(target, tmp_path, steps=10)
    trainer.train(sequences(2), progress=False)
    again = make(target, tmp_path, steps=10)
    assert again.resume() and again.step == 10
    for p, q in zip(trainer.drafter.model.parameters(), again.drafter.model.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(trainer.optimizer.state[p]["exp_avg_sq"], again.optimizer.state[q]["exp_avg_sq"])


def test_a_resume_may_raise_the_steps_and_nothing_else(target, tmp_path):
    """A finished run resumed with more steps goes on from where it stopped (the schedule stretched);
    any other change of config is refused, naming the field."""
    make(target, tmp_path, steps=10).train(sequences(2), progress=False)
    with pytest.raises(ValueError, match=r"lr 0.003 there, 0.001 now"):
        make(target, tmp_path, steps=10, lr=1e-3).resume()
    longer = make(target, tmp_path, steps=16, eval_every=0, save_every=4)
    assert longer.resume() and longer.step == 10
    assert longer.learning_rate(10) == pytest.approx(make(target, tmp_path / "fresh", steps=16).learning_rate(10))
    longer.train(sequences(2), progress=False)
    assert longer.step == 16
    assert json.loads((tmp_path / "dflash" / "trainer_state.json").read_text())["step"] == 16


def test_init_from_target_copies_top_layers(target, tmp_path):
    trainer = make(target, tmp_path)
    copied = init_from_target(trainer.drafter, target)
    assert "layers.0.mlp.up_proj.weight" in copied and "norm.weight" in copied
    assert torch.equal(trainer.drafter.model.layers[0].mlp.up_proj.weight, target.model.layers[3].mlp.up_proj.weight)


@pytest.mark.parametrize("kind", ["dflash", "domino"])
def test_export_writes_the_trained_drafter_in_bf16(target, tmp_path, kind):
    from treespec.apps.assembly.loading import load_drafter
    from treespec.apps.commands.train_drafter import export_drafter
    from treespec.drafters.domino import DominoDrafter

    trainer = make(target, tmp_path, kind=kind)
    trainer.train(sequences(), until=2, progress=False)
    out = export_drafter(tmp_path / kind / "drafter", tmp_path / "shipped", torch.bfloat16)
    shipped = load_drafter(out)
    assert isinstance(shipped, DominoDrafter) == (kind == "domino")
    trained = dict(trainer.drafter.model.state_dict())
    for name, value in shipped.model.state_dict().items():
        assert value.dtype == torch.bfloat16, name
        assert torch.equal(value, trained[name].to(torch.bfloat16)), name


# --- the teacher cache and the reduced draft vocabulary ---------------------------------------------


def _distill_dir(target, tmp_path, n=6):
    from treespec.apps.data.selfdistill import DistillConfig, write_shards

    prompts = [(f"p{i}", ids[:8].tolist()) for i, (ids, _) in enumerate(sequences(n, seed=5))]
    cfg = DistillConfig(num_prompts=n, max_new_tokens=20, batch_size=3, shard_size=4)
    write_shards(target, prompts, tmp_path / "data", cfg, stop_ids=[999], pad_id=0, progress=False)
    return tmp_path / "data"


_ID = {"name": "tiny", "sha256": "0" * 64}


def test_the_teacher_cache_holds_the_live_records_and_resumes(target, tmp_path):
    from treespec.apps.data.selfdistill import iter_sequences
    from treespec.apps.training.teacher import TeacherCache, TeacherSpec, build_teacher_cache, live_record

    data = _distill_dir(target, tmp_path)
    spec = TeacherSpec((0, 2, 3), top_k=8, max_seq_len=24)
    paths = build_teacher_cache(target, data, tmp_path / "cache", spec, _ID, progress=False)
    cache = TeacherCache(tmp_path / "cache")
    stored = list(iter_sequences(data))
    assert len(cache) == len(stored) == 6 and len(paths) == 2
    for record, seq in zip(cache, stored):
        live = live_record(target, seq.tokens, seq.response_start, spec)
        assert record.tokens.tolist() == seq.tokens[:24].tolist() and record.response_start == seq.response_start
        for name in ("features", "top_ids", "top_logp", "rest_logp"):
            assert torch.equal(getattr(record, name), getattr(live, name)), name
        mass = record.top_logp.exp().sum(-1) + record.rest_logp.exp()
        torch.testing.assert_close(mass, torch.ones_like(mass), rtol=0, atol=1e-5)
    assert [(t.tolist(), r) for t, r in cache.pairs()] == [(r.tokens.tolist(), r.response_start) for r in cache]
    before = _cache_shard(paths[1])
    paths[1].unlink()
    build_teacher_cache(target, data, tmp_path / "cache", spec, _ID, progress=False)
    assert _cache_shard(paths[1]) == before


def _cache_shard(path):
    """Metadata and tensors of a cache shard (the header's key order is not stable across writes)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata(), {k: handle.get_tensor(k).tolist() for k in handle.keys()}  # noqa: SIM118


def test_a_cache_shard_whose_data_shard_grew_is_built_again(target, tmp_path):
    """distill-data rewrites a short last shard in full when a run grows; its cache shard follows."""
    from treespec.apps.training.teacher import TeacherCache, TeacherSpec, build_teacher_cache

    spec = TeacherSpec((0, 2), top_k=8, max_seq_len=24)
    paths = build_teacher_cache(target, _distill_dir(target, tmp_path, n=6), tmp_path / "cache", spec, _ID,
                                progress=False)
    first = paths[0].stat().st_mtime_ns
    assert len(TeacherCache(tmp_path / "cache")) == 6  # shards of 4 + 2
    build_teacher_cache(target, _distill_dir(target, tmp_path, n=8), tmp_path / "cache", spec, _ID, progress=False)
    assert len(TeacherCache(tmp_path / "cache")) == 8  # shard 1 rebuilt with the prompts added
    assert paths[0].stat().st_mtime_ns == first  # shard 0 left as it was


@pytest.mark.parametrize("change, message", [
    (dict(identity={"name": "other", "sha256": "1" * 64}), "identity: the cache has"),
    (dict(top_k=4), "top_k: the cache has 8, this run 4"),
    (dict(taps=(1,)), "target_layer_ids"),
])
def test_a_teacher_cache_of_other_settings_is_refused(target, tmp_path, change, message):
    from treespec.apps.training.teacher import TeacherCacheError, TeacherSpec, build_teacher_cache

    data = _distill_dir(target, tmp_path, n=2)
    build_teacher_cache(target, data, tmp_path / "c", TeacherSpec((0, 2), top_k=8), _ID, progress=False)
    spec = TeacherSpec(change.get("taps", (0, 2)), top_k=change.get("top_k", 8))
    with pytest.raises(TeacherCacheError, match=message):
        build_teacher_cache(target, data, tmp_path / "c", spec, change.get("identity", _ID), progress=False)


def test_training_refuses_a_cache_for_another_target_taps_or_k(target, tmp_path):
    from treespec.apps.training.teacher import TeacherCache, TeacherCacheError, TeacherSpec, build_teacher_cache

    data = _distill_dir(target, tmp_path, n=2)
    build_teacher_cache(target, data, tmp_path / "c", TeacherSpec((0, 2), top_k=8), _ID, progress=False)
    cache = TeacherCache(tmp_path / "c")
    cache.check(identity=_ID, target_layer_ids=(2,), top_k=8)  # a subset of the taps is fine
    for kwargs, message in ((dict(identity={"name": "x", "sha256": "2"}), "made for target"),
                            (dict(target_layer_ids=(1, 2)), r"lacks target layers \[1\]"),
                            (dict(top_k=32), "keeps the top 8")):
        with pytest.raises(TeacherCacheError, match=message):
            cache.check(**kwargs)
    with pytest.raises(TeacherCacheError, match="no teacher cache here"):
        TeacherCache(tmp_path / "none")


@pytest.mark.parametrize("kind", by_default(FAMILIES, "domino"))
def test_training_from_the_cache_equals_training_live(target, tmp_path, kind):
    from treespec.apps.data.selfdistill import iter_sequences
    from treespec.apps.training.teacher import TeacherCache, TeacherSpec, build_teacher_cache

    data = _distill_dir(target, tmp_path)
    live = make(target, tmp_path / "live", kind=kind, steps=6, teacher_top_k=8, target_layer_ids=(0, 2))
    spec = TeacherSpec((0, 1, 2), top_k=8, max_seq_len=live.cfg.max_seq_len)  # a superset of the taps
    build_teacher_cache(target, data, tmp_path / "cache", spec, _ID, progress=False)
    pairs = [(s.tokens, s.response_start) for s in iter_sequences(data)]
    cached = make(target, tmp_path / "cached", kind=kind, steps=6, teacher_top_k=8, target_layer_ids=(0, 2))
    a = live.train(pairs, progress=False)
    b = cached.train(TeacherCache(tmp_path / "cache"), progress=False)
    assert [x["loss"] for x in a] == [x["loss"] for x in b]
    for p, q in zip(live.drafter.model.parameters(), cached.drafter.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_reduced_vocabulary_covering_every_token_trains_like_the_full_head(target, tmp_path):
    from treespec.training import draft_vocabulary

    data = sequences(2, target=target)
    full = make(target, tmp_path / "full", steps=3, autocast_bf16=False)
    everything = draft_vocabulary(torch.ones(64, dtype=torch.int64), 64)
    cfg = attrs_evolve(full.cfg, draft_vocab_size=64)
    same = DrafterTrainer(BlockRecipe(target, new_drafter(target, cfg, mask_token_id=1, draft_vocab=everything), cfg),
                          out_dir=tmp_path / "same")
    a, b = full.train(data, progress=False), same.train(data, progress=False)
    assert [x["loss"] for x in a] == pytest.approx([x["loss"] for x in b], rel=1e-6)


@pytest.mark.parametrize("kind", by_default(FAMILIES, "dflash"))
def test_a_reduced_vocabulary_trains_and_drafts_only_its_tokens(target, tmp_path, kind):
    from treespec.apps.training.vocabulary import coverage, response_token_counts
    from treespec.training import draft_vocabulary

    data = sequences(3, target=target)
    counts = response_token_counts(data, 64)
    vocab = draft_vocabulary(counts, 24)
    assert vocab.tolist() == sorted(vocab.tolist()) and coverage(vocab, counts) >= 24 / 64
    assert coverage(draft_vocabulary(counts, 64), counts) == 1.0
    ties = torch.tensor([0, 3, 3, 1, 0, 1])
    assert draft_vocabulary(ties, 3).tolist() == [1, 2, 3] and draft_vocabulary(ties, 5).tolist() == [0, 1, 2, 3, 5]
    assert draft_vocabulary(ties, 3, keep=torch.tensor([4])).tolist() == [1, 2, 4]  # kept first, then by count
    with pytest.raises(ValueError, match="cannot keep 2 tokens"):
        draft_vocabulary(ties, 1, keep=torch.tensor([0, 4]))
    cfg = TrainConfig(kind=kind, block_size=4, num_layers=1, anchors_per_sequence=6, steps=4, warmup_steps=1,
                      gru_hidden_dim=16, emb_dim=8, top_m=8, draft_vocab_size=24, save_every=2)
    with pytest.raises(ValueError, match="pass the draft vocabulary"):
        new_drafter(target, cfg, mask_token_id=1)
    trainer = DrafterTrainer(BlockRecipe(target, new_drafter(target, cfg, 1, draft_vocab=vocab), cfg),
                             out_dir=tmp_path / kind)
    history = trainer.train(data, progress=False)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    resumed = DrafterTrainer(BlockRecipe(target, new_drafter(target, cfg, 1, draft_vocab=vocab), cfg),
                             out_dir=tmp_path / kind)
    assert resumed.resume() and torch.equal(resumed.drafter.draft_token_ids, vocab)


def attrs_evolve(cfg, **kw):
    import attrs

    return attrs.evolve(cfg, **kw)


# --- held-out τ without the target ------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "method"), [("dflash", "ddtree@6"), ("domino", "dominotree@6"), ("domino", "domino")])
def test_heldout_tau_equals_live_decoding_tau(target, tmp_path, kind, method):
    from treespec.apps.assembly.methods import build_policy, parse_method
    from treespec.apps.training.evaluate import heldout_tau
    from treespec.apps.training.teacher import TeacherSpec, live_record
    from treespec.decoding import SpeculativeDecoder
    from treespec.engines.torch import TargetModel

    model = target.double()  # float64: one forward over the sequence = the live tree forwards
    trainer = make(model, tmp_path, kind=kind, steps=40, anchors_per_sequence=16, top_m=16, autocast_bf16=False)
    trainer.train(sequences(3, target=model), progress=False)  # a drafter that accepts something
    drafter = trainer.drafter
    drafter.model.double().eval()
    policy = build_policy(parse_method(method))
    live = SpeculativeDecoder(TargetModel(model, max_positions=256), drafter, policy)
    spec = TeacherSpec(drafter.config.target_layer_ids, top_k=4, max_seq_len=256)
    ar = SpeculativeDecoder(TargetModel(model, max_positions=256))
    records, expected = [], []
    for prompt, start in sequences(3, seed=9):
        prompt = prompt[:start]
        answer = ar.generate(prompt, max_new_tokens=40).tokens  # the target's greedy answer, as distilled
        out = live.generate(prompt, max_new_tokens=40)
        assert torch.equal(out.tokens, answer)
        records.append(live_record(model, torch.cat([prompt, answer]), start, spec))
        expected.append(out.stats.taus)
    (result,) = heldout_tau(drafter, {method: policy}, records)
    got = [round(t * n) for t, n in zip(result.per_sequence, map(len, expected))]
    assert got == [sum(t) for t in expected] and result.rounds == sum(map(len, expected))
    assert result.tau > 1.0  # the check is not vacuous
    target.float()


def test_training_scores_held_out_tau_keeps_the_best_and_resumes_it(target, tmp_path):
    import json

    from treespec.apps.training.teacher import TeacherCache, TeacherSpec, build_teacher_cache

    data = _distill_dir(target, tmp_path)
    build_teacher_cache(target, data, tmp_path / "held", TeacherSpec((0, 1, 2, 3), top_k=4), _ID, progress=False)
    heldout = TeacherCache(tmp_path / "held")
    trainer = make(target, tmp_path, steps=6, save_every=3, eval_every=3, eval_methods=("ddtree@4", "dflash"))
    trainer.train(sequences(2, target=target), progress=False, heldout=heldout)
    lines = [json.loads(x) for x in (trainer.out_dir / "eval.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [3, 6] and all(x["tau/ddtree@4"] >= 1 for x in lines)
    assert trainer.best_tau == max(x["tau/ddtree@4"] for x in lines)
    best = json.loads((trainer.out_dir / "best" / "heldout.json").read_text())
    assert best["tau/ddtree@4"] == trainer.best_tau
    svg = (trainer.out_dir / "tau_curve.svg").read_text()  # the run draws its curve beside eval.jsonl
    assert (trainer.out_dir / "tau_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert f"best {trainer.best_tau:.3f} at step" in svg and "ddtree@4" in svg and "dflash" in svg
    from treespec.apps.training.curve import draw_tau_curve

    draw_tau_curve(trainer.out_dir, "ddtree@4")
    assert (trainer.out_dir / "tau_curve.svg").read_text() == svg  # the same lines draw the same bytes
    again = make(target, tmp_path, steps=6, eval_every=3, eval_methods=("ddtree@4", "dflash"))
    assert again.resume() and again.best_tau == trainer.best_tau
    warm = DrafterTrainer(BlockRecipe(target, trainer.drafter, trainer.cfg), out_dir=tmp_path / "warm",
                          init="the run above")
    warm.train(sequences(2, target=target), progress=False, heldout=heldout)  # a warm start scores its start too
    steps = [json.loads(x)["step"] for x in (tmp_path / "warm" / "eval.jsonl").read_text().splitlines()]
    assert steps == [0, 3, 6]


def test_the_base_share_decays_to_its_floor(target, tmp_path):
    trainer = make(target, tmp_path, kind="domino", steps=10, base_share_floor=0.25)
    assert [trainer.recipe.base_share(s) for s in (0, 5, 8, 10)] == [1.0, 0.5, 0.25, 0.25]
    assert make(target, tmp_path, kind="domino", steps=10).recipe.base_share(10) == 0.0


def test_a_warm_start_keeps_the_base_share_at_its_floor_from_the_first_step(target, tmp_path):
    """On a saved Domino drafter the decay does not start over at 1 (which would train the base logits
    alone at first); a start named in the config is kept, and DFlash has no base share to move."""
    cfg = TrainConfig(kind="domino", steps=10, base_share_floor=0.3)
    warm = BlockRecipe.warm_config(cfg)
    assert warm.base_share_start == 0.3 and BlockRecipe.warm_config(attrs_evolve(cfg, base_share_start=0.6)) == (
        attrs_evolve(cfg, base_share_start=0.6))
    assert BlockRecipe.warm_config(TrainConfig(kind="dflash")) == TrainConfig(kind="dflash")
    trainer = make(target, tmp_path, kind="domino", steps=10, base_share_floor=0.3, base_share_start=0.3)
    assert [trainer.recipe.base_share(s) for s in (0, 5, 10)] == [0.3, 0.3, 0.3]
    halfway = make(target, tmp_path, kind="domino", steps=10, base_share_floor=0.25, base_share_start=0.75)
    assert [halfway.recipe.base_share(s) for s in (0, 3, 5, 10)] == [0.75, pytest.approx(0.45), 0.25, 0.25]


def _trained_start(target, out_dir, kind: str, steps: int):
    """(data, draft vocabulary, one-layer config, its trainer after ``steps`` steps): a saved start."""
    from treespec.apps.training.vocabulary import response_token_counts
    from treespec.training import draft_vocabulary

    data = sequences(3, target=target)
    vocab = draft_vocabulary(response_token_counts(data, 64), 24)
    cfg = TrainConfig(kind=kind, block_size=4, num_layers=1, anchors_per_sequence=8, steps=steps, warmup_steps=2,
                      gru_hidden_dim=16, emb_dim=8, top_m=8, draft_vocab_size=24, save_every=10, lr=3e-3,
                      soft_label_share=0.0)
    first = DrafterTrainer(BlockRecipe(target, new_drafter(target, cfg, 1, draft_vocab=vocab), cfg), out_dir=out_dir)
    first.train(data, progress=False)
    return data, vocab, cfg, first


@pytest.mark.parametrize("kind", by_default(FAMILIES, "domino"))
def test_a_warm_start_continues_from_the_saved_drafter(target, tmp_path, kind):
    """``--init``: the saved weights and d2t are the start, the optimiser is fresh, a mismatch is refused."""
    from treespec.drafters.training import warm_start

    data, vocab, cfg, first = _trained_start(target, tmp_path / "a", kind, steps=20)
    start = warm_start(target, cfg, 1, tmp_path / "a" / "drafter")
    assert torch.equal(start.draft_token_ids, vocab)
    for p, q in zip(first.drafter.model.parameters(), start.model.parameters(), strict=True):
        assert torch.equal(p, q)
    probe = first.recipe.make_batch(first.record(data, 0), torch.Generator().manual_seed(5))
    second = DrafterTrainer(BlockRecipe(target, start, cfg), out_dir=tmp_path / "b", init="a")
    assert not second.optimizer.state  # fresh moments
    second.step = first.step  # the same loss weighting, so the probe losses compare
    with torch.no_grad():
        before = float(second.recipe.batch_loss(probe, second.step)[0])
        assert before == pytest.approx(float(first.recipe.batch_loss(probe, first.step)[0]), rel=1e-6)
    second.step = 0
    second.train(data, progress=False)
    second.step = first.step
    with torch.no_grad():
        assert float(second.recipe.batch_loss(probe, second.step)[0]) < before  # the added steps go on lowering the loss
    with pytest.raises(ValueError, match="draft_vocab_size \\(24 saved, 16 asked\\)"):
        warm_start(target, attrs_evolve(cfg, draft_vocab_size=16), 1, tmp_path / "a" / "drafter")
    with pytest.raises(ValueError, match="needs the training responses' token counts"):
        warm_start(target, attrs_evolve(cfg, draft_vocab_size=32), 1, tmp_path / "a" / "drafter")
    with pytest.raises(ValueError, match="no drafter checkpoint"):
        warm_start(target, cfg, 1, tmp_path / "nothing")
    other = DrafterTrainer(BlockRecipe(target, start, cfg), out_dir=tmp_path / "b", init="elsewhere")
    with pytest.raises(ValueError, match="started from a"):
        other.resume()


@pytest.mark.parametrize("kind", by_default(FAMILIES, "dflash"))
def test_a_warm_start_with_more_layers_grows_a_drafter_that_drafts_as_saved(target, tmp_path, kind):
    """``--init`` of a one-layer drafter into a two-layer run: the saved layer first, unchanged; the added
    one the target's next-to-top layer with its output projections zeroed, so the start's loss is the
    saved drafter's; training then opens it; fewer layers than saved are refused."""
    from treespec.drafters.training import warm_start

    data, vocab, cfg, first = _trained_start(target, tmp_path / "a", kind, steps=10)
    two = attrs_evolve(cfg, num_layers=2)
    grown = warm_start(target, two, 1, tmp_path / "a" / "drafter")
    assert len(grown.model.layers) == 2 and torch.equal(grown.draft_token_ids, vocab)
    saved = first.drafter.model.state_dict()
    for name, value in grown.model.state_dict().items():
        if not name.startswith("layers.1."):
            assert torch.equal(value, saved[name]), name
    added, source = grown.model.layers[1], target.model.layers[-2].state_dict()
    for name, param in added.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert not param.any(), name
        elif name in source:
            assert torch.equal(param, source[name].float()), name
    probe = first.recipe.make_batch(first.record(data, 0), torch.Generator().manual_seed(5))
    second = DrafterTrainer(BlockRecipe(target, grown, two), out_dir=tmp_path / "b", init="a")
    second.step = first.step
    with torch.no_grad():
        before = float(second.recipe.batch_loss(probe, second.step)[0])
        assert before == pytest.approx(float(first.recipe.batch_loss(probe, first.step)[0]), rel=1e-5)  # drafts as saved
    second.step = 0
    second.train(data, progress=False)
    assert added.self_attn.o_proj.weight.abs().sum() > 0 and added.mlp.down_proj.weight.abs().sum() > 0
    second.step = first.step
    with torch.no_grad():
        assert float(second.recipe.batch_loss(probe, second.step)[0]) < before
    second.drafter.save_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match="num_hidden_layers \\(2 saved, 1 asked\\)"):
        warm_start(target, cfg, 1, tmp_path / "two")


@pytest.mark.parametrize("kind", by_default(FAMILIES, "domino"))
def test_grown_layers_learn_at_their_multiple_of_the_rate(target, tmp_path, kind):
    """``grown_lr_scale``: the layers a warm start adds take an Adam step that many times as large as at
    1x (a first Adam step is linear in the rate); the saved layers' step is the same either way."""
    from treespec.drafters.training import warm_start

    data, vocab, cfg, first = _trained_start(target, tmp_path / "a", kind, steps=6)
    init = tmp_path / "a" / "drafter"
    moved = {}
    for scale in (1.0, 10.0):
        two = attrs_evolve(cfg, num_layers=2, grown_lr_scale=scale)
        recipe = BlockRecipe(target, warm_start(target, two, 1, init), two)
        scales = recipe.lr_scales(init)
        assert (scales == []) == (scale == 1.0)
        assert BlockRecipe(target, recipe.drafter, two).lr_scales(None) == []  # fresh weights: nothing grown
        trainer = DrafterTrainer(recipe, out_dir=tmp_path / f"s{scale}", init="a", lr_scales=scales)
        before = {n: q.detach().clone() for n, q in recipe.trainable.named_parameters()}
        assert trainer.train_step([(0, trainer.record(data, 0))]) is not None
        moved[scale] = {n: q.detach() - before[n] for n, q in recipe.trainable.named_parameters()}
    added = [n for n in moved[1.0] if n.startswith("layers.1.")]
    assert added and len(added) < len(moved[1.0])
    for name, step in moved[1.0].items():
        expected = 10 * step if name in added else step
        torch.testing.assert_close(moved[10.0][name], expected, rtol=1e-4, atol=1e-7, msg=name)
    assert any(moved[1.0][n].abs().sum() > 0 for n in added)


def _saved_as(state_file, state: dict) -> None:
    """Write ``state`` as the checkpoint's trainer state, its manifest entry with it (what a save would write)."""
    import hashlib

    state_file.write_text(json.dumps(state))
    manifest_file = state_file.resolve().parent / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    data = state_file.read_bytes()
    manifest["files"]["trainer_state.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_file.write_text(json.dumps(manifest))


def test_a_run_saved_before_a_config_field_existed_resumes_at_its_default(target, tmp_path):
    """A trainer state without a field the config gained later reads as the field's default; a saved
    value other than this run's is still refused."""
    trainer = make(target, tmp_path, steps=4)
    trainer.train(sequences(2, target=target), progress=False)
    state_file = tmp_path / "dflash" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["config"]["grown_lr_scale"]
    _saved_as(state_file, state)
    again = make(target, tmp_path, steps=4)
    assert again.resume() and again.step == trainer.step == 4
    state["config"]["grown_lr_scale"] = 3.0
    _saved_as(state_file, state)
    with pytest.raises(ValueError, match="grown_lr_scale 3.0 there, 1.0 now"):
        make(target, tmp_path, steps=4).resume()


@pytest.mark.parametrize("kind", by_default(FAMILIES, "dflash"))
def test_a_warm_start_with_a_larger_head_keeps_the_weights_and_adds_the_most_frequent_tokens(target, tmp_path, kind):
    """``--init`` of a 24-token head into a 32-token run: every weight as saved, the saved tokens kept and
    the 8 most frequent others added; each saved token's logit is the saved drafter's; it trains on."""
    from treespec.apps.training.vocabulary import response_token_counts
    from treespec.drafters.training import warm_start

    data, vocab, cfg, first = _trained_start(target, tmp_path / "a", kind, steps=10)
    counts = response_token_counts(data, 64)
    wide = attrs_evolve(cfg, draft_vocab_size=32)
    grown = warm_start(target, wide, 1, tmp_path / "a" / "drafter", token_counts=counts)
    ids = grown.draft_token_ids
    assert ids.numel() == 32 and torch.equal(ids, ids.sort().values)
    assert set(vocab.tolist()) <= set(ids.tolist())
    added = sorted(set(ids.tolist()) - set(vocab.tolist()))
    others = [t for t in torch.sort(counts, descending=True, stable=True).indices.tolist() if t not in set(vocab.tolist())]
    assert added == sorted(others[:8])
    saved = first.drafter.model.state_dict()
    for name, value in grown.model.state_dict().items():
        if name != "d2t":
            assert torch.equal(value, saved[name]), name
    from treespec.engines.torch import TargetModel

    rows, wrapped = torch.randn(3, target.config.hidden_size), TargetModel(target)
    first.drafter.bind(wrapped)
    grown.bind(wrapped)
    before, after = first.drafter._head_logits(rows), grown._head_logits(rows)  # [3, V]
    assert torch.equal(before[:, vocab], after[:, vocab])  # the saved tokens score as they did
    assert torch.isfinite(after[:, added]).all() and torch.isinf(before[:, added]).all()
    second = DrafterTrainer(BlockRecipe(target, grown, wide), out_dir=tmp_path / "b", init="a")
    second.train(data, progress=False)
    assert second.step == wide.steps
    with pytest.raises(ValueError, match="whole vocabulary"):
        from treespec.drafters.training import grow_vocab

        grow_vocab(new_drafter(target, attrs_evolve(cfg, draft_vocab_size=None), 1), 32, counts)


@pytest.mark.parametrize("kind", ["dflash", "domino"])
def test_bf16_autocast_keeps_float32_masters_and_a_fixed_batchs_loss_within_two_percent(target, tmp_path, kind):
    """bf16 autocast (on CUDA, or a CPU whose bf16 matmul is faster) trains float32 master weights, and the
    loss of a fixed record and anchors is float32's to 2 % (bf16 keeps 8 bits of mantissa: about 0.4 % a
    product; the loss sums many)."""
    trainer = make(target, tmp_path, kind=kind, autocast_bf16=True)
    record = trainer.record(sequences(1, target=target), 0)
    losses = {}
    for enabled in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            losses[enabled] = float(trainer.recipe.loss(record, 0, trainer.step_generator(0)).loss.detach())
    assert abs(losses[True] - losses[False]) <= 0.02 * abs(losses[False])
    assert trainer.autocast and trainer.train_step([(0, record)]) is not None
    assert {p.dtype for p in trainer.params} == {torch.float32}


class _StepClock:
    """A clock on which every training step takes ``per_step`` seconds and every evaluation ``per_eval``."""

    def __init__(self, trainer, per_step: float, per_eval: float = 0.0) -> None:
        self.trainer, self.per_step, self.per_eval, self.evals = trainer, per_step, per_eval, 0
        evaluate = trainer.evaluate

        def counted(heldout):
            self.evals += 1
            return evaluate(heldout)

        trainer.evaluate = counted

    def __call__(self) -> float:
        return self.trainer.step * self.per_step + self.evals * self.per_eval


def test_a_time_box_fits_the_steps_to_the_budget(target, tmp_path):
    from treespec.apps.training.trainer import TimeBox

    trainer = make(target, tmp_path, steps=1000, save_every=1000)
    clock = _StepClock(trainer, per_step=0.5)
    trainer.train(sequences(2), progress=False, box=TimeBox(30.0, probe_steps=5, margin=0.0, clock=clock))
    assert trainer.cfg.steps == trainer.step == 60  # 30 s at 0.5 s a step, the schedule's length fitted
    state = json.loads((trainer.out_dir / "trainer_state.json").read_text())
    assert state["time_box"]["step_seconds"] == pytest.approx(0.5) and state["time_box"]["fitted_steps"] == 60
    assert trainer.learning_rate(59) == pytest.approx(trainer.cfg.lr * 0.1, rel=0.01)  # the cosine ends at the box


def test_a_time_box_counts_evaluations_and_stops_at_its_deadline(target, tmp_path):
    from treespec.apps.training.teacher import TeacherCache, TeacherSpec, build_teacher_cache
    from treespec.apps.training.trainer import TimeBox

    build_teacher_cache(target, _distill_dir(target, tmp_path), tmp_path / "held", TeacherSpec((0, 1, 2, 3), top_k=4),
                        _ID, progress=False)
    trainer = make(target, tmp_path, steps=1000, save_every=1000, eval_every=10, eval_methods=("dflash",))
    clock = _StepClock(trainer, per_step=0.5, per_eval=5.0)  # an evaluation every 10 steps: 1 s a step in all
    trainer.train(sequences(2), progress=False, heldout=TeacherCache(tmp_path / "held"),
                  box=TimeBox(40.0, probe_steps=5, margin=0.0, clock=clock))
    # fitted at 0.5 s a step to 80 steps, then refitted at step 10 to 1 s a step: 40 steps in the 40 s
    assert clock() <= 40.0 and trainer.step == trainer.cfg.steps == 40
    slow = make(target, tmp_path / "slow", steps=1000, save_every=1000)
    clock = _StepClock(slow, per_step=2.0)
    slow.train(sequences(2), progress=False, box=TimeBox(10.0, probe_steps=100, margin=0.0, clock=clock))
    assert slow.step == 5 and slow.cfg.steps == 1000  # no fit (the probe had not ended): stopped at 10 s
    again = make(target, tmp_path / "slow", steps=1000, save_every=1000)
    assert again.resume() and again.step == 5  # a run the deadline stopped resumes where it stopped


@pytest.mark.parametrize("seed", by_default(range(3), 0))
def test_the_sparse_soft_label_loss_equals_the_dense_one(target, tmp_path, seed):
    """`position_loss` reads K columns; the dense formula over all N draft ids gives the same loss."""
    from treespec.drafters.training import SoftLabels

    recipe = make(target, tmp_path, kind="domino").recipe
    g = torch.Generator().manual_seed(seed)
    n, depth, size, k = 5, 3, recipe.draft_ids.numel(), 6
    logits = torch.randn(n, depth, size, generator=g) * 3
    ids = torch.stack([torch.randperm(size, generator=g)[:k] for _ in range(n * depth)]).view(n, depth, k)
    ids[0, 0, :2] = -1  # teacher tokens outside the draft vocabulary
    probs = torch.softmax(torch.randn(n, depth, k, generator=g), -1) * 0.9 * (ids >= 0)
    hard = recipe.draft_ids[torch.randint(size, (n, depth), generator=g)]
    soft = SoftLabels(ids, probs)
    dense = soft.dense(size)  # [n, L, N]
    logp = torch.log_softmax(logits, -1)
    p_rest = (1 - dense.sum(-1)).clamp(min=0)
    q_rest = (1 - (logp.exp() * (dense > 0)).sum(-1)).clamp(min=1e-6)
    ce_soft = -(dense * logp).sum(-1) - p_rest * q_rest.log()
    ce_hard = -logp.gather(-1, recipe.to_draft[hard][..., None])[..., 0]
    s = recipe.config.soft_label_share
    torch.testing.assert_close(recipe.position_loss(logits, hard, soft), (1 - s) * ce_hard + s * ce_soft)
    cand = logits.topk(8, dim=-1).indices
    torch.testing.assert_close(soft.at(cand), dense.gather(-1, cand))
