"""The demo's pooled table and equality verdict, from synthetic bench records."""

from __future__ import annotations

import pytest

from treespec.apps.bench.lossless import Divergence
from treespec.apps.bench.records import BenchRecord
from treespec.apps.commands.demo import lossless_verdict, pooled_table
from treespec.target import Numerics


def rec(method, prompt, tokens, time, taus):
    return BenchRecord(method=method, policy=method, budget=0, temperature=0.0, dataset="d", prompt_id=prompt, turn=0,
                       seed=0, tokens=tokens, taus=taus, decode_time=time, prefill_time=0.0, stage_times={})


def test_table_pools_prompts_and_orders_methods():
    records = [rec("ar", "1", [1, 2, 3, 4], 0.4, [1] * 4), rec("ar", "2", [5, 6], 0.2, [1, 1]),
               rec("ddtree@16", "1", [1, 2, 3, 4], 0.2, [2, 2]), rec("ddtree@16", "2", [5, 7], 0.1, [2])]
    table = pooled_table(records, ["ar", "ddtree@16", "absent"]).splitlines()
    assert table[2].split()[:4] == ["ar", "1.00", "10.0", "1.00x"]
    assert table[3].split() == ["ddtree@16", "2.00", "20.0", "2.00x", "1/2", "0"]  # prompt 2 differs from AR
    assert len(table) == 4


def test_table_counts_near_ties_within_the_tolerance_only():
    records = [rec("ar", "1", [1, 2], 0.2, [1, 1]), rec("ar", "2", [5, 6], 0.2, [1, 1]),
               rec("dflash", "1", [1, 3], 0.2, [1, 1]), rec("dflash", "2", [5, 7], 0.2, [1, 1])]
    tie = Divergence("dflash", "d", "1", 0, 0.0, 1, 2, 3, gap=0.1, tolerance=0.5)
    wide = Divergence("dflash", "d", "2", 0, 0.0, 1, 6, 7, gap=2.0, tolerance=0.5)
    row = pooled_table(records, ["ar", "dflash"], [tie, wide]).splitlines()[3].split()
    assert row[-2:] == ["0/2", "1"]


def test_verdict_names_equality_near_ties_and_failures():
    exact, loose = Numerics(True, 0.0, "exact kernels"), Numerics(False, 0.5, "bf16")
    same = [rec("ar", "1", [1], 1.0, [1]), rec("dflash", "1", [1], 1.0, [1])]
    assert "all 1 outputs equal AR's token for token (exact kernels)" in lossless_verdict(same, 0, exact)
    diff = [rec("ar", "1", [1], 1.0, [1]), rec("dflash", "1", [2], 1.0, [1])]
    assert "near-tie" in lossless_verdict(diff, 0, loose) and "0.5" in lossless_verdict(diff, 0, loose)
    assert "FAILED" in lossless_verdict(diff, 1, exact)


def test_the_near_tie_column_is_gone_where_the_target_is_exact():
    records = [rec("ar", "1", [1], 1.0, [1]), rec("dflash", "1", [1], 1.0, [1])]
    assert "near-tie" in pooled_table(records, ["ar", "dflash"])
    assert "near-tie" not in pooled_table(records, ["ar", "dflash"], exact=True)


def test_demo_names_missing_drafters(monkeypatch, tmp_path, capsys):
    import treespec.apps.assembly.loading
    from treespec.apps.cli import main

    monkeypatch.setattr(treespec.apps.assembly.loading, "embedded_drafter_dir", lambda kind: tmp_path / kind)
    assert main(["demo"]) == 2
    assert "embedded drafters are not installed" in capsys.readouterr().err


def test_demo_prompts_need_no_dataset_files(monkeypatch, tmp_path):
    """The demo's chat and math prompts ship with treespec and HumanEval comes from its package."""
    from treespec.apps.commands.demo import _DATASETS
    from treespec.apps.data import datasets

    monkeypatch.setenv(datasets.DATA_ENV, str(tmp_path))  # no ../shared/datasets
    chat, math, code = (datasets.load_prompts(name, limit=2) for name in _DATASETS)
    assert [len(p) for p in (chat, math, code)] == [2, 2, 2]
    assert {p.dataset for p in chat} == {"chat"} and {p.dataset for p in code} == {"humaneval"}
    assert all(p.turns[0].endswith(datasets.MATH_SUFFIX) for p in math)  # the GSM8K template


def test_demo_loads_another_drafter_by_name(monkeypatch, tmp_path, capsys):
    """``--drafter NAME=DIR`` reaches the session for a method over a registered drafter (here the tests'
    bigram drafter, tests/bigram_drafter.py); a drafter named by no flag is asked for by name."""
    from treespec.apps.assembly.session import Session
    from treespec.apps.cli import main

    seen = {}

    class Loaded(Exception):
        pass

    def load(cls, model, dirs, **kwargs):
        seen.update(dirs)
        raise Loaded

    monkeypatch.setattr(Session, "load", classmethod(load))
    assert main(["demo", "--methods", "ar,bigram"]) == 2
    assert "give its checkpoint with --drafter bigram=DIR" in capsys.readouterr().err
    try:
        main(["demo", "--methods", "ar,bigram,ddtree@4:bigram", "--drafter", f"bigram={tmp_path}"])
    except Loaded:
        pass
    assert seen == {"bigram": tmp_path}


def test_an_engine_that_is_not_installed_is_left_out_in_one_line(monkeypatch, capsys):
    from treespec import registry
    from treespec.apps.commands.demo import _engines

    engine = registry.resolve("engine", "llama.cpp")
    monkeypatch.setattr(engine, "installed", staticmethod(lambda: False))
    assert _engines("torch,llama.cpp") == ["torch"]
    assert "the llama.cpp engine is not installed here (`treespec install-engine llama.cpp` builds it)" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match="none of the engines asked for can run here"):
        _engines("llama.cpp")
    with pytest.raises(ValueError, match="unknown engine 'vllm'"):
        _engines("torch,vllm")


def test_the_demo_keeps_the_bench_folder_contract(monkeypatch, tmp_path, capsys):
    """``demo --out``: the same settings resume, other settings (another answer length) and an engine named
    twice are refused in one line, and a folder another run is writing is refused at the start."""
    import fcntl
    import os

    from test_bench_runner import make_harness

    import treespec.apps.assembly.embedded
    from treespec.apps.assembly.session import Session
    from treespec.apps.bench.outdir import LOCK, unlock_out
    from treespec.apps.cli import main

    model_dir = tmp_path / "model"
    harness = make_harness()
    harness.target.model.save_pretrained(model_dir)
    monkeypatch.setattr(treespec.apps.assembly.embedded, "embedded_model_dir", lambda *a, **k: model_dir)
    monkeypatch.setattr(Session, "load", classmethod(lambda cls, *a, **k: make_harness()))
    out = tmp_path / "demo"
    base = ["demo", "--engines", "torch", "--methods", "ar", "--prompts", "1", "--dtype", "float32", "--out", str(out)]
    assert main([*base, "--max-new-tokens", "2"]) == 0
    records = (out / "torch" / "records.jsonl").read_text()
    unlock_out(out), unlock_out(out / "torch")  # as if that run's process had ended
    assert main([*base, "--max-new-tokens", "2"]) == 0
    assert "resuming the torch run" in capsys.readouterr().err
    assert (out / "torch" / "records.jsonl").read_text() == records  # nothing measured again, nothing added
    unlock_out(out), unlock_out(out / "torch")
    assert main([*base, "--max-new-tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert "holds the results of another bench configuration (differs in max_new_tokens)" in err
    assert err.count("treespec demo:") == 1 and "Traceback" not in err
    assert main([*base[:2], "torch,torch", *base[3:]]) == 2
    assert "--engines names torch twice" in capsys.readouterr().err
    unlock_out(out), unlock_out(out / "torch")
    held = os.open(out / LOCK, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # another run writes the folder
    try:
        assert main([*base, "--max-new-tokens", "2"]) == 2
        assert "is being written by another run" in capsys.readouterr().err
    finally:
        os.close(held)
    assert (out / "torch" / "records.jsonl").read_text() == records
