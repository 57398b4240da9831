"""The tree rules past DominoTree, replayed on held-out prompts: τ at equal budgets, paired intervals
against DominoTree@16 and DDTree@16, build time and scorer work per round (docs/tree-rules.md).

``record`` writes the held-out trace: prompts 24 to 33 after the published shuffle (seed 0) of GSM8K,
HumanEval, MT-Bench and the Alpaca bench split -- past the first 16 of each (the demo, the drafters'
held-out sets and the other docs' traces) and the three after them (the calibration prompts), so no
drafter or policy was tuned on them -- and MT-Bench's second turns asked after the target's own
greedy answers to the first: 50 turns, ``--tokens`` greedy tokens each, on the embedded default.

``eval`` replays every method at budgets 8 / 16 / 32 (one policy per method across the turns, its
round hooks fed as the live loop feeds them), and prints per method: τ with its 95 % interval, the
paired differences from ``dominotree@16`` and ``ddtree@16`` (turns resampled together), the
median build time per round and the scorer rows expanded per round (a counting wrapper around the
draft's scorer: the GRU steps a Domino build pays); and where acceptance goes, the share of rounds
accepting at least d draft tokens.  The records (per turn, each round's τ) are written to ``--out``
and the tables derive from them alone (``table``).

    python benchmarks/bench_tree_rules.py record --out runs/trace-rules.safetensors
    python benchmarks/bench_tree_rules.py eval runs/trace-rules.safetensors     # writes docs/figures/rules/records.json
    python benchmarks/bench_tree_rules.py table docs/figures/rules/records.json  # the tables, from the records
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from treespec.apps.assembly.loading import embedded_drafter_dir
from treespec.apps.assembly.methods import build_policy, parse_method
from treespec.apps.assembly.session import Session
from treespec.apps.bench.summary import bootstrap_interval
from treespec.apps.data.datasets import encode_chat, load_prompts
from treespec.apps.replay import RecordConfig, ReplayDrafts, Trace, merge_traces, record_trace
from treespec.apps.replay.evaluate import replay_rounds
from treespec.decoding import built_tree
from treespec.interfaces import ConditionalScorer, DraftOutput, Expansion
from treespec.pricing.conditions import ThreadControl

DATASETS = ("gsm8k", "humaneval", "mt-bench", "alpaca")
HELD_OUT = slice(24, 34)  # prompts no drafter or policy was tuned on (module docstring)
METHODS = ("ddtree", "dominotree", "pruned-dominotree+rule=mass+mass=0.8", "pruned-dominotree+rule=mass+mass=0.9",
           "pruned-dominotree+rule=ratio+ratio=4.0", "pruned-dominotree+rule=ratio+ratio=16.0",
           "gap-ddtree", "learned-ddtree", "learned-dominotree", "confident-ddtree+min_rate=0.02",
           "confident-dominotree+min_rate=0.02", "confident-dominotree+min_rate=0.05", "router:domino")
BUDGETS = (8, 16, 32)
BASELINES = ("dominotree@16", "ddtree@16")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    rec = sub.add_parser("record", help="record the held-out trace")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--tokens", type=int, default=96, help="greedy tokens per turn")
    ev = sub.add_parser("eval", help="replay every rule and print the tables")
    ev.add_argument("trace", type=Path)
    ev.add_argument("--methods", nargs="+", default=list(METHODS), help="methods without a budget")
    ev.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    ev.add_argument("--resamples", type=int, default=2000)
    ev.add_argument("--out", type=Path, default=Path("docs/figures/rules/records.json"))
    tab = sub.add_parser("table", help="the tables, from the records alone")
    tab.add_argument("records", type=Path)
    return parser.parse_args()


# ---------------------------------------------------------------------------- record
def record(args: argparse.Namespace) -> None:
    parts = Session.load(None, {k: embedded_drafter_dir(k) for k in ("dflash", "domino")}, progress=True)
    tokenizer, config = parts.tokenizer, RecordConfig(max_new_tokens=args.tokens)
    first, ids, mt = [], [], []
    for name in DATASETS:
        for prompt in load_prompts(name)[HELD_OUT]:
            first.append(torch.tensor(encode_chat(tokenizer, prompt.turns[:1]), dtype=torch.int64))
            ids.append(f"{prompt.dataset}/{prompt.id}")
            if len(prompt.turns) > 1:
                mt.append((len(first) - 1, prompt))
    start = time.perf_counter()
    turn1 = record_trace(parts, first, config=config, prompt_ids=ids, progress=True,
                         parts_dir=args.out.with_suffix(".parts1"))
    second, second_ids = [], []
    for index, prompt in mt:  # turn 2 after the target's own greedy answer to turn 1, as the bench asks it
        answer = turn1.sequences[index][turn1.prompt_len(index):].tolist()
        text = tokenizer.decode(answer, skip_special_tokens=True)
        second.append(torch.tensor(encode_chat(tokenizer, prompt.turns[:2], [text]), dtype=torch.int64))
        second_ids.append(f"{prompt.dataset}/{prompt.id}/turn2")
    turn2 = record_trace(parts, second, config=config, prompt_ids=second_ids, progress=True,
                         parts_dir=args.out.with_suffix(".parts2"))
    merge_traces([turn1, turn2]).save(args.out)
    print(f"recorded {len(first) + len(second)} turns x {args.tokens} tokens in {time.perf_counter() - start:.0f} s "
          f"-> {args.out}")


# ---------------------------------------------------------------------------- eval
class Counting(ConditionalScorer):
    """A scorer that counts the parent rows it expands (each a GRU step of a Domino build)."""

    def __init__(self, inner: ConditionalScorer, tally: list[int]) -> None:
        self.inner, self.tally = inner, tally

    def root_state(self):
        return self.inner.root_state()

    def expand(self, states, depth, *, top_m, k) -> Expansion:
        self.tally[0] += states.shape[0]
        return self.inner.expand(states, depth, top_m=top_m, k=k)

    def expand_deferred(self, states, depth, *, top_m, k) -> Expansion:
        self.tally[0] += states.shape[0]
        return self.inner.expand_deferred(states, depth, top_m=top_m, k=k)

    def advance(self, pending):
        return self.inner.advance(pending)


class Measured:
    """ReplayDrafts that wrap each draft's scorer in `Counting` and time each build."""

    def __init__(self, drafts: ReplayDrafts, policy) -> None:
        self.drafts, self.policy, self.rows, self.seconds = drafts, policy, [], []

    def draft(self, index: int, anchor: int, position: int) -> DraftOutput:
        draft = self.drafts.draft(index, anchor, position)
        tally = [0]
        counted = draft if draft.scorer is None else DraftOutput(
            draft.logprobs, draft.root_token, draft.position, Counting(draft.scorer, tally))
        start = time.perf_counter()
        built_tree(self.policy, counted)  # a timed build of its own (the policy's state is not touched)
        self.seconds.append(time.perf_counter() - start)
        self.rows.append(tally[0])
        return counted


def replay_method(trace: Trace, name: str) -> tuple[list[list[int]], Measured]:
    """Per turn, the rounds' τ of one method (one policy across the turns), and what its builds cost."""
    method = parse_method(name)
    policy = build_policy(method)
    measured = Measured(ReplayDrafts.of(trace, method.drafter), policy)
    controller = policy.draft_controller()  # one over the turns, as a live decoder keeps one
    taus = [[r.tau for r in replay_rounds(trace, measured, policy, i, controller=controller)]
            for i in range(trace.num_prompts)]
    return taus, measured


def with_budget(method: str, budget: int) -> str:
    """``method`` (no budget: ``policy[+k=v...][:drafter]``) at ``budget``: ``policy@B[+k=v...][:drafter]``."""
    policy = re.match(r"[a-z0-9-]+", method).group(0)
    return f"{policy}@{budget}{method[len(policy):]}"


def per_turn(taus: list[list[int]]) -> np.ndarray:
    """[turns] tokens per round of each turn (its τ)."""
    return np.array([sum(t) / len(t) for t in taus])


def evaluate(args: argparse.Namespace) -> None:
    """Replay every method and write the records (per turn, the rounds' τ; the build costs)."""
    trace = Trace.load(args.trace)
    names = list(dict.fromkeys(list(BASELINES) + [with_budget(m, b) for m in args.methods for b in args.budgets]))
    records = {"turns": trace.num_prompts, "tokens": trace.max_new_tokens, "methods": {}}
    for name in names:
        taus, cost = replay_method(trace, name)
        records["methods"][name] = {"taus": taus, "build_ms": 1e3 * statistics.median(cost.seconds),
                                    "rows": statistics.fmean(cost.rows) if cost.rows else 0.0}
        print(f"  replayed {name}: τ {per_turn(taus).mean():.3f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records) + "\n")
    plot(records, args.out.with_name("budget_curves.svg"), args.resamples)
    print(tables(records, args.resamples))


def tables(records: dict, resamples: int = 2000) -> str:
    """The page's two tables, derived from the records alone: τ with paired intervals against the
    baselines, build time and scorer rows; and where acceptance goes, P(τ >= d + 1) by depth d."""
    methods = records["methods"]
    tau = {name: per_turn(m["taus"]) for name, m in methods.items()}
    n = records["turns"]
    lines = [f"{n} turns x {records['tokens']} tokens; paired 95 % intervals over turns", "",
             "| method | τ [95% CI] | − dominotree@16 [95% CI] | − ddtree@16 [95% CI] | build ms/round | "
             "scorer rows/round |", "|---|---|---|---|---|---|"]
    for name, m in methods.items():
        cells = [f"{tau[name].mean():.3f} [{_ci(lambda i, t=tau[name]: t[i].mean(), n, resamples)}]"]
        for base in BASELINES:
            diff = tau[name] - tau[base]
            cells.append(f"{diff.mean():+.3f} [{_ci(lambda i, d=diff: d[i].mean(), n, resamples, '+')}]")
        cells += [f"{m['build_ms']:.2f}", f"{m['rows']:.1f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| method | " + " | ".join(f"d = {d}" for d in range(1, 7)) + " |", "|---" * 7 + "|"]
    for name, m in methods.items():
        rounds = np.array([t for turn in m["taus"] for t in turn])
        lines.append(f"| {name} | " + " | ".join(f"{(rounds >= d + 1).mean():.3f}" for d in range(1, 7)) + " |")
    return "\n".join(lines) + "\n"


def plot(records: dict, path: Path, resamples: int = 2000) -> Path:
    """τ against budget per rule (a method without its budget), with 95 % intervals over turns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from treespec.apps.bench.plots import budget_axis, interval_axes, save_figure

    families: dict[str, list[tuple[int, float, float, float]]] = {}
    for name, m in records["methods"].items():
        budget = int(re.search(r"@(\d+)", name).group(1))
        tau = per_turn(m["taus"])
        lo, hi = bootstrap_interval(lambda i, t=tau: t[i].mean(), len(tau), resamples, seed=0)
        families.setdefault(re.sub(r"@\d+", "", name), []).append((budget, tau.mean(), lo, hi))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.get_cmap("tab20").colors
    for k, (family, points) in enumerate(families.items()):
        points.sort()
        b, mean, lo, hi = (np.array(v) for v in zip(*points, strict=True))
        ax.errorbar(b, mean, yerr=[mean - lo, hi - mean], marker="os^D"[k % 4], capsize=3, label=family,
                    color=colors[k % len(colors)], linestyle="-" if k < 10 else "--")
    budget_axis(ax, sorted({p[0] for pts in families.values() for p in pts}))
    interval_axes(ax, "τ (tokens per round), 95 % CI over turns", [v for pts in families.values() for p in pts
                                                                      for v in p[2:]])
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return save_figure(fig, path)


def _ci(stat, n: int, resamples: int, sign: str = "") -> str:
    lo, hi = bootstrap_interval(stat, n, resamples, seed=0)
    return f"{lo:{sign}.3f}, {hi:{sign}.3f}"


def main() -> None:
    args = parse_args()
    ThreadControl.start(1)
    if args.action == "table":
        print(tables(json.loads(args.records.read_text())), end="")
        return
    record(args) if args.action == "record" else evaluate(args)


if __name__ == "__main__":
    main()
