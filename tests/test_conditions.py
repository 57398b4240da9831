"""Measurements a busy machine cannot corrupt: the thread choice from the free cores, a run that
knows it was disturbed (measured again, left out of speeds), arms in a rotated order, and cached
costs that stay plausible.  Every reading of the machine is faked: /proc files written by the test,
a scripted load, mocked core counts."""

from __future__ import annotations

import json
import os
import time

import attrs
import pytest
import torch
from test_bench_runner import CONFIG, make_harness, prompt_files
from test_target import tiny_model

from treespec.apps import bench as ab
from treespec.apps.assembly.methods import parse_method
from treespec.apps.bench import measure
from treespec.apps.bench.measure import rotated
from treespec.apps.bench.records import BenchRecord
from treespec.apps.bench.summary import disturbed_note, summarize, threads_by_turn, threads_note
from treespec.apps.commands.demo import conditions_line
from treespec.pricing import conditions
from treespec.pricing.conditions import (
    DISTURBED_MARGIN,
    CpuTimes,
    Load,
    LoadMeter,
    ThreadChoice,
    ThreadControl,
    choose_threads,
    read_cpu_times,
    run_processes,
)
from treespec.pricing.profile import machine_profile
from treespec.engines.torch import TargetModel


def times(busy: dict[int, int], total: dict[int, int], own: int = 0, clock: float = 0.0) -> CpuTimes:
    return CpuTimes(busy, total, {c: 0 for c in busy}, {"self": own}, clock)


class Script:
    """A reader returning scripted `CpuTimes` in turn (None: the kernel's files cannot be read)."""

    def __init__(self, *readings) -> None:
        self.readings = list(readings)

    def __call__(self):
        return self.readings.pop(0)


def test_the_kernels_accounting_is_read_per_core_and_for_this_process(tmp_path):
    stat, own = tmp_path / "stat", tmp_path / "self"
    stat.write_text("cpu  30 0 10 60 0 0 0 0 0 0\ncpu0 10 0 5 80 5 0 0 0 0 0\ncpu1 20 0 5 20 0 0 0 5 0 0\n"
                    "intr 1 2 3\n")
    own.write_text("42 (python3 (x)) R 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15")  # utime 11, stime 12
    read = read_cpu_times(stat, [own, tmp_path / "exited"], clock=lambda: 7.0)
    assert read == CpuTimes({0: 15, 1: 30}, {0: 100, 1: 50}, {0: 0, 1: 5}, {str(own): 23}, 7.0)
    assert read_cpu_times(tmp_path / "missing", [own]) is None
    assert read_cpu_times(stat, [tmp_path / "missing"]) is None


def test_the_run_of_several_ranks_counts_its_sibling_ranks_as_its_own(tmp_path, monkeypatch):
    """Under a launcher the processes with this one's parent are the run's other ranks: their
    ticks are the run's, not another process's load (two single-thread ranks on two cores are not
    a disturbance; a hog beside them is)."""
    monkeypatch.setattr(conditions.os, "getppid", lambda: 500)
    monkeypatch.setattr(conditions.os, "getpid", lambda: 501)
    for pid, ppid in ((501, 500), (502, 500), (503, 1), (504, 500)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python3) S {ppid} 0 0 0 0 0 0 0 0 0 0 0")
    (tmp_path / "505").mkdir()  # a process that exited while the folder was read
    assert run_processes(1, tmp_path) == [tmp_path / "self" / "stat"]
    found = run_processes(2, tmp_path)
    assert found[0] == tmp_path / "self" / "stat" and sorted(found[1:]) == [tmp_path / "502" / "stat",
                                                                           tmp_path / "504" / "stat"]

    def load(sibling_ticks: int, hog: int) -> Load:  # rank 0's meter: its own 100 ticks, rank 1's, a hog's
        before = CpuTimes({0: 0, 1: 0}, {0: 0, 1: 0}, {0: 0, 1: 0}, {"self": 0, "rank1": 0}, 0.0)
        busy = 100 + sibling_ticks + hog
        after = CpuTimes({0: busy // 2, 1: busy - busy // 2}, {0: 100, 1: 100}, {0: 0, 1: 0},
                         {"self": 100, "rank1": sibling_ticks}, 1.0)
        meter = LoadMeter(1, ranks=2, cores=[0, 1], reader=Script(before, after))
        meter.start()
        return meter.stop()

    assert load(100, hog=0).others == 0.0 and not load(100, hog=0).disturbed
    assert load(50, hog=50).others == pytest.approx(0.5) and load(50, hog=50).disturbed


def test_every_rank_of_a_launched_run_names_the_same_run(tmp_path, monkeypatch):
    """Records of one torchrun invocation carry one run id (the launcher's start and pid), so the
    report does not take its ranks for the runs of a resumed folder."""
    (tmp_path / "700").mkdir()
    tick = os.sysconf("SC_CLK_TCK")
    (tmp_path / "700" / "stat").write_text("700 (torchrun) S 1 " + " ".join(["0"] * 17) + f" {42 * tick} 0")
    (tmp_path / "stat").write_text("cpu  1 2 3 4\nbtime 1764900000\n")
    monkeypatch.setattr(measure.os, "getppid", lambda: 700)
    monkeypatch.setenv("WORLD_SIZE", "2")
    ranks = set()
    for pid in (701, 702):
        monkeypatch.setattr(measure.os, "getpid", lambda pid=pid: pid)
        ranks.add(measure.run_identity(tmp_path))
    (only,) = ranks
    assert only == time.strftime("%Y%m%dT%H%M%S", time.localtime(1764900042)) + "-700"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert measure.run_identity(tmp_path).endswith("-702")


def test_the_thread_choice_leaves_out_a_core_another_process_keeps_busy():
    quiet = choose_threads(0, cores=[0, 1], reader=Script(times({0: 0, 1: 0}, {0: 0, 1: 0}),
                                                          times({0: 2, 1: 3}, {0: 30, 1: 30}, clock=0.3)),
                           sleep=lambda s: None)
    assert quiet.threads == 2 and quiet.reason == "all 2 cores free over 0.3 s"
    busy = choose_threads(0, cores=[0, 1], reader=Script(times({0: 0, 1: 0}, {0: 0, 1: 0}),
                                                         times({0: 29, 1: 1}, {0: 30, 1: 30}, clock=0.3)),
                          sleep=lambda s: None)
    assert busy.threads == 1 and busy.reason == "1 of 2 cores free (cpu0 97 % busy over 0.3 s)"
    everything = choose_threads(0, cores=[0, 1], reader=Script(times({0: 0, 1: 0}, {0: 0, 1: 0}),
                                                               times({0: 30, 1: 30}, {0: 30, 1: 30})),
                                sleep=lambda s: None)
    assert everything.threads == 1  # never fewer than one
    blind = choose_threads(0, cores=[0, 1], default=3, reader=Script(None, None), sleep=lambda s: None)
    assert blind.threads == 3 and not blind.measured


def test_a_span_is_disturbed_only_when_others_take_the_cores_it_uses():
    """Others' load is the cores' busy time less this process's own; a load on a core the thread
    choice left free is not a disturbance, one on the cores in use is."""
    def load(threads: int, busy: int, own: int) -> Load:
        meter = LoadMeter(threads, cores=[0, 1], reader=Script(times({0: 0, 1: 0}, {0: 0, 1: 0}),
                                                               times({0: busy // 2, 1: busy - busy // 2},
                                                                     {0: 100, 1: 100}, own=own, clock=1.0)))
        meter.start()
        return meter.stop()

    alone = load(2, busy=190, own=190)  # this process kept both cores busy: nobody else ran
    assert alone.others == 0.0 and not alone.disturbed
    hogged = load(2, busy=200, own=100)  # a hog took a core this two-thread run was using
    assert hogged.others == pytest.approx(1.0) and hogged.disturbed
    beside = load(1, busy=200, own=100)  # the same hog beside a one-thread run, on the core it left free
    assert beside.spare == 1 and not beside.disturbed
    assert Load(0.25, 0.0, 1.0, 0).disturbed is (0.25 > DISTURBED_MARGIN)
    unknown = LoadMeter(2, cores=[0, 1], reader=Script(None, None))
    unknown.start()
    blind = unknown.stop()
    assert not blind.known and not blind.disturbed


def test_threads_given_are_kept_and_chosen_ones_follow_the_load(monkeypatch):
    said = []
    given = ThreadControl.start(2, reason="as asked (--threads)", report=said.append)
    assert given.fixed and not given.adapt(lambda default: ThreadChoice(1, "busy")) and torch.get_num_threads() == 2
    choices = iter([ThreadChoice(2, "all 2 cores free"), ThreadChoice(1, "1 of 2 cores free (cpu1 99 % busy)")])
    chosen = ThreadControl.start(report=said.append, chooser=lambda default: next(choices))
    assert chosen.threads == 2 and torch.get_num_threads() == 2
    assert chosen.adapt(lambda default: next(choices)) and chosen.threads == 1 and torch.get_num_threads() == 1
    assert said == ["treespec: another process took cores: threads 1: 1 of 2 cores free (cpu1 99 % busy) (was 2)"]
    ranks = ThreadControl.start(report=said.append, ranks=2, chooser=lambda default: ThreadChoice(2, "all free"))
    assert ranks.threads == 1 and ranks.meter().spare == max(0, len(conditions.allowed_cores()) - 2)
    torch.set_num_threads(1)



def test_threads_chosen_down_rise_again_once_the_spare_cores_sit_idle():
    """One of two cores busy at start: one thread.  While the load holds its core (others ~1 core of the
    1 left spare) nothing is checked; once it leaves, the next quiet turn chooses again and rises; a
    choice that still sees the core busy keeps one thread; never above the ceiling, never when given."""
    said, asked = [], []

    def chooser(free):
        def choose(default):
            asked.append(default)
            return ThreadChoice(free, f"{free} of 2 cores free")
        return choose

    control = ThreadControl.start(report=said.append, chooser=chooser(1))
    control.ceiling = 2
    held = Load(0.98, 0.0, 1.0, 1)  # the hog kept the spare core
    idle = Load(0.05, 0.0, 1.0, 1)
    assert not control.regain([held, idle], chooser(2)) and asked == [1]  # not even checked
    assert not control.regain([idle], chooser(1)) and control.threads == 1  # checked: still busy
    assert control.regain([idle, idle], chooser(4)) and control.threads == 2 and torch.get_num_threads() == 2
    assert said == ["treespec: cores free again: threads 2: 4 of 2 cores free (was 1)"]
    assert not control.regain([Load(0.0, 0.0, 1.0, 0)], chooser(2)) and len(asked) == 3  # at the ceiling
    given = ThreadControl.start(1, reason="as asked", report=said.append)
    assert not given.regain([idle], chooser(2)) and given.threads == 1 and len(asked) == 3
    torch.set_num_threads(1)

def test_rotation_puts_every_method_at_every_place_equally_often():
    methods = [parse_method(m) for m in ("ar", "dflash", "ddtree@4", "dominotree@4")]
    places = {m.name: [0] * 4 for m in methods}
    for seed in range(400, 440):
        for place, m in enumerate(rotated(methods, seed)):
            places[m.name][place] += 1
    assert all(counts == [10, 10, 10, 10] for counts in places.values())


class ScriptedThreads(ThreadControl):
    """A run's threads whose meters report a scripted load per measurement: a load that comes and goes."""

    def __init__(self, loads) -> None:
        super().__init__(ThreadChoice(2, "all 2 cores free"), report=lambda line: None)
        self.loads = loads  # the others' cores of each measurement in turn (the last repeats)
        self.adapted = 0

    def meter(self):
        others = self.loads.pop(0) if len(self.loads) > 1 else self.loads[0]

        class Fixed:
            threads, spare = 2, 0

            def start(self):
                pass

            def stop(self):
                return Load(others, 0.0, 0.1, 0)

        return Fixed()

    def adapt(self, chooser=None) -> bool:
        self.adapted += 1
        return True


def test_a_turn_a_passing_load_disturbed_is_measured_again_and_a_lasting_one_left_out(tmp_path):
    """Two methods, two turns of one prompt each.  Passing load: the first measurement of turn one is
    disturbed, the turn is measured again clean.  Lasting load: both attempts disturbed, the turn is
    kept flagged; the report leaves it out of the speeds and says so; no costs are saved."""
    config = attrs.evolve(CONFIG, methods=("ar", "ddtree@4"), temperatures=(0.0,), prompts=1,
                          datasets=prompt_files(tmp_path)[:1], warmup_tokens=0)
    for name, loads, still in (("passing", [1.0, 0.0], 0), ("lasting", [1.0], 1)):
        harness = make_harness()
        harness.threads = ScriptedThreads(list(loads))
        out = tmp_path / name
        ab.run_shard(config, harness, out, progress=False)
        ab.merge_shards(out)
        records = list(ab.read_records(out / ab.RECORDS))
        assert harness.disturbed == 1 and harness.threads.adapted == 1  # one disturbed turn, measured again
        assert sum(r.disturbed for r in records) == 2 * still and all(r.threads == 2 for r in records)
        report = ab.write_report(out, resamples=20)
        assert ("every one of the 1 prompt turns ran while another process" in report.table) == bool(still)
        harness.profile = harness.machine_profile()  # as a priced run would have it
        assert harness.close() is None and "disturbed by another process" in harness.not_saved


def record(method: str, prompt: str, seconds: float, others: float = 0.0, threads: int = 2) -> BenchRecord:
    return BenchRecord(method=method, policy="ar" if method == "ar" else "ddtree", budget=0 if method == "ar" else 4,
                       temperature=0.0, dataset="d", prompt_id=prompt, turn=0, seed=1, tokens=[1] * 10, taus=[1] * 10,
                       decode_time=seconds, prefill_time=0.0, stage_times={}, threads=threads,
                       load=Load(others, 0.0, seconds, 0).to_record())


def test_disturbed_turns_are_left_out_of_the_paired_speedups():
    clean = [record("ar", p, 1.0) for p in "abc"] + [record("ddtree@4", p, 0.5) for p in "abc"]
    hit = [record("ar", "d", 1.0), record("ddtree@4", "d", 9.0, others=1.0)]  # the method ran under a hog
    (ar, tree) = summarize(clean + hit, resamples=50)
    assert tree.method == "ddtree@4" and tree.speedup == pytest.approx(2.0) and tree.prompts == 4
    assert tree.speedup_lo == pytest.approx(2.0) and tree.speedup_hi == pytest.approx(2.0)
    assert "1 of 4 prompt turns ran while another process took cores" in disturbed_note(clean + hit)
    assert disturbed_note(clean) == ""
    (_, everything) = summarize(hit, resamples=10)  # every turn hit: the speeds are the disturbed ones, said so
    assert everything.speedup == pytest.approx(1 / 9) and "every one of the 1 prompt turns" in disturbed_note(hit)



def test_a_run_whose_threads_followed_the_load_says_how_many_turns_ran_with_each():
    steady = [record(m, p, 1.0) for m in ("ar", "ddtree@4") for p in "abc"]
    assert threads_note(steady) == "" and "threads followed" not in conditions_line(steady, 0)
    moved = [record(m, p, 1.0, threads=1 if p in "ab" else 2) for m in ("ar", "ddtree@4") for p in "abc"]
    assert threads_by_turn(moved) == {1: 2, 2: 1}
    assert "threads on prompt turns: 1 on 2, 2 on 1" in threads_note(moved)
    assert conditions_line(moved, 0).endswith("; threads followed the load: 1 on 2 turns, 2 on 1 turn")

def tiny_profile_target() -> TargetModel:
    return TargetModel(tiny_model(vocab=64, hidden=32, layers=2))


@pytest.mark.parametrize("verify, rule", [
    ([], "it holds no verify samples"),
    ([[1, 8, -5.0]], "verify seconds must be finite and positive"),
    ([[1, 8, float("nan")]], "verify seconds must be finite and positive"),
])
def test_a_corrupt_cached_profile_is_set_aside_and_measured_again(tmp_path, caplog, verify, rule, steady_timings):
    target = tiny_profile_target()
    machine_profile(target, sizes=(1, 2), contexts=(8,), repeats=1, cache_dir=tmp_path)
    (path,) = tmp_path.glob("profile-*.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), "verify": verify}))
    again = machine_profile(target, sizes=(1, 2), contexts=(8,), repeats=1, cache_dir=tmp_path)
    err = caplog.text
    assert f"setting aside the cached measurement {path}: {rule}" in err
    assert all(s > 0 for _, _, s in again.verify) and (tmp_path / (path.name + ".rejected")).is_file()


def test_an_implausible_saved_curve_is_dropped_at_load_naming_the_rule(tmp_path, caplog, steady_timings):
    """A live curve learned under load (trees at a quarter of the one-token step) is refused; the
    profile's own measured values, dips included, stand."""
    target = tiny_profile_target()
    profile = machine_profile(target, sizes=(1, 2, 5), contexts=(8,), repeats=1, cache_dir=tmp_path)
    (path,) = tmp_path.glob("profile-*.json")
    seconds = {n: s for n, _, s in profile.verify}
    record = json.loads(path.read_text())
    record["live_verify"] = [[1, 8, 2 * seconds[1], 40], [2, 8, seconds[2] / 2, 40], [5, 8, seconds[5] / 2, 40]]
    path.write_text(json.dumps(record))
    again = machine_profile(target, sizes=(1, 2, 5), contexts=(8,), repeats=1, cache_dir=tmp_path)
    err = caplog.text
    assert f"dropping the live correction of the cached cost profile {path}" in err and "AR steps" in err
    assert again.live_verify == () and again.verify == profile.verify
    assert json.loads(path.read_text())["live_verify"] == []  # rewritten without it: said once


def test_a_profile_measured_under_load_is_used_but_not_cached(tmp_path, caplog):
    class Busy:
        def start(self):
            pass

        def stop(self):
            return Load(1.0, 0.0, 1.0, 0)

    target = tiny_profile_target()
    busy = machine_profile(target, sizes=(1, 2), contexts=(8,), repeats=1, cache_dir=tmp_path, meter=Busy)
    assert busy.disturbed and not list(tmp_path.glob("profile-*.json"))
    assert "used for this run, not cached" in caplog.text
