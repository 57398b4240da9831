"""``treespec distill-data``: the target's responses to training prompts, as safetensors shards.

Greedy by default, sampled with ``--temperature`` (seeded by ``--seed``); ``--second-turn`` stores
two-turn chats (a follow-up after the target's own first answer), with ``--first-answers DIR``
taking those first answers from a first-turn run instead of generating them (greedy from greedy;
sampled from a run of the same temperature and seed).  Resumable:
rerunning the same command skips the shards already written.  Multi-turn records contribute their
first turn only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import attrs

from treespec.apps.assembly.embedded import EmbeddedError
from treespec.apps.assembly.loading import load_frozen_model
from treespec.apps.commands import add_threads_argument, start_threads
from treespec.apps.data.datasets import DatasetError, encode_chat, load_prompts
from treespec.apps.data.selfdistill import (
    SMOLLM2_CPU,
    DistillConfig,
    first_answers,
    follow_up,
    iter_sequences,
    write_shards,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SMOLLM2_CPU
    parser.add_argument("--out", type=Path, default=Path("runs/distill"), help="output directory of the shards")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a local Hugging Face model directory (default: the embedded SmolLM2)")
    parser.add_argument("--dataset", default=d.dataset, help="benchmark name or local prompt file")
    parser.add_argument("--split", default=d.split, choices=["train", "bench", "all"],
                        help="prompt split to answer (bench: held-out answers for evaluation only)")
    parser.add_argument("--num-prompts", type=int, default=d.num_prompts)
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    parser.add_argument("--batch-size", type=int, default=d.batch_size,
                        help="rows decoded at once; a finished row's place goes to the next prompt")
    parser.add_argument("--shard-size", type=int, default=d.shard_size)
    parser.add_argument("--temperature", type=float, default=d.temperature,
                        help="0: greedy responses; > 0: sampled at this temperature")
    parser.add_argument("--seed", type=int, default=d.seed, help="sampling seed (with the shard index)")
    parser.add_argument("--second-turn", action="store_true",
                        help="store two-turn chats: a follow-up request after the target's first answer")
    parser.add_argument("--first-answers", type=Path, default=None, metavar="DIR",
                        help="with --second-turn: take the first answers from this first-turn run of the same "
                             "prompts and target (and, sampled, the same temperature and seed) instead of "
                             "generating them again")
    parser.add_argument("--dtype", default="auto", help="target dtype: auto (the faster here), bfloat16, float32, ...")
    add_threads_argument(parser)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the target runs")


def _config(args: argparse.Namespace) -> DistillConfig:
    return DistillConfig(dataset=args.dataset, split=args.split, num_prompts=args.num_prompts,
                         max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                         batch_size=args.batch_size, shard_size=args.shard_size, temperature=args.temperature,
                         seed=args.seed, second_turn=args.second_turn)


def _stop_and_pad(model, tokenizer) -> tuple[list[int], int]:
    """Stop tokens (the tokenizer's and the model's end-of-turn ids) and the padding id."""
    configured = model.generation_config.eos_token_id
    stops = {tokenizer.eos_token_id} | set(configured if isinstance(configured, list) else [configured])
    stops.discard(None)
    if not stops:
        raise ValueError("the target defines no end-of-sequence token to stop generation at")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
    return sorted(stops), pad


def _encoded_prompts(cfg: DistillConfig, tokenizer) -> tuple[list[tuple[str, list[int]]], int, dict[str, str]]:
    """(prompt id, chat-templated ids) for the run's prompts, how many were too long to keep, and the
    first user turn of each prompt id."""
    records = load_prompts(cfg.dataset, split=cfg.split, limit=cfg.num_prompts)
    encoded = [(r.id, encode_chat(tokenizer, r.turns[:1])) for r in records]
    kept = [(pid, ids) for pid, ids in encoded if len(ids) <= cfg.max_prompt_tokens]
    return kept, len(encoded) - len(kept), {r.id: r.turns[0] for r in records}


def _second_prompt(tokenizer, first_turns: dict[str, str], stops: list[int]):
    """The `write_shards` callback that templates (first turn, the target's answer, a follow-up)."""
    def build(prompt_id: str, _ids: list[int], response: list[int]) -> list[int]:
        answer = tokenizer.decode([t for t in response if t not in stops], skip_special_tokens=False)
        return encode_chat(tokenizer, [first_turns[prompt_id], follow_up(prompt_id)], [answer])
    return build


def _known_first(data_dir: Path, cfg: DistillConfig, model: str):
    known, other_target = first_answers(data_dir, cfg, model)
    print(f"first answers of {len(known)} prompts from {data_dir}"
          + (f"; {len(other_target)} shards made by another target identity left out (answered again)"
             if other_target else ""), flush=True)
    return known


def _summary(out_dir: Path) -> str:
    sequences = list(iter_sequences(out_dir))
    responses = sum(len(s.tokens) - s.response_start for s in sequences)
    finished = sum(s.finished for s in sequences)
    return (f"{len(sequences)} sequences, {responses} response tokens, "
            f"{finished / max(len(sequences), 1):.0%} ended with a stop token")


def run(args: argparse.Namespace) -> int:
    from treespec.apps.commands.train_drafter import usable_folder

    usable_folder(args.out, "--out")  # before the model loads
    start_threads(args)
    try:
        cfg = _config(args)
        model, tokenizer, identity = load_frozen_model(args.model_dir, args.dtype, args.device)
        prompts, skipped, first_turns = _encoded_prompts(cfg, tokenizer)
        stops, pad = _stop_and_pad(model, tokenizer)
    except (DatasetError, EmbeddedError, ValueError, OSError) as exc:
        print(f"treespec distill-data: {exc}", file=sys.stderr)
        return 1
    print(f"{len(prompts)} prompts from {cfg.dataset} ({cfg.split}), {skipped} left out as longer than "
          f"{cfg.max_prompt_tokens} tokens; stop ids {stops}; shards in {args.out}", flush=True)
    metadata = {"model": f"{identity['name']} sha256:{identity['sha256']}", "dtype": str(model.dtype).removeprefix("torch."), "stop_ids": json.dumps(stops)}
    second = _second_prompt(tokenizer, first_turns, stops) if cfg.second_turn else None
    try:
        known = _known_first(args.first_answers, cfg, metadata["model"]) if args.first_answers else None
        write_shards(model, prompts, args.out, cfg, stop_ids=stops, pad_id=pad, metadata=metadata,
                     second_prompt=second, known_first=known)
    except ValueError as exc:  # shards left by a run with other settings, or unusable first answers
        print(f"treespec distill-data: {exc}", file=sys.stderr)
        return 1
    print(f"done: {_summary(args.out)}; settings {json.dumps(attrs.asdict(cfg))}")
    return 0
