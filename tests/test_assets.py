"""The drafters shipped for the embedded SmolLM2 target: layout, kind, size, and real decoding.

The decoding test needs the converted target (`treespec fetch-model`) and is skipped without it.
"""

from __future__ import annotations

import pytest
import torch

from treespec.apps.assembly.embedded import SMOLLM2_135M_INSTRUCT, cache_root, is_converted
from treespec.apps.assembly.loading import embedded_drafter_dir, load_drafter

KINDS = ("dflash", "domino")


@pytest.mark.parametrize("kind", KINDS)
def test_shipped_drafter_loads_strictly_in_bf16_at_smollm2_sizes(kind):
    from treespec.drafters.domino import DominoDrafter

    path = embedded_drafter_dir(kind)
    drafter = load_drafter(path)  # strict: every key present, none unexpected
    assert isinstance(drafter, DominoDrafter) == (kind == "domino")
    config = drafter.config
    assert (config.hidden_size, config.vocab_size, config.num_target_layers) == (576, 49152, 30)
    assert all(p.dtype == torch.bfloat16 for p in drafter.model.parameters())
    assert all(torch.isfinite(p.float()).all() for p in drafter.model.parameters())
    assert (path / "model.safetensors").stat().st_size < 30 * 2**20  # small enough to ship


@pytest.mark.parametrize("kind", KINDS)
def test_shipped_drafter_has_the_shape_of_its_named_preset(kind):
    """docs/embedded.md says the shipped drafters are the `smollm2-KIND-v8k-l1` preset's runs."""
    from treespec.drafters.training import TRAIN_PRESETS

    preset, config = TRAIN_PRESETS[f"smollm2-{kind}-v8k-l1"], load_drafter(embedded_drafter_dir(kind)).config
    assert preset.kind == kind
    assert (config.block_size, config.num_hidden_layers, config.draft_vocab_size) == (
        preset.block_size, preset.num_layers, preset.draft_vocab_size)


_CACHED = cache_root() / SMOLLM2_135M_INSTRUCT.dirname


@pytest.mark.skipif(not is_converted(_CACHED, SMOLLM2_135M_INSTRUCT),
                    reason=f"embedded model not converted yet at {_CACHED} (run `treespec fetch-model`)")
@pytest.mark.parametrize("method", ["ddtree@16", "dominotree@16"])
def test_shipped_drafters_decode_losslessly_and_accept_drafts(method):
    """float32 target: the tree's output equals AR's token for token, and drafts are accepted."""
    from transformers import AutoTokenizer

    from treespec.apps.assembly.loading import load_target
    from treespec.apps.assembly.methods import build_policy, parse_method
    from treespec.apps.data.datasets import encode_chat
    from treespec.decoding import SpeculativeDecoder

    target = load_target(_CACHED, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(_CACHED, local_files_only=True)
    ids = torch.as_tensor(encode_chat(tokenizer, ["What is the capital of France?"]), dtype=torch.int64)
    ar = SpeculativeDecoder(target, None, None).generate(ids, max_new_tokens=24)
    parsed = parse_method(method)
    drafter = load_drafter(embedded_drafter_dir(parsed.drafter))
    out = SpeculativeDecoder(target, drafter, build_policy(parsed)).generate(ids, max_new_tokens=24)
    assert out.tokens.tolist() == ar.tokens.tolist()
    assert out.stats.mean_tau > 1.2
