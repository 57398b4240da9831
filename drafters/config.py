"""Typed configuration of the DFlash / Domino draft models, read from and written to config.json.

Contract
--------
`DFlashConfig.from_dict` parses the ``config.json`` of a released z-lab DFlash checkpoint (e.g.
``z-lab/Qwen3-4B-DFlash-b16``) or of a Domino checkpoint (``Huang2020/Qwen3-4B-Domino-b16``) and
`DFlashConfig.to_dict` writes the same layout back:

* Qwen3 keys at the top level: ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
  ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``vocab_size``, ``rms_norm_eps``,
  ``rope_theta`` (or ``rope_parameters.rope_theta``), ``attention_bias``, ``hidden_act``;
* ``block_size`` and ``num_target_layers`` at the top level (``dflash_config`` is accepted too);
* ``dflash_config.mask_token_id`` and ``dflash_config.target_layer_ids`` (0-based target layers;
  the hidden state read is ``hidden_states[id + 1]``, one past the embedding output);
* ``draft_vocab_size`` (optional, top level, as EAGLE-3's draft configs): the head covers only N
  target tokens, listed by the ``d2t`` buffer of the weights (target id = draft id + ``d2t[id]``);
  absent for a full-vocabulary head;
* Domino only: ``dflash_config.projector_type = "domino"``, ``dflash_config.emb_dim`` (also
  duplicated at the top level), ``dflash_config.gru_hidden_dim``,
  ``dflash_config.pure_draft_prefix_len`` and ``dflash_config.shift_label``.

Keys treespec does not interpret are kept in ``extra`` and written back unchanged.  A malformed
config raises `ConfigError` naming the key.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = ["ConfigError", "DFlashConfig", "DominoHeadConfig", "PRESETS", "preset", "read_config"]

DOMINO_PROJECTORS = ("domino",)  # dflash_config.projector_type values that mean a Domino head


class ConfigError(ValueError):
    """A draft-model config.json that is missing a key or holds a value of the wrong type or range."""


def _positive(instance, attribute, value) -> None:
    if value <= 0:
        raise ConfigError(f"{attribute.name} must be positive, got {value}")


def _non_negative(instance, attribute, value) -> None:
    if value < 0:
        raise ConfigError(f"{attribute.name} must be >= 0, got {value}")


@attrs.frozen
class DominoHeadConfig:
    """The Domino correction head: a GRU over the drafted path and a low-rank logit correction."""

    emb_dim: int = attrs.field(default=256, validator=_positive)  # E: width of embed_proj's bottleneck
    gru_hidden_dim: int = attrs.field(default=1024, validator=_positive)  # G: the GRU state size
    pure_draft_prefix_len: int = attrs.field(default=1, validator=_non_negative)  # depths 1..this use base logits
    projector_type: str = "domino"  # dflash_config.projector_type, kept as read


@attrs.frozen
class DFlashConfig:
    """A DFlash draft model (optionally with a Domino head); field names follow config.json."""

    hidden_size: int = attrs.field(validator=_positive)  # H: must equal the target's hidden size
    intermediate_size: int = attrs.field(validator=_positive)  # MLP width of each draft layer
    num_hidden_layers: int = attrs.field(validator=_positive)  # number of draft decoder layers
    num_attention_heads: int = attrs.field(validator=_positive)  # query heads per draft layer
    num_key_value_heads: int = attrs.field(validator=_positive)  # key/value heads (GQA)
    head_dim: int = attrs.field(validator=_positive)  # width of one attention head
    vocab_size: int = attrs.field(validator=_positive)  # V: must equal the target's vocabulary
    num_target_layers: int = attrs.field(validator=_positive)  # decoder layers of the target it was trained on
    target_layer_ids: tuple[int, ...] = attrs.field(converter=tuple)  # 0-based target layers tapped (+1 offset)
    mask_token_id: int = attrs.field(validator=_non_negative)  # token filling block positions 1..B-1
    block_size: int = 16  # B: block positions per forward (anchor + B-1 masks)
    shift_label: bool = False  # True: block position k predicts anchor+k+1 (B drafted tokens, else B-1)
    rms_norm_eps: float = 1e-6  # epsilon of every RMSNorm
    rope_theta: float = 10_000.0  # RoPE base (default rope type only; transformers' Qwen3 default)
    attention_bias: bool = False  # q/k/v/o projections carry biases
    hidden_act: str = "silu"  # MLP activation (transformers ACT2FN name)
    domino: DominoHeadConfig | None = None  # the Domino head, None for plain DFlash
    draft_vocab_size: int | None = None  # N: target tokens the head covers (listed by d2t); None: all V
    extra: dict[str, Any] = attrs.field(factory=dict, eq=False, repr=False)  # uninterpreted config.json keys

    def __attrs_post_init__(self) -> None:
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2, got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.mask_token_id >= self.vocab_size:
            raise ConfigError(f"dflash_config.mask_token_id {self.mask_token_id} is outside the vocabulary "
                              f"(vocab_size {self.vocab_size})")
        self._check_layer_ids()
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ConfigError(f"draft_vocab_size must be in 1..vocab_size ({self.vocab_size}), "
                              f"got {self.draft_vocab_size}")
        if self.domino is not None and self.domino.pure_draft_prefix_len > self.num_drafted:
            raise ConfigError(f"dflash_config.pure_draft_prefix_len {self.domino.pure_draft_prefix_len} exceeds "
                              f"the {self.num_drafted} drafted positions")

    def _check_layer_ids(self) -> None:
        ids = self.target_layer_ids
        if not ids:
            raise ConfigError("dflash_config.target_layer_ids must list at least one target layer")
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < self.num_target_layers]
        if bad:
            raise ConfigError(f"dflash_config.target_layer_ids {list(ids)} has entries {bad} outside "
                              f"0..{self.num_target_layers - 1} (num_target_layers {self.num_target_layers})")

    # ------------------------------------------------------------------ derived
    @property
    def num_drafted(self) -> int:
        """L, drafted tokens per round: B with shift_label, else B - 1 (position 0 holds the anchor)."""
        return self.block_size if self.shift_label else self.block_size - 1

    @property
    def first_drafted_position(self) -> int:
        """Block position whose output predicts the token right after the anchor."""
        return 0 if self.shift_label else 1

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """Indices into Hugging Face's ``hidden_states`` tuple (0 = embedding output)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def is_domino(self) -> bool:
        return self.domino is not None

    # ------------------------------------------------------------------ config.json
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DFlashConfig:
        """Parse a config.json dict; raises `ConfigError` naming the offending key."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        reader = _Reader(raw)
        config = cls(**_backbone_fields(reader), domino=_domino_head(reader), extra=reader.leftover())
        return config

    def to_dict(self) -> dict[str, Any]:
        """The config.json layout of the released checkpoints (unknown keys preserved)."""
        out = copy.deepcopy(self.extra)
        inner = out.pop("dflash_config", {})
        out.setdefault("architectures", ["DominoDraftModel" if self.is_domino else "DFlashDraftModel"])
        out.setdefault("model_type", "qwen3")
        out.update(_backbone_json(self))
        inner.update(mask_token_id=self.mask_token_id, target_layer_ids=list(self.target_layer_ids))
        if self.shift_label or self.is_domino:
            inner["shift_label"] = self.shift_label
        if self.domino is not None:
            out["emb_dim"] = self.domino.emb_dim
            inner.update(projector_type=self.domino.projector_type, emb_dim=self.domino.emb_dim,
                         gru_hidden_dim=self.domino.gru_hidden_dim,
                         pure_draft_prefix_len=self.domino.pure_draft_prefix_len)
        out["dflash_config"] = inner
        return out

    def save(self, directory: str | Path) -> Path:
        """Write ``config.json`` into ``directory``."""
        path = Path(directory) / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path


def read_config(directory: str | Path) -> DFlashConfig:
    """Read ``directory/config.json``."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{directory} holds no drafter checkpoint (no config.json in it)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    return DFlashConfig.from_dict(raw)


# ---------------------------------------------------------------------------- parsing helpers
_MISSING = object()


class _Reader:
    """Typed look-ups in a config dict that remember which keys were consumed."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw
        inner = raw.get("dflash_config", {})
        if inner is None:
            inner = {}
        if not isinstance(inner, Mapping):
            raise ConfigError(f"dflash_config must be a JSON object, got {type(inner).__name__}")
        self.inner = inner
        self.used: set[str] = {"dflash_config"}
        self.used_inner: set[str] = set()

    def top(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        self.used.add(key)
        return _typed(self.raw.get(key), key, kind, default)

    def sub(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        self.used_inner.add(key)
        return _typed(self.inner.get(key), f"dflash_config.{key}", kind, default)

    def either(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        """A key the released configs put at the top level and newer ones inside dflash_config."""
        if self.raw.get(key) is not None:
            self.used_inner.add(key)
            return self.top(key, kind)
        self.used.add(key)
        return self.sub(key, kind, default)

    def leftover(self) -> dict[str, Any]:
        out = {k: copy.deepcopy(v) for k, v in self.raw.items() if k not in self.used}
        inner = {k: copy.deepcopy(v) for k, v in self.inner.items() if k not in self.used_inner}
        if inner:
            out["dflash_config"] = inner
        return out


def _typed(value: Any, name: str, kind: type, default: Any = _MISSING) -> Any:
    """``value`` checked against ``kind``; an absent or null value takes ``default`` when there is one."""
    if value is None:
        if default is _MISSING:
            raise ConfigError(f"config.json lacks the required key {name!r}")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"config key {name!r} must be {kind.__name__}, got {value!r}")
    return value


def _rope_theta(reader: _Reader) -> float:
    params = reader.top("rope_parameters", dict, None) or reader.top("rope_scaling", dict, None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope type {rope_type!r} is not supported (only 'default' RoPE)")
    if "rope_theta" in params:
        reader.used.add("rope_theta")
        return _typed(params["rope_theta"], "rope_parameters.rope_theta", float)
    return reader.top("rope_theta", float, 10_000.0)


def _check_full_attention(reader: _Reader) -> None:
    kinds = reader.raw.get("layer_types") or []
    if reader.raw.get("use_sliding_window") and "sliding_attention" in kinds:
        raise ConfigError("sliding-window draft layers (layer_types 'sliding_attention') are not supported")


def _backbone_fields(reader: _Reader) -> dict[str, Any]:
    _check_full_attention(reader)
    hidden = reader.top("hidden_size", int)
    heads = reader.top("num_attention_heads", int)
    if hidden <= 0 or heads <= 0:
        raise ConfigError(f"hidden_size and num_attention_heads must be positive, got {hidden}, {heads}")
    layer_ids = reader.either("target_layer_ids", list)
    return dict(
        hidden_size=hidden, num_attention_heads=heads,
        intermediate_size=reader.top("intermediate_size", int),
        num_hidden_layers=reader.top("num_hidden_layers", int),
        num_key_value_heads=reader.top("num_key_value_heads", int, heads),
        head_dim=reader.top("head_dim", int, hidden // heads),
        vocab_size=reader.top("vocab_size", int),
        num_target_layers=reader.either("num_target_layers", int),
        target_layer_ids=tuple(_typed(i, "dflash_config.target_layer_ids[]", int) for i in layer_ids),
        mask_token_id=reader.either("mask_token_id", int),
        block_size=reader.either("block_size", int),
        shift_label=reader.sub("shift_label", bool, False),
        rms_norm_eps=reader.top("rms_norm_eps", float, 1e-6),
        rope_theta=_rope_theta(reader),
        attention_bias=reader.top("attention_bias", bool, False),
        hidden_act=reader.top("hidden_act", str, "silu"),
        draft_vocab_size=reader.top("draft_vocab_size", int, None),
    )


def _domino_head(reader: _Reader) -> DominoHeadConfig | None:
    projector = reader.sub("projector_type", str, None)
    if projector is None:
        return None
    if projector not in DOMINO_PROJECTORS:
        raise ConfigError(f"unknown dflash_config.projector_type {projector!r}; supported: {DOMINO_PROJECTORS}")
    return DominoHeadConfig(emb_dim=_emb_dim(reader), gru_hidden_dim=reader.sub("gru_hidden_dim", int),
                            pure_draft_prefix_len=reader.sub("pure_draft_prefix_len", int, 0),
                            projector_type=projector)


def _emb_dim(reader: _Reader) -> int:
    """Released Domino configs carry emb_dim both inside dflash_config and at the top level."""
    inner, top = reader.sub("emb_dim", int, None), reader.top("emb_dim", int, None)
    if inner is not None and top is not None and inner != top:
        raise ConfigError(f"emb_dim differs between the top level ({top}) and dflash_config ({inner})")
    if inner is None and top is None:
        raise ConfigError("config.json lacks the required key 'dflash_config.emb_dim' of a Domino head")
    return inner if inner is not None else top


def _backbone_json(cfg: DFlashConfig) -> dict[str, Any]:
    return dict(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, attention_bias=cfg.attention_bias,
        hidden_act=cfg.hidden_act, block_size=cfg.block_size, num_target_layers=cfg.num_target_layers,
        tie_word_embeddings=False,
    ) | ({} if cfg.draft_vocab_size is None else {"draft_vocab_size": cfg.draft_vocab_size})


# ---------------------------------------------------------------------------- presets
def _qwen3(hidden: int, intermediate: int, domino: bool) -> DFlashConfig:
    """The released Qwen3-4B/8B drafters: 5 layers, block 16, taps [1, 9, 17, 25, 33] of 36."""
    return DFlashConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=5, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, num_target_layers=36,
        target_layer_ids=(1, 9, 17, 25, 33), mask_token_id=151669, block_size=16, shift_label=domino,
        rope_theta=1_000_000.0,
        domino=DominoHeadConfig(emb_dim=256, gru_hidden_dim=1024, pure_draft_prefix_len=1) if domino else None,
    )


PRESETS: dict[str, Callable[[], DFlashConfig]] = {
    "qwen3-4b-dflash-b16": lambda: _qwen3(2560, 9728, domino=False),
    "qwen3-8b-dflash-b16": lambda: _qwen3(4096, 12288, domino=False),
    "qwen3-4b-domino-b16": lambda: _qwen3(2560, 9728, domino=True),
    "qwen3-8b-domino-b16": lambda: _qwen3(4096, 12288, domino=True),
}


def preset(name: str) -> DFlashConfig:
    """A named config (the architecture of a released checkpoint; weights are loaded separately)."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown drafter preset {name!r}; available: {', '.join(sorted(PRESETS))}") from None
