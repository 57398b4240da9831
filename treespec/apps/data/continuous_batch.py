"""Continuous batching for plain generation: a row that finishes hands its place to the next prompt.

Contract:
- `ContinuousBatch(model, ...)` decodes `Job`\\ s (a key, prompt token ids, an optional sampling
  generator) with at most ``size`` rows at once over a Hugging Face causal LM and one KV cache.
  `submit` queues a job, also while `run` is iterating (a second turn can follow a first answer,
  ahead of the waiting jobs with ``front=True``);
  `run` yields a `Finished` for each job as it ends, until no job is queued or decoding.
- Each step feeds every row's last token.  Rows that emit a stop token (kept in the response) or
  reach ``max_new_tokens`` leave at once; when an eighth of the rows are free (or none are left),
  the waiting jobs take their places: their prompts are prefilled together, left-padded, and their
  cache rows joined to the running ones.  The cache is left-padded with one mask, so rows of any
  length share it; columns no row uses any more are dropped.
- Greedy (argmax) at ``temperature == 0``.  Otherwise each job draws from softmax(logits / T) with its
  own generator, so a job's response does not depend on which jobs shared its batch; the batch only
  changes the rounding of the model's matmuls (in float64 every response equals the job decoded
  alone, tested).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator, Sequence

import attrs
import torch

__all__ = ["ContinuousBatch", "Finished", "Job", "generate_responses"]


@attrs.frozen
class Job:
    """One prompt to answer."""

    key: Hashable  # the caller's name for the job, returned with its response
    prompt: Sequence[int]  # token ids, chat template applied
    generator: torch.Generator | None = None  # its sampling stream, on the model's device; required when T > 0


@attrs.frozen
class Finished:
    """A job's response."""

    key: Hashable
    response: list[int]  # generated ids, ending with the stop token when there is one
    finished: bool  # True: ended with a stop token; False: cut at max_new_tokens


class ContinuousBatch:
    """Decodes jobs with at most ``size`` rows at once (see the module docstring)."""

    def __init__(self, model, *, size: int, max_new_tokens: int, stop_ids: Sequence[int], pad_id: int,
                 temperature: float = 0.0) -> None:
        if size < 1 or max_new_tokens < 1:
            raise ValueError(f"a continuous batch needs size >= 1 and max_new_tokens >= 1, "
                             f"got {size} and {max_new_tokens}")
        self.model, self.size, self.max_new_tokens = model, size, max_new_tokens
        self.temperature, self.pad_id = temperature, pad_id
        self.device = model.get_input_embeddings().weight.device  # every row tensor lives with the model
        self._stops = torch.as_tensor(list(stop_ids), dtype=torch.long, device=self.device)
        self._queue: deque[Job] = deque()
        self._jobs: list[Job] = []  # the job of each row
        self._responses: list[list[int]] = []  # [b] generated ids so far
        self._cache = None  # one DynamicCache over every row, left-padded
        self._mask = self._empty(0, 0)  # [b, W] 1 where a cache column is the row's
        self._next_pos = self._empty(0)  # [b] position of each row's next token
        self._last = self._empty(0)  # [b] the token each row feeds next

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.long, device=self.device)

    def submit(self, job: Job, *, front: bool = False) -> None:
        """Queue ``job``; ``front``: before the jobs already waiting (a follow-up that completes a group)."""
        if self.temperature > 0 and job.generator is None:
            raise ValueError(f"job {job.key!r}: sampled responses (temperature > 0) need an explicit torch.Generator")
        if len(job.prompt) == 0:
            raise ValueError(f"job {job.key!r} has an empty prompt")
        if front:
            self._queue.appendleft(job)
        else:
            self._queue.append(job)

    def __len__(self) -> int:
        """Rows decoding now."""
        return len(self._jobs)

    @torch.inference_mode()
    def run(self) -> Iterator[Finished]:
        """Decode until every submitted job (including those submitted meanwhile) has finished."""
        while self._queue or self._jobs:
            free = self.size - len(self._jobs)
            if self._queue and (not self._jobs or free >= max(1, self.size // 8)):
                yield from self._admit([self._queue.popleft() for _ in range(min(free, len(self._queue)))])
            else:
                yield from self._step()

    # ------------------------------------------------------------------ steps
    def _admit(self, jobs: list[Job]) -> Iterator[Finished]:
        """Prefill ``jobs`` together, choose their first tokens and join them to the running rows."""
        from transformers import DynamicCache

        ids, mask = (t.to(self.device) for t in _left_pad([j.prompt for j in jobs], self.pad_id))  # [k, P]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [k, P]; padding is masked, its position unused
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, positions, cache)  # [k, V]
        first = len(self._jobs)
        self._join(cache, mask, positions[:, -1] + 1, jobs)
        yield from self._choose(logits, range(first, len(self._jobs)))

    def _step(self) -> Iterator[Finished]:
        """Every row feeds its last token."""
        self._mask = torch.cat([self._mask, self._mask.new_ones(len(self._jobs), 1)], dim=1)  # [b, W + 1]
        logits = self._forward(self._last[:, None], self._mask, self._next_pos[:, None], self._cache)  # [b, V]
        self._next_pos = self._next_pos + 1
        yield from self._choose(logits, range(len(self._jobs)))

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """Logits of each row's last position, [b, V]; the cache grows by ``ids.shape[1]`` columns."""
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                         logits_to_keep=1)
        return out.logits[:, -1]

    def _choose(self, logits: torch.Tensor, rows: range) -> Iterator[Finished]:
        """Next token of ``rows`` (logits [len(rows), V]); rows that end leave, their responses are yielded."""
        tokens = self._draw(logits, rows)  # [k]
        self._last[rows.start:rows.stop] = tokens
        stopped = torch.isin(tokens, self._stops).tolist()
        ended = []
        for r, token, stop in zip(rows, tokens.tolist(), stopped):
            self._responses[r].append(token)
            if stop or len(self._responses[r]) == self.max_new_tokens:
                ended.append(r)
                yield Finished(self._jobs[r].key, self._responses[r], bool(stop))
        if ended:
            left = set(ended)
            self._keep([r for r in range(len(self._jobs)) if r not in left])

    def _draw(self, logits: torch.Tensor, rows: range) -> torch.Tensor:
        """[k] tokens from [k, V] logits: argmax at temperature 0, else one draw per row from
        softmax(logits / T) with the row's own generator."""
        if self.temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)  # [k, V]
        return torch.cat([torch.multinomial(probs[i], 1, generator=self._jobs[r].generator)
                          for i, r in enumerate(rows)])

    # ------------------------------------------------------------------ the shared cache
    def _join(self, cache, mask: torch.Tensor, next_pos: torch.Tensor, jobs: list[Job]) -> None:
        """Append new rows (their cache, mask [k, P], next positions [k]) after the running ones."""
        if not self._jobs:
            self._cache, self._mask = cache, mask
        else:
            width = max(self._mask.shape[1], mask.shape[1])
            for old, new in zip(self._cache.layers, cache.layers):
                for name in ("keys", "values"):
                    merged = torch.cat([_pad_left(getattr(old, name), width), _pad_left(getattr(new, name), width)])
                    setattr(old, name, merged)  # [b + k, H, width, D]
            self._mask = torch.cat([_pad_left(self._mask, width), _pad_left(mask, width)])
        self._jobs += jobs
        self._responses += [[] for _ in jobs]
        self._next_pos = torch.cat([self._next_pos, next_pos])
        self._last = torch.cat([self._last, self._empty(len(jobs))])

    def _keep(self, rows: list[int]) -> None:
        """Only ``rows`` stay; cache columns that no remaining row uses are dropped."""
        self._jobs = [self._jobs[r] for r in rows]
        self._responses = [self._responses[r] for r in rows]
        if not rows:
            self._cache = None
            self._mask, self._next_pos, self._last = self._empty(0, 0), self._empty(0), self._empty(0)
            return
        index = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        self._mask, self._next_pos, self._last = self._mask[index], self._next_pos[index], self._last[index]
        used = self._mask.any(0).nonzero()  # columns some row still attends to
        start = int(used[0]) if used.numel() else self._mask.shape[1]
        self._mask = self._mask[:, start:]
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)[..., start:, :]
            layer.values = layer.values.index_select(0, index)[..., start:, :]


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, W], attention_mask [B, W]) with the prompts right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def _pad_left(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Zeros on the left of the column dimension (dim 2 of [B, H, W, D] K/V, dim 1 of a [B, W] mask)."""
    dim = 2 if tensor.dim() == 4 else 1
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def generate_responses(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: Sequence[int],
                       pad_id: int, temperature: float = 0.0, generator: torch.Generator | None = None,
                       batch_size: int | None = None) -> list[tuple[list[int], bool]]:
    """(response ids ending at the first stop, finished) per prompt, in order, decoded as one
    continuous batch of ``batch_size`` rows (default: all prompts at once).

    Greedy at ``temperature == 0``; sampled otherwise, each prompt from a stream seeded by a draw from
    ``generator`` (required then), so successive calls draw fresh responses.
    """
    if temperature > 0 and generator is None:
        raise ValueError("sampled responses (temperature > 0) need an explicit torch.Generator")
    if not prompts:
        return []
    seeds = (torch.randint(0, 2**62, (len(prompts),), generator=generator).tolist() if temperature > 0
             else [None] * len(prompts))
    batch = ContinuousBatch(model, size=batch_size or len(prompts), max_new_tokens=max_new_tokens,
                            stop_ids=stop_ids, pad_id=pad_id, temperature=temperature)
    for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
        batch.submit(Job(i, prompt, None if seed is None else torch.Generator(batch.device).manual_seed(seed)))
    results = {done.key: (done.response, done.finished) for done in batch.run()}
    return [results[i] for i in range(len(prompts))]
