"""How the target's token is chosen at a tree node, for every verifier.

Contract
--------
`target_tokens(logits, positions, sampling, generator)` returns one token per row of ``logits``:

* ``T = 0``: the argmax (first index on exact ties).
* ``T > 0``: a sample of softmax(filter(logits) / T), where the filter keeps the top-k tokens and /
  or the top-p nucleus of the target's own distribution.  Sampling is Gumbel-max:
  argmax(logits / T + G) with G i.i.d. standard Gumbel, which is a draw from that softmax.

Where the noise comes from:

* ``position_keyed=True``: the noise of absolute position p comes from a fresh generator seeded by
  ``mix_seed(key, p)``, where ``key = sampling.key`` is drawn once per generation from the caller's
  generator (`sampling_key`): a generator seeded alike reproduces a run, and successive calls with
  one generator draw fresh samples.  Every node at the same position gets the same noise, so a tree
  verifies against exactly the draws autoregressive decoding would make, and speculative output
  equals AR output for a given seed, whatever the tree.
* ``position_keyed=False``: fresh noise for every row from ``generator`` itself (a stream).

Filters are transformers' ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (minimum one token kept),
ties included: top-k keeps every token scoring at least the k-th largest; top-p sorts ascending,
accumulates the softmax and drops the tokens whose cumulative mass is at most 1 - top_p.

The caller's generator is never replaced by a global one; ``generator=None`` at ``T > 0`` is an
error here (the decoder makes one when the user gives none).
"""

from __future__ import annotations

import torch

from treespec.interfaces import SamplingParams
from treespec.topk import row_argmax

__all__ = ["filter_logits", "gumbel_noise", "mix_seed", "sample_from_probs", "sampling_key", "target_probs",
           "target_tokens", "work_dtype"]

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit seed from (seed, position): splitmix64 finaliser of their combination."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E5B) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # non-negative, fits torch's manual_seed


def sampling_key(generator: torch.Generator) -> int:
    """One 62-bit key drawn from ``generator``'s stream: the position-keyed noise of one generation."""
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))


def work_dtype(logits: torch.Tensor) -> torch.dtype:
    """Sampling arithmetic runs in float32 at least (float64 stays float64)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[n, V] logits with the tokens outside top-k / top-p set to -inf (top-k applied first)."""
    out = logits
    if 0 < top_k < logits.shape[-1]:
        kth = out.topk(top_k, dim=-1).values[..., -1:]  # [n, 1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        out = _nucleus(out, top_p)
    return out


def target_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """[n, V] float64 distributions the target samples from at T > 0: softmax of the filtered logits / T."""
    scaled = logits.to(torch.float64) / sampling.temperature
    return filter_logits(scaled, sampling.top_k, sampling.top_p).softmax(-1)


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    # ascending order: drop token j when the mass of j and everything below it is <= 1 - top_p,
    # always keeping the top token (transformers' TopPLogitsWarper, its tie order included)
    sorted_logits, order = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [n, V]
    drop_sorted = cumulative <= (1 - top_p)
    drop_sorted[..., -1:] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def gumbel_noise(positions: torch.Tensor, vocab: int, sampling: SamplingParams,
                 generator: torch.Generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[n, V] standard Gumbel noise, keyed by position or drawn from the generator's stream."""
    n = positions.numel()
    if not sampling.position_keyed:
        exp = torch.empty(n, vocab, dtype=dtype, device=generator.device).exponential_(generator=generator)
        return -exp.log().to(device)
    uniq, inverse = torch.unique(positions.cpu(), return_inverse=True)  # one draw per position
    seed = sampling.key if sampling.key is not None else generator.initial_seed()
    rows = [_keyed_exponential(seed, int(p), vocab, dtype, device) for p in uniq.tolist()]
    return -torch.stack(rows).log()[inverse.to(device)]


def _keyed_exponential(seed: int, position: int, vocab: int, dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(mix_seed(seed, position))
    return torch.empty(vocab, dtype=dtype, device=device).exponential_(generator=gen)  # [V]


def target_tokens(logits: torch.Tensor, positions: torch.Tensor, sampling: SamplingParams,
                  generator: torch.Generator | None) -> torch.Tensor:
    """[n] int64: the target's token for each row of ``logits`` [n, V]; row i sits at ``positions[i]``."""
    if sampling.greedy:
        return row_argmax(logits)
    if generator is None:
        raise ValueError("sampling at temperature > 0 needs an explicit torch.Generator")
    dtype = work_dtype(logits)
    scaled = filter_logits(logits.to(dtype) / sampling.temperature, sampling.top_k, sampling.top_p)
    noise = gumbel_noise(positions, logits.shape[-1], sampling, generator, logits.device, dtype)
    return row_argmax(scaled + noise)  # Gumbel-max: a draw from softmax(scaled)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from a [V] probability vector (need not be normalised), from the generator's stream."""
    exp = torch.empty(probs.shape, dtype=probs.dtype, device=generator.device).exponential_(generator=generator)
    return int((probs.log() - exp.log().to(probs.device)).argmax())  # Gumbel-max on log-probs
