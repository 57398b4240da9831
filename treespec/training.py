"""What a drafter family declares so that the apps' training loop can train it.

Contract
--------
Training is split in two.  The loop (`treespec.apps.training.DrafterTrainer`) owns what every
drafter's training shares: the data order, the teacher's view of each sequence (a `TeacherRecord`
read from a teacher cache or computed live), the optimiser and its schedule, bf16 autocast,
checkpoints and resumption, held-out τ and the best weights.  A `TrainingRecipe` (registered as kind
``"recipe"``; the block drafters' is ``"block"``) owns the rest: the configs and presets of its
family, building a drafter for a target (fresh or warm-started from a saved one), the module whose
parameters train, and the loss of one teacher record.  The loop never looks inside a drafter: it
trains ``recipe.trainable`` and saves and reloads the drafter through its ``save_pretrained`` and
``from_pretrained``.

The loop reads these fields of a recipe's config (an attrs class, so ``--set KEY=VALUE`` reaches
every field alike): ``kind`` (a name for the logs), ``steps``, ``lr``, ``warmup_steps``,
``weight_decay``, ``grad_clip``, ``seed``, ``save_every``, ``eval_every``, ``eval_methods``,
``autocast_bf16``, ``teacher_top_k``, ``max_seq_len`` and ``batch_sequences`` (sequences per
optimiser step: the global batch, which data-parallel ranks split); and of the drafter,
``config.target_layer_ids`` (the taps a record's features hold) and the `Drafter` ABC's own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch

from treespec.interfaces import Drafter

__all__ = ["StepLoss", "TeacherRecord", "TrainingRecipe", "draft_vocabulary"]


def draft_vocabulary(counts: torch.Tensor, size: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """[size] the ``size`` most frequent token ids by ``counts`` [V] (ties and unseen tokens by
    ascending id), ascending: a reduced head's vocabulary.  ``keep`` [k]: ids taken first whatever
    their counts (a saved head that grows keeps its tokens)."""
    if not 1 <= size <= counts.numel():
        raise ValueError(f"a draft vocabulary of {size} tokens needs 1 <= size <= {counts.numel()}")
    rank = counts.to(torch.float64)
    if keep is not None:
        if keep.numel() > size:
            raise ValueError(f"cannot keep {keep.numel()} tokens in a draft vocabulary of {size}")
        rank = rank.index_fill(0, keep.to(rank.device), float("inf"))
    order = torch.sort(rank, descending=True, stable=True).indices  # ties keep ascending ids
    return order[:size].sort().values


@attrs.frozen(eq=False)
class TeacherRecord:
    """One sequence with the target's features and next-token distribution."""

    tokens: torch.Tensor  # [T] int64
    response_start: int  # tokens[response_start:] is the response
    features: torch.Tensor  # [T, k*H] bf16 hidden-state taps
    top_ids: torch.Tensor  # [T, K] int64, row t predicts token t + 1
    top_logp: torch.Tensor  # [T, K] float32
    rest_logp: torch.Tensor  # [T] float32 log of the mass outside top_ids


@attrs.frozen(eq=False)
class StepLoss:
    """The loss of one training step and what to log about it."""

    loss: torch.Tensor  # [] scalar, differentiable in the drafter's parameters
    logs: dict[str, float]  # e.g. {"loss": ..., "acc1": ...}: shown and kept in the trainer's history
    label_positions: int  # labelled positions the loss covers (the loop reports them per second)


class TrainingRecipe(ABC):
    """How a family of drafters learns from a frozen target (module docstring)."""

    presets: ClassVar[Mapping[str, Any]] = {}  # preset name -> config of this recipe
    config_type: ClassVar[type]  # the attrs class of this recipe's configs

    def __init__(self, target: torch.nn.Module, drafter: Drafter, config: Any) -> None:
        self.target, self.drafter, self.config = target, drafter, config

    @classmethod
    @abstractmethod
    def new_drafter(cls, target: torch.nn.Module, config: Any, mask_token_id: int,
                    draft_vocab: torch.Tensor | None = None) -> Drafter:
        """A fresh drafter for ``target`` (float32, where the target runs); ``draft_vocab`` [N]: the
        target ids of a reduced head, for a config that asks for one."""

    @classmethod
    @abstractmethod
    def warm_start(cls, target: torch.nn.Module, config: Any, mask_token_id: int, init_dir: str | Path,
                   token_counts: torch.Tensor | None = None) -> Drafter:
        """The drafter saved at ``init_dir`` as the start of a run of ``config``; a ValueError naming the
        fields when it is not the drafter ``config`` would make for ``target``.  ``token_counts`` [V]:
        how often each token occurs in the training responses, for a recipe that grows a saved
        drafter's draft vocabulary."""

    @classmethod
    def warm_config(cls, config: Any) -> Any:
        """The config of a run that starts from a saved drafter (``--init``), for a recipe whose
        schedule should not start over on trained weights; by default ``config`` unchanged."""
        return config

    def lr_scales(self, init_dir: str | Path | None) -> list[tuple[list[torch.nn.Parameter], float]]:
        """Parameters that learn at a multiple of the schedule's rate, as (parameters, multiple) pairs;
        ``init_dir``: the saved drafter a warm start began from (None: fresh weights).  By default none."""
        return []

    @property
    @abstractmethod
    def trainable(self) -> torch.nn.Module:
        """The module whose parameters the optimiser updates (and whose buffers a checkpoint keeps)."""

    @abstractmethod
    def loss(self, record: TeacherRecord, step: int, generator: torch.Generator) -> StepLoss | None:
        """The loss of step ``step`` on ``record`` (None: nothing to learn from it, e.g. too short);
        ``generator`` is the step's own, so a resumed run draws what the uninterrupted one drew."""

    @property
    def eval_methods(self) -> tuple[str, ...]:
        """The methods held-out τ scores, the first picking the best weights (the config's)."""
        return tuple(self.config.eval_methods)
