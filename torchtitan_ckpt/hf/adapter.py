"""The contract between a model's own state-dict names and Hugging Face's, and its shared pieces.

A `StateDictAdapter` renames (and where a layout differs, rearranges) tensors in both directions:
`to_hf` converts whole tensors for an export; `hf_sources` tells an import where each of our
tensors comes from, so that each rank reads only the rows of its own shard. It never drops or
invents a tensor silently: a name it does not know, or one it expects and does not find, raises
`AdapterMismatchError` listing both sets.
"""

from __future__ import annotations

import json
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError, CorruptCheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
_FILE_INDEX = re.compile(r"-(\d+)-of-(\d+)\.safetensors$")


class AdapterMismatchError(CheckpointError, KeyError):
    """The tensor names of a state dict or checkpoint are not the ones the adapter maps."""

    def __init__(self, where: str, unknown: list[str], missing: list[str]):
        self.where = where
        self.unknown = sorted(unknown)
        self.missing = sorted(missing)
        super().__init__(where, self.unknown, self.missing)

    def __str__(self) -> str:  # KeyError would print the repr of its args
        return (f"{self.where}: {len(self.unknown)} unknown name(s) {self.unknown} and "
                f"{len(self.missing)} missing name(s) {self.missing}; is the adapter (or the "
                "model flavor) the one this checkpoint was made for?")


def check_names(where: str, found: Any, expected: Any) -> None:
    """Raise `AdapterMismatchError` unless the two name collections are the same set."""
    found, expected = set(found), set(expected)
    if found != expected:
        raise AdapterMismatchError(where, list(found - expected), list(expected - found))


@dataclass(frozen=True)
class HFSource:
    """Where one tensor of our state dict comes from in an HF checkpoint: the HF tensor `name`, of
    the same shape. An adapter that reorders rows within consecutive blocks of rows (an attention
    head) gives `row_order`, one entry per row of a block: our row k of each block is the HF row
    `row_order[k]` of the same block. A rank then reads the blocks its rows fall in, nothing else."""

    name: str
    row_order: tuple[int, ...] = ()

    @property
    def block_rows(self) -> int:
        return len(self.row_order) or 1


class StateDictAdapter(ABC):
    """Converts a model's state dict to Hugging Face names and layout, and back.

    `hf_assets_path` is the HF folder the adapter was built from (its `config.json` and
    `model.safetensors.index.json`), or None; exports copy that config and that file split.
    """

    def __init__(self, hf_assets_path: str | None = None):
        self.hf_assets_path = hf_assets_path

    @abstractmethod
    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Our names -> HF names. Values may be tensors or DTensors."""

    @abstractmethod
    def hf_sources(self, names: Iterable[str]) -> dict[str, HFSource]:
        """Our names -> where each comes from in an HF checkpoint; the inverse of `to_hf`."""

    @abstractmethod
    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        """The `config.json` of an export whose floating tensors are `dtype`."""

    @property
    def fqn_to_index_mapping(self) -> dict[str, int] | None:
        """HF tensor name -> 1-based output file index, from the assets' index; None without one."""
        if self.hf_assets_path is None:
            return None
        return read_file_split(self.hf_assets_path)

    def export_config(self, dtype: torch.dtype) -> dict[str, Any]:
        """The assets' `config.json` when there is one, its dtype set to `dtype` (the one of
        the exported tensors); else `hf_config(dtype)`."""
        path = os.path.join(self.hf_assets_path or "", CONFIG_FILE)
        if self.hf_assets_path is None or not os.path.isfile(path):
            return self.hf_config(dtype)
        with open(path) as f:
            config = json.load(f)
        # transformers 4 writes `torch_dtype`, 5 writes `dtype`
        for key in [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]:
            config[key] = str(dtype).removeprefix("torch.")
        return config


class ForeignAdapter(StateDictAdapter):
    """Any adapter with TorchTitan's `BaseStateDictAdapter` surface (`to_hf`, `from_hf`,
    `fqn_to_index_mapping`, `hf_assets_path`), e.g. TorchTitan's own llama3 / qwen3 /
    deepseek_v3 adapters. Exports go through its `to_hf`; imports read whole tensors and go
    through its `from_hf` (`hf_sources` is None: it cannot say which rows a shard needs, so the
    sharded import of our own adapters does not apply). TorchTitan's adapters write no
    `config.json`: an export copies the one in `hf_assets_path`, if any."""

    def __init__(self, adapter: Any):
        missing = [name for name in ("to_hf", "from_hf") if not callable(getattr(adapter, name, None))]
        if missing:
            raise TypeError(f"{type(adapter).__name__} is not a state-dict adapter: it has no "
                            f"{' or '.join(missing)}()")
        super().__init__(getattr(adapter, "hf_assets_path", None))
        self.adapter = adapter

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self.adapter.to_hf(state_dict)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return self.adapter.from_hf(hf_state_dict)

    def hf_sources(self, names: Iterable[str]) -> None:  # type: ignore[override]
        return None

    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        raise CheckpointError(f"{type(self.adapter).__name__} has no hf_assets_path holding a {CONFIG_FILE}, "
                              "and it cannot write one: give it the model's Hugging Face assets folder")

    @property
    def fqn_to_index_mapping(self) -> dict[str, int] | None:
        return getattr(self.adapter, "fqn_to_index_mapping", None)


def as_adapter(adapter: Any) -> StateDictAdapter | None:
    """Ours as it is; any other (TorchTitan's) behind `ForeignAdapter`."""
    if adapter is None or isinstance(adapter, StateDictAdapter):
        return adapter
    return ForeignAdapter(adapter)


def read_file_split(hf_dir: str) -> dict[str, int] | None:
    """HF name -> file index from `hf_dir`'s index file (None when it has none). Files named
    `*-0000X-of-0000N.safetensors` keep their number; other names are numbered in sorted order."""
    path = os.path.join(hf_dir, INDEX_FILE)
    if not os.path.isfile(path):
        return None
    weight_map = read_index(path)
    files = sorted(set(weight_map.values()))
    numbered = {f: int(m.group(1)) for f in files if (m := _FILE_INDEX.search(f))}
    if len(numbered) != len(files) or sorted(numbered.values()) != list(range(1, len(files) + 1)):
        numbered = {f: i for i, f in enumerate(files, start=1)}
    return {name: numbered[f] for name, f in weight_map.items()}


def read_index(path: str) -> dict[str, str]:
    """The `weight_map` of a `model.safetensors.index.json`."""
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is not a safetensors index with a weight_map: {e}") from e
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: weight_map is a {type(weight_map).__name__}, expected an object")
    for name, file in weight_map.items():
        # a file name that leaves the folder would make a load read (or probe) anything
        if not isinstance(file, str) or os.path.isabs(file) or os.sep in file or file in ("", ".", ".."):
            raise CorruptCheckpointError(f"{path} puts {name} in {file!r}, which is not a file of "
                                         "this folder")
    return weight_map


def permute_rows(w: Any, n_heads: int, to_half_split: bool) -> torch.Tensor:
    """Reorder the rows of a q/k projection, head by head, between RoPE's interleaved layout
    (row 2i+j of a head holds component j of pair i) and the half-split layout (row j*d/2+i).

    Rows of one head may live on several ranks, so a DTensor is gathered to a full tensor first
    (one parameter at a time); the result is a plain tensor."""
    if isinstance(w, DTensor):
        w = w.full_tensor()
    rows, cols = w.shape
    half = rows // n_heads // 2
    split = (n_heads, half, 2, cols) if to_half_split else (n_heads, 2, half, cols)
    return w.reshape(split).transpose(1, 2).reshape(rows, cols)


def rope_row_order(head_dim: int) -> tuple[int, ...]:
    """`HFSource.row_order` of a q/k projection: our (interleaved) row 2i+j of a head is the HF
    (half-split) row j*head_dim/2+i; the inverse of `permute_rows(..., to_half_split=True)`."""
    return tuple(j * (head_dim // 2) + i for i in range(head_dim // 2) for j in range(2))
