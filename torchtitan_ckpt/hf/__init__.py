"""Hugging Face format: state-dict adapters, file planning, safetensors import and export."""

from .adapter import AdapterMismatchError, StateDictAdapter
from .llama import LlamaAdapter, hf_llama_config, llama_args_from_hf_config
from .load import load_hf
from .planner import parse_size, plan_files
from .save import save_hf

__all__ = [
    "AdapterMismatchError",
    "LlamaAdapter",
    "StateDictAdapter",
    "hf_llama_config",
    "llama_args_from_hf_config",
    "load_hf",
    "parse_size",
    "plan_files",
    "save_hf",
]
