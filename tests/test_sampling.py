"""Sampling: filters equal transformers' warpers (ties included), and fresh randomness per call.

* `filter_logits` keeps exactly what ``TopKLogitsWarper`` / ``TopPLogitsWarper`` keep, on random
  logits and on logits full of exact ties.
* Two `generate` calls with one generator draw different samples (the position-keyed noise key is
  drawn from the generator's stream per call); two generators seeded alike reproduce a run, and
  speculative output still equals AR's for the same seed.
"""

from __future__ import annotations

import pytest
import torch
from test_target import tiny_target
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from treespec.decoding import SpeculativeDecoder
from treespec.drafters.oracle import OracleConfig, OracleDrafter
from treespec.policies.ddtree import DDTree
from treespec.sampling import filter_logits


def _cases():
    gen = torch.Generator().manual_seed(0)
    random = torch.randn(64, 50, generator=gen, dtype=torch.float64) * 3
    tied = torch.randint(-3, 3, (64, 50), generator=gen).to(torch.float64)  # many exact ties
    return {"random": random, "tied": tied}


@pytest.mark.parametrize("kind", ["random", "tied"])
@pytest.mark.parametrize("top_k", [1, 3, 10, 49])
def test_top_k_keeps_what_transformers_keeps(kind, top_k):
    logits = _cases()[kind]
    ours = torch.isfinite(filter_logits(logits, top_k=top_k))
    theirs = torch.isfinite(TopKLogitsWarper(top_k)(None, logits.clone()))
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("kind", ["random", "tied"])
@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.9, 0.99])
def test_top_p_keeps_what_transformers_keeps(kind, top_p):
    logits = _cases()[kind]
    ours = torch.isfinite(filter_logits(logits, top_p=top_p))
    theirs = torch.isfinite(TopPLogitsWarper(top_p)(None, logits.clone()))
    assert torch.equal(ours, theirs)


def test_successive_calls_with_one_generator_draw_fresh_samples():
    target = tiny_target("qwen3")
    prompt = torch.tensor([3, 9, 4, 1])
    ar = SpeculativeDecoder(target)
    kwargs = {"max_new_tokens": 24, "temperature": 1.0}
    gen = torch.Generator().manual_seed(7)
    first, second = (ar.generate(prompt, generator=gen, **kwargs).tokens.tolist() for _ in range(2))
    assert first != second  # 24 tokens at T = 1 over a 128-token vocabulary: equal by chance ~never
    again = [ar.generate(prompt, generator=torch.Generator().manual_seed(7), **kwargs).tokens.tolist()
             for _ in range(2)]
    assert again == [first, first]  # a generator seeded alike reproduces the run
    spec = SpeculativeDecoder(target, OracleDrafter(OracleConfig(depth=4)), DDTree(budget=8))
    gen = torch.Generator().manual_seed(7)
    assert [spec.generate(prompt, generator=gen, **kwargs).tokens.tolist() for _ in range(2)] == [first, second]
