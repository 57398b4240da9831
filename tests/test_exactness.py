"""Exact by construction: on an engine's exact numeric path a tree's rows equal its one-token steps bit for bit.

* torch's batch-invariant kernels (treespec/engines/torch_exact.py), each against its one-row reference on
  random inputs: the attention of any tree mask (hypothesis) row by row against one query over exactly its
  own keys, the linears row by row against one-row calls; a tiny float32 model's measured numerics exact.
* The real embedded SmolLM2 on both engines (torch in float32 with exact kernels; llama.cpp on its Q4_1 file
  with a q8_0 K/V cache), 2 threads, prompts past 512 positions: a policy's output equals the engine's own AR
  output at T = 0 and at T > 0 (`treespec.apps.kit.testing.check_exact`), where llama.cpp's own f16 cache
  does not.  Skipped without the converted model, except under CI (.ci/run fetches it).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treespec.apps.kit.tiny import tiny_causal_lm
from treespec.engines import torch_exact
from treespec.engines.torch import TargetModel
from treespec.tree import DraftTree


def _tree(parents: list[int]) -> DraftTree:
    return DraftTree.build(tokens=list(range(len(parents))), parents=parents)


@st.composite
def trees(draw, most: int = 20) -> DraftTree:
    n = draw(st.integers(1, most))
    return _tree([-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)])


class _Heads(torch.nn.Module):
    num_key_value_groups = 2


@settings(max_examples=40, deadline=None)
@given(tree=trees(), context=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_each_row_of_the_exact_attention_is_one_query_over_its_own_keys(tree, context, seed):
    """A tree's query rows, attended in one call under its mask, equal each row attended alone over the cached
    prefix and its own path, as a one-token step at its position sees them."""
    g = torch.Generator().manual_seed(seed)
    n, heads, kv_heads, dim = len(tree), 4, 2, 64
    query = torch.randn(1, heads, n, dim, generator=g)
    key, value = torch.randn(1, kv_heads, context + n, dim, generator=g), torch.randn(1, kv_heads, context + n, dim, generator=g)
    mask = tree.attention_mask(context, torch.float32)  # [1, 1, N, context + N]
    together, _ = torch_exact.exact_attention(_Heads(), query, key, value, mask, scaling=0.125)  # [1, N, H, D]
    for node in range(n):
        own = [*range(context), *(context + i for i in tree.path(node))]  # position order
        alone, _ = torch_exact.exact_attention(_Heads(), query[:, :, node:node + 1], key[:, :, own], value[:, :, own],
                                               None, scaling=0.125)
        assert torch.equal(together[0, node], alone[0, 0])


@pytest.mark.parametrize("shape", [(64, 96), (96, 64), (64, 5000)])
def test_each_row_of_an_exact_linear_is_its_one_row_call(shape):
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(shape[1], shape[0], generator=g), torch.randn(70, shape[0], generator=g)
    rows = torch.cat([torch_exact.exact_linear(x[i:i + 1], weight) for i in range(70)])
    for m in (1, 2, 3, 5, 17, 33, 70):
        assert torch.equal(torch_exact.exact_linear(x[:m], weight), rows[:m])


def test_a_float32_model_on_exact_kernels_measures_exact_and_its_commit_is_ars():
    """The measured numerics of a tiny float32 model's exact kernels: a tree beside a chain and the steps after
    its commit equal one-token steps bit for bit; the kernels come off again with ``exact=False``."""
    model = tiny_causal_lm(vocab=128, hidden=128, layers=2, heads=4, kv_heads=2, seed=0, dtype=torch.float32)
    target = TargetModel(model, exact=True)
    assert target.exact and "batch-invariant" in target.describe()
    numerics = target.numerics()
    assert numerics.exact and numerics.tolerance == 0.0
    plain = TargetModel(model, exact=False)
    assert not plain.exact and model.config._attn_implementation == "sdpa"
    assert not any(isinstance(m, torch_exact.ExactLinear) for m in model.modules())


# ---------------------------------------------------------------------------- the real model, both engines
def _embedded() -> bool:
    from treespec.apps.assembly.embedded import SMOLLM2_135M_INSTRUCT, cache_root, is_converted

    return is_converted(cache_root() / SMOLLM2_135M_INSTRUCT.dirname, SMOLLM2_135M_INSTRUCT)


real_model = pytest.mark.skipif(not _embedded() and not os.environ.get("CI"),
                                reason="the embedded model is not converted here (`treespec fetch-model`)")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
@real_model
@pytest.mark.parametrize("engine", ["torch", "llama.cpp"])
def test_trees_on_the_real_model_past_512_positions_are_ars_own_output(engine, two_threads):
    from treespec.apps.kit.testing import check_exact

    if engine == "llama.cpp":
        pytest.importorskip("llama_cpp") if not os.environ.get("CI") else None
    numerics = check_exact("dominotree", engine=engine, prompts=1, tokens=24, context=520)
    assert numerics.exact, numerics.how


@pytest.mark.slow
@real_model
def test_llama_cpps_own_f16_cache_is_not_exact_past_256_cells_on_two_threads(two_threads):
    """What the q8_0 default avoids: with llama.cpp's own f16 K/V cache, a one-token step's flash attention
    splits its keys across threads past 256 cells and sums them otherwise than a tree's batch."""
    if not os.environ.get("CI"):
        pytest.importorskip("llama_cpp")
    from treespec.apps.assembly.embedded import embedded_gguf
    from treespec.apps.assembly.loading import load_target

    target = load_target(embedded_gguf(), engine="llama.cpp", exact=False)
    assert target.cache_type == "f16"
    numerics = target.numerics()
    assert not numerics.exact and numerics.tolerance > 0.1
