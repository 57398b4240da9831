"""Capture a policy's static torch build in a CUDA graph and replay it every round.

Contract
--------
``GraphedBuild(policy, depth, vocab_size)`` (CUDA tensors only) captures, once, the static-mode
build of ``policy`` -- Chain over marginals, DDTree, CaDDTree -- for drafts of shape [L, V].
``build(draft)`` validates the draft on the host, copies its log-probs into the graph's input,
replays the graph and returns the same `DraftTree` as ``policy.build(draft)``.  The root token
only names node 0, so it is written into the output after the replay; a stop rule (CaDDTree) is
applied after the replay to the captured canonical order, keep and trim, as the eager build does.

Policies over a scorer (DominoTree, the Domino chain) are captured with ``scorer=`` a template
`ConditionalScorer` whose class offers ``round_inputs`` / ``with_round_inputs``: its round inputs
(Domino: the drafted rows, the base logits, the anchor) become the graph's input buffers, every
captured build reads a fresh scorer over those buffers, and ``build(draft)`` copies the draft's
scorer's round inputs in.  Drafts whose scorer the graph was not captured for are refused.
"""

from __future__ import annotations

import torch

from treespec.interfaces import ConditionalScorer, DraftOutput
from treespec.policies.engine.best_first import BestFirstPolicy
from treespec.policies.engine.frontier import finish, frontier_selection
from treespec.tree import DraftTree

__all__ = ["GraphedBuild", "static_selection"]


class GraphedBuild:
    """One captured build for one (policy, L, V) on one CUDA device."""

    def __init__(self, policy: BestFirstPolicy, depth: int, vocab_size: int, *, device: torch.device | str = "cuda",
                 warmup: int = 2, scorer: ConditionalScorer | None = None) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.policy, self.template = policy, scorer
        self.logprobs = torch.zeros(depth, vocab_size, device=device)  # the graph's inputs
        self.inputs = None  # the scorer's round inputs, copied in before each replay
        if scorer is not None:
            self.inputs = {k: t.to(device).clone() for k, t in _round_inputs(scorer, "the template scorer").items()}
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up runs allocate outside the capture
            for _ in range(warmup):
                self._run()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self._run()

    def _template_draft(self) -> DraftOutput:
        """A draft over the input buffers, with a fresh scorer (its per-round caches start empty)."""
        scorer = None if self.template is None else self.template.with_round_inputs(self.inputs)
        return DraftOutput(logprobs=self.logprobs, root_token=0, scorer=scorer)

    def _run(self) -> tuple[torch.Tensor, ...]:
        return static_selection(self.policy, self._template_draft())

    def build(self, draft: DraftOutput) -> DraftTree:
        if draft.logprobs.shape != self.logprobs.shape:
            raise ValueError(f"captured for logprobs {tuple(self.logprobs.shape)}, got {tuple(draft.logprobs.shape)}")
        self.policy.validate(draft)
        self._copy_inputs(draft)
        self.graph.replay()
        order, tokens, scores, depths, parents = self.outputs
        tokens = tokens.clone()
        tokens[0] = draft.root_token
        return finish(draft, order, (tokens, scores, depths, parents), self.policy.stop)

    def _copy_inputs(self, draft: DraftOutput) -> None:
        if (draft.scorer is None) != (self.template is None):
            raise ValueError("this GraphedBuild was captured " + ("without a scorer; the draft carries one"
                                                                  if self.template is None else
                                                                  "for a scorer; the draft carries none"))
        self.logprobs.copy_(draft.logprobs)
        if self.template is None:
            return
        inputs = _round_inputs(draft.scorer, "the draft's scorer")
        if inputs.keys() != self.inputs.keys() or any(inputs[k].shape != self.inputs[k].shape for k in inputs):
            raise ValueError(f"captured for scorer inputs { {k: tuple(v.shape) for k, v in self.inputs.items()} }, "
                             f"got { {k: tuple(v.shape) for k, v in inputs.items()} }")
        for name, tensor in inputs.items():
            self.inputs[name].copy_(tensor)


def static_selection(policy: BestFirstPolicy, draft: DraftOutput) -> tuple[torch.Tensor, ...]:
    """What a graph captures of a build: the static-mode selection (order, tokens, scores, depths,
    parents), whose shapes depend on the policy and the draft's shape alone and which never reads a
    tensor's value on the host (it runs on ``meta`` tensors, where such a read fails)."""
    source = policy.source(draft, "static")
    return frontier_selection(draft, source, policy.max_nodes(draft), static=True)


def _round_inputs(scorer: ConditionalScorer, which: str) -> dict[str, torch.Tensor]:
    inputs = scorer.round_inputs()
    if inputs is None:
        raise ValueError(f"{which} ({type(scorer).__name__}) offers no round_inputs: it cannot be captured")
    return inputs
