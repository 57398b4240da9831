"""Capture a factorized policy's static torch build in a CUDA graph and replay it every round.

Contract
--------
``GraphedBuild(policy, depth, vocab_size)`` (CUDA tensors only) captures, once, the static-mode
build of ``policy`` -- Chain over marginals, DDTree, CaDDTree -- for drafts of shape [L, V].
``build(draft)`` validates the draft on the host, copies its log-probs into the graph's input,
replays the graph and returns the same `DraftTree` as ``policy.build(draft)``.  The root token
only names node 0, so it is written into the output after the replay; a stop rule (CaDDTree) is
applied after the replay to the captured canonical order.  Drafts carrying a
`ConditionalScorer` are refused: their scorer is not part of the captured inputs.
"""

from __future__ import annotations

import torch

from policies.best_first import BestFirstPolicy
from policies.frontier import assemble, frontier_selection
from treespec.interfaces import DraftOutput
from treespec.tree import DraftTree

__all__ = ["GraphedBuild"]


class GraphedBuild:
    """One captured build for one (policy, L, V) on one CUDA device."""

    def __init__(self, policy: BestFirstPolicy, depth: int, vocab_size: int, *,
                 device: torch.device | str = "cuda", warmup: int = 2) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.policy = policy
        self.logprobs = torch.zeros(depth, vocab_size, device=device)  # the graph's input
        template = DraftOutput(logprobs=self.logprobs, root_token=0)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up runs allocate outside the capture
            for _ in range(warmup):
                self._run(template)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self._run(template)

    def _run(self, draft: DraftOutput) -> tuple[torch.Tensor, ...]:
        source = self.policy.source(draft, "static")
        return frontier_selection(draft, source, self.policy.max_nodes(draft), static=True)

    def build(self, draft: DraftOutput) -> DraftTree:
        if draft.scorer is not None:
            raise ValueError("GraphedBuild captures factorized drafts only; this draft carries a scorer")
        if draft.logprobs.shape != self.logprobs.shape:
            raise ValueError(f"captured for logprobs {tuple(self.logprobs.shape)}, got {tuple(draft.logprobs.shape)}")
        self.policy.validate(draft)
        self.logprobs.copy_(draft.logprobs)
        self.graph.replay()
        order, tokens, scores, depths, parents = self.outputs
        tokens = tokens.clone()
        tokens[0] = draft.root_token
        stop = self.policy.stop
        if stop is not None:
            order = order[: int(stop.keep(draft, scores[order]))]
        return assemble(order, tokens, scores, depths, parents)
