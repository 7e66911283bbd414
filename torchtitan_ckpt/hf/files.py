"""The files of a Hugging Face model folder: their names, the tensors in them that no model
loads, and the safetensors format's dtype names and header limit. Every module that names an HF
file or reads a safetensors header takes these from here."""

from __future__ import annotations

import re

import torch

INDEX_FILE = "model.safetensors.index.json"
"""The index of a model split over several files: `weight_map` (tensor -> file)."""
SINGLE_FILE = "model.safetensors"
"""The one file of a model that is not split."""
CONFIG_FILE = "config.json"
"""The model's `transformers` config."""
ASSET_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
               "tekken.json")
"""The files of an assets folder besides `config.json` that an export copies, so that the folder
generates and tokenizes as the assets' model does: `generation_config.json` holds the tokens
`generate` stops at (three for Llama 3.1 Instruct, one in its `config.json`), the others what
`AutoTokenizer` reads (`tekken.json`: Mistral's own tokenizer, for `mistral_common`). Only these
and `TEMPLATES`: an assets folder may hold anything else (the weights)."""
TEMPLATES = "additional_chat_templates"
"""The folder where `transformers` keeps a tokenizer's named chat templates, one `NAME.jinja`
each, beside the default one's `chat_template.jinja`: an export copies it, or a tool-use template
asked for by name would be taken as the template's text."""
MAX_ASSET_BYTES = 64 << 20
"""Largest of `ASSET_FILES` copied, and of `TEMPLATES` all together: a tokenizer of 250,000
tokens is about 20 MB."""
DCP_SHARD_NAME = "shard-0000R-model-0000X-of-0000N.safetensors"
"""The form of the names of DCP's per-rank shard files, for messages (`is_dcp_shard_file`)."""
_NUMBERED = re.compile(r"-(\d+)-of-(\d+)\.safetensors$")
_MODEL_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors", re.ASCII)
_DCP_SHARD_FILE = re.compile(r"shard-\d+-model-\d+-of-\d+\.safetensors", re.ASCII)
_UNUSED_TENSOR = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", re.ASCII)

RECORDED_CONFIG = "hf_config.json"
"""The HF `config.json` that `convert --to dcp` records in the DCP step folder it writes."""
RECORDED_LAYOUT = "rope_layout.json"
"""`{"rope_layout": ...}` (`adapter.ROPE_LAYOUTS`): the RoPE layout of the model whose q/k rows
`convert --to dcp` wrote into a DCP step, recorded beside its copy of the HF config (ours, kept
out of that copy)."""
MAX_RECORDED_LAYOUT_BYTES = 1 << 12
"""Largest `RECORDED_LAYOUT` read: ours is a few bytes."""
MAX_INDEX_BYTES = 64 << 20
"""Largest `model.safetensors.index.json` read: a model of 100,000 tensors names them in a few MB."""
MAX_HEADER_BYTES = 100_000_000
"""The largest safetensors header the `safetensors` library itself reads."""

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2, "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16,
    "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
    "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64, "C64": torch.complex64,
}
"""safetensors' dtype name -> torch dtype, for every dtype with whole bytes per element."""
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}
DTYPE_SIZES: dict[str, int] = {k: v.itemsize for k, v in SAFETENSORS_DTYPES.items()}
"""safetensors' dtype name -> bytes per element."""


def model_file_name(index: int, num_files: int) -> str:
    """The name of file `index` (1-based) of a model split into `num_files` files."""
    return f"model-{index:05d}-of-{num_files:05d}.safetensors"


def file_number(name: str) -> int | None:
    """`...-00002-of-00005.safetensors` -> 2; a name without a number -> None."""
    m = _NUMBERED.search(name)
    return int(m.group(1)) if m else None


def is_model_file(name: str) -> bool:
    """Whether `name` is a model file of an HF export (`model.safetensors` or
    `model-0000X-of-0000N.safetensors`), as opposed to another format's file beside them
    (Mistral's `consolidated.safetensors`)."""
    return _MODEL_FILE.fullmatch(name) is not None


def is_dcp_shard_file(name: str) -> bool:
    """Whether `name` is a per-rank shard file of DCP's `HuggingFaceStorageWriter`
    (`DCP_SHARD_NAME`): the files a two-phase export writes, consolidates, and clears."""
    return _DCP_SHARD_FILE.fullmatch(name) is not None


def is_unused_tensor(name: str) -> bool:
    """Whether the HF tensor `name` is one that `transformers` ignores on load: the RoPE
    `inv_freq` buffers of Llama-2-era checkpoints, which it recomputes from the config."""
    return _UNUSED_TENSOR.fullmatch(name) is not None
