"""Positioned and vectored file I/O that moves every byte asked for: the kernel may move fewer
bytes per call than asked (about 2 GiB at most on Linux, fewer on a signal), so each call loops.
The readers and writers of every format use these."""

from __future__ import annotations

import errno
import os

import torch

IOV_MAX = max(1, min(os.sysconf("SC_IOV_MAX"), 1024))
"""Buffers per `preadv` / `writev` call (1 where the system does not say)."""
_MAX_IO = 1 << 30
"""Bytes per `pwrite` call: Linux moves at most about 2 GiB per call."""


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The memory of the contiguous tensor `t` as a 1-D uint8 tensor of the same memory. A
    dimension of one element may have any stride in a contiguous tensor (`zeros(2)[::2]`, one
    element sliced out of a matrix), which `view(-1)` keeps and a byte view refuses: its
    elements are one dense run all the same."""
    if not t.is_contiguous():  # `view(-1)` takes some such tensors (`arange(10)[::2]`): not their values' bytes
        raise ValueError(f"byte_view of a tensor that is not contiguous (strides {t.stride()})")
    flat = t.view(-1)
    return flat.as_strided((flat.numel(),), (1,)).view(torch.uint8)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The memory of the contiguous CPU tensor `t` as a writable byte view (a buffer these
    functions read into or write from without a copy)."""
    return memoryview(byte_view(t).numpy())


def read_into(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Fill `bufs`, one after the other, from byte `offset` of `fd` on, `IOV_MAX` buffers per
    `preadv`; returns the bytes read (fewer than asked only at the end of the file)."""
    bufs = [b for b in bufs if len(b)]
    done, i = 0, 0
    while i < len(bufs):
        n = os.preadv(fd, bufs[i : i + IOV_MAX], offset + done)
        if n == 0:
            break
        done += n
        while i < len(bufs) and n >= len(bufs[i]):
            n -= len(bufs[i])
            i += 1
        if n:
            bufs[i] = bufs[i][n:]
    return done


def read_bytes(fd: int, offset: int, n: int) -> bytes:
    """Up to `n` bytes from `offset` (fewer only at the end of the file)."""
    parts = []
    while n > 0:
        part = os.pread(fd, n, offset)
        if not part:
            break
        parts.append(part)
        offset, n = offset + len(part), n - len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of `data` at byte `offset` of `fd`."""
    while len(data):
        n = os.pwrite(fd, data[:_MAX_IO], offset)
        data, offset = data[n:], offset + n


def grow(fd: int, size: int) -> None:
    """Make the new, empty file `fd` `size` bytes long, for writes at their offsets: by
    `ftruncate`, or by writing its last byte where a file system extends no file so (FAT through
    FUSE answers EPERM)."""
    try:
        os.ftruncate(fd, size)
    except OSError as e:
        if size == 0 or e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        write_all(fd, memoryview(b"\0"), size - 1)
