"""First-token total-variation distance from the target at T > 0: the sanity column of the sampling
A/B on the embedded default (docs/sampling.md).

For each prompt (the first turns of the A/B's datasets, the first ``--prompts`` of each), the
target's law p of the first new token (softmax(logits / T) after top-p) is computed exactly from the
root's logits.  Each method then answers the prompt's first round ``--samples`` times with fresh
randomness (the generator seeded k; the drafter's output is the same every time, a sampled policy
draws a new tree, the verifier new noise) and the first token it commits is counted:

    TV_i = 1/2 sum_x | count_i(x) / K - p_i(x) |        (prompt i, K samples)

Here count_i / K is compared with the law the verifier was given: the mean over the K draws of
softmax(root logits / T) of each draw's own tree forward.  In bf16 a tree forward's root logits
differ a little from the one-token forward AR runs (another kernel shape), so that law is printed
beside, as its TV from AR's law ("numerics"): a verifier is exact when its first tokens follow the
logits it verified, and the numerics column says how far those are from AR's in this dtype.

Even an exact method shows TV > 0 from K finite samples, so each row is printed beside the floor:
the TV of K draws from p itself, simulated (``--repeats`` times per prompt).  The p-value is the
share of simulated repeats whose TV summed over the prompts is at least the method's: small means the
method's first tokens are further from p than sampling noise explains.  The biased control (the
DFlash chain under rejection sampling with the draft's q as proposal, which the decoder refuses:
the chain is not sampled from q) shows that the column can fail.

    python3 benchmarks/first_token_tv.py [--prompts 4] [--samples 160] [--temperatures 0.6,1.0]
"""

from __future__ import annotations

import argparse
import time

import attrs
import torch

from treespec import registry
from treespec.apps.assembly.embedded import embedded_model_dir
from treespec.apps.assembly.loading import embedded_drafter_dir, load_drafter, load_target
from treespec.apps.assembly.methods import build_policy, parse_method
from treespec.apps.data.datasets import encode_chat, load_prompts
from treespec.decoding import SequenceState, checked_draft, cut_proposals, fitted_tree, policy_tree
from treespec.interfaces import SamplingParams
from treespec.sampling import sampling_key, target_probs
from treespec.engines.torch import crop_cache
from treespec.tree import DraftTree

METHODS = ["ddtree@16", "ddtree-sampled@16/recursive-rejection", "ddtree-sampled@16/traversal",
           "dominotree@16", "dominotree-sampled@16/recursive-rejection", "dominotree-sampled@16/traversal"]
CONTROLS = {  # biased on purpose: the draft's q used over a chain that was not sampled from it
    "control: dflash chain + rejection with the draft's q": ("dflash", "rejection", {"proposal": "draft"}),
}


@attrs.frozen
class Arm:
    """One row: a policy and a verifier over a drafter."""

    label: str
    policy: object
    verifier: object
    drafter: str  # "dflash" or "domino"


def arms(methods: list[str] = METHODS) -> list[Arm]:
    """The rows: ``methods`` (method names) and the biased control."""
    rows = []
    for text in methods:
        method = parse_method(text)
        drafter = "domino" if method.policy.startswith("domino") else "dflash"
        rows.append(Arm(text, build_policy(method), registry.create("verifier", method.verifier), drafter))
    for label, (text, verifier, options) in CONTROLS.items():
        rows.append(Arm(label, build_policy(parse_method(text)), registry.create("verifier", verifier, **options),
                        "dflash"))
    return rows


class FirstRound:
    """The first round of one prompt, run again and again on the same prefilled cache."""

    def __init__(self, target, drafter, prompt: torch.Tensor) -> None:
        self.target, self.drafter = target, drafter
        self.taps = tuple(drafter.tap_layers)
        drafter.bind(target)
        drafter.reset()
        prefill = target.prefill(prompt[:-1], self.taps)
        self.seq = SequenceState.start(prompt, 64, frozenset())
        self.seq.features = prefill.features
        self.draft = checked_draft(drafter.draft(self.seq.context()), target)
        root = target.forward_tree(DraftTree.root_only(self.seq.anchor, device=target.device), self.taps)
        self.root_logits = root.logits[:1].float()  # [1, V]
        crop_cache(target.cache, target.length)
        self.fixed = {}  # label -> (tree, proposals, logits) of a deterministic policy: one forward serves every draw

    def law(self, sampling: SamplingParams) -> torch.Tensor:
        """[V] the target's law of the first new token."""
        return target_probs(self.root_logits, sampling)[0].double()

    def first_token(self, arm: Arm, sampling: SamplingParams, seed: int) -> tuple[int, torch.Tensor]:
        """The first token ``arm`` commits in the round drawn with the generator seeded ``seed``, and
        the law [V] of the first new token by the root logits of that round's tree forward."""
        generator = torch.Generator().manual_seed(seed)
        sampling = attrs.evolve(sampling, key=sampling_key(generator))
        fitted, proposals, logits = self.fixed.get(arm.label) or self._tree(arm, sampling, generator)
        result = arm.verifier.verify(fitted, logits, sampling=sampling, generator=generator,
                                     position=self.seq.anchor_position + 1, draft=self.draft, proposals=proposals)
        first = int(fitted.tokens[result.accepted[1]]) if result.accepted.numel() > 1 else result.bonus_token
        return first, target_probs(logits[:1].float(), sampling)[0].double()

    def _tree(self, arm: Arm, sampling: SamplingParams, generator: torch.Generator):
        """(tree, proposals, the target's logits [N, V]) of one draw of ``arm``'s policy."""
        tree, proposals = policy_tree(arm.policy, self.draft, sampling, generator)
        fitted = fitted_tree(tree, self.seq, self.target)
        proposals = cut_proposals(proposals, tree, fitted)
        logits = self.target.forward_tree(fitted, self.taps).logits
        crop_cache(self.target.cache, self.target.length)  # the prefix again, for the next draw
        if not arm.policy.samples_from_draft:
            self.fixed[arm.label] = fitted, proposals, logits
        return fitted, proposals, logits


def tv(counts: torch.Tensor, law: torch.Tensor) -> torch.Tensor:
    """Total-variation distance of ``counts`` [..., V] (normalised per row) from ``law`` [V]."""
    return (counts / counts.sum(-1, keepdim=True) - law).abs().sum(-1) / 2


def floor(law: torch.Tensor, samples: int, repeats: int, generator: torch.Generator) -> torch.Tensor:
    """[repeats] TV of ``samples`` draws from ``law`` itself, one value per simulated repeat."""
    draws = torch.multinomial(law.float(), samples * repeats, replacement=True, generator=generator)
    counts = torch.zeros(repeats, law.numel(), dtype=torch.float64)
    counts.scatter_add_(1, draws.view(repeats, samples), torch.ones(repeats, samples, dtype=torch.float64))
    return tv(counts, law)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="first-turn prompts per dataset")
    parser.add_argument("--samples", type=int, default=160, help="first rounds per prompt and method (K)")
    parser.add_argument("--repeats", type=int, default=400, help="simulated repeats of the floor per prompt")
    parser.add_argument("--temperatures", default="0.6,1.0")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--dtype", default="auto", help="the target's dtype (auto: the faster here)")
    parser.add_argument("--datasets", default="gsm8k,humaneval,mt-bench,alpaca")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated methods (the control always runs)")
    args = parser.parse_args()
    if args.prompts < 1 or args.samples < 1 or args.repeats < 1:
        parser.error("--prompts, --samples and --repeats must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    model_dir = embedded_model_dir()
    target = load_target(model_dir, dtype=args.dtype)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    drafters = {kind: load_drafter(embedded_drafter_dir(kind)) for kind in ("dflash", "domino")}
    prompts = [torch.tensor(encode_chat(tokenizer, record.turns[:1])) for name in args.datasets.split(",")
               for record in load_prompts(name, limit=args.prompts)]
    rows = arms(args.methods.split(","))
    print(f"{len(prompts)} prompts, K = {args.samples} first rounds each; {torch.get_num_threads()} threads, "
          f"target {target.dtype}")
    for temperature in (float(t) for t in args.temperatures.split(",")):
        start = time.perf_counter()
        observed, numerics, floor_sums = measure(args, target, drafters, prompts, rows,
                                                 SamplingParams(temperature, 0, args.top_p))
        print(f"\nT = {temperature}, top-p {args.top_p} ({time.perf_counter() - start:.0f} s): floor (K draws "
              f"from p itself) mean TV {float(floor_sums.mean()) / len(prompts):.3f}")
        print("| method | mean first-token TV | floor | p-value | numerics |")
        print("|---|---|---|---|---|")
        for arm in rows:
            total = sum(observed[arm.label])
            pvalue = float((floor_sums >= total).double().mean())
            print(f"| {arm.label} | {total / len(prompts):.3f} | {float(floor_sums.mean()) / len(prompts):.3f} | "
                  f"{pvalue:.3f} | {sum(numerics[arm.label]) / len(prompts):.4f} |", flush=True)


def measure(args, target, drafters, prompts, rows, sampling: SamplingParams):
    """Per arm, each prompt's TV of K first tokens from the verified root law, and that law's TV from
    AR's (the numerics); and [repeats] floors summed over the prompts (K draws from p itself)."""
    observed = {arm.label: [] for arm in rows}
    numerics = {arm.label: [] for arm in rows}  # TV of the verified root law from AR's
    floors = []
    for i, prompt in enumerate(prompts):
        for kind in ("dflash", "domino"):
            first = FirstRound(target, drafters[kind], prompt)
            law = first.law(sampling)
            for arm in (a for a in rows if a.drafter == kind):
                counts, verified = torch.zeros_like(law), torch.zeros_like(law)
                for k in range(args.samples):
                    token, root_law = first.first_token(arm, sampling, seed=1_000_003 * i + k)
                    counts[token] += 1
                    verified += root_law / args.samples
                observed[arm.label].append(float(tv(counts, verified)))
                numerics[arm.label].append(float(tv(verified, law)))
        floors.append(floor(law, args.samples, args.repeats, torch.Generator().manual_seed(i)))
    return observed, numerics, torch.stack(floors).sum(0)


if __name__ == "__main__":
    main()
