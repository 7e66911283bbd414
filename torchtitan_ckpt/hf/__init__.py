"""Hugging Face format: state-dict adapters built from an HF config, file planning, safetensors
import and export."""

from ..errors import AdapterMismatchError
from .adapter import StateDictAdapter
from .llama import LlamaAdapter, MixtralAdapter, Qwen2Adapter, Qwen3Adapter, Qwen3MoeAdapter
from .load import load_hf
from .model_config import HFModelConfig, read_hf_config
from .planner import parse_size, plan_files
from .registry import ADAPTERS, adapter_for_config, adapter_for_hf_dir
from .save import save_hf

__all__ = [
    "ADAPTERS",
    "AdapterMismatchError",
    "HFModelConfig",
    "LlamaAdapter",
    "MixtralAdapter",
    "Qwen2Adapter",
    "Qwen3Adapter",
    "Qwen3MoeAdapter",
    "StateDictAdapter",
    "adapter_for_config",
    "adapter_for_hf_dir",
    "load_hf",
    "parse_size",
    "plan_files",
    "read_hf_config",
    "save_hf",
]
