"""The conditions a measurement runs under: which cores are free, and whether another process took them.

Contract
--------
Timings on a small machine are only as good as the cores they ran on: two intra-op threads on two
cores slow to a third of their speed the moment another process takes one core, while one thread on
the free core keeps almost all of it.  This module reads the kernel's own accounting (Linux
``/proc/stat`` per core, ``/proc/self/stat`` for this process) and answers two questions:

* `choose_threads(window)`: how many intra-op threads to run: the cores of this process's affinity
  mask that were not busy with other work over a short window (``window`` seconds; a core counts
  as busy when other processes and the hypervisor, "steal", took more than `BUSY_SHARE` of it),
  at least one.  The answer names its reason, e.g. ``1 of 2 cores (cpu1 97 % busy over 0.3 s)``.
* `LoadMeter`: over a span of work (a bench turn, a dtype probe, a cost profile), the cores that
  other processes used, in cores: busy time of the allowed cores not spent by the run's own
  processes (this one, and under a launcher such as torchrun its sibling ranks: the processes with
  the same parent), plus time stolen by the hypervisor, per second.  A span is **disturbed** when that exceeds the cores
  this process leaves free (allowed cores less its threads) by more than `DISTURBED_MARGIN`: another
  process then competed for the cores this one was using.  A load that sits on a core the thread
  choice left free does not disturb.

Where the kernel does not offer these files (not Linux), `choose_threads` keeps torch's own count
and says so, and a `LoadMeter` reads no load (``Load.known`` False): nothing is marked disturbed.
Every reader takes its clock and file paths as arguments, so tests drive it with fake ones.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

__all__ = ["BUSY_SHARE", "DISTURBED_MARGIN", "THREADS_ENV", "CpuTimes", "Load", "LoadMeter", "ThreadChoice",
           "ThreadControl", "allowed_cores", "busy_shares", "check_threads", "choose_threads", "current_meter", "process_started",
           "read_cpu_times", "run_processes"]

BUSY_SHARE = 0.5  # a core whose time went more than half to other work is not free
DISTURBED_MARGIN = 0.3  # cores of others' load beyond the free ones that mark a span disturbed
THREADS_ENV = "TREESPEC_THREADS"  # the threads of every command where it is set (the test suite sets 1)


@attrs.frozen
class CpuTimes:
    """One reading of the kernel's accounting, in clock ticks since boot."""

    busy: dict[int, int]  # core -> ticks not idle (user, nice, system, irq, softirq, steal)
    total: dict[int, int]  # core -> all ticks
    steal: dict[int, int]  # core -> ticks the hypervisor gave to other guests
    own: dict[str, int]  # the run's processes (their stat files) -> user + system ticks (every thread, every core)
    clock: float  # seconds on the caller's clock when it was read


def read_cpu_times(stat: Path = Path("/proc/stat"), own: Sequence[Path] = (Path("/proc/self/stat"),),
                   clock: Callable[[], float] = time.perf_counter) -> CpuTimes | None:
    """The per-core ticks of ``stat`` and the run's processes' of ``own`` (this process's file first;
    a sibling's that cannot be read, one that has exited, is left out); None where ``stat`` or the
    first of ``own`` cannot be read."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    ticks_of = {str(path): ticks for path in own if (ticks := _process_ticks(path)) is not None}
    if not own or str(own[0]) not in ticks_of:
        return None
    busy, total, steal = {}, {}, {}
    for line in lines:
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        ticks = [int(v) for v in values[:8]] + [0] * (8 - len(values[:8]))  # user nice system idle iowait irq softirq steal
        core = int(name[3:])
        total[core] = sum(ticks)
        busy[core] = total[core] - ticks[3] - ticks[4]
        steal[core] = ticks[7]
    return CpuTimes(busy, total, steal, ticks_of, clock())


def _process_ticks(path: Path) -> int | None:
    """utime + stime of a process's stat file (fields 14 and 15 of proc(5)); None where unreadable."""
    try:
        fields = _stat_fields(path)
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def run_processes(ranks: int, proc: Path = Path("/proc")) -> list[Path]:
    """The stat files of the run's processes: this one's, and with ``ranks`` > 1 those of the other
    processes with the same parent (the launcher's other ranks)."""
    own = [proc / "self" / "stat"]
    if ranks == 1:
        return own
    parent, me = os.getppid(), os.getpid()
    for entry in proc.glob("[0-9]*"):
        try:
            ppid = int(_stat_fields(entry / "stat")[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and int(entry.name) != me:
            own.append(entry / "stat")
    return own


def process_started(pid: int, proc: Path = Path("/proc")) -> float | None:
    """When process ``pid`` started, in seconds since the epoch (proc(5): the boot time plus its
    start ticks); None where that cannot be read."""
    try:
        ticks = int(_stat_fields(proc / str(pid) / "stat")[19])  # field 22, starttime
        boot = next(int(line.split()[1]) for line in (proc / "stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, IndexError, ValueError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _stat_fields(path: Path) -> list[str]:
    """A stat file's fields after the command name: state, ppid, ..."""
    return path.read_text().rsplit(")", 1)[1].split()


def busy_shares(before: CpuTimes, after: CpuTimes, cores: Sequence[int]) -> dict[int, float]:
    """core -> share of its ticks between the readings that were busy (steal included)."""
    shares = {}
    for core in cores:
        spent = after.total.get(core, 0) - before.total.get(core, 0)
        shares[core] = (after.busy.get(core, 0) - before.busy.get(core, 0)) / spent if spent > 0 else 0.0
    return shares


def allowed_cores() -> list[int]:
    """The cores this process may run on (its affinity mask; every core where there is none)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def check_threads(value: int | str, where: str = "threads") -> int:
    """``value`` (a number or its text) as a thread count: a whole number from 1 to the cores this
    process may run on (more would run every measurement oversubscribed); else a ValueError naming
    ``where`` (``--threads``, ``$TREESPEC_THREADS``, ``threads=``).  The one thread-count rule."""
    try:
        threads = int(value) if isinstance(value, str) else value
    except ValueError:
        threads = None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{where} must be a whole number of threads >= 1, got {value!r}")
    cores = len(allowed_cores())
    if threads > cores:
        raise ValueError(f"{where} {threads}: this process may run on {cores} core(s); more threads than cores "
                         "would run every measurement oversubscribed")
    return threads


@attrs.frozen
class ThreadChoice:
    """How many intra-op threads to run, and why."""

    threads: int
    reason: str  # one line, for the user
    measured: bool = True  # False: nothing could be read, torch's own count kept

    def describe(self) -> str:
        return f"threads {self.threads}: {self.reason}"


def choose_threads(window: float = 0.3, *, cores: Sequence[int] | None = None, default: int | None = None,
                   reader: Callable[[], CpuTimes | None] | None = None,
                   sleep: Callable[[float], None] = time.sleep) -> ThreadChoice:
    """The cores of ``cores`` (this process's) that were free over ``window`` seconds (module docstring);
    ``default`` (torch's count) where the kernel's accounting cannot be read (``reader``: by default
    `read_cpu_times`)."""
    reader = reader or read_cpu_times
    cores = list(cores if cores is not None else allowed_cores())
    before = reader()
    sleep(window)
    after = reader()
    if before is None or after is None:
        kept = default or len(cores)
        return ThreadChoice(kept, "the machine's load cannot be read here; torch's own count", measured=False)
    shares = busy_shares(before, after, cores)
    busy = {c: s for c, s in shares.items() if s > BUSY_SHARE}
    threads = max(1, len(cores) - len(busy))
    seconds = after.clock - before.clock
    if not busy:
        return ThreadChoice(threads, f"all {len(cores)} cores free over {seconds:.1f} s")
    taken = ", ".join(f"cpu{c} {100 * s:.0f} % busy" for c, s in sorted(busy.items()))
    return ThreadChoice(threads, f"{threads} of {len(cores)} cores free ({taken} over {seconds:.1f} s)")


@attrs.frozen
class Load:
    """What other processes took while a span of work ran."""

    others: float  # cores used by other processes and the hypervisor (steal), on average over the span
    steal: float  # of which stolen by the hypervisor, in cores
    seconds: float  # the span's length
    spare: float  # cores the span left free (allowed cores less its threads)
    known: bool = True  # False: the load could not be read

    @property
    def disturbed(self) -> bool:
        """Other work competed for the cores this span was using (module docstring)."""
        return self.known and self.others > self.spare + DISTURBED_MARGIN

    def describe(self) -> str:
        if not self.known:
            return "load unknown"
        steal = f", {self.steal:.2f} stolen" if self.steal >= 0.05 else ""
        return f"other processes used {self.others:.2f} cores{steal} (free for them: {self.spare:g})"

    def to_record(self) -> dict:
        return {"others": round(self.others, 4), "steal": round(self.steal, 4), "seconds": round(self.seconds, 4),
                "spare": self.spare, "known": self.known}


UNKNOWN = Load(0.0, 0.0, 0.0, 0.0, known=False)


class LoadMeter:
    """Others' load over a span of work run with ``threads`` threads in each of ``ranks`` processes
    of the run (module docstring)."""

    def __init__(self, threads: int, *, ranks: int = 1, cores: Sequence[int] | None = None,
                 reader: Callable[[], CpuTimes | None] | None = None,
                 processes: Sequence[Path] | None = None) -> None:
        self.cores = list(cores if cores is not None else allowed_cores())
        self.threads = threads
        self.spare = max(0, len(self.cores) - threads * ranks)
        own = tuple(processes if processes is not None else run_processes(ranks))  # the run's processes
        self.reader = reader or (lambda: read_cpu_times(own=own))
        self._start: CpuTimes | None = None

    def start(self) -> None:
        self._start = self.reader()

    def stop(self) -> Load:
        """The load since `start` (`UNKNOWN` where it could not be read)."""
        before, after = self._start, self.reader()
        if before is None or after is None:
            return UNKNOWN
        ticks = [after.total.get(c, 0) - before.total.get(c, 0) for c in self.cores]
        per_core = sum(ticks) / len(ticks) if ticks else 0
        if per_core <= 0:
            return Load(0.0, 0.0, after.clock - before.clock, self.spare)
        busy = sum(after.busy.get(c, 0) - before.busy.get(c, 0) for c in self.cores)
        steal = sum(after.steal.get(c, 0) - before.steal.get(c, 0) for c in self.cores)
        own = sum(after.own[p] - before.own[p] for p in before.own if p in after.own)  # the run's processes
        others = max(0.0, (busy - own) / per_core)
        return Load(others, steal / per_core, after.clock - before.clock, self.spare)


def current_meter() -> LoadMeter:
    """A meter over the threads torch runs with now: for a measurement made outside a run's
    `ThreadControl` (whose ``meter`` is the one to use inside a run)."""
    import torch

    return LoadMeter(torch.get_num_threads())


@attrs.define
class ThreadControl:
    """The intra-op threads of a run: given (``--threads``: never changed), or chosen from the cores
    free at start, chosen again (down) after a measurement another process disturbed, and chosen again
    (up) after one during which the cores they left to others sat idle."""

    choice: ThreadChoice  # the current threads (of each process of the run) and why
    fixed: bool = False  # given by the user: kept whatever the load
    report: Callable[[str], None] = print  # where a change of threads is said
    ranks: int = 1  # processes of the run sharing the cores (bench ranks), each with these threads
    ceiling: int = 0  # the most threads each process may take (its share of the allowed cores); 0: never raised
    processes: tuple[Path, ...] | None = attrs.field(default=None, init=False)  # the run's, found at the first meter

    @classmethod
    def start(cls, threads: int | None = None, *, reason: str = "as asked", report: Callable[[str], None] = print,
              ranks: int = 1, chooser: Callable[..., ThreadChoice] = choose_threads) -> ThreadControl:
        """``threads`` if given (>= 1; ``reason`` says who asked), else the free cores shared among
        ``ranks`` processes; sets torch's intra-op threads."""
        import torch

        if threads is not None:
            threads = check_threads(threads, "threads")
            torch.set_num_threads(threads)
            return cls(ThreadChoice(threads, reason), fixed=True, report=report, ranks=ranks)
        choice = _shared(chooser(default=torch.get_num_threads()), ranks)
        if not choice.measured:
            return cls(choice, report=report, ranks=ranks)
        torch.set_num_threads(choice.threads)
        return cls(choice, report=report, ranks=ranks, ceiling=max(1, len(allowed_cores()) // ranks))

    @classmethod
    def keep(cls, report: Callable[[str], None] = print) -> ThreadControl:
        """The threads torch runs with now, fixed: a run that was given no choice of its own."""
        import torch

        return cls(ThreadChoice(torch.get_num_threads(), "torch's count"), fixed=True, report=report)

    @property
    def threads(self) -> int:
        return self.choice.threads

    def meter(self) -> LoadMeter:
        """A meter of others' load over a span run with the current threads (every rank's)."""
        if self.processes is None:
            self.processes = tuple(run_processes(self.ranks))
        return LoadMeter(self.threads, ranks=self.ranks, processes=self.processes)

    def adapt(self, chooser: Callable[..., ThreadChoice] = choose_threads) -> bool:
        """After a disturbed measurement: the threads chosen again from the cores free now (said when they
        change); True when the measurement should be made again (always, unless the threads were given)."""
        if self.fixed:
            return False
        import torch

        choice = _shared(chooser(default=self.threads * self.ranks), self.ranks)
        if choice.measured and choice.threads != self.threads:
            torch.set_num_threads(choice.threads)
            self.report(f"treespec: another process took cores: {choice.describe()} (was {self.threads})")
            self.choice = choice
        return True

    def regain(self, loads: Sequence[Load], chooser: Callable[..., ThreadChoice] = choose_threads) -> bool:
        """After a measurement no other process disturbed, made of the spans ``loads``: where the threads
        are below `ceiling` and the cores they left to others sat mostly idle over every span (others
        used at most `BUSY_SHARE` of them), the threads chosen again from the cores free now; True (and
        said) when they rose.  A load that keeps its core busy never triggers the check."""
        if self.fixed or self.threads >= self.ceiling or not loads:
            return False
        if any(not load.known or load.others > load.spare * BUSY_SHARE for load in loads):
            return False
        import torch

        choice = _shared(chooser(default=self.threads * self.ranks), self.ranks)
        if not choice.measured or choice.threads <= self.threads:
            return False
        choice = attrs.evolve(choice, threads=min(choice.threads, self.ceiling))
        torch.set_num_threads(choice.threads)
        self.report(f"treespec: cores free again: {choice.describe()} (was {self.threads})")
        self.choice = choice
        return True


def _shared(choice: ThreadChoice, ranks: int) -> ThreadChoice:
    """``choice``'s free cores split among ``ranks`` processes (at least one thread each)."""
    if ranks == 1 or not choice.measured:
        return choice
    return ThreadChoice(max(1, choice.threads // ranks), f"{choice.reason}, shared by {ranks} ranks")
