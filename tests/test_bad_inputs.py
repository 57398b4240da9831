"""Bad input gets a clear error naming the problem, through the CLI's entry point and the API.

One test per row of the reliability issue's table that this module covers; CLI rows assert the exit
code and the message.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_decoding import model_dir  # noqa: F401 - the fixture: a tiny model directory with a tokenizer
from test_target import tiny_model, tiny_target

import treespec
from treespec.apps.cli import main
from treespec.decoding import SpeculativeDecoder
from treespec.tree import DraftTree
from treespec.verifiers.match import MatchVerifier


@pytest.mark.parametrize(("flags", "message"), [
    (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--budget", "0"], "--budget: budget must be an integer >= 1 (it counts non-root nodes), got 0"),
])
def test_generate_refuses_bad_numbers_before_loading(model_dir, capsys, flags, message):
    assert main(["generate", str(model_dir), "--prompt", "w3", *flags]) == 2
    assert message in capsys.readouterr().err


def test_generate_refuses_a_stop_token_outside_the_vocabulary(model_dir, capsys):
    assert main(["generate", str(model_dir), "--prompt", "w3", "--dtype", "float32", "--stop-token-id", "999999"]) == 2
    assert "--stop-token-id 999999 is outside the vocabulary [0, 128)" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_generate_on_cuda_without_a_gpu_says_so(model_dir, capsys):
    assert main(["generate", str(model_dir), "--prompt", "w3", "--device", "cuda"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err


def test_a_missing_drafter_directory_is_named_as_a_path(model_dir, capsys):
    missing = model_dir / "no-such-drafter"
    assert main(["generate", str(model_dir), "--prompt", "w3", "--dtype", "float32", "--drafter", str(missing)]) == 2
    assert f"no drafter checkpoint directory at {missing}" in capsys.readouterr().err


def test_an_empty_target_directory_says_there_is_no_config(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        treespec.generate(tmp_path, [1, 2], max_new_tokens=2)
    assert main(["generate", str(tmp_path), "--prompt", "w3"]) == 2
    assert "holds no config.json" in capsys.readouterr().err  # the model's own checks come first


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_damaged_target_safetensors_file_is_named(tmp_path, damage):
    tiny_model(dtype=torch.float32).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        treespec.generate(tmp_path, [1, 2], max_new_tokens=2, dtype="float32")


def test_a_damaged_drafter_safetensors_file_is_named(tmp_path):
    from test_drafters_support import tiny_config

    from treespec.drafters.dflash import DFlashDrafter

    DFlashDrafter.random(tiny_config(), dtype=torch.float32).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        treespec.apps.api.load_drafter(tmp_path)


def test_infinite_target_logits_are_an_error_not_token_zero():
    tree = DraftTree.root_only(3)
    logits = torch.zeros(1, 16)
    logits[0, 5] = float("inf")
    with pytest.raises(FloatingPointError, match=r"\+inf at tree nodes \[0\]"):
        MatchVerifier().verify(tree, logits, sampling=treespec.interfaces.SamplingParams(), generator=None,
                               position=0)


def test_float_prompts_are_refused_not_truncated():
    target = tiny_target()
    with pytest.raises(TypeError, match="integer token ids"):
        SpeculativeDecoder(target).generate(torch.tensor([1.7, 2.2]), max_new_tokens=2)
    with pytest.raises(TypeError, match="must be integers"):
        treespec.generate(target, [1.7, 2.2], max_new_tokens=2)


def test_a_budget_beyond_memory_is_refused_up_front():
    from treespec.drafters.toy import MarginalDrafter

    with pytest.raises(ValueError, match="exceeds 8192 nodes"):
        treespec.generate(tiny_target(), [1, 2, 3], drafter=MarginalDrafter.random(4, 128), policy="ddtree",
                          budget=10**7, max_new_tokens=2)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tokens": [1, 2], "parents": [-1, 0.5]}, "parents must be integers"),
    ({"tokens": [1, 2], "parents": [-1, 0], "scores": [-0.5, -1.0]}, "root's score must be 0"),
    ({"tokens": [1, 2, 3], "parents": [-1, 0, 1], "scores": [0.0, -2.0, -1.0]}, "node 2 scores -1.0 above its parent"),
])
def test_malformed_trees_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DraftTree.build(**kwargs)


@pytest.mark.parametrize(("content", "message"), [
    (None, "no tree file at"),
    ("{tokens: [1]}", "is not valid JSON"),
    ('{"tokens": [1, 2, 3], "parents": [-1, 2, 1]}', "parents are not topological"),  # a cycle 1 -> 2 -> 1
    ('{"tokens": [1, 2], "parents": [-1, 0], "accepted": [0, 7]}', r"accepted must list node indices in \[0, 2\)"),
    ('{"tokens": [1, 2], "parents": [-1, 0], "labels": ["a"]}', "one label per node"),
])
def test_draw_tree_files_are_checked(tmp_path, capsys, content, message):
    path = tmp_path / "tree.json"
    if content is not None:
        path.write_text(content)
    assert main(["draw", "--tree", str(path), "--out", str(tmp_path / "t.dot")]) == 2  # a bad input, as argparse exits
    err = capsys.readouterr().err
    assert re.search(message, err) and str(path) in err


def test_draw_on_a_target_without_a_tokenizer_says_so(tmp_path, capsys):
    from test_drafters_support import tiny_config

    from treespec.drafters.dflash import DFlashDrafter

    tiny_model(dtype=torch.float32).save_pretrained(tmp_path / "target")
    DFlashDrafter.random(tiny_config(), dtype=torch.float32).save_pretrained(tmp_path / "drafter")
    assert main(["draw", "--model", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                 "--out", str(tmp_path / "t.dot")]) == 2
    assert "no tokenizer files in" in capsys.readouterr().err


@pytest.mark.parametrize(("setup", "flags", "message"), [
    ("missing", [], "no such directory"),
    ("empty", [], "no distill-data shards"),
    ("empty", ["--set", "lr=abc"], "--set lr=abc: not a valid lr"),
])
def test_train_drafter_names_its_bad_inputs(tmp_path, setup, flags, message):
    data = tmp_path / "data"
    if setup == "empty":
        data.mkdir()
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["train-drafter", "--data", str(data), "--out", str(tmp_path / "out"), *flags])


def test_replay_eval_on_a_file_that_is_not_a_trace(tmp_path, capsys):
    path = tmp_path / "not-a-trace.safetensors"
    path.write_bytes(b"\x00" * 64)
    assert main(["replay", "eval", str(path)]) == 2
    assert str(path) in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--teacher", "{tmp}/none"], "no teacher cache here"),
    ([], "give --data (distill-data shards) or --teacher"),
    (["--data", "{tmp}", "--set", "autocast_bf16=maybe"], "expected true or false"),
    (["--data", "{tmp}", "--set", "draft_vocab_size=big"], "--set draft_vocab_size=big: not a valid"),
])
def test_train_drafter_names_bad_teacher_and_settings(tmp_path, args, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["train-drafter", "--out", str(tmp_path / "out"), *argv])


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--layers", "1,x"], 2, "--layers '1,x' must be comma-separated integers"),
    ([], 1, "no distill-data shards"),
])
def test_teacher_cache_names_its_bad_inputs(tmp_path, capsys, args, code, message):
    assert main(["teacher-cache", "--data", str(tmp_path), "--out", str(tmp_path / "c"), *args]) == code
    assert message in capsys.readouterr().err


def test_train_drafter_on_a_target_without_a_tokenizer_asks_for_the_mask_token(tmp_path):
    """No tokenizer is needed when --mask-token-id is given; without both, the message says so."""
    from treespec.apps.data.selfdistill import DistillConfig, write_shards

    model = tiny_model("llama", dtype=torch.float32)
    model.save_pretrained(tmp_path / "target")
    gen = torch.Generator().manual_seed(0)
    prompts = [(f"p{i}", torch.randint(3, 96, (8,), generator=gen).tolist()) for i in range(4)]
    write_shards(model, prompts, tmp_path / "data", DistillConfig(num_prompts=4, max_new_tokens=12, batch_size=2,
                                                                  shard_size=4), stop_ids=[999], pad_id=0,
                 progress=False)
    argv = ["train-drafter", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "data"),
            "--out", str(tmp_path / "run"), "--set", "steps=2", "--set", "block_size=4", "--set", "num_layers=1",
            "--set", "anchors_per_sequence=2", "--set", "warmup_steps=1"]
    with pytest.raises(SystemExit, match="no usable tokenizer.*or pass --mask-token-id"):
        main(argv)
    assert main([*argv, "--mask-token-id", "0"]) == 0
    assert (tmp_path / "run" / "drafter" / "config.json").is_file()
    with pytest.raises(SystemExit, match=re.escape(f"--target {tmp_path / 'none'}: no model here")):
        main([*argv[:2], str(tmp_path / "none"), *argv[3:]])


@pytest.mark.parametrize("device", [
    pytest.param("gpu", id="unknown"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")),
])
def test_pipeline_commands_name_a_device_this_machine_lacks(tmp_path, capsys, device):
    """distill-data, teacher-cache and train-drafter refuse --device up front, naming it."""
    from treespec.apps.data.selfdistill import DistillConfig, write_shards

    model = tiny_model("llama", dtype=torch.float32)
    model.save_pretrained(tmp_path / "target")
    write_shards(model, [("p0", [3, 4, 5])], tmp_path / "data", DistillConfig(num_prompts=1, max_new_tokens=2),
                 stop_ids=[999], pad_id=0, progress=False)
    message = "unknown device 'gpu'" if device == "gpu" else "sees no CUDA device"
    common = ["--device", device]
    assert main(["distill-data", "--model-dir", str(tmp_path / "target"), "--out", str(tmp_path / "d2"), *common]) == 1
    assert message in capsys.readouterr().err
    assert main(["teacher-cache", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "c"),
                 "--target", str(tmp_path / "target"), *common]) == 1
    assert message in capsys.readouterr().err
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["train-drafter", "--data", str(tmp_path / "data"), "--target", str(tmp_path / "target"),
              "--out", str(tmp_path / "run"), "--mask-token-id", "0", *common])
    assert not (tmp_path / "d2").exists() and not (tmp_path / "c").exists()


def test_generate_takes_sampling_as_one_typed_value():
    """``sampling=SamplingParams(...)`` equals the Hugging Face style flags it replaces (same seed, same
    tokens), and giving both is refused, naming both."""
    from treespec import SamplingParams

    target = tiny_target()
    flags = treespec.generate(target, [1, 2, 3], max_new_tokens=8, do_sample=True, temperature=0.7, top_k=5, seed=3)
    typed = treespec.generate(target, [1, 2, 3], max_new_tokens=8, seed=3,
                              sampling=SamplingParams(temperature=0.7, top_k=5))
    assert typed.tokens.tolist() == flags.tokens.tolist()
    greedy = treespec.generate(target, [1, 2, 3], max_new_tokens=8, sampling=SamplingParams())
    assert greedy.tokens.tolist() == treespec.generate(target, [1, 2, 3], max_new_tokens=8).tokens.tolist()
    with pytest.raises(ValueError, match="give either sampling=SamplingParams"):
        treespec.generate(target, [1, 2, 3], max_new_tokens=2, sampling=SamplingParams(), temperature=0.5)


def test_generate_wraps_a_text_prompt_in_the_chat_template_when_asked():
    """``chat=True`` is ``treespec generate --chat``: the text as one user turn of the tokenizer's chat
    template (the generation equals decoding those ids), and token ids with chat=True are refused."""
    from test_bench_runner import CharTokenizer

    from treespec.apps.data.datasets import encode_chat

    target, tokenizer = tiny_target(vocab=128), CharTokenizer()
    chat = treespec.generate(target, "hi", tokenizer=tokenizer, chat=True, max_new_tokens=6, stop_token_ids=[])
    ids = encode_chat(tokenizer, ["hi"])
    assert ids == [1 + ord(c) % 126 for c in "user:hi|assistant:"]
    assert chat.tokens.tolist() == treespec.generate(target, ids, max_new_tokens=6, stop_token_ids=[]).tokens.tolist()
    with pytest.raises(ValueError, match="chat=True wraps a text prompt"):
        treespec.generate(target, [1, 2, 3], chat=True, max_new_tokens=2)


# ---------------------------------------------------------------------------- documented inputs, before any load
@pytest.fixture
def no_loading(monkeypatch):
    """Any target or weights load fails the test: the refusal must come first."""
    import treespec.apps.assembly.loading as loading
    import treespec.pricing.hardware as hardware

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(loading, "load_target", refuse)
    monkeypatch.setattr(loading, "load_tokenizer", refuse)
    monkeypatch.setattr(hardware, "measure_linear_speed", refuse)


@pytest.mark.parametrize("name", ["domino", "dflash"])
def test_a_registered_drafter_name_without_weights_for_the_model_gets_one_line(model_dir, capsys, no_loading, name):
    assert main(["generate", str(model_dir), "--prompt", "w3", "--drafter", name]) == 2
    err = capsys.readouterr().err
    assert f"the {name} drafter loads from a checkpoint directory: name its directory" in err
    assert err.count("\n") == 1 and "config= or path=" not in err
    with pytest.raises(ValueError, match="loads from a checkpoint directory"):
        treespec.generate(model_dir, [1, 2, 3], drafter=name)


def test_a_registered_drafter_name_is_the_shipped_checkpoint_for_the_embedded_default(tmp_path, monkeypatch):
    from treespec.apps.assembly.loading import drafter_source, embedded_drafter_dir

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    (tmp_path / "smollm2-135m-instruct").mkdir()
    for name in ("dflash", "domino"):
        assert drafter_source(name, tmp_path / "smollm2-135m-instruct") == embedded_drafter_dir(name)
        own_gguf = tmp_path / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"  # what llama.cpp runs
        assert drafter_source(name, own_gguf) == embedded_drafter_dir(name)
        with pytest.raises(ValueError, match="ships .* weights for the embedded default only"):
            drafter_source(name, tmp_path / "another.gguf")
    assert drafter_source("toy-conditional", "any") == "toy-conditional"  # built from its arguments
    with pytest.raises(ValueError, match="unknown drafter 'nosuch'"):
        drafter_source("nosuch", "any")


@pytest.mark.parametrize(("flags", "message"), [
    (["--round", "0"], "--round must be >= 1 (1 = the first round), got 0"),
    (["--method", "eagle2@16+topk=0"], "eagle2 option topk='0': topk must be an integer >= 1, got 0"),
    (["--trace", "t.safetensors", "--methods", "ddtree@16", "--prompt", "first"], "the prompt's index in the trace"),
    (["--trace", "t.safetensors", "--methods", "ddtree@16", "--position", "-1"], "--position must be >= 0"),
])
def test_draw_refuses_bad_arguments_before_the_model_loads(tmp_path, capsys, no_loading, flags, message):
    assert main(["draw", "--out", str(tmp_path / "t.svg"), *flags]) == 2
    assert message in capsys.readouterr().err


def test_bench_refuses_a_bad_option_value_before_loading(tmp_path, capsys, no_loading):
    assert main(["bench", "--methods", "eagle2@16+topk=0", "--out", str(tmp_path / "b")]) == 2
    assert "topk must be an integer >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": 0.7}, "do_sample=False decodes greedily: pass do_sample=True"),
    ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
    ({"top_k": 5}, "top_k=5 filter sampling, and this decodes greedily"),
    ({"do_sample": True, "temperature": 0.0}, "do_sample=True needs temperature > 0"),
])
def test_the_api_refuses_contradictory_sampling_settings(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        treespec.generate(tiny_target(), [1, 2, 3], max_new_tokens=2, **kwargs)


def test_the_cli_refuses_a_filter_on_greedy_decoding(model_dir, capsys, no_loading):
    assert main(["generate", str(model_dir), "--prompt", "w3", "--top-k", "5"]) == 2
    assert "--top-k=5 filter sampling, and this decodes greedily (temperature 0)" in capsys.readouterr().err


def test_generate_takes_a_cost_model_and_refuses_a_bad_one(model_dir, tmp_path, capsys, no_loading):
    bad = tmp_path / "cost.json"
    bad.write_text("{")
    assert main(["generate", str(model_dir), "--prompt", "w3", "--cost-model", str(bad)]) == 2
    assert f"{bad}: not valid JSON" in capsys.readouterr().err


def test_a_shipped_data_pass_is_found_by_name(tmp_path):
    from pathlib import Path

    from treespec.apps.data.datastore import read_manifest, shipped_store, shipped_stores

    assert "greedy" in shipped_stores()
    folder = shipped_store(Path("greedy"))
    assert folder.is_dir() and read_manifest(folder)
    assert shipped_store(tmp_path / "greedy") == tmp_path / "greedy"  # a path stays a path


def test_an_engine_whose_binding_is_missing_gets_one_line(tmp_path, monkeypatch, capsys, model_dir):
    import sys

    from test_embedded import write_tiny_gguf

    from treespec.apps.assembly.loading import load_target
    from treespec.target import EngineUnavailable

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if llama-cpp-python were not installed
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(EngineUnavailable, match="needs llama-cpp-python, which is not installed"):
        load_target(path, engine="llama.cpp", dtype="float32")
    assert main(["generate", str(path), "--engine", "llama.cpp", "--prompt", "w3", "--dtype", "float32"]) == 1
    err = capsys.readouterr().err
    assert "needs llama-cpp-python" in err and "Traceback" not in err
    out, chat = tmp_path / "bench", Path(__file__).resolve().parents[1] / "treespec" / "assets" / "demo" / "chat.jsonl"
    assert main(["bench", "--model", str(path), "--engine", "llama.cpp", "--methods", "ar", "--prompts", "1",
                 "--datasets", str(chat), "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "treespec bench: the llama.cpp engine needs llama-cpp-python" in err and "Traceback" not in err
    assert not out.exists()  # nothing made by a run that could not start
