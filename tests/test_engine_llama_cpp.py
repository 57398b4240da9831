"""The target on llama.cpp (treespec/engines/llama_cpp.py), on a tiny GGUF made here (tests/test_embedded.py's
Q4_1 llama file): a tree's logits are each node's path run alone, bit for bit; a commit leaves a cache
whose next decode equals a plain run of the accepted path (holes of rejected nodes closed); the taps
are those of the same tokens run as a chain; speculative decoding on the engine is the engine's own AR
output token for token; bad files and limits get one line.

llama-cpp-python builds from source (.ci/run installs it); without it these tests are skipped, and
under CI its absence fails them."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_embedded import write_tiny_gguf
from tiers import by_default

from treespec.decoding import SpeculativeDecoder
from treespec.interfaces import DraftContext
from treespec.target import ContextOverflowError, Numerics
from treespec.tree import DraftTree

if not os.environ.get("CI"):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'treespec[engine]')")

from treespec.apps.assembly.loading import load_target
from treespec.drafters.toy import MarginalDrafter

TAPS = (0, 1, 2)  # the embedding output and both layers' outputs of the tiny model


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("engine") / "tiny.gguf")


@pytest.fixture(scope="module")
def engine(gguf_file):
    return load_target(gguf_file, engine="llama.cpp", dtype=torch.float32)


def prompt(n: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed))


def random_tree(root: int, nodes: int, seed: int) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, nodes + 1)]
    return DraftTree.build([root] + torch.randint(3, 250, (nodes,), generator=g).tolist(), parents)


def path_to(tree: DraftTree, node: int) -> list[int]:
    parents, path = tree.parents.tolist(), []
    while node >= 0:
        path.append(node)
        node = parents[node] if node > 0 else -1
    return path[::-1]


@pytest.mark.parametrize("seed", range(4))
def test_a_trees_logits_and_taps_are_each_nodes_path_run_alone(engine, seed):
    ids = prompt(seed=seed)
    tree = random_tree(int(ids[-1]), 9, seed)
    engine.prefill(ids[:-1], TAPS)
    out = engine.forward_tree(tree, TAPS)
    assert out.logits.shape == (10, engine.vocab_size) and out.features.shape == (10, 3 * engine.hidden_size)
    for node in range(len(tree)):
        path = path_to(tree, node)
        engine.prefill(ids[:-1], TAPS)
        alone = engine.forward_tree(DraftTree.chain(int(ids[-1]), tree.tokens[path[1:]]), TAPS)
        assert torch.equal(out.logits[node], alone.logits[-1]) and torch.equal(out.features[node], alone.features[-1])


@pytest.mark.parametrize(("tokens", "parents", "accepted"), [
    ([7, 5, 9, 11], [-1, 0, 0, 2], [0, 2, 3]),  # the rejected branch's cell sits before the path's
    ([7, 5, 9, 11], [-1, 0, 1, 0], [0, 1, 2]),  # it sits after
    ([7, 5, 9, 11, 13], [-1, 0, 0, 1, 2], [0, 2, 4]),
])
def test_a_commit_leaves_the_cache_a_plain_run_of_the_accepted_path_leaves(engine, tokens, parents, accepted):
    ids = prompt(seed=1)
    tokens = [int(ids[-1])] + tokens[1:]
    engine.prefill(ids[:-1])
    engine.forward_tree(DraftTree.build(tokens, parents))
    engine.commit(torch.tensor(accepted))
    assert engine.length == engine.cache_length() == ids.numel() - 1 + len(accepted)
    after_tree = engine.forward_tree(DraftTree.chain(42, torch.tensor([43, 44]))).logits
    engine.prefill(torch.cat([ids[:-1], torch.tensor([tokens[i] for i in accepted])]))
    for _ in range(2):  # the plain run: the path prefilled, then the same chain
        plain = engine.forward_tree(DraftTree.chain(42, torch.tensor([43, 44]))).logits
        assert torch.equal(after_tree, plain)
        engine.drop_tree()


def ar_output(engine, ids: torch.Tensor, n: int) -> list[int]:
    return SpeculativeDecoder(engine, None, None).generate(ids, max_new_tokens=n).tokens.tolist()


class Peeking(MarginalDrafter):
    """Drafts the engine's own continuation at most depths (so trees are accepted, partly), noise
    elsewhere; it declares taps, so the loop carries the engine's taps through every round."""

    tap_layers = TAPS

    def __init__(self, answer: list[int], offset: int, vocab: int, depth: int = 4) -> None:
        self.answer, self.offset, self.vocab = answer, offset, vocab
        g = torch.Generator().manual_seed(0)
        self.noise = torch.randn(4096, depth, vocab, generator=g)
        super().__init__(self._logits)

    def _logits(self, ctx: DraftContext) -> torch.Tensor:
        logits = self.noise[ctx.position].clone()  # [L, V]
        for d in range(logits.shape[0]):
            i = ctx.position + d + 1 - self.offset
            if 0 <= i < len(self.answer) and (ctx.position + d) % 3:  # right two times in three
                logits[d, self.answer[i]] += 6.0
        return logits


@pytest.mark.parametrize("method", ["chain", "ddtree", "eagle2"])
def test_speculative_decoding_on_the_engine_is_its_own_ar_output(engine, method):
    from treespec import registry

    ids = prompt(16, seed=3)
    answer = ar_output(engine, ids, 40)
    drafter = Peeking(answer, ids.numel(), engine.vocab_size)
    policy = registry.create("policy", method, budget=8) if method != "chain" else registry.create("policy", "chain")
    out = SpeculativeDecoder(engine, drafter, policy).generate(ids, max_new_tokens=40)
    assert out.tokens.tolist() == answer
    assert out.stats.mean_tau > 1.2  # trees were accepted in part: commits moved cells around


def test_bad_files_and_limits_get_one_line(engine, tmp_path, gguf_file):
    text = tmp_path / "model.gguf"
    text.write_text("not a model")
    with pytest.raises(ValueError, match=f"{text} is not a GGUF file"):
        load_target(text, engine="llama.cpp")
    with pytest.raises(FileNotFoundError, match="no GGUF file or folder at .*nowhere"):
        load_target(tmp_path / "nowhere", engine="llama.cpp")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty holds no .gguf file; name the file"):
        load_target(tmp_path / "empty", engine="llama.cpp")
    engine.prefill(prompt()[:-1])
    wide = DraftTree.build([7] + [8] * 70, [-1] + [0] * 70)  # 70 leaves
    with pytest.raises(ValueError, match="70 leaves exceeds the engine's 64 sequences"):
        engine.forward_tree(wide)
    engine.prefill(torch.zeros(engine.max_positions - 2, dtype=torch.long) + 5)
    with pytest.raises(ContextOverflowError, match="exceeds the engine's context"):
        engine.forward_tree(DraftTree.chain(5, torch.tensor([6, 7, 8])))


def test_a_gguf_that_is_not_a_causal_lm_is_named(tmp_path):
    import gguf

    path = tmp_path / "encoder.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.add_tensor("position_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"{path} is a GGUF file but not a causal language model"):
        load_target(path, engine="llama.cpp")


@pytest.mark.parametrize(("policy", "verifier"), by_default(
    [("ddtree-sampled", "recursive-rejection"), ("chain", "rejection")], ("chain", "rejection")))
def test_at_t_above_zero_the_engines_first_two_tokens_follow_its_own_law(engine, policy, verifier):
    """Sampled trees over the engine's logits: the first two tokens of many seeded generations against
    p(t1) p(t2 | t1) computed from the engine's own logits (temperature 1, top-k 4), by the kit's
    chi-square test; a test that fails when the law is off (a greedy decoder's counts are refused)."""
    from treespec import registry
    from treespec.apps.kit.exactness import chi_square_pvalue
    from treespec.interfaces import SamplingParams
    from treespec.sampling import target_probs

    ids = prompt(10, seed=5)
    sampling = SamplingParams(temperature=1.0, top_k=4)
    engine.prefill(ids[:-1])
    first = target_probs(engine.forward_tree(DraftTree.root_only(int(ids[-1]))).logits, sampling)[0]  # [V]
    law = torch.zeros(engine.vocab_size, engine.vocab_size, dtype=torch.float64)
    for t1 in first.nonzero().flatten().tolist():
        engine.prefill(ids[:-1])
        rows = engine.forward_tree(DraftTree.chain(int(ids[-1]), torch.tensor([t1]))).logits
        law[t1] = first[t1] * target_probs(rows[1:], sampling)[0]
    drafter = Peeking(torch.multinomial(first.float(), 40, replacement=True).tolist(), ids.numel(), engine.vocab_size)
    budget = {"budget": 6} if policy != "chain" else {}
    decoder = SpeculativeDecoder(engine, drafter, registry.create("policy", policy, **budget),
                                 registry.create("verifier", verifier))
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros_like(law)
    for _ in range(1500):
        t1, t2 = decoder.generate(ids, max_new_tokens=2, sampling=sampling, generator=generator).tokens.tolist()
        counts[t1, t2] += 1
    assert chi_square_pvalue(counts, law) > 1e-3
    greedy = torch.zeros_like(law)
    greedy[int(law.sum(1).argmax()), int(law[law.sum(1).argmax()].argmax())] = 1500
    assert chi_square_pvalue(greedy, law) < 1e-3  # the test can fail


def test_trees_decode_to_the_last_position_of_the_context(gguf_file):
    """A tree takes a cache cell per node, not per position: at the end of the context a 16-node tree
    of depth 4 still fits (positions are checked, cells are the engine's business), and speculative
    decoding to the context's last position equals the engine's AR."""
    from treespec import registry
    from treespec.engines.llama_cpp import LlamaCppTarget

    small = LlamaCppTarget(gguf_file, n_ctx=64, dtype=torch.float32)
    ids = prompt(50, seed=5)
    answer = ar_output(small, ids, 13)  # positions 49 .. 62, the last of 64
    drafter = Peeking(answer, ids.numel(), small.vocab_size)
    out = SpeculativeDecoder(small, drafter, registry.create("policy", "ddtree", budget=16)).generate(
        ids, max_new_tokens=13)
    assert out.tokens.tolist() == answer
    small.prefill(prompt(58, seed=6)[:-1])
    wide = DraftTree.build([7] + [8] * 16, [-1] + [0] * 8 + list(range(1, 9)))  # 16 nodes, depth 2: 57 + 17 cells
    assert small.forward_tree(wide).logits.shape == (17, small.vocab_size)


def test_an_interrupt_during_a_tapped_decode_stops_the_run_as_an_interrupt(gguf_file, monkeypatch, capsys):
    """Ctrl-C while the engine's tap callback runs is a KeyboardInterrupt after the decode, not a
    swallowed one and a complaint about missing tap rows; the CLI ends it in one line, exit 130."""
    from treespec.apps.cli import main
    from treespec.engines import llama_cpp

    target = llama_cpp.LlamaCppTarget(gguf_file, dtype=torch.float32)
    calls = []

    def interrupted(self, tensor, ask):
        if not ask:
            calls.append(1)
            raise KeyboardInterrupt
        return True

    monkeypatch.setattr(llama_cpp._Taps, "_copy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        target.prefill(prompt(8), taps=TAPS)
    assert calls  # the callback ran and caught it
    monkeypatch.setattr("treespec.apps.commands.generate.run", lambda args: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(["generate", str(gguf_file), "--prompt", "hi"]) == 130
    err = capsys.readouterr().err
    assert err == "treespec generate: interrupted\n"


def test_a_damaged_or_nan_gguf_ends_in_one_line(tmp_path, capsys):
    """A truncated GGUF with no tokenizer beside it is named by the GGUF check (before the tokenizer
    reader, which would raise a bare struct error); a GGUF whose weights hold NaN is refused after the
    prompt's logits, naming the file; both in one line, exit 2 and 1."""
    import gguf

    from treespec.apps.cli import main

    path = write_tiny_gguf(tmp_path / "nan.gguf")
    reader = gguf.GGUFReader(path, "r+")
    next(t for t in reader.tensors if t.name == "token_embd.weight").data.reshape(-1)[3] = float("nan")
    del reader
    truncated = tmp_path / "cut" / "truncated.gguf"
    truncated.parent.mkdir()
    truncated.write_bytes(write_tiny_gguf(tmp_path / "whole.gguf").read_bytes()[:5000])
    capsys.readouterr()
    assert main(["generate", str(truncated), "--engine", "llama.cpp", "--prompt", "hi", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "a damaged GGUF file" in err and "Traceback" not in err and err.count("treespec generate") == 1
    ids = ",".join(["5"] * 4)
    with pytest.raises(ValueError, match="nan.gguf: the model's logits after the prompt are not finite"):
        import treespec

        treespec.generate(path, [int(i) for i in ids.split(",")], engine="llama.cpp", dtype="float32",
                          max_new_tokens=2)
    assert main(["generate", str(path), "--engine", "llama.cpp", "--prompt", "hi", "--dtype", "float32"]) == 1
    err = capsys.readouterr().err
    assert "logits after the prompt are not finite" in err and "Traceback" not in err


def test_bench_runs_a_gguf_file_and_its_quantization_is_part_of_the_runs_identity(tmp_path, capsys):
    """``bench --engine llama.cpp --model FILE.gguf`` runs (the settings name the file and its sha256); the
    same folder with another file behind the same name (another quantization) is other settings, refused
    in one line instead of resumed and pooled; --batch-size 2 on the engine is refused before anything
    loads; so is a batch of prompts through the API."""
    from pathlib import Path

    import treespec
    from treespec.apps.cli import main

    chat = Path(__file__).resolve().parents[1] / "treespec" / "assets" / "demo" / "chat.jsonl"
    model = write_tiny_gguf(tmp_path / "model.gguf")
    out = tmp_path / "bench"
    args = ["bench", "--model", str(model), "--engine", "llama.cpp", "--methods", "ar", "--prompts", "1", "--datasets",
            str(chat), "--out", str(out), "--no-progress", "--max-new-tokens", "2", "--dtype", "float32"]
    assert main(args) == 0
    settings = json.loads((out / "bench.json").read_text())
    assert settings["model"]["path"] == str(model) and len(settings["model"]["sha256"]) == 64
    write_tiny_gguf(model, hidden=32, heads=2, kv_heads=1)  # another file saved under the same name
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "holds the results of another bench configuration (differs in model)" in err and "Traceback" not in err
    assert main([*args, "--batch-size", "2", "--out", str(tmp_path / "batch")]) == 2
    assert "the llama.cpp engine decodes one sequence at a time here" in capsys.readouterr().err
    assert not (tmp_path / "batch").exists()
    with pytest.raises(ValueError, match="the llama.cpp engine decodes one sequence at a time"):
        treespec.generate(model, [[5, 6, 7], [8, 9]], engine="llama.cpp", dtype="float32", max_new_tokens=2)



def test_flipped_bytes_in_a_gguf_are_caught_by_its_digest(tmp_path, capsys):
    """A GGUF file carries no checksum: bytes flipped in its weights run silently, unless the run names
    the digest the weights must have (``--sha256``, the one bench.json records), which is checked first."""
    import hashlib

    from treespec.apps.cli import main

    path = write_tiny_gguf(tmp_path / "model.gguf")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    common = ["generate", str(path), "--engine", "llama.cpp", "--prompt", "hi", "--dtype", "float32",
              "--max-new-tokens", "2", "--sha256"]
    assert main([*common, digest]) == 0
    data = bytearray(path.read_bytes())
    data[-200:-100] = bytes(100)  # the last tensor's bytes, zeroed: still a GGUF file that loads
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert main([*common, digest]) == 2
    err = capsys.readouterr().err
    assert f"{path}: sha256" in err and f"expected {digest}" in err and "Traceback" not in err
    assert main([*common, "abc"]) == 2
    assert "--sha256 takes 64 hex digits" in capsys.readouterr().err


def test_the_engines_numerics_are_measured_per_size_and_threads_on_a_sibling(gguf_file, monkeypatch):
    """How a tree compares with one-token steps is measured on this file, cache type and thread count (a tree
    beside a chain, and steps after its commit), once per size and thread count, on a sibling: the target's
    own sequence is left as it was."""
    from treespec.engines.llama_cpp import LlamaCppTarget

    target = LlamaCppTarget(gguf_file, dtype=torch.float32)
    target.prefill(prompt())
    first = target.numerics(17)
    assert first.exact and first.tolerance == 0.0 and "f16 K/V cache" in first.how and "measured" in first.how
    assert target.numerics(17) is first and target.numerics(9) is not first
    assert target.length == 12 and target.cache_length() == 12  # its own cache untouched
    assert target.cache_type == "f16"  # heads of 16 dimensions: q8_0's 32-element blocks do not divide them
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert target.numerics(17) is not first  # measured again at another thread count


def test_generate_check_says_whether_a_near_tie_decided_a_token(gguf_file, monkeypatch, capsys):
    """``generate --check`` decodes AR beside the method: equal outputs say so; at a difference it names the
    token and AR's top-two gap there against the engine's rounding (exit 0 within it, 1 beyond it)."""
    import argparse

    import treespec
    from treespec.apps.assembly.loading import load_tokenizer
    from treespec.apps.cli import main
    from treespec.apps.commands.generate import _check
    from treespec.engines.llama_cpp import LlamaCppTarget

    target = LlamaCppTarget(gguf_file, dtype=torch.float32)
    tokenizer = load_tokenizer(gguf_file)
    args = argparse.Namespace(prompt="hello there", chat=False, max_new_tokens=6, stop_token_id=None, budget=8,
                              policy="ddtree")
    ar = treespec.generate(target, "hello there", tokenizer=tokenizer, max_new_tokens=6).tokens.tolist()
    assert _check(args, target, tokenizer, ar) == 0
    assert "check: equal to AR's output token for token (6 tokens)" in capsys.readouterr().err
    other = [*ar[:-1], (ar[-1] + 1) % target.vocab_size]  # a method's output that leaves AR's at token 5
    monkeypatch.setattr(LlamaCppTarget, "numerics", lambda self, tokens=17: Numerics(False, float("inf"), "loose"))
    assert _check(args, target, tokenizer, other) == 0
    err = capsys.readouterr().err
    assert "token 5 differs from AR's" in err and "a near-tie decided it" in err
    monkeypatch.undo()  # the engine's own: trees equal one-token steps here, so any difference is not AR's output
    assert _check(args, target, tokenizer, other) == 1
    assert "exceeds the engine's rounding" in capsys.readouterr().err
    assert main(["generate", str(gguf_file), "--engine", "llama.cpp", "--prompt", "hi", "--temperature", "0.5",
                 "--check"]) == 2
    assert "--check compares with AR's greedy output" in capsys.readouterr().err
