"""The machine runtime: the dtype choice (faked micro-benchmarks), cache keying, corrupt and stale
cache files, and the cost profile's JSON round trip and fit."""

from __future__ import annotations

import json

import pytest
import torch
from test_target import tiny_model

from treespec.pricing import hardware
from treespec.pricing.conditions import Load
from treespec.pricing.profile import CostProfile, machine_profile
from treespec.engines.torch import TargetModel


def fake_speed(bf16_1: float, bf16_17: float, fp32_1: float = 1.0, fp32_17: float = 2.0):
    calls = []

    def benchmark(shapes, rows=(1, 17), repeats=5):
        if rows == (1, 17):  # a full measurement (a re-check of a cached choice asks for 17 rows alone)
            calls.append(shapes)
        return {"bfloat16": {1: bf16_1, 17: bf16_17}, "float32": {1: fp32_1, 17: fp32_17}}

    return benchmark, calls


def test_the_faster_dtype_is_chosen_with_its_reason(tmp_path):
    config = tiny_model(dtype=torch.float32).config
    slow_bf16, calls = fake_speed(0.5, 28.0)  # bf16 without hardware support: 14x slower at 17 rows
    assert hardware.resolve_dtype("auto", config=config, cache_dir=tmp_path, benchmark=slow_bf16) == torch.float32
    choice = hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=slow_bf16)
    assert "bf16 is 14.0x slower here at 17 rows (2.0x faster at 1 row)" in choice.describe()
    assert len(calls) == 1  # the second call read the cache
    fast_bf16, _ = fake_speed(0.5, 1.0)
    assert hardware.resolve_dtype("auto", config=config, cache_dir=tmp_path / "other",
                                  benchmark=fast_bf16) == torch.bfloat16


def test_forced_dtypes_cuda_and_float64_checkpoints_skip_the_benchmark(tmp_path):
    never, calls = fake_speed(1.0, 1.0)
    config = tiny_model(dtype=torch.float32).config
    assert hardware.resolve_dtype("float32", config=config, cache_dir=tmp_path, benchmark=never) == torch.float32
    assert hardware.resolve_dtype(torch.bfloat16, config=config, cache_dir=tmp_path, benchmark=never) == torch.bfloat16
    assert hardware.resolve_dtype("checkpoint", config=config, cache_dir=tmp_path, benchmark=never) == "auto"
    assert hardware.resolve_dtype("auto", device="cuda", config=config, cache_dir=tmp_path,
                                  benchmark=never) == torch.bfloat16
    config.dtype = torch.bfloat16  # a config that names its stored dtype: "checkpoint" resolves to it, typed
    assert hardware.resolve_dtype("checkpoint", config=config, cache_dir=tmp_path, benchmark=never) == torch.bfloat16
    config.dtype = torch.float64
    assert hardware.resolve_dtype("auto", config=config, cache_dir=tmp_path, benchmark=never) == "auto"
    assert not calls
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        hardware.resolve_dtype("fp8", config=config)


def test_another_machine_model_or_torch_is_measured_again(tmp_path, monkeypatch):
    config = tiny_model(dtype=torch.float32).config
    bench, calls = fake_speed(0.5, 28.0)
    hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=bench)
    hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=bench)
    assert len(calls) == 1
    monkeypatch.setattr(hardware, "_cpu_model", lambda: "Some Other CPU")
    hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=bench)
    assert len(calls) == 2
    bigger = tiny_model(dtype=torch.float32, hidden=64).config
    hardware.cpu_dtype_choice(bigger, cache_dir=tmp_path, benchmark=bench)
    assert len(calls) == 3
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=bench)
    assert len(calls) == 4


@pytest.mark.parametrize("content", ["{not json", '{"key": "x"}', "[]", '{"dtype": "float32"}'])
def test_corrupt_or_foreign_cache_files_are_measured_again_with_a_warning(tmp_path, caplog, content):
    config = tiny_model(dtype=torch.float32).config
    bench, calls = fake_speed(0.5, 28.0)
    hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=bench)
    (path,) = tmp_path.glob("dtype-*.json")
    path.write_text(content)
    caplog.clear()
    assert hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=bench).dtype == torch.float32
    assert len(calls) == 2 and "measuring again" in caplog.text
    assert json.loads(path.read_text())["dtype"] == "float32"  # rewritten


def test_a_cached_choice_with_missing_fields_is_measured_again(tmp_path, caplog):
    config = tiny_model(dtype=torch.float32).config
    bench, calls = fake_speed(0.5, 28.0)
    hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=bench)
    (path,) = tmp_path.glob("dtype-*.json")
    record = json.loads(path.read_text())
    del record["dtype"]
    path.write_text(json.dumps(record))
    hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=bench)
    assert len(calls) == 2 and "dtype None is not one the probe chooses" in caplog.text


def test_a_real_micro_benchmark_measures_both_dtypes_quickly():
    speed = hardware.measure_linear_speed({(64, 32): 4, (128, 32): 1})
    assert set(speed) == {"bfloat16", "float32"} and all(s[n] > 0 for s in speed.values() for n in (1, 17))


def _tiny_target() -> TargetModel:
    torch.manual_seed(0)
    return TargetModel(tiny_model(dtype=torch.float32))


def test_profile_is_cached_keyed_and_round_trips(tmp_path, caplog, steady_timings):
    target = _tiny_target()
    first = machine_profile(target, sizes=(1, 2, 5), contexts=(8, 16), repeats=1, cache_dir=tmp_path)
    assert len(first.verify) == 6 and target.length == 0
    assert machine_profile(target, sizes=(1, 2, 5), contexts=(8, 16), repeats=1, cache_dir=tmp_path) == first
    assert CostProfile.from_record(json.loads(json.dumps(first.to_record()))) == first
    model = first.cost_model()
    assert model.contexts == (8, 16) and model.draft_cost == 0.0
    as64 = TargetModel(tiny_model(dtype=torch.float32).to(torch.float64))  # another dtype: measured anew
    other = machine_profile(as64, sizes=(1, 2, 5), contexts=(8, 16), repeats=1, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("profile-*.json"))) == 2 and other is not first
    (path,) = [p for p in tmp_path.glob("profile-*.json") if json.loads(p.read_text())["key"]["dtype"] == "float32"]
    path.write_text('{"key": 1')
    again = machine_profile(target, sizes=(1, 2, 5), contexts=(8, 16), repeats=1, cache_dir=tmp_path)
    assert "measuring again" in caplog.text and len(again.verify) == 6


def test_the_profile_prices_every_size_as_measured_and_the_convex_fit_on_request():
    """Measured verify times are not monotone (a 3-token forward slower than a 5-token one, as CPU kernels
    make them): the default curve keeps every sample, linear between; ``shape="convex"`` is CaDDTree's fit
    of n >= 2 with the one-token point as measured (a matrix-vector kernel of its own)."""
    samples = [(1, 128, 0.064), (2, 128, 0.150), (3, 128, 0.170), (5, 128, 0.140), (9, 128, 0.150),
               (17, 128, 0.160), (33, 128, 0.190)]
    profile = CostProfile(tuple(samples))
    costs = profile.cost_model().verify_costs(33, 128)
    assert [float(costs[n]) for n, _, _ in samples] == [s for _, _, s in samples]
    assert float(costs[4]) == pytest.approx(0.155) and float(costs[3]) > float(costs[5])  # the slow size stays slow
    convex = profile.cost_model(shape="convex").verify_costs(33, 128)
    assert float(convex[1]) == 0.064
    assert bool((convex[2:] >= 0.14).all()) and bool((convex[1:].diff() >= 0).all())
    assert bool((convex[2:-1].diff().diff() >= -1e-12).all())  # convex from n = 2 on
    assert profile.verify_in_steps(1) == 1.0 and profile.verify_in_steps(17) == pytest.approx(0.160 / 0.064)
    with pytest.raises(ValueError, match="curve shape"):
        profile.cost_model(shape="smooth")


def test_the_calibration_is_fitted_from_rounds_and_kept_with_the_profile(tmp_path, steady_timings):
    from treespec.pricing.calibration import Calibration
    from treespec.pricing.profile import save_profile

    target = _tiny_target()

    class Named:
        def __init__(self, weights: str = "w1") -> None:
            self.weights = weights

        def identity(self) -> str:
            return "a-drafter"

        def weights_digest(self) -> str:
            return self.weights

    profile = machine_profile(target, sizes=(1, 2), contexts=(8,), repeats=1, cache_dir=tmp_path)
    assert profile.calibration(Named()).identity
    fitted = Calibration(0.8, 0.7)
    save_profile(target, profile.with_calibration(Named(), fitted), sizes=(1, 2), contexts=(8,), cache_dir=tmp_path)
    again = machine_profile(target, sizes=(1, 2), contexts=(8,), repeats=1, cache_dir=tmp_path)
    assert again.calibration(Named()) == fitted and again.calibration("other").identity
    assert again.calibration(Named("w2")).identity  # the same drafter trained further starts uncalibrated
    record = again.to_record() | {"calibrations": {"a-drafter@w1": 0.9}}  # not a calibration of this format
    with pytest.raises(ValueError, match=r"a calibration is \[scale, power\], got 0.9"):
        type(again).from_record(record)


class Meter:
    """A `LoadMeter` stand-in that reports a fixed load of other processes."""

    def __init__(self, others: float, spare: float = 0.0) -> None:
        self.load = Load(others, 0.0, 1.0, spare)

    def start(self) -> None:
        pass

    def stop(self) -> Load:
        return self.load


@pytest.mark.parametrize("record, rule", [
    ({"dtype": "float64"}, "dtype 'float64' is not one the probe chooses (bfloat16 or float32)"),
    ({"seconds": {"bfloat16": {"1": -5.0, "17": 1.0}, "float32": {"1": 1.0, "17": 2.0}}},
     "seconds must be finite and positive"),
    ({"seconds": {"bfloat16": {"1": float("nan"), "17": 1.0}, "float32": {"1": 1.0, "17": 2.0}}},
     "seconds must be finite and positive"),
    ({"seconds": {"bfloat16": {"1": 0.5, "17": 1.0}, "float32": {"1": 1.0, "17": 2.0}}}, "choose the other dtype"),
])
def test_a_cached_choice_that_fails_its_checks_is_set_aside_naming_the_file_and_the_rule(tmp_path, caplog, record,
                                                                                          rule):
    config = tiny_model(dtype=torch.float32).config
    bench, calls = fake_speed(0.5, 28.0)
    hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=bench)
    (path,) = tmp_path.glob("dtype-*.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), **record}))
    caplog.clear()
    assert hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=bench).dtype == torch.float32
    err = caplog.text
    assert f"setting aside the cached measurement {path}" in err and rule in err and len(calls) == 2
    assert (tmp_path / (path.name + ".rejected")).is_file()  # kept for a look, never used
    assert json.loads(path.read_text())["dtype"] == "float32"  # measured again


def test_a_choice_measured_while_another_process_took_the_cores_is_not_cached(tmp_path):
    config = tiny_model(dtype=torch.float32).config
    bench, calls = fake_speed(0.5, 28.0)
    busy = hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=bench, meter=lambda: Meter(1.0))
    assert "not cached: other processes used 1.00 cores" in busy.reason and not list(tmp_path.glob("dtype-*.json"))
    assert hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=bench) == busy and len(calls) == 1  # kept
    other = tmp_path / "other"
    hardware.cpu_dtype_choice(config, cache_dir=other, benchmark=bench, meter=lambda: Meter(1.0, spare=1.0))
    assert len(calls) == 2 and len(list(other.glob("dtype-*.json"))) == 1  # a load on a spare core: cached


def test_a_cached_choice_the_re_check_contradicts_is_measured_again(tmp_path, caplog):
    config = tiny_model(dtype=torch.float32).config
    slow, calls = fake_speed(0.5, 28.0)
    hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=slow)
    fast, fast_calls = fake_speed(0.5, 1.0)  # bf16 now 2x faster at 17 rows: float32 no longer holds
    assert hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=fast).dtype == torch.bfloat16
    assert "no longer holds" in caplog.text and len(fast_calls) == 1
    hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=fast)
    assert len(fast_calls) == 1  # the re-check agrees with the new cache


def test_the_library_logs_its_lines_and_an_api_user_can_silence_them(tmp_path, caplog, capsys, monkeypatch):
    """What the library says while it measures (a damaged cache set aside) goes through
    ``logging.getLogger("treespec...")``: a level set on "treespec" silences it; the CLI's handler shows
    the same line as ``treespec: ...`` on stderr."""
    import logging

    from treespec.apps.cli import show_library_lines

    config = tiny_model(dtype=torch.float32).config
    bench, _ = fake_speed(0.5, 28.0)
    hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=bench)
    (path,) = tmp_path.glob("dtype-*.json")

    def damage_and_read() -> None:
        path.write_text("{not json")
        caplog.clear()
        capsys.readouterr()
        hardware.cpu_dtype_choice(config, cache_dir=tmp_path, benchmark=bench)

    library = logging.getLogger("treespec")
    monkeypatch.setattr(library, "level", library.level)  # restored after the test
    library.setLevel(logging.ERROR)
    damage_and_read()
    assert caplog.records == [] and "measuring again" not in capsys.readouterr().err
    library.setLevel(logging.NOTSET)
    show_library_lines()
    damage_and_read()
    (record,) = [r for r in caplog.records if "measuring again" in r.getMessage()]
    assert record.name == "treespec.pricing.hardware" and record.levelno == logging.WARNING
    assert f"treespec: ignoring the cached measurement {path}" in capsys.readouterr().err
