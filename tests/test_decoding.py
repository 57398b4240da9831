"""SpeculativeDecoder, treespec.generate and `treespec generate` on tiny random targets.

The policies here are two small test-local ones (a top-1 chain and a static Medusa-style tree), so
the loop is tested on its own; every registered policy is swept in test_lossless.py.
"""

from __future__ import annotations

import pytest
import torch
from test_target import hf_greedy, random_prompts, tiny_model, tiny_target

import treespec
from treespec import decoding
from treespec.apps.cli import main
from treespec.decoding import SpeculativeDecoder, limit_depth
from treespec.drafters.oracle import ORACLE_PRESETS, OracleDrafter
from treespec.interfaces import Decision, DraftController, Drafter, DraftOutput, TreePolicy
from treespec.policies.ddtree import DDTree
from treespec.target import ContextOverflowError
from treespec.tree import DraftTree


class TopChain(TreePolicy):
    """The top-1 token of every drafted depth."""

    def build(self, draft: DraftOutput) -> DraftTree:
        lp, tok = draft.logprobs.max(-1)
        return DraftTree.chain(draft.root_token, tok, lp)


class StaticTree(TreePolicy):
    """A fixed rank-path tree over the top-3 candidates per depth (branches, siblings, depth 5)."""

    CHOICES = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0),
               (0, 0, 0, 0, 0))

    def build(self, draft: DraftOutput) -> DraftTree:
        top = draft.logprobs.topk(3, dim=-1)
        return DraftTree.from_topk_choices(self.CHOICES, root_token=draft.root_token, topk_tokens=top.indices,
                                           topk_logprobs=top.values)


def _oracle(preset: str = "typical", **kw) -> OracleDrafter:
    return OracleDrafter(ORACLE_PRESETS[preset], tap_layers=(0, 2), check_features=True, **kw)


@pytest.fixture(scope="module")
def qwen():
    return tiny_target("qwen3")


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_autoregressive_loop_equals_plain_greedy(family):
    target = tiny_target(family)
    for prompt in random_prompts(3, 128, seed=4):
        out = SpeculativeDecoder(target).generate(prompt, max_new_tokens=40)
        assert out.tokens.tolist() == hf_greedy(target.model, prompt, 40)
        assert out.stats.taus == [1] * 40


@pytest.mark.parametrize("policy", [TopChain(), StaticTree()], ids=["chain", "static-tree"])
@pytest.mark.parametrize("preset", ["perfect", "typical", "noisy"])
def test_speculative_equals_greedy_and_features_follow_the_contract(qwen, policy, preset):
    decoder = SpeculativeDecoder(qwen, _oracle(preset), policy)
    taus = []
    for prompt in random_prompts(2, 128, seed=5):
        out = decoder.generate(prompt, max_new_tokens=60)
        assert out.tokens.tolist() == hf_greedy(qwen.model, prompt, 60)
        assert qwen.cache_length() == qwen.length == prompt.numel() + 60 - 1  # memory stays at the context
        taus += out.stats.taus
    assert sum(taus) / len(taus) > 1.5  # the oracle really drafts the continuation


@pytest.mark.parametrize("n", [1, 2, 7, 33])
def test_exactly_max_new_tokens(qwen, n):
    decoder = SpeculativeDecoder(qwen, _oracle("perfect"), TopChain())
    prompt = torch.tensor([3, 1, 4, 1, 5])
    out = decoder.generate(prompt, max_new_tokens=n)
    assert out.tokens.tolist() == hf_greedy(qwen.model, prompt, n)
    assert out.stats.new_tokens == n and sum(out.stats.taus) == n  # trees are pruned to what can be used


def test_stop_token_is_included_and_ends_generation_mid_round(qwen):
    prompt = torch.tensor([9, 2, 6])
    reference = hf_greedy(qwen.model, prompt, 60)
    stop = reference[30]
    cut = reference.index(stop) + 1
    for drafter, policy in [(None, None), (_oracle("perfect"), TopChain())]:
        out = SpeculativeDecoder(qwen, drafter, policy).generate(prompt, max_new_tokens=60, stop_token_ids=[stop])
        assert out.tokens.tolist() == reference[:cut]
        assert out.stats.new_tokens == cut


def test_stats_record_rounds_and_stage_times(qwen):
    out = SpeculativeDecoder(qwen, _oracle(), StaticTree()).generate(torch.tensor([1, 2, 3]), max_new_tokens=50)
    stats = out.stats
    assert sum(stats.taus) == 50 and len(stats.rounds) < 50
    assert all(1 <= r.tau <= 6 and 1 <= r.tree_size <= 12 for r in stats.rounds)
    assert all(set(r.times) == {"draft", "build", "verify", "commit"} for r in stats.rounds)
    assert all(t >= 0 for r in stats.rounds for t in r.times.values())
    assert stats.prefill_time > 0 and stats.decode_time >= sum(stats.stage_totals().values())


def test_near_the_context_window(qwen):
    target = tiny_target(max_positions=40)
    prompt = torch.arange(10)
    out = SpeculativeDecoder(target, _oracle("perfect"), TopChain()).generate(prompt, max_new_tokens=30)
    assert out.tokens.tolist() == hf_greedy(target.model, prompt, 30)
    with pytest.raises(ContextOverflowError, match="11 tokens \\+ max_new_tokens=30 = 41 exceeds .* 40 positions"):
        SpeculativeDecoder(target, _oracle(), TopChain()).generate(torch.arange(11), max_new_tokens=30)


def test_limit_depth_keeps_the_shallow_subtree():
    tree = DraftTree.build([7, 3, 4, 5, 6, 8, 9], [-1, 0, 0, 1, 3, 2, 5], scores=[0, -1, -2, -3, -4, -5, -6])
    cut = limit_depth(tree, 1)
    assert cut.tokens.tolist() == [7, 3, 4] and cut.parents.tolist() == [-1, 0, 0]
    cut = limit_depth(tree, 2)
    assert cut.tokens.tolist() == [7, 3, 4, 5, 8] and cut.parents.tolist() == [-1, 0, 0, 1, 2]
    assert cut.scores.tolist() == [0, -1, -2, -3, -5]
    assert limit_depth(tree, 3) is tree


class _WrongVocab(Drafter):
    def draft(self, ctx):
        return DraftOutput(torch.zeros(3, 100), root_token=ctx.anchor)


class _WrongRoot(TreePolicy):
    def build(self, draft):
        return DraftTree.chain(draft.root_token + 1, [1])


def test_clear_errors(qwen):
    prompt = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="drafter's vocabulary \\(100\\) differs from the target's \\(128\\)"):
        SpeculativeDecoder(qwen, _WrongVocab(), TopChain()).generate(prompt, max_new_tokens=4)
    with pytest.raises(ValueError, match="tree has root token .*; its root must be the draft's anchor"):
        SpeculativeDecoder(qwen, _oracle(), _WrongRoot()).generate(prompt, max_new_tokens=4)
    with pytest.raises(ValueError, match="both a drafter and a policy"):
        SpeculativeDecoder(qwen, _oracle())
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        SpeculativeDecoder(qwen).generate(prompt, max_new_tokens=0)
    with pytest.raises(ValueError, match="unknown backend .jax.; expected one of"):
        DDTree(budget=4, backend="jax")
    with pytest.raises(TypeError, match="backend"):  # the loop takes a policy, never a backend
        SpeculativeDecoder(qwen).generate(prompt, max_new_tokens=3, backend="networkx")
    with pytest.raises(ValueError, match="prompt token ids must lie in \\[0, 128\\)"):
        SpeculativeDecoder(qwen).generate(torch.tensor([1, 500]), max_new_tokens=3)
    broken = tiny_target()
    with torch.no_grad():
        broken.model.lm_head.weight[5, 0] = float("nan")
    with pytest.raises(ValueError, match="logits after the prompt are not finite .*its weights hold NaN"):
        SpeculativeDecoder(broken).generate(prompt, max_new_tokens=3)


def test_sampling_without_a_generator_still_runs(qwen):
    out = SpeculativeDecoder(qwen, _oracle(), StaticTree()).generate(torch.tensor([4, 4]), max_new_tokens=12,
                                                                    temperature=0.9)
    assert out.tokens.numel() == 12


# ---------------------------------------------------------------------------- one-call API and CLI
def test_generate_api_on_a_model_object_matches_greedy():
    model = tiny_model()
    prompt = [5, 6, 7, 8]
    out = treespec.generate(model, prompt, drafter=_oracle(), policy=StaticTree(), max_new_tokens=25)
    assert out.tokens.tolist() == hf_greedy(model, torch.tensor(prompt), 25) and out.text is None
    ar = treespec.generate(model, prompt, max_new_tokens=25, do_sample=True, temperature=0.7, seed=3)
    spec = treespec.generate(model, prompt, drafter="oracle", policy=StaticTree(), max_new_tokens=25,
                             do_sample=True, temperature=0.7, seed=3)
    assert spec.tokens.tolist() == ar.tokens.tolist()  # position-keyed sampling pairs them exactly
    with pytest.raises(ValueError, match="do_sample=True needs temperature > 0"):
        treespec.generate(model, prompt, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        treespec.generate(model, "hello", max_new_tokens=3)


def _word_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0", eos_token="w1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model(dtype=torch.float32).save_pretrained(path)
    _word_tokenizer(128).save_pretrained(path)
    return path


def test_generate_api_and_cli_from_a_directory(model_dir, capsys):
    model = tiny_model(dtype=torch.float32)
    reference = hf_greedy(model, torch.tensor([3, 5, 7]), 20)
    if 1 in reference:  # w1 is the tokenizer's EOS: generation stops there and decoding drops it
        reference = reference[: reference.index(1) + 1]
    expected = " ".join(f"w{t}" for t in reference if t != 1)
    out = treespec.generate(model_dir, "w3 w5 w7", max_new_tokens=20, dtype="float32")  # not "auto": exactness
    assert out.text == expected
    assert main(["generate", str(model_dir), "--prompt", "w3 w5 w7", "--drafter", "oracle", "--policy",
                 _a_policy(), "--max-new-tokens", "20", "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == expected
    assert "mean tau" in captured.err
    assert main(["generate", str(model_dir / "missing"), "--prompt", "w3"]) == 2  # a bad argument
    assert "cannot load" in capsys.readouterr().err


def _a_policy() -> str:
    return "chain"


def test_generate_api_takes_token_ids_from_a_directory_without_tokenizer(tmp_path):
    model = tiny_model(dtype=torch.float32)
    model.save_pretrained(tmp_path)
    out = treespec.generate(tmp_path, [3, 5, 7], max_new_tokens=6, stop_token_ids=[], dtype="float32")
    assert out.tokens.tolist() == hf_greedy(model, torch.tensor([3, 5, 7]), 6) and out.text is None
    with pytest.raises(ValueError, match="no tokenizer files"):
        treespec.generate(tmp_path, "w3 w5", max_new_tokens=2)


# ---------------------------------------------------------------------------- the oracle drafter
def test_oracle_continuation_is_the_targets_greedy_for_any_context(qwen):
    drafter = OracleDrafter(depth=4)
    drafter.bind(qwen)
    gen = torch.Generator().manual_seed(8)
    base = [5, 9, 2]
    for _ in range(25):  # contexts that extend, shorten and branch away from each other
        seq = base + torch.randint(0, 128, (int(torch.randint(0, 5, ())),), generator=gen).tolist()
        assert drafter.greedy_continuation(seq, 4) == hf_greedy(qwen.model, torch.tensor(seq), 4)


def _ctx(seq: list[int]):
    from treespec.interfaces import DraftContext

    return DraftContext(torch.tensor(seq), None, len(seq) - 1)


def test_oracle_drafts_rank_the_truth_as_configured(qwen):
    perfect = OracleDrafter(ORACLE_PRESETS["perfect"])
    perfect.bind(qwen)
    seq = [4, 8, 15, 16]
    draft = perfect.draft(_ctx(seq))
    assert draft.logprobs.argmax(-1).tolist() == hf_greedy(qwen.model, torch.tensor(seq), 8)
    assert torch.equal(draft.logprobs, perfect.draft(_ctx(seq)).logprobs)  # keyed by the context
    noisy = OracleDrafter(ORACLE_PRESETS["noisy"], depth=1)
    noisy.bind(qwen)
    hits = 0
    for i in range(200):
        ctx = _ctx(seq + [i % 128])
        truth = noisy.greedy_continuation(ctx.sequence.tolist(), 1)[0]
        hits += int(noisy.draft(ctx).logprobs[0].argmax()) == truth
    assert 0.3 < hits / 200 < 0.6  # top1 = 0.45 at depth 1


def test_oracle_scorer_children_are_sorted_and_path_dependent(qwen):
    drafter = OracleDrafter(ORACLE_PRESETS["noisy"], conditional=True)
    drafter.bind(qwen)
    seq = [1, 2, 3]
    draft = drafter.draft(_ctx(seq))
    truth = drafter.greedy_continuation(seq, 8)
    scorer = draft.scorer
    root = scorer.root_state()[None]
    first = scorer.expand(root, 0, top_m=64, k=5)  # pure-draft prefix: the base row's best 5
    base = draft.logprobs[0]
    assert first.tokens[0].tolist() == torch.argsort(-base, stable=True)[:5].tolist()
    torch.testing.assert_close(first.logprobs[0], base[first.tokens[0]])
    on_path = first.states[0, :, 0] > 0.5
    assert on_path.tolist() == [t == truth[0] for t in first.tokens[0].tolist()]
    states = torch.stack([torch.tensor([1.0, float(truth[0])]), torch.tensor([0.0, 77.0])])
    kids = scorer.expand(states, 1, top_m=16, k=16)
    assert kids.tokens.shape == (2, 16) and kids.states.shape == (2, 16, 2)
    assert not torch.equal(kids.logprobs[0], kids.logprobs[1])  # the path changes the children
    assert bool((kids.logprobs[:, :-1] >= kids.logprobs[:, 1:]).all())  # sorted per row
    torch.testing.assert_close(kids.logprobs.exp().sum(-1), torch.ones(2, dtype=torch.float32))  # over all M = 16
    if truth[1] in kids.tokens[0].tolist():  # on the greedy path the truth is boosted
        j = kids.tokens[0].tolist().index(truth[1])
        assert bool(kids.states[0, j, 0] == 1.0)


# ---------------------------------------------------------------------------- the real drafters in the loop
def _block_drafter(domino: bool):
    from treespec.drafters.config import DFlashConfig, DominoHeadConfig
    from treespec.drafters.dflash import DFlashDrafter
    from treespec.drafters.domino import DominoDrafter

    config = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=128, num_target_layers=2,
                          target_layer_ids=(0, 1), mask_token_id=127, block_size=4, shift_label=domino,
                          domino=DominoHeadConfig(emb_dim=8, gru_hidden_dim=12) if domino else None)
    return (DominoDrafter if domino else DFlashDrafter).random(config, seed=1, dtype=torch.float64)


@pytest.mark.parametrize("domino,policy", [(False, "ddtree"), (True, "dominotree")])
def test_dflash_and_domino_drafters_run_losslessly_in_the_loop(qwen, domino, policy, tmp_path):
    drafter = _block_drafter(domino)
    prompt = torch.tensor([7, 3, 9, 1, 4])
    reference = hf_greedy(qwen.model, prompt, 30)
    out = SpeculativeDecoder(qwen, drafter, treespec.create("policy", policy, budget=8)).generate(
        prompt, max_new_tokens=30)
    assert out.tokens.tolist() == reference
    drafter.save_pretrained(tmp_path)  # and by directory, through the one-call API
    by_path = treespec.generate(qwen, prompt, drafter=tmp_path, policy=policy, budget=8, max_new_tokens=30)
    assert by_path.tokens.tolist() == reference


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_first_token_from_the_prefill_counts_rounds_as_the_papers_do(temperature):
    """first_token="prefill": same output; the first token comes from the prefill, so the rounds
    (and τ) are those after it, as the published loops count them."""
    from treespec.drafters.oracle import OracleConfig, OracleDrafter

    target = tiny_target("llama")
    prompt = torch.tensor([5, 9, 2, 7, 1])
    kwargs = {"max_new_tokens": 30, "temperature": temperature}
    ar = SpeculativeDecoder(target).generate(prompt, generator=torch.Generator().manual_seed(1), **kwargs)
    decoder = SpeculativeDecoder(target, OracleDrafter(OracleConfig(depth=4)), DDTree(budget=8))
    ours = decoder.generate(prompt, generator=torch.Generator().manual_seed(1), **kwargs)
    papers = decoder.generate(prompt, generator=torch.Generator().manual_seed(1), first_token="prefill", **kwargs)
    assert papers.tokens.tolist() == ours.tokens.tolist() == ar.tokens.tolist()
    assert sum(papers.stats.taus) == 29 and sum(ours.stats.taus) == 30  # the first token is not a round's
    with pytest.raises(ValueError, match="first_token"):
        decoder.generate(prompt, max_new_tokens=2, first_token="paper")


def test_a_fixed_policy_drafts_every_round_whatever_its_trees():
    """The default controller drafts every round, the length-cut last round and root-only trees included."""
    from treespec.drafters.oracle import OracleConfig, OracleDrafter

    decoder = SpeculativeDecoder(tiny_target("qwen3"), OracleDrafter(OracleConfig(depth=4)), DDTree(budget=8))
    for _ in range(3):
        decoder.generate(torch.tensor([4, 8, 1]), max_new_tokens=1)
    out = decoder.generate(torch.tensor([4, 8, 1]), max_new_tokens=20)
    assert all(r.drafted and "draft" in r.times for r in out.stats.rounds)


class _Scripted(DraftController):
    """A controller that replays a list of decisions (then AR steps) and records what it was told."""

    def __init__(self, decisions, *, drafts=True):
        self.decisions, self.drafts, self.reports, self.generations = list(decisions), drafts, [], 0

    def start_generation(self):
        self.generations += 1
        return self.drafts

    def decide(self):
        return self.decisions.pop(0) if self.decisions else Decision(draft=False)

    def observe_round(self, report):
        self.reports.append(report)


class _ScriptedPolicy(DDTree):
    def draft_controller(self):
        return self.script


def _scripted_decoder(script, target, drafter=None):
    from treespec.drafters.oracle import OracleConfig, OracleDrafter

    policy = _ScriptedPolicy(budget=8)
    object.__setattr__(policy, "script", script)
    return SpeculativeDecoder(target, drafter or OracleDrafter(OracleConfig(depth=4)), policy)


def test_the_loop_does_what_its_controller_decides_and_tells_it_every_round(qwen):
    """Each round drafts as decided (an exploration is marked), the controller hears every round, a round
    that drops the taps ends drafting for the generation (the decoder keeps no more taps), and the
    output is AR's whatever was decided."""
    target = qwen
    prompt = torch.tensor([4, 8, 1, 6])
    ar = SpeculativeDecoder(target).generate(prompt, max_new_tokens=24).tokens.tolist()
    script = _Scripted([Decision(), Decision(draft=False), Decision(explore=True), Decision(draft=False, taps=False),
                        Decision(), Decision()])
    decoder = _scripted_decoder(script, target, _block_drafter(False))
    kept = []
    commit = decoding.commit_round
    decoding.commit_round = lambda seq, *args: kept.append(args[2] is not None) or commit(seq, *args)
    try:
        out = decoder.generate(prompt, max_new_tokens=24)
    finally:
        decoding.commit_round = commit
    rounds = out.stats.rounds
    assert out.tokens.tolist() == ar
    assert [r.drafted for r in rounds[:6]] == [True, False, True, False, False, False]
    assert [r.explored for r in rounds[:3]] == [False, False, True]
    assert not any(r.drafted for r in rounds[3:]) and len(script.decisions) == 2  # never asked again
    assert kept[:3] == [True] * 3 and not any(kept[3:])
    assert len(script.reports) == len(rounds) and [r.drafted for r in script.reports] == [r.drafted for r in rounds]


def test_a_generation_the_controller_declines_is_plain_ar():
    target = tiny_target("qwen3")
    script = _Scripted([Decision()] * 10, drafts=False)
    out = _scripted_decoder(script, target).generate(torch.tensor([4, 8, 1, 6]), max_new_tokens=12)
    assert out.stats.undrafted and not any(r.drafted for r in out.stats.rounds)
    assert len(script.decisions) == 10 and len(script.reports) == len(out.stats.rounds)  # told, never asked


def test_a_decision_to_draft_without_taps_is_refused():
    with pytest.raises(ValueError, match="taps"):
        Decision(draft=True, taps=False)
