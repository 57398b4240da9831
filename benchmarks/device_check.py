"""The checks to run when a CUDA machine is lent: captured builds against eager, and training on the GPU.

1. **CUDA-graph builds.**  For B = 16 / 64 / 256, `treespec.policies.engine.cuda_graph.GraphedBuild` against the
   eager static build, bit for bit over several fresh rounds, and the build time per round of both
   (median, synchronised): DDTree over random marginals (V = 151,936, L = 16) and DominoTree over
   random Qwen3-4B-sized Domino parts (H 2,560, G 1,024, E 256; M = 64, 8 children per node).
2. **Stacked builds.**  S = 8 drafts' trees in one stacked build on the GPU against their single
   builds, and the time of both.
3. **The drafter pipeline on the GPU.**  On a random target of SmolLM2-135M's shape (no network:
   the target is made here): its self-distillation data (one continuous batch on the GPU, tokens
   per second), ``treespec teacher-cache --device cuda`` over it, then ``treespec train-drafter
   --device cuda`` from that cache for a few minutes, printing the time of each stage and per step.

4. **End-to-end decoding.**  A random Qwen3-4B-shaped target (bf16) with random DFlash and Domino
   drafters (block 16, one layer, the Domino head at G 1,024 / E 256) on the GPU: AR and every
   registered policy (budget 16; cost-aware ones priced by their own live cost model over a fresh
   profile) on a few prompts at T = 0, each output checked against AR's token for token, the
   stage times per round printed; then the live cost curve after 50 rounds beside the profile.

    python benchmarks/device_check.py                  # on the CUDA machine, about 10 minutes
    python benchmarks/device_check.py --cpu-dry-run    # every code path at tiny sizes, no capture
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_build import SIZES, DominoParts, marginal_draft

from treespec.interfaces import DraftOutput
from treespec.policies.ddtree import DDTree
from treespec.policies.dominotree import DominoTree

DEPTH = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", nargs="+", type=int, default=[16, 64, 256])
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds per cell (median)")
    parser.add_argument("--train-steps", type=int, default=300, help="train-drafter steps (part 3)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on the CPU, graphs skipped")
    parser.add_argument("--skip", nargs="*", default=[], choices=["graphs", "stacked", "train", "decode"])
    parser.add_argument("--decode-tokens", type=int, default=48, help="new tokens per prompt (part 4)")
    return parser.parse_args()


def on(draft: DraftOutput, device: str) -> DraftOutput:
    """A marginal draft moved to ``device`` (scorer drafts are made on their device)."""
    return DraftOutput(logprobs=draft.logprobs.to(device), root_token=draft.root_token, position=draft.position)


def timed_ms(fn, rounds: int, device: str) -> float:
    times = []
    for _ in range(rounds):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


class Cases:
    """Fresh rounds for each policy at the machine's sizes."""

    def __init__(self, device: str, dry: bool) -> None:
        self.device = device
        self.vocab = 300 if dry else 151936
        sizes = {"hidden": 24, "gru": 8, "rank": 6} if dry else SIZES[151936]
        self.parts = DominoParts(self.vocab, **sizes, scale=4.0)
        for module in (self.parts.gru, self.parts.proj, self.parts.embed):
            module.to(device)

    def marginal(self, seed: int) -> DraftOutput:
        return on(marginal_draft(self.vocab, 4.0, seed, DEPTH), self.device)

    def domino(self, seed: int) -> DraftOutput:
        draft = self.parts.draft(seed, DEPTH)
        scorer = draft.scorer.with_round_inputs({k: v.to(self.device) for k, v in draft.scorer.round_inputs().items()})
        return DraftOutput(logprobs=draft.logprobs.to(self.device), root_token=draft.root_token, scorer=scorer)


def check_graphs(cases: Cases, args: argparse.Namespace) -> None:
    from treespec.policies.engine.cuda_graph import GraphedBuild

    print("\n## 1. CUDA-graph builds against eager (static mode), ms per round")
    print("| policy | B | eager ms | graph ms | eager / graph | identical rounds |")
    print("|---|---|---|---|---|---|")
    for budget in args.budgets:
        for name, policy, make in (("ddtree", DDTree(budget=budget), cases.marginal),
                                   ("dominotree", DominoTree(budget=budget), cases.domino)):
            first = make(0)
            start = time.perf_counter()
            graphed = GraphedBuild(policy, first.depth, first.vocab_size, scorer=first.scorer)
            capture_s = time.perf_counter() - start
            drafts = [make(seed) for seed in range(1, 6)]
            same = sum(graphed.build(d).equal(policy.build_torch(d, static=True)) for d in drafts)
            eager = timed_ms(lambda: policy.build_torch(drafts[0], static=True), args.rounds, cases.device)
            replay = timed_ms(lambda: graphed.build(drafts[0]), args.rounds, cases.device)
            print(f"| {name} | {budget} | {eager:.2f} | {replay:.2f} | {eager / replay:.1f}x | {same}/{len(drafts)} "
                  f"(capture {capture_s:.1f} s) |", flush=True)


def check_stacked(cases: Cases, args: argparse.Namespace, size: int = 8) -> None:
    print(f"\n## 2. {size} drafts' trees in one stacked build against {size} single builds, ms per batch")
    print("| policy | B | single builds ms | stacked ms | identical trees |")
    print("|---|---|---|---|---|")
    for budget in args.budgets:
        for name, policy, make in (("ddtree", DDTree(budget=budget), cases.marginal),
                                   ("dominotree", DominoTree(budget=budget), cases.domino)):
            drafts = [make(100 + i) for i in range(size)]
            stacked = policy.build_batch(drafts)  # off the CPU the drafts always grow together
            same = sum(a.equal(policy.build_torch(d, static=True)) for a, d in zip(stacked, drafts, strict=True))
            single = timed_ms(lambda: [policy.build(d) for d in drafts], max(3, args.rounds // 4), cases.device)
            batch = timed_ms(lambda: policy.build_batch(drafts), max(3, args.rounds // 4), cases.device)
            print(f"| {name} | {budget} | {single:.1f} | {batch:.1f} | {same}/{size} |", flush=True)


def _timed_command(label: str, *args: str) -> float:
    """Run one treespec command to completion; its wall time in seconds."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "treespec.apps.cli", *args], check=True)
    wall = time.perf_counter() - start
    print(f"{label}: {wall:.1f} s (start-up included)", flush=True)
    return wall


def check_training(device: str, steps: int, dry: bool) -> None:
    """A random SmolLM2-shaped target, its self-distillation data, its teacher cache, then
    train-drafter from the cache, every stage on ``device``."""
    from treespec.apps.data.selfdistill import DistillConfig, iter_sequences, write_shards
    from treespec.apps.kit.tiny import tiny_causal_lm

    print(f"\n## 3. the drafter pipeline on {device}")
    sizes = dict(vocab=512, hidden=64, layers=4, heads=4, kv_heads=2) if dry else \
        dict(vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, head_dim=64)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        target = tiny_causal_lm("llama", init=0.02, dtype=torch.float32, **sizes).to(device)
        target.save_pretrained(work / "target", safe_serialization=True)
        gen = torch.Generator().manual_seed(0)
        prompts = [(f"p{i}", torch.randint(3, sizes["vocab"], (24,), generator=gen).tolist()) for i in range(256)]
        config = DistillConfig(num_prompts=len(prompts), max_new_tokens=64 if dry else 256,
                               batch_size=32 if dry else 128, shard_size=64)
        start = time.perf_counter()
        write_shards(target, prompts, work / "data", config, stop_ids=[sizes["vocab"] + 1], pad_id=0, progress=False)
        wall = time.perf_counter() - start
        tokens = sum(len(s.tokens) - s.response_start for s in iter_sequences(work / "data"))
        print(f"distill data: {len(prompts)} prompts, {tokens} tokens in {wall:.1f} s ({tokens / wall:.0f} tokens/s, "
              f"batch {config.batch_size})", flush=True)
        del target
        _timed_command("teacher cache", "teacher-cache", "--data", str(work / "data"), "--out", str(work / "cache"),
                       "--target", str(work / "target"), "--device", device)
        head = 256 if dry else 8192
        wall = _timed_command(f"train-drafter, {steps} steps", "train-drafter", "--target", str(work / "target"),
                              "--teacher", str(work / "cache"), "--out", str(work / "run"),
                              "--preset", "smollm2-domino-v8k-l1", "--mask-token-id", "0", "--device", device,
                              "--set", f"steps={steps}", "--set", "save_every=100000", "--set", "eval_every=0",
                              "--set", f"draft_vocab_size={head}")
        state = json.loads((work / "run" / "trainer_state.json").read_text())
        print(f"{state['step']} steps: {wall / max(1, state['step']):.2f} s per step, start-up included")


def _random_target(device: str, dry: bool):
    """A random target of Qwen3-4B's shape (tiny in a dry run), made on ``device``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from treespec.engines.torch import TargetModel

    sizes = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128) if dry else \
        dict(vocab_size=151936, hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
             head_dim=128, intermediate_size=9728)
    config = Qwen3Config(**sizes, max_position_embeddings=4096, initializer_range=0.02, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return TargetModel(model.to(torch.float32 if dry else torch.bfloat16).eval())


def _random_drafters(target, device: str, dry: bool) -> dict:
    from treespec.drafters.dflash import DFlashDrafter
    from treespec.drafters.domino import DominoDrafter
    from treespec.drafters.training import TrainConfig, draft_config_for

    drafters = {}
    for kind, cls in (("dflash", DFlashDrafter), ("domino", DominoDrafter)):
        cfg = TrainConfig(kind=kind, block_size=16, num_layers=1, gru_hidden_dim=32 if dry else 1024,
                          emb_dim=16 if dry else 256)
        dtype = torch.float32 if dry else torch.bfloat16
        drafters[kind] = cls.random(draft_config_for(target.config, cfg, 0), seed=1, dtype=dtype, device=device)
    return drafters


def check_decoding(device: str, dry: bool, new_tokens: int) -> None:
    """AR and every registered policy end to end on the GPU; outputs against AR; live costs after 50 rounds."""
    from treespec.pricing.profile import machine_profile

    print(f"\n## 4. end-to-end decoding on {device}")
    target = _random_target(device, dry)
    drafters = _random_drafters(target, device, dry)
    start = time.perf_counter()
    profile = machine_profile(target, list(drafters.values()), repeats=3, cache=False)
    print(f"cost profile: {time.perf_counter() - start:.1f} s; verify of 1 / 2 / 5 / 17 tokens = "
          + " / ".join(f"{profile.verify_in_steps(n):.2f}" for n in (1, 2, 5, 17)) + " AR steps", flush=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size, (64,), generator=gen) for _ in range(3)]
    lives = decode_every_method(target, drafters, profile, prompts, new_tokens)
    for name, live in lives.items():
        report_live(name, live, target, drafters, prompts, new_tokens)


def decode_every_method(target, drafters, profile, prompts, new_tokens: int) -> dict:
    """AR and every registered policy at budget 16 on ``prompts``, each output checked against AR's;
    returns the live cost models of the cost-aware methods, by method name."""
    from treespec import registry
    from treespec.apps.assembly.methods import build_policy, parse_method
    from treespec.decoding import SpeculativeDecoder
    from treespec.pricing.live_cost import LiveCost

    names = ["ar", "dflash", "domino"] + [f"{n}@16" for n in registry.available("policy") if n != "chain"]
    reference, lives = None, {}
    print("| method | tau | ms per round: draft / build / verify / commit | = AR |")
    print("|---|---|---|---|")
    for name in names:
        method = parse_method(name)
        drafter = drafters.get(method.drafter) if method.drafter else None
        pricing = ()
        if drafter is not None and registry.resolve("policy", method.policy).uses_cost_model:
            pricing = (LiveCost(profile.cost_model(drafter)),)
            lives[name] = pricing[0]
        decoder = SpeculativeDecoder(target, drafter, build_policy(method, *pricing))
        outs = [decoder.generate(p, max_new_tokens=new_tokens) for p in prompts]
        tokens = [o.tokens.tolist() for o in outs]
        reference = tokens if reference is None else reference
        rounds = [r for o in outs for r in o.stats.rounds]
        stages = " / ".join(f"{1e3 * statistics.fmean(r.times.get(k, 0.0) for r in rounds):.2f}"
                            for k in ("draft", "build", "verify", "commit"))
        tau = statistics.fmean(r.tau for r in rounds)
        same = sum(a == b for a, b in zip(tokens, reference))
        print(f"| {name} | {tau:.2f} | {stages} | {same}/{len(prompts)} |", flush=True)
        if same != len(prompts):
            raise SystemExit(f"{name}: output differs from AR's")
    return lives


def report_live(name: str, live, target, drafters, prompts, new_tokens: int) -> None:
    """Decode with ``live`` until it has 50 rounds, then its curve beside the profile's."""
    from treespec.apps.assembly.methods import build_policy, parse_method
    from treespec.decoding import SpeculativeDecoder

    method = parse_method(name)
    decoder = SpeculativeDecoder(target, drafters[method.drafter], build_policy(method, live))
    while len(live.observations) < 50:
        decoder.generate(prompts[len(live.observations) % len(prompts)], max_new_tokens=new_tokens)
    curve, prior = live.snapshot(), live.prior
    ctx = curve.contexts[0]
    row = lambda m: " / ".join(f"{1e3 * float(m.verify_cost(torch.tensor([float(n)]), ctx)[0]):.2f}"  # noqa: E731
                               for n in (1, 2, 5, 17, 33))
    print(f"{name} after {len(live.observations)} rounds ({live.refits} re-fits), verify ms at n = 1 / 2 / 5 / 17 "
          f"/ 33, ctx {ctx}: profile {row(prior)}; live {row(curve)}; support {live.support()}", flush=True)


def main() -> None:
    args = parse_args()
    device = "cpu" if args.cpu_dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; --cpu-dry-run runs the code paths on the CPU")
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)"
    print(f"device: {name}; torch {torch.__version__}")
    run_graphs = "graphs" not in args.skip and device == "cuda"
    if run_graphs or "stacked" not in args.skip:
        cases = Cases(device, args.cpu_dry_run)  # Qwen3-4B-sized parts: made only for the parts that use them
    if run_graphs:
        check_graphs(cases, args)
    if "stacked" not in args.skip:
        check_stacked(cases, args)
    if "train" not in args.skip:
        check_training(device, args.train_steps if device == "cuda" else 4, args.cpu_dry_run)
    if "decode" not in args.skip:
        check_decoding(device, args.cpu_dry_run, args.decode_tokens if device == "cuda" else 12)


if __name__ == "__main__":
    main()
