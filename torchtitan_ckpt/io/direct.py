"""Writing a file around the page cache (`O_DIRECT`), through aligned buffers of our own.

A buffered write costs the kernel a page allocation and a copy for every 4 KiB, and the
writeback after it more CPU still; on a machine whose cores also train (or that runs several
ranks per core) that CPU is most of a save's time. With `O_DIRECT` the disk reads the bytes
straight from the process's memory. It needs offsets, lengths and memory aligned to the
device's block (`ALIGN` covers 512-byte and 4 KiB devices), which a file of back-to-back
archives does not have, so the bytes are first copied into page-aligned blocks (`BLOCK_BYTES`,
a few per file): one copy at memory speed instead of the kernel's. A helper thread checksums and
writes each full block while the next fills. The last block is padded to `ALIGN` and the file
cut back to its size.

A file system that refuses `O_DIRECT` (tmpfs before Linux 6.6, some FUSE ones) is written
through the page cache, by the caller's buffered path (`open_direct` returns None); one that
accepts the flag but refuses a write (a larger alignment) gets the rest of the file through the
page cache from the same descriptor (`fcntl` clears the flag).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import queue
import threading

import numpy as np

from .. import faults
from . import durable, posio
from .checksum import crc32

logger = logging.getLogger(__name__)

ALIGN = 4096
"""Alignment of every direct write's offset, length and memory."""
BLOCK_BYTES = 8 << 20
"""Bytes copied into one block before it is written."""
BLOCKS_PER_FILE = 3
"""Blocks a file uses at once: one filling, the rest being written."""
_IDLE_BLOCKS = 8
"""Blocks kept for the next files (their pages stay mapped: a fresh block's first touch costs)."""

_pool: list[mmap.mmap] = []
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    """In a forked child: its copies of the idle blocks are not its to hand out, and the lock
    may have been held by a thread that does not exist there."""
    global _pool, _pool_lock
    _pool, _pool_lock = [], threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _take_block() -> mmap.mmap:
    with _pool_lock:
        if _pool:
            return _pool.pop()
    return mmap.mmap(-1, BLOCK_BYTES, flags=mmap.MAP_PRIVATE)  # anonymous maps are page-aligned


def _give_block(block: mmap.mmap) -> None:
    with _pool_lock:
        if len(_pool) < _IDLE_BLOCKS:
            _pool.append(block)
            return
    try:
        block.close()
    except BufferError:  # a view of it is still alive somewhere: unmapped when that goes
        pass


def drop_idle_blocks() -> None:
    """Unmap the blocks kept for the next files (`_IDLE_BLOCKS`): when a job lets go of its
    checkpointing (`CheckpointManager.close`), which may be long before the process ends. A later
    save maps fresh ones."""
    with _pool_lock:
        idle = _pool[:]
        _pool.clear()
    for block in idle:
        with contextlib.suppress(BufferError):  # a view of it still alive: unmapped when that goes
            block.close()


def _address(buffer) -> int:
    """The address of a byte buffer (read-only ones too)."""
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def open_direct(path: str) -> int | None:
    """A new file at `path`, opened for direct writes; None where the file system refuses them."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return durable.create_replacing(path, flag)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        return None


class DirectOutput:
    """The file being written with `O_DIRECT` (`fd` from `open_direct`): `write()` copies into
    the current block; full blocks go to a helper thread, which checksums and writes them.
    `finish()` queues the last block and returns; `settle()` waits until every block is written
    and cuts the padding off (before the fsync); `abort()` stops the helper after a failure.
    `step` arms the `write` fail point (half of the first block is written, then the process is
    killed)."""

    def __init__(self, fd: int, step: int | None):
        self._fd = fd
        self._step = step
        self.pos = 0
        """Bytes written so far (the file's size once settled)."""
        self._crc = 0
        self._blocks: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self._taken: list[mmap.mmap] = []
        for _ in range(BLOCKS_PER_FILE):
            self._taken.append(_take_block())
            self._blocks.put(self._taken[-1])
        self._block: mmap.mmap | None = None
        self._address = 0
        self._fill = 0
        self._at = 0
        """File offset of the current block."""
        self._todo: queue.SimpleQueue[tuple[mmap.mmap, int, int, int] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ckpt-direct", daemon=True)
        self._thread.start()

    def write(self, data, temporary: bool = False) -> None:
        """Copy `data` in (it may change once this returns; `temporary` is for the buffered path)."""
        view = memoryview(data).cast("B")
        n = len(view)
        if not n:
            return
        source, done = _address(view), 0
        while done < n:
            if self._block is None:
                self._next_block()
            take = min(n - done, BLOCK_BYTES - self._fill)
            ctypes.memmove(self._address + self._fill, source + done, take)  # releases the GIL
            self._fill += take
            done += take
            if self._fill == BLOCK_BYTES:
                self._submit()
        self.pos += n

    def crc(self) -> int:
        """The CRC-32 of every byte written, once `settle()` or `abort()` has returned."""
        return self._crc

    def finish(self) -> None:
        """Queue the last block, padded to `ALIGN` (its padding is cut off by `settle()`)."""
        if self._block is not None and self._fill:
            padded = -(-self._fill // ALIGN) * ALIGN
            self._block[self._fill : padded] = bytes(padded - self._fill)
            self._submit(padded)
        self._todo.put(None)

    def settle(self) -> None:
        """Wait until every block is written and cut the file back to `pos`; raises the writes' error."""
        self._thread.join()
        self._release()
        if self._error is not None:
            raise self._error
        if os.fstat(self._fd).st_size != self.pos:
            os.ftruncate(self._fd, self.pos)

    def abort(self) -> None:
        """Stop after a failed write (nothing more is queued)."""
        self._todo.put(None)
        self._thread.join()
        self._release()

    def _release(self) -> None:
        for block in self._taken:
            _give_block(block)
        self._taken.clear()

    def _next_block(self) -> None:
        block = self._blocks.get()
        if self._error is not None:
            raise self._error
        self._block, self._address, self._fill = block, _address(block), 0

    def _submit(self, length: int | None = None) -> None:
        """Queue the current block: its `_fill` bytes of data, written as `length` (padded)."""
        block, at, data = self._block, self._at, self._fill
        self._block, self._at = None, at + data
        if self._step is not None:  # the `write` fail point: a data file is partly written
            prefix = data // 2 // ALIGN * ALIGN
            _pwrite(self._fd, memoryview(block)[:prefix], at)
            faults.hit("write", self._step)
            self._step = None
        self._todo.put((block, at, data, length or data))

    def _run(self) -> None:
        """Checksums, then writes, each block in order (blocks after a failure are only handed back)."""
        while (job := self._todo.get()) is not None:
            block, at, data, length = job
            if self._error is None:
                try:
                    self._crc = crc32(memoryview(block)[:data], self._crc)  # releases the GIL
                    _pwrite(self._fd, memoryview(block)[:length], at)
                except BaseException as e:  # raised by the writer's next block, or by settle()
                    self._error = e.with_traceback(None)  # its frames hold views of the block
            self._blocks.put(block)


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    """`posio.write_all`; where a direct write is refused (an alignment larger than `ALIGN`, or
    the unaligned rest after a short write), the same bytes again, and the file's later writes,
    through the page cache."""
    try:
        posio.write_all(fd, data, offset)
    except OSError as e:
        if e.errno != errno.EINVAL or not _clear_direct(fd):
            raise
        posio.write_all(fd, data, offset)


def _clear_direct(fd: int) -> bool:
    """Turn `O_DIRECT` off for `fd`; False if it was off already."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not flags & os.O_DIRECT:
        return False
    logger.info("direct writes refused on fd %d; the rest of the file goes through the page cache", fd)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
    return True
