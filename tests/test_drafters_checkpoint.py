"""Config parsing and checkpoint I/O of the DFlash / Domino drafters in the released layouts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from treespec import registry
from treespec.drafters._checkpoint import CheckpointError
from treespec.drafters.config import ConfigError, DFlashConfig, preset, read_config
from treespec.drafters.dflash import DFlashDrafter
from treespec.drafters.domino import DominoDrafter

H, FF, NH, NKV, HD, V, LAYERS, E, G = 32, 48, 4, 2, 8, 61, 2, 12, 20
TAPS = [0, 2]


def released_config(*, domino: bool = False) -> dict:
    """A config.json shaped like z-lab/Qwen3-4B-DFlash-b16 (or the Domino b16 release), tiny sizes."""
    cfg = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "attention_bias": False, "attention_dropout": 0.0, "block_size": 4, "dtype": "bfloat16",
        "head_dim": HD, "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02,
        "intermediate_size": FF, "layer_types": ["full_attention"] * LAYERS, "max_position_embeddings": 40960,
        "max_window_layers": LAYERS, "model_type": "qwen3", "num_attention_heads": NH,
        "num_hidden_layers": LAYERS, "num_key_value_heads": NKV, "num_target_layers": 4, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
        "transformers_version": "4.57.1", "use_cache": True, "use_sliding_window": False, "vocab_size": V,
        "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": TAPS},
    }
    if domino:
        cfg["architectures"] = ["DominoDraftModel"]
        cfg["emb_dim"] = E
        cfg["dflash_config"].update(projector_type="domino", emb_dim=E, gru_hidden_dim=G, pure_draft_prefix_len=1,
                                    shift_label=True)
    return cfg


def released_shapes(*, domino: bool = False) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the released checkpoints, written out independently of the model."""
    shapes = {"fc.weight": (H, len(TAPS) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (NH * HD, H), p + "self_attn.k_proj.weight": (NKV * HD, H),
            p + "self_attn.v_proj.weight": (NKV * HD, H), p + "self_attn.o_proj.weight": (H, NH * HD),
            p + "self_attn.q_norm.weight": (HD,), p + "self_attn.k_norm.weight": (HD,),
            p + "mlp.gate_proj.weight": (FF, H), p + "mlp.up_proj.weight": (FF, H), p + "mlp.down_proj.weight": (H, FF),
        })
    if domino:
        shapes.update({"prefix_gru.weight_ih_l0": (3 * G, H), "prefix_gru.weight_hh_l0": (3 * G, G),
                       "embed_proj.0.weight": (E, H + G), "embed_proj.2.weight": (V, E)})
    return shapes


def write_checkpoint(directory, config: dict, shapes: dict, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return tensors


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key


# ---------------------------------------------------------------------------- config
def test_released_dflash_config_parses_and_round_trips():
    config = DFlashConfig.from_dict(released_config())
    assert (config.block_size, config.mask_token_id, config.target_layer_ids) == (4, V - 1, (0, 2))
    assert config.tap_layers == (1, 3) and config.num_drafted == 3 and not config.is_domino
    assert config.rope_theta == 1e6 and config.num_target_layers == 4
    again = DFlashConfig.from_dict(config.to_dict())
    assert again == config
    assert again.to_dict()["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}  # unknown keys kept


def test_transformers_v5_rope_parameters_are_read():
    cfg = released_config()
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "default"}
    assert DFlashConfig.from_dict(cfg).rope_theta == 5e5


def test_released_domino_config_parses():
    config = DFlashConfig.from_dict(released_config(domino=True))
    assert config.is_domino and config.shift_label and config.num_drafted == 4
    assert (config.domino.emb_dim, config.domino.gru_hidden_dim, config.domino.pure_draft_prefix_len) == (E, G, 1)
    written = config.to_dict()
    assert written["emb_dim"] == E and written["dflash_config"]["projector_type"] == "domino"
    assert DFlashConfig.from_dict(written) == config


def test_presets_match_the_released_architectures():
    dflash, domino = preset("qwen3-4b-dflash-b16"), preset("qwen3-4b-domino-b16")
    assert dflash.tap_layers == (2, 10, 18, 26, 34) and dflash.num_drafted == 15
    assert domino.num_drafted == 16 and domino.domino.gru_hidden_dim == 1024
    with pytest.raises(ConfigError, match="unknown drafter preset"):
        preset("qwen3-4b")


def _edit(path: str, value, *, domino: bool = False) -> dict:
    cfg = released_config(domino=domino)
    *parents, leaf = path.split(".")
    node = cfg
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[leaf]
    else:
        node[leaf] = value
    return cfg


@pytest.mark.parametrize(("path", "value", "message"), [
    ("dflash_config.mask_token_id", KeyError, "dflash_config.mask_token_id"),
    ("dflash_config.target_layer_ids", KeyError, "target_layer_ids"),
    ("dflash_config.target_layer_ids", "1,2", "target_layer_ids' must be list"),
    ("dflash_config.target_layer_ids", [0, 4], r"entries \[4\] outside 0..3"),
    ("dflash_config.mask_token_id", V, "outside the vocabulary"),
    ("hidden_size", "32", "'hidden_size' must be int"),
    ("num_key_value_heads", 3, "multiple of num_key_value_heads"),
    ("block_size", 1, "block_size must be >= 2"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope type 'yarn'"),
    ("use_sliding_window", True, None),
])
def test_malformed_configs_name_the_problem(path, value, message):
    cfg = _edit(path, value)
    if path == "use_sliding_window":
        cfg["layer_types"] = ["sliding_attention"] * LAYERS
        message = "sliding-window"
    with pytest.raises(ConfigError, match=message):
        DFlashConfig.from_dict(cfg)


@pytest.mark.parametrize(("path", "value", "message"), [
    ("dflash_config.gru_hidden_dim", KeyError, "gru_hidden_dim"),
    ("dflash_config.projector_type", "dspark", "unknown dflash_config.projector_type 'dspark'"),
    ("emb_dim", E + 1, "emb_dim differs"),
    ("dflash_config.shift_label", 1, "shift_label' must be bool"),
    ("dflash_config.pure_draft_prefix_len", 9, "exceeds the 4 drafted positions"),
])
def test_malformed_domino_configs_name_the_problem(path, value, message):
    with pytest.raises(ConfigError, match=message):
        DFlashConfig.from_dict(_edit(path, value, domino=True))


def test_config_json_must_exist_and_parse(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_config(tmp_path)


# ---------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize(("cls", "domino"), [(DFlashDrafter, False), (DominoDrafter, True)])
def test_released_layout_loads_strictly_and_round_trips_bit_exactly(tmp_path, cls, domino):
    (tmp_path / "src").mkdir()
    written = write_checkpoint(tmp_path / "src", released_config(domino=domino), released_shapes(domino=domino))
    drafter = cls.from_pretrained(tmp_path / "src")
    assert_bit_equal(written, drafter.model.state_dict())
    drafter.save_pretrained(tmp_path / "out")
    assert_bit_equal(written, load_file(str(tmp_path / "out" / "model.safetensors")))
    assert read_config(tmp_path / "out") == drafter.config
    assert_bit_equal(written, cls.from_pretrained(tmp_path / "out").model.state_dict())


def test_loaded_gru_runs_on_the_checkpoint_weights(tmp_path):
    written = write_checkpoint(tmp_path, released_config(domino=True), released_shapes(domino=True), torch.float32)
    gru = DominoDrafter.from_pretrained(tmp_path).model.prefix_gru
    x, h = torch.randn(1, 1, H), torch.randn(1, 1, G)
    gi = x[0, 0] @ written["prefix_gru.weight_ih_l0"].T  # gate order r, z, n
    gh = h[0, 0] @ written["prefix_gru.weight_hh_l0"].T
    r, z = torch.sigmoid(gi[:G] + gh[:G]), torch.sigmoid(gi[G:2 * G] + gh[G:2 * G])
    n = torch.tanh(gi[2 * G:] + r * gh[2 * G:])
    torch.testing.assert_close(gru(x, h)[1][0, 0], (1 - z) * n + z * h[0, 0])


def test_sharded_checkpoints_load(tmp_path):
    shapes = released_shapes()
    tensors = write_checkpoint(tmp_path, released_config(), shapes)
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_bit_equal(tensors, DFlashDrafter.from_pretrained(tmp_path).model.state_dict())


def test_missing_unexpected_and_misshapen_keys_are_named(tmp_path):
    shapes = released_shapes()
    del shapes["layers.1.mlp.up_proj.weight"]
    shapes["layers.0.self_attn.qkv_proj.weight"] = (4, 4)
    shapes["norm.weight"] = (H + 1,)
    write_checkpoint(tmp_path, released_config(), shapes)
    with pytest.raises(CheckpointError) as info:
        DFlashDrafter.from_pretrained(tmp_path)
    message = str(info.value)
    assert "missing keys: layers.1.mlp.up_proj.weight" in message
    assert "unexpected keys: layers.0.self_attn.qkv_proj.weight" in message
    assert "norm.weight: checkpoint shape (33,), model (32,)" in message


def test_no_weights_file_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(released_config()))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_domino_checkpoint_refused_as_dflash_and_the_reverse(tmp_path):
    (tmp_path / "domino").mkdir()
    (tmp_path / "dflash").mkdir()
    write_checkpoint(tmp_path / "domino", released_config(domino=True), released_shapes(domino=True))
    write_checkpoint(tmp_path / "dflash", released_config(), released_shapes())
    with pytest.raises(ConfigError, match="this is a Domino checkpoint.*load it with DominoDrafter"):
        DFlashDrafter.from_pretrained(tmp_path / "domino")
    with pytest.raises(ConfigError, match="not a Domino checkpoint.*load it with DFlashDrafter"):
        DominoDrafter.from_pretrained(tmp_path / "dflash")


def test_domino_weights_under_a_dflash_config_are_flagged(tmp_path):
    write_checkpoint(tmp_path, released_config(), released_shapes(domino=True))
    with pytest.raises(CheckpointError, match="unexpected keys: embed_proj.0.weight.*Domino head weights"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_registry_names_build_drafters_from_a_path(tmp_path):
    write_checkpoint(tmp_path, released_config(domino=True), released_shapes(domino=True))
    assert registry.resolve("drafter", "dflash") is DFlashDrafter
    drafter = registry.create("drafter", "domino", path=tmp_path, gru_input_table=False)
    assert isinstance(drafter, DominoDrafter) and drafter.config.is_domino and not drafter.gru_input_table


def test_constructor_needs_exactly_one_source(tmp_path):
    with pytest.raises(ValueError, match="exactly one of config= or path="):
        DFlashDrafter()
    with pytest.raises(ValueError, match="exactly one of config= or path="):
        DFlashDrafter(DFlashConfig.from_dict(released_config()), path=tmp_path)
