"""A drafter written the way a researcher adds one, living in the tests: a Markov chain over tokens.

Its draft at depth d is the d-step marginal of a [V, V] transition table started at the anchor
(row d = log (P^d)[anchor]), so it reads no target features.  It declares its role (marginal: no
scorer) and its loader (`from_pretrained` of a folder holding ``bigram.safetensors``), and is
registered in tests/conftest.py through the public `treespec.register`; tests/test_new_drafter.py
checks that bench and replay pick it up with no edit in treespec/.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from treespec import DraftContext, Drafter, DraftOutput

NAME = "bigram"


class BigramDrafter(Drafter):
    """Depth-d marginals of a token Markov chain from the anchor."""

    role = "marginal"

    def __init__(self, log_table: torch.Tensor, depth: int) -> None:
        if log_table.dim() != 2 or log_table.shape[0] != log_table.shape[1]:
            raise ValueError(f"the transition table must be [V, V], got {tuple(log_table.shape)}")
        self.table = torch.softmax(log_table.double(), dim=-1)  # [V, V] rows sum to 1
        self.log_table, self.depth = log_table, depth

    @classmethod
    def random(cls, vocab: int, depth: int, seed: int = 0) -> BigramDrafter:
        return cls(3.0 * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)), depth)

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> BigramDrafter:
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        return cls(load_file(str(path / "bigram.safetensors"))["log_table"], int(config["depth"]))

    def save_pretrained(self, path: str | Path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file({"log_table": self.log_table.contiguous()}, str(path / "bigram.safetensors"))
        (path / "config.json").write_text(json.dumps({"depth": self.depth}))
        return path

    def draft(self, ctx: DraftContext) -> DraftOutput:
        rows, state = [], torch.nn.functional.one_hot(torch.tensor(ctx.anchor), self.table.shape[0]).double()
        for _ in range(self.depth):
            state = state @ self.table  # [V] the marginal one step further
            rows.append(state)
        logprobs = torch.stack(rows).clamp_min(1e-300).log().float()  # [L, V]
        return DraftOutput(logprobs=logprobs, root_token=ctx.anchor, position=ctx.position)
