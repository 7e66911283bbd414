"""Reading safetensors files ourselves: headers, then byte ranges (writing is
`hf.consolidate`'s).

A file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape and
`data_offsets` into the data section; `__metadata__`), then the tensors' raw bytes. Reading a
header touches no tensor data, and a header larger than the file or the format's limit, with an
unknown dtype or with out-of-bounds offsets, is an error naming the file before anything big is
allocated; so is one the `safetensors` library refuses (a header not in UTF-8, tensors that do
not tile the data section) or that two readers may read apart (a name given twice). Tensor
bytes are then read by position (`read_exact`), so threads can share a file.
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

MAX_ELEMENTS = 2**63 - 1
"""Most elements the dimensions of a tensor's shape may span, counting each dimension but a 0:
torch indexes elements and strides with 64-bit ints, so a larger shape fails in `torch.empty`
even when a 0 makes it hold nothing."""


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
    data read). The file must be one the `safetensors` library reads: a UTF-8 JSON header
    (`parse_header`), `__metadata__` absent, null or an object of strings, and the tensors'
    bytes tiling the rest of the file (`_check_offsets`)."""
    try:
        with safe_open.open_path(path, "a safetensors file") as f:
            size = os.fstat(f.fileno()).st_size
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"header length {length} exceeds the file ({size} bytes) or the format's limit")
            header = parse_header(f.read(length))
        metadata = header.pop("__metadata__", None)
        if metadata is not None and not (isinstance(metadata, dict)
                                         and all(isinstance(v, str) for v in metadata.values())):
            raise ValueError(f"__metadata__ {brief(metadata)} is not an object of strings")
        entries = {name: _entry(name, e, path, 8 + length) for name, e in header.items()}
        _check_offsets(header, entries, size - 8 - length)
        return entries
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError,
            struct.error) as e:
        raise CorruptCheckpointError(f"{path} is not a readable safetensors file: {e!r}") from e


def parse_header(text: bytes) -> dict:
    """The JSON object of a safetensors header, or `ValueError`. UTF-8 only, as the format and
    the `safetensors` library have it (`json.loads` of bytes would take UTF-16 and UTF-32 too),
    and each key once in each object: `json` keeps the last of a name given twice, so a
    file would hold one tensor for us and maybe another for a reader that keeps the first."""
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"the header is not UTF-8 (byte {e.start}: {e.reason})") from None
    header = json.loads(decoded, object_pairs_hook=_unique_keys, parse_constant=_not_json)
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header


def _not_json(constant: str) -> None:
    """`json` reads NaN and Infinity, which JSON (and the `safetensors` library) does not have."""
    raise ValueError(f"the header holds {constant}, which is not JSON")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"the header names {_shown(key)} twice")
        seen.add(key)
    return dict(pairs)


def _entry(name: str, fields: dict, path: str, data_start: int) -> TensorEntry:
    """The entry of tensor `name`, its dtype, shape and `data_offsets` checked (not yet against
    the data section: `_check_offsets`)."""
    if not isinstance(fields, dict) or not {"dtype", "shape", "data_offsets"} <= fields.keys():
        raise ValueError(f"{_shown(name)}: {brief(fields)} is not an object with dtype, shape and data_offsets")
    if not isinstance(fields["dtype"], str) or fields["dtype"] not in SAFETENSORS_DTYPES:
        raise ValueError(f"{_shown(name)}: dtype {brief(fields['dtype'])} is not one of {sorted(SAFETENSORS_DTYPES)}")
    shape, offsets = fields["shape"], fields["data_offsets"]
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d) for d in shape):
        raise ValueError(f"{_shown(name)}: shape {brief(shape)} is not a list of at most {MAX_DIMS} non-negative "
                         "integers")
    if math.prod(d for d in shape if d) > MAX_ELEMENTS:
        raise ValueError(f"{_shown(name)}: shape {brief(shape)} spans more than the {MAX_ELEMENTS} elements a tensor "
                         "can index (even when one of its dimensions is 0)")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(x) for x in offsets):
        raise ValueError(f"{_shown(name)}: data_offsets {brief(offsets)} is not a pair of non-negative integers")
    return TensorEntry(SAFETENSORS_DTYPES[fields["dtype"]], tuple(shape), path, data_start + offsets[0])


def _shown(name: str) -> str:
    """A tensor's name as messages give it: at most its first 200 characters (a crafted header
    may hold a name of megabytes; the `CorruptCheckpointError` it reaches the caller in escapes it)."""
    return name[:200]


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
    """The tensors' bytes tile the data section, as the `safetensors` library requires: each
    tensor's span holds its dtype and shape, and in order of their offsets the spans start at
    0, each where the one before ends, the last where the file ends. A byte of two tensors, of
    none (a hole, or trailing bytes), or beyond the file (a truncated file) is an error."""
    spans = []
    for name, entry in entries.items():
        start, end = header[name]["data_offsets"]  # a pair of integers: `_entry`
        if end - start != entry.nbytes:
            raise ValueError(f"{_shown(name)}: data_offsets [{start}, {end}] do not fit its {entry.nbytes} bytes")
        spans.append((start, end, name))
    spans.sort()
    reached, before = 0, None
    for start, end, name in spans:
        if start != reached:
            problem = f"overlap {_shown(before)}'s" if start < reached else f"leave [{reached}, {start}) to no tensor"
            raise ValueError(f"{_shown(name)}: data_offsets [{start}, {end}] {problem}")
        reached, before = end, name
    if reached != data_bytes:
        problem = "the file is truncated" if reached > data_bytes else "the bytes after them belong to no tensor"
        raise ValueError(f"the tensors end at byte {reached} of a data section of {data_bytes}: {problem}")
