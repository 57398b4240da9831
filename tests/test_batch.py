"""Batched decoding: S sequences per forward, each with its own tree, every row its own output.

* `TreeBatch`: the padded mask, positions and slices equal each tree's own (hypothesis).
* `TorchBatch`: every sequence's logits and taps equal a single-sequence `TargetModel`'s, round
  after round of ragged commits, and finished sequences leave the cache.
* Drafters: ``draft_batch`` over forks equals each fork drafting alone (DFlash, Domino).
* Policies: ``build_batch`` equals one ``build`` per draft, bit for bit, both backends; the stacked
  frontier (S trees in one static build) gives every draft its own tree -- marginal lists, toy
  scorers called in turn, and the batched correction of real Domino rounds (float64), with ties,
  tiny vocabularies and per-sequence budgets (hypothesis).
* `BatchDecoder`: every row's output equals that prompt's own AR output and its own single-sequence
  speculative run, for every registered policy, S in {1, 2, 5}, float64 tiny Qwen3 and Llama, mixed
  prompt lengths and budgets, and stop tokens hit in different rounds; at T > 0 with
  position-keyed sampling, each row equals the single run with the same generator; the same with
  the first token taken from the prefill (``first_token="prefill"``) at T = 0 and T = 1.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_drafters_support import tiny_config
from test_lossless import ORACLE, PAYING, arm_id, arms
from test_policies import marginal_draft, toy_draft
from test_target import random_tree, tiny_model
from tiers import by_default

import treespec
from treespec import registry
from treespec.batch import TreeBatch
from treespec.batch_decoding import BatchDecoder
from treespec.engines.torch import TorchBatch
from treespec.decoding import SpeculativeDecoder
from treespec.drafters.dflash import DFlashDrafter
from treespec.drafters.domino import DominoDrafter, DominoStack
from treespec.drafters.oracle import OracleDrafter
from treespec.interfaces import DraftContext
from treespec.policies.engine.frontier import expand_frontier_batch, resolve_batch
from treespec.policies.engine.stacked import stack_sources
from treespec.engines.torch import TargetModel

VOCAB = 96
TAPS = (0, 2)


def prompts_of(lengths, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request) -> TargetModel:
    return TargetModel(tiny_model(request.param, vocab=VOCAB, hidden=32, layers=2, seed=5))


# ---------------------------------------------------------------------------- the packed trees
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.integers(0, 2**31))
def test_the_padded_mask_positions_and_slices_are_each_trees_own(sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(1, n, 50, gen) for n in sizes]
    lengths = torch.randint(0, 7, (len(trees),), generator=gen).tolist()
    width = max(lengths) + int(torch.randint(0, 3, (), generator=gen))
    batch = TreeBatch(trees)
    mask, positions = batch.attention_mask(lengths, width), batch.position_ids(lengths)
    lowest = torch.finfo(torch.float32).min
    for s, (tree, n, length) in enumerate(zip(trees, sizes, lengths, strict=True)):
        own = tree.attention_mask(length)[0, 0]  # [n, length + n]
        assert torch.equal(mask[s, 0, :n, :length], own[:, :length])
        assert bool((mask[s, 0, :n, length:width] == lowest).all())  # the padded cache stays hidden
        assert torch.equal(mask[s, 0, :n, width:width + n], own[:, length:])
        pad = mask[s, 0, n:]  # a padding node sees itself only
        assert all(int((row == 0).sum()) == 1 and row[width + n + i] == 0 for i, row in enumerate(pad))
        assert torch.equal(positions[s, :n], tree.position_ids(length)[0])
        assert torch.equal(batch.tokens[s, :n], tree.tokens)
    assert [t.tolist() for t in batch.split(batch.tokens)] == [t.tokens.tolist() for t in trees]
    block = batch.block_mask()
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    for tree, start, n in zip(trees, starts, sizes, strict=True):
        assert torch.equal(block[start:start + n, start:start + n], tree.ancestor_mask)
    assert int(block.sum()) == sum(int(t.ancestor_mask.sum()) for t in trees)


def test_a_batch_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="at least one tree"):
        TreeBatch([])
    batch = TreeBatch([random_tree(1, 3, 9, torch.Generator().manual_seed(0))])
    with pytest.raises(ValueError, match="2 cache lengths for a batch of 1"):
        batch.position_ids([0, 1])
    with pytest.raises(ValueError, match="exceeds the cache width"):
        batch.attention_mask([5], 4)


# ---------------------------------------------------------------------------- the target
def test_every_sequence_of_a_batch_forward_equals_its_own_forward(target):
    prompts = prompts_of((5, 1, 9, 3))
    gen = torch.Generator().manual_seed(2)
    batch = TorchBatch(target)
    features = batch.prefill(prompts, TAPS)
    singles = [TargetModel(target.model) for _ in prompts]
    for single, prompt, feats in zip(singles, prompts, features, strict=True):
        own = single.prefill(prompt[:-1], TAPS).features
        assert feats.shape == own.shape and torch.allclose(feats, own, rtol=0, atol=1e-12)
    roots = [int(p[-1]) for p in prompts]
    for _ in range(4):  # ragged rounds: trees of other sizes, paths of other lengths
        trees = [random_tree(root, int(torch.randint(1, 9, (), generator=gen)), VOCAB, gen) for root in roots]
        outs = batch.forward_trees(trees, TAPS)
        accepted = []
        for single, tree, out in zip(singles, trees, outs, strict=True):
            own = single.forward_tree(tree, TAPS)
            assert torch.allclose(out.logits, own.logits, rtol=0, atol=1e-12)
            assert torch.allclose(out.features, own.features, rtol=0, atol=1e-12)
            node = int(torch.randint(0, len(tree), (), generator=gen))
            accepted.append(torch.tensor(tree.path(node)))
            single.commit(accepted[-1])
        batch.commit(accepted)
        assert batch.lengths == [s.length for s in singles]
        roots = [int(torch.randint(0, VOCAB, (), generator=gen)) for _ in roots]
    batch.keep([3, 1])  # two sequences finish: the others go on
    trees = [random_tree(root, 4, VOCAB, gen) for root in (roots[3], roots[1])]
    outs = batch.forward_trees(trees)
    for i, tree, out in zip((3, 1), trees, outs, strict=True):
        assert torch.allclose(out.logits, singles[i].forward_tree(tree).logits, rtol=0, atol=1e-12)


def test_the_batch_target_refuses_mismatched_calls(target):
    batch = TorchBatch(target)
    with pytest.raises(RuntimeError, match="before prefill"):
        batch.forward_trees([random_tree(1, 2, VOCAB, torch.Generator())])
    batch.prefill(prompts_of((3, 4)))
    with pytest.raises(ValueError, match="1 trees for 2 sequences"):
        batch.forward_trees([random_tree(1, 2, VOCAB, torch.Generator())])
    trees = [random_tree(1, 2, VOCAB, torch.Generator()) for _ in range(2)]
    batch.forward_trees(trees)
    with pytest.raises(ValueError, match="sequence 1: accepted node 5 was not in its tree"):
        batch.commit([torch.tensor([0]), torch.tensor([0, 5])])
    with pytest.raises(ValueError, match="must start with the root"):
        batch.commit([torch.tensor([1]), torch.tensor([0])])


# ---------------------------------------------------------------------------- drafters and policies
@pytest.mark.parametrize("cls", [DFlashDrafter, DominoDrafter])
def test_a_batched_block_forward_equals_each_fork_drafting_alone(target, cls):
    config = tiny_config(domino=cls is DominoDrafter, vocab=VOCAB, hidden=32, num_target_layers=2, layer_ids=(0, 1),
                         block_size=5)
    drafter = cls.random(config, dtype=torch.float64, seed=1)
    drafter.bind(target)
    contexts = []
    for prompt in prompts_of((6, 1, 11)):
        contexts.append(DraftContext(prompt, target.prefill(prompt[:-1], drafter.tap_layers).features, 0))
    batched = drafter.draft_batch([drafter.fork() for _ in contexts], contexts)
    for ctx, out in zip(contexts, batched, strict=True):
        alone = drafter.fork().draft(ctx)
        assert torch.allclose(out.logprobs, alone.logprobs, rtol=0, atol=1e-12) and out.position == alone.position
        if cls is DominoDrafter:
            a, b = (o.scorer.expand(o.scorer.root_state()[None], 1, top_m=8, k=3) for o in (out, alone))
            assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["torch", "networkx"])
@pytest.mark.parametrize("name", registry.available("policy"))
def test_build_batch_equals_one_build_per_draft(name, backend):
    cls = registry.resolve("policy", name)
    policy = cls(budget=24, **({"cost_model": PAYING} if cls.uses_cost_model else {}))
    if cls.uses_scorer == "required":
        drafts = [toy_draft(seed, vocab_size=300, depth=5) for seed in range(8)]  # 8: the CPU stacks them
    else:
        drafts = [marginal_draft(6, 700, seed, quantum=0.5 if seed % 2 else None) for seed in range(9)]
    for tree, draft in zip(policy.with_backend(backend).build_batch(drafts), drafts, strict=True):
        assert tree.equal(policy.with_backend(backend).build(draft))


def test_build_batch_groups_drafts_of_different_depths():
    policy = make_policy("ddtree", budget=20)
    drafts = [marginal_draft(depth, 300, seed, quantum=0.5) for seed, depth in enumerate((6, 3, 6, 1, 3) * 2)]
    for tree, draft in zip(policy.build_batch(drafts), drafts, strict=True):
        assert tree.equal(policy.with_backend("networkx").build(draft))


# ---------------------------------------------------------------------------- the stacked frontier
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


def stacked_trees(policy, drafts, budgets):
    """The stacked static build of ``drafts`` at once, whatever `grow_batch` would choose on this machine."""
    candidates = [attrs.evolve(policy, budget=b).candidates(d) for d, b in zip(drafts, budgets, strict=True)]
    stack = stack_sources(resolve_batch(candidates, budgets, "static"))
    assert stack is not None, "these sources should stack"
    return expand_frontier_batch(drafts, stack, budgets, policy.stop), stack


def assert_each_own(policy, drafts, budgets) -> None:
    """Each stacked tree is its draft's own tree: networkx, compact and static builds alike."""
    trees, _ = stacked_trees(policy, drafts, budgets)
    for tree, draft, budget in zip(trees, drafts, budgets, strict=True):
        own = attrs.evolve(policy, budget=budget)
        assert tree.equal(own.with_backend("networkx").build(draft)), f"stacked tree != networkx for {own}"
        assert tree.equal(own.build(draft)), f"stacked tree != compact torch for {own}"
        assert tree.equal(own.build_torch(draft, static=True)), f"stacked tree != static torch for {own}"


@st.composite
def marginal_batches(draw):
    depth, vocab, size = draw(st.integers(1, 8)), draw(st.sampled_from((2, 5, 17, 300))), draw(st.integers(2, 5))
    quantum = draw(st.sampled_from([None, 0.25, 1.0]))  # quantised logits force ties
    seeds = draw(st.lists(st.integers(0, 2**31), min_size=size, max_size=size))
    return [marginal_draft(depth, vocab, seed, quantum=quantum) for seed in seeds]


@settings(max_examples=60, **SETTINGS)
@given(marginal_batches(), st.sampled_from(["ddtree", "caddtree"]), st.one_of(st.integers(1, 40), st.just(128)))
def test_stacked_marginal_trees_are_each_drafts_own_tree(drafts, name, budget):
    assert_each_own(make_policy(name), drafts, [budget] * len(drafts))


@settings(max_examples=40, **SETTINGS)
@given(marginal_batches(), st.data())
def test_stacked_trees_of_different_budgets_are_each_drafts_own_tree(drafts, data):
    budgets = data.draw(st.lists(st.integers(1, 10), min_size=len(drafts), max_size=len(drafts)))
    assert_each_own(make_policy("chain"), drafts, budgets)


@st.composite
def toy_batches(draw):
    vocab = draw(st.sampled_from((2, 5, 40, 300)))
    config = {"vocab_size": vocab, "depth": draw(st.integers(1, 8)),
              "pure_draft_prefix_len": draw(st.integers(0, 2)), "quantum": draw(st.sampled_from([None, 1.0, 4.0])),
              "correction_rows": draw(st.sampled_from([None, 1, 3]))}
    seeds = draw(st.lists(st.integers(0, 2**31), min_size=2, max_size=5))
    top_m = draw(st.sampled_from([1, 4, 64, vocab]))
    node_topk = draw(st.integers(1, max(1, min(8, top_m))))
    return [toy_draft(seed, **config) for seed in seeds], top_m, node_topk


@settings(max_examples=40, **SETTINGS)
@given(toy_batches(), st.one_of(st.integers(1, 40), st.just(100)))
def test_stacked_scorer_trees_are_each_drafts_own_tree(batch, budget):
    drafts, top_m, node_topk = batch
    policy = registry.resolve("policy", "dominotree")(budget=budget, top_m=top_m, node_topk=node_topk)
    assert_each_own(policy, drafts, [budget] * len(drafts))


def test_the_domino_stack_gives_every_round_its_own_scorers_tree(target):
    """One batched correction for S real Domino rounds, in float64 (in float32 a matmul's rounding
    depends on how many rows it is given, so no two build shapes need agree in the last bit)."""
    config = tiny_config(domino=True, vocab=VOCAB, hidden=32, num_target_layers=2, layer_ids=(0, 1), block_size=7)
    drafter = DominoDrafter.random(config, dtype=torch.float64, seed=3)
    drafter.bind(target)
    contexts = [DraftContext(p, target.prefill(p[:-1], drafter.tap_layers).features, 0)
                for p in prompts_of((9, 2, 14, 5))]
    drafts = drafter.draft_batch([drafter.fork() for _ in contexts], contexts)
    for name, budget in (("dominotree", 24), ("dominotree", 64), ("chain", 6)):
        widths = {"top_m": 16} if name == "chain" else {"top_m": 16, "node_topk": 4}
        policy = registry.resolve("policy", name)(budget=budget, **widths)
        _, stack = stacked_trees(policy, drafts, [budget] * len(drafts))
        assert isinstance(stack.scorer, DominoStack)
        assert_each_own(policy, drafts, [budget] * len(drafts))


# ---------------------------------------------------------------------------- the decoding loop
def make_policy(name: str, budget: int = 16):
    cls = registry.resolve("policy", name)
    return cls(budget=budget, **({"cost_model": PAYING} if cls.uses_cost_model else {}))


def stop_token(ar_tokens: list[list[int]]) -> int:
    """A token at which the answers end after the most different lengths (some early, some late or never)."""
    def ends(token: int) -> tuple[int, ...]:
        return tuple(t.index(token) + 1 if token in t else len(t) for t in ar_tokens)

    return max({x for t in ar_tokens for x in t}, key=lambda token: (len(set(ends(token))), min(ends(token)), -token))


@pytest.mark.parametrize("size", by_default([1, 2, 5], 5))
@pytest.mark.parametrize("arm", arms(), ids=arm_id)
def test_every_row_equals_its_own_ar_and_single_run(target, arm, size):
    name, conditional = arm
    prompts = prompts_of((7, 1, 12, 3, 9)[:size], seed=size)
    budgets = [24, 17, 30, 9, 24][:size]
    ar = [SpeculativeDecoder(target).generate(p, max_new_tokens=n, stop_token_ids=()).tokens.tolist()
          for p, n in zip(prompts, budgets, strict=True)]
    stops = [stop_token(ar)] if size > 1 else []
    expected = [next((t[:i + 1] for i, x in enumerate(t) if x in stops), t) for t in ar]  # each cut at its stop
    decoder = BatchDecoder(target, OracleDrafter(ORACLE, conditional=conditional), make_policy(name))
    out = decoder.generate(prompts, max_new_tokens=budgets, stop_token_ids=stops)
    assert [o.tokens.tolist() for o in out] == expected
    policy = make_policy(name)
    single = SpeculativeDecoder(target, OracleDrafter(ORACLE, conditional=conditional), policy)
    for prompt, n, o in zip(prompts, budgets, out, strict=True):
        alone = single.generate(prompt, max_new_tokens=n, stop_token_ids=stops)
        assert alone.tokens.tolist() == o.tokens.tolist()
        # a policy that learns from the rounds it is told of builds otherwise alone than in a batch, which tells it none
        assert alone.stats.taus == o.stats.taus or policy.learns
    if size > 1:
        assert len({len(t) for t in expected}) > 1  # sequences really left the batch in different rounds


def test_a_learning_policy_in_a_batch_learns_what_it_learns_from_the_rows_one_by_one(target):
    """Every row's round is reported to the policy: learned-dominotree (no refit during the run, so its
    trees stay put) gathers from a batch of four the acceptance counts it gathers from the same four
    prompts decoded one by one, and every row is still AR's output."""
    from treespec.policies.learned import AcceptanceTable

    prompts = prompts_of((7, 3, 11, 5), seed=9)
    made = lambda: registry.create("policy", "learned-dominotree", budget=8,  # noqa: E731
                                   table=AcceptanceTable(refit_every=10**6))
    batched, alone = made(), made()
    out = BatchDecoder(target, OracleDrafter(ORACLE, conditional=True), batched).generate(
        prompts, max_new_tokens=16, stop_token_ids=())
    single = SpeculativeDecoder(target, OracleDrafter(ORACLE, conditional=True), alone)
    for prompt, row in zip(prompts, out, strict=True):
        want = single.generate(prompt, max_new_tokens=16, stop_token_ids=())
        ar = SpeculativeDecoder(target).generate(prompt, max_new_tokens=16, stop_token_ids=())
        assert row.tokens.tolist() == want.tokens.tolist() == ar.tokens.tolist()
        assert row.stats.taus == want.stats.taus
    assert alone.table.accepted.sum() > 0 and alone.table.rounds == batched.table.rounds
    assert torch.allclose(batched.table.accepted, alone.table.accepted)
    assert torch.allclose(batched.table.expected, alone.table.expected)


def test_a_router_in_a_batch_chooses_per_request_over_shared_arms(target):
    """What belongs to one request stays with its row (`TreePolicy.for_request`): each row's router makes
    its own choice, the arms (and what they learn) are the batch's; every row is AR's output."""
    router = registry.create("policy", "router", budget=8, arms="dominotree|learned-dominotree", probe=1)
    mine = router.for_request()
    assert mine is not router and mine.choice is not router.choice and mine.policies is router.policies
    prompts = prompts_of((6, 9, 4), seed=3)
    out = BatchDecoder(target, OracleDrafter(ORACLE, conditional=True), router).generate(
        prompts, max_new_tokens=12, stop_token_ids=())
    for prompt, row in zip(prompts, out, strict=True):
        assert row.tokens.tolist() == SpeculativeDecoder(target).generate(
            prompt, max_new_tokens=12, stop_token_ids=()).tokens.tolist()
    assert router.policies[1].table.accepted.sum() > 0  # the learning arm learned from the rows' rounds
    assert router.choice.taus == [[], []]  # the batch's own router was not the rows' router


@pytest.mark.parametrize("method", ["ddtree", "dominotree", "chain"])
def test_position_keyed_sampling_gives_each_row_its_single_run(target, method):
    prompts, conditional = prompts_of((4, 10, 2), seed=7), method == "dominotree"
    seeds = (11, 12, 13)
    decoder = BatchDecoder(target, OracleDrafter(ORACLE, conditional=conditional), make_policy(method))
    out = decoder.generate(prompts, max_new_tokens=20, temperature=1.0, stop_token_ids=(),
                           generators=[torch.Generator().manual_seed(s) for s in seeds])
    for prompt, seed, o in zip(prompts, seeds, out, strict=True):
        ar = SpeculativeDecoder(target).generate(prompt, max_new_tokens=20, temperature=1.0, stop_token_ids=(),
                                                 generator=torch.Generator().manual_seed(seed))
        assert o.tokens.tolist() == ar.tokens.tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_first_token_from_the_prefill_gives_each_row_its_single_run(target, temperature):
    """first_token="prefill": one batched anchor forward; rows with one new token leave at once."""
    prompts, seeds, budgets = prompts_of((6, 1, 9), seed=4), (21, 22, 23), [14, 1, 10]
    decoder = BatchDecoder(target, OracleDrafter(ORACLE, conditional=True), make_policy("dominotree"))
    out = decoder.generate(prompts, max_new_tokens=budgets, temperature=temperature, stop_token_ids=(),
                           generators=[torch.Generator().manual_seed(s) for s in seeds], first_token="prefill")
    single = SpeculativeDecoder(target, OracleDrafter(ORACLE, conditional=True), make_policy("dominotree"))
    for prompt, seed, n, o in zip(prompts, seeds, budgets, out, strict=True):
        alone = single.generate(prompt, max_new_tokens=n, temperature=temperature, stop_token_ids=(),
                                generator=torch.Generator().manual_seed(seed), first_token="prefill")
        assert o.tokens.tolist() == alone.tokens.tolist() and o.stats.taus == alone.stats.taus
    assert out[1].stats.rounds == [] and len(out[1].tokens) == 1
    with pytest.raises(ValueError, match="first_token must be 'round' or 'prefill'"):
        decoder.generate(prompts, max_new_tokens=4, first_token="first")


@pytest.mark.parametrize("kind", ["dflash", "domino"])
def test_block_drafters_decode_batches_losslessly(target, kind):
    cls = DFlashDrafter if kind == "dflash" else DominoDrafter
    config = tiny_config(domino=kind == "domino", vocab=VOCAB, hidden=32, num_target_layers=2, layer_ids=(0, 1),
                         block_size=5)
    drafter = cls.random(config, dtype=torch.float64, seed=3)
    policy = make_policy("dominotree" if kind == "domino" else "ddtree")
    prompts = prompts_of((5, 2, 13), seed=3)
    out = BatchDecoder(target, drafter, policy).generate(prompts, max_new_tokens=16, stop_token_ids=())
    for prompt, o in zip(prompts, out, strict=True):
        assert o.tokens.tolist() == SpeculativeDecoder(target).generate(prompt, max_new_tokens=16,
                                                                        stop_token_ids=()).tokens.tolist()


def test_generate_takes_a_list_of_prompts(target):
    prompts = [p.tolist() for p in prompts_of((3, 8), seed=9)]
    drafter = OracleDrafter(ORACLE)
    together = treespec.generate(target, prompts, drafter=drafter, policy="ddtree", max_new_tokens=12,
                                 stop_token_ids=[])
    assert isinstance(together, list) and len(together) == 2
    for prompt, out in zip(prompts, together, strict=True):
        alone = treespec.generate(target, prompt, drafter=drafter, policy="ddtree", max_new_tokens=12,
                                  stop_token_ids=[])
        assert out.tokens.tolist() == alone.tokens.tolist()


def test_the_batch_decoder_refuses_bad_requests(target):
    decoder = BatchDecoder(target)
    with pytest.raises(ValueError, match="at least one prompt"):
        decoder.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match="2 prompts need as many max_new_tokens"):
        decoder.generate(prompts_of((3, 4)), max_new_tokens=[4])
    with pytest.raises(ValueError, match="prompt 1: max_new_tokens must be >= 1"):
        decoder.generate(prompts_of((3, 4)), max_new_tokens=[4, 0])
    with pytest.raises(ValueError, match=r"prompt 0: token ids must lie in \[0, 96\)"):
        decoder.generate([torch.tensor([1, 500])], max_new_tokens=4)


# ---------------------------------------------------------------------------- the bench at batch size S
@pytest.mark.parametrize("first_token", by_default(["round", "prefill"], "round"))
def test_a_batched_bench_run_gives_every_turn_the_unbatched_tokens(tmp_path, first_token):
    from test_bench_runner import CONFIG, TIMES, make_harness, prompt_files

    import treespec.apps.bench as ab

    config = attrs.evolve(CONFIG, datasets=prompt_files(tmp_path),
                          methods=("ar", "ddtree", "dominotree", "ddtree:domino"), first_token=first_token)
    outs = {}
    for size in (1, 3):
        out = tmp_path / f"s{size}"
        ab.run_shard(attrs.evolve(config, batch_size=size), make_harness(), out, progress=False)
        ab.merge_shards(out)
        ab.write_report(out, resamples=20)
        outs[size] = list(ab.read_records(out / ab.RECORDS))
        assert ab.read_divergences(out / ab.DIVERGENCES) == []  # every method equals AR, batched or not
    strip = lambda r: {k: v for k, v in attrs.asdict(r).items() if k not in (*TIMES, "batch_size")}  # noqa: E731
    assert [strip(r) for r in outs[3]] == [strip(r) for r in outs[1]]  # same turns, tokens, taus and seeds
    assert {r.batch_size for r in outs[1]} == {1} and max(r.batch_size for r in outs[3]) == 3
    assert {(r.method, r.drafter, r.verifier) for r in outs[3]} == {  # the method's fields, batched or not
        ("ar", None, "match"), ("ddtree@4", "dflash", "match"), ("dominotree@4", "domino", "match"),
        ("ddtree@4:domino", "domino", "match")}
    assert all(r.decode_time > 0 and r.stage_times["verify"] > 0 for r in outs[3])  # shares of measured batch times


@pytest.mark.parametrize("target", ["qwen3"], indirect=True)
def test_a_batch_whose_policy_shows_no_tree_can_pay_decodes_without_drafting(target):
    """The batched decoder asks the policy as the single one does: a verify that costs an AR step per
    token leaves every row an AR row (no draft, no taps), each the target's greedy output."""
    from treespec.pricing.cost import LinearCost

    prompts = prompts_of((7, 12, 3), seed=1)
    policy = registry.create("policy", "caddtree", budget=16, cost_model=LinearCost(draft=0.01, base=0.0,
                                                                                   per_token=0.05))
    drafter = OracleDrafter(ORACLE, conditional=False)
    drafter.draft_batch = lambda *args: pytest.fail("a batch that cannot pay drafted")
    out = BatchDecoder(target, drafter, policy).generate(prompts, max_new_tokens=12, stop_token_ids=())
    ar = [SpeculativeDecoder(target).generate(p, max_new_tokens=12, stop_token_ids=()).tokens.tolist() for p in prompts]
    assert [o.tokens.tolist() for o in out] == ar
    assert all(o.stats.undrafted and set(o.stats.taus) == {1} for o in out)
