"""Writing one rank's DCP data files: the bytes DCP's `FileSystemWriter` would write, faster.

A file holds its items back to back in DCP's default format (a value's pickled bytes, or a
tensor as one `torch.save` archive), so plain `dcp.load` with `FileSystemReader` reads it.
What differs is how the bytes reach the disk:

- a tensor's archive is framed by `torch.save` under `torch.serialization.skip_data()` (once
  per dtype, shape and strides, then reused) and its storage bytes are written straight from
  the tensor's memory, instead of through `torch.save`'s own copy and CRC (the archive's
  per-record CRC is left 0, as `torch.serialization.set_crc32_options(False)` does; the commit
  manifest's CRC-32 of the whole file, computed here, covers every byte instead);
- the bytes go to the page cache as fast as the system calls take them; the fsync and the
  CRC-32 come after, in the background (`WrittenFile.durable()` waits for them), so DCP's
  gathering of write results and its `.metadata` overlap the disk's work, and the checksum
  (CPU) overlaps the fsync (disk) instead of slowing the writes;
- small header writes are buffered.

This module has no DCP planner or process group in it: a `FileJob` carries resolved data, so
the same function runs in the training process or in the writer process of
`async_with_pinned_mem` (see `writer_process`).
"""

from __future__ import annotations

import io
import os
import threading
import zlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.utils.serialization import config as serialization_config

from . import faults

CHUNK_BYTES = 32 << 20
"""Bytes handed to the kernel per write system call for large tensors."""
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


class WrittenFile:
    """A file whose bytes have all been written: its size and where each entry landed are
    final. `durable()` waits until it is on the disk and returns its CRC-32 (hex)."""

    def __init__(self, size: int, places: list[tuple[object, int, int]], wait: Callable[[], str]):
        self.size = size
        self.places = places
        """(entry key, offset, length) of every entry, in file order."""
        self._wait = wait
        self._crc32: str | None = None

    def durable(self) -> str:
        if self._crc32 is None:
            self._crc32 = self._wait()
        return self._crc32


class _DeferredCrc:
    """CRC-32 of the buffers fed to it, in order, on a helper thread that starts once the writes
    are over (`start()`): the checksum then runs while the fsync waits on the disk, instead of
    taking CPU from the writes. Fed buffers must stay unchanged until `value()` returns.

    A temporary buffer (a copy made only to be written) would be kept alive until then; so once
    more than `_TEMPORARIES` of them wait, the helper starts at once and the writer waits for the
    oldest, as a checksum running beside the writes would."""

    _TEMPORARIES = 4

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-crc")
        self._go = threading.Event()
        self._crc = 0
        self._temporaries: deque[Future] = deque()

    def feed(self, data: memoryview | bytearray, temporary: bool = False) -> None:
        done = self._pool.submit(self._update, data)
        if temporary:
            self._temporaries.append(done)
            if len(self._temporaries) > self._TEMPORARIES:
                self._go.set()
                self._temporaries.popleft().result()

    def _update(self, data: memoryview | bytearray) -> None:
        self._go.wait()
        self._crc = zlib.crc32(data, self._crc)

    def start(self) -> None:
        self._go.set()

    def value(self) -> int:
        self._go.set()
        self._pool.shutdown(wait=True)
        return self._crc

    def discard(self) -> None:
        """After a failure: drop what is not checksummed yet and let the helper thread end."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._go.set()


class _Output:
    """The file being written: counts, feeds the checksum, buffers small writes."""

    def __init__(self, f: io.FileIO, step: int | None):
        self._f = f
        self._pending = bytearray()
        self.pos = 0
        self.crc = _DeferredCrc()
        self._step = step

    def write(self, data, temporary: bool = False) -> None:
        """Write `data`; `temporary` says it is a copy made only to be written."""
        view = memoryview(data).cast("B")
        if len(view) < _SMALL:
            self._pending += view
            self.pos += len(view)
        else:
            self.flush()
            for start in range(0, len(view), CHUNK_BYTES):
                self._write_all(view[start : start + CHUNK_BYTES])
            self.crc.feed(view, temporary)
        if self._step is not None:  # the `write` fail point: a data file is partly written
            self._step, step = None, self._step
            self.flush()
            faults.hit("write", step)

    def _write_all(self, chunk: memoryview) -> None:
        written = 0
        while written < len(chunk):
            written += self._f.write(chunk[written:])
        self.pos += len(chunk)

    def flush(self) -> None:
        """Write out the gathered small writes (already counted in `pos`)."""
        if self._pending:
            pending, self._pending = self._pending, bytearray()
            view, written = memoryview(pending), 0
            while written < len(view):
                written += self._f.write(view[written:])
            view.release()
            self.crc.feed(pending)


class _Frame(io.RawIOBase):
    """Records what `torch.save` writes under `skip_data`: the bytes before the hole left for
    the storage's bytes, and the bytes after it."""

    def __init__(self, hole: int):
        self.parts = [bytearray()]
        self._hole = hole
        self._pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.parts[-1] += view
        self._pos += len(view)
        return len(view)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR and offset == self._hole > 0 and len(self.parts) == 1:
            self.parts.append(bytearray())
            self._pos += offset
        elif {io.SEEK_SET: offset, io.SEEK_CUR: self._pos + offset}.get(whence) != self._pos:
            raise io.UnsupportedOperation(f"torch.save under skip_data seeked ({offset}, {whence}); "
                                          "this torch version frames archives differently")
        return self._pos


_FRAMES: dict[tuple, tuple[bytes, bytes]] = {}
_MAX_FRAMES = 4096


def _frame(t: torch.Tensor) -> tuple[bytes, bytes]:
    """The archive `torch.save(t)` writes around `t`'s storage bytes (whose storage holds
    exactly its elements). It depends only on the tensor's dtype, shape and strides and on
    torch's serialization settings, so it is computed once per kind of tensor: framing each
    tensor anew took about 0.3 ms, a tenth of a Llama save's time beyond the disk's."""
    settings = serialization_config.save
    key = (t.dtype, tuple(t.shape), t.stride(), settings.storage_alignment, settings.compute_crc32)
    found = _FRAMES.get(key)
    if found is None:
        frame = _Frame(t.untyped_storage().nbytes())
        with torch.serialization.skip_data():
            torch.save(t, frame)
        if len(frame.parts) != (2 if t.untyped_storage().nbytes() else 1):
            raise RuntimeError("torch.save under skip_data did not leave the expected hole for the "
                               "tensor's bytes; this torch version frames archives differently")
        found = (bytes(frame.parts[0]), bytes(frame.parts[-1]) if len(frame.parts) == 2 else b"")
        if len(_FRAMES) >= _MAX_FRAMES:
            _FRAMES.clear()
        _FRAMES[key] = found
    return found


def _storage_bytes(t: torch.Tensor) -> memoryview:
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return memoryview(raw.numpy()).cast("B")


def _write_tensor(out: _Output, entry: torch.Tensor) -> None:
    t = exact_storage(entry)
    before, after = _frame(t)
    out.write(before)
    if t.untyped_storage().nbytes():
        out.write(_storage_bytes(t), temporary=t.untyped_storage().data_ptr() != entry.untyped_storage().data_ptr())
    out.write(after)


def write_file(job: FileJob, step: int | None = None, sync: bool = True) -> WrittenFile:
    """Write `job`'s entries into a new file at `job.path` and return as soon as every byte is
    handed to the kernel; the fsync (when `sync`) and the CRC-32 continue in the background
    until `durable()` is called on the result. `step` arms the `write` fail point."""
    f = open(job.path, "wb", buffering=0)
    out = _Output(f, step if faults.armed() else None)
    places = []
    try:
        for entry in job.entries:
            start = out.pos
            if isinstance(entry.data, torch.Tensor):
                _write_tensor(out, entry.data)
            else:
                out.write(entry.data)
            places.append((entry.key, start, out.pos - start))
        out.flush()
    except BaseException:
        out.crc.discard()
        f.close()
        raise
    out.crc.start()
    synced: Future = Future()
    threading.Thread(target=_sync_and_close, args=(f, sync, synced), name="ckpt-fsync", daemon=True).start()

    def wait() -> str:
        try:
            synced.result()
        finally:
            crc = out.crc.value()
        return f"{crc:08x}"

    return WrittenFile(out.pos, places, wait)


def _sync_and_close(f: io.FileIO, sync: bool, done: Future) -> None:
    try:
        try:
            if sync:
                os.fsync(f.fileno())
        finally:
            f.close()
    except BaseException as e:
        done.set_exception(e)
    else:
        done.set_result(None)


Sink = Callable[[list[FileJob], "int | None", bool], list[WrittenFile]]
"""Writes a rank's files: `write_files` here, or `WriterProcess.write` in another process."""


def write_files(jobs: list[FileJob], step: int | None = None, sync: bool = True) -> list[WrittenFile]:
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
