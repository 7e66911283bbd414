"""Every field of a DCP `.metadata` checked before anything is planned or allocated from it.

The allow-list unpickler guarantees only the classes; here their fields get their types and
bounds: each tensor's dtype, size and chunks (which must cover it exactly, so a load never leaves
part of a tensor as it was), and each storage entry's file (inside the folder: `safe_open.inside`),
offset and length. A violation is a `CorruptCheckpointError` naming the file and the entry. The
checks are per entry and per chunk, not per byte.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CorruptCheckpointError
from ..io import safe_open

MAX_DIMS = 64
MAX_INT = 2**62
"""Bound of every size, offset and element count: no real tensor or file comes near it."""


def _ints(value: Any, n: int | None = None) -> bool:
    """A sequence of `n` (any number when None) ints in [0, MAX_INT]."""
    if not isinstance(value, (torch.Size, tuple, list)) or len(value) > MAX_DIMS or n not in (None, len(value)):
        return False
    if type(value) is not torch.Size and not all(type(v) is int for v in value):  # a Size holds only ints
        return False
    return not value or (min(value) >= 0 and max(value) <= MAX_INT)


def check_metadata(metadata: Metadata, root: str, path: str) -> None:
    """Raise `CorruptCheckpointError` naming `path` unless `metadata` is well formed for the
    checkpoint folder `root`."""
    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CorruptCheckpointError(f"{path}: state_dict_metadata and storage_data must be dicts, found "
                                     f"{type(entries).__name__} and {type(storage).__name__}")
    if not isinstance(getattr(metadata, "storage_meta", None), (StorageMeta, type(None))):
        raise CorruptCheckpointError(f"{path}: storage_meta is a {type(metadata.storage_meta).__name__}")
    for key, md in entries.items():
        if not isinstance(key, str):
            raise CorruptCheckpointError(f"{path}: key {key!r} is not a string")
        problem = _entry_problem(key, md, storage)
        if problem:
            raise CorruptCheckpointError(f"{path}: entry '{key}' {problem}; the file is damaged or crafted")
    _check_storage(storage, root, path)


def _entry_problem(key: str, md: Any, storage: dict) -> str | None:
    if isinstance(md, BytesStorageMetadata):
        return None if MetadataIndex(key) in storage else "has no storage entry"
    if not isinstance(md, TensorStorageMetadata):
        return f"is a {type(md).__name__}, not a tensor or bytes entry"
    props = getattr(md, "properties", None)
    if not isinstance(props, TensorProperties) or not isinstance(getattr(props, "dtype", None), torch.dtype):
        return f"has properties {props!r} without a dtype"
    size, chunks = getattr(md, "size", None), getattr(md, "chunks", None)
    if not _ints(size) or math.prod(size) > MAX_INT:
        return f"has size {size!r}, not a list of at most {MAX_DIMS} non-negative dimensions"
    if not isinstance(chunks, list):
        return f"has chunks {chunks!r}, not a list"
    for chunk in chunks:
        if problem := _chunk_problem(chunk, size):
            return problem
        if MetadataIndex(key, chunk.offsets) not in storage:
            return f"has no storage entry for its chunk at {list(chunk.offsets)}"
    return _coverage_problem(size, chunks)


def _chunk_problem(chunk: Any, size: torch.Size) -> str | None:
    offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
    if (not isinstance(chunk, ChunkStorageMetadata) or not _ints(offsets, len(size))
            or not _ints(sizes, len(size))):
        return f"has a chunk {chunk!r} that is not offsets and sizes of {len(size)} dimensions"
    if any(o + s > n for o, s, n in zip(offsets, sizes, size)):
        return f"has a chunk at {list(offsets)} of {list(sizes)} outside its size {list(size)}"
    return None


def _coverage_problem(size: torch.Size, chunks: list[ChunkStorageMetadata]) -> str | None:
    """Whether the chunks tile the tensor: none overlaps another (a sweep along dimension 0,
    so a tensor split into N chunks costs about N comparisons) and together they hold every
    element."""
    total = math.prod(size)
    held = sum(math.prod(c.sizes) for c in chunks)
    if total and held != total:
        return f"of size {list(size)} has chunks holding {held} of its {total} elements: the load would leave the rest as they were"
    boxes = sorted((c for c in chunks if math.prod(c.sizes)), key=lambda c: tuple(c.offsets))
    open_boxes: list[ChunkStorageMetadata] = []
    for box in boxes:
        start = box.offsets[0] if box.offsets else 0
        open_boxes = [b for b in open_boxes if not b.offsets or b.offsets[0] + b.sizes[0] > start]
        for other in open_boxes:
            if all(max(a, b) < min(a + m, b + n)
                   for a, m, b, n in zip(box.offsets, box.sizes, other.offsets, other.sizes)):
                return f"has chunks at {list(other.offsets)} and {list(box.offsets)} that overlap"
        open_boxes.append(box)
    return None


def _check_storage(storage: dict, root: str, path: str) -> None:
    files: set[str] = set()
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        what = f"entry '{getattr(index, 'fqn', index)}'"
        if not isinstance(index, MetadataIndex) or not _ints((offset, length)):
            raise CorruptCheckpointError(f"{path}: storage {what} has offset {offset!r} and length {length!r}, "
                                         "not byte counts")
        if not isinstance(name, str) or name not in files:
            safe_open.inside(root, name, f"the storage {what} in {path}")
            files.add(name)
