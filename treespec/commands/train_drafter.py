"""``treespec train-drafter``: train a DFlash or Domino drafter on self-distillation data.

Resumable: rerunning with the same ``--out`` continues from the last checkpoint (weights, optimizer
moments and data order).  The final drafter is ``OUT/drafter/`` in the released checkpoint layout.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs
import torch

from treespec.commands import CPU_DTYPES, DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, required=True, help="directory of distill-data shards")
    parser.add_argument("--out", type=Path, required=True, help="run directory (checkpoints; resumed if present)")
    parser.add_argument("--target", type=Path, default=None, help="local HF target directory (default: the embedded SmolLM2)")
    parser.add_argument("--preset", default="smollm2-dflash", help="named TrainConfig (see drafters.training.TRAIN_PRESETS)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a TrainConfig field, e.g. --set steps=4000 --set lr=5e-4")
    parser.add_argument("--mask-token-id", type=int, default=None, help="mask token (default: the tokenizer's unk/pad/eos)")
    parser.add_argument("--target-dtype", choices=CPU_DTYPES, default="bfloat16", help="dtype of the frozen target")
    parser.add_argument("--until", type=int, default=None, help="stop at this step (the schedule stays that of the full run)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the target and the drafter train")
    parser.add_argument("--export", type=Path, default=None,
                        help="also write the trained drafter here in --export-dtype (the shipped form)")
    parser.add_argument("--export-dtype", choices=CPU_DTYPES, default="bfloat16", help="dtype of --export")


def _config(args: argparse.Namespace):
    from drafters.training import TRAIN_PRESETS, TrainConfig

    if args.preset not in TRAIN_PRESETS:
        raise SystemExit(f"unknown preset {args.preset!r}; available: {', '.join(TRAIN_PRESETS)}")
    cfg, fields = TRAIN_PRESETS[args.preset], {f.name: f for f in attrs.fields(TrainConfig)}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--set {key}: not a TrainConfig field ({', '.join(fields)})")
        try:
            cfg = attrs.evolve(cfg, **{key: _parse(value, getattr(cfg, key))})
        except (TypeError, ValueError) as exc:
            raise SystemExit(f"--set {key}={value}: not a valid {key} ({exc})") from None
    return cfg


def _check_data(path: Path) -> None:
    """A clear error before the target loads when --data holds no shards."""
    if not path.is_dir():
        raise SystemExit(f"--data {path}: no such directory (make one with `treespec distill-data --out {path}`)")
    if not any(path.glob("shard-*.safetensors")):
        raise SystemExit(f"--data {path}: no distill-data shards (shard-*.safetensors) in this directory")


def _parse(text: str, current):
    if isinstance(current, bool):
        return text.lower() in ("1", "true", "yes")
    if isinstance(current, tuple) or current is None and "," in text:
        return tuple(int(x) for x in text.split(","))
    return type(current)(text) if current is not None else float(text)


def _target(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treespec.embedded import embedded_model_dir

    path = args.target or embedded_model_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.target_dtype]).eval().requires_grad_(False)
    model.to(args.device)
    return model, AutoTokenizer.from_pretrained(path)


def run(args: argparse.Namespace) -> int:
    from drafters.training import DrafterTrainer, new_drafter
    from treespec.selfdistill import iter_sequences

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = _config(args)
    _check_data(args.data)
    target, tokenizer = _target(args)
    mask = args.mask_token_id
    if mask is None:
        mask = next(t for t in (tokenizer.unk_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None)
    data = [(s.tokens, s.response_start) for s in iter_sequences(args.data)]
    print(f"{len(data)} sequences, {sum(t.numel() for t, _ in data)} tokens; config: {cfg}")
    trainer = DrafterTrainer(target, new_drafter(target, cfg, mask), cfg, out_dir=args.out)
    if trainer.resume():
        print(f"resumed at step {trainer.step}")
    trainer.train(data, until=args.until)
    print(f"drafter written to {args.out / 'drafter'}")
    if args.export is not None:
        export_drafter(args.out / "drafter", args.export, DTYPES[args.export_dtype])
        print(f"{args.export_dtype} copy written to {args.export}")
    return 0


def export_drafter(source: Path, out: Path, dtype: torch.dtype) -> Path:
    """Reload the checkpoint at ``source`` (strictly) and save it in ``dtype`` at ``out``."""
    from treespec.api import load_drafter

    return load_drafter(source, dtype=dtype).save_pretrained(out)
