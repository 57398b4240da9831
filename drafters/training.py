"""Training recipe for block drafters (DFlash and Domino) on any Hugging Face causal-LM target.

Contract
--------
`BlockRecipe` (registered as the training recipe ``"block"``) trains a `DFlashDrafter` /
`DominoDrafter` against a frozen target on token sequences (the target's own responses:
self-distillation), in the apps' training loop (`treespec.apps.training`: data order, optimiser,
schedule, checkpoints and held-out τ; the contract between the two is `treespec.training`).  One
step takes one sequence:

1. The teacher's view of the sequence (a `treespec.training.TeacherRecord`, which the loop reads
   from a teacher cache or computes live): the target's hidden-state taps (rounded to bf16) give
   the drafter's context features, its top-K next-token log-probs plus the remaining mass give the
   soft labels.
2. ``anchors_per_sequence`` anchors a are drawn in the response.  Block j is
   ``[token_a, mask, ..., mask]`` at positions ``a .. a+B-1``; it sees the context features of
   positions ``< a`` and itself (bidirectionally), as at inference.  All blocks of a sequence run
   in one forward under one boolean mask.
3. Drafted depth d of block j predicts the token at ``a + d``.  Its loss is
   ``w_d * [(1 - s) CE(hard label) + s CE(target distribution)]`` with the position-decayed weight
   ``w_d = exp(-(d - 1) / gamma)`` of the published recipe (gamma 7 / 5 / 4 for blocks 16 / 10 / 8)
   and soft-label share s.  The soft CE is over the teacher's top K tokens plus one class for the
   rest: -sum_k p_k log q_k - p_rest log(1 - sum_k q_k).
   With a reduced draft vocabulary (``draft_vocab_size`` = N, the N most frequent response tokens)
   the drafter's distribution q is over those N tokens (the head rows of the target's LM head
   for them, as at inference); a hard label outside them adds no hard-label term and teacher mass
   outside them counts as rest.
4. Domino adds its GRU, teacher-forced on the true path: s_0 = GRU(e(token_a)),
   s_i = GRU(s_{i-1}, e(token_{a+i})); corrected logits = base + embed_proj([z ; s]) beyond the
   pure-draft prefix, normalised over the top-M base candidates as DominoTree does at inference
   (a label outside them falls back to the base loss); loss ``(1 - lam) L(corrected) + lam L(base)``
   with lam decayed linearly from ``base_share_start`` (1) to 0 over the run (or to
   ``base_share_floor``).  A warm start's correction is already trained, so there lam starts at
   the floor (``base_share_start`` None: 1 for fresh weights, the floor for ``--init``); restarting
   the decay at 1 would train the base logits alone for a while and undo part of the correction.

`new_drafter` builds a fresh drafter for a target (top layers copied from it), `warm_start` loads a
saved one as a run's start (`grow_layers` adds draft layers that draft nothing at first; with
``grown_lr_scale`` they learn at that multiple of the rate, `BlockRecipe.lr_scales`).
"""

from __future__ import annotations

import math

from pathlib import Path

import attrs
import torch

from treespec.drafters.config import DFlashConfig, DominoHeadConfig, read_config
from treespec.drafters.dflash import DFlashDrafter
from treespec.drafters.domino import DominoDrafter
from treespec.target import spread_layers
from treespec.training import StepLoss, TeacherRecord, TrainingRecipe, draft_vocabulary

__all__ = ["TRAIN_PRESETS", "BlockRecipe", "SoftLabels", "TrainConfig", "decay_weights", "draft_config_for", "grow_layers",
           "init_from_target", "new_drafter", "warm_start"]

_GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}


def _positive_finite(instance, attribute, value) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value}")


def _finite_at_least_zero(instance, attribute, value) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{attribute.name} must be a finite number >= 0, got {value}")


@attrs.frozen
class TrainConfig:
    """Hyper-parameters of one drafter training run."""

    kind: str = attrs.field(default="dflash", validator=attrs.validators.in_(("dflash", "domino")))  # drafter type
    block_size: int = attrs.field(default=8, validator=attrs.validators.ge(2))  # B: block positions per forward
    num_layers: int = attrs.field(default=2, validator=attrs.validators.ge(1))  # draft decoder layers
    target_layer_ids: tuple[int, ...] | None = None  # target layers tapped; None: spread evenly
    init_from_target: bool = True  # start draft layers as copies of the target's top layers
    anchors_per_sequence: int = attrs.field(default=24, validator=attrs.validators.ge(1))  # blocks per sequence and step
    max_seq_len: int = attrs.field(default=384, validator=attrs.validators.ge(2))  # longer sequences are cut
    steps: int = attrs.field(default=2000, validator=attrs.validators.ge(1))  # optimizer steps (batch_sequences sequences each)
    # sequences per optimizer step: the global batch (data-parallel ranks split it)
    batch_sequences: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    lr: float = attrs.field(default=1e-3, validator=_positive_finite)  # AdamW peak learning rate
    warmup_steps: int = attrs.field(default=50, validator=attrs.validators.ge(0))  # linear warm-up, then cosine to 10%
    weight_decay: float = attrs.field(default=0.0, validator=_finite_at_least_zero)  # AdamW weight decay
    grad_clip: float = attrs.field(default=1.0, validator=_positive_finite)  # global gradient-norm clip
    soft_label_share: float = 0.5  # s: weight of CE against the target's distribution
    loss_decay_gamma: float | None = None  # gamma of w_d; None: the published value for the block size
    gru_hidden_dim: int = 256  # Domino: G
    emb_dim: int = 64  # Domino: embed_proj bottleneck E
    pure_draft_prefix_len: int = 1  # Domino: depths 1..this use base logits
    # Domino: base candidates the correction is normalised over (as DominoTree's M)
    top_m: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    base_share_floor: float = 0.0  # Domino: lam never falls below this (its base logits pick depth 1 and top-M)
    base_share_start: float | None = None  # Domino: lam at step 0; None: 1 for fresh weights, the floor for --init
    autocast_bf16: bool | None = None  # bf16 autocast (fp32 master weights); None: on CUDA, or where bf16 is faster
    draft_vocab_size: int | None = None  # N: head over the N most frequent response tokens; None: all V
    # K: teacher log-probs kept per position (soft labels: top K + the rest)
    teacher_top_k: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    seed: int = 0  # data order, anchors and fresh weights
    save_every: int = attrs.field(default=200, validator=attrs.validators.ge(1))  # steps between checkpoints
    # steps between held-out τ evaluations (0: none; needs held-out records)
    eval_every: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    eval_methods: tuple[str, ...] = ()  # methods scored on held-out data; the first picks the best; () by kind
    grown_lr_scale: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))  # lr multiple of added layers

    @property
    def gamma(self) -> float:
        return self.loss_decay_gamma or _GAMMA_BY_BLOCK.get(self.block_size, self.block_size / 2)


# Named presets (docs/embedded.md): the first recipe's SmolLM2 drafters (two layers, full head, live
# target; the base of the recipe sweep) and the shipped ones, trained with exactly the `-v8k-l1`
# presets from teacher caches (one layer, 8,192-token head, 8,000 steps; Domino with the base floor).
_SHIPPED = dict(block_size=8, num_layers=1, anchors_per_sequence=48, draft_vocab_size=8192, steps=8000,
                eval_every=1000, save_every=250)
TRAIN_PRESETS: dict[str, TrainConfig] = {
    "smollm2-dflash": TrainConfig(kind="dflash", block_size=8, num_layers=2, anchors_per_sequence=48),
    "smollm2-domino": TrainConfig(kind="domino", block_size=8, num_layers=2, anchors_per_sequence=48),
    "smollm2-dflash-v8k-l1": TrainConfig(kind="dflash", **_SHIPPED),
    "smollm2-domino-v8k-l1": TrainConfig(kind="domino", base_share_floor=0.3, **_SHIPPED),
}


def decay_weights(depths: int, gamma: float) -> torch.Tensor:
    """[L] w_d = exp(-(d - 1) / gamma) for d = 1..L: early depths matter most for acceptance."""
    return torch.exp(-torch.arange(depths, dtype=torch.float32) / gamma)


def draft_config_for(target_config, cfg: TrainConfig, mask_token_id: int) -> DFlashConfig:
    """A drafter config that fits ``target_config`` (an HF config) with the run's shape choices."""
    n_layers = target_config.num_hidden_layers
    head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    rope = getattr(target_config, "rope_theta", None) or (getattr(target_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    domino = None
    if cfg.kind == "domino":
        domino = DominoHeadConfig(emb_dim=cfg.emb_dim, gru_hidden_dim=cfg.gru_hidden_dim,
                                  pure_draft_prefix_len=cfg.pure_draft_prefix_len)
    return DFlashConfig(
        hidden_size=target_config.hidden_size, intermediate_size=target_config.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=target_config.num_key_value_heads, head_dim=head_dim,
        vocab_size=target_config.vocab_size, num_target_layers=n_layers,
        target_layer_ids=cfg.target_layer_ids or spread_layers(n_layers), mask_token_id=mask_token_id,
        block_size=cfg.block_size, shift_label=cfg.kind == "domino", rms_norm_eps=target_config.rms_norm_eps,
        rope_theta=float(rope), hidden_act=target_config.hidden_act, domino=domino,
        draft_vocab_size=cfg.draft_vocab_size)


@torch.no_grad()
def init_from_target(drafter: DFlashDrafter, target) -> list[str]:
    """Copy the target's top decoder layers (and final norm) into the draft layers where shapes match.

    Returns the names of the drafter parameters that were copied.
    """
    layers = target.model.layers
    offset = len(layers) - len(drafter.model.layers)
    source = {f"layers.{i - offset}.{k}": v for i in range(offset, len(layers))
              for k, v in layers[i].state_dict().items()}
    source["norm.weight"] = target.model.norm.weight
    copied = []
    for name, param in drafter.model.named_parameters():
        if name in source and source[name].shape == param.shape:
            param.copy_(source[name].to(param.dtype))
            copied.append(name)
    return copied


@attrs.frozen(eq=False)
class Batch:
    """One sequence's training blocks."""

    features: torch.Tensor  # [T, k*H] target taps
    tokens: torch.Tensor  # [T] int64
    anchors: torch.Tensor  # [n] int64 anchor positions
    top_ids: torch.Tensor  # [T, K] int64 teacher's most likely next tokens (row t predicts token t+1)
    top_logp: torch.Tensor  # [T, K] float32 their log-probs


@attrs.frozen
class SoftLabels:
    """The teacher's top-K probabilities on the draft vocabulary, sparse: position (j, d)'s label is
    ``probs[j, d, k]`` at draft id ``ids[j, d, k]`` (distinct ids; -1 and probability 0 where the
    teacher's token is outside the draft vocabulary), zero at every other draft id."""

    ids: torch.Tensor  # [n, L, K] int64 draft ids, -1 outside the draft vocabulary
    probs: torch.Tensor  # [n, L, K] float32 teacher probabilities, 0 where ids is -1

    def at(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """[n, L, M] the label's probability at each of ``draft_ids`` [n, L, M]."""
        match = draft_ids[..., :, None] == self.ids[..., None, :]  # [n, L, M, K]
        return (match * self.probs[..., None, :]).sum(-1)

    def dense(self, size: int) -> torch.Tensor:
        """[n, L, size] the labels over the whole draft vocabulary of ``size`` tokens."""
        out = self.probs.new_zeros(*self.ids.shape[:-1], size)
        return out.scatter_add_(-1, self.ids.clamp(min=0), self.probs)


class BlockRecipe(TrainingRecipe):
    """The recipe of the module docstring for `DFlashDrafter` and `DominoDrafter` (``cfg.kind``)."""

    presets = TRAIN_PRESETS
    config_type = TrainConfig

    def __init__(self, target, drafter: DFlashDrafter, cfg: TrainConfig) -> None:
        super().__init__(target, drafter, cfg)
        self.embed, self.head = target.get_input_embeddings(), target.get_output_embeddings()
        ids = drafter.draft_token_ids
        vocab = drafter.config.vocab_size
        self.draft_ids = torch.arange(vocab, device=self.embed.weight.device) if ids is None else ids  # [N]
        self.head_rows = self.head.weight.detach().index_select(0, self.draft_ids)  # [N, H] frozen
        self.to_draft = torch.full((vocab,), -1, dtype=torch.int64, device=self.draft_ids.device)  # [V]
        self.to_draft[self.draft_ids] = torch.arange(self.draft_ids.numel(), device=self.draft_ids.device)

    @classmethod
    def new_drafter(cls, target, config: TrainConfig, mask_token_id: int,
                    draft_vocab: torch.Tensor | None = None) -> DFlashDrafter:
        return new_drafter(target, config, mask_token_id, draft_vocab)

    @classmethod
    def warm_start(cls, target, config: TrainConfig, mask_token_id: int, init_dir: str | Path,
                   token_counts: torch.Tensor | None = None) -> DFlashDrafter:
        return warm_start(target, config, mask_token_id, init_dir, token_counts)

    @classmethod
    def warm_config(cls, config: TrainConfig) -> TrainConfig:
        """Domino's lam starts at its floor on a saved drafter, unless the config names a start."""
        if config.kind != "domino" or config.base_share_start is not None:
            return config
        return attrs.evolve(config, base_share_start=config.base_share_floor)

    def lr_scales(self, init_dir: str | Path | None) -> list[tuple[list[torch.nn.Parameter], float]]:
        """The draft layers a warm start added (`grow_layers`) at ``grown_lr_scale`` times the rate: their
        zeroed output projections start far below the trained layers' scale and grow slowly at 1x."""
        if init_dir is None or self.config.grown_lr_scale == 1.0:
            return []
        added = self.drafter.model.layers[read_config(init_dir).num_hidden_layers:]
        params = [p for layer in added for p in layer.parameters()]
        return [(params, self.config.grown_lr_scale)] if params else []

    @property
    def trainable(self) -> torch.nn.Module:
        return self.drafter.model

    @property
    def eval_methods(self) -> tuple[str, ...]:
        """The config's, else the drafter's tree at budget 16 and its chain."""
        if self.config.eval_methods:
            return tuple(self.config.eval_methods)
        return ("dominotree@16", "domino") if self.config.kind == "domino" else ("ddtree@16", "dflash")

    def loss(self, record: TeacherRecord, step: int, generator: torch.Generator) -> StepLoss | None:
        batch = self.make_batch(record, generator)
        if batch is None:
            return None
        loss, logs = self.batch_loss(batch, step)
        return StepLoss(loss, logs, batch.anchors.numel() * self.drafter.config.num_drafted)

    def base_share(self, step: int) -> float:
        """Domino's lam: the base-logit loss share, decayed linearly from ``base_share_start`` (None: 1)
        to ``base_share_floor``; `warm_config` sets the start of a run from a saved drafter."""
        start = 1.0 if self.config.base_share_start is None else self.config.base_share_start
        return max(self.config.base_share_floor, start - step / max(1, self.config.steps))

    # ------------------------------------------------------------------ data
    def make_batch(self, record: TeacherRecord, generator: torch.Generator) -> Batch | None:
        """The anchors to train on in one teacher record (None when too short)."""
        device = self.embed.weight.device
        tokens = record.tokens[: self.config.max_seq_len].to(device)
        first, last = max(record.response_start - 1, 0), tokens.numel() - 2  # an anchor needs >= 1 label
        if last < first:
            return None
        count = min(self.config.anchors_per_sequence, last - first + 1)
        anchors = first + torch.randperm(last - first + 1, generator=generator)[:count].sort().values
        n = tokens.numel()
        return Batch(record.features[:n].to(device).float(), tokens, anchors.to(device),
                     record.top_ids[:n].to(device), record.top_logp[:n].to(device).float())

    # ------------------------------------------------------------------ forward and loss
    def block_mask(self, anchors: torch.Tensor, context_len: int) -> torch.Tensor:
        """[n*B, T + n*B] bool: block j sees context positions < a_j and its own B positions."""
        size, n = self.drafter.config.block_size, anchors.numel()
        ctx = torch.arange(context_len, device=anchors.device)[None, :] < anchors[:, None]  # [n, T]
        own = torch.eye(n, dtype=torch.bool, device=anchors.device)  # [n, n]
        ctx = ctx.repeat_interleave(size, dim=0)  # [n*B, T]
        blk = own.repeat_interleave(size, dim=0).repeat_interleave(size, dim=1)  # [n*B, n*B]
        return torch.cat([ctx, blk], dim=1)

    def drafted_states(self, batch: Batch) -> torch.Tensor:
        """[n, L, H] hidden states of every drafted depth of every block."""
        cfg, model = self.drafter.config, self.drafter.model
        size, n = cfg.block_size, batch.anchors.numel()
        positions = torch.arange(batch.tokens.numel(), device=batch.tokens.device)
        context = model.context_kv(batch.features.to(self.dtype), positions)
        ids = torch.full((n, size), cfg.mask_token_id, dtype=torch.int64, device=batch.tokens.device)
        ids[:, 0] = batch.tokens[batch.anchors]
        block = self.embed(ids).to(self.dtype).flatten(0, 1)  # [n*B, H]
        block_pos = (batch.anchors[:, None] + torch.arange(size, device=ids.device)).flatten()
        z = model(block, block_pos, context, attn_mask=self.block_mask(batch.anchors, positions.numel()))
        return z.view(n, size, -1)[:, cfg.first_drafted_position:cfg.first_drafted_position + cfg.num_drafted]

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.model.fc.weight.dtype

    def labels(self, batch: Batch) -> tuple[torch.Tensor, SoftLabels, torch.Tensor]:
        """Hard labels [n, L] (target ids), soft labels (the teacher's top K on the draft vocabulary,
        kept sparse) and validity [n, L] of every drafted depth.

        The teacher mass the soft labels lack is the "rest" class of `position_loss`.
        """
        depth = torch.arange(1, self.drafter.config.num_drafted + 1, device=batch.anchors.device)
        pos = batch.anchors[:, None] + depth[None, :]  # [n, L] position of the predicted token
        valid = pos < batch.tokens.numel()
        pos = pos.clamp(max=batch.tokens.numel() - 1)
        top = self.to_draft[batch.top_ids[pos - 1]]  # [n, L, K] draft ids of the teacher's top-K (-1: outside)
        probs = batch.top_logp[pos - 1].exp() * (top >= 0)  # [n, L, K]
        return batch.tokens[pos], SoftLabels(top, probs), valid

    def position_loss(self, logits: torch.Tensor, hard: torch.Tensor, soft: SoftLabels) -> torch.Tensor:
        """[n, L] per-position (1 - s) CE(hard) + s CE(soft) over the draft vocabulary.

        ``logits`` [n, L, N] are over draft ids, ``hard`` [n, L] target ids.  With p_k the teacher's
        kept probabilities (at most K per position, at distinct draft ids):
        CE(soft) = -sum_k p_k log q_k - p_rest log q_rest, p_rest = 1 - sum_k p_k and
        q_rest = 1 - sum_{k: p_k > 0} q_k (the drafter's mass outside the teacher's kept tokens);
        only the label's and the K kept columns of log q are formed, never an [n, L, N] label tensor.
        """
        label = self.to_draft[hard]  # [n, L]; -1: outside the draft vocabulary
        columns = torch.cat([label.clamp(min=0)[..., None], soft.ids.clamp(min=0)], dim=-1)  # [n, L, 1 + K]
        logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, columns)  # [n, L, 1 + K]: one gather
        ce_hard = -logq[..., 0] * (label >= 0)
        logq, kept = logq[..., 1:], soft.probs > 0  # [n, L, K]
        p_rest = (1 - soft.probs.sum(-1)).clamp(min=0)  # [n, L]
        q_rest = (1 - (logq.exp() * kept).sum(-1)).clamp(min=1e-6)
        ce_soft = -(soft.probs * logq).sum(-1) - p_rest * q_rest.log()
        s = self.config.soft_label_share
        return (1 - s) * ce_hard + s * ce_soft

    def batch_loss(self, batch: Batch, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """Weighted block loss at step ``step`` (Domino: mixed base / corrected) and per-depth top-1
        accuracy."""
        z = self.drafted_states(batch)  # [n, L, H]
        # one [n L, H] x [H, N] matmul: z is a slice of the block, which matmul would broadcast the head over
        flat = z.reshape(-1, z.shape[-1]).to(self.head_rows.dtype)  # [n L, H]
        base = (flat @ self.head_rows.T).view(*z.shape[:2], -1).float()  # [n, L, N] over draft ids
        hard, soft, valid = self.labels(batch)
        weights = decay_weights(z.shape[1], self.config.gamma).to(z.device)[None] * valid  # [n, L]
        per_pos = self.position_loss(base, hard, soft)
        if self.drafter.config.is_domino:
            corrected, pred = self.corrected_loss(z, base, hard, soft, batch, per_pos)
            lam = self.base_share(step)
            per_pos = lam * per_pos + (1 - lam) * corrected
        else:
            pred = self.draft_ids[base.argmax(-1)]  # [n, L] target ids
        loss = (per_pos * weights).sum() / weights.sum().clamp(min=1e-6)
        acc = ((pred == hard) & valid).float().sum(0) / valid.float().sum(0).clamp(min=1)
        return loss, {"loss": float(loss.detach()), **{f"acc{d + 1}": float(a) for d, a in enumerate(acc)}}

    def corrected_loss(self, z: torch.Tensor, base: torch.Tensor, hard: torch.Tensor, soft: SoftLabels,
                       batch: Batch, base_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Domino's per-position loss [n, L] and prediction [n, L] under the corrected distribution.

        As at inference, the correction is normalised over the top-M base candidates of each
        position (M = ``top_m``); a label outside them costs the base loss (``base_loss`` [n, L],
        `position_loss` of the base logits) instead.  Depths in the pure-draft prefix use the base
        distribution.  The GRU is teacher-forced on the true path.
        """
        model, cfg = self.drafter.model, self.drafter.config
        n, depth = z.shape[:2]
        path = batch.anchors[:, None] + torch.arange(depth, device=z.device)[None, :]  # anchor, t_{a+1}, ...
        path_tokens = batch.tokens[path.clamp(max=batch.tokens.numel() - 1)]  # [n, L]
        states, _ = model.prefix_gru(self.embed(path_tokens).to(self.dtype))  # [n, L, G]: s_0 .. s_{L-1}
        hidden = model.embed_proj[1](model.embed_proj[0](torch.cat([z, states], dim=-1)))  # [n, L, E]
        cand = base.detach().topk(min(self.config.top_m, base.shape[-1]), dim=-1).indices  # [n, L, M] draft ids
        cand_ids = self.draft_ids[cand]  # [n, L, M] target ids
        w2 = model.embed_proj[2].weight[cand_ids]  # [n, L, M, E]
        logits = base.gather(-1, cand) + (w2 @ hidden[..., None])[..., 0].float()  # [n, L, M]
        logp = torch.log_softmax(logits, dim=-1)
        found = cand_ids == hard[..., None]  # [n, L, M]
        ce_hard = -(logp * found).sum(-1)
        target = soft.at(cand)  # [n, L, M]
        ce_soft = -(target / target.sum(-1, keepdim=True).clamp(min=1e-12) * logp).sum(-1)
        s = self.config.soft_label_share
        corrected = (1 - s) * ce_hard + s * ce_soft
        pure = torch.arange(depth, device=z.device)[None, :] < cfg.domino.pure_draft_prefix_len  # [1, L]
        use_base = pure | ~found.any(-1)
        pred = torch.where(pure, cand_ids[..., 0],  # topk's first: the base argmax
                           cand_ids.gather(-1, logits.argmax(-1, keepdim=True))[..., 0])
        return torch.where(use_base, base_loss, corrected), pred

def new_drafter(target, cfg: TrainConfig, mask_token_id: int,
                draft_vocab: torch.Tensor | None = None) -> DFlashDrafter:
    """A fresh drafter for ``target`` (random weights; top layers copied from the target if asked).

    ``draft_vocab`` [N]: the target ids of a reduced head (required when ``cfg.draft_vocab_size``).
    """
    dcfg = draft_config_for(target.config, cfg, mask_token_id)
    cls = DominoDrafter if cfg.kind == "domino" else DFlashDrafter
    device = target.get_input_embeddings().weight.device  # train where the target runs (CPU or CUDA)
    drafter = cls.random(dcfg, seed=cfg.seed, dtype=torch.float32, device=device)
    if cfg.draft_vocab_size is not None:
        if draft_vocab is None:
            raise ValueError("draft_vocab_size is set: pass the draft vocabulary (see draft_vocabulary)")
        drafter.set_draft_vocab(draft_vocab)
    if cfg.init_from_target:
        init_from_target(drafter, target)
    return drafter


def grow_layers(drafter: DFlashDrafter, target, num_layers: int) -> DFlashDrafter:
    """``drafter`` with ``num_layers`` draft layers: its own layers first, unchanged, then each added
    layer a copy of the target layer below those the drafter's layers started from (one layer: the
    target's top; the added one: its next-to-top), with its two output projections (attention
    ``o_proj``, MLP ``down_proj``) zeroed.  An added block then adds nothing to the residual stream,
    so the grown drafter drafts exactly as ``drafter`` did; the first step's gradient reaches the
    zeroed projections (their inputs are not zero), and through them the rest of the block."""
    old = len(drafter.model.layers)
    config = attrs.evolve(drafter.config, num_hidden_layers=num_layers)
    device = next(drafter.model.parameters()).device
    grown = type(drafter).random(config, dtype=torch.float32, device=device)
    missing, unexpected = grown.model.load_state_dict(drafter.model.state_dict(), strict=False)
    added = tuple(f"layers.{j}." for j in range(old, num_layers))
    if unexpected or any(not k.startswith(added) for k in missing):
        raise ValueError(f"cannot grow this drafter: unexpected {unexpected}, missing {missing}")
    layers = target.model.layers
    with torch.no_grad():
        for j in range(old, num_layers):
            source = layers[len(layers) - 1 - j].state_dict()
            for name, param in grown.model.layers[j].named_parameters():
                if name in source and source[name].shape == param.shape:
                    param.copy_(source[name].to(param.dtype))
            layer = grown.model.layers[j]
            for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
                projection.weight.zero_()
                if projection.bias is not None:
                    projection.bias.zero_()
    return grown


def grow_vocab(drafter: DFlashDrafter, size: int, token_counts: torch.Tensor) -> DFlashDrafter:
    """``drafter`` with a head over ``size`` target tokens: its own draft vocabulary and the most
    frequent others by ``token_counts`` [V] (ties by ascending id).  No weight is indexed by draft id
    (the head rows are the target's, picked by ``d2t``), so every weight carries over unchanged; the
    grown head adds tokens the saved one could never draft."""
    saved = drafter.draft_token_ids
    if saved is None:
        raise ValueError("cannot grow the head of a drafter whose head covers the whole vocabulary")
    ids = draft_vocabulary(token_counts, size, keep=saved.cpu())
    config = attrs.evolve(drafter.config, draft_vocab_size=size)
    device = next(drafter.model.parameters()).device
    grown = type(drafter).random(config, dtype=torch.float32, device=device)
    weights = {k: v for k, v in drafter.model.state_dict().items() if k != "d2t"}
    missing, unexpected = grown.model.load_state_dict(weights, strict=False)
    if unexpected or missing != ["d2t"]:
        raise ValueError(f"cannot grow this drafter's head: unexpected {unexpected}, missing {missing}")
    grown.set_draft_vocab(ids)
    return grown


def warm_start(target, cfg: TrainConfig, mask_token_id: int, init_dir: str | Path,
               token_counts: torch.Tensor | None = None) -> DFlashDrafter:
    """The drafter saved at ``init_dir`` (weights and ``d2t``), in float32 where the target runs, as the
    start of a run of ``cfg`` (``train-drafter --init``): the optimiser starts afresh (its own warm-up).
    A saved drafter that is otherwise the same may be grown: fewer draft layers than ``cfg`` asks for
    (`grow_layers`: it drafts as saved, the added layers start from the target's), a smaller draft
    vocabulary (`grow_vocab`: the saved tokens and the most frequent others by ``token_counts`` [V],
    how often each token occurs in the training responses), or both.

    Refused (ValueError naming the fields) when the saved drafter is not the drafter ``cfg`` would
    make for ``target``: another kind, shape or tap set, or more layers or draft tokens."""
    init_dir = Path(init_dir)
    if not (init_dir / "config.json").is_file():
        raise ValueError(f"--init {init_dir}: no drafter checkpoint here (config.json missing)")
    cls = DominoDrafter if cfg.kind == "domino" else DFlashDrafter
    device = target.get_input_embeddings().weight.device
    try:
        drafter = cls.from_pretrained(init_dir, dtype=torch.float32, device=device)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"--init {init_dir}: cannot load it as a {cfg.kind} drafter ({exc})") from None
    wanted = draft_config_for(target.config, cfg, mask_token_id)
    differ = [f.name for f in attrs.fields(DFlashConfig)
              if f.eq and f.name != "mask_token_id" and getattr(drafter.config, f.name) != getattr(wanted, f.name)]
    grows = {name for name in differ if name in ("num_hidden_layers", "draft_vocab_size")
             and None not in (getattr(drafter.config, name), getattr(wanted, name))
             and getattr(drafter.config, name) < getattr(wanted, name)}
    if "draft_vocab_size" in grows and token_counts is None:
        raise ValueError(f"--init {init_dir}: growing the head to {wanted.draft_vocab_size} tokens needs the "
                         "training responses' token counts")
    if set(differ) - grows:
        raise ValueError(f"--init {init_dir}: the saved drafter differs from the run's config in "
                         + ", ".join(f"{n} ({getattr(drafter.config, n)!r} saved, {getattr(wanted, n)!r} asked)"
                                     for n in differ if n not in grows))
    if "num_hidden_layers" in grows:
        drafter = grow_layers(drafter, target, wanted.num_hidden_layers)
    if "draft_vocab_size" in grows:
        drafter = grow_vocab(drafter, wanted.draft_vocab_size, token_counts)
    return drafter
