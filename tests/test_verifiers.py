"""Sampling and verifiers on synthetic logits: walks, filters, keyed noise, rejection sampling.

Statistical tests are chi-square goodness-of-fit tests at significance ALPHA = 1e-3 against the
exact distribution; every seed is fixed, so each test's outcome is reproducible.
"""

from __future__ import annotations

import pytest
import torch

from treespec.apps.kit.exactness import chi_square_pvalue
from treespec.interfaces import DraftOutput, SamplingParams
from treespec.sampling import filter_logits, mix_seed, target_tokens
from treespec.tree import DraftTree
from treespec.verifiers.match import MatchVerifier
from treespec.verifiers.rejection import RejectionVerifier

ALPHA = 1e-3  # significance level of every distribution test


def test_chi_square_helper_accepts_a_fair_die_and_rejects_a_loaded_one():
    gen = torch.Generator().manual_seed(0)
    probs = torch.full((6,), 1 / 6)
    fair = torch.bincount(torch.multinomial(probs, 3000, True, generator=gen), minlength=6)
    loaded = torch.bincount(torch.multinomial(torch.tensor([.25, .15, .15, .15, .15, .15]), 3000, True,
                                              generator=gen), minlength=6)
    assert chi_square_pvalue(fair, probs) > ALPHA
    assert chi_square_pvalue(loaded, probs) < ALPHA


# ---------------------------------------------------------------------------- match verification
def _logits_choosing(choices: list[int], vocab: int = 10) -> torch.Tensor:
    """[N, V] logits whose argmax at row i is choices[i]."""
    out = torch.zeros(len(choices), vocab, dtype=torch.float64)
    out[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return out


GREEDY = SamplingParams()


def test_match_walks_while_the_target_token_is_a_child():
    #        0(root 7)
    #      /    \
    #   1(3)    2(4)
    #   /  \      \
    # 3(5) 4(6)   5(8)
    tree = DraftTree.build([7, 3, 4, 5, 6, 8], [-1, 0, 0, 1, 1, 2])
    result = MatchVerifier().verify(tree, _logits_choosing([4, 5, 8, 1, 1, 9]), sampling=GREEDY,
                                    generator=None, position=10)
    assert result.accepted.tolist() == [0, 2, 5] and result.bonus_token == 9 and result.tau == 3
    result = MatchVerifier().verify(tree, _logits_choosing([2, 5, 8, 1, 1, 9]), sampling=GREEDY,
                                    generator=None, position=10)
    assert result.accepted.tolist() == [0] and result.bonus_token == 2


def test_match_takes_the_first_of_two_equal_siblings():
    tree = DraftTree.build([7, 3, 3, 5], [-1, 0, 0, 2])
    result = MatchVerifier().verify(tree, _logits_choosing([3, 1, 5, 2]), sampling=GREEDY, generator=None, position=0)
    assert result.accepted.tolist() == [0, 1] and result.bonus_token == 1


def test_match_clear_errors():
    tree = DraftTree.chain(1, [2, 3])
    verifier = MatchVerifier()
    with pytest.raises(ValueError, match="must be \\[N=3, V\\]"):
        verifier.verify(tree, torch.zeros(2, 10), sampling=GREEDY, generator=None, position=0)
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        verifier.verify(DraftTree.chain(1, [12]), torch.zeros(2, 10), sampling=GREEDY, generator=None, position=0)
    bad = torch.zeros(3, 10)
    bad[1, 4] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN at tree nodes \\[1\\]"):
        verifier.verify(tree, bad, sampling=GREEDY, generator=None, position=0)
    with pytest.raises(ValueError, match="explicit torch.Generator"):
        verifier.verify(tree, torch.zeros(3, 10), sampling=SamplingParams(temperature=1.0), generator=None,
                        position=0)


# ---------------------------------------------------------------------------- sampling
def test_filters_keep_top_k_and_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.05, 0.3, 0.15]]))
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[True, False, True, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.8)).tolist() == [[True, False, True, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.81)).tolist() == [[True, False, True, True]]
    assert torch.isfinite(filter_logits(logits, top_p=0.1)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(filter_logits(logits, top_k=3, top_p=0.6)).tolist() == [[True, False, True, False]]


def test_mix_seed_is_deterministic_and_separates_positions():
    seeds = {mix_seed(s, p) for s in range(20) for p in range(50)}
    assert len(seeds) == 1000 and all(0 <= x < 2**63 for x in seeds)
    assert mix_seed(3, 7) == mix_seed(3, 7)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7)])
@pytest.mark.parametrize("keyed", [True, False])
def test_sampled_tokens_follow_the_filtered_softmax(top_k, top_p, keyed):
    logits = torch.tensor([1.0, 0.2, -0.5, 0.7, 0.0, -1.0], dtype=torch.float64)
    sampling = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, position_keyed=keyed)
    probs = filter_logits(logits[None] / 0.8, top_k, top_p).softmax(-1)[0]
    n = 3000
    if keyed:  # one draw per seed, as each generation would make
        draws = [int(target_tokens(logits[None], torch.tensor([5]), sampling, torch.Generator().manual_seed(s)))
                 for s in range(n)]
        draws = torch.tensor(draws)
    else:  # one stream, many rows
        draws = target_tokens(logits.expand(n, -1), torch.zeros(n, dtype=torch.int64), sampling,
                              torch.Generator().manual_seed(0))
    assert chi_square_pvalue(torch.bincount(draws, minlength=6), probs) > ALPHA


def test_keyed_noise_is_shared_by_nodes_at_one_position_and_reproducible():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(1, 50, generator=gen).expand(6, -1)
    sampling = SamplingParams(temperature=1.0)
    positions = torch.tensor([3, 4, 4, 5, 5, 5])
    first = target_tokens(logits, positions, sampling, torch.Generator().manual_seed(9))
    again = target_tokens(logits, positions, sampling, torch.Generator().manual_seed(9))
    assert torch.equal(first, again)
    assert first[1] == first[2] and first[3] == first[4] == first[5]
    many = target_tokens(torch.zeros(40, 50), torch.arange(40), sampling, torch.Generator().manual_seed(9))
    assert many.unique().numel() > 20  # positions get independent noise


# ---------------------------------------------------------------------------- rejection sampling
P_ROWS = torch.tensor([[0.45, 0.25, 0.15, 0.1, 0.05], [0.1, 0.2, 0.4, 0.2, 0.1], [0.3, 0.3, 0.2, 0.1, 0.1]],
                      dtype=torch.float64)  # the target's next-token distribution after each node (context-free)
Q_ROWS = torch.tensor([[0.3, 0.4, 0.1, 0.1, 0.1], [0.25, 0.25, 0.3, 0.1, 0.1]])  # draft rows, depths 1 and 2
T1 = SamplingParams(temperature=1.0, position_keyed=False)


def _draft(root: int = 0) -> DraftOutput:
    return DraftOutput(Q_ROWS.log().to(torch.float32), root_token=root)


def _first_two_tokens(verifier, chain_tokens, seed: int) -> tuple[int, int]:
    """First two committed tokens of one round over the context-free target (next round simulated)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = chain_tokens(gen)
    lp = Q_ROWS.log().to(torch.float32)[torch.arange(len(tokens)), torch.tensor(tokens)]
    tree = DraftTree.chain(0, tokens, lp)
    result = verifier.verify(tree, P_ROWS.log()[: len(tree)], sampling=T1, generator=gen, position=1,
                             draft=_draft())
    committed = tree.tokens[result.accepted[1:]].tolist() + [result.bonus_token]
    if len(committed) < 2:  # the next round's first token: a plain draw from the target
        committed.append(int(torch.multinomial(P_ROWS[1], 1, generator=gen)))
    return committed[0], committed[1]


def _pair_pvalue(verifier, chain_tokens, n: int = 2000) -> float:
    counts = torch.zeros(5, 5)
    for seed in range(n):
        a, b = _first_two_tokens(verifier, chain_tokens, seed)
        counts[a, b] += 1
    return chi_square_pvalue(counts, P_ROWS[0][:, None] * P_ROWS[1][None, :])


def _sampled_chain(gen: torch.Generator) -> list[int]:
    return [int(torch.multinomial(Q_ROWS[d].double(), 1, generator=gen)) for d in range(2)]


def _greedy_chain(gen: torch.Generator) -> list[int]:
    return Q_ROWS.argmax(-1).tolist()


def test_leviathan_is_lossless_on_chains_sampled_from_the_draft():
    assert _pair_pvalue(RejectionVerifier("draft"), _sampled_chain) > ALPHA


def test_point_proposal_is_lossless_on_deterministic_chains():
    assert _pair_pvalue(RejectionVerifier("point"), _greedy_chain) > ALPHA


def test_leviathan_on_a_deterministic_chain_is_detected_as_biased():
    # the chain always proposes token 1 (q = 0.4, p = 0.25): min(1, p/q) accepts it w.p. 0.625, and the
    # residual max(p - q, 0) never yields it, so P(first token = 1) = 0.625 instead of the target's 0.25.
    assert _pair_pvalue(RejectionVerifier("draft"), _greedy_chain) < ALPHA


def test_rejection_greedy_equals_match_and_clear_errors():
    tree = DraftTree.chain(0, [1, 2], Q_ROWS.log().to(torch.float32)[[0, 1], [1, 2]])
    logits = _logits_choosing([1, 3, 0], vocab=5)
    for proposal in ("draft", "point"):
        result = RejectionVerifier(proposal).verify(tree, logits, sampling=GREEDY, generator=None, position=0,
                                                    draft=_draft())
        assert result.accepted.tolist() == [0, 1] and result.bonus_token == 3
    with pytest.raises(ValueError, match="needs a chain"):
        RejectionVerifier().verify(DraftTree.build([0, 1, 2], [-1, 0, 0]), logits, sampling=T1,
                                   generator=torch.Generator(), position=0)
    with pytest.raises(ValueError, match="pass draft="):
        RejectionVerifier("draft").verify(tree, logits, sampling=T1, generator=torch.Generator(), position=0)
    rescored = DraftTree.chain(0, [1, 2], [-0.1, -0.2])
    with pytest.raises(ValueError, match="not the draft's base log-probs"):
        RejectionVerifier("draft").verify(rescored, logits, sampling=T1, generator=torch.Generator(), position=0,
                                   draft=_draft())
    with pytest.raises(ValueError, match="proposal must be one of"):
        RejectionVerifier("soft")
