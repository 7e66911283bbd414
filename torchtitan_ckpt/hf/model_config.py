"""A Hugging Face `config.json`, read and checked before anything is sized from it.

`HFModelConfig.parse` takes the parsed JSON of a `config.json` and keeps what renaming and
permuting tensors needs: the shapes of every tensor (hidden size, layers, heads, `head_dim`, FFN
and expert widths, vocabulary) and whether the embedding is tied. Every value is checked for its
type and range first, so a hostile or malformed file (a string where a number belongs, zero
heads, 10**7 layers, a 2**40 vocabulary, a list instead of an object) is refused with the key
named before any tensor is allocated. RoPE settings are kept for a model to use; they change the
forward pass, never the weights, so no adapter looks at them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from .files import CONFIG_FILE
from ..io import safe_open

# ceilings far above any published model, low enough that no shape computed from them overflows
MAX_HIDDEN = 1 << 16
MAX_LAYERS = 1 << 12
MAX_HEADS = 1 << 12
MAX_FFN = 1 << 20
MAX_VOCAB = 1 << 24
MAX_EXPERTS = 1 << 12
MAX_CONFIG_BYTES = 16 << 20
"""Far above any model's `config.json` (a few KiB): a larger file is refused, not read whole."""

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"num_key_value_heads": 8},
    "mixtral": {"num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2": {"num_key_value_heads": 32},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128},
    # num_experts, which transformers 5 writes as num_local_experts: the default of either
    "qwen3_moe": {"num_key_value_heads": 4, "num_local_experts": 128, "num_experts_per_tok": 8,
                  "intermediate_size": 6144},
}
"""`model_type` -> the value `transformers` gives a key that a `config.json` leaves out, where
it is not the one `HFModelConfig.parse` gives any family (`num_key_value_heads` = heads,
`head_dim` = hidden / heads, no experts): the defaults of `transformers`' configuration classes
(`MistralConfig`, `Qwen3Config`, `Qwen3MoeConfig`), so that a file read here gives the shapes
`transformers` builds from it. A key given as null takes the value of any family, as in
`transformers`. A key this module requires (`hidden_size`, `moe_intermediate_size`, ...) is
required of every family: refused when missing, never guessed."""

EXPERT_RULES: dict[str, dict[str, Any]] = {
    "mixtral": {"width": "intermediate_size", "norm_topk_prob": True},
}
"""`model_type` -> what a family fixes about its experts that no key of its config says, where it
differs from Qwen3-MoE's rule (experts `moe_intermediate_size` wide, top-k probabilities
renormalised as `norm_topk_prob` says): Mixtral's experts are `intermediate_size` wide, and its
router always renormalises them."""


@dataclass(frozen=True)
class HFModelConfig:
    """The shapes of a decoder-only HF model; `raw` is the `config.json` object as read. One built
    in Python (no `raw`) gets as `raw` its fields as the `config.json` that `transformers` reads
    (what an export writes), checked as `parse` checks a file's: a bad field, or one its family
    fixes otherwise (a Mixtral's experts are `intermediate_size` wide), is a `ConfigError`."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    num_experts: int = 0
    moe_intermediate_size: int = 0
    """The experts' width (a Mixtral's is its `intermediate_size`: `EXPERT_RULES`)."""
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    """The router renormalises a token's top-k probabilities to sum to 1."""
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    where: str = field(default=CONFIG_FILE, compare=False, repr=False)
    """The file read, for messages about a key an adapter needs (`moe_intermediate_size`)."""

    def __post_init__(self) -> None:
        if self.raw:
            return
        where = "HFModelConfig" if self.where == CONFIG_FILE else self.where
        if isinstance(self.mlp_only_layers, list):
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        raw = self._as_json()
        checked = HFModelConfig.parse(raw, where)
        for f in fields(self):
            if f.compare and getattr(checked, f.name) != getattr(self, f.name):
                raise ConfigError(f"{where}: {f.name}", getattr(self, f.name),
                                  f"a {self.model_type} config with these fields gives {getattr(checked, f.name)!r}")
        object.__setattr__(self, "raw", raw)
        object.__setattr__(self, "where", where)

    def _as_json(self) -> dict[str, Any]:
        """The fields as `transformers` names them in a `config.json`."""
        raw = {"model_type": self.model_type, **{k: getattr(self, k) for k in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "tie_word_embeddings")}}
        if self.num_experts:
            raw.update(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok)
            if "width" not in EXPERT_RULES.get(self.model_type, {}):
                raw.update(moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                           decoder_sparse_step=self.decoder_sparse_step,
                           mlp_only_layers=list(self.mlp_only_layers) if isinstance(self.mlp_only_layers, tuple)
                           else self.mlp_only_layers)  # anything else: for `parse` to refuse
        return raw

    def expert_width(self, who: str) -> int:
        """`moe_intermediate_size`, which `who` (a model or an adapter of Qwen3-MoE's layout)
        needs: a config without it (broken, or another family's: Mixtral's) is refused."""
        if not self.moe_intermediate_size:
            raise ConfigError(f"{self.where}: moe_intermediate_size", self.raw.get("moe_intermediate_size"),
                              f"required by {who}: its experts' width, a positive integer")
        return self.moe_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` holds experts, by the rule of `transformers`' Qwen3-MoE."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def parse(cls, raw: Any, where: str = CONFIG_FILE) -> HFModelConfig:
        """Check `raw` (a parsed `config.json`) and keep its shapes; raises `ConfigError` naming
        `where` and the key of the first bad value."""
        raw = config_object(raw, where)
        model_type = _Reader(raw, where).text("model_type")
        get = _Reader(raw, where, FAMILY_DEFAULTS.get(model_type, {}))
        hidden, heads = get.integer("hidden_size", MAX_HIDDEN), get.integer("num_attention_heads", MAX_HEADS)
        kv = get.integer("num_key_value_heads", heads, default=heads)
        if heads % kv:
            raise ConfigError(f"{where}: num_key_value_heads", kv, f"must divide num_attention_heads ({heads})")
        if hidden < heads and get._value("head_dim", None) is None:
            raise ConfigError(f"{where}: num_attention_heads", heads, f"is more than hidden_size ({hidden}) and the "
                              "config gives no head_dim: each head would have hidden_size // num_attention_heads = 0 "
                              "channels")
        head_dim = get.integer("head_dim", MAX_HIDDEN, default=hidden // heads)
        if head_dim % 2:
            raise ConfigError(f"{where}: head_dim", head_dim, "must be even (RoPE rotates pairs of channels)")
        layers = get.integer("num_hidden_layers", MAX_LAYERS)
        moe = _expert_fields(get, layers, EXPERT_RULES.get(model_type, {}))
        return cls(
            model_type=model_type, hidden_size=hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
            intermediate_size=get.integer("intermediate_size", MAX_FFN),
            vocab_size=get.integer("vocab_size", MAX_VOCAB),
            tie_word_embeddings=get.flag("tie_word_embeddings", False), raw=raw, where=where, **moe)


def read_config_json(path: str) -> Any:
    """The `config.json` at `path` as JSON, unchecked (`HFModelConfig.parse` checks it): a regular
    file (a FIFO or a device there is refused, never waited on) inside its folder (a link out of
    it is not followed) of at most `MAX_CONFIG_BYTES`."""
    if not os.path.lexists(path):
        raise CheckpointNotFoundError(f"{path} not found: the folder holds no Hugging Face model config")
    try:
        return json.loads(safe_open.read_bounded(path, "the model config", MAX_CONFIG_BYTES))
    except (OSError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"cannot read the model config {path}: {e}") from e


def config_object(raw: Any, where: str) -> dict[str, Any]:
    """`raw` (a parsed `config.json`, read from `where`) when it is a JSON object, as every
    config must be; else `ConfigError` naming `where`."""
    if not isinstance(raw, dict):
        raise ConfigError(where, type(raw).__name__, "a config.json must hold a JSON object")
    return raw


def read_hf_config(path: str) -> HFModelConfig:
    """Read (`read_config_json`) and check the `config.json` at `path`."""
    return HFModelConfig.parse(read_config_json(path), path)


_MISSING: Any = object()


class _Reader:
    """Typed, bounded reads of a config's keys; each failure names the file and the key."""

    def __init__(self, raw: dict[str, Any], where: str, family: dict[str, Any] | None = None):
        self.raw, self.where, self.family = raw, where, family or {}

    def _value(self, key: str, default: Any) -> Any:
        """The value of `key`; when the config leaves it out, the family's default
        (`FAMILY_DEFAULTS`); when it is null or that too is missing, `default`."""
        value = self.raw.get(key, self.family.get(key))
        if value is None:
            if default is _MISSING:
                raise ConfigError(f"{self.where}: {key}", value, "required; the config does not give it")
            return default
        return value

    def integer(self, key: str, high: int, default: Any = _MISSING, low: int = 1) -> int:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            given = "" if key in self.raw or key not in self.family else \
                " (the config does not give it: this is transformers' default for its model_type)"
            raise ConfigError(f"{self.where}: {key}", value, f"expected an integer in [{low}, {high}]{given}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self._value(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.where}: {key}", value, "expected true or false")
        return value

    def text(self, key: str) -> str:
        value = self._value(key, _MISSING)
        if not isinstance(value, str):
            raise ConfigError(f"{self.where}: {key}", value, "expected a string")
        return value

    def layers(self, key: str, layers: int) -> tuple[int, ...]:
        value = self._value(key, [])
        if not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < layers for v in value):
            raise ConfigError(f"{self.where}: {key}", value, f"expected a list of layer numbers in [0, {layers})")
        return tuple(value)


def _expert_fields(get: _Reader, layers: int, rules: dict[str, Any]) -> dict[str, Any]:
    """The expert fields of a mixture-of-experts config (none of a dense one), as
    `HFModelConfig` keeps them, by its family's `rules` (`EXPERT_RULES`). The experts' width is
    0 when not given, so that the adapter that sizes experts by it requires it
    (`Qwen3MoeAdapter`), and a family no adapter maps is refused for its `model_type`, not for a
    key."""
    local = get.integer("num_local_experts", MAX_EXPERTS, 0, low=0)
    experts = get.integer("num_experts", MAX_EXPERTS, default=local, low=0)
    if not experts:
        return {}
    norm, width = rules.get("norm_topk_prob"), rules.get("width", "moe_intermediate_size")
    return dict(num_experts=experts,
                moe_intermediate_size=get.integer(width, MAX_FFN, default=0, low=0),
                num_experts_per_tok=get.integer("num_experts_per_tok", experts),
                norm_topk_prob=get.flag("norm_topk_prob", False) if norm is None else norm,
                decoder_sparse_step=get.integer("decoder_sparse_step", layers, default=1),
                mlp_only_layers=get.layers("mlp_only_layers", layers))


def positive_float(raw: dict[str, Any], key: str, default: float, where: str = CONFIG_FILE) -> float:
    """A finite positive number of `raw` (a model's RoPE or norm constant)."""
    value = raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{where}: {key}", value, "expected a finite positive number")
    return float(value)
