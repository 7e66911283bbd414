"""Writing one rank's DCP data files: the bytes DCP's `FileSystemWriter` would write, faster.

A file holds its items back to back in DCP's default format (a value's pickled bytes, or a
tensor as one `torch.save` archive), so plain `dcp.load` with `FileSystemReader` reads it.
What differs is how the bytes reach the disk:

- a tensor's archive is framed by `torch.save` under `torch.serialization.skip_data()`
  (`torch_archive.frame`: once per dtype, shape and strides, then reused) and its storage bytes are written straight from
  the tensor's memory, instead of through `torch.save`'s own copy and CRC (the archive's
  per-record CRC is left 0, as `torch.serialization.set_crc32_options(False)` does; the commit
  manifest's CRC-32 of the whole file, computed here, covers every byte instead);
- writing returns once every byte is handed to the kernel; the fsync comes after, in the
  background, and the CRC-32 is computed beside the writes on a helper thread
  (`WrittenFile.durable()` waits for both), so DCP's gathering of write results and its
  `.metadata` overlap the disk's work, and the checksum (CPU) overlaps the writes, which wait
  on the disk, instead of following them;
- buffers (headers and tensors' bytes alike) are handed to the kernel many at a time, with
  `os.writev`, and the disk is started on each 64 MiB as soon as it is written (by a helper
  thread, so the writer never waits for the disk's queue);
- or, for a file that is fsynced and asks for it (`FileJob.direct`), around the page cache
  altogether (`direct.DirectOutput`: copied into aligned blocks that a helper thread checksums
  and writes with `O_DIRECT`), where the file system allows.

This module has no DCP planner or process group in it: a `FileJob` carries resolved data, so
the same function runs in the training process or in the writer process of
`async_with_pinned_mem` (see `writer_process`).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import io
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .. import faults
from . import durable, safe_open
from .checksum import crc32, hex_crc
from . import torch_archive
from .direct import DirectOutput, open_direct
from .posio import IOV_MAX

BATCH_BYTES = 64 << 20
"""Bytes gathered before they are handed to the kernel in one system call."""


@dataclass
class Entry:
    """One item of a file: a value's bytes, or a tensor (a view, or on another device, is
    copied into a CPU tensor of its own first, as `torch.save` would write the whole storage)."""

    key: object
    """Opaque to this module (DCP's `MetadataIndex`); handed back with the item's place."""
    data: bytes | torch.Tensor
    ready: Callable[[], None] | None = None
    """Called before the item's bytes are read: blocks until they are final (a tensor that a
    background save's staging is still copying in)."""


_POLL_S = 0.0005
_POLL_MAX_S = 0.004
"""How often a `CountWait` looks at the count: first after 0.5 ms, then twice as long each
time, up to 4 ms."""


@dataclass(frozen=True)
class CountWait:
    """An `Entry.ready` that crosses into the writer process: it waits until `count[0]`, a
    shared-memory count of the staging copies made so far, reaches `at_least` (it polls: the
    copies run at memory speed, so the waits are short). A negative count means staging failed;
    the training process raises that failure itself. The staging thread sets the count after
    the copies' bytes; that the writer then sees those bytes rests on the processor's store
    order (x86) and, elsewhere, on the system calls and locks between the two (no explicit
    fence)."""

    count: torch.Tensor
    at_least: int

    def __call__(self) -> None:
        made, pause = self.count.numpy(), _POLL_S
        while made[0] < self.at_least:
            if made[0] < 0:
                raise RuntimeError("staging failed; the save's own error names the cause")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)  # a GPU state's copies are all counted at once, at the end


@dataclass
class FileJob:
    path: str
    """Where to write; the file must not be open elsewhere."""
    entries: list[Entry]
    direct: bool = False
    """Write a file that is fsynced around the page cache (`direct.DirectOutput`) where the
    file system allows it."""


def linux_libc() -> ctypes.CDLL | None:
    """The C library on Linux (for calls Python's `os` lacks), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _libc_sync_file_range():
    fn = getattr(linux_libc(), "sync_file_range", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


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


class _BackgroundCrc:
    """CRC-32 of the buffers fed to it, in order, computed on a helper thread while the writes
    go on. The writes of a save end when the disk has taken most of their bytes (the kernel
    holds back writers beyond its dirty-page limit), so a checksum computed beside them ends
    with them; computed after them, it would be the save's tail. Fed buffers must stay unchanged
    until `value()`.

    A temporary buffer (a copy made only to be written: a GPU tensor's, a view's) is let go
    once checksummed; the writer waits while more than `TEMPORARY_BYTES` of them are pending,
    so the copies alive at once stay bounded."""

    TEMPORARY_BYTES = 64 << 20

    def __init__(self) -> None:
        self._crc = 0
        self._pending: collections.deque[tuple[memoryview | bytes, bool]] = collections.deque()
        self._temporary_bytes = 0
        self._closed = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ckpt-crc", daemon=True)
        self._thread.start()

    def feed(self, data: memoryview | bytes, temporary: bool = False) -> None:
        with self._cond:
            while temporary and self._temporary_bytes > self.TEMPORARY_BYTES and self._error is None:
                self._cond.wait()
            self._pending.append((data, temporary))
            self._temporary_bytes += len(data) if temporary else 0
            self._cond.notify_all()

    def close(self) -> None:
        """Nothing more will be fed (also after a failed write: the thread then ends)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._pending and not self._closed:
                        self._cond.wait()
                    if not self._pending:
                        return
                    data, temporary = self._pending.popleft()
                self._crc = crc32(data, self._crc)  # releases the GIL
                if temporary:
                    with self._cond:
                        self._temporary_bytes -= len(data)
                        self._cond.notify_all()
        except BaseException as e:  # never expected of crc32; raised by value() rather than lost
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def join(self) -> None:
        """Wait, after `close()`, until the thread has checksummed everything fed and ended."""
        self._thread.join()

    def value(self) -> int:
        """The CRC-32 of everything fed, once `close()` was called and the thread is done."""
        self.join()
        if self._error is not None:
            raise self._error
        return self._crc


class Writeback:
    """Starts the disk on a file's written ranges (`sync_file_range`) from a helper thread, in
    order. Called by the writer itself, a start blocks while the disk's queue is full, and the
    writer with it, so the writer could not run ahead of the disk; from a helper, the writer
    keeps filling the page cache while the disk works (`docs/performance.md` compares the
    three ways). `close()` waits for the starts queued; it comes before
    the file's fsync and close, so no start acts on a closed descriptor. Does nothing where the
    call is missing."""

    def __init__(self, fd: int, enabled: bool = True):
        self._fd = fd
        self._ranges: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if enabled and _SYNC_FILE_RANGE is not None:
            self._thread = threading.Thread(target=self._run, name="ckpt-writeback", daemon=True)
            self._thread.start()

    def start(self, offset: int, length: int) -> None:
        if self._thread is not None:
            self._ranges.put((offset, length))

    def close(self) -> None:
        if self._thread is not None:
            self._ranges.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (found := self._ranges.get()) is not None:
            # a failure to start is not an error of the save: the fsync writes what is left
            _SYNC_FILE_RANGE(self._fd, found[0], found[1], _SYNC_FILE_RANGE_WRITE)


class _Output:
    """The file being written through the page cache: counts, feeds the checksum, gathers
    buffers to hand to the kernel together (`os.writev`: few system calls, so few waits for the
    GIL in a thread writing beside DCP's planning) and asks the kernel to start writing each
    batch back to the disk (`sync_file_range`, from a helper: `Writeback`), so the disk works
    while the rest of the save is prepared; the final fsync then waits for the last batches
    only. Its methods are those of `direct.DirectOutput`, the other way to write a file."""

    def __init__(self, fd: int, step: int | None, sync: bool = True):
        self._fd = fd
        self._batch: list[memoryview] = []
        self._batch_bytes = 0
        self.pos = 0
        self._written = 0
        self._checksum = _BackgroundCrc()
        self._writeback = Writeback(self._fd, enabled=sync)  # a file never fsynced is left to the page cache
        self._step = step

    def write(self, data, temporary: bool = False) -> None:
        """Write `data` (kept, unchanged, until the next `flush`); `temporary` says it is a
        copy made only to be written."""
        view = memoryview(data).cast("B")
        if not len(view):
            return
        self._batch.append(view)
        self._batch_bytes += len(view)
        self.pos += len(view)
        self._checksum.feed(view, temporary)
        if len(self._batch) >= IOV_MAX or self._batch_bytes >= BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        """Write out the gathered buffers, and start the disk on them."""
        buffers, self._batch, self._batch_bytes = self._batch, [], 0
        if self._step is not None and buffers:  # the `write` fail point: a data file is partly written
            self._writev(buffers[:1])
            self._step, step = None, self._step
            faults.hit("write", step)
            buffers = buffers[1:]
        self._writev(buffers)
        if self.pos > self._written:
            self._writeback.start(self._written, self.pos - self._written)
        self._written = self.pos

    def finish(self) -> None:
        """Everything is written: hand the rest to the kernel."""
        self.flush()
        self._checksum.close()

    def settle(self) -> None:
        """Before the fsync: wait for the writeback starts queued."""
        self._writeback.close()

    def abort(self) -> None:
        """Stop the helpers after a failed write."""
        self._checksum.close()
        self._writeback.close()
        self._checksum.join()

    def crc(self) -> int:
        """The CRC-32 of every byte written, once `finish()` was called."""
        return self._checksum.value()

    def _writev(self, buffers: list[memoryview]) -> None:
        first = 0
        while first < len(buffers):
            written = os.writev(self._fd, buffers[first : first + IOV_MAX])
            if not written:  # no progress and no error: never expected of a regular file
                raise OSError(f"writev wrote nothing of {sum(map(len, buffers[first:]))} bytes")
            while first < len(buffers) and written >= len(buffers[first]):
                written -= len(buffers[first])
                first += 1
            if written:  # a short write: the rest of this buffer goes first next time
                buffers[first] = buffers[first][written:]


def _storage_bytes(t: torch.Tensor) -> memoryview:
    raw = torch.empty(0, dtype=torch.uint8, device="cpu").set_(t.untyped_storage())
    return memoryview(raw.numpy()).cast("B")


_Buffers = list[tuple[bytes | memoryview, bool]]
"""An entry's bytes as buffers to write, each with whether it is a temporary copy."""


def _framed(data: torch.Tensor, t: torch.Tensor) -> _Buffers:
    """The buffers of tensor `data`, whose bytes are `t = exact_storage(data)`."""
    before, after = torch_archive.frame(t)
    if not t.untyped_storage().nbytes():
        return [(before, False), (after, False)]
    copied = t.data_ptr() != data.data_ptr()
    return [(before, False), (_storage_bytes(t), copied), (after, False)]


def _lookup(entry: Entry) -> _Buffers | Callable[[], _Buffers]:
    """`entry`'s buffers now, or, for a tensor that must be copied first (a view that does not
    fill one stretch of its storage, or a tensor on another device), a function that makes them
    when the file gets there, so copies are made one at a time."""
    data = entry.data
    if not isinstance(data, torch.Tensor):
        return [(data, False)]
    t = exact_storage(data, copy=False)
    return (lambda: _framed(data, exact_storage(data))) if t is None else _framed(data, t)


_LookedUp = tuple[object, "_Buffers | Callable[[], _Buffers]", "Callable[[], None] | None"]
"""An entry as `_write` takes it: key, buffers (`_lookup`'s), what to wait for before reading them."""


def _write(path: str, entries: list[_LookedUp], direct: bool, step: int | None, sync: bool) -> WrittenFile:
    step = step if faults.armed() else None
    fd = open_direct(path) if direct and sync else None
    f = io.FileIO(durable.create_replacing(path) if fd is None else fd, "w")
    try:
        out: _Output | DirectOutput = _Output(f.fileno(), step, sync) if fd is None else DirectOutput(fd, step)
    except BaseException:
        f.close()
        raise
    places = []
    try:
        for key, buffers, ready in entries:
            if ready is not None:
                ready()
            start = out.pos
            for data, temporary in buffers() if callable(buffers) else buffers:
                out.write(data, temporary)
            places.append((key, start, out.pos - start))
        out.finish()
    except BaseException:  # no helper thread outlives a failed file
        try:
            out.abort()
        finally:
            f.close()
        raise
    synced: Future = Future()
    threading.Thread(target=_sync_and_close, args=(f, out, sync, synced), name="ckpt-fsync", daemon=True).start()

    def wait() -> str:
        try:
            synced.result()
        finally:
            crc = out.crc()
        return hex_crc(crc)

    return WrittenFile(out.pos, places, wait)


def write_file(job: FileJob, step: int | None = None, sync: bool = True) -> WrittenFile:
    """Write `job`'s entries into a new file at `job.path` and return as soon as every byte is
    handed over (to the kernel, or copied into the blocks of a direct write); the fsync (when
    `sync`) and the CRC-32 continue in the background until `durable()` is called on the result.
    `step` arms the `write` fail point."""
    return _write(job.path, [(e.key, _lookup(e), e.ready) for e in job.entries], job.direct, step, sync)


def _sync_and_close(f: io.FileIO, out: "_Output | DirectOutput", sync: bool, done: Future) -> None:
    try:
        try:
            out.settle()
            if sync:
                os.fsync(f.fileno())
        finally:
            f.close()
    except BaseException as e:
        done.set_exception(e)
    else:
        done.set_result(None)


Sink = Callable[[list[FileJob], "int | None", bool], list[WrittenFile]]
"""Writes a rank's files: `write_files` here, or a `WriterProcess` (called) in another process."""


def write_files(jobs: list[FileJob], step: int | None = None, sync: bool = True) -> list[WrittenFile]:
    """`write_file` for each job, the files in parallel (one thread per file)."""
    _make_room(jobs)
    if len(jobs) <= 1:
        return [write_file(job, step, sync) for job in jobs]
    with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="ckpt-file") as pool:
        return list(pool.map(lambda job: write_file(job, step, sync), jobs))


def _make_room(jobs: list[FileJob]) -> None:
    """Each file stays open until its fsync ends (`_sync_and_close`): a rank holds them all at once."""
    safe_open.make_room(len(jobs), "the files this rank writes at once", "lower checkpoint.save_threads")


@dataclass
class StartedFiles:
    """Files being written by `start_files`."""

    done: Future
    """Of their `WrittenFile`s, in order."""
    places: list[list[tuple[object, int, int]] | None]
    """Each file's (entry key, offset, length) of every entry, known before it is written (None
    when an entry must be copied first, so its framing is not known yet)."""


def _places(entries: list[_LookedUp]) -> list[tuple[object, int, int]] | None:
    out, pos = [], 0
    for key, buffers, _ in entries:
        if callable(buffers):
            return None
        length = sum(memoryview(data).nbytes for data, _ in buffers)
        out.append((key, pos, length))
        pos += length
    return out


def planned_places(job: FileJob) -> list[tuple[object, int, int]] | None:
    """Where `job`'s entries will land in its file, as `write_file` lays them out (None when
    an entry must be copied first)."""
    return _places([(e.key, _lookup(e), e.ready) for e in job.entries])


def start_files(jobs: list[FileJob], step: int | None = None, sync: bool = True) -> StartedFiles:
    """`write_files` on helper threads. The buffers of the tensors that need no copy are looked
    up here first (so where each entry will land is known at once): in a helper thread, each of
    the dozen torch calls that takes (each releasing the GIL) would wait for a busy caller to let
    go of the GIL again. Tensors that need a copy (on another device, views) are copied
    by the helper, one at a time."""
    _make_room(jobs)
    looked_up = [(job.path, [(e.key, _lookup(e), e.ready) for e in job.entries], job.direct) for job in jobs]
    done: Future = Future()

    def run() -> None:
        try:
            if len(looked_up) == 1:
                done.set_result([_write(*looked_up[0], step, sync)])
            else:
                with ThreadPoolExecutor(max_workers=len(looked_up), thread_name_prefix="ckpt-file") as pool:
                    done.set_result(list(pool.map(lambda job: _write(*job, step, sync), looked_up)))
        except BaseException as e:
            done.set_exception(e)

    threading.Thread(target=run, name="ckpt-early", daemon=True).start()
    return StartedFiles(done, [_places(entries) for _, entries, _ in looked_up])


def exact_storage(t: torch.Tensor, copy: bool = True) -> torch.Tensor | None:
    """`t` on the CPU with a storage holding exactly its elements (what `torch.save` writes).
    A view whose elements fill one stretch of a larger storage (a slice of rows, a tensor in
    a staging arena) gets a storage over just that stretch, sharing its memory; a view that
    does not, a tensor on another device, or a lazily conjugated or negated view (whose storage
    holds other values than it shows) is copied (or None is returned, if not `copy`)."""
    t = t.detach()
    nbytes = t.numel() * t.element_size()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg().cpu() if copy else None
    elif t.device.type != "cpu":
        t = t.cpu() if copy else None
    elif t.untyped_storage().nbytes() != nbytes:
        if _fills_one_stretch(t):
            start = t.storage_offset() * t.element_size()
            t = torch.empty(0, dtype=t.dtype, device="cpu").set_(t.untyped_storage()[start:start + nbytes], 0, t.shape,
                                                                 t.stride())
        else:
            t = t.clone(memory_format=torch.contiguous_format) if copy else None
    return t


def _fills_one_stretch(t: torch.Tensor) -> bool:
    """Whether `t`'s elements lie next to each other in memory, in some order of its dimensions
    (contiguous, transposed, channels-last), with no gaps or overlaps."""
    step = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride != step:
            return False
        step *= size
    return True
