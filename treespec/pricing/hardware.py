"""The machine treespec runs on: its identity, its cache directory, and the dtype that is fastest here.

Contract
--------
* `machine_identity()`: what makes timings of this machine comparable: CPU model string, core
  count, torch's intra-op threads and torch version (plus the GPU's name on CUDA).  Cached
  measurements (this module's dtype choice, `treespec.pricing.profile`'s cost profiles) are keyed by it, so
  a measurement from another machine, thread count or torch build is never used.
* `resolve_dtype(dtype, device=..., config=...)`: ``"auto"`` becomes bf16 on CUDA; on a CPU the
  faster of bf16 and fp32 for this target's own linear shapes, measured once by a micro-benchmark
  (about a second: weights streamed from memory as a forward does, `measure_linear_speed`) at 1 row (an
  autoregressive step) and 17 rows (a 16-node tree verify), the two weighted alike.  The choice is
  cached in ``cache_root() / "machine"`` and printed once per process with its reason, e.g.
  ``float32: bf16 is 2.1x slower here at 17 rows (1.7x faster at 1 row)``.  A float64 checkpoint
  stays float64 (asked-for exactness); ``"checkpoint"`` keeps the checkpoint's stored dtype; any
  torch dtype or its name is used as given.
* A corrupt or foreign cache file is re-measured with a one-line warning, never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from treespec.pricing.conditions import current_meter
from treespec.target import DTYPE_NAMES, stored_dtype

logger = logging.getLogger(__name__)  # one line per event; the CLI shows them as "treespec: ..."

__all__ = [
    "CACHE_ENV", "DtypeChoice", "cache_root", "choose_dtype", "digest", "linear_shapes", "machine_identity",
    "machine_file", "measure_linear_speed", "read_cached", "recheck_dtype", "resolve_dtype", "set_aside",
    "write_cached", "check_dtype_record",
]

CACHE_ENV = "TREESPEC_CACHE"
_ROWS = (1, 17)  # an AR step and a budget-16 tree verify
_STREAM_ELEMENTS = 24 * 2**20  # weights streamed per benchmark pass: 96 MB in fp32, beyond a CPU cache
_COPY_ELEMENTS = 2**18  # the least weights in one streamed copy (a tiny target's shape made taller), lest
# thousands of calls time Python's per-call work instead of memory
_PRINTED: set[str] = set()  # choices already reported in this process
_UNCACHED: dict[str, DtypeChoice] = {}  # choices measured under load in this process (not on disk), by cache file
CHOICES = ("bfloat16", "float32")  # the dtypes the probe chooses between
RECHECK_MARGIN = 1.3  # a cached dtype more than this much slower at 17 rows on a re-check is measured again


def cache_root() -> Path:
    """``$TREESPEC_CACHE`` if set, else ``~/.cache/treespec``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "treespec"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_identity(device: str | torch.device = "cpu") -> dict[str, Any]:
    """What timings of this machine depend on (see the module docstring)."""
    ident = {"cpu": _cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
             "torch": torch.__version__}
    device = torch.device(device)
    if device.type == "cuda":
        ident["gpu"] = torch.cuda.get_device_name(device)
    return ident


def digest(obj: Any) -> str:
    """A short sha256 of a JSON-ready object (keys sorted): cache file names and identities."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def machine_file(kind: str, key: Mapping[str, Any], cache_dir: Path | None = None) -> Path:
    """The cache file of one measurement ``kind`` for ``key`` (a JSON-ready mapping)."""
    return (cache_dir or cache_root() / "machine") / f"{kind}-{digest(key)}.json"


def read_cached(path: Path, key: Mapping[str, Any]) -> dict | None:
    """The cached record at ``path`` if it was made for ``key``; None (with a warning) if unusable."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("its top level is not a JSON object")
        if data.get("key") != json.loads(json.dumps(key, default=str)):
            raise ValueError("made for another machine, model or dtype")
        return data
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        logger.warning(f"ignoring the cached measurement {path} ({exc}); measuring again")
        return None


def write_cached(path: Path, key: Mapping[str, Any], record: Mapping[str, Any]) -> None:
    """Write ``record`` under ``key`` atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, **record}, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)


# ---------------------------------------------------------------------------- dtype choice
def linear_shapes(config: Any) -> dict[tuple[int, int], int]:
    """(out, in) -> count of the target's matmuls per forward, from its `treespec.target.ModelShapes` (or a
    transformers config, which names them alike)."""
    h = int(config.hidden_size)
    inter = int(getattr(config, "intermediate_size", None) or 4 * h)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads) * head_dim
    layers = int(config.num_hidden_layers)
    shapes: dict[tuple[int, int], int] = {}
    for shape, count in (((heads * head_dim, h), 1), ((kv, h), 2), ((h, heads * head_dim), 1), ((inter, h), 2),
                         ((h, inter), 1)):
        shapes[shape] = shapes.get(shape, 0) + count * layers
    vocab = (int(config.vocab_size), h)
    shapes[vocab] = shapes.get(vocab, 0) + 1
    return shapes


def measure_linear_speed(shapes: Mapping[tuple[int, int], int], dtypes=(torch.bfloat16, torch.float32),
                         rows=_ROWS, repeats: int = 5, budget: float = 3.0) -> dict[str, dict[int, float]]:
    """dtype name -> rows -> estimated seconds of the matmuls of one forward over ``shapes``.

    A forward streams every weight from memory once, so the benchmark streams copies of the MLP's
    up-projection (the most common large shape) totalling at least `_STREAM_ELEMENTS` weights,
    more than a CPU cache holds, and scales the time to the target's weight count.  The passes are
    interleaved (every dtype and row count once per repeat, ``repeats`` times, fewer once ``budget``
    seconds are spent) and each figure is the median of its passes, so a load that comes and goes
    falls on both dtypes alike.
    """
    (out_dim, in_dim), _ = max(shapes.items(), key=lambda item: (item[1], item[0][0] * item[0][1]))
    out_dim = max(out_dim, -(-_COPY_ELEMENTS // in_dim))
    copies = max(1, -(-_STREAM_ELEMENTS // (out_dim * in_dim)))
    scale = sum(o * i * count for (o, i), count in shapes.items()) / (copies * out_dim * in_dim)
    passes = {}
    for dtype in dtypes:
        weights = [torch.full((out_dim, in_dim), 0.01, dtype=dtype) for _ in range(copies)]
        for n in rows:
            x = torch.full((n, in_dim), 0.01, dtype=dtype)
            passes[str(dtype).removeprefix("torch."), n] = lambda x=x, weights=weights: [
                torch.nn.functional.linear(x, w) for w in weights]
    times: dict[tuple[str, int], list[float]] = {key: [] for key in passes}
    for run in passes.values():  # warm-up
        run()
    start = time.perf_counter()
    for _ in range(repeats):
        for key, run in passes.items():
            begin = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - begin)
        if time.perf_counter() - start > budget:
            break
    speed: dict[str, dict[int, float]] = {}
    for (name, n), seconds in times.items():
        speed.setdefault(name, {})[n] = scale * sorted(seconds)[len(seconds) // 2]
    return speed


@attrs.frozen
class DtypeChoice:
    """The dtype picked for a target on this machine, and why."""

    dtype: torch.dtype  # what the target runs in
    reason: str  # one line, for the user

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}: {self.reason}"


def choose_dtype(speed: Mapping[str, Mapping[int, float]]) -> DtypeChoice:
    """The faster of bf16 and fp32 summed over 1 and 17 rows (`measure_linear_speed`'s figures)."""
    bf16, fp32 = speed["bfloat16"], speed["float32"]
    small, large = min(_ROWS), max(_ROWS)

    def ratio(rows: int) -> str:
        r = bf16[rows] / fp32[rows]
        return f"{r:.1f}x slower" if r >= 1 else f"{1 / r:.1f}x faster"

    detail = f"bf16 is {ratio(large)} here at {large} rows ({ratio(small)} at {small} row)"
    if sum(bf16.values()) < sum(fp32.values()):
        return DtypeChoice(torch.bfloat16, detail)
    return DtypeChoice(torch.float32, detail)


def resolve_dtype(dtype: torch.dtype | str, *, device: str | torch.device = "cpu", config: Any = None,
                  cache_dir: Path | None = None,
                  benchmark: Callable[[Mapping], Mapping] = measure_linear_speed) -> torch.dtype | str:
    """A torch dtype for the target, or ``"auto"`` for transformers (the checkpoint's own dtype).

    ``dtype`` is a torch dtype, one of `DTYPE_NAMES`, ``"checkpoint"`` or ``"auto"`` (see the module
    docstring); ``benchmark`` is replaceable for tests.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    if dtype == "checkpoint":  # the stored dtype itself where the config names one; else transformers' "auto"
        stored = stored_dtype(config) if config is not None else None
        return stored if stored is not None else "auto"
    if dtype != "auto":
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, checkpoint or one of {', '.join(DTYPE_NAMES)}")
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    if config is None or stored_dtype(config) == torch.float64:
        return "auto"
    return cpu_dtype_choice(config, cache_dir=cache_dir, benchmark=benchmark).dtype


def cpu_dtype_choice(config: Any, *, cache_dir: Path | None = None,
                     benchmark: Callable[[Mapping], Mapping] = measure_linear_speed,
                     meter: Callable[[], Any] | None = None) -> DtypeChoice:
    """This machine's `DtypeChoice` for a target of ``config``: the cached one when it passes its checks
    (`check_dtype_record`) and a cheap re-check (`recheck_dtype`), else measured, and cached unless
    another process disturbed the measurement (``meter``: a `treespec.pricing.conditions.LoadMeter`
    factory, by default over torch's current threads)."""
    shapes = linear_shapes(config)
    key = {"machine": machine_identity(), "shapes": sorted([list(s), c] for s, c in shapes.items())}
    path = machine_file("dtype", key, cache_dir)
    choice = _UNCACHED.get(str(path)) or _cached_choice(path, key, shapes, benchmark)
    if choice is None:
        load_meter = (meter or current_meter)()
        load_meter.start()
        speed = benchmark(shapes)
        load = load_meter.stop()
        choice = choose_dtype(speed)
        if load.disturbed:
            choice = attrs.evolve(choice, reason=f"{choice.reason}; not cached: {load.describe()} while it was measured")
            _UNCACHED[str(path)] = choice  # this process keeps it: measured once
        else:
            write_cached(path, key, {"dtype": str(choice.dtype).removeprefix("torch."), "reason": choice.reason,
                                     "seconds": {d: {str(n): s for n, s in v.items()} for d, v in speed.items()}})
    if path.name not in _PRINTED:
        _PRINTED.add(path.name)
        logger.info(f"dtype {choice.describe()}")
    return choice



def check_dtype_record(record: Mapping[str, Any]) -> str | None:
    """The rule a cached dtype choice breaks, or None: its dtype is one the probe chooses among, its
    seconds are finite and positive for both dtypes at 1 and 17 rows, and they choose that dtype."""
    dtype = record.get("dtype")
    if dtype not in CHOICES:
        return f"dtype {dtype!r} is not one the probe chooses ({' or '.join(CHOICES)})"
    try:
        speed = {d: {int(n): float(s) for n, s in record["seconds"][d].items()} for d in CHOICES}
    except (KeyError, TypeError, ValueError, AttributeError):
        return "its seconds are missing or malformed"
    if any(set(v) != set(_ROWS) or not all(math.isfinite(s) and s > 0 for s in v.values()) for v in speed.values()):
        return f"its seconds must be finite and positive at {' and '.join(map(str, _ROWS))} rows"
    if str(choose_dtype(speed).dtype).removeprefix("torch.") != dtype:
        return "its seconds choose the other dtype"
    return None


def recheck_dtype(choice: DtypeChoice, shapes, benchmark: Callable[..., Mapping] = measure_linear_speed) -> bool:
    """A cheap second look at a cached choice: one interleaved pass of each dtype at 17 rows twice
    (a few hundredths of a second); False when the chosen dtype is now slower than the other by
    more than `RECHECK_MARGIN` (the cache was made under other conditions: measure again)."""
    speed = benchmark(shapes, rows=(max(_ROWS),), repeats=2)
    chosen = str(choice.dtype).removeprefix("torch.")
    other = next(d for d in CHOICES if d != chosen)
    return speed[chosen][max(_ROWS)] <= RECHECK_MARGIN * speed[other][max(_ROWS)]


def _cached_choice(path: Path, key: Mapping, shapes, benchmark) -> DtypeChoice | None:
    """The cached choice at ``path``, or None (with one line naming the file and the rule) to measure again."""
    record = read_cached(path, key)
    if record is None:
        return None
    broken = check_dtype_record(record)
    if broken is not None:
        set_aside(path, broken)
        return None
    choice = DtypeChoice(DTYPE_NAMES[record["dtype"]], str(record.get("reason", "")))
    if not recheck_dtype(choice, shapes, benchmark):
        logger.warning(f"the cached dtype choice {path} no longer holds ({choice.describe()}; a re-check found "
                       f"it more than {RECHECK_MARGIN:g}x slower); measuring again")
        return None
    return choice


def set_aside(path: Path, rule: str) -> None:
    """Move a cached file that fails its checks to ``NAME.rejected`` (kept for a look), saying why."""
    logger.warning(f"setting aside the cached measurement {path}: {rule}; measuring again")
    try:
        path.replace(path.with_name(path.name + ".rejected"))
    except OSError:
        pass
