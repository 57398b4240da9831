"""Traces that know when they are damaged: each tensor's digest in the header, checked on load (so by
`replay info` and before `replay eval` uses a trace), token ids and counts range-checked, one line
naming the file and what failed; a trace written before the digests loads, saying it cannot be checked."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from test_replay import World

from treespec.apps.cli import main
from treespec.apps.replay import RecordConfig, Trace, TraceError
from treespec.apps.replay.trace import META_KEY, _flatten


@pytest.fixture(scope="module")
def world():
    return World(64, RecordConfig(max_new_tokens=8, max_budget=32, min_k=4), n_prompts=2, seed=3)


def data_start(path) -> int:
    (header,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8 + header


def flip_bytes(path, count: int, seed: int = 0) -> None:
    """``count`` bytes of the tensors' data (not the header) inverted, at seeded places."""
    raw = bytearray(path.read_bytes())
    start = data_start(path)
    places = torch.randperm(len(raw) - start, generator=torch.Generator().manual_seed(seed))[:count] + start
    for i in places.tolist():
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def save_without_digests(tensors: dict, meta: dict, path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={META_KEY: json.dumps(meta)})


def test_a_saved_trace_loads_checked(world, tmp_path):
    path = world.trace.save(tmp_path / "t.safetensors")
    assert Trace.load(path).checked


@pytest.mark.parametrize("action", [["info"], ["eval", "--methods", "dominotree@16"], ["eval", "--methods", "ddtree@16"]])
def test_flipped_data_bytes_are_refused_in_one_line(world, tmp_path, capsys, action):
    path = world.trace.save(tmp_path / "t.safetensors")
    flip_bytes(path, 2000)
    with pytest.raises(TraceError, match="does not match its digest; the trace is damaged"):
        Trace.load(path)
    capsys.readouterr()
    assert main(["replay", action[0], str(path), *action[1:]]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "does not match its digest" in err
    assert "Traceback" not in err


def test_a_trace_without_digests_loads_saying_it_cannot_be_checked(world, tmp_path, capsys, caplog):
    path = tmp_path / "old.safetensors"
    save_without_digests(_flatten(world.trace), world.trace.meta, path)
    loaded = Trace.load(path)
    assert not loaded.checked and f"{path} was recorded without digests" in caplog.text
    assert main(["replay", "info", str(path)]) == 0
    assert "recorded without digests (not checked)" in capsys.readouterr().out


@pytest.mark.parametrize(("name", "value", "rule"), [
    ("domino.scorer.round.base_tokens", 5570603, "base_tokens holds a token id outside the vocabulary"),
    ("dflash.tokens", -3, "the dflash drafter holds a token id outside its vocabulary"),
    ("trajectory.tokens", 64, "holds a token id outside the vocabulary (64)"),
    ("dflash.logprobs", float("nan"), "a log-probability that is NaN"),
    ("dflash.counts", -1, "counts >= 0"),
])
def test_ids_and_counts_out_of_range_are_refused_without_digests_too(world, tmp_path, name, value, rule):
    """An old trace (no digests) with a damaged id is caught by the range checks before a replay reads it."""
    tensors = _flatten(world.trace)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[-1] = value
    path = tmp_path / "bad.safetensors"
    save_without_digests(tensors, world.trace.meta, path)
    with pytest.raises(TraceError, match="the trace is damaged") as caught:
        Trace.load(path)
    assert rule in str(caught.value) and str(path) in str(caught.value)


def test_a_missing_tensor_is_named(world, tmp_path):
    tensors = _flatten(world.trace)
    del tensors["dflash.logprobs"]
    path = tmp_path / "short.safetensors"
    save_without_digests(tensors, world.trace.meta, path)
    with pytest.raises(TraceError, match="lacks the tensor\\(s\\) dflash.logprobs"):
        Trace.load(path)
