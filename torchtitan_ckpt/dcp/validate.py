"""Every field of a DCP `.metadata` checked before anything is planned or allocated from it.

The allow-list unpickler guarantees only the classes; here their fields get their types and
bounds: each tensor's dtype, size and chunks (which must cover it exactly, so a load never leaves
part of a tensor as it was), and each storage entry's file (inside the folder: `safe_open.inside`),
offset and length, and that it is stored without transforms. A violation is a
`CorruptCheckpointError` naming the file and the entry. The checks are per entry and per chunk,
not per byte.
"""

from __future__ import annotations

import itertools
import math
import os
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
from ..io.dtypes import storable
from ..io.untrusted import MAX_DIMS, brief

MAX_INT = 2**62
"""Bound of every size, offset and element count: no real tensor or file comes near it."""
FRAMING_BYTES = 16 << 20
"""Most bytes a tensor's item holds beyond its elements' (`torch.save`'s zip records and
directory take a few KB, with its records aligned to 64 bytes by default and to at most a few
MB by `torch.utils.serialization.config.save.storage_alignment`; DCP saves a view's elements
alone, cloning it first)."""
MAX_VALUE_BYTES = 1 << 30
"""Largest non-tensor value item read (a dataloader's or a user's state pickled whole)."""
MAX_CELLS = 1 << 22
"""Most cells the overlap check cuts a tensor into (`_overlap_problem`): a grid of N chunks, as
DCP writes a sharded tensor, makes N; slicing each chunk's rows (`policy.dedup`) a few times N."""


def _ints(value: Any, n: int | None = None) -> bool:
    """A `torch.Size` (as DCP writes every size and offset; it holds only ints) of `n` (any
    number when None) dimensions, each in [0, MAX_INT]."""
    if type(value) is not torch.Size or len(value) > MAX_DIMS or n not in (None, len(value)):
        return False
    return not value or (min(value) >= 0 and max(value) <= MAX_INT)


def _count(value: Any) -> bool:
    """An int in [0, MAX_INT]."""
    return type(value) is int and 0 <= value <= MAX_INT


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
            raise CorruptCheckpointError(f"{path}: key {brief(key)} is not a string")
        problem = _entry_problem(key, md, storage)
        if problem:
            raise CorruptCheckpointError(f"{path}: entry '{key}' {problem}; the file is damaged or crafted")
    _check_storage(storage, root, path)


def _entry_problem(key: str, md: Any, storage: dict) -> str | None:
    if isinstance(md, BytesStorageMetadata):
        info = storage.get(MetadataIndex(key))
        if info is None:
            return "has no storage entry"
        problem = _length_problem(info, MAX_VALUE_BYTES)
        return problem and f"is {problem}"
    if not isinstance(md, TensorStorageMetadata):
        return f"is a {type(md).__name__}, not a tensor or bytes entry"
    props = getattr(md, "properties", None)
    if not isinstance(props, TensorProperties) or not isinstance(getattr(props, "dtype", None), torch.dtype):
        return f"has properties {brief(props)} without a dtype"
    if not storable(props.dtype):
        return f"has the dtype {props.dtype}, which no tensor DCP writes has"
    size, chunks = getattr(md, "size", None), getattr(md, "chunks", None)
    if not _ints(size) or math.prod(size) > MAX_INT:
        return f"has size {brief(size)}, not a torch.Size of at most {MAX_DIMS} non-negative dimensions"
    if not isinstance(chunks, list):
        return f"has chunks {brief(chunks)}, not a list"
    for chunk in chunks:
        if problem := _chunk_problem(chunk, size):
            return problem
        info = storage.get(MetadataIndex(key, chunk.offsets))
        if info is None:
            return f"has no storage entry for its chunk at {list(chunk.offsets)}"
        held = math.prod(chunk.sizes) * props.dtype.itemsize + FRAMING_BYTES
        if problem := _length_problem(info, held):
            return f"has a chunk at {list(chunk.offsets)} {problem}"
    return _coverage_problem(size, chunks)


def _length_problem(info: Any, most: int) -> str | None:
    """Whether a storage entry's length (a count, or `_check_storage` says otherwise) exceeds what
    its entry can hold: a crafted length would make a reader allocate it."""
    length = getattr(info, "length", None)
    if _count(length) and length > most:
        return f"stored in {length} bytes, more than the {most} it can take"
    return None


def _chunk_problem(chunk: Any, size: torch.Size) -> str | None:
    offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
    if (not isinstance(chunk, ChunkStorageMetadata) or not _ints(offsets, len(size))
            or not _ints(sizes, len(size))):
        return f"has a chunk {brief(chunk)} that is not offsets and sizes of {len(size)} dimensions (torch.Size)"
    if any(o + s > n for o, s, n in zip(offsets, sizes, size)):
        return f"has a chunk at {list(offsets)} of {list(sizes)} outside its size {list(size)}"
    return None


def _coverage_problem(size: torch.Size, chunks: list[ChunkStorageMetadata]) -> str | None:
    """Whether the chunks tile the tensor: together they hold every element, and none overlaps
    another."""
    total = math.prod(size)
    held = sum(math.prod(c.sizes) for c in chunks)
    if total and held != total:
        return f"of size {list(size)} has chunks holding {held} of its {total} elements: the load would leave the rest as they were"
    return _overlap_problem(size, [c for c in chunks if math.prod(c.sizes)])


def _overlap_problem(size: torch.Size, boxes: list[ChunkStorageMetadata]) -> str | None:
    """Whether two of `boxes` (chunks inside `size`, each holding elements) overlap. The edges
    of all the boxes cut the tensor into a grid of cells (at most `MAX_CELLS`), and each box
    marks the cells it covers: a cell marked twice is an overlap. A box marks a run of cells
    along one dimension at a time, the one that makes the fewest runs in all, so the cost is
    about the number of boxes for a grid of them, whatever their sizes, and never more than
    the cells."""
    if len(boxes) < 2:
        return None
    dims = range(len(size))
    edges = [sorted({0, size[d], *(b.offsets[d] for b in boxes), *(b.offsets[d] + b.sizes[d] for b in boxes)})
             for d in dims]
    cells = math.prod(len(e) - 1 for e in edges)
    if cells > MAX_CELLS:
        return (f"has {len(boxes)} chunks whose edges cut it into {cells} pieces, more than the {MAX_CELLS} its "
                "overlap check takes: no sharding DCP writes is this irregular")
    at = [{x: i for i, x in enumerate(e)} for e in edges]
    spans = [[(at[d][b.offsets[d]], at[d][b.offsets[d] + b.sizes[d]]) for d in dims] for b in boxes]
    runs = [sum(math.prod(hi - lo for e, (lo, hi) in enumerate(span) if e != d) for span in spans) for d in dims]
    inner = min(dims, key=runs.__getitem__)
    outer = [d for d in dims if d != inner]
    stride, step = {}, 1
    for d in [inner, *reversed(outer)]:
        stride[d], step = step, step * (len(edges[d]) - 1)
    marked, ones = bytearray(cells), b"\x01" * (len(edges[inner]) - 1)
    for k, span in enumerate(spans):
        lo, hi = span[inner]
        for corner in itertools.product(*(range(*span[d]) for d in outer)):
            start = lo + sum(i * stride[d] for i, d in zip(corner, outer))
            if marked.find(1, start, start + hi - lo) >= 0:
                other = next(b for b in boxes[:k] if _overlap(b, boxes[k]))
                return f"has chunks at {list(other.offsets)} and {list(boxes[k].offsets)} that overlap"
            marked[start : start + hi - lo] = ones[: hi - lo]
    return None


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return all(max(x, y) < min(x + m, y + n) for x, m, y, n in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def _check_storage(storage: dict, root: str, path: str) -> None:
    """Every storage entry: an offset and a length, a file inside `root` named as DCP names one
    (no `./`), no transform, and bytes no other entry's range covers in that file (entries
    sharing bytes would make a reader read one value once per entry: a small file costing many
    times its size). Checked by name, with no I/O: every rank checks every entry. DCP
    stores an item through transforms (compression) only when asked to (`_extensions`), and
    this package never asks: reading one would mean reading it after the other items, past the
    checks, and decompressing it without bound, so such a checkpoint is refused before anything
    is read."""
    files: dict[str, list[tuple[int, int, Any]]] = {}
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        transforms = getattr(info, "transform_descriptors", None)
        if not isinstance(index, MetadataIndex) or not _count(offset) or not _count(length):
            problem = f"has offset {brief(offset)} and length {brief(length)}, not byte counts"
        elif transforms:
            problem = (f"is stored through the transforms {brief(transforms)} (compression), which this loader "
                       "does not read; load it with torch.distributed.checkpoint and save it again")
        elif not isinstance(name, str):
            problem = f"names the file {brief(name)}, not a file name"
        elif os.path.normpath(name) != name:  # `./x` beside `x`: one file's bytes under two names
            problem = f"names the file {brief(name)}, not as DCP spells one ({brief(os.path.normpath(name))})"
        else:
            if name not in files:
                safe_open.inside(root, name, f"the storage entry {brief(index.fqn)} in {path}")
                files[name] = []
            if length:
                files[name].append((offset, offset + length, index))
            continue
        raise CorruptCheckpointError(f"{path}: storage entry {brief(getattr(index, 'fqn', index))} {problem}")
    for name, ranges in files.items():  # two names of one file (a link): `io.reader` refuses them
        ranges.sort(key=lambda r: r[:2])
        for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
            if start < end:
                raise CorruptCheckpointError(
                    f"{path}: storage entries {brief(first.fqn)} and {brief(second.fqn)} share bytes of {brief(name)} "
                    "(every item is written to bytes of its own): the file is damaged or crafted")
