"""The teacher cache: what drafter training needs from the frozen target, computed once.

Contract
--------
`build_teacher_cache` runs the target (no grad) once over every sequence of a distill-data
directory (`treespec.apps.data.selfdistill`), each cut at ``spec.max_seq_len`` tokens, and writes one
``teacher-NNNNN.safetensors`` per data shard (same index), holding for its n sequences of T tokens
in all:

    tokens          [T] int32      the sequences concatenated
    offsets         [n + 1] int64  sequence i is rows offsets[i]:offsets[i + 1]
    response_start  [n] int64      where sequence i's response begins
    features        [T, k*H] bf16  the target's hidden states hidden_states[id + 1] of every
                                   ``spec.target_layer_ids`` entry, concatenated in that order
    top_ids         [T, K] int32   row t: the K most likely next tokens (the token at t + 1), best first
    top_logp        [T, K] f32     their log-probs under the target (log_softmax of its logits)
    rest_logp       [T] f32        log of the remaining mass, log(1 - sum(exp(top_logp)))

``manifest.json`` (written before the first shard) names the target (``identity``: a name and
the sha256 of its weight files), ``target_layer_ids``, ``top_k``, ``max_seq_len`` and the feature
dtype.  A rerun into the same directory skips the shards already written (each is written under a
temporary name and renamed, so a present shard is complete) and refuses other settings, naming the
field; a cache shard records the prompt ids of its data shard (``rows``), and one whose data shard
has changed since (distill-data regenerates a short last shard in full when a run grows) is built
again.  `TeacherCache.check` refuses a cache made for another target, tap set or K.

`live_record` computes the same `TeacherRecord` from the target directly, so training reads one
record type with or without a cache, and a cached run equals a live one (features rounded to bf16
in both).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from treespec.apps.data.selfdistill import read_shard, shard_rows
from treespec.target import select_taps, spread_layers
from treespec.training import TeacherRecord

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT",
    "TeacherCache",
    "TeacherCacheError",
    "TeacherRecord",
    "TeacherSpec",
    "build_teacher_cache",
    "default_cache_layers",
    "live_record",
]

FORMAT = "treespec-teacher-cache/1"
_FEATURE_DTYPE = torch.bfloat16
_SETTINGS = ("identity", "target_layer_ids", "top_k", "max_seq_len")  # what two caches must agree on


class TeacherCacheError(ValueError):
    """A teacher cache that is missing, damaged, or made for another target or settings."""


@attrs.frozen
class TeacherSpec:
    """What the cache stores."""

    target_layer_ids: tuple[int, ...] = attrs.field(converter=tuple)  # 0-based target layers tapped
    top_k: int = 32  # K: teacher log-probs kept per position
    max_seq_len: int = 384  # sequences are cut here (as training cuts them)

    def __attrs_post_init__(self) -> None:
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise TeacherCacheError(f"target_layer_ids must be >= 0 and not empty, got {self.target_layer_ids}")
        if self.top_k < 1 or self.max_seq_len < 2:
            raise TeacherCacheError(f"top_k must be >= 1 and max_seq_len >= 2, got {self.top_k}, {self.max_seq_len}")


def default_cache_layers(num_layers: int) -> tuple[int, ...]:
    """The evenly spread taps the training presets use, plus the target's last layer."""
    return tuple(sorted(set(spread_layers(num_layers)) | {num_layers - 1}))


# ---------------------------------------------------------------------------- the teacher's view
def _top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [T, K], log-probs [T, K], log of the rest [T]) of logits [T, V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(min(k, logp.shape[-1]), dim=-1)
    kept = torch.logsumexp(top.values, dim=-1)  # log of the kept mass, <= 0
    rest = torch.log((-torch.expm1(kept)).clamp(min=0)).clamp(min=-1e4)  # log(1 - exp(kept)); -1e4 for none
    return top.indices, top.values, rest


@torch.no_grad()
def live_record(target, tokens: torch.Tensor, response_start: int, spec: TeacherSpec) -> TeacherRecord:
    """The `TeacherRecord` of one sequence, from a forward of ``target`` (an HF causal LM)."""
    device = target.get_input_embeddings().weight.device
    tokens = tokens[: spec.max_seq_len].to(device)
    out = target(input_ids=tokens[None], output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in spec.target_layer_ids], dim=-1)  # [T, k*H]
    ids, logp, rest = _top_k(out.logits[0], spec.top_k)
    return TeacherRecord(tokens.long(), int(response_start), feats.to(_FEATURE_DTYPE), ids.long(), logp, rest)


def _pack(records: Sequence[TeacherRecord]) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([r.tokens.numel() for r in records], dtype=torch.long)
    cat = lambda name: torch.cat([getattr(r, name).cpu() for r in records])  # noqa: E731
    return {
        "tokens": cat("tokens").int(), "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "response_start": torch.tensor([r.response_start for r in records], dtype=torch.long),
        "features": cat("features").contiguous(), "top_ids": cat("top_ids").int(),
        "top_logp": cat("top_logp").contiguous(), "rest_logp": cat("rest_logp").contiguous(),
    }


# ---------------------------------------------------------------------------- building
def _manifest(spec: TeacherSpec, identity: dict[str, str], data_dir: Path) -> dict:
    return {"format": FORMAT, "identity": identity, "target_layer_ids": list(spec.target_layer_ids),
            "top_k": spec.top_k, "max_seq_len": spec.max_seq_len, "feature_dtype": "bfloat16",
            "data": str(data_dir)}


def _read_manifest(out_dir: Path) -> dict | None:
    path = out_dir / "manifest.json"
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TeacherCacheError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise TeacherCacheError(f"{path} is not a treespec teacher cache manifest ({FORMAT})")
    return manifest


def _differences(found: dict, wanted: dict, fields: Sequence[str]) -> list[str]:
    return [f"{f}: the cache has {found.get(f)!r}, this run {wanted.get(f)!r}" for f in fields
            if found.get(f) != wanted.get(f)]


def cache_path(out_dir: Path, index: int) -> Path:
    return Path(out_dir) / f"teacher-{index:05d}.safetensors"


def damage(path: Path) -> str | None:
    """What is wrong with a safetensors file at ``path``, or None when whole: a header that does not parse,
    or fewer bytes than its header says (a write cut short)."""
    try:
        with path.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        end = 8 + size + max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        return f"no readable safetensors header ({exc})"
    actual = path.stat().st_size
    return None if actual >= end else f"cut short: {actual} of its {end} bytes"


def _is_current(path: Path, shard: Path) -> bool:
    """Whether cache shard ``path`` exists, is whole and was built from data shard ``shard`` as it is now (by
    its prompt ids; a cache shard from before they were recorded, by its number of sequences); a damaged one
    is said and built again."""
    if not path.exists():
        return False
    problem = damage(path)
    if problem is not None:
        logger.warning(f"{path} is damaged ({problem}): building it again")
        return False
    rows = shard_rows(shard)
    with safe_open(str(path), framework="pt") as handle:
        cached, offsets = handle.metadata().get("rows"), handle.get_slice("offsets").get_shape()[0]
    if cached is not None:
        return json.loads(cached) == rows
    return offsets - 1 == len(rows)


def build_teacher_cache(target, data_dir: str | Path, out_dir: str | Path, spec: TeacherSpec,
                        identity: dict[str, str], *, progress: bool = True) -> list[Path]:
    """Write every missing cache shard for the data shards in ``data_dir``; returns all cache paths."""
    from tqdm import tqdm

    data_dir, out_dir = Path(data_dir), Path(out_dir)
    shards = sorted(data_dir.glob("shard-*.safetensors"))
    if not shards:
        raise TeacherCacheError(f"no distill-data shards (shard-*.safetensors) in {data_dir}")
    wanted = _manifest(spec, identity, data_dir)
    found = _read_manifest(out_dir)
    if found is not None:
        problems = _differences(found, wanted, _SETTINGS)
        if problems:
            raise TeacherCacheError(f"{out_dir} holds a teacher cache made with other settings ("
                                    + "; ".join(problems) + "); use another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "manifest.json").write_text(json.dumps(wanted, indent=1) + "\n")
    paths = [cache_path(out_dir, int(p.stem.split("-")[1])) for p in shards]
    todo = [(s, p) for s, p in zip(shards, paths) if not _is_current(p, s)]
    bar = tqdm(total=len(shards), initial=len(shards) - len(todo), unit="shard", disable=not progress)
    for shard, path in todo:
        sequences = read_shard(shard)
        records = [live_record(target, s.tokens, s.response_start, spec) for s in sequences]
        tmp = path.with_name(path.name + ".tmp")
        save_file(_pack(records), str(tmp), metadata={"source": shard.name,
                                                        "rows": json.dumps([s.id for s in sequences])})
        os.replace(tmp, path)
        bar.update(1)
    bar.close()
    return paths


# ---------------------------------------------------------------------------- reading
class TeacherCache:
    """Random access to the records of one or more built caches (rows read from disk on demand).

    Several directories (e.g. greedy and sampled data) read as one, in the order given; their
    manifests must agree on the target, the taps, K and the sequence cut.
    """

    def __init__(self, *directories: str | Path) -> None:
        if not directories:
            raise TeacherCacheError("no teacher cache directory given")
        self.directories = [Path(d) for d in directories]
        manifests = [self._manifest_of(d) for d in self.directories]
        for d, m in zip(self.directories[1:], manifests[1:]):
            problems = _differences(m, manifests[0], _SETTINGS)
            if problems:
                raise TeacherCacheError(f"teacher caches {self.directories[0]} and {d} do not agree: "
                                        + "; ".join(problems))
        self.manifest = manifests[0]
        self.paths = [p for d in self.directories for p in sorted(d.glob("teacher-*.safetensors"))]
        if not self.paths:
            raise TeacherCacheError(f"{', '.join(map(str, self.directories))}: no cache shards yet")
        self._offsets: list[list[int]] = []  # per shard: row offsets of its sequences
        self._starts: list[list[int]] = []  # per shard: response starts
        self._handles = [self._open(p) for p in self.paths]
        self._index = [(h, i) for h in range(len(self.paths)) for i in range(len(self._offsets[h]) - 1)]

    @staticmethod
    def _manifest_of(directory: Path) -> dict:
        manifest = _read_manifest(directory)
        if manifest is None:
            raise TeacherCacheError(f"{directory}: no teacher cache here (no manifest.json); build one with "
                                    f"`treespec teacher-cache --out {directory}`")
        return manifest

    @property
    def directory(self) -> str:
        return ", ".join(map(str, self.directories))

    def _open(self, path: Path):
        problem = damage(path)
        if problem is not None:
            raise TeacherCacheError(f"{path} is damaged ({problem}): run `treespec teacher-cache` again over its "
                                    "data to build it again")
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as exc:  # safetensors raises its own types for a damaged file
            raise TeacherCacheError(f"{path} is not a readable safetensors file ({exc})") from None
        self._offsets.append(handle.get_tensor("offsets").tolist())
        self._starts.append(handle.get_tensor("response_start").tolist())
        return handle

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.manifest["target_layer_ids"])

    @property
    def top_k(self) -> int:
        return int(self.manifest["top_k"])

    def check(self, *, identity: dict[str, str] | None = None, target_layer_ids: Sequence[int] = (),
              top_k: int | None = None) -> None:
        """Refuse a cache made for another target, without the taps asked for, or with another K."""
        problems = []
        if identity is not None and self.manifest.get("identity") != identity:
            problems.append(f"it was made for target {self.manifest.get('identity')}, not {identity}")
        missing = sorted(set(target_layer_ids) - set(self.target_layer_ids))
        if missing:
            problems.append(f"it lacks target layers {missing} (it has {list(self.target_layer_ids)})")
        if top_k is not None and top_k != self.top_k:
            problems.append(f"it keeps the top {self.top_k} teacher log-probs, the run asks for {top_k}")
        if problems:
            raise TeacherCacheError(f"teacher cache {self.directory} does not fit: " + "; ".join(problems))

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> TeacherRecord:
        shard, row = self._index[i]
        handle, lo, hi = self._handles[shard], self._offsets[shard][row], self._offsets[shard][row + 1]
        get = lambda name: handle.get_slice(name)[lo:hi]  # noqa: E731
        return TeacherRecord(get("tokens").long(), int(self._starts[shard][row]), get("features"),
                             get("top_ids").long(), get("top_logp"), get("rest_logp"))

    def __iter__(self) -> Iterator[TeacherRecord]:
        return (self[i] for i in range(len(self)))

    def pairs(self) -> Iterator[tuple[torch.Tensor, int]]:
        """(tokens, response_start) of every record, without reading features or teacher rows."""
        for shard, row in self._index:
            lo, hi = self._offsets[shard][row], self._offsets[shard][row + 1]
            yield self._handles[shard].get_slice("tokens")[lo:hi].long(), int(self._starts[shard][row])

    def select_taps(self, features: torch.Tensor, target_layer_ids: Sequence[int]) -> torch.Tensor:
        """[T, k'*H] the columns of ``target_layer_ids`` (a subset of the cache's taps, any order)."""
        return select_taps(features, self.target_layer_ids, target_layer_ids)
