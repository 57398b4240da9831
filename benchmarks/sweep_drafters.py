"""Drafter recipe sweep at equal CPU time, scored by held-out τ (no target forward anywhere).

Every arm trains a fresh drafter from the teacher caches for the same CPU budget: a short probe
(``--probe`` steps, thrown away) measures the arm's seconds per step on this machine, the arm's
schedule is then set to the number of steps that fit the budget (warm-up and cosine decay over
exactly those steps), and the trained drafter is scored by `treespec.apps.training.evaluate` on the held-out
caches at T = 0.  Arms are resumable: each writes ``OUT/ARM/result.json`` when done and is
skipped on a rerun; an interrupted arm resumes from its last checkpoint.  The table, with the
CPU minutes each arm really used, is printed and written to ``OUT/sweep.md``.

    python benchmarks/sweep_drafters.py --teacher runs/teacher/snap1 \
        --heldout runs/teacher/heldout-alpaca --heldout runs/teacher/heldout-gsm8k \
        --cpu-minutes 20 --arms domino-base domino-l1 domino-l4 --out runs/sweep
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import attrs
import torch

from treespec.apps.training.teacher import TeacherCache
from treespec.apps.training.trainer import DrafterTrainer
from treespec.apps.training.vocabulary import response_token_counts
from treespec.drafters.training import TRAIN_PRESETS, BlockRecipe, TrainConfig, new_drafter
from treespec.pricing.conditions import ThreadControl
from treespec.training import draft_vocabulary

# name -> (preset, overrides): the axes the issue names, one change from the base arm each.
ARMS: dict[str, tuple[str, dict]] = {
    "domino-base": ("smollm2-domino", {"draft_vocab_size": 8192}),
    "domino-l1": ("smollm2-domino", {"draft_vocab_size": 8192, "num_layers": 1}),
    "domino-l4": ("smollm2-domino", {"draft_vocab_size": 8192, "num_layers": 4}),
    "domino-b16": ("smollm2-domino", {"draft_vocab_size": 8192, "block_size": 16}),
    "domino-last-tap": ("smollm2-domino", {"draft_vocab_size": 8192, "target_layer_ids": (1, 10, 19, 29)}),
    "domino-gru512": ("smollm2-domino", {"draft_vocab_size": 8192, "gru_hidden_dim": 512}),
    "domino-floor": ("smollm2-domino", {"draft_vocab_size": 8192, "base_share_floor": 0.3}),
    "domino-lr3e-4": ("smollm2-domino", {"draft_vocab_size": 8192, "lr": 3e-4}),
    "domino-v16k": ("smollm2-domino", {"draft_vocab_size": 16384}),
    "domino-full-vocab": ("smollm2-domino", {}),
    "dflash-base": ("smollm2-dflash", {"draft_vocab_size": 8192}),
    "dflash-l4": ("smollm2-dflash", {"draft_vocab_size": 8192, "num_layers": 4}),
    "dflash-b16": ("smollm2-dflash", {"draft_vocab_size": 8192, "block_size": 16}),
}


def arm_config(name: str, steps: int) -> TrainConfig:
    preset, overrides = ARMS[name]
    return attrs.evolve(TRAIN_PRESETS[preset], **overrides, steps=steps, warmup_steps=min(50, steps // 10),
                        save_every=max(steps // 4, 1), eval_every=0)


def _seconds_per_step(target, cache, name: str, vocab, mask: int, probe: int, out: Path) -> float:
    cfg = arm_config(name, steps=10_000)
    drafter = new_drafter(target, cfg, mask, draft_vocab=_vocab_for(cfg, vocab))
    trainer = DrafterTrainer(BlockRecipe(target, drafter, cfg), out_dir=out / "probe")
    trainer.train(cache, until=1, progress=False)  # first step: allocation, tables
    start = time.process_time()
    trainer.train(cache, until=1 + probe, progress=False)
    return (time.process_time() - start) / probe


def _vocab_for(cfg: TrainConfig, vocab: dict[int, torch.Tensor]) -> torch.Tensor | None:
    return None if cfg.draft_vocab_size is None else vocab[cfg.draft_vocab_size]


def run_arm(target, cache, heldout, name: str, budget_s: float, vocab, mask: int, probe: int, out: Path) -> dict:
    """Train arm ``name`` for ``budget_s`` CPU-seconds (schedule fitted to it) and score it."""
    done = out / name / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    plan = out / name / "plan.json"  # the step count is fixed once, so a resumed arm keeps its schedule
    if plan.exists():
        planned = json.loads(plan.read_text())
        steps, per_step = planned["steps"], planned["seconds_per_step"]
    else:
        per_step = _seconds_per_step(target, cache, name, vocab, mask, probe, out / name)
        steps = max(int(budget_s / per_step), 10)
        plan.parent.mkdir(parents=True, exist_ok=True)
        plan.write_text(json.dumps({"steps": steps, "seconds_per_step": per_step}))
    cfg = arm_config(name, steps)
    drafter = new_drafter(target, cfg, mask, draft_vocab=_vocab_for(cfg, vocab))
    trainer = DrafterTrainer(BlockRecipe(target, drafter, cfg), out_dir=out / name)
    resumed = trainer.resume()
    start = time.process_time()
    history = trainer.train(cache, progress=True)
    cpu = time.process_time() - start  # training only (a resumed arm: its last stretch)
    scores = trainer.evaluate(heldout)
    result = {"arm": name, "overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in ARMS[name][1].items()},
              "steps": steps, "cpu_minutes": cpu / 60, "seconds_per_step": per_step, "resumed": resumed,
              "final_loss": history[-1]["loss"] if history else None} | scores
    done.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return result


def table(results: list[dict]) -> str:
    methods = sorted({k for r in results for k in r if k.startswith("tau/")})
    head = "| arm | change | steps | CPU min | " + " | ".join(m.removeprefix("tau/") for m in methods) + " |"
    lines = [head, "|" + "---|" * (4 + len(methods))]
    for r in results:
        change = ", ".join(f"{k}={v}" for k, v in r["overrides"].items()) or "-"
        taus = " | ".join(f"{r[m]:.3f}" if m in r else "" for m in methods)
        cpu = f"{r['cpu_minutes']:.1f}" + (" (resumed)" if r.get("resumed") else "")
        lines.append(f"| {r['arm']} | {change} | {r['steps']} | {cpu} | {taus} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", type=Path, action="append", required=True, help="training teacher cache(s)")
    parser.add_argument("--heldout", type=Path, action="append", required=True, help="held-out teacher cache(s)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=sorted(ARMS))
    parser.add_argument("--cpu-minutes", type=float, default=20.0, help="CPU budget of each arm")
    parser.add_argument("--probe", type=int, default=5, help="steps timed to fit an arm's schedule to the budget")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/sweep"))
    args = parser.parse_args()
    missing = [str(p) for p in [*args.teacher, *args.heldout] if not (p / "manifest.json").is_file()]
    if missing:
        raise SystemExit(f"no teacher cache at {', '.join(missing)} (make one with `treespec teacher-cache`)")
    ThreadControl.start(args.threads)

    from treespec.apps.assembly.loading import load_frozen_model

    target, tokenizer, identity = load_frozen_model(None, "auto")
    cache, heldout = TeacherCache(*args.teacher), TeacherCache(*args.heldout)
    for c in (cache, heldout):
        c.check(identity=identity)
    counts = response_token_counts(cache.pairs(), target.config.vocab_size)
    sizes = {ARMS[a][1].get("draft_vocab_size") for a in args.arms} - {None}
    vocab = {n: draft_vocabulary(counts, n) for n in sizes}
    mask = next(t for t in (tokenizer.unk_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None)
    results = [run_arm(target, cache, heldout, name, 60 * args.cpu_minutes, vocab, mask, args.probe, args.out)
               for name in args.arms]
    text = table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
