"""The training recipe end to end on a tiny random target (docs/training.md): self-distillation data, teacher
caches (training and held-out), `treespec train-drafter` with held-out τ and its curve, the export in the
released layout, and the exported drafter decoding losslessly through `treespec.generate`."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import treespec
from treespec.apps.cli import main
from treespec.apps.data.selfdistill import DistillConfig, write_shards


def tiny_target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def prompts(n: int, seed: int) -> list[tuple[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"p{seed}-{i}", torch.randint(3, 64, (8,), generator=g).tolist()) for i in range(n)]


def test_from_a_target_to_a_trained_drafter_that_decodes_losslessly(tmp_path):
    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    cfg = DistillConfig(num_prompts=8, max_new_tokens=24, batch_size=4, shard_size=4)
    write_shards(target, prompts(8, 1), tmp_path / "data", cfg, stop_ids=[999], pad_id=0, progress=False)
    write_shards(target, prompts(4, 2), tmp_path / "held-data", cfg, stop_ids=[999], pad_id=0, progress=False)
    for data, cache in (("data", "cache"), ("held-data", "held")):
        assert main(["teacher-cache", "--data", str(tmp_path / data), "--out", str(tmp_path / cache), "--target",
                     str(tmp_path / "target"), "--top-k", "8", "--dtype", "float32", "--threads", "1"]) == 0
    assert main(["train-drafter", "--teacher", str(tmp_path / "cache"), "--heldout", str(tmp_path / "held"),
                 "--target", str(tmp_path / "target"), "--out", str(tmp_path / "run"), "--mask-token-id", "0",
                 "--target-dtype", "float32", "--export", str(tmp_path / "drafter"), "--export-dtype", "float32",
                 "--set", "steps=6", "--set", "teacher_top_k=8", "--set", "block_size=4", "--set", "num_layers=1",
                 "--set", "warmup_steps=1",
                 "--set", "anchors_per_sequence=2", "--set", "eval_every=3", "--set", "save_every=3",
                 "--threads", "1"]) == 0
    run = tmp_path / "run"
    steps = [json.loads(line)["step"] for line in (run / "eval.jsonl").read_text().splitlines()]
    assert steps == [3, 6] and (run / "tau_curve.svg").is_file() and (run / "tau_curve.png").is_file()
    assert {p.name for p in (tmp_path / "drafter").iterdir()} >= {"config.json", "model.safetensors"}
    ids = torch.tensor(prompts(1, 3)[0][1])
    ar = treespec.generate(tmp_path / "target", ids, dtype="float32", max_new_tokens=16)
    tree = treespec.generate(tmp_path / "target", ids, dtype="float32", max_new_tokens=16,
                             drafter=tmp_path / "drafter", policy="ddtree", budget=4)
    assert tree.tokens.tolist() == ar.tokens.tolist()


def _train_args(tmp_path, out: str, *extra: str) -> list[str]:
    return ["train-drafter", "--teacher", str(tmp_path / "cache"), "--target", str(tmp_path / "target"), "--out",
            str(tmp_path / out), "--mask-token-id", "0", "--target-dtype", "float32", "--threads", "1",
            "--set", "steps=4", "--set", "batch_sequences=2", "--set", "teacher_top_k=8", "--set", "block_size=4",
            "--set", "num_layers=1", "--set", "warmup_steps=1", "--set", "anchors_per_sequence=2",
            "--set", "save_every=2", *extra]


def _torchrun(args: list[str]) -> None:
    import os
    import subprocess
    import sys

    # the CLI as a module of this interpreter: no console script on a PATH needed (a venv not activated)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "treespec.apps.cli", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TREESPEC_THREADS": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]


def _losses(run) -> list[float]:
    return [row["loss"] for row in json.loads((run / "trainer_state.json").read_text())["recent"]]


@pytest.mark.slow
def test_two_cpu_ranks_train_as_one_process_with_the_same_global_batch(tmp_path):
    """``torchrun --nproc-per-node 2 treespec train-drafter`` (gloo, DistributedDataParallel) takes one of
    each step's two sequences per rank: its loss curve is one process's with ``batch_sequences=2`` to
    1e-4, rank 0 alone writes the run; a run stopped in one process resumes under two ranks and ends
    where the one-process run does."""
    from safetensors.torch import load_file

    _chain_data(tmp_path)
    assert main(_train_args(tmp_path, "one")) == 0
    _torchrun(_train_args(tmp_path, "two"))
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(one) == len(two) == 4 and max(abs(a - b) for a, b in zip(one, two, strict=True)) < 1e-4
    assert main(_train_args(tmp_path, "switched", "--until", "2")) == 0
    _torchrun(_train_args(tmp_path, "switched"))
    ends = [load_file(str(tmp_path / run / "drafter" / "model.safetensors")) for run in ("one", "switched")]
    assert max(float((ends[0][k] - ends[1][k]).abs().max()) for k in ends[0]) < 1e-4


def _chain_data(tmp_path, heldout: bool = False) -> None:
    """A tiny target, its answers' teacher cache (``cache``) and, if asked, a held-out one (``held``)."""
    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    cfg = DistillConfig(num_prompts=8, max_new_tokens=24, batch_size=4, shard_size=4)
    sets = (("data", "cache", prompts(8, 1)),) + ((("held-data", "held", prompts(4, 2)),) if heldout else ())
    for data, cache, rows in sets:
        write_shards(target, rows, tmp_path / data, cfg, stop_ids=[999], pad_id=0, progress=False)
        assert main(["teacher-cache", "--data", str(tmp_path / data), "--out", str(tmp_path / cache), "--target",
                     str(tmp_path / "target"), "--top-k", "8", "--dtype", "float32", "--threads", "1"]) == 0


def test_train_drafter_fits_its_steps_to_minutes(tmp_path, capsys):
    import pytest

    _chain_data(tmp_path)
    with pytest.raises(SystemExit, match="--minutes 0: give a positive, finite budget"):
        main(_train_args(tmp_path, "bad", "--minutes", "0"))
    assert main(_train_args(tmp_path, "boxed", "--minutes", "0.05", "--set", "steps=1000000")) == 0
    state = json.loads((tmp_path / "boxed" / "trainer_state.json").read_text())
    box = state["time_box"]
    assert box["step_seconds"] > 0 and box["fitted_steps"] == state["config"]["steps"] < 1_000_000
    assert state["step"] <= state["config"]["steps"]  # fitted, or stopped at the deadline
    assert f"time box of 0.05 min: {state['step']} of {state['config']['steps']} steps" in capsys.readouterr().out


@pytest.mark.slow
def test_a_time_box_over_two_ranks_takes_rank_0s_decisions(tmp_path):
    """Only rank 0 evaluates, so only its clock knows an evaluation's cost: the refit after the first
    evaluation and the deadline are its decisions on both ranks (a rank deciding alone would hang the
    other in a collective; torchrun's timeout would fail the test)."""
    _chain_data(tmp_path, heldout=True)
    _torchrun(_train_args(tmp_path, "boxed", "--minutes", "0.2", "--heldout", str(tmp_path / "held"),
                          "--set", "steps=1000000", "--set", "eval_every=5", "--set", "save_every=1000000"))
    state = json.loads((tmp_path / "boxed" / "trainer_state.json").read_text())
    box = state["time_box"]
    assert box["eval_seconds"] and box["fitted_steps"] == state["config"]["steps"] < 1_000_000
    evaluated = [json.loads(line)["step"] for line in (tmp_path / "boxed" / "eval.jsonl").read_text().splitlines()]
    assert evaluated == list(range(5, state["step"] + 1, 5))


def test_the_gpu_training_script_refuses_before_any_work(tmp_path):
    """drafters/train_on_gpu.sh: a folder holding files, or no CUDA device, is refused with a clear line."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "drafters" / "train_on_gpu.sh"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "kept").write_text("earlier results")
    done = subprocess.run([str(script), str(tmp_path / "full")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "holds files already" in done.stderr
    assert (tmp_path / "full" / "kept").read_text() == "earlier results"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "RUNS": str(tmp_path / "runs")}
    done = subprocess.run([str(script), str(tmp_path / "out")], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1 and "torch sees no CUDA device" in done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()
