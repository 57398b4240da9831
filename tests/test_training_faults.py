"""Drafter training under faults (docs/training.md, "What a crash costs"): a checkpoint is a unit, written whole
beside the last and made current in one step, so a crash at any moment resumes from the old checkpoint or the
new one, said which, never a mix; every output folder is checked before any work; every bad value is refused in
one line.  On the tiny target and teacher cache of tests/test_training_chain.py."""

from __future__ import annotations

import json

import pytest
from test_training_chain import _chain_data, _train_args

from treespec.apps.cli import main


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("chain")
    _chain_data(root)
    return root


def _recent(run) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in json.loads((run / "trainer_state.json").read_text())["recent"]}


def test_a_crash_between_the_files_of_a_save_resumes_from_the_last_whole_checkpoint(chain, tmp_path, monkeypatch,
                                                                                    capsys):
    """The step-4 save is killed after its drafter is written and before its optimizer moments: the run resumes
    at step 2 (the checkpoint made current before the crash), says so, and trains on exactly as a run that was
    never interrupted; nothing of the broken save is left behind."""
    import treespec.apps.training.trainer as trainer

    assert main(_train_args(chain, "whole")) == 0
    out = tmp_path / "crashed"
    args = [*_train_args(chain, "x"), "--out", str(out)]
    original, calls = trainer.save_file, []

    def dies_on_the_second_save(tensors, path, *a, **k):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a kill between the drafter and the moments
        return original(tensors, path, *a, **k)

    monkeypatch.setattr(trainer, "save_file", dies_on_the_second_save)
    assert main(args) == 130
    monkeypatch.setattr(trainer, "save_file", original)
    assert json.loads((out / "trainer_state.json").read_text())["step"] == 2
    capsys.readouterr()
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "resumed at step 2 from checkpoint" in said
    whole, resumed = _recent(chain / "whole"), _recent(out)
    assert set(resumed) == {3, 4} and all(resumed[s] == pytest.approx(whole[s], abs=1e-6) for s in (3, 4))
    assert not list((out / "checkpoints").glob("*.partial"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]


def test_a_state_file_cut_to_nothing_falls_back_to_the_checkpoint_before(chain, tmp_path, capsys):
    """A damaged current checkpoint (its trainer state emptied) is passed over, named, for the one before;
    with every checkpoint damaged, the resume is refused in one line naming the files."""
    out = tmp_path / "run"
    args = [*_train_args(chain, "x", "--until", "4"), "--out", str(out)]
    assert main(args) == 0
    (out / "checkpoint" / "trainer_state.json").write_text("")
    capsys.readouterr()
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "resumed at step 2 from checkpoints/step-00000002" in said and "trainer_state.json" in said
    for folder in (out / "checkpoints").iterdir():
        (folder / "optimizer.safetensors").write_bytes(b"")
    with pytest.raises(SystemExit, match="no checkpoint can be trusted"):
        main(args)


def test_a_run_directory_from_before_checkpoints_were_units_resumes(chain, tmp_path, capsys):
    """drafter/, optimizer.safetensors and trainer_state.json directly in OUT (the earlier layout): resumed as
    they are, said so; the next save makes the run a unit."""
    import shutil

    out = tmp_path / "old"
    assert main([*_train_args(chain, "x", "--until", "2"), "--out", str(out)]) == 0
    current = (out / "checkpoint").resolve()
    for name in ("drafter", "trainer_state.json", "checkpoint"):
        (out / name).unlink()
    for name in ("drafter", "optimizer.safetensors", "trainer_state.json"):
        shutil.move(str(current / name), str(out / name))
    shutil.rmtree(out / "checkpoints")
    capsys.readouterr()
    assert main([*_train_args(chain, "x"), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "resumed at step 2" in said and "before checkpoints were units" in said
    assert (out / "checkpoint").is_symlink() and (out / "drafter").is_symlink()
    assert not (out / "optimizer.safetensors").exists()


@pytest.mark.parametrize(("extra", "message"), [
    (["--set", "steps=0"], "--set steps=0: not a valid steps"),
    (["--set", "steps=-3"], "--set steps=-3: not a valid steps"),
    (["--set", "batch_sequences=0"], "--set batch_sequences=0: not a valid batch_sequences"),
    (["--set", "lr=nan"], "--set lr=nan: not a valid lr"),
    (["--minutes", "inf"], "--minutes inf: give a positive, finite budget"),
    (["--minutes", "nan"], "--minutes nan: give a positive, finite budget"),
])
def test_every_bad_value_is_refused_in_one_line_before_any_work(chain, tmp_path, extra, message):
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=message):
        main([*_train_args(chain, "x"), "--out", str(out), *extra])
    assert not out.exists()


def test_unusable_or_occupied_output_folders_are_refused_before_any_work(chain, tmp_path):
    """--out a file or below one, --export over a folder holding files (unless --overwrite), distill-data's --out
    below a file: one line each, before the target loads; nothing written."""
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    with pytest.raises(SystemExit, match="--out .*a-file: a file, not a folder"):
        main([*_train_args(chain, "x"), "--out", str(a_file)])
    with pytest.raises(SystemExit, match="a-file is a file, so no folder can be made below it"):
        main([*_train_args(chain, "x"), "--out", str(a_file / "run")])
    kept = tmp_path / "shipped"
    kept.mkdir()
    (kept / "model.safetensors").write_text("another drafter")
    with pytest.raises(SystemExit, match="--export .*shipped: holds files already"):
        main([*_train_args(chain, "x"), "--out", str(tmp_path / "run"), "--export", str(kept)])
    assert (kept / "model.safetensors").read_text() == "another drafter" and not (tmp_path / "run").exists()
    with pytest.raises(SystemExit, match="holds files and is not a train-drafter run"):
        main([*_train_args(chain, "x"), "--out", str(kept)])
    with pytest.raises(SystemExit, match="a-file is a file, so no folder can be made below it"):
        main(["distill-data", "--out", str(a_file / "shards")])


def test_a_teacher_shard_cut_in_half_is_named_and_built_again(chain, tmp_path, capsys):
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(chain / "cache", cache)
    from safetensors.torch import load_file

    shard = sorted(cache.glob("teacher-*.safetensors"))[0]
    whole, before = shard.read_bytes(), {k: v.clone() for k, v in load_file(str(shard)).items()}  # not a map of the file
    shard.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(SystemExit, match=f"{shard.name} is damaged \\(cut short"):
        main([*_train_args(chain, "x"), "--out", str(tmp_path / "run"), "--teacher", str(cache)])
    capsys.readouterr()
    assert main(["teacher-cache", "--data", str(chain / "data"), "--out", str(cache), "--target",
                 str(chain / "target"), "--top-k", "8", "--dtype", "float32", "--threads", "1"]) == 0
    assert f"{shard.name} is damaged (cut short" in capsys.readouterr().err
    again = load_file(str(shard))
    assert again.keys() == before.keys() and all(bool((again[k] == before[k]).all()) for k in before)


def test_a_resume_says_when_it_goes_on_with_other_data_or_more_sequences_a_step_than_there_are(chain, tmp_path,
                                                                                                capsys):
    import shutil

    out, other = tmp_path / "run", tmp_path / "other-cache"
    shutil.copytree(chain / "cache", other)
    assert main([*_train_args(chain, "x", "--until", "2"), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main([*_train_args(chain, "x", "--set", "steps=4"), "--out", str(out), "--teacher", str(other)]) == 0
    said = capsys.readouterr().out
    assert "note: the run trained on" in said and str(other.resolve()) in said
    assert main([*_train_args(chain, "x", "--set", "batch_sequences=16"), "--out", str(tmp_path / "wide")]) == 0
    assert "batch_sequences=16 exceeds the 8 training sequences" in capsys.readouterr().out


def test_a_malformed_jsonl_prompt_file_is_named_at_its_own_line(tmp_path):
    from treespec.apps.data.datasets import DatasetError, read_rows

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": "cut\n')
    with pytest.raises(DatasetError, match=r"prompts.jsonl, line 2: not valid JSON"):
        read_rows(path)
