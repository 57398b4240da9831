"""Exactness at T > 0, measured: does a (policy, verifier) pair commit tokens with the target's law?

Contract
--------
``check_exactness(policy, verifier, sampling, samples=20000)`` runs one decoding round many times
in a small synthetic world and compares the law of the first two committed tokens with the
target's own, by a chi-square goodness-of-fit test.  The world (`ToyWorld`): a vocabulary of
V = 5, a target whose next-token logits are a seeded random function of the whole path (so every
node of a tree sees its own distribution), and one draft of depth 3 from the registry's
``toy-conditional`` drafter (its marginals for factorized policies, its path-dependent scorer for
conditional ones), deliberately unlike the target so that bias shows.  Each sample builds the
round's tree as `SpeculativeDecoder` does (sampled with a fresh seed when the policy samples from
the draft), verifies it against the world's logits at every node, and, when the round commits
fewer than two tokens, draws the rest from the target itself (the next round's law whatever it
drafts).  The exact law is p(t1) p(t2 | t1) under the same temperature and filters.

The report gives the statistic, its degrees of freedom, the p-value, the observed total-variation
distance from the exact law, and the smallest total variation the test detects with power 0.9 at
its ``alpha`` (mass moved between the two likeliest cells, the hardest placement; Patnaik's
approximation of the non-central chi-square).  `chi_square_pvalue` is the shared test: cells
expected below 5 are pooled, and a count in a zero-probability cell gives p = 0.
"""

from __future__ import annotations

import math

import attrs
import torch

from treespec import registry
from treespec.decoding import policy_tree
from treespec.interfaces import DraftContext, DraftOutput, SamplingParams, TreePolicy, Verifier
from treespec.sampling import mix_seed, sample_from_probs, sampling_key, target_probs

__all__ = ["ExactnessReport", "ToyWorld", "check_exactness", "chi_square_pvalue", "detectable_tv"]

ALPHA = 1e-3  # significance of the test


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Goodness of fit of ``counts`` to ``probs`` (flattened); cells expected < 5 are pooled."""
    return _chi_square(counts, probs, min_expected)[2]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int, float]:
    counts, probs = counts.flatten().to(torch.float64), probs.flatten().to(torch.float64)
    if bool((counts[probs == 0] > 0).any()):
        return math.inf, 0, 0.0
    expected = probs * counts.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = obs.numel() - 1
    return stat, dof, _upper_tail(stat, dof)


def _upper_tail(stat: float, dof: float) -> float:
    """P(chi2_dof > stat)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _critical(dof: int, alpha: float) -> float:
    lo, hi = 0.0, 10.0 * dof + 100.0
    for _ in range(200):  # bisection on the upper tail
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _upper_tail(mid, dof) > alpha else (lo, mid)
    return hi


def _power(lam: float, dof: int, critical: float) -> float:
    # Patnaik: chi2'(k, lam) ~ c chi2(h), c = (k + 2 lam) / (k + lam), h = (k + lam)^2 / (k + 2 lam)
    c, h = (dof + 2 * lam) / (dof + lam), (dof + lam) ** 2 / (dof + 2 * lam)
    return _upper_tail(critical / c, h)


def detectable_tv(probs: torch.Tensor, samples: int, dof: int, alpha: float = ALPHA, power: float = 0.9) -> float:
    """The smallest TV distance detected with ``power``: mass moved between the two likeliest cells."""
    top = probs.flatten().to(torch.float64).topk(2).values
    inv = float(1 / top[0] + 1 / top[1])
    critical = _critical(max(dof, 1), alpha)
    lo, hi = 0.0, float(top[1])
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _power(samples * mid * mid * inv, max(dof, 1), critical) >= power else (mid, hi)
    return hi


@attrs.frozen
class ExactnessReport:
    """One pair's test (see the module docstring)."""

    statistic: float  # chi-square statistic
    dof: int  # its degrees of freedom (after pooling)
    pvalue: float  # P(a statistic this large | exact)
    samples: int  # rounds run
    tv: float  # observed total-variation distance from the exact law
    detectable_tv: float  # TV detected with power 0.9 at alpha
    mean_tau: float  # mean committed tokens of the round itself

    def exact(self, alpha: float = ALPHA) -> bool:
        return self.pvalue > alpha


class ToyWorld:
    """A V = 5 target whose logits are a seeded function of the path, and one draft of depth 3."""

    def __init__(self, seed: int = 0, vocab: int = 5, depth: int = 3, scale: float = 1.5) -> None:
        self.seed, self.vocab, self.scale = seed, vocab, scale
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}
        drafter = registry.create("drafter", "toy-conditional", seed=seed + 11, vocab_size=vocab, depth=depth,
                                  logit_scale=1.0, correction_gain=3.0)
        self.draft: DraftOutput = drafter.draft(DraftContext(torch.tensor([1, 2, 0]), None))

    def logits(self, path: tuple[int, ...]) -> torch.Tensor:
        """[V] float64 target logits after the root and ``path``."""
        if path not in self._logits:
            key = self.seed
            for token in path:
                key = mix_seed(key, token + 1)
            gen = torch.Generator().manual_seed(key)
            self._logits[path] = torch.randn(self.vocab, dtype=torch.float64, generator=gen) * self.scale
        return self._logits[path]

    def probs(self, path: tuple[int, ...], sampling: SamplingParams) -> torch.Tensor:
        return target_probs(self.logits(path)[None], sampling)[0]

    def joint(self, sampling: SamplingParams) -> torch.Tensor:
        """[V, V] the exact law of the first two tokens."""
        first = self.probs((), sampling)
        return torch.stack([first[t] * self.probs((t,), sampling) for t in range(self.vocab)])

    def first_two(self, policy: TreePolicy, verifier: Verifier, sampling: SamplingParams,
                  gen: torch.Generator) -> tuple[int, int, int]:
        """One round's first two committed tokens (completed from the target) and its tau."""
        if sampling.position_keyed:  # a fresh noise key, as each generation draws one
            sampling = attrs.evolve(sampling, key=sampling_key(gen))
        tree, proposals = policy_tree(policy, self.draft, sampling, gen)
        tokens = tree.tokens.tolist()
        paths = [tuple(tokens[i] for i in tree.path(node)[1:]) for node in range(len(tree))]
        logits = torch.stack([self.logits(path) for path in paths])  # [N, V]
        result = verifier.verify(tree, logits, sampling=sampling, generator=gen, position=1, draft=self.draft,
                                 proposals=proposals)
        committed = [tokens[i] for i in result.accepted.tolist()[1:]] + [result.bonus_token]
        if len(committed) < 2:
            committed.append(sample_from_probs(self.probs((committed[0],), sampling), gen))
        return committed[0], committed[1], result.tau


def check_exactness(policy: TreePolicy, verifier: Verifier, sampling: SamplingParams, *, samples: int = 20000,
                    seed: int = 0, world: ToyWorld | None = None) -> ExactnessReport:
    """Chi-square test of the first two committed tokens against the target's law (module docstring)."""
    if sampling.greedy:
        raise ValueError("check_exactness tests temperature > 0 (at T = 0 compare with greedy decoding)")
    world = world or ToyWorld()
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(world.vocab, world.vocab, dtype=torch.float64)
    taus = 0
    for _ in range(samples):
        a, b, tau = world.first_two(policy, verifier, sampling, gen)
        counts[a, b] += 1
        taus += tau
    joint = world.joint(sampling)
    stat, dof, pvalue = _chi_square(counts, joint)
    tv = float((counts / samples - joint).abs().sum() / 2)
    return ExactnessReport(stat, dof, pvalue, samples, tv, detectable_tv(joint, samples, dof), taus / samples)
