"""The training loop every drafter family shares; its recipe supplies the drafter and the loss.

Contract
--------
`DrafterTrainer(recipe, out_dir=...)` trains ``recipe.trainable`` (a `treespec.training.TrainingRecipe`),
``batch_sequences`` sequences a step:

* **Data**: a `TeacherCache` or (tokens, response_start) pairs taught live (the same record); a seeded
  permutation (step s takes entries s k .. s k + k - 1), each sequence drawing from a generator seeded by
  the seed, s and its place, so a resumed run draws what an uninterrupted one drew.
* **Data-parallel** under ``torchrun`` (gloo on CPUs, NCCL on GPUs, `DistributedDataParallel`): rank r of
  W takes its share of each step's batch, so the global batch and every generator are one process's;
  rank 0 alone writes, and a run resumes under another world size.
* **Optimiser**: AdamW (fused), the global gradient norm clipped; linear warm-up then a cosine to 10 %
  of the peak at ``steps``; ``lr_scales`` parameters at their multiple; bf16 autocast with float32
  masters where it pays (``autocast_bf16``; None: on CUDA or where this CPU's bf16 is faster).
* **Held-out τ** every ``eval_every`` steps (and before a warm start's first step): each of the
  recipe's ``eval_methods`` decoded greedily over cached answers, logged to ``eval.jsonl``, the best
  weights kept in ``best/`` (replaced whole), the τ curve drawn beside it.
* **Checkpoints** every ``save_every`` steps and at the end, each a unit made current in one atomic
  step (`treespec.apps.training.checkpoint`); `resume` takes the current one (or the newest that
  checks), refusing a run of another start or config but for the fields of `RESUMABLE` (more ``steps``
  stretch the schedule).
* **A time box** (`TimeBox`): after untimed steps and a timed probe, ``steps`` becomes what the budget
  holds (fitted again once the first evaluation is timed); the run stops and saves at the deadline,
  rank 0's clock deciding for every rank.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import load_file, save_file

from treespec.apps.training.checkpoint import Resumed, current_checkpoint, replace_folder, write_checkpoint
from treespec.apps.training.curve import draw_tau_curve
from treespec.apps.training.teacher import TeacherCache, TeacherSpec, live_record
from treespec.training import TeacherRecord, TrainingRecipe

__all__ = ["RESUMABLE", "DrafterTrainer", "TimeBox", "use_autocast"]

RESUMABLE = frozenset({"steps", "eval_every", "save_every"})  # config fields a resumed run may change


def use_autocast(setting: bool | None, device: torch.device, target_config) -> bool:
    """Whether to train under bf16 autocast: ``setting``, else on CUDA, else where this CPU's bf16
    matmul beats fp32 for the target's shapes (`treespec.pricing.hardware`; on a CPU without bf16 hardware
    a bf16-autocast step measured about 10x slower than a float32 one)."""
    if setting is not None:
        return setting
    if torch.device(device).type == "cuda":
        return True
    from treespec.pricing.hardware import cpu_dtype_choice

    return cpu_dtype_choice(target_config).dtype == torch.bfloat16


def _ranks() -> tuple[int, int]:
    """(rank, world size) of the `torch.distributed` group this process is in ((0, 1) outside one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _summed(learned: int, positions: int, total: float, world: int) -> tuple[int, int, float]:
    """The three counts summed over every rank (as they are in one process)."""
    if world == 1:
        return learned, positions, total
    import torch.distributed as dist

    counts = torch.tensor([learned, positions, total], dtype=torch.float64)
    dist.all_reduce(counts)
    return int(counts[0]), int(counts[1]), float(counts[2])


def _from_rank0(values: Sequence[float], world: int) -> list[float]:
    """Rank 0's ``values`` on every rank (themselves in one process)."""
    if world == 1:
        return list(values)
    import torch.distributed as dist

    box = torch.tensor(list(values), dtype=torch.float64)
    dist.broadcast(box, 0)
    return box.tolist()


@attrs.frozen
class TimeBox:
    """A wall-clock budget for one `DrafterTrainer.train` call (module docstring)."""

    seconds: float = attrs.field(validator=attrs.validators.gt(0))  # the budget, from the call's start
    settle_steps: int = 2  # first steps left untimed (allocation, autocast and kernel warm-up)
    probe_steps: int = 20  # steps timed before the length is fitted
    margin: float = 0.03  # share of the budget kept for the last save and the export
    clock: Any = time.perf_counter  # seconds; a test passes its own


@attrs.define
class _BoxState:
    """What a time box has measured in one `train` call."""

    deadline: float
    origin: int  # the step the call started at
    probe_start: tuple[int, float, int] | None = None  # (step, clock, evaluations so far) where the probe began
    step_seconds: float | None = None
    eval_seconds: list[float] = attrs.Factory(list)
    fitted_with_evals: bool = False


def _no_sync(model: torch.nn.Module, sync: bool):
    """DDP's ``no_sync`` for all but a step's last backward (gradients accumulate, then one all-reduce)."""
    import contextlib

    return contextlib.nullcontext() if sync else model.no_sync()


class _RecipeLoss(torch.nn.Module):
    """``recipe.loss`` as a module over ``recipe.trainable`` (what `DistributedDataParallel` wraps): (the
    loss tensor, the `StepLoss`), or (a zero loss over every parameter, None) when the record holds
    nothing to learn, so every rank's backward reaches the same parameters."""

    def __init__(self, recipe: TrainingRecipe) -> None:
        super().__init__()
        self.trainable = recipe.trainable
        self.recipe = recipe

    def forward(self, record: TeacherRecord, step: int, generator: torch.Generator):
        out = self.recipe.loss(record, step, generator)
        if out is None:
            return sum(p.sum() for p in self.trainable.parameters() if p.requires_grad) * 0.0, None
        return out.loss, out


def _best_saved(out: Path, methods: Sequence[str]) -> float:
    """The held-out τ ``best/`` was saved with (it can be newer than the checkpoint a run resumes), -inf without."""
    try:
        return float(json.loads((out / "best" / "heldout.json").read_text())[f"tau/{methods[0]}"])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return float("-inf")


def _with_defaults(saved: dict[str, Any], config_type: type) -> dict[str, Any]:
    """A saved config with the fields it predates at their defaults (a run saved before a field was
    added resumes as one trained with the default)."""
    missing = {f.name: f.default for f in attrs.fields(config_type)
               if f.name not in saved and f.default is not attrs.NOTHING and not isinstance(f.default, attrs.Factory)}
    return {**saved, **json.loads(json.dumps(missing))}


def _groups(params: list[torch.nn.Parameter], lr_scales) -> list[dict[str, Any]]:
    """The optimiser's parameter groups: one per rate multiple (``lr_scales``: (parameters, multiple)
    pairs; every other parameter at 1x), each carrying its ``lr_scale``."""
    scale = {id(p): float(s) for group, s in lr_scales for p in group}
    groups: dict[float, list[torch.nn.Parameter]] = {}
    for p in params:
        groups.setdefault(scale.get(id(p), 1.0), []).append(p)
    return [{"params": group, "lr_scale": s} for s, group in groups.items()]


class DrafterTrainer:
    """Runs the loop of the module docstring over one recipe; see `train`."""

    def __init__(self, recipe: TrainingRecipe, *, out_dir: str | Path, init: str | None = None,
                 lr_scales: Sequence[tuple[Sequence[torch.nn.Parameter], float]] = ()) -> None:
        self.recipe = recipe
        self.rank, self.world = _ranks()
        if recipe.config.batch_sequences % self.world:
            raise ValueError(f"batch_sequences {recipe.config.batch_sequences} is not a multiple of the "
                             f"{self.world} data-parallel ranks")
        self.init = init  # the warm start's weights (path and sha256), None for fresh weights
        self.out_dir = Path(out_dir)
        cfg = recipe.config
        self.spec = TeacherSpec(recipe.drafter.config.target_layer_ids, cfg.teacher_top_k, cfg.max_seq_len)
        self.params = list(recipe.trainable.parameters())
        for p in self.params:
            p.requires_grad_(True)
        recipe.trainable.train()
        self.optimizer = torch.optim.AdamW(_groups(self.params, lr_scales), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           fused=True)  # one kernel over every parameter (CPU and CUDA)
        self.autocast = use_autocast(cfg.autocast_bf16, self.params[0].device, recipe.target.config)
        self.step = 0
        self.best_tau = float("-inf")  # best held-out τ of the first eval method so far
        self.data_identity: str | None = None  # what the run trains on (the teacher caches' paths), kept in its state
        self.resumed_data: str | None = None  # what the resumed checkpoint said it trained on
        self._eval_target = None
        self._model: torch.nn.Module | None = None  # the loss as a module (DDP-wrapped across ranks), made on first use

    @property
    def cfg(self) -> Any:
        return self.recipe.config

    @property
    def drafter(self):
        return self.recipe.drafter

    @property
    def target(self) -> torch.nn.Module:
        return self.recipe.target

    # ------------------------------------------------------------------ schedule
    def learning_rate(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 10% of the peak."""
        cfg = self.cfg
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def step_generator(self, step: int, sequence: int = 0) -> torch.Generator:
        """The generator of sequence ``sequence`` of step ``step`` (anchors and the like): a function of
        the seed, the step and the sequence's place in the step's batch."""
        return torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step + sequence * 7_919_317)

    def batch_indices(self, order: Sequence[int], step: int) -> list[tuple[int, int]]:
        """(place j in the step's batch, sequence index) of this rank's share of step ``step``."""
        k = self.cfg.batch_sequences
        share = range(self.rank * k // self.world, (self.rank + 1) * k // self.world)
        return [(j, order[(step * k + j) % len(order)]) for j in share]

    # ------------------------------------------------------------------ one step
    def record(self, source: Sequence, index: int) -> TeacherRecord:
        """The teacher's view of sequence ``index``: from a `TeacherCache`, else a live target forward."""
        if isinstance(source, TeacherCache):
            record = source[index]
            taps = source.select_taps(record.features, self.drafter.config.target_layer_ids)
            return attrs.evolve(record, features=taps)
        tokens, response_start = source[index]
        return live_record(self.target, tokens, response_start, self.spec)

    def train_step(self, records: Sequence[tuple[int, TeacherRecord]]) -> tuple[dict[str, float], int] | None:
        """One optimiser step on this rank's ``records`` ((place in the batch, record) pairs): the mean
        loss over the step's ``batch_sequences`` sequences, gradients averaged across ranks.  Returns
        (logs, label positions of the whole batch), or None when the recipe found nothing to learn in
        any of them (the step still counts)."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.step) * group["lr_scale"]
        model, scale = self._loss_module(), self.world / self.cfg.batch_sequences  # DDP averages over ranks
        self.optimizer.zero_grad(set_to_none=True)
        logs: dict[str, float] = {}
        learned, positions, total = 0, 0, 0.0
        for i, (j, record) in enumerate(records):
            sync = i == len(records) - 1 or self.world == 1
            with _no_sync(model, sync), torch.autocast(self.params[0].device.type, dtype=torch.bfloat16,
                                                       enabled=self.autocast):
                loss, out = model(record, self.step, self.step_generator(self.step, j))
            if out is not None:
                learned, positions, total = learned + 1, positions + out.label_positions, total + float(loss.detach())
                for key, value in out.logs.items():
                    logs[key] = logs.get(key, 0.0) + value
            (loss * scale).backward()
        learned, positions, total = _summed(learned, positions, total, self.world)
        if learned == 0:
            self.step += 1
            return None
        logs = {key: value / max(1, len(records)) for key, value in logs.items()}  # this rank's means
        logs["loss"] = total / learned  # the step's mean over every rank's sequences
        logs["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=True))
        self.optimizer.step()
        self.step += 1
        return logs, int(positions)

    def _loss_module(self) -> torch.nn.Module:
        """The recipe's loss as a module over ``recipe.trainable`` (wrapped in `DistributedDataParallel`
        across ranks, which broadcasts rank 0's weights once and averages every backward's gradients)."""
        if self._model is None:
            self._model = _RecipeLoss(self.recipe)
            if self.world > 1:
                from torch.nn.parallel import DistributedDataParallel

                device = self.params[0].device
                self._model = DistributedDataParallel(
                    self._model, device_ids=[device] if device.type == "cuda" else None, find_unused_parameters=True)
        return self._model

    # ------------------------------------------------------------------ held-out τ
    @torch.no_grad()
    def evaluate(self, heldout: TeacherCache) -> dict[str, float]:
        """Held-out τ of each eval method (`treespec.apps.training.evaluate`) with the current weights."""
        from treespec.apps.assembly.methods import build_policy, parse_method
        from treespec.apps.training.evaluate import heldout_tau
        from treespec.apps.assembly.loading import load_target

        if self._eval_target is None:
            self._eval_target = load_target(self.target)  # the default engine's target of the frozen module
        self.recipe.trainable.eval()
        self.drafter.bind(self._eval_target)  # fresh per-bind tables (Domino's GRU inputs) from these weights
        methods = {m: build_policy(parse_method(m)) for m in self.recipe.eval_methods}
        layers = self.drafter.config.target_layer_ids
        results = heldout_tau(self.drafter, methods, heldout, taps=lambda r: heldout.select_taps(r.features, layers))
        self.recipe.trainable.train()
        return {f"tau/{r.policy}": r.tau for r in results}

    def _maybe_evaluate(self, heldout: TeacherCache | None, history: list[dict[str, float]]) -> None:
        """Every ``eval_every`` steps: log held-out τ to ``eval.jsonl``; keep the best weights in ``best/``
        (rank 0 alone)."""
        if heldout is None or not self.cfg.eval_every or self.step % self.cfg.eval_every or self.rank:
            return
        scores = self.evaluate(heldout) | {"step": self.step}
        history.append(scores)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / "eval.jsonl", "a") as fh:
            fh.write(json.dumps(scores, sort_keys=True) + "\n")
        draw_tau_curve(self.out_dir, self.recipe.eval_methods[0])  # tau_curve.svg / .png beside it
        primary = scores[f"tau/{self.recipe.eval_methods[0]}"]
        if primary > self.best_tau:
            self.best_tau = primary

            def write(folder: Path) -> None:
                self.drafter.save_pretrained(folder)
                (folder / "heldout.json").write_text(json.dumps(scores, indent=1, sort_keys=True) + "\n")

            replace_folder(self.out_dir / "best", write)

    # ------------------------------------------------------------------ the run
    def train(self, sequences: Sequence, *, until: int | None = None, progress: bool = True,
              heldout: TeacherCache | None = None, box: TimeBox | None = None) -> list[dict[str, float]]:
        """Run to step ``until`` (default ``cfg.steps``), one sequence per step in a seeded order.

        ``sequences``: a `TeacherCache`, or (tokens, response_start) pairs taught live.
        ``heldout``: a teacher cache of held-out greedy answers, scored every ``eval_every`` steps (and,
        for a warm start, once before the first step, so ``best/`` is the start until a step beats it).

        ``box``: fit the run's length to a wall-clock budget (`TimeBox`; module docstring).

        Checkpoints every ``save_every`` steps and at the end; stopping early keeps the schedule of
        the full run, so a later call (after `resume`) continues it exactly.
        """
        from tqdm import tqdm

        if not sequences:
            raise ValueError("no training sequences")
        order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(self.cfg.seed)).tolist()
        history: list[dict[str, float]] = []
        timer = None if box is None else _BoxState(box.clock() + box.seconds * (1 - box.margin), self.step)
        bar = tqdm(total=self._stop(until), initial=self.step, disable=not progress, desc=f"train {self.cfg.kind}")
        start, positions = time.perf_counter(), 0
        if self.step == 0 and self.init is not None:  # a warm start's score: the bar to beat, best/ until beaten
            self._timed_evaluate(heldout, history, box, timer)
        while self.step < self._stop(until):
            if timer is not None and self._boxed(box, timer):
                break
            done = self.train_step([(j, self.record(sequences, i)) for j, i in self.batch_indices(order, self.step)])
            if done is None:
                continue
            logs, labelled = done
            history.append(logs | {"step": self.step})
            positions += labelled
            bar.set_postfix(loss=f"{logs['loss']:.3f}", acc1=f"{logs.get('acc1', 0):.2f}",
                            tok_s=f"{positions / (time.perf_counter() - start):.0f}", refresh=False)
            bar.total = self._stop(until)
            bar.update(1)
            self._timed_evaluate(heldout, history, box, timer)
            if self.step % self.cfg.save_every == 0:
                self.save(history)
        self.save(history, box=timer)
        bar.close()
        return history

    def _stop(self, until: int | None) -> int:
        return min(self.cfg.steps, until if until is not None else self.cfg.steps)

    # ------------------------------------------------------------------ the time box
    def _timed_evaluate(self, heldout, history, box: TimeBox | None, timer: _BoxState | None) -> None:
        """`_maybe_evaluate`, its seconds kept when a time box runs (an evaluation that ran adds a line)."""
        before, lines = (box.clock() if box else 0.0), len(history)
        self._maybe_evaluate(heldout, history)
        if timer is not None and len(history) > lines:
            timer.eval_seconds.append(box.clock() - before)

    def _boxed(self, box: TimeBox, timer: _BoxState) -> bool:
        """Before a step: True when the deadline has passed; else time the probe, and fit ``steps`` to
        the budget once the probe and later the first evaluation are measured.  Both decisions are
        rank 0's (only rank 0 evaluates), taken on every rank together."""
        now = box.clock()
        if timer.probe_start is None and self.step >= timer.origin + box.settle_steps:
            timer.probe_start = (self.step, now, len(timer.eval_seconds))
        wants_fit = False
        if timer.probe_start is not None and self.step - timer.probe_start[0] >= box.probe_steps:
            step0, t0, evals0 = timer.probe_start
            if timer.step_seconds is None:
                timer.step_seconds = (now - t0 - sum(timer.eval_seconds[evals0:])) / (self.step - step0)
                wants_fit = True
            wants_fit |= bool(timer.eval_seconds) and not timer.fitted_with_evals  # the first evaluation timed
        stop, fit = _from_rank0([float(now >= timer.deadline), float(wants_fit)], self.world)
        if stop:
            return True
        if fit:
            self._fit(timer, now)
        return False

    def _fit(self, timer: _BoxState, now: float) -> None:
        """``steps`` := this step + what the time left holds (rank 0's estimate, on every rank)."""
        per_step = timer.step_seconds
        if timer.eval_seconds:  # seconds of an evaluation, spread over the steps between two
            per_step += sum(timer.eval_seconds) / len(timer.eval_seconds) / max(1, self.cfg.eval_every)
            timer.fitted_with_evals = True
        steps = self.step + max(0, int((timer.deadline - now) / max(per_step, 1e-9)))
        steps = int(_from_rank0([float(steps)], self.world)[0])
        self.recipe.config = attrs.evolve(self.cfg, steps=max(steps, self.step))

    # ------------------------------------------------------------------ checkpoints
    def save(self, history: Sequence[dict[str, float]] = (), *, box: _BoxState | None = None) -> Path:
        """Write a checkpoint as a unit (`treespec.apps.training.checkpoint`: the drafter in its released layout,
        optimizer moments, the trainer state; rank 0 alone: every rank holds the same weights and moments);
        with a time box, what it measured."""
        if self.rank:
            return self.out_dir
        names = {id(p): n for n, p in self.recipe.trainable.named_parameters()}
        moments = {}
        for p, st in self.optimizer.state.items():
            moments[f"{names[id(p)]}::exp_avg"] = st["exp_avg"].contiguous()
            moments[f"{names[id(p)]}::exp_avg_sq"] = st["exp_avg_sq"].contiguous()
        state = {"step": self.step, "config": attrs.asdict(self.cfg), "autocast_bf16": self.autocast, "init": self.init,
                 "best_tau": self.best_tau if self.best_tau > float("-inf") else None,
                 "recent": list(history[-50:]), "data": self.data_identity}
        if box is not None:
            state["time_box"] = {"step_seconds": box.step_seconds, "eval_seconds": box.eval_seconds,
                                 "fitted_steps": self.cfg.steps if box.step_seconds is not None else None}

        def write(folder: Path) -> None:
            self.drafter.save_pretrained(folder / "drafter")
            save_file(moments, str(folder / "optimizer.safetensors"))
            (folder / "trainer_state.json").write_text(json.dumps(state, indent=1))

        self.out_dir.mkdir(parents=True, exist_ok=True)
        write_checkpoint(self.out_dir, self.step, write)
        return self.out_dir

    def resume(self) -> Resumed | None:
        """Restore weights, optimizer moments and step from the run's current checkpoint (or the newest one
        that checks, `treespec.apps.training.checkpoint.current_checkpoint`); None when there is none.  A
        checkpoint that does not check, or a run of another start or config, is refused (ValueError)."""
        taken = current_checkpoint(self.out_dir)
        if taken is None:
            return None
        state = json.loads((taken.folder / "trainer_state.json").read_text())
        if state.get("init") != self.init:
            raise ValueError(f"{self.out_dir} is a run started from {state.get('init') or 'fresh weights'}, "
                             f"not from {self.init or 'fresh weights'}: use a new --out or the same start")
        now = json.loads(json.dumps(attrs.asdict(self.cfg)))
        saved = _with_defaults(state.get("config") or {}, type(self.cfg))
        differ = sorted(k for k in set(saved) | set(now) if k not in RESUMABLE and saved.get(k) != now.get(k))
        if differ:
            raise ValueError(f"{self.out_dir} was trained with another config ("
                             + ", ".join(f"{k} {saved.get(k)!r} there, {now.get(k)!r} now" for k in differ)
                             + f"): use a new --out; a resumed run may change only {', '.join(sorted(RESUMABLE))}")
        module = self.recipe.trainable
        loaded = type(self.drafter).from_pretrained(taken.folder / "drafter", dtype=self.params[0].dtype,
                                                    device=self.params[0].device)
        saved = type(self.recipe)(self.target, loaded, self.cfg).trainable
        with torch.no_grad():
            for p, q in zip(module.parameters(), saved.parameters(), strict=True):
                p.copy_(q)
            for b, c in zip(module.buffers(), saved.buffers(), strict=True):
                b.copy_(c)
        moments = load_file(str(taken.folder / "optimizer.safetensors"), device=str(self.params[0].device))
        for name, p in module.named_parameters():
            if f"{name}::exp_avg" in moments:
                self.optimizer.state[p] = {"step": torch.tensor(float(state["step"]), device=p.device),
                                           "exp_avg": moments[f"{name}::exp_avg"],
                                           "exp_avg_sq": moments[f"{name}::exp_avg_sq"]}
        self.step = int(state["step"])
        self.best_tau = max(state.get("best_tau") if state.get("best_tau") is not None else float("-inf"),
                            _best_saved(self.out_dir, self.recipe.eval_methods))
        self.resumed_data = state.get("data")
        return attrs.evolve(taken, step=self.step)
