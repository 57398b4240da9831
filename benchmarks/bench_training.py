"""Drafter training throughput: label positions per CPU-second, arms side by side in one run.

Arms (same recipe, same sequences, same steps): the target run live every step or a teacher
cache read instead; the full 49,152-token head or a reduced draft vocabulary; bf16 autocast or
float32.  Each arm trains ``--steps`` steps from fresh weights on the first sequences of the data
directory; the first ``--warmup`` steps are not timed.  Arms are interleaved step by step, so a
change in the machine's load hits all of them alike.  CPU time is the process's
(`time.process_time`), so pin threads (``--threads``) for a per-core figure.

Also prints the draft forward time per round of the two heads at inference (one block of B rows
through the drafter, its head and the log-softmax), median of ``--rounds`` rounds, side by side.

``--against REF`` asks instead what a change to the training code bought: two arms on the teacher
cache at ``--preset``, one trained by the recipe (``drafters/training.py``) and the loop
(``treespec/apps/training/trainer.py``) of git commit REF (read with ``git show``; REF at or after
the data-parallel loop, whose ``train_step`` takes a batch), one by the working tree's, from the same
fresh weights, interleaved step by step; it prints each arm's labels per CPU-second, the ratio, and
whether the two arms' losses agree step by step.

    python benchmarks/bench_training.py --data runs/data/greedy --cache runs/teacher/greedy
    python benchmarks/bench_training.py --data runs/data/greedy --cache runs/teacher/greedy \
        --preset smollm2-domino-v8k-l1 --against HEAD~1
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import attrs
import torch

from treespec.apps.data.selfdistill import iter_sequences
from treespec.apps.training.teacher import TeacherCache
from treespec.apps.training.trainer import DrafterTrainer
from treespec.apps.training.vocabulary import coverage, response_token_counts
from treespec.drafters.training import TRAIN_PRESETS, BlockRecipe, new_drafter
from treespec.pricing.conditions import ThreadControl
from treespec.training import draft_vocabulary


def _arms(args) -> dict[str, dict]:
    base = attrs.evolve(TRAIN_PRESETS[args.preset], steps=10_000, save_every=10**9)
    arms = {}
    for autocast in (True, False):
        suffix = "bf16-autocast" if autocast else "fp32"
        cfg = attrs.evolve(base, autocast_bf16=autocast)
        arms[f"live, full head, {suffix}"] = dict(cfg=cfg, cached=False)
        arms[f"cache, full head, {suffix}"] = dict(cfg=cfg, cached=True)
        arms[f"cache, {args.vocab} head, {suffix}"] = dict(cfg=attrs.evolve(cfg, draft_vocab_size=args.vocab),
                                                         cached=True)
    return arms


def _trainers(args, target, pairs, cache, vocab, out: Path) -> dict[str, tuple[DrafterTrainer, object]]:
    trainers = {}
    for name, arm in _arms(args).items():
        cfg = arm["cfg"]
        drafter = new_drafter(target, cfg, args.mask_token_id,
                              draft_vocab=vocab if cfg.draft_vocab_size else None)
        trainer = DrafterTrainer(BlockRecipe(target, drafter, cfg), out_dir=out / name)
        trainers[name] = (trainer, cache if arm["cached"] else pairs)
    return trainers


def _step(trainer: DrafterTrainer, source, index: int) -> tuple[float, int, float | None]:
    """(CPU seconds, label positions, loss) of one training step on sequence ``index``."""
    start = time.process_time()
    done = trainer.train_step([(0, trainer.record(source, index))])
    seconds = time.process_time() - start
    return (seconds, 0, None) if done is None else (seconds, done[1], done[0]["loss"])


@torch.no_grad()
def _draft_ms(trainer: DrafterTrainer, target, rounds: int) -> float:
    """Median ms of one inference round's block forward, head and log-softmax (context of 128)."""
    from treespec.engines.torch import TargetModel

    drafter = trainer.drafter
    drafter.model.eval()
    drafter.bind(TargetModel(target))
    features = torch.randn(128, len(drafter.tap_layers) * drafter.config.hidden_size)
    drafter._append_features(features, 0)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        z = drafter._block_states(5, 128)[drafter.config.first_drafted_position:]
        torch.log_softmax(drafter._head_logits(z), dim=-1)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="distill-data directory")
    parser.add_argument("--cache", type=Path, required=True, help="teacher cache of that directory")
    parser.add_argument("--preset", default="smollm2-domino")
    parser.add_argument("--vocab", type=int, default=8192, help="reduced draft vocabulary size")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mask-token-id", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-training"))
    parser.add_argument("--against", metavar="REF", default=None,
                        help="compare the working tree's training code with git commit REF's instead")
    return parser.parse_args()


def _module_at(ref: str, path: str, name: str) -> types.ModuleType:
    """The Python module at ``path`` as of git commit ``ref``, imported under ``name``."""
    root = Path(__file__).resolve().parent.parent
    shown = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=root, capture_output=True, text=True, check=False)
    if shown.returncode:
        raise SystemExit(f"--against {ref}: cannot read {path} there ({shown.stderr.strip()})")
    module = types.ModuleType(name)
    module.__file__ = f"{ref}:{path}"
    sys.modules[name] = module  # attrs and dataclasses look their module up while the body runs
    exec(compile(shown.stdout, module.__file__, "exec"), module.__dict__)
    return module


def against(args, target, cache, vocab) -> None:
    """The working tree's recipe and loop against REF's: same fresh weights, interleaved steps."""
    from treespec.drafters import training as recipe_now

    arms = {}
    for name, recipe, loop in ((args.against, _module_at(args.against, "drafters/training.py", "_recipe_at_ref"),
                                _module_at(args.against, "treespec/apps/training/trainer.py", "_loop_at_ref")),
                               ("working tree", recipe_now, sys.modules[DrafterTrainer.__module__])):
        cfg = attrs.evolve(recipe.TRAIN_PRESETS[args.preset], steps=10_000, save_every=10**9)
        drafter = recipe.new_drafter(target, cfg, args.mask_token_id, draft_vocab=vocab if cfg.draft_vocab_size else None)
        arms[name] = loop.DrafterTrainer(recipe.BlockRecipe(target, drafter, cfg), out_dir=args.out / name.replace(" ", "-"))
    seconds, labels, losses = dict.fromkeys(arms, 0.0), dict.fromkeys(arms, 0), {name: [] for name in arms}
    for step in range(args.warmup + args.steps):
        for name, trainer in arms.items():
            cpu, n, loss = _step(trainer, cache, step % len(cache))
            if step >= args.warmup:
                seconds[name] += cpu
                labels[name] += n
            losses[name].append(loss)
    print(f"{torch.get_num_threads()} thread(s); {args.steps} timed steps per arm ({args.warmup} untimed first), "
          f"preset {args.preset}, teacher cache {args.cache}")
    print(f"{'arm':24s} {'labels/CPU-s':>12s} {'ms/step':>8s}")
    for name in arms:
        print(f"{name:24s} {labels[name] / seconds[name]:12.0f} {1000 * seconds[name] / args.steps:8.0f}")
    old, now = arms
    print(f"working tree / {old}: {seconds[old] / seconds[now] * labels[now] / labels[old]:.2f}x labels per CPU-second")
    gap = max(abs(a - b) for a, b in zip(losses[old], losses[now]))
    print(f"largest difference of a step's loss between the arms: {gap:.2e} over {len(losses[now])} steps")


def main() -> None:
    args = parse_args()
    for option, folder, file, what in (("--data", args.data, "shard-00000.safetensors", "distill-data shards"),
                                       ("--cache", args.cache, "manifest.json", "teacher cache")):
        if not (folder / file).is_file():
            raise SystemExit(f"{option} {folder}: no {what} here")
    ThreadControl.start(args.threads)

    from treespec.apps.assembly.loading import load_frozen_model

    target, _, _ = load_frozen_model(None, "float32")
    pairs = [(s.tokens, s.response_start) for s in iter_sequences(args.data)]
    cache = TeacherCache(args.cache)
    counts = response_token_counts(pairs, target.config.vocab_size)
    vocab = draft_vocabulary(counts, args.vocab)
    if args.against is not None:
        against(args, target, cache, draft_vocabulary(counts, TRAIN_PRESETS[args.preset].draft_vocab_size or args.vocab))
        return
    trainers = _trainers(args, target, pairs, cache, vocab, args.out)
    seconds = {name: 0.0 for name in trainers}
    labels = dict.fromkeys(trainers, 0)
    for step in range(args.warmup + args.steps):
        for name, (trainer, source) in trainers.items():
            cpu, n, _ = _step(trainer, source, step % len(cache))
            if step >= args.warmup:
                seconds[name] += cpu
                labels[name] += n
    print(f"{torch.get_num_threads()} thread(s); {args.steps} timed steps per arm on {args.data} "
          f"({args.preset}); draft vocabulary {args.vocab}: coverage {coverage(vocab, counts):.2%} of these responses")
    report(args, trainers, seconds, labels, target)


def report(args, trainers, seconds, labels, target) -> None:
    """Labels per CPU-second and ms per step of each arm, then the draft forward's time per round."""
    print(f"{'arm':40s} {'labels/CPU-s':>12s} {'ms/step':>8s}")
    for name in trainers:
        print(f"{name:40s} {labels[name] / seconds[name]:12.0f} {1000 * seconds[name] / args.steps:8.0f}")
    print("\ndraft forward per round (block + head + log-softmax), float32, median of "
          f"{args.rounds}:")
    for name, (trainer, _) in trainers.items():
        if name.endswith("fp32") and name.startswith("cache"):
            print(f"  {name.split(', ')[1]:12s} {_draft_ms(trainer, target, args.rounds):6.2f} ms")


if __name__ == "__main__":
    main()
