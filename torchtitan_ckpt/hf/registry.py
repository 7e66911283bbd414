"""Which adapter maps which Hugging Face `model_type`: a new family is one class and one line."""

from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointError, ConfigError
from .adapter import StateDictAdapter
from .files import CONFIG_FILE
from .llama import LlamaAdapter, MixtralAdapter, Qwen2Adapter, Qwen3Adapter, Qwen3MoeAdapter
from .model_config import HFModelConfig, read_config_json

ADAPTERS: dict[str, type[StateDictAdapter]] = {
    "llama": LlamaAdapter,
    "mistral": LlamaAdapter,  # Llama's tensors; sliding-window attention changes no weight
    "mixtral": MixtralAdapter,
    "qwen2": Qwen2Adapter,
    "qwen3": Qwen3Adapter,
    "qwen3_moe": Qwen3MoeAdapter,
}


def adapter_for_config(config: HFModelConfig | Any, hf_assets_path: str | None = None,
                       adapter: str | None = None, where: str = CONFIG_FILE,
                       rope_layout: str | None = None) -> StateDictAdapter:
    """The adapter of `config` (an `HFModelConfig` or a parsed `config.json`), chosen by its
    `model_type` unless `adapter` names one of `ADAPTERS`, for a model of `rope_layout`
    (`adapter.ROPE_LAYOUTS`; None: the family's, as TorchTitan's model of it has). A config
    without a `model_type` takes `adapter`'s (the family's name is its `model_type`)."""
    raw = config.raw if isinstance(config, HFModelConfig) else config
    name = adapter or (config.model_type if isinstance(config, HFModelConfig) else
                       raw.get("model_type") if isinstance(raw, dict) else None)
    if isinstance(raw, dict) and not (isinstance(name, str) and name in ADAPTERS):  # first: another family's
        key = "adapter" if adapter else f"{where}: model_type"  # config names its sizes otherwise (GPT-2)
        raise ConfigError(key, name, f"no adapter for it; supported: {', '.join(sorted(ADAPTERS))}")
    if not isinstance(config, HFModelConfig):
        if adapter and isinstance(raw, dict) and raw.get("model_type") is None:
            config = {**raw, "model_type": adapter}
        config = HFModelConfig.parse(config, where)
    return ADAPTERS[name](config, hf_assets_path, rope_layout)


def adapter_for_hf_dir(hf_dir: str, adapter: str | None = None, rope_layout: str | None = None) -> StateDictAdapter:
    """The adapter of the HF folder `hf_dir`, from its `config.json`; exports copy its config
    and file split."""
    path = os.path.join(hf_dir, CONFIG_FILE)
    return adapter_for_config(read_config_json(path), hf_dir, adapter, path, rope_layout)


def known_hf_names(hf_assets_path: str | None) -> set[str] | None:
    """The tensor names of the Hugging Face model whose assets are in `hf_assets_path`, where its
    `config.json` names a family of `ADAPTERS`: what `transformers` reads of an export beside
    that config (a tied head's copy too, which it takes or leaves); None where not known."""
    path = os.path.join(hf_assets_path, CONFIG_FILE) if hf_assets_path is not None else None
    if path is None or not os.path.isfile(path):
        return None
    try:
        family = adapter_for_config(read_config_json(path), where=path)
    except CheckpointError:  # another family, or a config the export's own checks refuse
        return None
    return {*family.hf_names, *family.tied_copies}
