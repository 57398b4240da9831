"""A third drafter, added as a user adds one (tests/bigram_drafter.py, registered in tests/conftest.py),
runs through method strings, the bench (API and CLI) and replay (record and eval) with no edit in
treespec/: the apps pick a drafter by the name a method gives and by the role its policy needs.

* ``bigram`` alone is the chain over it; ``ddtree@4:bigram`` a DDTree over it; a policy that needs a
  scorer is refused over a marginal drafter, naming the role; ``--drafter NAME=DIR`` loads it
  through its declared loader, and a drafter named by no flag is asked for by name.
* Every output equals AR's at T = 0; replay of a recorded trace gives the live taus.
"""

from __future__ import annotations

import json

import pytest
import torch
from bigram_drafter import NAME, BigramDrafter
from test_decoding import _word_tokenizer
from test_target import random_prompts, tiny_model

import treespec.apps.bench as ab
from treespec.apps.assembly.loading import drafter_dirs
from treespec.apps.assembly.methods import build_policy, parse_method
from treespec.apps.assembly.session import Session
from treespec.apps.cli import main
from treespec.apps.replay import RecordConfig, evaluate, record_trace
from treespec.decoding import SpeculativeDecoder
from treespec.interfaces import Drafter
from treespec.engines.torch import TargetModel


def test_method_strings_name_the_drafter_and_its_role_is_checked():
    assert (parse_method(NAME).policy, parse_method(NAME).drafter) == ("chain", NAME)
    assert parse_method(f"ddtree@4:{NAME}").drafter == NAME
    with pytest.raises(ValueError, match=f"dominotree needs a conditional drafter .*; {NAME} is marginal"):
        parse_method(f"dominotree@4:{NAME}")
    assert BigramDrafter.role == "marginal" and Drafter.role == "marginal"
    with pytest.raises(NotImplementedError, match="cannot be loaded from a directory"):
        type("Bare", (Drafter,), {"draft": lambda self, ctx: None}).from_pretrained("x")


def test_drafter_dirs_come_from_flags_and_are_asked_for_by_name(tmp_path):
    assert drafter_dirs([NAME], [f"{NAME}={tmp_path}"]) == {NAME: tmp_path}
    with pytest.raises(ValueError, match=f"give its checkpoint with --drafter {NAME}=DIR"):
        drafter_dirs([NAME], [])
    with pytest.raises(ValueError, match="unknown drafter 'nosuch'"):
        drafter_dirs([NAME], [f"nosuch={tmp_path}"])
    with pytest.raises(ValueError, match="--drafter takes NAME=DIR"):
        drafter_dirs([NAME], [NAME])


def test_bench_and_replay_run_the_new_drafter():
    target = TargetModel(tiny_model(vocab=64, hidden=32, layers=2))
    drafter = BigramDrafter.random(64, depth=4, seed=1)
    prompts = [p for p in random_prompts(6, 64, seed=2) if p.numel() > 1][:3]
    trace = record_trace(Session(target, drafters={NAME: drafter}), prompts, config=RecordConfig(max_new_tokens=12, max_budget=64))
    for method in (NAME, f"ddtree@4:{NAME}", f"eagle2@8+topk=2:{NAME}"):
        parsed = parse_method(method)
        decoder = SpeculativeDecoder(target, drafter, build_policy(parsed))
        live = []
        for i, prompt in enumerate(prompts):
            out = decoder.generate(prompt, max_new_tokens=12)
            assert out.tokens.tolist() == trace.sequences[i][prompt.numel():][:out.tokens.numel()].tolist()
            live.append(tuple(out.stats.taus))
        assert list(evaluate(trace, [method])[0].taus) == live


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny target with a word tokenizer whose chat template joins the turns' words."""
    path = tmp_path_factory.mktemp("chat-tiny")
    tiny_model(dtype=torch.float32).save_pretrained(path)
    tokenizer = _word_tokenizer(128)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(path)
    return path


def test_the_bench_cli_loads_it_by_name(model_dir, tmp_path, capsys):
    drafter_dir = BigramDrafter.random(128, depth=4, seed=3).save_pretrained(tmp_path / "bigram")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("w3 w5 w7", "w9 w2")))
    args = ["bench", "--model", str(model_dir), "--methods", f"ar,{NAME},ddtree@4:{NAME}", "--datasets", str(prompts),
            "--prompts", "2", "--max-new-tokens", "8", "--temperatures", "0", "--dtype", "float32", "--no-progress",
            "--out", str(tmp_path / "out")]
    assert main([*args[:-2], "--out", str(tmp_path / "missing")]) == 2
    assert f"give its checkpoint with --drafter {NAME}=DIR" in capsys.readouterr().err
    assert main([*args, "--drafter", f"{NAME}={drafter_dir}"]) == 0
    records = list(ab.read_records(tmp_path / "out" / ab.RECORDS))
    assert {r.method for r in records} == {"ar", NAME, f"ddtree@4:{NAME}"}
    ar = {r.key: r.tokens for r in records if r.method == "ar"}
    assert all(r.tokens == ar[r.key] for r in records)
    settings = json.loads((tmp_path / "out" / ab.SETTINGS).read_text())
    assert NAME in settings["drafters"]
    trace = tmp_path / "trace.safetensors"
    assert main(["replay", "record", "--out", str(trace), "--model", str(model_dir), "--dtype", "float32",
                 "--drafter", f"{NAME}={drafter_dir}", "--prompt-ids", str(_ids(tmp_path)), "--max-new-tokens",
                 "6"]) == 0
    assert main(["replay", "eval", str(trace), "--methods", f"{NAME},ddtree@4:{NAME}"]) == 0
    assert f"ddtree@4:{NAME}" in capsys.readouterr().out


def _ids(folder):
    path = folder / "ids.json"
    path.write_text(json.dumps([[3, 5, 7], [9, 2]]))
    return path


def test_a_drafter_without_a_loader_is_refused_by_name(tmp_path, capsys):
    from treespec import registry

    registry.register("drafter", "no-loader", type("NoLoader", (Drafter,), {"draft": lambda self, ctx: None}))
    try:
        assert main(["replay", "record", "--out", str(tmp_path / "t.safetensors"), "--model", str(tmp_path),
                     "--drafter", f"no-loader={tmp_path}", "--prompt-ids", str(_ids(tmp_path))]) != 0
    except NotImplementedError as exc:
        pytest.fail(f"a traceback instead of a message: {exc}")
    finally:
        registry._RUNTIME["drafter"].pop("no-loader")
    assert "cannot be loaded from a directory" in capsys.readouterr().err


def test_the_trace_keeps_the_drafters_name():
    target = TargetModel(tiny_model(vocab=64, hidden=32, layers=2, dtype=torch.float64))
    trace = record_trace(Session(target, drafters={NAME: BigramDrafter.random(64, depth=3)}), [torch.tensor([1, 2, 3])],
                         config=RecordConfig(max_new_tokens=4, max_budget=64))
    assert set(trace.drafters) == {NAME}
