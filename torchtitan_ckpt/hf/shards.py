"""Reading this rank's shard of each HF tensor straight from the safetensors files.

Safetensors stores a tensor row-major, so the rows [lo, hi) that a rank holds (FSDP's Shard(0);
the local part of any Shard/Replicate placement is found as DCP finds it) are one byte range of
the file, and that range is all the rank reads. Ranges are cut into pieces of about
`PIECE_BYTES`, read in file order by a few threads, each reading its own stretch of the files
front to back. A piece goes straight into the shard's memory when its rows are the shard's
rows in the file's dtype: in one read when they lie in the same order, and as one scattered read
(`preadv`, each row to its place) when an adapter reorders rows within heads. Otherwise (another
dtype, a shard cut along another dimension, a tensor off the CPU) it goes through a buffer,
shared by the threads, so the extra memory is one piece. Reordered rows are read from the first
to the last whole block (head) that [lo, hi) touches, the rows outside the shard into one spare
row: at most one block beyond the shard on each side, and never the whole tensor.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from ..dcp.storage import dtensor_chunk
from ..io import safe_open
from ..io.posio import tensor_bytes
from ..policy.split import in_order_runs, share
from .adapter import LOCAL_PLACEMENTS, HFSource
from .safetensors_io import TensorEntry, read_exact

PIECE_BYTES = 8 << 20


@dataclass(frozen=True)
class Read:
    """Bytes [offset, offset + nbytes) of `path`: whole rows, of `shape` and `dtype`, of one HF
    tensor. `dest` receives this rank's part of them: the rows `rows` (a slice, or indices that
    also put them in our order) and, of the other dimensions, `inner`."""

    path: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    dest: torch.Tensor
    rows: slice | torch.Tensor
    inner: tuple[slice, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def whole_rows(self) -> bool:
        """`dest` takes whole rows, in the file's dtype, into contiguous CPU memory that holds its
        values as they are (not a lazily conjugated or negated view, whose memory holds others)."""
        return (self.dest.dtype == self.dtype and self.dest.device.type == "cpu" and self.dest.is_contiguous()
                and not self.dest.is_conj() and not self.dest.is_neg() and tuple(self.dest.shape[1:]) == self.shape[1:])

    @property
    def direct(self) -> bool:
        """The bytes read are exactly `dest`'s, so they are read into its memory."""
        return self.whole_rows and isinstance(self.rows, slice) and self.dest.shape[0] == self.shape[0]

    @property
    def buffered(self) -> bool:
        """The rows read are not `dest`'s rows as they lie in memory (another dtype, a shard cut
        along another dimension, a destination not contiguous or off the CPU), so they go
        through a buffer."""
        return not self.whole_rows


def row_pieces(lo: int, hi: int, rows: int, block: int, piece_rows: int) -> list[tuple[int, int]]:
    """The row ranges to read for rows [lo, hi) of a tensor of `rows` rows whose rows move within
    consecutive blocks of `block` rows: [lo, hi) widened to whole blocks, cut into pieces of
    whole blocks of about `piece_rows` rows (at least one block)."""
    start = lo // block * block
    stop = min(rows, -(-hi // block) * block)
    step = max(block, piece_rows // block * block)
    return [(r, min(r + step, stop)) for r in range(start, stop, step)]


def plan_reads(name: str, value: Any, source: HFSource, layout: Mapping[str, TensorEntry]) -> list[Read]:
    """The reads that fill this rank's part of `value` (our tensor `name`, a tensor or DTensor
    shaped as its HF tensor, or as the stack of them for a grouped tensor) from the HF tensors
    in `layout`. Of a grouped tensor, only the experts this rank holds are read."""
    local, offsets = _local_part(name, value)
    if not source.stack:
        return _plan_tensor(local, offsets, source, layout[source.name])
    reads = []
    for k in range(local.shape[0]):
        hf = source.stack[offsets[0] + k]
        reads += _plan_tensor(local[k], offsets[1:], HFSource(hf), layout[hf])
    return reads


def _plan_tensor(local: torch.Tensor, offsets: tuple[int, ...], source: HFSource, entry: TensorEntry) -> list[Read]:
    """The reads that fill `local`, the part at `offsets` of a tensor shaped as `entry`."""
    if local.numel() == 0:
        return []
    if not source.row_order and local.dim() == 2 and local.shape[1] < entry.shape[1]:
        return _plan_columns(local, offsets, entry)
    shape = entry.shape or (1,)  # a scalar is one row of one element
    local, offsets = (local.view(1), (0,)) if local.dim() == 0 else (local, offsets)
    lo, hi = offsets[0], offsets[0] + local.shape[0]
    inner = tuple(slice(o, o + n) for o, n in zip(offsets[1:], local.shape[1:]))
    row_bytes = math.prod(shape[1:]) * entry.dtype.itemsize
    order = _order_tensor(source.row_order) if source.row_order else None
    reads = []
    for start, stop in row_pieces(lo, hi, shape[0], source.block_rows, max(1, PIECE_BYTES // max(1, row_bytes))):
        first, last = max(lo, start), min(hi, stop)
        rows: slice | torch.Tensor = slice(first - start, last - start)
        if order is not None:  # our row g is HF row order[g % block] of g's block
            ours = torch.arange(first, last, device="cpu")
            rows = ours - ours % len(order) + order[ours % len(order)] - start
        reads.append(Read(entry.path, entry.offset + start * row_bytes, entry.dtype, (stop - start, *shape[1:]),
                          local[first - lo:last - lo], rows, inner))
    return reads


def _plan_columns(local: torch.Tensor, offsets: tuple[int, ...], entry: TensorEntry) -> list[Read]:
    """A block of columns (a rowwise tensor-parallel shard, `Shard(1)`): each of its rows is
    one stretch of the file, read into its row, so the rank reads its own bytes and no others."""
    (row, col), width, itemsize = offsets, entry.shape[1], entry.dtype.itemsize
    return [Read(entry.path, entry.offset + ((row + k) * width + col) * itemsize, entry.dtype, (1, local.shape[1]),
                 local[k:k + 1], slice(0, 1), (slice(0, local.shape[1]),)) for k in range(local.shape[0])]


def _local_part(name: str, value: Any) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's tensor of `value` and where it starts in the global tensor."""
    if not isinstance(value, DTensor):
        return value.detach(), (0,) * value.dim()
    if not all(isinstance(p, LOCAL_PLACEMENTS) for p in value.placements):
        raise CheckpointError(f"{name}: loading a DTensor with placements {value.placements} from HF "
                              "is not supported (only Shard, FSDP's _StridedShard and Replicate)")
    return value.to_local().detach(), dtensor_chunk(tuple(value.shape), value.device_mesh, tuple(value.placements))[0]


@functools.lru_cache(maxsize=16)
def _order_tensor(row_order: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(row_order, device="cpu")


def read_all(reads: list[Read], num_threads: int) -> int:
    """Do `reads` on up to `num_threads` threads; return the bytes read. The reads, in file
    order, are cut into one run of about equal bytes per thread, and each thread reads its run
    front to back: a few long sequential streams, which kernel readahead serves well (threads
    taking pieces in turn broke the streams up and were slower than one thread). Pieces that
    need a buffer share one, the size of the largest of them, so the extra memory does not grow
    with the threads (a fresh buffer per piece left the allocator holding several times more).
    Since the buffer serialises the pieces that need it, one thread reads everything when they
    are most of the bytes (a bf16 checkpoint into fp32 weights), where threads taking turns at
    the buffer are slower than one. On an error the other threads stop at their next piece and
    the error is raised."""
    reads = sorted(reads, key=lambda r: (r.path, r.offset))
    largest = max((r.nbytes for r in reads if r.buffered), default=0)
    total = sum(r.nbytes for r in reads)
    if 2 * sum(r.nbytes for r in reads if r.buffered) > total:
        num_threads = 1
    scratch = _Scratch(largest)
    failed = threading.Event()

    def read_run(run: list[Read]) -> None:
        path, fd = None, -1  # the run's reads are in file order: one file open at a time
        try:
            for r in run:
                if failed.is_set():
                    return
                if r.path != path:
                    if fd >= 0:
                        os.close(fd)
                        fd = -1
                    fd = safe_open.open_fd(os.path.dirname(r.path), os.path.basename(r.path), "a safetensors file")
                    path = r.path
                _read(r, fd, scratch)
        except BaseException:
            failed.set()
            raise
        finally:
            if fd >= 0:
                os.close(fd)

    runs = in_order_runs(reads, lambda r: r.nbytes, share(sum(r.nbytes for r in reads), num_threads), num_threads)
    if len(runs) <= 1:
        for run in runs:
            read_run(run)
    else:
        with ThreadPoolExecutor(len(runs), thread_name_prefix="hf-read") as pool:
            for future in [pool.submit(read_run, run) for run in runs]:
                future.result()
    return total


class _Scratch:
    """One buffer for the pieces that cannot be read straight into their shard, used by one
    thread at a time. Its pages are touched, so counted, only as pieces use them."""

    def __init__(self, nbytes: int):
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        self.lock = threading.Lock()


def _read(read: Read, fd: int, scratch: _Scratch) -> None:
    if read.direct:
        read_exact(fd, [tensor_bytes(read.dest)], read.offset, read.path)
    elif read.whole_rows:
        read_exact(fd, _row_places(read), read.offset, read.path)
    else:
        with scratch.lock:
            buf = scratch.buf[:read.nbytes].view(read.dtype).view(read.shape)
            read_exact(fd, [tensor_bytes(buf)], read.offset, read.path)
            read.dest.copy_(buf[(read.rows, *read.inner)])


def _row_places(read: Read) -> list[memoryview]:
    """Where each row that `read` reads goes, in file order: its row of `dest`, or, for a row
    outside this rank's shard (the rest of a head the shard cuts), one spare row."""
    row = math.prod(read.shape[1:]) * read.dtype.itemsize
    dest = tensor_bytes(read.dest)
    places: list[memoryview | None] = [None] * read.shape[0]
    ours = range(read.shape[0])[read.rows] if isinstance(read.rows, slice) else read.rows.tolist()
    for k, j in enumerate(ours):
        places[j] = dest[k * row:(k + 1) * row]
    if None in places:
        spare = memoryview(bytearray(row))
        places = [spare if p is None else p for p in places]
    return places
