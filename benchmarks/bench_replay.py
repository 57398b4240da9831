"""Live decoding against trace replay: wall time and tau agreement for the same methods, side by side.

One trace is recorded along the target's greedy trajectory of every prompt; then, method by method,
the live `SpeculativeDecoder` (T = 0, no stop tokens) runs over the prompts and the same method is
replayed from the trace.  Printed per method: live and replay seconds and their ratio, mean tau
both ways, and three prompt counts: replayed tau sequence = live; live output = the recorded
trajectory (a low-precision target can flip a near-tie between a tree forward and a one-token
step, after which live and replay follow different texts); and tau equal among those prompts.
The recording, saving and loading times are printed once: they are paid once for every method.

    OMP_NUM_THREADS=1 python benchmarks/bench_replay.py          # embedded SmolLM2 + its shipped drafters
    python benchmarks/bench_replay.py --dflash DIR --domino DIR  # other checkpoints for the embedded target
    python benchmarks/bench_replay.py --random-drafters          # untrained drafters where none are shipped
    python benchmarks/bench_replay.py --tiny                     # tiny random float64 models
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import attrs
import torch

from treespec.apps.assembly.loading import embedded_drafter_dir
from treespec.apps.assembly.methods import parse_method
from treespec.apps.assembly.session import Session
from treespec.apps.kit.tiny import tiny_causal_lm
from treespec.apps.replay import RECORD_PRESETS, ReplayDrafts, Trace, evaluate, record_trace
from treespec.engines.torch import TargetModel
from treespec.pricing.conditions import ThreadControl

METHODS = ["dflash", "domino", "ddtree@16", "caddtree@16", "dominotree@16", "static-corrected@16", "ddtree@64"]
DATASETS = ["gsm8k", "mt-bench", "alpaca"]
KINDS = ("dflash", "domino")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random float64 target and drafters")
    parser.add_argument("--prompts", type=int, default=20, help="prompts (split evenly over --datasets)")
    parser.add_argument("--datasets", nargs="+", default=DATASETS, help="treespec.apps.data.datasets names or files")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--dflash", type=Path, default=None, help="DFlash checkpoint (default: the shipped one)")
    parser.add_argument("--domino", type=Path, default=None, help="Domino checkpoint (default: the shipped one)")
    parser.add_argument("--random-drafters", action="store_true",
                        help="untrained drafters of the embedded recipe's shapes where no checkpoint is found")
    parser.add_argument("--preset", default="quick", choices=sorted(RECORD_PRESETS), help="what the trace keeps")
    parser.add_argument("--trace", type=Path, default=None, help="keep the trace here (default: a temporary file)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="dtype of the embedded target (the tiny models are float64)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return parser.parse_args()


# ---------------------------------------------------------------------------- models and prompts
def tiny_setup(args: argparse.Namespace):
    """A float64 Qwen3 (V 256, H 64, 4 layers), random DFlash / Domino drafters, random prompts."""
    from treespec.drafters.config import DFlashConfig, DominoHeadConfig
    from treespec.drafters.dflash import DFlashDrafter
    from treespec.drafters.domino import DominoDrafter

    target = TargetModel(tiny_causal_lm(vocab=256, hidden=64, layers=4, max_positions=1024, init=0.3))

    def drafter_config(domino: bool) -> DFlashConfig:
        head = DominoHeadConfig(emb_dim=32, gru_hidden_dim=64) if domino else None
        return DFlashConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=256, num_target_layers=4,
                            target_layer_ids=(0, 2), mask_token_id=255, block_size=8, shift_label=domino, domino=head)

    drafters = {"dflash": DFlashDrafter.random(drafter_config(False), dtype=torch.float64, seed=1),
                "domino": DominoDrafter.random(drafter_config(True), dtype=torch.float64, seed=2)}
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 255, (int(torch.randint(8, 40, (), generator=gen)),), generator=gen)
               for _ in range(args.prompts)]
    return target, drafters, prompts, "tiny-qwen3-float64"


def embedded_setup(args: argparse.Namespace):
    """The embedded SmolLM2 (bf16), its drafters, and chat-encoded prompts from treespec.apps.data.datasets."""
    from treespec.apps.assembly.embedded import load_embedded
    from treespec.apps.data.datasets import encode_chat, load_prompts

    model, tokenizer = load_embedded(getattr(torch, args.dtype))
    drafters = {kind: load_drafter(kind, getattr(args, kind), model, tokenizer, args.random_drafters) for kind in KINDS}
    per_dataset = math.ceil(args.prompts / len(args.datasets))
    records = [r for name in args.datasets for r in load_prompts(name, limit=per_dataset)][:args.prompts]
    prompts = [torch.tensor(encode_chat(tokenizer, r.turns[:1]), dtype=torch.int64) for r in records]
    return TargetModel(model), drafters, prompts, f"smollm2-135m-instruct-{args.dtype}"


def load_drafter(kind: str, path: Path | None, model, tokenizer, random_fallback: bool):
    from treespec import registry

    path = path or embedded_drafter_dir(kind)
    if path.is_dir():
        return registry.resolve("drafter", kind).from_pretrained(path)
    if not random_fallback:
        raise SystemExit(f"no {kind} checkpoint at {path}: pass --{kind} DIR, --random-drafters or --tiny")
    from treespec.drafters.training import TRAIN_PRESETS, new_drafter

    mask = next(t for t in (tokenizer.unk_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None)
    print(f"{kind}: no checkpoint at {path}; an untrained drafter of the smollm2-{kind} shape stands in")
    return new_drafter(model, TRAIN_PRESETS[f"smollm2-{kind}"], mask)


# ---------------------------------------------------------------------------- measuring
def live_run(session: Session, method, prompts, n: int) -> tuple[float, list[list[int]], list[list[int]]]:
    """(seconds, per-prompt taus, per-prompt tokens) of the live decoder over every prompt."""
    decoder = session.decoder(method)
    decoder.generate(prompts[0], max_new_tokens=min(n, 8))  # warm-up, not timed
    taus, tokens, seconds = [], [], 0.0
    for prompt in prompts:
        start = time.perf_counter()
        out = decoder.generate(prompt, max_new_tokens=n)
        seconds += time.perf_counter() - start
        taus.append(out.stats.taus)
        tokens.append(out.tokens.tolist())
    return seconds, taus, tokens


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def report_row(name, live_s, replay_s, live_taus, replayed, same_output: list[bool]) -> str:
    live_mean = statistics.fmean(t for taus in live_taus for t in taus)
    equal = [list(a) == list(b) for a, b in zip(live_taus, replayed.taus, strict=True)]
    n, on_trajectory = len(live_taus), sum(same_output)
    both = sum(e and s for e, s in zip(equal, same_output, strict=True))
    return (f"{name:<20} {live_s:>8.2f} {replay_s:>8.3f} {live_s / replay_s:>7.1f}x {live_mean:>8.3f} "
            f"{replayed.mean_tau:>8.3f}   {sum(equal):>3}/{n:<3} {on_trajectory:>5}/{n:<3} {both:>5}/{on_trajectory}")


def main() -> None:
    args = parse_args()
    if args.threads:
        ThreadControl.start(args.threads)
    target, drafters, prompts, name = tiny_setup(args) if args.tiny else embedded_setup(args)
    config = attrs.evolve(RECORD_PRESETS[args.preset], max_new_tokens=args.max_new_tokens)
    session = Session(target, None, drafters, name)
    trace, record_s = timed(record_trace, session, prompts, config=config, progress=True)
    path = args.trace or Path(tempfile.mkdtemp()) / "trace.safetensors"
    _, save_s = timed(trace.save, path)
    trace, load_s = timed(Trace.load, path)
    _, parts_s = timed(lambda: [ReplayDrafts.of(trace, kind) for kind in trace.drafters])
    print(f"{name}: {len(prompts)} prompts x {args.max_new_tokens} tokens; record {record_s:.1f} s, save "
          f"{save_s:.2f} s, load {load_s:.2f} s + {parts_s:.2f} s; trace {path.stat().st_size / 2**20:.1f} MiB")
    print(f"{'method':<20} {'live s':>8} {'replay s':>8} {'ratio':>8} {'tau live':>8} {'replay':>8}   "
          f"{'tau =':>7} {'out = AR':>9} {'tau = | out = AR':>14}")
    live_total = replay_total = 0.0
    for text in args.methods:
        method = parse_method(text)
        live_s, live_taus, tokens = live_run(session, method, prompts, args.max_new_tokens)
        replayed = evaluate(trace, [method])[0]
        same = [t == trace.sequences[i][prompts[i].numel():].tolist() for i, t in enumerate(tokens)]
        print(report_row(text, live_s, replayed.seconds, live_taus, replayed, same), flush=True)
        live_total, replay_total = live_total + live_s, replay_total + replayed.seconds
    print(f"{'all methods':<20} {live_total:>8.2f} {replay_total:>8.3f} {live_total / replay_total:>7.1f}x")


if __name__ == "__main__":
    main()
