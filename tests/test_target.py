"""TargetModel: prefill taps, tree forwards against plain causal forwards, KV compaction, errors.

This module also holds the tiny-model builders the decoding tests import (``tiny_model``,
``tiny_target``, ``hf_greedy``, ``random_prompts``).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from treespec.apps.kit.tiny import tiny_causal_lm
from treespec.engines.torch import TargetModel
from treespec.target import ContextOverflowError, Target
from treespec.tree import DraftTree

FAMILIES = ("qwen3", "llama")


# ---------------------------------------------------------------------------- builders
def tiny_model(family: str = "qwen3", *, vocab: int = 128, hidden: int = 32, layers: int = 2, seed: int = 0,
               dtype: torch.dtype = torch.float64, attn: str = "sdpa", max_positions: int = 512,
               init: float = 0.5) -> torch.nn.Module:
    """A random-weight causal LM (`treespec.apps.kit.tiny.tiny_causal_lm`)."""
    return tiny_causal_lm(family, vocab=vocab, hidden=hidden, layers=layers, seed=seed, dtype=dtype, attn=attn,
                          max_positions=max_positions, init=init)


def tiny_target(family: str = "qwen3", **kwargs) -> TargetModel:
    return TargetModel(tiny_model(family, **kwargs))


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: torch.Tensor, n: int) -> list[int]:
    """Reference AR greedy decoding with plain transformers calls (causal mask, its own cache)."""
    cache = DynamicCache(config=model.config)
    logits = model(prompt[None], cache=cache, use_cache=True).logits[0, -1]
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model(torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits[0, -1]
    return out


def random_prompts(n: int, vocab: int, *, seed: int = 0, max_len: int = 16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (k,), generator=gen) for k in lengths]


def random_tree(root: int, n: int, vocab: int, gen: torch.Generator) -> DraftTree:
    """A random topological tree of n nodes (siblings may repeat tokens; the target does not care)."""
    parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]
    tokens = [root] + torch.randint(0, vocab, (n - 1,), generator=gen).tolist()
    return DraftTree.build(tokens, parents)


@torch.inference_mode()
def causal_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1]


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_and_taps_match_a_plain_forward(family):
    target = tiny_target(family)
    ids = torch.arange(3, 12)
    out = target.prefill(ids, taps=(0, 1, 2))
    with torch.inference_mode():
        ref = target.model(ids[None], output_hidden_states=True)
    torch.testing.assert_close(out.logits[0], ref.logits[0, -1])
    assert out.features.shape == (9, 3 * target.hidden_size)
    torch.testing.assert_close(out.features[:, :32], target.embed_tokens(ids))  # tap 0 = embeddings
    torch.testing.assert_close(out.features[:, 64:], ref.hidden_states[2][0])
    assert target.length == 9 and target.cache_length() == 9


@pytest.mark.parametrize("family,attn", [("qwen3", "sdpa"), ("qwen3", "eager"), ("llama", "sdpa"), ("llama", "eager")])
def test_tree_forward_equals_causal_forward_of_every_path(family, attn):
    target = tiny_target(family, attn=attn)
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 128, (7,), generator=gen).tolist()
    target.prefill(torch.tensor(prefix), taps=(1,))
    tree = random_tree(5, 12, 128, gen)
    out = target.forward_tree(tree, taps=(1,))
    assert out.logits.shape == (12, 128) and out.features.shape == (12, 32)
    # eager attention takes its softmax in float32 even for a float64 model: float32 tolerance there
    tol = {"atol": 1e-5, "rtol": 1e-5} if attn == "eager" else {}
    for node in range(12):
        path = prefix + tree.tokens[tree.path(node)].tolist()
        torch.testing.assert_close(out.logits[node], causal_logits(target.model, path), **tol)
    with torch.inference_mode():
        hidden = target.model(torch.tensor([prefix + tree.tokens[tree.path(11)].tolist()]),
                              output_hidden_states=True).hidden_states[1][0, -1]
    torch.testing.assert_close(out.features[11], hidden, **tol)


def _fresh_cache(model, ids: list[int]) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.tensor([ids]), cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("family", FAMILIES)
def test_compacted_cache_equals_fresh_prefill_after_many_rounds(family):
    target = tiny_target(family)
    gen = torch.Generator().manual_seed(2)
    committed = torch.randint(0, 128, (6,), generator=gen).tolist()
    target.prefill(torch.tensor(committed[:-1]))
    for _ in range(40):
        tree = random_tree(committed[-1], int(torch.randint(1, 20, (), generator=gen)), 128, gen)
        out = target.forward_tree(tree)
        node = int(torch.randint(0, len(tree), (), generator=gen))  # any node: paths skip siblings
        path = tree.path(node)
        torch.testing.assert_close(out.logits[node], causal_logits(target.model, committed + tree.tokens[path[1:]].tolist()))
        target.commit(torch.tensor(path))
        committed += tree.tokens[path[1:]].tolist() + [int(torch.randint(0, 128, (), generator=gen))]
        assert target.cache_length() == target.length == len(committed) - 1  # the new root is not cached
    fresh = _fresh_cache(target.model, committed[:-1])
    for mine, ref in zip(target.cache.layers, fresh.layers, strict=True):
        assert mine.keys.shape == ref.keys.shape
        torch.testing.assert_close(mine.keys, ref.keys)
        torch.testing.assert_close(mine.values, ref.values)


def test_one_token_prompt_prefills_nothing():
    target = tiny_target()
    out = target.prefill(torch.tensor([]), taps=(0,))
    assert out.logits.shape == (0, 128) and out.features.shape == (0, 32) and target.length == 0
    logits = target.forward_tree(DraftTree.chain(9, [4, 2])).logits
    torch.testing.assert_close(logits[2], causal_logits(target.model, [9, 4, 2]))


def test_context_overflow_is_refused_before_the_model_runs():
    target = tiny_target(max_positions=16)
    with pytest.raises(ContextOverflowError, match="overflow.*16 positions"):
        target.prefill(torch.arange(17))
    target.prefill(torch.arange(14))
    target.forward_tree(DraftTree.chain(1, [2]))  # positions 14, 15: fits
    with pytest.raises(ContextOverflowError, match="position 16"):
        target.forward_tree(DraftTree.chain(1, [2, 3]))


def test_clear_errors():
    target = tiny_target()
    with pytest.raises(RuntimeError, match="before prefill"):
        target.forward_tree(DraftTree.root_only(3))
    with pytest.raises(ValueError, match="tap layers \\[3\\]"):
        target.prefill(torch.arange(4), taps=(0, 3))
    target.prefill(torch.arange(4))
    target.forward_tree(DraftTree.chain(1, [2]))
    with pytest.raises(ValueError, match="start with the root"):
        target.commit(torch.tensor([1]))
    with pytest.raises(ValueError, match="accepted node 2 was not in the last tree forward \\(2 nodes\\)"):
        target.commit(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="tree token 128 is outside the target's vocabulary of 128"):
        target.forward_tree(DraftTree.chain(1, [128]))
    model = tiny_model()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="custom 4D tree mask"):
        TargetModel(model)
    windowed = Qwen3ForCausalLM(Qwen3Config(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                            use_sliding_window=True, sliding_window=4, max_window_layers=0))
    with pytest.raises(ValueError, match="sliding-window"):
        TargetModel(windowed)


def test_contract_attributes():
    target = tiny_target("llama", vocab=64, hidden=16, layers=3, max_positions=100)
    assert (target.vocab_size, target.hidden_size, target.num_hidden_layers) == (64, 16, 3)
    assert target.embed_tokens is target.model.get_input_embeddings()
    assert target.lm_head is target.model.get_output_embeddings()
    assert target.dtype == torch.float64 and target.device.type == "cpu" and target.max_positions == 100
    assert target.config is target.model.config


def test_from_local_loads_safetensors(tmp_path):
    model = tiny_model(dtype=torch.float32)
    model.save_pretrained(tmp_path)
    loaded = TargetModel.from_local(tmp_path, dtype="checkpoint")
    assert loaded.model.config._attn_implementation == "sdpa" and loaded.dtype == torch.float32
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)


# ---------------------------------------------------------------------------- float32 head
@pytest.mark.parametrize("family", FAMILIES)
def test_a_bf16_target_computes_its_final_norm_and_head_in_float32(family):
    model = tiny_model(family, dtype=torch.bfloat16)
    w = model.get_output_embeddings().weight.detach().float().clone()
    norm = model.get_decoder().norm
    seen = []
    norm.register_forward_hook(lambda _m, inputs, _out: seen.append(inputs[0]))
    target = TargetModel(model)
    assert target.dtype == torch.bfloat16 and target.lm_head.weight.dtype == torch.float32
    prompt = torch.tensor([3, 9, 27, 4, 8])
    out = target.prefill(prompt, taps=(1, 2))
    assert out.logits.dtype == torch.float32
    pre_norm = seen[-1][0, -1:]  # the last layer's output, bf16, fed to the norm as float32
    assert seen[-1].dtype == torch.float32
    expected = torch.nn.functional.linear(norm(pre_norm.float()), w)  # float32 throughout
    assert torch.equal(out.logits, expected)
    assert out.features.dtype == torch.float32  # the last tap is the final norm's float32 output


def test_float32_head_off_keeps_the_models_dtype_and_float_models_are_untouched():
    bf16 = TargetModel(tiny_model(dtype=torch.bfloat16), float32_head=False)
    assert bf16.prefill(torch.tensor([1, 2, 3])).logits.dtype == torch.bfloat16
    f64 = TargetModel(tiny_model(dtype=torch.float64))
    assert type(f64.lm_head) is torch.nn.Linear and f64.prefill(torch.tensor([1, 2])).logits.dtype == torch.float64


def test_a_bf16_target_with_a_float32_head_keeps_tree_forwards_equal_to_causal_ones():
    target = TargetModel(tiny_model(dtype=torch.bfloat16))
    first = target.prefill(torch.tensor([5, 6, 7])).logits  # the cache holds 5 6 7; the root 8 comes next
    chain = DraftTree.build([8, 11, 12], [-1, 0, 1])
    logits = target.forward_tree(chain).logits  # [3, V]: a chain is a causal continuation
    again = TargetModel(tiny_model(dtype=torch.bfloat16))
    assert first.dtype == logits.dtype == torch.float32
    reference = again.model(torch.tensor([[5, 6, 7, 8, 11, 12]])).logits[0, -3:].float()
    torch.testing.assert_close(logits, reference, rtol=0, atol=0.05)  # bf16 trunk: same maths, other batching


def test_a_third_engine_is_one_class_and_one_registry_line(tmp_path, monkeypatch):
    """An engine registered beside torch and llama.cpp (here torch's target under another name) is found,
    loaded and decoded by the apps' loader, the Session and the API with nothing else to change."""
    import treespec
    from treespec import registry
    from treespec.apps.assembly.loading import engines, load_target

    class Mirror(TargetModel):
        engine = "mirror"

    monkeypatch.setitem(registry._RUNTIME["engine"], "mirror", Mirror)
    tiny_model(dtype=torch.float32).save_pretrained(tmp_path)
    assert "mirror" in engines() and type(load_target(tmp_path, engine="mirror", dtype="float32")) is Mirror
    prompt = torch.tensor([3, 5, 7, 9])
    mirrored = treespec.generate(tmp_path, prompt, engine="mirror", dtype="float32", max_new_tokens=6)
    plain = treespec.generate(tmp_path, prompt, dtype="float32", max_new_tokens=6)
    assert mirrored.tokens.tolist() == plain.tokens.tolist() == hf_greedy(tiny_model(dtype=torch.float32), prompt, 6)


def test_a_target_states_its_shapes_identity_and_stop_ids():
    target = tiny_target(dtype=torch.float32)
    shapes = target.shapes()
    assert (shapes.hidden_size, shapes.num_hidden_layers, shapes.vocab_size) == (32, 2, 128)
    assert shapes.dtype == torch.float32 or shapes.dtype is None
    assert "dtype" not in target.identity() and target.identity()["hidden_size"] == 32
    assert target.describe() == "float32, cpu"
    assert isinstance(target, Target)
