"""Writing one rank's DCP data files: the bytes DCP's `FileSystemWriter` would write, faster.

A file holds its items back to back in DCP's default format (a value's pickled bytes, or a
tensor as one `torch.save` archive), so plain `dcp.load` with `FileSystemReader` reads it.
What differs is how the bytes reach the disk:

- a tensor's archive is framed by `torch.save` under `torch.serialization.skip_data()` and its
  storage bytes are written straight from the tensor's memory, in large chunks, instead of
  through `torch.save`'s own copy and CRC (the archive's per-record CRC is left 0, as
  `torch.serialization.set_crc32_options(False)` does; the commit manifest's CRC-32 of the
  whole file, computed here on the way out, covers every byte instead);
- after each chunk the kernel is told to start writing it back (`sync_file_range` on Linux),
  so the final fsync waits for the last chunk only rather than for the whole file;
- small header writes are buffered.

This module has no DCP planner or process group in it: a `FileJob` carries resolved data, so
the same function runs in the training process or in the writer process of
`async_with_pinned_mem` (see `writer_process`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import os
import sys
import zlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from . import faults

CHUNK_BYTES = 32 << 20
"""Bytes written (and handed to writeback) per system call for large tensors."""
_SMALL = 64 << 10  # writes below this are gathered into one buffer


@dataclass
class Entry:
    """One item of a file: a value's bytes, or a tensor (a view, or on another device, is
    copied into a CPU tensor of its own first, as `torch.save` would write the whole storage)."""

    key: object
    """Opaque to this module (DCP's `MetadataIndex`); handed back with the item's place."""
    data: bytes | torch.Tensor


@dataclass
class FileJob:
    path: str
    """Where to write; the file must not be open elsewhere."""
    entries: list[Entry]


@dataclass
class FileResult:
    size: int
    crc32: str
    places: list[tuple[object, int, int]] = field(default_factory=list)
    """(entry key, offset, length) of every entry, in file order."""


def _libc_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


class _RunningCrc:
    """CRC-32 of everything fed to it, in order, computed on a helper thread so that it overlaps
    the write system calls (zlib releases the GIL for large buffers). Fed buffers must stay
    unchanged until `value()` returns; at most `_BACKLOG` of them wait, so a slow checksum holds
    back the writes instead of pinning an unbounded number of buffers."""

    _BACKLOG = 4

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-crc")
        self._crc = 0
        self._queued: deque[Future] = deque()

    def feed(self, data: memoryview | bytearray) -> None:
        self._queued.append(self._pool.submit(self._update, data))
        while len(self._queued) > self._BACKLOG:
            self._queued.popleft().result()

    def _update(self, data: memoryview | bytearray) -> None:
        self._crc = zlib.crc32(data, self._crc)

    def value(self) -> int:
        self.close()
        while self._queued:
            self._queued.popleft().result()
        return self._crc

    def close(self) -> None:
        """Stop the helper thread (after the buffers already fed)."""
        self._pool.shutdown(wait=True)


class _Output(io.RawIOBase):
    """The file being written: counts, checksums, buffers small writes, starts writeback of
    large ones. `fill` (the storage bytes of the tensor being framed) replaces the hole that
    `torch.save` under `skip_data` seeks over."""

    def __init__(self, f: io.FileIO, step: int | None):
        self._f = f
        self._fd = f.fileno()
        self._pending = bytearray()
        self.pos = 0
        self.crc = _RunningCrc()
        self._synced_to = 0
        self._step = step
        self.fill: memoryview | None = None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) < _SMALL:
            self._pending += view
            self.pos += len(view)
        else:
            self.flush()
            for start in range(0, len(view), CHUNK_BYTES):
                self._write_all(view[start : start + CHUNK_BYTES])
        if self._step is not None:  # the `write` fail point: a data file is partly written
            self._step, step = None, self._step
            self.flush()
            faults.hit("write", step)
        return len(view)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR and self.fill is not None and offset == len(self.fill) > 0:
            fill, self.fill = self.fill, None  # the tensor's bytes go where the hole would be
            self.write(fill)
            return self.pos
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self.pos + offset}.get(whence)
        if target != self.pos:  # only the hole above is expected; anything else is a bug
            raise io.UnsupportedOperation(f"seek({offset}, {whence}) while writing {self._f.name}")
        return self.pos

    def _write_all(self, chunk: memoryview) -> None:
        written = 0
        while written < len(chunk):
            written += self._f.write(chunk[written:])
        self.crc.feed(chunk)
        self.pos += len(chunk)
        if _SYNC_FILE_RANGE is not None and self.pos - self._synced_to >= CHUNK_BYTES:
            _SYNC_FILE_RANGE(self._fd, self._synced_to, self.pos - self._synced_to, _SYNC_FILE_RANGE_WRITE)
            self._synced_to = self.pos

    def discard(self) -> None:
        """After a failure: drop what is not written yet and stop the checksum thread."""
        self._pending = bytearray()
        self.crc.close()

    def flush(self) -> None:
        """Write out the gathered small writes (already counted in `pos`)."""
        if self._pending:
            pending, self._pending = self._pending, bytearray()
            view, written = memoryview(pending), 0
            while written < len(view):
                written += self._f.write(view[written:])
            view.release()
            self.crc.feed(pending)


def _storage_bytes(t: torch.Tensor) -> memoryview:
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return memoryview(raw.numpy()).cast("B")


def _write_tensor(out: _Output, t: torch.Tensor) -> None:
    out.fill = _storage_bytes(t) if t.untyped_storage().nbytes() else None
    with torch.serialization.skip_data():
        torch.save(t, out)
    if out.fill is not None:
        raise RuntimeError("torch.save under skip_data did not leave the expected hole for the "
                           "tensor's bytes; this torch version frames archives differently")


def write_file(job: FileJob, step: int | None = None, sync: bool = True) -> FileResult:
    """Write `job`'s entries into a new file at `job.path`, fsync it when `sync`, and return
    its size, CRC-32 and where each entry landed. `step` arms the `write` fail point."""
    result = FileResult(size=0, crc32="")
    with open(job.path, "wb", buffering=0) as f:
        out = _Output(f, step if faults.armed() else None)
        try:
            for entry in job.entries:
                start = out.pos
                if isinstance(entry.data, torch.Tensor):
                    _write_tensor(out, exact_storage(entry.data))
                else:
                    out.write(entry.data)
                result.places.append((entry.key, start, out.pos - start))
            out.flush()
            if sync:
                os.fsync(f.fileno())
        except BaseException:
            out.discard()
            raise
    result.size, result.crc32 = out.pos, f"{out.crc.value():08x}"
    return result


Sink = Callable[[list[FileJob], "int | None", bool], list[FileResult]]
"""Writes a rank's files: `write_files` here, or `WriterProcess.write` in another process."""


def write_files(jobs: list[FileJob], step: int | None = None, sync: bool = True) -> list[FileResult]:
    """`write_file` for each job, the files in parallel (one thread per file)."""
    if len(jobs) <= 1:
        return [write_file(job, step, sync) for job in jobs]
    with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="ckpt-file") as pool:
        return list(pool.map(lambda job: write_file(job, step, sync), jobs))


def exact_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU with a storage holding exactly its elements (what `torch.save` writes),
    copying only when it is a view into something larger or lives on another device."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    return t
