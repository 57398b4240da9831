"""``treespec train-drafter``: train a drafter on self-distillation data through its recipe.

``--recipe NAME`` picks a registered training recipe (kind ``"recipe"``; ``block``, the default,
trains DFlash and Domino drafters) and ``--preset`` one of its named configs.

``--teacher DIR`` reads a teacher cache (``treespec teacher-cache``) instead of running the target
every step; ``--set draft_vocab_size=N`` gives the drafter a head over the N most frequent response
tokens of the training data.  Resumable: rerunning with the same ``--out`` continues from the last checkpoint (weights, optimizer
moments and data order).  The final drafter is ``OUT/drafter/`` in the released checkpoint layout.

Data-parallel: ``torchrun --nproc-per-node N "$(which treespec)" train-drafter ... --set batch_sequences=K``
runs N ranks (gloo on CPUs, NCCL with ``--device cuda``, one GPU per rank), each taking K / N of every
step's K sequences (`treespec.apps.training.trainer`); rank 0 writes the run directory and prints.

``--minutes M`` fits the run to M minutes of wall time from its first step (the trainer's time box):
``steps`` becomes what the budget holds at the measured rate, and the run stops and saves at the
deadline; the minutes do not count loading the target and the caches.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import attrs
import torch

from treespec import registry
from treespec.apps.commands import CPU_DTYPES, DTYPES, add_threads_argument, start_threads
from treespec.apps.training.teacher import TeacherCache, TeacherCacheError
from treespec.apps.training.vocabulary import coverage, response_token_counts
from treespec.training import TrainingRecipe, draft_vocabulary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, default=None, help="directory of distill-data shards (or --teacher)")
    parser.add_argument("--teacher", type=Path, action="append", default=None,
                        help="a teacher cache (treespec teacher-cache): train without running the target; "
                             "repeat to train on several (e.g. greedy and sampled data)")
    parser.add_argument("--out", type=Path, required=True, help="run directory (checkpoints; resumed if present)")
    parser.add_argument("--heldout", type=Path, action="append", default=None,
                        help="a teacher cache of held-out greedy answers (repeatable): held-out τ every "
                             "eval_every steps (--set eval_every=N), logged to OUT/eval.jsonl; the best weights "
                             "go to OUT/best")
    parser.add_argument("--init", type=Path, default=None,
                        help="start from this drafter (weights and draft vocabulary, e.g. a shipped one) with a "
                             "fresh optimiser and its warm-up, instead of fresh weights; the run's steps are added (the block "
                             "recipe grows a drafter with fewer layers or a smaller head than the run asks for)")
    parser.add_argument("--target", type=Path, default=None, help="local HF target directory (default: the embedded SmolLM2)")
    parser.add_argument("--recipe", default="block",
                        help="registered training recipe (`treespec list recipe`; block: DFlash and Domino)")
    parser.add_argument("--preset", default="smollm2-dflash", help="one of the recipe's named configs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of the recipe's config, e.g. --set steps=4000 --set lr=5e-4")
    parser.add_argument("--mask-token-id", type=int, default=None, help="mask token (default: the tokenizer's unk/pad/eos)")
    parser.add_argument("--target-dtype", choices=CPU_DTYPES, default="auto", help="dtype of the frozen target")
    parser.add_argument("--until", type=int, default=None, help="stop at this step (the schedule stays that of the full run)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="fit the run to this wall-clock budget: after a short timed probe, steps becomes what "
                             "the budget holds (evaluations counted), and the run stops and saves at the deadline")
    add_threads_argument(parser)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the target and the drafter train")
    parser.add_argument("--export", type=Path, default=None,
                        help="also write the trained drafter here in --export-dtype (the shipped form)")
    parser.add_argument("--export-dtype", choices=CPU_DTYPES, default="bfloat16", help="dtype of --export")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into an --out that holds other files than a run's, or over an --export folder "
                             "that holds files (default: refused before any work)")


def _recipe(name: str) -> type[TrainingRecipe]:
    try:
        return registry.resolve("recipe", name)
    except registry.RegistryError as exc:
        raise SystemExit(f"--recipe: {exc}") from None


def _config(args: argparse.Namespace, recipe: type[TrainingRecipe]):
    if args.preset not in recipe.presets:
        raise SystemExit(f"unknown preset {args.preset!r} of recipe {args.recipe}; available: {', '.join(recipe.presets)}")
    cfg, fields = recipe.presets[args.preset], {f.name: f for f in attrs.fields(recipe.config_type)}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--set {key}: not a field of the {args.recipe} recipe's config ({', '.join(fields)})")
        try:
            cfg = attrs.evolve(cfg, **{key: _parse(value, getattr(cfg, key), str(fields[key].type))})
        except (TypeError, ValueError) as exc:
            raise SystemExit(f"--set {key}={value}: not a valid {key} ({exc})") from None
    return cfg


def _check_data(path: Path | None, teachers: list[Path] | None) -> None:
    """A clear error before the target loads when --data holds no shards."""
    if teachers:
        for teacher in teachers:
            if not (teacher / "manifest.json").is_file():
                raise SystemExit(f"--teacher {teacher}: no teacher cache here (make one with `treespec teacher-cache`)")
        if path is None:
            return
    if path is None:
        raise SystemExit("give --data (distill-data shards) or --teacher (a teacher cache)")
    if not path.is_dir():
        raise SystemExit(f"--data {path}: no such directory (make one with `treespec distill-data --out {path}`)")
    if not any(path.glob("shard-*.safetensors")):
        raise SystemExit(f"--data {path}: no distill-data shards (shard-*.safetensors) in this directory")


def _parse(text: str, current, annotation: str = ""):
    if current is None and text.lower() in ("none", "auto"):
        return None
    if isinstance(current, bool) or current is None and annotation.startswith("bool"):
        if text.lower() not in ("1", "true", "yes", "0", "false", "no"):
            raise ValueError(f"expected true or false, got {text!r}")
        return text.lower() in ("1", "true", "yes")
    if isinstance(current, tuple) or current is None and "," in text:
        items = [x.strip() for x in text.split(",") if x.strip()]
        return tuple(int(x) if x.lstrip("-").isdigit() else x for x in items)
    if current is None:  # an optional field: an integer if it reads as one
        return int(text) if text.lstrip("-").isdigit() else float(text)
    return type(current)(text)


def _sequences(args: argparse.Namespace, identity, cfg):
    """What training reads: the teacher cache (checked against the target and K), else the data's pairs."""
    from treespec.apps.data.selfdistill import iter_sequences

    if args.teacher is None:
        return [(s.tokens, s.response_start) for s in iter_sequences(args.data)]
    try:
        cache = TeacherCache(*args.teacher)
        cache.check(identity=identity, top_k=cfg.teacher_top_k)
    except TeacherCacheError as exc:
        raise SystemExit(f"--teacher: {exc}") from None
    if cache.manifest.get("max_seq_len", cfg.max_seq_len) < cfg.max_seq_len:
        raise SystemExit(f"--teacher: the cache cut sequences at {cache.manifest['max_seq_len']} tokens, the run "
                         f"asks for max_seq_len {cfg.max_seq_len}")
    return cache


def _heldout(args: argparse.Namespace, identity):
    """The held-out teacher cache (checked against the target), or None."""
    if not args.heldout:
        return None
    try:
        cache = TeacherCache(*args.heldout)
        cache.check(identity=identity)
    except TeacherCacheError as exc:
        raise SystemExit(f"--heldout: {exc}") from None
    return cache


def _check_taps(caches: dict, layers) -> None:
    """Every teacher cache given holds the drafter's tap layers (``caches``: option -> cache or None)."""
    for option, cache in caches.items():
        if isinstance(cache, TeacherCache):
            try:
                cache.check(target_layer_ids=layers)
            except TeacherCacheError as exc:
                raise SystemExit(f"--{option}: {exc}") from None


def _response_counts(sequences, vocab_size: int):
    """[V] how often each token occurs in the training responses (a teacher cache or the data's pairs)."""
    return response_token_counts(sequences.pairs() if isinstance(sequences, TeacherCache) else sequences, vocab_size)


def _draft_vocab(cfg, sequences, vocab_size: int):
    """The reduced head's token ids (None for a full head), with its coverage printed."""
    if cfg.draft_vocab_size is None:
        return None
    counts = _response_counts(sequences, vocab_size)
    vocab = draft_vocabulary(counts, cfg.draft_vocab_size)
    print(f"draft vocabulary: the {cfg.draft_vocab_size} most frequent response tokens cover "
          f"{coverage(vocab, counts):.2%} of the training responses")
    return vocab


def _start_drafter(args: argparse.Namespace, recipe: type[TrainingRecipe], target, cfg, mask: int, data):
    """Fresh weights (and a draft vocabulary picked from the data), or the ``--init`` drafter's."""
    if args.init is None:
        return recipe.new_drafter(target, cfg, mask, draft_vocab=_draft_vocab(cfg, data, target.config.vocab_size))
    # a reduced head needs the counts (to grow it, and for its coverage); a full head cannot have one saved
    counts = None if cfg.draft_vocab_size is None else _response_counts(data, target.config.vocab_size)
    try:
        drafter = recipe.warm_start(target, cfg, mask, args.init, token_counts=counts)
    except ValueError as exc:
        raise SystemExit(f"treespec train-drafter: {exc}") from None
    if drafter.draft_token_ids is not None:
        print(f"warm start from {args.init}: its draft vocabulary covers "
              f"{coverage(drafter.draft_token_ids.cpu(), counts):.2%} of the training responses")
    return drafter


def _init_identity(init: Path | None) -> str | None:
    """``--init``'s weights by path and sha256 (a resumed run must continue from the same start)."""
    if init is None:
        return None
    from treespec.apps.assembly.embedded import sha256_of

    return f"{init} sha256:{sha256_of(init / 'model.safetensors')}"


def _distributed(args: argparse.Namespace) -> int:
    """Join the ``torchrun`` group this process was launched in (its world size; 1 without torchrun): gloo
    on CPUs, NCCL on GPUs (each rank on cuda:LOCAL_RANK)."""
    import os

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        cuda = str(args.device).startswith("cuda")
        if cuda:
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(args.device)
        dist.init_process_group("nccl" if cuda else "gloo")
    return world


_PEER_GONE = ("gloo", "nccl", "connection", "peer", "broken pipe")  # how a collective says another rank is gone


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    world = _distributed(args)
    try:
        code = _train(args, world)
    except (dist.DistError, RuntimeError) as exc:
        if world == 1 or not (isinstance(exc, dist.DistError) or any(w in str(exc).lower() for w in _PEER_GONE)):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        print(f"treespec train-drafter: rank {dist.get_rank()}: a collective failed, another rank stopped "
              f"({first}); the last checkpoint stays as it was", file=sys.stderr)
        return 1  # no collective after a failure: the group is left to end with the process
    if world > 1 and dist.is_initialized():  # after a failure the ranks exit without it (a collective could hang)
        dist.barrier()  # every rank past its last collective and rank 0 done writing: they tear down together
        dist.destroy_process_group()
    return code


def _train(args: argparse.Namespace, world: int) -> int:
    from treespec.apps.assembly.loading import load_frozen_model
    from treespec.apps.training.trainer import DrafterTrainer, TimeBox

    start_threads(args, ranks=world)
    recipe = _recipe(args.recipe)
    cfg = _config(args, recipe)
    if args.init is not None:
        cfg = recipe.warm_config(cfg)
    _check_data(args.data, args.teacher)
    if args.minutes is not None and not (math.isfinite(args.minutes) and args.minutes > 0):
        raise SystemExit(f"treespec train-drafter: --minutes {args.minutes:g}: give a positive, finite budget")
    _check_outputs(args)
    try:
        target, tokenizer, identity = load_frozen_model(args.target, args.target_dtype, args.device,
                                                        tokenizer=args.mask_token_id is None)
    except OSError as exc:
        hint = "; or pass --mask-token-id" if "tokenizer" in str(exc) else ""
        raise SystemExit(f"treespec train-drafter: --target {exc}{hint}") from None
    except ValueError as exc:  # a device this machine does not have
        raise SystemExit(f"treespec train-drafter: {exc}") from None
    mask = args.mask_token_id
    if mask is None:
        mask = next(t for t in (tokenizer.unk_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None)
    data, heldout = _sequences(args, identity, cfg), _heldout(args, identity)
    source = f"teacher cache {', '.join(map(str, args.teacher))}" if args.teacher else f"{args.data}"
    print(f"{len(data)} sequences from {source}; config: {cfg}")
    drafter = _start_drafter(args, recipe, target, cfg, mask, data)
    _check_taps({"teacher": data, "heldout": heldout}, drafter.config.target_layer_ids)
    run_recipe = recipe(target, drafter, cfg)
    scales = run_recipe.lr_scales(args.init)
    for params, scale in scales:
        print(f"{sum(p.numel() for p in params):,} parameters added to the --init drafter learn at {scale:g}x the rate")
    try:
        trainer = DrafterTrainer(run_recipe, out_dir=args.out, init=_init_identity(args.init), lr_scales=scales)
        trainer.data_identity = _data_identity(args)
        resumed = trainer.resume()
    except ValueError as exc:
        raise SystemExit(f"treespec train-drafter: {exc}") from None
    if resumed is not None:
        where = resumed.folder.relative_to(args.out) if resumed.folder != args.out else args.out
        print(f"resumed at step {trainer.step} from {where}" + (f" ({resumed.note})" if resumed.note else ""))
        if trainer.resumed_data not in (None, trainer.data_identity):
            print(f"note: the run trained on {trainer.resumed_data} until step {trainer.step}; it goes on with "
                  f"{trainer.data_identity}")
    if len(data) < trainer.cfg.batch_sequences:
        print(f"note: batch_sequences={trainer.cfg.batch_sequences} exceeds the {len(data)} training sequences: each "
              "step repeats some of them")
    box = None if args.minutes is None else TimeBox(args.minutes * 60)
    trainer.train(data, until=args.until, heldout=heldout, progress=trainer.rank == 0, box=box)
    if box is not None and trainer.rank == 0:
        print(f"time box of {args.minutes:g} min: {trainer.step} of {trainer.cfg.steps} steps")
    if trainer.rank:
        return 0  # rank 0 writes and exports
    print(f"drafter written to {args.out / 'drafter'}")
    if args.export is not None:
        best = args.out / "best"
        source = best if heldout is not None and best.is_dir() else args.out / "drafter"
        export_drafter(source, args.export, DTYPES[args.export_dtype])
        print(f"exported {source}")
        print(f"{args.export_dtype} copy written to {args.export}")
    return 0


def _data_identity(args: argparse.Namespace) -> str:
    """What the run trains on, as its checkpoints record it (a resume on other data is said)."""
    return ", ".join(str(p.resolve()) for p in args.teacher) if args.teacher else str(args.data.resolve())


def usable_folder(path: Path, option: str) -> None:
    """SystemExit naming ``option`` when ``path`` cannot be a folder this run writes: it is a file, a file
    stands where one of its parents would be, or the nearest existing parent is not writable."""
    if path.exists() and not path.is_dir():
        raise SystemExit(f"{option} {path}: a file, not a folder")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise SystemExit(f"{option} {path}: {parent} is a file, so no folder can be made below it")
    if not os.access(parent, os.W_OK):
        raise SystemExit(f"{option} {path}: {parent} is not writable")


def _is_run(path: Path) -> bool:
    return any((path / name).exists() or (path / name).is_symlink()
               for name in ("checkpoints", "checkpoint", "trainer_state.json"))


def _check_outputs(args: argparse.Namespace) -> None:
    """Every folder the run writes, checked before any work: usable, and holding nothing a user made that the
    run would write over (``--overwrite`` allows it)."""
    usable_folder(args.out, "--out")
    if args.out.is_dir() and any(args.out.iterdir()) and not _is_run(args.out) and not args.overwrite:
        raise SystemExit(f"--out {args.out}: holds files and is not a train-drafter run; give an empty or new folder "
                         "(or --overwrite to write the run among them)")
    if args.export is not None:
        usable_folder(args.export, "--export")
        if args.export.is_dir() and any(args.export.iterdir()) and not args.overwrite:
            raise SystemExit(f"--export {args.export}: holds files already (a drafter?); give a new folder, or "
                             "--overwrite to replace them")


def export_drafter(source: Path, out: Path, dtype: torch.dtype) -> Path:
    """Reload the checkpoint at ``source`` (strictly) and save it in ``dtype`` at ``out``."""
    from treespec.apps.assembly.loading import load_drafter

    return load_drafter(source, dtype=dtype).save_pretrained(out)
