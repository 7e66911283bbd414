"""Import a Hugging Face safetensors folder into a (possibly sharded) model state dict.

The names and shapes in the folder's index and file headers are checked against what the
adapter expects before any tensor data is read. Data is then read by DCP's
`HuggingFaceStorageReader`, which copies into each rank's DTensor shard only the byte ranges
of that shard. The adapter's permuted tensors (Llama's `wq`/`wk`) are read whole on every
rank, because a shard's rows come from rows of the whole head elsewhere in the file; each rank
then keeps its own rows.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..storage import root_cause
from .adapter import INDEX_FILE, SINGLE_FILE, StateDictAdapter, check_names, like, read_index
from .safetensors_io import TensorEntry, read_header

logger = logging.getLogger(__name__)


def read_hf_layout(hf_dir: str) -> dict[str, TensorEntry]:
    """Name -> dtype and shape of every tensor of an HF folder (index + headers, no data).
    Safetensors files the index does not list are an error: they would be read as well."""
    index = os.path.join(hf_dir, INDEX_FILE)
    if os.path.isfile(index):
        weight_map = read_index(index)
    elif os.path.isfile(os.path.join(hf_dir, SINGLE_FILE)):
        index = os.path.join(hf_dir, SINGLE_FILE)
        weight_map = dict.fromkeys(read_header(index), SINGLE_FILE)
    else:
        raise CheckpointNotFoundError(f"{hf_dir} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    stray = sorted({f for f in os.listdir(hf_dir) if f.endswith(".safetensors")} - set(weight_map.values()))
    if stray:  # DCP's reader takes every safetensors file of the folder
        raise CheckpointError(f"{hf_dir} holds {stray} besides the checkpoint that "
                              f"{os.path.basename(index)} describes; move them away")
    entries: dict[str, TensorEntry] = {}
    for file in sorted(set(weight_map.values())):
        path = os.path.join(hf_dir, file)
        if not os.path.isfile(path):
            raise CheckpointNotFoundError(f"{index} lists {file}, which does not exist")
        header = read_header(path)
        for name in (n for n, f in weight_map.items() if f == file):
            if name not in header:
                raise CorruptCheckpointError(f"{index} puts {name} in {file}, whose header lacks it")
            entries[name] = header[name]
    return entries


def load_hf(state_dict: dict[str, Any], hf_dir: str, adapter: StateDictAdapter,
            process_group: Any | None = None) -> dict[str, Any]:
    """Fill `state_dict` (our names; tensors or DTensors, read in place) from the HF folder
    `hf_dir`; call on every rank. Returns `state_dict`. Raises `AdapterMismatchError` naming
    the differing tensors, before reading any data, when the folder is not the adapter's."""
    start = time.perf_counter()
    target = adapter.to_hf(state_dict)
    layout = read_hf_layout(hf_dir)
    check_names(hf_dir, layout, target)
    wrong = [f"{n}: {tuple(layout[n].shape)} in the checkpoint, {tuple(t.shape)} expected"
             for n, t in target.items() if tuple(layout[n].shape) != tuple(t.shape)]
    if wrong:
        raise CheckpointError(f"{hf_dir} does not fit this model: {'; '.join(wrong)}")
    try:
        dcp.load(target, storage_reader=HuggingFaceStorageReader(hf_dir), process_group=process_group)
    except CheckpointException as e:
        cause = root_cause(e)
        raise CheckpointError(f"reading {hf_dir} failed: {type(cause).__name__}: {cause}") from None
    with torch.no_grad():
        for name, value in adapter.from_hf(target).items():
            if value is not state_dict[name]:  # rearranged by the adapter: keep this rank's part
                state_dict[name].copy_(like(value, state_dict[name]))
    secs = time.perf_counter() - start
    gb = sum(e.nbytes for e in layout.values()) / 1e9
    if not dist.is_initialized() or dist.get_rank(process_group) == 0:
        logger.info("loaded %s: %.3f GB in %.2f s, %.2f GB/s", hf_dir, gb, secs, gb / max(secs, 1e-9))
    return state_dict
