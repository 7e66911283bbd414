"""The safetensors file format, as far as we read and write it ourselves.

A file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape and
`data_offsets` into the data section; `__metadata__`), then the tensors' raw bytes. Reading a
header touches no tensor data; the writer streams tensors in header order, so no more than one
tensor is held at a time, and fsyncs the file before it is reported complete.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from ..errors import CorruptCheckpointError

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_header(path: str) -> dict[str, TensorEntry]:
    """Name -> dtype and shape of every tensor in the safetensors file `path` (no data read)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                raise ValueError(f"header length {length} is implausible")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        return {name: TensorEntry(_BY_NAME[e["dtype"]], tuple(e["shape"])) for name, e in header.items()}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise CorruptCheckpointError(f"{path} is not a readable safetensors file: {e!r}") from e


class SafetensorsWriter:
    """Writes one safetensors file whose header is known up front; `add()` the tensors in the
    order of `entries`, then `close()` (which fsyncs)."""

    def __init__(self, path: str, entries: dict[str, TensorEntry]):
        self.path = path
        self._pending = list(entries.items())
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, e in self._pending:
            header[name] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape),
                            "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors does
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self._file.write(struct.pack("<Q", len(raw)) + raw)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, entry = self._pending.pop(0)
        if name != expected_name or tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise ValueError(f"{self.path}: got {name} {tensor.dtype} {tuple(tensor.shape)}, "
                             f"expected {expected_name} {entry.dtype} {entry.shape}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))

    def close(self) -> None:
        """Flush and fsync; complain if a tensor of the header was never added."""
        if self._file.closed:
            return
        try:
            if self._pending:
                raise ValueError(f"{self.path}: {len(self._pending)} tensor(s) never written, "
                                 f"e.g. {self._pending[0][0]}")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()
