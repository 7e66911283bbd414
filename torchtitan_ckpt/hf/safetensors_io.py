"""Reading safetensors files ourselves: headers, then byte ranges (writing is
`hf.consolidate`'s).

A file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape and
`data_offsets` into the data section; `__metadata__`), then the tensors' raw bytes. Reading a
header touches no tensor data, and a header larger than the file or the format's limit, with an
unknown dtype or with out-of-bounds offsets, is an error naming the file before anything big is
allocated. Tensor bytes are then read by position (`read_exact`), so threads can share a file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from ..errors import CorruptCheckpointError
from .files import MAX_HEADER_BYTES, SAFETENSORS_DTYPES
from ..io import posio, safe_open
from ..io.untrusted import MAX_DIMS, brief



@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: its dtype and shape, and where its bytes start in `path`."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    path: str
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_header(path: str) -> dict[str, TensorEntry]:
    """Name -> dtype, shape and position of every tensor in the safetensors file `path` (no
    data read)."""
    try:
        with safe_open.open_path(path, "a safetensors file") as f:
            size = os.fstat(f.fileno()).st_size
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"header length {length} exceeds the file ({size} bytes) or the format's limit")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        header.pop("__metadata__", None)
        entries = {name: _entry(name, e, path, 8 + length) for name, e in header.items()}
        _check_offsets(header, entries, size - 8 - length)
        return entries
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError,
            struct.error) as e:
        raise CorruptCheckpointError(f"{path} is not a readable safetensors file: {e!r}") from e


def _entry(name: str, fields: dict, path: str, data_start: int) -> TensorEntry:
    """The entry of tensor `name`, its dtype, shape and `data_offsets` checked (not yet against
    the data section: `_check_offsets`)."""
    if fields["dtype"] not in SAFETENSORS_DTYPES:
        raise ValueError(f"{name[:200]}: dtype {brief(fields['dtype'])} is not one of {sorted(SAFETENSORS_DTYPES)}")
    shape, offsets = fields["shape"], fields["data_offsets"]
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d) for d in shape):
        raise ValueError(f"{name[:200]}: shape {brief(shape)} is not a list of at most {MAX_DIMS} non-negative "
                         "integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(x) for x in offsets):
        raise ValueError(f"{name[:200]}: data_offsets {brief(offsets)} is not a pair of non-negative integers")
    return TensorEntry(SAFETENSORS_DTYPES[fields["dtype"]], tuple(shape), path, data_start + offsets[0])


def _is_count(value: object) -> bool:
    """A non-negative JSON integer: not a bool, nor a float (`json` reads 4.0, 1e999, Infinity
    and NaN as floats)."""
    return type(value) is int and value >= 0


def read_exact(fd: int, bufs: list[memoryview], offset: int, path: str) -> None:
    """Fill `bufs`, one after the other, with the bytes of `path` (open as `fd`) from `offset`
    on: one `preadv` per `IOV_MAX` buffers, so rows bound for scattered places in memory are read
    as one stretch of the file. A file that ends sooner (cut after its header was checked) is an
    error naming it."""
    want = sum(len(b) for b in bufs)
    got = posio.read_into(fd, bufs, offset)
    if got < want:
        raise CorruptCheckpointError(f"{path} ends at byte {offset + got}, inside the {want} bytes from byte "
                                     f"{offset} that its header describes: the file is truncated")


def _check_offsets(header: dict, entries: dict[str, TensorEntry], data_bytes: int) -> None:
    """Each tensor's bytes lie inside the data section, match its dtype and shape, and overlap
    no other tensor's."""
    spans = []
    for name, entry in entries.items():
        start, end = header[name]["data_offsets"]  # a pair of integers: `_entry`
        if not 0 <= start <= end <= data_bytes or end - start != entry.nbytes:
            raise ValueError(f"{name}: data_offsets [{start}, {end}] do not fit {entry.nbytes} bytes "
                             f"in a data section of {data_bytes}")
        spans.append((start, end, name))
    spans.sort()
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{name} and {other} overlap")
