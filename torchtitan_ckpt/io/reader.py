"""Reading DCP's TORCH_SAVE items without a `torch.load` per item.

DCP stores every tensor and every non-tensor value of a checkpoint as one `torch.save` archive (an
uncompressed zip) inside a rank's `.distcp` file, and its `FileSystemReader` reads each one back
with `torch.load` (a fixed cost per item, then a copy into the destination). Here each file's items are
read in offset order on a few threads; a tensor item's zip directory and header pickle are parsed
(`torch_archive`) without running code from the file, and its single storage record is read straight into the
destination tensor (through a bounded temporary when the destination is a non-contiguous view,
another dtype or another device). A non-tensor value is unpickled from the archive's first
record with no globals allowed. An archive of any other shape goes through
`torch.load(weights_only=True)`, as DCP does.

Every item is checked, and every value read, before the first tensor byte is written
(`ItemReader`): the destinations are the job's own tensors, and a damaged item found halfway
would leave them part one step, part another.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import os
import pickle
import threading
from collections.abc import Callable, Sequence
import concurrent.futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ..errors import CorruptCheckpointError, MalformedArchive, UnrecognisedArchive, UnsafePickleError
from ..policy.split import in_order_runs, share
from . import posio, safe_open
from .torch_archive import (HeaderUnpickler, SavedTensor, check_header_record, check_small_records, header_pickle,
                            local_record, refusal, torch_load, unpickle_header, zip_record, zip_records)
from .untrusted import brief

logger = logging.getLogger(__name__)

_WINDOW = 4096
"""Bytes read at once at each end of an item: its zip directory and header records fit in them."""
_MAX_DIRECTORY = 16 << 10
"""Largest zip directory of a tensor's archive read (`torch.save` writes about 500 bytes): a
larger one is refused before it is read."""
_NOWAIT = getattr(os, "RWF_NOWAIT", 0) if hasattr(os, "posix_fadvise") else 0
"""`preadv` flag: read only what the page cache holds (Linux); 0 where it or `posix_fadvise` is
missing, and then the page cache is left to the kernel."""
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PIECE_BYTES = 4 << 20
"""Largest temporary buffer of one indirect tensor copy, per thread."""
_GAP = 64 << 10
"""Most bytes between two tensors' bytes that the fill reads through (into a scratch buffer)
rather than start a new read."""
_SPAN = 64 << 20
"""Bytes one vectored read of the fill moves at most (failures are seen between reads)."""
_SCRATCH = 4 << 20
"""Most bytes between tensors one vectored read moves into its scratch buffer (a checkpoint's
framing is a few KB per item; this bounds what a crafted one can make the reader allocate)."""
_AHEAD = 64 << 20
"""Bytes of a run's tensors, from its first, that the kernel is asked to start reading once the
run's first pass is done on a cold cache, so that the disk works while the ranks agree that
every item checked out (a round that waits for the slowest rank's planning and checks)."""

# ---------------------------------------------------------------- one file, read forward


class _Cursor:
    """A `.distcp` file opened for one run of items, read forward. Small reads come from the
    last two windows read (each `2 * _WINDOW` bytes from where it was asked), so one read gives
    an item's zip directory, at its end, and the next item's header records, at its start."""

    def __init__(self, path: str, fd: int, first: int):
        self.path, self.fd = path, fd
        """The file's descriptor, shared by the cursors of its runs (closed by `ItemReader`)."""
        self.size = os.fstat(fd).st_size
        self._windows: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=2)
        self.cold = self._probe(first)
        """Whether the page cache lacked the run's first window when the cursor was opened
        (every run's cursor is opened before any run is read, so that one run's reads past
        its end do not make the next one look cached)."""
        self.span = (self.size, 0)
        """The bytes of the file the windows read from the disk cover."""

    def read(self, at: int, n: int) -> bytes:
        """Up to `n` bytes from `at` (fewer at the end of the file)."""
        for start, data in self._windows:
            if start <= at and at + n <= start + len(data):
                return data[at - start : at - start + n]
        if n > 2 * _WINDOW:  # a whole item of some size: read once, not kept
            return posio.read_bytes(self.fd, at, n)
        data = posio.read_bytes(self.fd, at, 2 * _WINDOW)
        self.span = (min(self.span[0], at), max(self.span[1], at + len(data)))
        self._windows.append((at, data))
        return data[:n]

    def _probe(self, at: int) -> bool:
        """Whether the page cache lacks some of the window at `at`; where it holds all of it,
        the window is kept for the first read. False where the file system cannot tell
        (`RWF_NOWAIT` unsupported): the page cache is then left to the kernel."""
        if not _NOWAIT:
            return False
        buf = bytearray(2 * _WINDOW)
        try:
            got = os.preadv(self.fd, [buf], at, _NOWAIT)
        except BlockingIOError:  # some of it is not cached
            return True
        except OSError:  # EOPNOTSUPP
            return False
        if got < len(buf) and at + got < self.size:
            return True
        self._windows.append((at, bytes(buf[:got])))
        return False

    def forget_read(self) -> None:
        """On a cold cache, drop from it what the first pass read (a few KB at each end of every
        item): left there, those islands split the kernel's read-ahead of the tensor bytes
        between them into several times as many disk requests, which slows the second pass
        (`docs/performance.md`). On a warm cache nothing is dropped."""
        if self.cold and self.span[1] > self.span[0]:
            start = self.span[0] - self.span[0] % _PAGE
            os.posix_fadvise(self.fd, start, self.span[1] - start, os.POSIX_FADV_DONTNEED)

    def read_ahead(self, start: int, stop: int) -> None:
        """On a cold cache, ask the kernel to start reading bytes [start, stop) (after
        `forget_read`, which would drop them)."""
        if self.cold and stop > start:
            os.posix_fadvise(self.fd, start, stop - start, os.POSIX_FADV_WILLNEED)

    def prefetch(self, places: Sequence) -> None:
        """On a cold cache, ask the kernel to start reading the few KB at each end of the items
        at `places` (in offset order) that the first pass reads, so it waits on many small
        reads at once rather than one after the other."""
        ranges: list[list[int]] = []
        for p in places:
            end = p.offset + p.length
            for start, stop in [(p.offset, p.offset + 2 * _WINDOW), (end - _WINDOW, end + 2 * _WINDOW)]:
                start, stop = max(start, p.offset), min(stop, self.size)
                if ranges and start <= ranges[-1][1]:
                    ranges[-1][1] = max(ranges[-1][1], stop)
                elif stop > start:
                    ranges.append([start, stop])
        for start, stop in ranges:
            os.posix_fadvise(self.fd, start, stop - start, os.POSIX_FADV_WILLNEED)
        if ranges:
            self.span = (min(self.span[0], ranges[0][0]), max(self.span[1], ranges[-1][1]))

    def readinto(self, at: int, buf: memoryview) -> int:
        return posio.read_into(self.fd, [buf], at)


@dataclass(frozen=True)
class _Located:
    """A tensor item's header and where its storage record was found from the item's first bytes."""

    saved: SavedTensor
    folder: bytes
    pickle_length: int
    header: int
    start: int

    @property
    def record(self) -> bytes:
        return self.folder + b"data/" + self.saved.key.encode()

    @property
    def nbytes(self) -> int:
        return self.saved.storage_numel * self.saved.dtype.itemsize


class _Item:
    """One item of a `.distcp` file: bytes [offset, offset + length)."""

    def __init__(self, cursor: _Cursor, offset: int, length: int, what: str):
        self.cursor, self.offset, self.length, self.what = cursor, offset, length, what

    def fail(self, problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.cursor.path}: item '{self.what}' (bytes {self.offset}-{self.offset + self.length}) "
            f"{problem}; the file is damaged or was not written by DCP: restore it or load another step "
            "(checkpoint.load_step; checkpoint.verify_on_load passes over a damaged newest step)")

    def read(self, at: int, n: int) -> bytes:
        data = self.cursor.read(self.offset + at, n)
        if len(data) != n:
            raise self.fail(f"is cut short: the file ends {n - len(data)} bytes early")
        return data

    def readinto(self, at: int, buf: memoryview) -> None:
        got = self.cursor.readinto(self.offset + at, buf)
        if got != len(buf):
            raise self.fail(f"is cut short: the file ends {len(buf) - got} bytes early")

    def locate(self, headers: dict[bytes, tuple[SavedTensor, int]]) -> _Located:
        """The tensor's header and storage record, from the item's first bytes only, so that the
        file is read forward; `confirm` checks them against the zip directory afterwards.
        `headers` caches parsed header pickles (and their lengths): tensors of one shape and
        dtype share theirs."""
        head = self.read(0, min(self.length, _WINDOW))
        folder, pkl, pos = header_pickle(head)
        if pkl not in headers:
            saved, length = unpickle_header(HeaderUnpickler, pkl)
            if not isinstance(saved, SavedTensor):
                raise UnrecognisedArchive("not a tensor")
            headers[pkl] = saved, length
        saved, length = headers[pkl]
        record = folder + b"data/" + saved.key.encode()
        while pos >= 0:
            found, start = local_record(head, pos)
            if found == record:
                located = _Located(saved, folder, length, pos, start)
                if start + located.nbytes > self.length:
                    raise UnrecognisedArchive("storage record past the item's end")
                return located
            pos = head.find(b"PK\x03\x04", pos + 4)
        raise UnrecognisedArchive("storage record not among the first records")

    def confirm(self, located: _Located) -> None:
        """Check what `locate` found against the zip directory at the item's end."""
        tail = max(located.start + located.nbytes, self.length - _WINDOW)
        self.read(tail, self.length - tail)  # one read for the directory and the next item's start
        records = zip_records(self.read, self.length, _MAX_DIRECTORY)
        check_header_record(records, located.folder, located.pickle_length)
        check_small_records(self.read, self.length, records, located.folder)
        order = zip_record(self.read, self.length, records, located.folder + b"byteorder")
        if order is not None and order[1] not in (len(b"little"), len(b"big")):
            raise MalformedArchive(f"has a byteorder record of {order[1]} bytes, not 'little' or 'big'")
        if order is None or self.read(*order) != b"little":
            raise UnrecognisedArchive("not a little-endian torch.save archive")
        if located.record not in records:
            raise self.fail(f"lacks the storage record {brief(located.record)} its header names")
        header, size = records[located.record]
        if size != located.nbytes:
            raise self.fail(f"has a storage record of {size} bytes; its header says {located.saved.storage_numel} "
                            f"x {located.saved.dtype} = {located.nbytes} bytes")
        if header != located.header:
            raise UnrecognisedArchive("storage record elsewhere than its first header")


# ---------------------------------------------------------------- a plan's reads


def _narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (start, n) in enumerate(zip(offsets, lengths)):
        if start != 0 or n != t.size(dim):
            t = t.narrow(dim, start, n)
    return t


def _row_major(size: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _dtype_problem(planner: LoadPlanner, req: ReadItem, dtype: torch.dtype) -> str | None:
    """Whether an item's own dtype differs from the one `.metadata` declares for its tensor: a
    load into tensors made from the metadata (`convert`'s) would cast its values silently."""
    entries = getattr(getattr(planner, "metadata", None), "state_dict_metadata", None) or {}
    declared = getattr(getattr(entries.get(req.storage_index.fqn), "properties", None), "dtype", None)
    if declared is not None and declared != dtype:
        return f"holds {dtype} values where the checkpoint's metadata says {declared}"
    return None


@dataclass(frozen=True)
class _Region:
    """The part of a saved tensor that one read request wants, in elements of its storage."""

    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    contiguous: bool

    def view(self, saved: SavedTensor) -> torch.Tensor:
        """The region as a meta tensor over a storage of the saved record's size."""
        storage = torch.empty(saved.storage_numel, dtype=saved.dtype, device="meta")
        return storage.as_strided(self.size, self.stride, self.offset)


def _fits(saved: SavedTensor) -> bool:
    """Whether the saved view lies within its storage (meta tensors' `as_strided` does not check)."""
    if saved.storage_offset < 0 or len(saved.stride) != len(saved.size) or any(st < 0 for st in saved.stride):
        return False
    extent = sum((n - 1) * st for n, st in zip(saved.size, saved.stride))
    return 0 in saved.size or saved.storage_offset + extent < saved.storage_numel


def _region(saved: SavedTensor, req: ReadItem) -> _Region | None:
    """What `req` reads of `saved` (a view that `_fits`), or None when it lies outside it."""
    size = torch.Size(req.lengths)
    if len(size) != len(saved.size) or len(req.storage_offsets) != len(saved.size):
        return None
    if (tuple(size) == saved.size and not any(req.storage_offsets) and saved.storage_offset == 0
            and saved.stride == _row_major(saved.size) and size.numel() == saved.storage_numel):
        return _Region(size, saved.stride, 0, True)  # the whole record, as most reads are
    try:
        storage = torch.empty(saved.storage_numel, dtype=saved.dtype, device="meta")
        view = _narrow(storage.as_strided(saved.size, saved.stride, saved.storage_offset),
                       req.storage_offsets, req.lengths)
    except RuntimeError:
        return None
    return _Region(view.size(), view.stride(), view.storage_offset(), view.is_contiguous())


@dataclass
class _Planned:
    """A tensor item, checked: where its bytes go, and how to read them (`located` None: through
    `torch.load`)."""

    item: _Item
    req: ReadItem
    dest: torch.Tensor
    located: _Located | None = None
    region: _Region | None = None


@dataclass
class _Run:
    cursor: _Cursor
    planned: list[_Planned]


class ItemReader:
    """Reads a load plan's items from a checkpoint folder into the planner's destinations.

    `storage_data` maps each item's storage index to DCP's `_StorageInfo` (relative path, offset,
    length). The read has two passes, so that what a checkpoint holds can fail a load only
    before any destination is written (destinations are the model's own tensors, filled in
    place): `check` opens every file, checks every item against its file and its tensor header
    (a few KB at each end of an item) and reads every non-tensor value; `fill` reads the
    tensors' bytes through the descriptors `check` opened. What can still fail in `fill` is the
    storage itself (an I/O error, a file cut short or changed since `check`). Each file's items
    are read in offset order; the plan is cut into runs of about total / `threads` bytes, each
    pass reading the runs in parallel. Planner calls are serialised by a lock; the first
    failure stops every run at its next item. `close` closes the files.
    """

    def __init__(self, root: str, storage_data: dict, threads: int):
        self.root, self.storage_data, self.threads = root, storage_data, threads
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self._headers: dict[bytes, tuple[SavedTensor, int]] = {}
        self._fds: dict[str, int] = {}
        self._names: dict[tuple[int, int], str] = {}
        """(device, inode) of each file opened -> the name it was opened by."""
        self._checked: list[_Run] = []
        self._pool: ThreadPoolExecutor | None = None

    def check(self, items: Sequence[ReadItem], planner: LoadPlanner) -> None:
        """The first pass: open every file of `items`, check every item, hand every non-tensor
        value to the planner; no tensor is written. Every run's cursor is opened first, before
        any run is read."""
        runs = self._runs(items)
        safe_open.make_room(len({rel for rel, _ in runs}), "the data files this rank reads")
        runs = [(self._open(rel, run), run) for rel, run in runs]
        self._checked = self._each(lambda run: self._check_run(*run, planner), runs)

    @property
    def opened(self) -> dict[str, int]:
        """The descriptor of each file `check` opened, by its name (relative to `root`)."""
        return dict(self._fds)

    def fill(self, planner: LoadPlanner) -> None:
        """The second pass: read the checked tensors into their destinations."""
        self._each(lambda run: self._fill_run(run, planner), self._checked)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _each(self, fn: Callable[[Any], Any], jobs: list) -> list:
        """`fn` of each job, on up to `threads` threads; the first failure stops the others."""
        if self.threads == 1 or len(jobs) <= 1:
            return [fn(job) for job in jobs]
        if self._pool is None:  # one pool for both passes
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-load")
        futures = [self._pool.submit(fn, job) for job in jobs]
        try:
            return [f.result() for f in futures]
        except BaseException:
            self._failed.set()
            for f in futures:
                f.cancel()
            concurrent.futures.wait(futures)
            raise

    def _runs(self, items: Sequence[ReadItem]) -> list[tuple[str, list[ReadItem]]]:
        """Each file's items in offset order, cut into runs of about total / threads bytes."""
        by_file: dict[str, list[ReadItem]] = {}
        for req in items:
            by_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        def length(req: ReadItem) -> int:
            return self.storage_data[req.storage_index].length

        target = share(sum(map(length, items)), self.threads)
        ordered = {rel: sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset)
                   for rel, reqs in by_file.items()}
        return [(rel, run) for rel, reqs in ordered.items() for run in in_order_runs(reqs, length, target)]

    def _open(self, rel: str, run: list[ReadItem]) -> _Cursor:
        """A cursor for `run` of the file `rel`, on the file's one descriptor (opened here for
        its first run): a rank reading the files of thousands of ranks holds one per file. A
        file opened by another name before (a link) is refused: `validate` found the entries of
        each name apart, but not those of one file under two names."""
        if rel not in self._fds:
            fd = safe_open.open_fd(self.root, rel, "a data file named in .metadata")
            st = os.fstat(fd)
            if (other := self._names.setdefault((st.st_dev, st.st_ino), rel)) != rel:
                os.close(fd)
                raise CorruptCheckpointError(
                    f"{os.path.join(self.root, rel)}: the data files {brief(rel)} and {brief(other)} are one file (a "
                    "link), so their storage entries share bytes of it (every item is written to bytes of its own, "
                    "once): the checkpoint is damaged or crafted")
            self._fds[rel] = fd
        return _Cursor(os.path.join(self.root, rel), self._fds[rel], self.storage_data[run[0].storage_index].offset)

    def _check_run(self, cursor: _Cursor, run: list[ReadItem], planner: LoadPlanner) -> _Run:
        """The first pass over a run: nothing is written to a destination."""
        try:
            planned = []
            places = [self.storage_data[req.storage_index] for req in run]
            for k, req in enumerate(run):
                if self._failed.is_set():
                    break
                if k % 64 == 0 and cursor.cold:
                    cursor.prefetch(places[k : k + 64])
                info = places[k]
                item = _Item(cursor, info.offset, info.length, req.storage_index.fqn)
                if info.offset + info.length > cursor.size:  # before any buffer of that length
                    raise item.fail(f"is cut short: the file ends at byte {cursor.size}, "
                                    f"{info.offset + info.length - cursor.size} bytes early")
                if req.type == LoadItemType.BYTE_IO:
                    self._read_value(item, req, planner)
                else:
                    planned.append(self._check_tensor(item, req, planner))
            cursor.forget_read()
            direct = [p for p in planned if _direct(p)]
            if direct:
                first, last = _start(direct[0]), _start(direct[-1]) + direct[-1].dest.nbytes
                cursor.read_ahead(first, min(last, first + _AHEAD))
            return _Run(cursor, planned)
        except BaseException:
            self._failed.set()
            raise

    def _fill_run(self, run: _Run, planner: LoadPlanner) -> None:
        """The second pass over a run: its tensors' bytes, into their destinations. Tensors read
        straight into their destinations go in spans: one vectored read from the first one's
        bytes to the last one's, the few KB of archive framing between them into a scratch
        buffer, so the kernel sees one forward stream (a read per tensor makes it issue two to
        three times as many, smaller, disk requests; `docs/performance.md`)."""
        try:
            for span in _spans(run.planned):
                if self._failed.is_set():
                    return
                if len(span) == 1 and not _direct(span[0]):
                    self._read_tensor(span[0])
                else:
                    _read_span(span)
                with self._lock:
                    for p in span:
                        planner.commit_tensor(p.req, p.dest)
        except BaseException:
            self._failed.set()
            raise

    def _read_value(self, item: _Item, req: ReadItem, planner: LoadPlanner) -> None:
        data = item.read(0, item.length)
        with self._lock:
            try:
                planner.load_bytes(req, io.BytesIO(data))
            except Exception as e:  # torch.load's errors on damaged bytes are of any class
                raise item.fail(f"is not a value this load can read ({type(e).__name__}: {e})") from e

    def _check_tensor(self, item: _Item, req: ReadItem, planner: LoadPlanner) -> _Planned:
        """The item's header and zip directory checked against the metadata's region and the
        destination; an archive of another shape is loaded once with `torch.load` to check it."""
        with self._lock:
            dest = planner.resolve_tensor(req).detach()
        try:
            located = item.locate(self._headers)
            saved = located.saved
            if not _fits(saved):
                raise item.fail(f"has a header whose view (size {brief(list(saved.size))}, stride "
                                f"{brief(list(saved.stride))}, offset {saved.storage_offset}) runs past its "
                                f"{saved.storage_numel} stored elements")
            region = _region(saved, req)
            if region is None:
                raise item.fail(f"does not hold the region {list(req.storage_offsets)} + {list(req.lengths)} "
                                f"the checkpoint's metadata says (it holds {brief(list(saved.size))})")
            if dest.size() != region.size:
                raise item.fail(f"holds {list(region.size)} where the destination is {list(dest.size())}")
            if problem := _dtype_problem(planner, req, saved.dtype):
                raise item.fail(problem)
            item.confirm(located)
        except MalformedArchive as e:
            raise item.fail(str(e)) from None
        except UnsafePickleError as e:
            raise item.fail(f"has a header pickle that {e.problem}") from None
        except UnrecognisedArchive as e:  # not the archive it looked like: read it the slow way
            logger.debug("%s: item '%s' read with torch.load (%s)", item.cursor.path, item.what, e)
            if problem := _dtype_problem(planner, req, self._load_with_torch(item, req, dest).dtype):
                raise item.fail(problem) from None
            return _Planned(item, req, dest)
        return _Planned(item, req, dest, located, region)

    def _read_tensor(self, p: _Planned) -> None:
        """A tensor that is not read straight into its destination: through `torch.load`, or
        through bounded temporaries."""
        if p.located is None:
            p.dest.copy_(self._load_with_torch(p.item, p.req, p.dest))
        else:
            _copy_pieces(p.item, p.located.start, p.region.view(p.located.saved), p.dest)

    @staticmethod
    def _load_with_torch(item: _Item, req: ReadItem, dest: torch.Tensor) -> torch.Tensor:
        """The region `req` reads of the item, loaded with `torch.load(weights_only=True)`."""
        try:
            tensor = torch_load(item.read(0, item.length))
        except MalformedArchive as e:
            raise item.fail(str(e)) from None
        except UnsafePickleError as e:
            raise item.fail(f"has a pickle that {e.problem}") from None
        except pickle.UnpicklingError as e:
            raise item.fail(f"is not a plain tensor and loading it could run code; refused ({refusal(e)})") from None
        except Exception as e:
            raise item.fail(f"is not a readable torch.save archive ({type(e).__name__}: {e})") from None
        if not isinstance(tensor, torch.Tensor):
            raise item.fail(f"holds a {type(tensor).__name__} where the metadata says a tensor")
        region = None
        if len(req.lengths) == len(req.storage_offsets) == tensor.dim():
            with contextlib.suppress(RuntimeError):
                region = _narrow(tensor, req.storage_offsets, req.lengths)
        if region is None:
            raise item.fail(f"does not hold the region {list(req.storage_offsets)} + {list(req.lengths)} "
                            f"the checkpoint's metadata says (it holds {list(tensor.size())})")
        tensor = region
        if dest.size() != tensor.size():
            raise item.fail(f"holds {tuple(tensor.size())} where the destination is {tuple(dest.size())}")
        return tensor


def _direct(p: _Planned) -> bool:
    """Whether the tensor's bytes are read straight into its destination: its region is one
    contiguous stretch of the record, of the destination's dtype, and the destination a
    contiguous CPU tensor whose memory holds its values as they are (not a lazy `conj()` or
    negated view, whose bytes torch will not hand out)."""
    return (p.located is not None and p.region.contiguous and p.dest.is_contiguous()
            and p.dest.dtype == p.located.saved.dtype and p.dest.device.type == "cpu"
            and not p.dest.is_conj() and not p.dest.is_neg())


def _start(p: _Planned) -> int:
    """Where in the file a direct tensor's bytes begin."""
    return p.item.offset + p.located.start + p.region.offset * p.located.saved.dtype.itemsize


def _spans(planned: list[_Planned]) -> list[list[_Planned]]:
    """`planned` (in file order) cut into spans of direct tensors at most `_GAP` bytes apart,
    `_SPAN` bytes in all and `_SCRATCH` bytes between them; any other tensor is a span of its own."""
    spans: list[list[_Planned]] = []
    end = size = between = 0
    for p in planned:
        if not _direct(p):
            spans.append([p])
            end = -1
            continue
        start, n = _start(p), p.dest.nbytes
        gap = start - end
        if (not spans or end < 0 or not 0 <= gap <= _GAP or size + gap + n > _SPAN
                or between + gap > _SCRATCH):
            spans.append([])
            size = between = gap = 0
        spans[-1].append(p)
        end, size, between = start + n, size + gap + n, between + gap
    return spans


def _read_span(span: list[_Planned]) -> None:
    """One vectored read of a span of direct tensors: each into its destination, what lies
    between them into a scratch buffer."""
    first = _start(span[0])
    gaps = bytearray(sum(_start(b) - _start(a) - a.dest.nbytes for a, b in zip(span, span[1:])))
    bufs, pos, used = [], first, 0
    for p in span:
        gap = _start(p) - pos
        bufs += [memoryview(gaps)[used:used + gap], posio.tensor_bytes(p.dest)]
        pos, used = _start(p) + p.dest.nbytes, used + gap
    got = posio.read_into(span[0].item.cursor.fd, bufs, first)
    if got != pos - first:
        short = next(p for p in span if _start(p) + p.dest.nbytes > first + got)
        raise short.item.fail(f"is cut short: the file ends at byte {first + got}")


def _copy_pieces(item: _Item, start: int, region: torch.Tensor, dest: torch.Tensor) -> None:
    """Copy `region` (a meta view of the storage record whose bytes begin at `start` in the item)
    into `dest`, through temporaries of at most about `_PIECE_BYTES`: a region spanning more is
    split along its dimension of largest stride (dim 0 of a row-major tensor, the last of a
    transposed one), and a piece that still spans more is split again along its next one."""
    itemsize = region.dtype.itemsize
    if region.dim() == 0:
        region, dest = region.reshape(1), dest.reshape(1)
    if region.numel() == 0:
        return
    span = 1 + sum((n - 1) * s for n, s in zip(region.size(), region.stride()))
    if span * itemsize <= _PIECE_BYTES or region.numel() == 1:
        tmp = torch.empty(span, dtype=region.dtype, device="cpu")
        item.readinto(start + region.storage_offset() * itemsize, posio.tensor_bytes(tmp))
        dest.copy_(tmp.as_strided(region.size(), region.stride(), 0))
        return
    dim = max((d for d in range(region.dim()) if region.size(d) > 1), key=region.stride)
    # fewer than all of its slices, so each piece is smaller even where views overlap
    step = max(1, min(_PIECE_BYTES // max(1, region.stride(dim) * itemsize), region.size(dim) // 2))
    for first in range(0, region.size(dim), step):
        n = min(step, region.size(dim) - first)
        _copy_pieces(item, start, region.narrow(dim, first, n), dest.narrow(dim, first, n))
