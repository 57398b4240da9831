"""The committed data store: shards saved and restored byte for byte, and the store in the repository
checked against the embedded target and the Alpaca training split."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from treespec.apps.data.datastore import (
    StoreError,
    read_manifest,
    restore_store,
    save_store,
    shard_metadata,
    stored_shard,
)

STORE = Path(__file__).resolve().parents[1] / "drafters" / "embedded" / "data"


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.2)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def _data(target, out: Path, n: int = 6, model: str = "tiny sha256:" + "0" * 64) -> Path:
    from treespec.apps.data.selfdistill import DistillConfig, write_shards

    g = torch.Generator().manual_seed(3)
    prompts = [(f"p{i}", torch.randint(3, 64, (6,), generator=g).tolist()) for i in range(n)]
    cfg = DistillConfig(num_prompts=n, max_new_tokens=12, batch_size=3, shard_size=4)
    write_shards(target, prompts, out, cfg, stop_ids=[999], pad_id=0, progress=False,
                 metadata={"model": model, "dtype": "float32"})
    return out


def test_a_saved_store_restores_the_shards_byte_for_byte(target, tmp_path):
    data = _data(target, tmp_path / "run")
    assert save_store(data, tmp_path / "store", tokenizer="tok") == ["shard-00000", "shard-00001"]
    assert save_store(data, tmp_path / "store", tokenizer="tok") == []  # nothing new
    manifest = read_manifest(tmp_path / "store")
    assert manifest["target"] == "tiny sha256:" + "0" * 64 and manifest["tokenizer"] == "tok"
    assert [e["rows"] for e in manifest["shards"].values()] == [4, 2]
    assert manifest["shards"]["shard-00001"]["prompts"] == ["p4", "p5"]
    restored = restore_store(tmp_path / "store", tmp_path / "again")
    assert restored == ["shard-00000", "shard-00001"]
    for name in restored:
        assert (tmp_path / "again" / f"{name}.safetensors").read_bytes() == (data / f"{name}.safetensors").read_bytes()
    assert restore_store(tmp_path / "store", tmp_path / "again") == []  # present shards are kept


def test_a_grown_pass_replaces_its_short_last_shard_and_the_pass_resumes_from_a_restore(target, tmp_path):
    """The pass regenerates a short last shard in full when it grows; the store follows."""
    save_store(_data(target, tmp_path / "run", n=6), tmp_path / "store", tokenizer="tok")
    restore_store(tmp_path / "store", tmp_path / "fresh")
    grown = _data(target, tmp_path / "fresh", n=8)  # resumes: shard 0 kept, shard 1 made again in full
    assert save_store(grown, tmp_path / "store", tokenizer="tok") == ["shard-00001"]
    assert read_manifest(tmp_path / "store")["shards"]["shard-00001"]["rows"] == 4


def test_the_teacher_cache_of_restored_data_is_the_cache_of_the_original(target, tmp_path):
    from safetensors import safe_open

    from treespec.apps.training.teacher import TeacherSpec, build_teacher_cache

    data = _data(target, tmp_path / "run")
    save_store(data, tmp_path / "store", tokenizer="tok")
    restore_store(tmp_path / "store", tmp_path / "restored")
    spec, ident = TeacherSpec((0, 2), top_k=8, max_seq_len=24), {"name": "tiny", "sha256": "0" * 64}
    a = build_teacher_cache(target, data, tmp_path / "ca", spec, ident, progress=False)
    b = build_teacher_cache(target, tmp_path / "restored", tmp_path / "cb", spec, ident, progress=False)
    for x, y in zip(a, b, strict=True):
        with safe_open(str(x), framework="pt") as fx, safe_open(str(y), framework="pt") as fy:
            assert sorted(fx.keys()) == sorted(fy.keys())
            for key in fx.keys():  # noqa: SIM118
                assert torch.equal(fx.get_tensor(key), fy.get_tensor(key)), key


def test_bad_stores_are_refused_naming_the_problem(target, tmp_path):
    data = _data(target, tmp_path / "run")
    with pytest.raises(StoreError, match="no data store"):
        restore_store(tmp_path / "nothing", tmp_path / "out")
    with pytest.raises(StoreError, match="no data shards"):
        save_store(tmp_path / "nothing", tmp_path / "store", tokenizer="tok")
    save_store(data, tmp_path / "store", tokenizer="tok")
    with pytest.raises(StoreError, match="differs from the store .* in tokenizer"):
        save_store(_data(target, tmp_path / "other", n=8), tmp_path / "store", tokenizer="other")
    with pytest.raises(StoreError, match="in target"):
        save_store(_data(target, tmp_path / "o2", n=2, model="another sha256:1"), tmp_path / "store", tokenizer="tok")
    shard = tmp_path / "store" / "shard-00000.safetensors.xz"
    shard.write_bytes(lzma.compress(b"not the shard"))
    with pytest.raises(StoreError, match="does not match the manifest"):
        restore_store(tmp_path / "store", tmp_path / "out")


# --- the store committed in the repository ---------------------------------------------------------------

def _passes() -> list[Path]:
    return sorted(p.parent for p in STORE.glob("*/manifest.json"))


def test_the_repository_holds_a_data_store():
    assert _passes(), f"no committed data pass under {STORE}"


@pytest.mark.parametrize("pass_dir", _passes(), ids=lambda p: p.name)
def test_the_committed_data_is_the_embedded_targets_answers_to_alpaca_training_prompts(pass_dir):
    """Every stored shard decompresses to its manifest's bytes, names the pinned target, and holds only
    prompts of the Alpaca training split (never a benchmark prompt)."""
    from safetensors.torch import load

    from treespec.apps.assembly.embedded import SMOLLM2_135M_INSTRUCT
    from treespec.apps.data.datasets import load_prompts

    manifest = read_manifest(pass_dir)
    assert manifest["target"] == SMOLLM2_135M_INSTRUCT.identity
    assert manifest["config"]["dataset"] == "alpaca" and manifest["config"]["split"] == "train"
    train = {p.id for p in load_prompts("alpaca", split="train")}
    bench = {p.id for p in load_prompts("alpaca", split="bench")}
    listed = sorted(f.name.removesuffix(".safetensors.xz") for f in pass_dir.glob("*.safetensors.xz"))
    assert listed == sorted(manifest["shards"])
    for name, entry in manifest["shards"].items():
        raw = stored_shard(pass_dir, name, entry)
        header = shard_metadata(raw)
        assert header["model"] == manifest["target"]
        assert json.loads(header["rows"]) == entry["prompts"]
        assert set(entry["prompts"]) <= train and not set(entry["prompts"]) & bench, name
        tensors = load(raw)
        assert tensors["offsets"].numel() == entry["rows"] + 1
        assert int(tensors["tokens"].max()) < 49152


HELDOUT = STORE.parent / "heldout"


def test_the_committed_held_out_answers_are_the_targets_greedy_answers_to_benchmark_prompts():
    """drafters/embedded/heldout/SET: each set's stored answers name the pinned target, are greedy, and
    answer only prompts of that benchmark's bench split (none of them in any training pass)."""
    from treespec.apps.assembly.embedded import SMOLLM2_135M_INSTRUCT
    from treespec.apps.data.datasets import load_prompts

    sets = sorted(p.parent.name for p in HELDOUT.glob("*/manifest.json"))
    assert sets == ["alpaca", "gsm8k", "humaneval", "mt-bench"]
    trained = {p for d in _passes() for e in read_manifest(d)["shards"].values() for p in e["prompts"]}
    for name in sets:
        manifest = read_manifest(HELDOUT / name)
        assert manifest["target"] == SMOLLM2_135M_INSTRUCT.identity
        config = manifest["config"]
        assert (config["dataset"], config["split"], config["temperature"]) == (name, "bench", 0.0)
        bench = {p.id for p in load_prompts(name, split="bench")}
        for shard, entry in manifest["shards"].items():
            header = shard_metadata(stored_shard(HELDOUT / name, shard, entry))
            assert json.loads(header["rows"]) == entry["prompts"]
            assert set(entry["prompts"]) <= bench and not set(entry["prompts"]) & trained, (name, shard)
