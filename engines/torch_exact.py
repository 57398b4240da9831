"""Batch-invariant numerics for the torch engine: each row of a forward computed as a one-token step computes it.

Contract
--------
A one-token step and a tree forward run the same model code; they differ only in the shapes the
kernels see (one query row or N; a key among others that are masked), and a BLAS picks other
reduction orders for other shapes.  `install(model)` replaces the shape-dependent reductions by
shape-independent ones, where `probe` measures them to be so here (per dtype, device and intra-op
thread count, once per process):

* **Linears** (`exact_linear`, the model's ``nn.Linear`` modules re-classed as `ExactLinear`): the
  probe finds the row counts at which every row equals the same row of a 64-row call (`RowSizes`);
  a call of m rows is padded with zero rows up to the next such count, a longer one cut into chunks.
  (An AR step pays for the padded rows: 4 on an AVX2 CPU with MKL in float32.)
* **Attention** (`exact_attention`, registered with transformers' ``AttentionInterface`` as
  ``"treespec_exact"``): query row i attends to the keys its mask row shows (the cached prefix, its
  ancestors, itself, in position order) and

  - its scores q.k come from one product over every key, the query rows padded to a stable count and
    the keys to the least width whose columns are stable (a key's score does not depend on the others);
  - its softmax runs over its visible scores gathered in position order, padded with -inf at the end:
    the values a one-token step at its position sums, in the same lanes;
  - its output is those weights, put back in their own columns with zeros elsewhere, times the values,
    one query row at a time: a product the probe shows sums over the keys in order, so the zero terms
    between visible keys change nothing.

  A call told ``treespec_exact=False`` (a prefill, which a run and its AR share) takes SDPA instead.
* Where the probe finds no stable shape (a kernel that splits its sums by shape, a GPU's say),
  `install` leaves the model as it was and returns the reason; the target then states a tolerance.

`probe` reads random matrices of the model's shapes; the target checks the result end to end on the
model itself (`treespec.numerics.step_agreement`) before it claims exactness.
"""

from __future__ import annotations

import functools

import attrs
import torch
import torch.nn.functional as F

__all__ = ["ATTENTION", "AttentionPlan", "ExactLinear", "RowSizes", "attention_plan", "exact_attention",
           "exact_linear", "install", "linear_sizes", "uninstall"]

ATTENTION = "treespec_exact"  # its name in transformers' AttentionInterface
_MAX_ROWS = 64  # the widest call the probe checks rows against; longer calls are cut into chunks of a stable size
_ROW_CANDIDATES = (*range(1, 25), 32, 40, 48, 56, 64)  # row counts the probe tries
_PROBE_WIDTH = 8192  # a probe's output features at most (a vocabulary-wide head is probed at this width)
_KEY_WIDTHS = (*range(1, 65), *range(65, 1100, 41))  # key counts the score probe tries
_PV_TRIALS = 24  # random visible sets the value product is tried on


@attrs.frozen
class RowSizes:
    """The row counts at which a product computes every row alike (ascending; empty: none does)."""

    sizes: tuple[int, ...]

    @property
    def stable(self) -> bool:
        return bool(self.sizes)

    def padded(self, rows: int) -> int:
        """The least stable count >= ``rows`` (``rows`` <= the largest stable count)."""
        return next(s for s in self.sizes if s >= rows)

    def chunks(self, rows: int) -> list[tuple[int, int]]:
        """(start, padded size) of the calls that compute ``rows`` rows: chunks of the largest size, the last
        padded up."""
        largest = self.sizes[-1]
        return [(start, self.padded(min(largest, rows - start))) for start in range(0, rows, largest)]


def _threads() -> int:
    return torch.get_num_threads()


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)


@functools.cache
def _linear_sizes(in_features: int, out_features: int, dtype: torch.dtype, device: torch.device,
                  threads: int) -> RowSizes:
    weight = _randn(min(out_features, _PROBE_WIDTH), in_features, dtype=dtype, device=device, seed=1) / in_features ** 0.5
    x = _randn(_MAX_ROWS, in_features, dtype=dtype, device=device, seed=2)
    ref = F.linear(x, weight)  # [64, O]
    if not torch.equal(F.linear(x.roll(1, 0), weight), ref.roll(1, 0)):
        return RowSizes(())  # a row's result depends on where it sits in the call
    return RowSizes(tuple(m for m in _ROW_CANDIDATES if torch.equal(F.linear(x[:m], weight), ref[:m])))


def linear_sizes(in_features: int, out_features: int, dtype: torch.dtype, device: torch.device) -> RowSizes:
    """`RowSizes` of ``F.linear`` for this shape here, at the current thread count (probed once)."""
    return _linear_sizes(in_features, out_features, dtype, torch.device(device), _threads())


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with every row computed in a call of a stable row count (module docstring)."""
    flat = x.reshape(-1, x.shape[-1])  # [m, K]
    rows = flat.shape[0]
    sizes = linear_sizes(weight.shape[1], weight.shape[0], weight.dtype, weight.device)
    if rows in sizes.sizes:
        out = F.linear(flat, weight, bias)
    else:
        parts = []
        for start, size in sizes.chunks(rows):
            chunk = flat[start:start + size]
            real = chunk.shape[0]
            if size > real:
                chunk = torch.cat([chunk, chunk.new_zeros(size - real, chunk.shape[1])])
            parts.append(F.linear(chunk, weight, bias)[:real])
        out = torch.cat(parts)
    return out.reshape(*x.shape[:-1], out.shape[-1])


class ExactLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward is `exact_linear` on its input in the weight's dtype (`install` re-classes
    the model's own linears, a float32 head among them: parameters and state-dict names stay)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exact_linear(x.to(self.weight.dtype), self.weight, self.bias)


@attrs.frozen
class AttentionPlan:
    """How `exact_attention` computes a head dimension's products here (module docstring)."""

    score_rows: RowSizes  # query rows at which every score row is computed alike
    min_keys: int  # the least key count at which each key's score column is computed alike (keys padded up to it)
    value_rows: int  # the most query rows a value product may take and still sum over the keys in order (0: none)
    min_width: int = 1  # the least row width from which a softmax's values do not depend on -inf after them

    @property
    def stable(self) -> bool:
        return self.score_rows.stable and self.min_keys > 0 and self.value_rows > 0 and self.min_width > 0


def _score_shapes(q: torch.Tensor, keys: torch.Tensor) -> tuple[RowSizes, int]:
    """(the query row counts, the least key count) from which every score equals the same score of a 64-row
    product over every key: each tried row count at each tried key count against that product (0 keys: none)."""
    ref = q @ keys.transpose(1, 2)  # [B, 64, Lmax]
    if not torch.equal(q.roll(1, 1) @ keys.transpose(1, 2), ref.roll(1, 1)):
        return RowSizes(()), 0
    equal = {(m, n): torch.equal(q[:, :m] @ keys[:, :n].transpose(1, 2), ref[:, :m, :n])
             for n in _KEY_WIDTHS for m in _ROW_CANDIDATES}
    wide = [n for n in _KEY_WIDTHS if n > 64]

    def rows_from(least: int) -> tuple[int, ...]:
        return tuple(m for m in _ROW_CANDIDATES if all(equal[m, n] for n in _KEY_WIDTHS if n >= least))

    target = rows_from(wide[0])  # what the long contexts allow
    if not target:
        return RowSizes(()), 0
    least = next(n for n in _KEY_WIDTHS if rows_from(n) == target)
    return RowSizes(target), least


def _value_rows(head_dim: int, dtype: torch.dtype, device: torch.device, most: int = 8) -> int:
    """The most rows m <= ``most`` at which a weights x values product over keys with zero weights among
    them equals the product over the visible keys alone, at every m' <= m (module docstring)."""
    generator = torch.Generator().manual_seed(3)
    values = _randn(2, 1100, head_dim, dtype=dtype, device=device, seed=4)
    for m in range(1, most + 1):
        for _ in range(_PV_TRIALS):
            ctx, width = (int(torch.randint(1, 1000, (), generator=generator)),
                          int(torch.randint(1, 64, (), generator=generator)))
            seen = torch.rand(width, generator=generator) < 0.4
            cols = torch.cat([torch.arange(ctx), ctx + seen.nonzero().flatten()]).to(device)
            weights = torch.rand(2, m, cols.numel(), generator=generator).to(device=device, dtype=dtype)
            spread = torch.zeros(2, m, ctx + width, device=device, dtype=dtype)
            spread[..., cols] = weights
            if not torch.equal(spread @ values[:, :ctx + width], weights @ values[:, cols]):
                return m - 1
    return most


def _softmax_width(dtype: torch.dtype, device: torch.device, widest: int = 160) -> int:
    """The least total width from which a float32 softmax of a row's values followed by -inf gives those
    values the same weights whatever the width (narrower rows take another code path); 0: none does."""
    generator = torch.Generator().manual_seed(7)
    bad = 0
    for real in range(1, 48):
        x = (torch.randn(3, real, generator=generator) * 3).to(device=device, dtype=dtype)
        rows = [torch.cat([x, x.new_full((3, total - real), float("-inf"))], -1) for total in range(real, widest)]
        ref = torch.softmax(rows[-1], -1, dtype=torch.float32)[:, :real]
        bad = max([bad] + [real + i for i, row in enumerate(rows)
                           if not torch.equal(torch.softmax(row, -1, dtype=torch.float32)[:, :real], ref)])
    return 0 if bad >= widest // 2 else bad + 1


@functools.cache
def _attention_plan(head_dim: int, dtype: torch.dtype, device: torch.device, threads: int) -> AttentionPlan:
    q = _randn(2, _MAX_ROWS, head_dim, dtype=dtype, device=device, seed=5)
    keys = _randn(2, _KEY_WIDTHS[-1], head_dim, dtype=dtype, device=device, seed=6)
    rows, min_keys = _score_shapes(q, keys)
    if not rows.stable:
        return AttentionPlan(rows, 0, 0)
    return AttentionPlan(rows, min_keys, _value_rows(head_dim, dtype, device), _softmax_width(dtype, device))


def attention_plan(head_dim: int, dtype: torch.dtype, device: torch.device) -> AttentionPlan:
    """`AttentionPlan` of this head dimension here, at the current thread count (probed once)."""
    return _attention_plan(head_dim, dtype, torch.device(device), _threads())


def _visible(mask: torch.Tensor | None, batch: int, rows: int, keys: int, device: torch.device) -> torch.Tensor:
    """[B, n, L] bool: which keys each query row sees (a bool mask as it is, an additive one where it is 0,
    None: causal, the rows being the last n positions)."""
    if mask is None:
        index = torch.arange(keys, device=device)
        causal = index[None, :] <= index[keys - rows:, None]  # [n, L]
        return causal[None].expand(batch, rows, keys)
    mask = mask[..., :keys]
    seen = mask if mask.dtype == torch.bool else mask == 0
    return seen[:, 0].expand(batch, rows, keys)


def exact_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    treespec_exact: bool = True, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention with each query row reduced over exactly its own keys (module docstring): query [B, H, n, D],
    key and value [B, Hkv, L, D], the mask [B, 1, n, L]; returns [B, n, H, D] as transformers' functions do."""
    if not treespec_exact:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError("treespec's exact attention has no logit soft-capping or sliding window")
    batch, heads, rows, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    plan = attention_plan(dim, query.dtype, query.device)
    scale = dim ** -0.5 if scaling is None else scaling
    seen = _visible(attention_mask, batch, rows, keys, query.device)  # [B, n, L]
    # scores [B * Hkv, G * n, L]: query heads j * G .. j * G + G - 1 share key head j (transformers' repeat_kv)
    q = query.reshape(batch * kv_heads, group * rows, dim)
    k = key.reshape(batch * kv_heads, keys, dim)
    if keys < plan.min_keys:
        k = torch.cat([k, k.new_zeros(k.shape[0], plan.min_keys - keys, dim)], dim=1)
    parts = []
    for start, size in plan.score_rows.chunks(group * rows):  # the query rows in calls of stable row counts
        chunk = q[:, start:start + size]
        real = chunk.shape[1]
        if size > real:
            chunk = torch.cat([chunk, chunk.new_zeros(chunk.shape[0], size - real, dim)], dim=1)
        parts.append((chunk @ k.transpose(1, 2))[:, :real, :keys])
    scores = torch.cat(parts, dim=1) * scale  # [B * Hkv, G * n, L]
    scores = scores.view(batch, kv_heads, group, rows, keys)
    # softmax of each row over its visible keys, gathered in position order, -inf after them
    order = torch.sort((~seen).to(torch.int8), dim=-1, stable=True).indices  # [B, n, L]: visible keys first
    count = seen.sum(-1)  # [B, n]
    index = order[:, None, None].expand(batch, kv_heads, group, rows, keys)
    gathered = scores.gather(-1, index)
    beyond = torch.arange(keys, device=query.device) >= count[..., None]  # [B, n, L]
    gathered = gathered.masked_fill(beyond[:, None, None], float("-inf"))
    if keys < plan.min_width:  # a row this narrow would take the softmax's other code path
        gathered = torch.cat([gathered, gathered.new_full((*gathered.shape[:-1], plan.min_width - keys),
                                                          float("-inf"))], dim=-1)
    weights = torch.softmax(gathered, dim=-1, dtype=torch.float32).to(query.dtype)[..., :keys]
    spread = torch.zeros_like(weights).scatter(-1, index, weights)  # each weight back in its key's column
    # each query row's weights x values, in calls of at most `value_rows` rows: sums over the keys in order
    spread = spread.reshape(batch * kv_heads, group, rows, keys)
    v = value.reshape(batch * kv_heads, keys, dim)
    step = plan.value_rows
    out = torch.stack([torch.cat([spread[:, g:g + step, r] @ v for g in range(0, group, step)], dim=1)
                       for r in range(rows)], dim=2)  # [B * Hkv, G, n, D]
    out = out.reshape(batch, heads, rows, dim).transpose(1, 2).contiguous()
    return out, None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, exact_attention)


def install(model: torch.nn.Module) -> str | None:
    """Make ``model``'s forwards batch-invariant here (module docstring); returns None when done, else the
    reason it cannot be (the model left as it was)."""
    device = next(model.parameters()).device
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for linear in linears:
        sizes = linear_sizes(linear.in_features, linear.out_features, linear.weight.dtype, device)
        if not sizes.stable:
            return (f"no row count computes every row of a {linear.in_features} -> {linear.out_features} "
                    f"{str(linear.weight.dtype).removeprefix('torch.')} product alike on {device}")
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    plan = attention_plan(head_dim, dtype, device)
    if not plan.stable:
        return f"no shape of the attention products is computed alike here ({plan})"
    _register()
    for linear in linears:
        if not isinstance(linear, ExactLinear):
            linear.treespec_class = type(linear)  # what `uninstall` gives back
            linear.__class__ = ExactLinear
    model.treespec_attention = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION)
    return None


def uninstall(model: torch.nn.Module) -> None:
    """Undo `install`: each linear its own class again, the attention it had."""
    for module in model.modules():
        if isinstance(module, ExactLinear):
            module.__class__ = module.treespec_class
    model.set_attn_implementation(getattr(model, "treespec_attention", "sdpa"))
