"""Lossless end to end, for every registered policy.

* T = 0: the output of every policy at budgets 1, 16 and 128 equals AR greedy decoding of the same
  float64 tiny random target (Qwen3 and Llama), token for token.  The drafter is the oracle (the
  target's greedy continuation, corrupted under a fixed seed), so acceptances are long and trees
  deep.  The default run covers every (policy, budget) pair on a rotating slice of the 20 prompts
  x 200 tokens; ``-m slow`` runs all 20 prompts for every pair on both models.
* T > 0, position-keyed: speculative output equals AR output for the same seed, for every policy.
* T > 0, not keyed: the joint distribution of the first two generated tokens under each policy
  passes a chi-square test against the target's exact distribution at ALPHA; the same test detects
  the bias of min(1, p/q) acceptance on deterministic drafts (a top-1 chain, a top-k tree).
* After many rounds the decoder's compacted KV cache equals a fresh prefill of the same tokens.
"""

from __future__ import annotations

import inspect
import statistics
from typing import ClassVar

import pytest
import torch
from test_target import hf_greedy, random_prompts, tiny_model, tiny_target
from test_verifiers import ALPHA, chi_square_pvalue
from transformers import DynamicCache

from treespec import registry
from treespec.decoding import SpeculativeDecoder
from treespec.drafters.oracle import GreedyContinuations, OracleConfig, OracleDrafter
from treespec.interfaces import DraftOutput, Proposals, SamplingParams, Verifier, VerifyResult
from treespec.policies.chain import Chain
from treespec.pricing.cost import LinearCost
from treespec.sampling import filter_logits, sample_from_probs
from treespec.engines.torch import TargetModel
from treespec.tree import DraftTree
from treespec.verifiers.match import check_logits
from treespec.verifiers.rejection import RejectionVerifier

POLICIES = registry.available("policy")
# what each policy declares it needs: a scorer ("required": over the conditional drafter only)
USES_SCORER = {name: registry.resolve("policy", name).uses_scorer for name in POLICIES}
# a machine where trees pay (GPU-like: a verified token costs 0.2% of a forward); see the
# no-pay test below for one where they do not
PAYING = LinearCost(draft=0.001, base=0.05, per_token=1e-4)
BUDGETS = (1, 16, 128)
N_PROMPTS, N_TOKENS = 20, 200
SWEEP_PROMPTS = 8  # of them per policy, budget and family in the slow tier's full sweep (about 10 minutes of CI)
# the truth is top-1 80% of the time and a near miss (ranks 1-3) 17%: long chains, and trees catch the misses
ORACLE = OracleConfig(depth=8, top1=0.8, near=0.17, decay=0.98, tap_layers=(0, 2), check_features=True)


def arms() -> list[tuple[str, bool]]:
    """(policy, conditional drafter?) pairs: chains run over both drafter kinds (~DFlash, ~Domino)."""
    out = []
    for name in POLICIES:
        kinds = {"never": (False,), "optional": (False, True), "required": (True,)}[USES_SCORER[name]]
        out += [(name, conditional) for conditional in kinds]
    return out


ARMS = arms()


def arm_id(arm: tuple[str, bool]) -> str:
    return f"{arm[0]}-{'conditional' if arm[1] else 'marginal'}"


def make_policy(name: str, budget: int):
    """The registered policy at ``budget`` (policies without a budget parameter take their default)."""
    cls = registry.resolve("policy", name)
    accepts = inspect.signature(cls).parameters
    kwargs = {"cost_model": PAYING} if cls.uses_cost_model else {}
    return cls(budget=budget, **kwargs) if "budget" in accepts else cls(**kwargs)


def deepest(policy) -> int:
    """The deepest node a policy's trees can hold here: a fixed shape's deepest node (a static tree's
    kept choices, Sequoia's DP tree at the budget), else the draft's depth."""
    choices = getattr(policy, "choices", None)
    if choices is not None:
        return max(len(c) for c in choices[:policy.budget])
    if hasattr(policy, "acceptance"):
        from treespec.policies.sequoia import optimal_trees

        return max(len(c) for c in optimal_trees(policy.acceptance, policy.budget + 1, ORACLE.depth)[1][-1])
    return ORACLE.depth


def make_drafter(conditional: bool, continuations: GreedyContinuations | None = None) -> OracleDrafter:
    return OracleDrafter(ORACLE, conditional=conditional, continuations=continuations)


# ---------------------------------------------------------------------------- T = 0: equality with AR
class Greedy:
    """Tiny float64 targets with their AR references, computed once per module."""

    def __init__(self) -> None:
        self.targets = {family: tiny_target(family) for family in ("qwen3", "llama")}
        # one oracle memory per target: each prompt's greedy continuation is computed once for all arms
        self.continuations = {family: GreedyContinuations(t) for family, t in self.targets.items()}
        self.prompts = random_prompts(N_PROMPTS, 128, seed=123)
        self._refs: dict[tuple[str, int], list[int]] = {}
        self.taus: dict[tuple, list[int]] = {}

    def reference(self, family: str, i: int) -> list[int]:
        if (family, i) not in self._refs:
            self._refs[family, i] = hf_greedy(self.targets[family].model, self.prompts[i], N_TOKENS)
        return self._refs[family, i]

    def check(self, family: str, arm: tuple[str, bool], budget: int, prompt_ids: list[int]) -> list[int]:
        target = self.targets[family]
        drafter = make_drafter(arm[1], self.continuations[family])
        decoder = SpeculativeDecoder(target, drafter, make_policy(arm[0], budget))
        taus = []
        for i in prompt_ids:
            out = decoder.generate(self.prompts[i], max_new_tokens=N_TOKENS)
            assert out.tokens.tolist() == self.reference(family, i), f"{arm_id(arm)}@{budget} prompt {i}"
            taus += out.stats.taus
        self.taus[family, arm, budget] = taus
        return taus


@pytest.fixture(scope="module")
def greedy():
    return Greedy()


def _slice(index: int, size: int = 1) -> list[int]:
    start = (index * size) % N_PROMPTS
    return [(start + j) % N_PROMPTS for j in range(size)]


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("arm", ARMS, ids=arm_id)
def test_greedy_output_equals_autoregressive(greedy, arm, budget):
    index = ARMS.index(arm) * len(BUDGETS) + BUDGETS.index(budget)
    family = ("qwen3", "llama")[index % 2]
    taus = greedy.check(family, arm, budget, _slice(index))
    limit = 2 if budget == 1 else ORACLE.depth + 1
    assert max(taus) <= limit
    if budget >= 16:  # long acceptances were exercised, as deep as the policy's trees reach
        assert statistics.fmean(taus) > 2.0 and max(taus) >= min(6, deepest(make_policy(arm[0], budget)))
    print(f"{arm_id(arm)}@{budget} {family}: mean tau {statistics.fmean(taus):.2f} over {len(taus)} rounds")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("arm", ARMS, ids=arm_id)
def test_greedy_output_equals_autoregressive_full_sweep(greedy, arm, budget, family):
    taus = greedy.check(family, arm, budget, list(range(SWEEP_PROMPTS)))
    print(f"{arm_id(arm)}@{budget} {family}: mean tau {statistics.fmean(taus):.2f} over {len(taus)} rounds")


@pytest.mark.parametrize("arm", ARMS, ids=arm_id)
def test_networkx_backend_gives_the_same_rounds(greedy, arm):
    target, prompt = greedy.targets["llama"], greedy.prompts[3]
    runs = [SpeculativeDecoder(target, make_drafter(arm[1], greedy.continuations["llama"]),
                               make_policy(arm[0], 16).with_backend(backend))
            .generate(prompt, max_new_tokens=40) for backend in ("torch", "networkx")]
    assert runs[0].tokens.tolist() == runs[1].tokens.tolist() == greedy.reference("llama", 3)[:40]
    assert runs[0].stats.taus == runs[1].stats.taus
    assert [r.tree_size for r in runs[0].stats.rounds] == [r.tree_size for r in runs[1].stats.rounds]


@pytest.mark.parametrize(("name", "conditional"), [("caddtree", False), ("cost-aware-dominotree", True)])
def test_when_no_tree_pays_the_decoder_does_not_draft_and_stays_lossless(greedy, name, conditional):
    """Every verified token costing an AR step (a compute-bound verify): no tree could pay even fully
    accepted, so the cost-aware policies decode without drafting at all, generation after generation, and
    the output is the target's (the controller itself: tests/test_control.py)."""
    costly = LinearCost(draft=0.01, base=0.0, per_token=0.07)
    target, prompt = greedy.targets["qwen3"], greedy.prompts[5]
    policy = registry.create("policy", name, budget=16, cost_model=costly)
    decoder = SpeculativeDecoder(target, make_drafter(conditional, greedy.continuations["qwen3"]), policy)
    for _ in range(2):
        out = decoder.generate(prompt, max_new_tokens=N_TOKENS)
        assert out.tokens.tolist() == greedy.reference("qwen3", 5)
        assert set(out.stats.taus) == {1} and len(out.stats.rounds) == N_TOKENS and out.stats.undrafted
        assert not any("draft" in r.times for r in out.stats.rounds)


# ---------------------------------------------------------------------------- T > 0, keyed: equality
@pytest.mark.parametrize("arm", ARMS, ids=arm_id)
def test_position_keyed_sampling_equals_autoregressive(greedy, arm):
    target = greedy.targets["qwen3"]
    decoder = SpeculativeDecoder(target, make_drafter(arm[1], greedy.continuations["qwen3"]), make_policy(arm[0], 16))
    ar = SpeculativeDecoder(target)
    for seed, (top_k, top_p) in enumerate([(20, 1.0), (0, 0.9)]):
        kwargs = {"max_new_tokens": 60, "temperature": 0.8, "top_k": top_k, "top_p": top_p}
        want = ar.generate(greedy.prompts[seed], generator=torch.Generator().manual_seed(seed), **kwargs)
        got = decoder.generate(greedy.prompts[seed], generator=torch.Generator().manual_seed(seed), **kwargs)
        assert got.tokens.tolist() == want.tokens.tolist()
        assert got.stats.mean_tau > 1.0


# ---------------------------------------------------------------------------- T > 0: distribution tests
class SmallVocab:
    """A V = 8 target and the exact law of its first two tokens after a fixed prompt."""

    PROMPT = torch.tensor([3, 1, 4, 1, 5])
    TEMPERATURE = 1.0

    def __init__(self) -> None:
        self.target = TargetModel(tiny_model("qwen3", vocab=8, hidden=16, layers=1, seed=7, init=0.3))
        model, v = self.target.model, 8
        with torch.inference_mode():
            first = model(self.PROMPT[None]).logits[0, -1]
            pairs = torch.cat([self.PROMPT.expand(v, -1), torch.arange(v)[:, None]], dim=1)  # [V, P + 1]
            second = model(pairs).logits[:, -1]  # [V, V]
        p1 = (first / self.TEMPERATURE).softmax(-1)
        self.joint = p1[:, None] * (second / self.TEMPERATURE).softmax(-1)  # [V, V] P(t1, t2)

    def pvalue(self, decoder: SpeculativeDecoder, n: int) -> float:
        counts = torch.zeros(8, 8)
        for seed in range(n):
            out = decoder.generate(self.PROMPT, max_new_tokens=3, temperature=self.TEMPERATURE,
                                   position_keyed=False, generator=torch.Generator().manual_seed(seed))
            counts[out.tokens[0], out.tokens[1]] += 1
        return chi_square_pvalue(counts, self.joint)


@pytest.fixture(scope="module")
def small():
    return SmallVocab()


def _small_drafter(conditional: bool) -> OracleDrafter:
    # flat draft rows (sharpness 0.5): q is far from p, which is what makes min(1, p/q) visibly biased
    return OracleDrafter(OracleConfig(depth=2, top1=0.7, near=0.3, sharpness=0.5, confidence=0.0), conditional=conditional)


N_SEEDS = 200  # per test by default; the slow variant uses 3000 (the biases below give p < 1e-100 at 200)


@pytest.mark.parametrize("arm", ARMS, ids=arm_id)
def test_first_tokens_follow_the_target_distribution(small, arm):
    decoder = SpeculativeDecoder(small.target, _small_drafter(arm[1]), make_policy(arm[0], 16))
    assert small.pvalue(decoder, N_SEEDS) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("budget", [4, 16])
@pytest.mark.parametrize("arm", ARMS, ids=arm_id)
def test_first_tokens_follow_the_target_distribution_many_seeds(small, arm, budget):
    decoder = SpeculativeDecoder(small.target, _small_drafter(arm[1]), make_policy(arm[0], budget))
    assert small.pvalue(decoder, 3000) > ALPHA


def test_autoregressive_sampling_passes_the_same_test(small):
    assert small.pvalue(SpeculativeDecoder(small.target), N_SEEDS) > ALPHA


@pytest.mark.parametrize("conditional", [False, True], ids=["marginal", "conditional"])
def test_the_rejection_verifier_as_the_cli_builds_it_passes(small, conditional):
    """`--verifier rejection` is registry.create("verifier", "rejection"): the point proposal by default.
    It verifies chains only, so with every built-in policy the reachable pairs are match x every
    policy (the test above) and rejection x chain over either drafter (this one)."""
    verifier = registry.create("verifier", "rejection")
    assert verifier.proposal == "point"
    decoder = SpeculativeDecoder(small.target, _small_drafter(conditional), make_policy("chain", 16), verifier)
    assert small.pvalue(decoder, N_SEEDS) > ALPHA


def test_leviathan_acceptance_on_a_deterministic_chain_is_refused_and_is_biased(small):
    """The old default (proposal="draft") over the argmax chain: refused, and measurably biased."""
    with pytest.raises(ValueError, match="lossless only for trees sampled from the draft"):
        SpeculativeDecoder(small.target, _small_drafter(False), make_policy("chain", 16), RejectionVerifier("draft"))

    class ClaimsSampled(Chain):  # a false claim: the chain is the draft's argmax, not a sample
        samples_from_draft: ClassVar[bool] = True

        def sample(self, draft, *, sampling, seed):
            tree = self.build(draft)
            rows = torch.log_softmax(draft.logprobs.double(), -1)[tree.depths.clamp_max(draft.depth - 1)]  # [N, V]
            return tree, Proposals(torch.arange(draft.vocab_size).expand(len(tree), -1), rows, seed)

    decoder = SpeculativeDecoder(small.target, _small_drafter(False), ClaimsSampled(budget=16),
                                 RejectionVerifier("draft"))
    assert small.pvalue(decoder, N_SEEDS) < ALPHA  # the same test the lossless pairs pass


class NaiveTreeRejection(Verifier):
    """min(1, p/q) down a tree, children tried in order with residual updates (SpecInfer-style).

    Lossless for children drawn i.i.d. from q; applied to a deterministic top-k tree it is biased.
    Test-only: it exists to show that the distribution test catches that bias.
    """

    def verify(self, tree: DraftTree, target_logits: torch.Tensor, *, sampling: SamplingParams,
               generator: torch.Generator | None, position: int, draft: DraftOutput | None = None, proposals: Proposals | None = None) -> VerifyResult:
        check_logits(tree, target_logits)
        p_rows = filter_logits(target_logits.double() / sampling.temperature).softmax(-1)  # [N, V]
        q_rows = draft.logprobs.double().softmax(-1)  # [L, V]
        tokens, path = tree.tokens.tolist(), [0]
        while True:
            node = path[-1]
            p, q = p_rows[node].clone(), q_rows[min(int(tree.depths[node]), q_rows.shape[0] - 1)]
            child = self._try_children(tree.children[node], tokens, p, q, generator)
            if child is None:
                return VerifyResult(torch.tensor(path), sample_from_probs(p, generator))
            path.append(child)

    @staticmethod
    def _try_children(children, tokens, p, q, generator):
        for c in children:
            x = tokens[c]
            if float(torch.rand((), dtype=torch.float64, generator=generator)) < min(1.0, float(p[x] / q[x])):
                return c
            p.copy_((p - q).clamp_min(0.0))  # residual for the next sibling (p updated in place)
            p /= p.sum()
        return None


def test_min_p_over_q_on_a_deterministic_top_k_tree_is_detected(small):
    decoder = SpeculativeDecoder(small.target, _small_drafter(False), make_policy("ddtree", 16), NaiveTreeRejection())
    assert small.pvalue(decoder, N_SEEDS) < ALPHA


# ---------------------------------------------------------------------------- the KV cache after many rounds
def test_decoder_cache_equals_fresh_prefill_after_many_rounds(greedy):
    target = greedy.targets["llama"]  # test_target.py compacts both families directly
    prompt = greedy.prompts[0]
    decoder = SpeculativeDecoder(target, make_drafter(True), make_policy("dominotree", 16))
    out = decoder.generate(prompt, max_new_tokens=240 - prompt.numel(), temperature=0.7,
                           generator=torch.Generator().manual_seed(0))
    assert len(out.stats.rounds) > 30
    committed = torch.cat([prompt, out.tokens])
    assert target.cache_length() == target.length == committed.numel() - 1  # all but the last bonus
    fresh = DynamicCache(config=target.config)
    with torch.inference_mode():
        target.model(committed[None, :-1], cache=fresh, use_cache=True)
    for mine, ref in zip(target.cache.layers, fresh.layers, strict=True):
        torch.testing.assert_close(mine.keys, ref.keys)
        torch.testing.assert_close(mine.values, ref.values)


def test_every_policy_refuses_a_budget_below_one():
    for name in POLICIES:
        cls = registry.resolve("policy", name)
        if "budget" in inspect.signature(cls).parameters:
            with pytest.raises(ValueError, match="budget"):
                cls(budget=0)
