"""The Domino drafter and its batched conditional scorer on a tiny random Qwen3 target."""

from __future__ import annotations

import pytest
import torch
from test_drafters_support import VOCAB, Rounds, tiny_config, tiny_target

from treespec.drafters.domino import DominoDrafter, DominoScorer
from treespec.topk import top_set

K = 4


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def drafted(target, *, table: bool = False, prefix_len: int = 1, block_size: int = 5,
            shift_label: bool | None = None, seed: int = 0) -> tuple[DominoDrafter, object]:
    config = tiny_config(domino=True, block_size=block_size, prefix_len=prefix_len, shift_label=shift_label)
    drafter = DominoDrafter.random(config, dtype=torch.float64, seed=seed, gru_input_table=table)
    drafter.bind(target)
    return drafter, drafter.draft(Rounds(target, drafter.tap_layers).context())


def random_states(n: int, size: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).tanh()


def assert_same_expansion(a, b, *, atol: float = 1e-6) -> None:
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=atol)
    torch.testing.assert_close(a.states, b.states, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------- the draft
@pytest.mark.parametrize(("shift_label", "rows"), [(True, 5), (False, 4)])
def test_shift_label_sets_the_drafted_rows(target, shift_label, rows):
    drafter, out = drafted(target, shift_label=shift_label)
    assert out.logprobs.shape == (rows, VOCAB) and isinstance(out.scorer, DominoScorer)
    block = target.embed_tokens(torch.tensor([out.root_token] + [drafter.config.mask_token_id] * 4))
    z = drafter.model(block, torch.arange(out.position, out.position + 5), drafter.cache.layers())
    first = 0 if shift_label else 1  # shift_label: block position k predicts anchor + k + 1
    expected = torch.log_softmax(target.lm_head(z[first:]), dim=-1).float()
    torch.testing.assert_close(out.logprobs, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.logprobs.exp().sum(-1), torch.ones(rows), rtol=0, atol=1e-5)


def test_root_state_is_the_gru_after_the_anchor_embedding(target):
    drafter, out = drafted(target)
    _, h = drafter.model.prefix_gru(target.embed_tokens(torch.tensor([[out.root_token]])))
    torch.testing.assert_close(out.scorer.root_state(), h[0, 0], rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------- expand
@pytest.mark.parametrize("table", [False, True])
@pytest.mark.parametrize("top_m", [7, VOCAB])
def test_batched_expand_equals_node_by_node(target, table, top_m):
    _, out = drafted(target, table=table)
    states = random_states(6, out.scorer.state_size)
    for depth in range(out.depth):
        batched = out.scorer.expand(states, depth, top_m=top_m, k=K)
        single = [out.scorer.expand(states[i:i + 1], depth, top_m=top_m, k=K) for i in range(6)]
        assert batched.tokens.shape == batched.logprobs.shape == (6, K)
        assert batched.states.shape == (6, K, out.scorer.state_size)
        for i, one in enumerate(single):
            assert torch.equal(batched.tokens[i], one.tokens[0])
            torch.testing.assert_close(batched.logprobs[i], one.logprobs[0], rtol=0, atol=1e-6)
            torch.testing.assert_close(batched.states[i], one.states[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("prefix_len", [0, 1, 2])
def test_full_vocabulary_candidates_equal_the_reference(target, prefix_len):
    _, out = drafted(target, prefix_len=prefix_len)
    states = random_states(5, out.scorer.state_size)
    for depth in range(out.depth):
        assert_same_expansion(out.scorer.expand(states, depth, top_m=VOCAB, k=K),
                              out.scorer.expand_reference(states, depth, k=K))


def test_gru_input_table_equals_the_direct_projection(target):
    _, direct = drafted(target, table=False)
    _, tabled = drafted(target, table=True)
    states = random_states(4, direct.scorer.state_size)
    for depth in range(direct.depth):
        assert_same_expansion(direct.scorer.expand(states, depth, top_m=9, k=K),
                              tabled.scorer.expand(states, depth, top_m=9, k=K))


@pytest.mark.parametrize("prefix_len", [1, 2])
def test_pure_draft_depths_use_the_base_distribution(target, prefix_len):
    _, out = drafted(target, prefix_len=prefix_len)
    states = random_states(3, out.scorer.state_size)
    for depth in range(prefix_len):
        children = out.scorer.expand(states, depth, top_m=7, k=K)
        base = out.logprobs[depth]
        expected = torch.topk(base, K)
        for row in range(3):  # identical for every parent, whatever its path
            assert torch.equal(children.tokens[row], expected.indices)
            torch.testing.assert_close(children.logprobs[row], expected.values, rtol=0, atol=0)
    corrected = out.scorer.expand(states, prefix_len, top_m=VOCAB, k=K)
    assert not torch.allclose(corrected.logprobs[0], corrected.logprobs[1])  # path dependent beyond the prefix


def test_candidates_are_the_top_m_base_tokens_normalised_among_themselves(target):
    _, out = drafted(target)
    states = random_states(3, out.scorer.state_size)
    depth, m = 2, 7
    children = out.scorer.expand(states, depth, top_m=m, k=m)
    top_m_tokens = set(torch.topk(out.logprobs[depth], m).indices.tolist())
    for row in range(3):
        assert set(children.tokens[row].tolist()) == top_m_tokens
        torch.testing.assert_close(children.logprobs[row].logsumexp(0), torch.tensor(0.0), rtol=0, atol=1e-6)


def test_greedy_chain_matches_the_sequential_formula(target):
    """Threading child states through the depths reproduces s_i = GRU(anchor, d_1 .. d_i)."""
    drafter, out = drafted(target)
    model, scorer = drafter.model, out.scorer
    z = scorer.rows
    state, path = scorer.root_state()[None], [out.root_token]
    for depth in range(out.depth):
        child = scorer.expand(state, depth, top_m=VOCAB, k=1)
        state = child.states[:, 0]
        path.append(int(child.tokens[0, 0]))
    prefix_states, _ = model.prefix_gru(target.embed_tokens(torch.tensor([path[:-1]])))  # [1, L, G]
    for depth in range(out.depth):
        logits = target.lm_head(z[depth])
        if depth + 1 > drafter.config.domino.pure_draft_prefix_len:
            logits = logits + model.embed_proj(torch.cat([z[depth], prefix_states[0, depth]]))
        assert int(logits.argmax()) == path[depth + 1]
    _, final = model.prefix_gru(target.embed_tokens(torch.tensor([path])))
    torch.testing.assert_close(state[0], final[0, 0], rtol=0, atol=1e-10)


def test_children_are_sorted_with_ties_broken_by_token_id():
    tied_target = tiny_target(seed=5)
    with torch.no_grad():
        tied_target.lm_head.weight[9] = tied_target.lm_head.weight[3]
    drafter, out = drafted(tied_target)
    with torch.no_grad():
        drafter.model.embed_proj[2].weight[9] = drafter.model.embed_proj[2].weight[3]
    states = random_states(3, out.scorer.state_size)
    for depth in (0, 2):  # a pure-draft depth and a corrected depth
        children = out.scorer.expand(states, depth, top_m=VOCAB, k=VOCAB)
        for tokens, lps in zip(children.tokens.tolist(), children.logprobs.tolist(), strict=True):
            assert tokens.index(3) < tokens.index(9) and lps[tokens.index(3)] == lps[tokens.index(9)]
            for i in range(len(tokens) - 1):
                assert lps[i] > lps[i + 1] or (lps[i] == lps[i + 1] and tokens[i] < tokens[i + 1])


@pytest.mark.parametrize(("call", "message"), [
    (lambda s, st: s.expand(st, 5, top_m=7, k=2), r"depth 5 out of range: children exist for depths 0..4"),
    (lambda s, st: s.expand(st[:, :3], 1, top_m=7, k=2), r"states must be \[n, 20\], got \(2, 3\)"),
    (lambda s, st: s.expand(st, 2, top_m=3, k=4), "k = 4 children requested but only top_m = 3"),
    (lambda s, st: s.expand(st, 2, top_m=0, k=1), "top_m must be >= 1"),
    (lambda s, st: s.expand(st, 2, top_m=5, k=0), "k must be >= 1"),
])
def test_expand_rejects_bad_arguments(target, call, message):
    _, out = drafted(target)
    with pytest.raises(ValueError, match=message):
        call(out.scorer, random_states(2, out.scorer.state_size))


def test_deferred_children_complete_to_the_expanded_states(target):
    _, out = drafted(target, table=True)
    states = random_states(4, out.scorer.state_size)
    for depth in (0, 2):
        eager = out.scorer.expand(states, depth, top_m=7, k=K)
        deferred = out.scorer.expand_deferred(states, depth, top_m=7, k=K)
        assert torch.equal(deferred.tokens, eager.tokens) and torch.equal(deferred.logprobs, eager.logprobs)
        completed = out.scorer.advance(deferred.states.reshape(4 * K, -1)).view(4, K, -1)
        torch.testing.assert_close(completed, eager.states, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------- bf16, as released
def test_bf16_children_are_computed_as_the_released_head_computes_them():
    """bf16: W1 [z ; s] as one bf16 matmul, silu cast to float32, the last matmul in float32 on the
    gathered W2 rows, and child states from the nn.GRU module (its bits)."""
    bf16_target = tiny_target(dtype=torch.bfloat16)
    config = tiny_config(domino=True, block_size=5, prefix_len=1)
    drafter = DominoDrafter.random(config, dtype=torch.bfloat16, seed=3)
    drafter.bind(bf16_target)
    draft = drafter.draft(Rounds(bf16_target, drafter.tap_layers).context())
    scorer, m = draft.scorer, 9
    assert scorer.gru_table is None  # no input table in reduced precision: nn.GRU reads the embedding
    model = drafter.model
    root = scorer.root_state()
    _, h0 = model.prefix_gru(bf16_target.embed_tokens(torch.tensor([[draft.root_token]])))
    assert torch.equal(root, h0[0, 0])
    first = scorer.expand(root[None], 0, top_m=m, k=K)  # depth 0 is the pure-draft prefix
    states = first.states[0]  # [K, G] bf16
    out = scorer.expand(states, 1, top_m=m, k=K)
    cand = top_set(scorer.base_logits[1][None], m)[0]  # [M] ascending ids
    z = scorer.rows[1].expand(K, -1)
    hidden = model.embed_proj[1](model.embed_proj[0](torch.cat([z, states], dim=-1))).float()  # [K, E]
    corrected = scorer.base_logits[1][cand].float() + hidden @ model.embed_proj[2].weight[cand].float().T
    logprobs = torch.log_softmax(corrected, dim=-1)  # [K, M]
    order = torch.sort(logprobs, dim=-1, descending=True, stable=True).indices[:, :K]
    assert torch.equal(out.tokens, cand[order]) and torch.equal(out.logprobs, logprobs.gather(-1, order))
    emb = bf16_target.embed_tokens(out.tokens.reshape(-1))[:, None]  # [K*K, 1, H]
    _, h = model.prefix_gru(emb, states.repeat_interleave(K, dim=0)[None].contiguous())
    assert out.states.dtype == torch.bfloat16 and torch.equal(out.states, h[0].view(K, K, -1))
    pending = scorer.expand_deferred(states, 1, top_m=m, k=K)
    assert torch.equal(scorer.advance(pending.states.reshape(K * K, -1)), h[0])


# ---------------------------------------------------------------------------- round inputs (CUDA-graph capture)
@pytest.mark.parametrize("table", [False, True])
def test_a_scorer_rebuilt_from_its_round_inputs_builds_the_same_trees(target, table):
    """`with_round_inputs` over copies of `round_inputs` (a tensor anchor, as a captured graph's
    buffers hold it) is the same scorer: the same root state and every policy's tree bit for bit."""
    from treespec.interfaces import DraftOutput
    from treespec.policies.chain import Chain
    from treespec.policies.dominotree import DominoTree

    drafter, draft = drafted(target, table=table, block_size=6)
    inputs = draft.scorer.round_inputs()
    assert set(inputs) == {"rows", "base_logits", "anchor"} and inputs["anchor"].dtype == torch.int64
    rebuilt = draft.scorer.with_round_inputs({k: v.clone() for k, v in inputs.items()})
    assert torch.equal(rebuilt.root_state(), draft.scorer.root_state())
    again = DraftOutput(logprobs=draft.logprobs.clone(), root_token=draft.root_token, scorer=rebuilt)
    for policy in (DominoTree(budget=24, top_m=16, node_topk=4), Chain(top_m=16)):
        for backend in ("torch", "networkx"):
            assert policy.with_backend(backend).build(again).equal(policy.with_backend(backend).build(draft))
        assert policy.build_torch(again, static=True).equal(policy.build_torch(draft, static=True))


def test_a_replayed_round_offers_no_round_inputs(target):
    """A replayed scorer's base log-probs are given, not computed: it cannot be captured (None)."""
    _, draft = drafted(target)
    s = draft.scorer
    replayed = DominoScorer(rows=s.rows, base_logits=s.base_logits, prefix_gru=s.prefix_gru, embed_proj=s.embed_proj,
                            embed=s.embed, anchor=s.anchor, pure_draft_prefix_len=1,
                            prefix_logprobs=torch.log_softmax(s.base_logits[:1], dim=-1))
    assert replayed.round_inputs() is None
