"""The losslessness check of a bench run: every response against AR's, and AR's margin where they differ.

Contract
--------
Every response that differs from AR's gets a `Divergence` giving the first differing position and
AR's decision margin there (`decision_gap`: the logits' top-two gap at T = 0; at T > 0 that of the
position-keyed Gumbel-max scores, in logit units), on AR's own numeric path (the prompt prefilled, then
one-token steps through AR's tokens).  It is acceptable only when the margin is within the stated
tolerance: the target's own (`treespec.target.Target.numerics`, measured; 0 where the target's trees
equal its one-token steps bit for bit, so that any difference fails) or the config's.
`lossless_text` writes the verdict per temperature for the report.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs
import torch

from treespec.apps.bench.config import BenchConfig
from treespec.apps.bench.records import BenchRecord
from treespec.apps.bench.summary import AR
from treespec.interfaces import SamplingParams
from treespec.sampling import gumbel_noise, sampling_key, work_dtype
from treespec.target import Target
from treespec.tree import DraftTree

__all__ = ["Divergence", "ar_logits", "decision_gap", "find_divergence", "first_difference", "lossless_text",
           "read_divergences", "resolve_tolerance", "token_comparable", "write_jsonl"]


@attrs.frozen
class Divergence:
    """A response that differs from AR's, with AR's decision margin where it first does."""

    method: str  # the diverging method
    dataset: str
    prompt_id: str
    turn: int
    temperature: float
    position: int  # index of the first differing generated token
    ar_token: int | None  # AR's token there (None: AR's answer ended before)
    method_token: int | None  # the method's token there (None: its answer ended before)
    gap: float  # AR's decision margin at that position (`decision_gap`, logit units)
    tolerance: float  # the stated tolerance the gap is judged against

    @property
    def acceptable(self) -> bool:
        return self.gap <= self.tolerance

    def describe(self) -> str:
        verdict = "within tolerance" if self.acceptable else "BEYOND TOLERANCE: not lossless"
        return (f"{self.method} {self.dataset}/{self.prompt_id} turn {self.turn} T={self.temperature:g}: first "
                f"difference at token {self.position} (AR {self.ar_token}, {self.method} {self.method_token}); "
                f"AR top-two gap {self.gap:.3g} vs tolerance {self.tolerance:g}: {verdict}")


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token lists differ (a length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def ar_logits(target: Target, prompt: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """[1, V]: the logits AR decided its token after ``prompt`` [P] and ``tokens`` with: the prompt prefilled
    but for its last token, then one-token steps, as AR's own decoder ran them (a fresh forward of the whole
    prefix would round otherwise).  The target's cache is left holding the prefix."""
    ids = [int(t) for t in prompt.reshape(-1).tolist()] + [int(t) for t in tokens]
    target.prefill(torch.tensor(ids[:prompt.numel() - 1], dtype=torch.int64))
    logits = None
    for token in ids[prompt.numel() - 1:]:
        logits = target.forward_tree(DraftTree.root_only(token)).logits[:1]
        target.commit(torch.zeros(1, dtype=torch.int64))
    return logits


def decision_gap(target: Target, prompt: torch.Tensor, tokens: Sequence[int], temperature: float, seed: int) -> float:
    """Top-1 minus top-2 of the scores AR chose its token after ``prompt`` [P] and its ``tokens`` by, in logit
    units, on AR's own numeric path (`ar_logits`).

    T = 0: the logits.  T > 0: T * (logits / T + G) = logits + T * G, with G the position-keyed Gumbel
    noise of that position under ``seed`` (Gumbel-max picks the argmax of logits / T + G); scaling by T
    keeps one rounding tolerance valid at every temperature.
    """
    logits = ar_logits(target, prompt, tokens)  # [1, V]
    position = prompt.numel() + len(tokens)  # of the token chosen
    scores = logits.double()
    if temperature > 0:
        generator = torch.Generator().manual_seed(seed)
        sampling = SamplingParams(temperature, key=sampling_key(generator))  # the key the decoder drew
        noise = gumbel_noise(torch.tensor([position]), logits.shape[-1], sampling, generator, logits.device,
                             work_dtype(logits))  # [1, V], the noise of the token's absolute position
        scores = (logits.to(noise.dtype) / temperature + noise).double() * temperature
    top = scores[0].topk(2).values
    return float(top[0] - top[1])


def resolve_tolerance(config: BenchConfig, target: Target, tree_tokens: int = 17) -> float:
    """The config's gap tolerance, else the target's own for trees of up to ``tree_tokens`` tokens
    (`treespec.target.Target.numerics`)."""
    return config.gap_tolerance if config.gap_tolerance is not None else target.numerics(tree_tokens).tolerance


def find_divergence(target: Target, prompt: torch.Tensor, ar: BenchRecord, rec: BenchRecord,
                    tolerance: float) -> Divergence | None:
    """The `Divergence` of ``rec`` from the AR record of the same turn (``prompt`` [P] its ids), or None."""
    k = first_difference(ar.tokens, rec.tokens)
    if k is None:
        return None
    gap = decision_gap(target, prompt.cpu(), ar.tokens[:k], rec.temperature, rec.seed)
    return Divergence(rec.method, rec.dataset, rec.prompt_id, rec.turn, rec.temperature, k, _token_at(ar.tokens, k),
                      _token_at(rec.tokens, k), gap, tolerance)


def _token_at(tokens: Sequence[int], k: int) -> int | None:
    return tokens[k] if k < len(tokens) else None


def read_divergences(path: Path) -> list[Divergence]:
    if not path.is_file():
        return []
    with open(path) as fh:
        return [Divergence(**json.loads(line)) for line in fh if line.strip()]


def write_jsonl(fh, rows: Iterable) -> None:
    for row in rows:
        fh.write(json.dumps(attrs.asdict(row), sort_keys=True) + "\n")
    fh.flush()


def _ar_index(records: Sequence[BenchRecord]) -> dict[tuple, BenchRecord]:
    return {r.key: r for r in records if r.method == AR}


_LOSSLESS_INTRO = (
    "Every method's output must equal AR's: at T = 0, and at T > 0 too (position-keyed sampling, paired "
    "seeds) under a verifier that commits AR's own draws (match verification). On an engine's exact path "
    "(a tree's logits equal to one-token steps bit for bit, as measured) every output equals AR's and any "
    "difference fails; elsewhere a divergence is acceptable only where AR's own decision margin at the first "
    "differing token (top-two gap of the logits, at T > 0 of logits + T x Gumbel noise) is within the "
    "target's measured tolerance.")


def token_comparable(record: BenchRecord) -> bool:
    """Whether ``record`` must equal AR's output token for token: at T = 0 always; at T > 0 when its
    verifier commits AR's own position-keyed draws (``reproduces_ar_samples``: match verification).
    Other verifiers at T > 0 (rejection sampling) only sample from the target's distribution, which
    `treespec.apps.kit.exactness` tests; their outputs are not compared with AR's."""
    from treespec import registry

    return record.temperature == 0.0 or bool(getattr(registry.resolve("verifier", record.verifier),
                                                     "reproduces_ar_samples", False))


def _lossless_section(temperature: float, records: Sequence[BenchRecord], ar: dict[tuple, BenchRecord],
                      measured: dict[tuple, Divergence]) -> tuple[list[str], int]:
    """Markdown lines listing every response of one temperature that differs from AR's; unacceptable count."""
    lines, bad = [f"### T = {temperature:g}", ""], 0
    compared = [r for r in records if token_comparable(r)]
    distributional = sorted({f"{r.method}" for r in records if not token_comparable(r)})
    if distributional:
        lines += [f"{len(records) - len(compared)} responses of {', '.join(distributional)} are not compared with "
                  "AR's: their verifier samples from the target's distribution without reproducing AR's draws "
                  "(exact in distribution: treespec.apps.kit.exactness, docs/sampling.md).", ""]
    differing = [r for r in compared if r.hash != ar[r.key].hash]
    for r in differing:
        d = measured.get((r.method, *r.key))
        bad += d is None or not d.acceptable
        unmeasured = f"{r.method} {r.dataset}/{r.prompt_id} turn {r.turn}: differs from AR, gap not measured"
        lines.append(f"- {d.describe() if d else unmeasured}")
    lines += [""] if differing else []
    if not differing:
        lines += [f"all {len(compared)} outputs equal AR's token for token.", ""]
    else:
        count = f"{len(differing)} of {len(compared)} responses differ from AR's; "
        lines += [count + f"{len(differing) - bad} within the stated tolerance, {bad} not.", ""]
    return lines, bad


def lossless_text(records: Sequence[BenchRecord], divergences: Sequence[Divergence]) -> tuple[str, int]:
    """Markdown of the check against AR per temperature, and the count of unacceptable divergences."""
    ar = _ar_index(records)
    measured = {(d.method, d.dataset, d.temperature, d.prompt_id, d.turn): d for d in divergences}
    lines, bad = ["## Losslessness: equality with AR", "", _LOSSLESS_INTRO, ""], 0
    for temperature in sorted({r.temperature for r in records}):
        compared = [r for r in records if r.temperature == temperature and r.method != AR and r.key in ar]
        section, n_bad = _lossless_section(temperature, compared, ar, measured)
        lines, bad = lines + section, bad + n_bad
    return "\n".join(lines), bad
