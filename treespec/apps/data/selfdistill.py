"""Self-distillation data: the target's own responses to training prompts, stored as token ids.

Contract:
- Input: (prompt id, prompt token ids) pairs, already chat-templated (`treespec.apps.data.datasets.encode_chat`)
  and drawn from a training split, so the data never overlaps benchmark prompts.
- Output: shards ``shard-00000.safetensors``, ... in one directory.  Shard k holds prompts
  ``[k * shard_size, (k + 1) * shard_size)`` of the input order, so a rerun with the same prompts
  skips the shards already written (resumable); each shard is written to a temporary name and renamed.
- A shard's tensors (no pickles):
    ``tokens``          [T] int32  every sequence (prompt + response) concatenated
    ``offsets``         [n + 1] int64  sequence i is ``tokens[offsets[i]:offsets[i + 1]]``
    ``response_start``  [n] int64  index in sequence i where the response begins (its prompt length)
    ``finished``        [n] bool  the response ended with a stop token (else it was cut at the limit)
  and string metadata: ``ids`` (JSON list of prompt ids), ``config`` (JSON), ``model``.
- Responses are the target's continuations, decoded as one continuous batch of ``batch_size`` rows
  over every missing shard (`treespec.apps.data.continuous_batch`): a row leaves at its first stop token,
  which the response keeps so a drafter learns where answers end, and the next prompt takes its
  place; a shard is written once its last answer is in.  Greedy (argmax) at ``temperature == 0``,
  else sampled from softmax(logits / T), each answer from its own generator seeded by (``seed``,
  shard, row, turn), so a resumed or repeated run writes the same shard whatever the batch size.
  Responses cut at ``max_new_tokens`` are marked unfinished.
- ``second_turn``: each chat gets a second user turn after the target's first answer (as MT-Bench
  asks), a follow-up request from `FOLLOW_UPS` chosen by the prompt id; the stored sequence is the
  two-turn conversation (the first answer re-templated from its text, as a chat harness does) and
  its response is the second answer.  Chats whose first answer was cut at the limit are left out.
  A second-turn run can take its first answers from a first-turn run of the same prompts and target
  (`first_answers`) instead of generating them again, which halves its cost: a greedy run from a
  greedy one, a sampled run from one of the same temperature, seed and shard size (the first
  answers its own streams would have drawn).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import attrs
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from treespec.apps.data.continuous_batch import ContinuousBatch, Job, generate_responses

__all__ = [
    "SMOLLM2_CPU",
    "DistillConfig",
    "DistillSequence",
    "FOLLOW_UPS",
    "first_answers",
    "generate_greedy",
    "generate_responses",
    "iter_sequences",
    "read_shard",
    "shard_path",
    "shard_rows",
    "write_shards",
]

Prompt = tuple[str, Sequence[int]]  # (prompt id, token ids)
# Settings a resumed run may change: more prompts extend the data, the batch size only the speed.
_RESUME_FREE = ("num_prompts", "batch_size")


@attrs.frozen
class DistillConfig:
    """What to generate and how to batch it."""

    dataset: str = "alpaca"  # benchmark name or local prompt file (its training split is used)
    split: str = "train"  # prompt split; "train" keeps the data disjoint from benchmark prompts
    num_prompts: int = 3200  # prompts to answer (after shuffling with seed 0)
    max_new_tokens: int = 256  # response length limit
    max_prompt_tokens: int = 512  # longer prompts are left out
    batch_size: int = 32  # rows decoded at once (a finished row's place goes to the next prompt)
    shard_size: int = 64  # prompts per shard file (the unit of resumption)
    temperature: float = 0.0  # 0: greedy responses; > 0: sampled at this temperature (no top-k/top-p)
    seed: int = 0  # sampling seed (with the shard index); unused when greedy
    second_turn: bool = False  # store two-turn chats (a follow-up after the first answer) instead

    def __attrs_post_init__(self) -> None:
        for name in ("num_prompts", "max_new_tokens", "max_prompt_tokens", "batch_size", "shard_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"DistillConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise ValueError(f"DistillConfig.temperature must be a finite number >= 0, got {self.temperature}")


# Second user turns of `DistillConfig.second_turn` chats: generic follow-ups of the kinds MT-Bench's
# second turns ask (rewrite, shorten, extend, explain, apply), written for treespec.
FOLLOW_UPS: tuple[str, ...] = (
    "Can you make your answer shorter, in at most three sentences?",
    "Rewrite your previous answer so that a ten-year-old could understand it.",
    "Explain your reasoning step by step.",
    "Give a concrete example that illustrates your answer.",
    "Now write the same answer as a bulleted list.",
    "What are the weaknesses or limits of your answer?",
    "Rewrite your answer in a more formal tone.",
    "Summarise your answer in one sentence.",
    "Add a short title to your answer and expand it with one more paragraph.",
    "Could you answer the same question for a different situation of your choice?",
    "Turn your answer into a short poem.",
    "Which part of your answer is the most important, and why?",
    "Rewrite your answer as a short dialogue between two people.",
    "List three questions someone might ask after reading your answer, and answer them briefly.",
    "Translate the main point of your answer into simple instructions.",
    "Please double-check your answer and correct anything that is wrong.",
)


def follow_up(prompt_id: str) -> str:
    """The second user turn of a chat: a `FOLLOW_UPS` entry fixed by the prompt id."""
    index = int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:4], "big") % len(FOLLOW_UPS)
    return FOLLOW_UPS[index]


# Data for the embedded SmolLM2 drafters on a CPU core.
SMOLLM2_CPU = DistillConfig()


@attrs.frozen
class DistillSequence:
    """One stored example: prompt and response token ids."""

    id: str  # prompt id from the dataset loader
    tokens: torch.Tensor  # [T] int64, prompt then response
    response_start: int  # tokens[response_start:] is the response
    finished: bool  # the response ends with a stop token


def shard_path(out_dir: Path, index: int) -> Path:
    return Path(out_dir) / f"shard-{index:05d}.safetensors"


def generate_greedy(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: Sequence[int],
                    pad_id: int) -> list[tuple[list[int], bool]]:
    """`generate_responses` at temperature 0, all prompts in one batch."""
    return generate_responses(model, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids, pad_id=pad_id)


def _pack(items: list[tuple[str, list[int], list[int], bool]]) -> dict[str, torch.Tensor]:
    """Ragged (id, prompt, response, finished) rows -> the shard's flat tensors."""
    sequences = [prompt + response for _, prompt, response, _ in items]
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    return {
        "tokens": torch.tensor([t for s in sequences for t in s], dtype=torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "response_start": torch.tensor([len(p) for _, p, _, _ in items], dtype=torch.long),
        "finished": torch.tensor([f for *_, f in items], dtype=torch.bool),
    }


def _write_shard(path: Path, covered: list[str], items: list[tuple[str, list[int], list[int], bool]],
                 metadata: dict[str, str]) -> None:
    """``ids``: the prompts the shard covers (its resumption key); ``rows``: the prompt of each row."""
    tmp = path.with_name(path.name + ".tmp")
    save_file(_pack(items), str(tmp),
              metadata={**metadata, "ids": json.dumps(covered), "rows": json.dumps([i for i, *_ in items])})
    os.replace(tmp, path)


# (prompt id, first prompt ids, first response ids) -> the two-turn prompt's ids
SecondPrompt = Callable[[str, list[int], list[int]], list[int]]
# prompt id -> (prompt ids, response ids, finished) of a first-turn run
FirstAnswers = Mapping[str, tuple[list[int], list[int], bool]]
# what a first-turn run must share with a second-turn run for its answers to be that run's first answers
_FIRST_TURN_KEYS = ("dataset", "split", "max_new_tokens", "max_prompt_tokens", "temperature")
_SAMPLED_KEYS = ("seed", "shard_size")  # and, for a sampled run, what fixes each answer's stream


def first_answers(data_dir: Path, cfg: DistillConfig, model: str,
                  ) -> tuple[dict[str, tuple[list[int], list[int], bool]], list[Path]]:
    """The answers of a first-turn run in ``data_dir`` for the second-turn run ``cfg`` of the target
    ``model`` (its ``model`` metadata), and the shards left out as made by another target.

    Answers: prompt id -> (prompt ids, response ids, finished).  Refused (ValueError) unless ``cfg``
    is a second-turn run and every shard has its dataset, split, length limits and temperature (and,
    when sampled, its seed and shard size: each first answer is then the one ``cfg``'s own stream of
    that prompt draws), or when no shard was made by ``model``.  The prompts of shards left out or
    not written yet get their first answers generated as usual.
    """
    _check_reuse(cfg)
    paths = sorted(Path(data_dir).glob("shard-*.safetensors"))
    if not paths:
        raise ValueError(f"no shard-*.safetensors in {data_dir} to take first answers from")
    answers, other_target = {}, []
    for path in paths:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata()
        stored = json.loads(meta.get("config", "{}"))
        keys = _FIRST_TURN_KEYS + (_SAMPLED_KEYS if cfg.temperature else ())
        differ = [k for k in keys if stored.get(k) != getattr(cfg, k)]
        differ += ["second_turn"] if stored.get("second_turn") else []
        if differ:
            raise ValueError(f"{path} cannot give this run's first answers: it differs in {', '.join(differ)}")
        if meta.get("model") != model:
            other_target.append(path)
            continue
        for seq in read_shard(path):
            tokens = seq.tokens.tolist()
            answers[seq.id] = (tokens[: seq.response_start], tokens[seq.response_start:], seq.finished)
    if not answers:
        raise ValueError(f"no shard of {data_dir} was made by this target ({model})")
    return answers, other_target


def _check_reuse(cfg: DistillConfig) -> None:
    if not cfg.second_turn:
        raise ValueError("first answers from another run serve a second-turn run only")


def _check_known(prompts: Sequence[Prompt], known: FirstAnswers) -> None:
    for pid, ids in prompts:
        if pid in known and known[pid][0] != list(ids):
            raise ValueError(f"the first-turn data's prompt {pid!r} is not this run's (another tokenizer or template)")


def _row_generator(cfg: DistillConfig, shard: int, row: int, turn: int,
                   device: torch.device) -> torch.Generator | None:
    """The sampling stream of one answer, fixed by (seed, shard, row, turn); None when greedy."""
    if cfg.temperature == 0:
        return None
    digest = hashlib.sha256(f"{cfg.seed}/{shard}/{row}/{turn}".encode()).digest()
    return torch.Generator(device).manual_seed(int.from_bytes(digest[:8], "big") >> 1)


Row = tuple[str, list[int], list[int], bool]  # (prompt id, prompt ids, response ids, finished)


@attrs.define
class _Shard:
    """The rows of one shard as its answers come in; complete when no answer is pending."""

    index: int
    prompts: list[Prompt]
    pending: int  # answers still to come
    rows: dict[int, Row] = attrs.Factory(dict)  # row -> stored row (chats left out have none)


class _ShardWriter:
    """Feeds the missing shards' prompts to one continuous batch and writes each shard once its last
    answer is in.  First turns queue in shard order and the second turns they lead to go ahead of
    them (second turns after known first answers queue in shard order too), so shards end roughly in
    order and an interruption loses only the few shards in flight.  The progress bar counts prompts
    whose last answer is in (or whose chat was left out)."""

    def __init__(self, batch: ContinuousBatch, cfg: DistillConfig, second_prompt: SecondPrompt | None,
                 write: Callable[[int, list[Row]], None], progress: _TokenRate) -> None:
        self.batch, self.cfg, self.second_prompt = batch, cfg, second_prompt
        self.write, self.progress = write, progress
        self.shards: dict[int, _Shard] = {}

    def add(self, index: int, prompts: list[Prompt], known: FirstAnswers) -> None:
        """Queue one shard's prompts; first answers in ``known`` are taken, not generated."""
        shard = self.shards[index] = _Shard(index, prompts, pending=len(prompts))
        for row, (pid, ids) in enumerate(prompts):
            if pid in known:
                self._first_done(shard, row, *known[pid][1:], front=False)
            else:
                self._submit(index, row, 1, ids)
        self._write_if_complete(shard)

    def run(self) -> None:
        for done in self.batch.run():
            index, row, turn = done.key
            shard = self.shards[index]
            self.progress.update(0, len(done.response))
            if turn == 1:
                self._first_done(shard, row, done.response, done.finished)
            else:
                pid, chat = shard.rows[row][:2]
                shard.rows[row] = (pid, chat, done.response, done.finished)
                self._row_done(shard)
            self._write_if_complete(shard)

    def _first_done(self, shard: _Shard, row: int, response: list[int], finished: bool, front: bool = True) -> None:
        pid, ids = shard.prompts[row]
        if not self.cfg.second_turn:
            shard.rows[row] = (pid, list(ids), response, finished)
            self._row_done(shard)
            return
        chat = self.second_prompt(pid, list(ids), response) if finished else None
        if chat is None or len(chat) > self.cfg.max_prompt_tokens:  # a cut first answer, or too long a chat
            self._row_done(shard)
            return
        shard.rows[row] = (pid, chat, [], False)  # its response comes with the second turn
        self._submit(shard.index, row, 2, chat, front=front)

    def _row_done(self, shard: _Shard) -> None:
        shard.pending -= 1
        self.progress.update(1, 0)

    def _submit(self, index: int, row: int, turn: int, ids: Sequence[int], front: bool = False) -> None:
        generator = _row_generator(self.cfg, index, row, turn, self.batch.device)
        self.batch.submit(Job((index, row, turn), ids, generator), front=front)

    def _write_if_complete(self, shard: _Shard) -> None:
        if shard.pending == 0:
            self.write(shard.index, [shard.rows[i] for i in sorted(shard.rows)])
            del self.shards[shard.index]


def write_shards(model, prompts: Sequence[Prompt], out_dir: Path, cfg: DistillConfig, *, stop_ids: Sequence[int],
                 pad_id: int, metadata: dict[str, str] | None = None, progress: bool = True,
                 second_prompt: SecondPrompt | None = None, known_first: FirstAnswers | None = None) -> list[Path]:
    """Generate and store every missing shard for ``prompts``; returns all shard paths.

    ``second_prompt`` builds the two-turn prompt of a `DistillConfig.second_turn` run;
    ``known_first`` (from `first_answers`) gives first answers that need not be generated again.
    """
    from tqdm import tqdm

    if cfg.second_turn and second_prompt is None:
        raise ValueError("a second_turn run needs second_prompt to build the two-turn chats")
    if known_first is not None:
        _check_reuse(cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    chunks = [list(prompts[i:i + cfg.shard_size]) for i in range(0, len(prompts), cfg.shard_size)]
    paths = [shard_path(out_dir, k) for k in range(len(chunks))]
    meta = {"config": json.dumps(attrs.asdict(cfg, filter=lambda a, _: a.name not in _RESUME_FREE)),
            **(metadata or {})}
    todo = [k for k in range(len(chunks)) if not _is_done(paths[k], [pid for pid, _ in chunks[k]], meta["config"])]
    bar = tqdm(total=len(prompts), initial=len(prompts) - sum(len(chunks[k]) for k in todo), unit="prompt",
               disable=not progress, smoothing=0.1)
    batch = ContinuousBatch(model, size=cfg.batch_size, max_new_tokens=cfg.max_new_tokens, stop_ids=stop_ids,
                            pad_id=pad_id, temperature=cfg.temperature)
    writer = _ShardWriter(batch, cfg, second_prompt, lambda k, rows: _write_shard(
        paths[k], [pid for pid, _ in chunks[k]], rows, meta), _TokenRate(bar))
    known = known_first or {}
    for k in todo:  # every shard's prompts checked before anything is generated
        _check_known(chunks[k], known)
    for k in todo:
        writer.add(k, chunks[k], known)
    writer.run()
    bar.close()
    return paths


def _is_done(path: Path, ids: list[str], config_json: str) -> bool:
    """Whether an earlier run already wrote this shard; its data must come from the same settings."""
    if not path.exists():
        return False
    with safe_open(str(path), framework="pt") as handle:
        stored_config, stored_ids = handle.metadata().get("config"), json.loads(handle.metadata()["ids"])
    if stored_config != config_json:
        raise ValueError(f"{path} was made with other settings ({stored_config}); use a new output "
                         f"directory or the same settings ({config_json})")
    if stored_ids == ids:
        return True
    if ids[: len(stored_ids)] == stored_ids:
        return False  # the short last shard of a run with fewer prompts: regenerate it in full
    raise ValueError(f"{path} holds other prompts than this run's shard (another dataset, split or order)")


class _TokenRate:
    """Progress-bar callback: prompts done, and generated tokens per second since the start."""

    def __init__(self, bar):
        self.bar, self.tokens, self.start = bar, 0, time.perf_counter()

    def update(self, prompts: int, tokens: int) -> None:
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix(tok_s=f"{rate:.0f}", tokens=self.tokens, refresh=False)
        self.bar.update(prompts)


def _row_ids(meta: dict[str, str]) -> list[str]:
    # ``rows``: the prompt of each stored row; shards from before second turns have only ``ids``
    return json.loads(meta.get("rows", meta["ids"]))


def shard_rows(path: Path) -> list[str]:
    """The prompt id of each sequence of one shard, without reading its tensors."""
    with safe_open(str(path), framework="pt") as handle:
        return _row_ids(handle.metadata())


def read_shard(path: Path) -> list[DistillSequence]:
    """The sequences of one shard, in the order they were written."""
    with safe_open(str(path), framework="pt") as handle:
        ids = _row_ids(handle.metadata())
        tokens, offsets = handle.get_tensor("tokens").long(), handle.get_tensor("offsets")
        starts, finished = handle.get_tensor("response_start"), handle.get_tensor("finished")
    return [DistillSequence(ids[i], tokens[offsets[i]:offsets[i + 1]], int(starts[i]), bool(finished[i]))
            for i in range(len(ids))]


def iter_sequences(out_dir: Path) -> Iterator[DistillSequence]:
    """Every stored sequence of a data directory, shard by shard."""
    for path in sorted(Path(out_dir).glob("shard-*.safetensors")):
        yield from read_shard(path)
