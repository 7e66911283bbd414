"""How state goes through `torch.distributed.checkpoint`: storage readers/writers and planners.

This is the one place that picks DCP's plug-ins for a save or a load, so later features (dedup
policy, Hugging Face format) replace a factory here instead of adding branches to the manager.
Loading runs no code from the checkpoint: `.metadata` is read with an allow-list unpickler
(`metadata`), tensors are read by `reader` (which parses their headers itself) and non-tensor
values are plain data or go through `torch.load(weights_only=True)` (DCP itself uses
`weights_only=False`). Every pickle is checked by `untrusted.check_pickle` before it is unpickled.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import io
import logging
import os
import pickle
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo  # the format's entry type
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # DCP's keys, as its planner makes them
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors  # as DCP's save planner
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # as DCP's own planning
from torch.futures import Future

from ..io import durable, filewriter, own_writes, reader, safe_open, torch_archive
from ..errors import RankFailed, UnsafePickleError
from ..io.checksum import crc32, file_crc32, hex_crc
from ..io.tensors import local_values
from .. import commit, gc_pause
from ..config import Checkpoint
from ..policy.split import balanced_groups
from . import load_plan
from .planner import DedupSavePlanner, PlanCache, item_bytes, plain_scalar
from .metadata import METADATA_FILE, check_loadable, read_metadata
from ..errors import CorruptCheckpointError, PartialLoadError

logger = logging.getLogger(__name__)

class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader with a metadata read that refuses anything but DCP's own classes,
    and items read by `reader.ItemReader` on `threads` threads, straight into their destinations.

    Every item is checked and every non-tensor value read before any tensor is written (with
    `fast=False` too, where PyTorch's engine then reads the tensors). `agree(checks)` runs
    those checks: on every rank together, so that no rank writes a tensor before every rank's
    checks passed, when the caller passes a collective. A failure after them (the storage
    failing, a file changed while it is read) is a `PartialLoadError`.

    `metadata`, when the caller has already read the folder's `.metadata`, is used instead of
    reading it again. `before_read`, when given, hears of the byte ranges this rank's plan reads
    ({data file: [(offset, length)]}) before any is read (a remote store fetches them).
    """

    def __init__(self, path: str, metadata: Metadata | None = None, threads: int = 1, fast: bool = True,
                 before_read: Callable[[dict[str, list[tuple[int, int]]]], None] | None = None,
                 agree: Callable[[Callable[[], None]], None] | None = None):
        super().__init__(path)
        self.fs = _ReadOnlyRegularFiles()
        self._metadata = metadata
        self.threads = threads
        self.fast = fast
        self.before_read = before_read
        self._agree = agree or (lambda checks: checks())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is None and self._metadata is not None:
            metadata = self._metadata
        else:
            metadata = read_metadata(str(self._get_metadata_path(rank)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """No item is stored through a transform (compression): `check_metadata` refused those."""
        if self.before_read is not None:
            ranges: dict[str, list[tuple[int, int]]] = {}
            for info in (self.storage_data[req.storage_index] for req in plan.items):
                ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
            self.before_read(ranges)
        items = reader.ItemReader(str(self.path), self.storage_data, self.threads)
        try:
            self._agree(lambda: items.check(plan.items, planner))
            try:
                if self.fast:
                    items.fill(planner)
                else:  # the values are read: PyTorch's engine reads the tensors
                    rest = [r for r in plan.items if r.type != LoadItemType.BYTE_IO]
                    self.fs.opened = {os.fspath(self.fs.concat_path(self.path, rel)): fd
                                      for rel, fd in items.opened.items()}
                    super().read_data(dataclasses.replace(plan, items=rest), planner).wait()
            except Exception as e:
                raise PartialLoadError(str(self.path), e) from e
        finally:
            self.fs.opened = {}
            items.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


class _ReadOnlyRegularFiles(FileSystem):
    """DCP's file system for the reads DCP's own reader still does (with `fast=False`): a file
    the check pass opened is read through a duplicate of its descriptor (`opened`), not opened
    by its name again, which may be gone since (a job saving into the folder removed the step:
    a load of another job's step fails before anything is written, or reads what it checked);
    any other file is opened as `safe_open` opens one (a FIFO or a device is refused, never
    waited on)."""

    def __init__(self) -> None:
        super().__init__()
        self.opened: dict[str, int] = {}
        """The check pass's descriptor of each data file, by its path, while it reads."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "r" not in mode or "+" in mode:
            raise CorruptCheckpointError(f"{path}: opened as {mode!r} by a checkpoint reader")
        if (fd := self.opened.get(os.fspath(path))) is not None:
            with os.fdopen(os.dup(fd), "rb") as f:
                yield f
            return
        with safe_open.open_path(str(path), "a data file named in .metadata") as f:
            yield f


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are unpickled without running code, and
    put under the caller's own keys, and the state is flattened in the order DCP's save planner
    flattens it (nested keys first, then sharded tensors). DCP's load planner does it the other
    way round, and its sharded-tensor pass drops empty containers from lists: a `LambdaLR` with a
    function for one group and a `functools.partial` for another (`lr_lambdas: [None, {}]`),
    saved as `lr_lambdas.0`, was asked for as `lr_lambdas` and its load failed."""

    def __init__(self) -> None:
        super().__init__(flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        super().set_up_planner(state_dict, *args, **kwargs)
        self.state_dict = _flatten_sharded_tensors(self.state_dict)
        self._spellings: dict[int, dict[str, Any]] = {}
        """Per dict of the caller's (by id, for this load), its keys that are not text, by their text."""
        self._values: dict[bytes, Any] = {}
        """The first `_CACHED_VALUES` values read that are `plain_scalar` (immutable: one object
        serves every entry), by their bytes (at most `_CACHED_VALUE_BYTES`): TorchTitan's layout
        keeps each optimizer setting once per parameter, the same bytes for every parameter of a
        group, each decoded at a cost (docs/performance.md, "Costs that grow with the job")."""

    def create_local_plan(self) -> LoadPlan:
        """DCP's local plan, each distinct chunk layout worked out once (`load_plan`) when the
        checkpoint holds every value of the state; else DCP's own planning, with its rules for
        missing keys and older checkpoints."""
        original = self.original_state_dict if self.flatten_state_dict else None
        if self.metadata is not None and load_plan.matches(self.state_dict, self.metadata, original):
            return load_plan.local_load_plan(self.state_dict, self.metadata)
        return super().create_local_plan()

    def _own_key(self, node: Any, key: Any) -> Any:
        """The key of the caller's dict `node` that DCP's flattening spelled `key`: it spells every
        key of a path as text, so a value under the number 0 would be put under "0" beside it."""
        if not isinstance(node, dict) or key in node or not isinstance(key, str):
            return key
        spelled = self._spellings.get(id(node))
        if spelled is None:
            spelled = self._spellings[id(node)] = {str(k): k for k in node if not isinstance(k, str)}
        return spelled.get(key, key)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        data = value.getvalue()
        small = len(data) <= _CACHED_VALUE_BYTES  # a larger value is never kept: not hashed to look for it
        if (obj := self._values.get(data, _UNREAD) if small else _UNREAD) is _UNREAD:
            obj = _read_value(read_item, data)
            if small and len(self._values) < _CACHED_VALUES and plain_scalar(obj):
                self._values[data] = obj
        # the flattened key (`make_load_planner`'s planner flattens) maps back to a path of keys
        # into the caller's nested dict
        *parents, last = self.mappings[read_item.dest_index.fqn]
        node = self.original_state_dict
        for key in parents:
            node = node[self._own_key(node, key)]
        node[self._own_key(node, last)] = obj


_UNREAD = object()
"""`SafeLoadPlanner._values`' answer for bytes not read before."""

_CACHED_VALUES = 4096
"""How many values `SafeLoadPlanner` keeps (a few per optimizer group are read again and again;
a state of many distinct values would otherwise keep every archive until the load ends)."""

_CACHED_VALUE_BYTES = 4096
"""The largest value `SafeLoadPlanner` keeps by its bytes (a setting's `torch.save` archive is
about 1.3 KB)."""


def _read_value(read_item: ReadItem, data: bytes) -> Any:
    """The value DCP saved as `data` (a `torch.save` archive), read without running code."""
    try:
        return torch_archive.load_plain(data)
    except UnsafePickleError as e:
        raise CorruptCheckpointError(f"checkpoint value '{read_item.dest_index.fqn}' has a pickle that "
                                     f"{e.problem}; refused") from None
    except pickle.UnpicklingError as e:
        raise CorruptCheckpointError(
            f"checkpoint value '{read_item.dest_index.fqn}' is not plain data and loading it "
            f"could run code; refused ({torch_archive.refusal(e)})"
        ) from None


SINGLE_PROCESS_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"
"""The start of the warning DCP's save and load give outside a process group, where one
process is this package's intent (a job of one rank, the command line)."""


def quiet_single_process() -> None:
    """Leave out DCP's warning that a save runs outside a process group, from now on in this
    process: a job of one rank saves so on purpose, and its background saves run on a thread
    where `warnings.catch_warnings` (process-wide before Python 3.14) would race the training
    thread's own filters. Adding the filter again replaces it."""
    warnings.filterwarnings("ignore", SINGLE_PROCESS_WARNING, UserWarning)


def load_on_this_rank(state: dict[str, Any], storage_reader: SafeFileSystemReader, planner: SafeLoadPlanner) -> None:
    """`dcp.load` of what this rank's `state` needs, without DCP's collectives.

    A default load plan has no cross-rank step: each rank reads the items its own tensors
    overlap. DCP would still send every rank's plan through rank 0 and back and gather every
    rank's result, a large share of a cold load's time (`docs/performance.md`). The caller makes
    a failure on one rank known to the others.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", SINGLE_PROCESS_WARNING, UserWarning)
        dcp.load(state, storage_reader=storage_reader, planner=planner, no_dist=True)


def root_cause(error: BaseException, rank: int | None = None) -> BaseException:
    """DCP wraps every rank's failure in one `CheckpointException` (a BaseException whose message
    is a traceback dump); return the lowest failing rank's own exception instead. Given this
    process's `rank`, another rank's failure comes as a `RankFailed` naming that rank (a
    background save failing on rank 1 read on rank 0 as if it were its own)."""
    if isinstance(error, CheckpointException) and error.failures:
        failed = min(error.failures)
        exc, _trace = error.failures[failed]
        if rank is not None and failed != rank:
            return RankFailed(failed, f"{type(exc).__name__}: {exc}", tuple(c.__name__ for c in type(exc).__mro__), None)
        return exc
    return error


class _ChecksummedStream:
    """A write-only file that computes the CRC-32 and the SHA-256 of what passes through it."""

    def __init__(self, f):
        self._f = f
        self.crc = 0
        self.size = 0
        self.sha256 = hashlib.sha256()

    def write(self, data) -> int:
        n = self._f.write(data)
        written = memoryview(data).cast("B")[:n]
        self.crc = crc32(written, self.crc)
        self.sha256.update(written)
        self.size += n
        return n

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        """The descriptor, with every byte written so far in it: DCP fsyncs `.metadata` through
        it, and the commit counts on that (`commit.write_marker` fsyncs no file a writer
        reported on the disk)."""
        self._f.flush()
        return self._f.fileno()

    def close(self) -> None:
        self._f.close()

    def writable(self) -> bool:
        return True


class _NewFiles(FileSystem):
    """DCP's file system, but each file written is created new (`durable.create_replacing`): a
    link or hard link that another user put at its name is never written through."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with os.fdopen(durable.create_replacing(os.fspath(path)), mode) as f:
            yield f


class ChecksummingFileSystem(_NewFiles):
    """DCP's local file system, recording the size and CRC-32 of every file written through it
    (DCP's `.metadata`) or handed to it (`add`, the data files, still on their way to the disk).
    `durable()` waits for the data files and returns every file's (size, crc32 hex) by its path
    relative to `root`."""

    def __init__(self, root: str):
        super().__init__()
        self.root = os.path.abspath(root)
        self._checksums: dict[str, tuple[int, str]] = {}
        self._written: dict[str, filewriter.WrittenFile | Callable[[], filewriter.WrittenFile]] = {}
        self._digests: dict[str, bytes] = {}
        """SHA-256 of the files written through `create_stream` (DCP's `.metadata`), until renamed."""
        self._lock = threading.Lock()

    def _rel(self, path) -> str:
        return os.path.relpath(os.path.abspath(path), self.root)

    def add(self, path: str | os.PathLike,
            written: filewriter.WrittenFile | Callable[[], filewriter.WrittenFile]) -> None:
        """A data file, written or (a function waiting for it) being written."""
        with self._lock:
            self._written[self._rel(path)] = written

    def durable(self) -> dict[str, tuple[int, str]]:
        """Wait until every data file is on the disk (raising its writing's or fsync's error);
        return the checksums of every file written."""
        for rel, written in list(self._written.items()):
            file = written() if callable(written) else written
            self._checksums[rel] = (file.size, file.durable())
        return dict(self._checksums)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as f:
            if "w" not in mode:
                yield f
                return
            stream = _ChecksummedStream(f)
            yield stream
        with self._lock:
            self._checksums[self._rel(path)] = (stream.size, hex_crc(stream.crc))
            self._digests[self._rel(path)] = stream.sha256.digest()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if (entry := self._checksums.pop(self._rel(path), None)) is not None:
                self._checksums[self._rel(new_path)] = entry
            digest = self._digests.pop(self._rel(path), None)
        if digest is not None and os.path.basename(new_path) == METADATA_FILE:
            own_writes.remember(digest)  # written whole by this process: a load of it need not scan it


def _staged() -> None:
    """A state that is not being staged: its bytes are final."""


class _LoadableWriter(FileSystemWriter):
    """DCP's file-system writer whose `.metadata` is checked to be one a load reads
    (`check_loadable`): DCP's `finish` runs on rank 0 alone, and its failure is every rank's.
    The `.metadata` records the id of the save the folder's in-progress marker names, where it
    has one (`commit.started_by`): another program's step written into the folder later is
    told from ours by it (`layout.status_of`)."""

    _mark: str | None = None

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self._mark = commit.started_by(str(self.path))
        super().finish(metadata, results)
        check_loadable(os.path.join(self.path, METADATA_FILE), metadata)

    def storage_meta(self) -> StorageMeta | None:
        """DCP's, with the in-progress marker's save id, and without the path written to: a step
        moves (renamed into place by `convert`, uploaded from a node's staging folder), and two
        saves of one state differ in nothing else."""
        meta = super().storage_meta()
        if meta is not None:
            meta.checkpoint_id = None
            if self._mark is not None:
                meta.save_id = self._mark
        return meta


class DataFileWriter(_LoadableWriter):
    """DCP's file-system writer (same layout and format: `plain dcp.load` reads the result)
    whose data files are written by `filewriter`, through `sink`: in this process, or in the
    rank's writer process. Planning, `.metadata` and every collective stay with DCP.

    `files_per_rank` files are written in parallel, tensors spread over them by size.

    `write_early` starts on tensors this rank will write before DCP has planned the save: those
    the last save's plan gave it, when the state's layout is unchanged (the plan is the same
    unless another rank's state changed), else those no other rank holds (no plan can give them
    to another rank). Their bytes reach the disk while DCP plans, and `write_data` writes only
    the rest, in up to `files_per_rank` more files."""

    def __init__(self, path: str, sink: filewriter.Sink, step: int | None, files_per_rank: int = 1,
                 sync: bool = True, staged: Callable[[], None] = _staged, direct: bool = False):
        super().__init__(path, sync_files=sync, single_file_per_rank=True, thread_count=files_per_rank)
        self.fs = ChecksummingFileSystem(path)
        self._staged = staged
        self._sink = sink
        self._step = step
        self._direct = direct
        self._early: filewriter.StartedFiles | None = None
        self._early_error: Exception | None = None
        self._early_names: list[str] = []
        self.early_bytes = 0
        """Tensor bytes `write_early` started on."""

    def write_early(self, state: dict[str, Any], rank: int, world_size: int, cache: PlanCache | None = None,
                    ready: Callable[[torch.Tensor], None] | None = None,
                    wait_across: Callable[[torch.Tensor], filewriter.CountWait] | None = None) -> None:
        """Start writing the tensor writes of the last save's plan in `cache`
        (`PlanCache.tensor_writes`), or without one the tensors of `state` no other rank holds:
        with one rank, every tensor; else those of DTensors sharded on every dimension of a mesh
        of all the ranks. Entries are keyed by (DCP key, chunk offsets, chunk sizes), so
        `write_data` finds them in the plan. With the sink of this process they are written on
        helper threads, each tensor once `ready(tensor)` returns (`Staged.ready`); with a writer
        process (a sink with `start`), there, each once `wait_across(tensor)` is satisfied
        (`Staged.wait_across`; without one, nothing is written early)."""
        if self._sink is filewriter.write_files:
            start, wait = filewriter.start_files, ready and (lambda t: functools.partial(ready, t))
        else:
            start, wait = getattr(self._sink, "start", None), wait_across
            if start is None or wait is None:
                return
        try:
            pieces = _early_pieces(state, world_size, cache.tensor_writes(state) if cache is not None else None)
            if not pieces:
                return
            jobs = []
            for i, bucket in enumerate(balanced_groups(pieces, self.thread_count, lambda kt: kt[1].nbytes)):
                self._early_names.append(_data_file(f"__{rank}_", i))  # the prefix the global plan gives
                jobs.append(filewriter.FileJob(os.path.join(self.path, self._early_names[-1]),
                                               [filewriter.Entry(key, t, wait and wait(t)) for key, t in bucket],
                                               self._direct))
            self._early = start(jobs, self._step, self.sync_files)
            self.early_bytes = sum(t.nbytes for _, t in pieces)
        except Exception as e:  # raised in write_data, inside DCP's protocol, so every rank hears of it
            self._early_error = e

    def durable(self) -> dict[str, tuple[int, str]]:
        """Wait until this rank's files are on the disk; their (size, CRC-32) by relative path."""
        return self.fs.durable()

    def wait_early(self) -> None:
        """Wait until the early writes have stopped (after a failed save: nothing may still be
        writing into the step folder when the error reaches the caller)."""
        if self._early is not None:
            concurrent.futures.wait([self._early.done])

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with gc_pause.lifted():  # waiting for the staging copy, as for the bytes below
            self._staged()  # raised here, in DCP's protocol, a staging failure reaches every rank
        results, rest = self._written_early(plan.items)
        buckets = balanced_groups(rest, self.thread_count, item_bytes) if rest or self._early is None else []
        jobs, names = [], []
        for i, bucket in enumerate(buckets):
            names.append(_data_file(plan.storage_data.prefix, len(self._early_names) + i))
            entries = [filewriter.Entry(item.index, _resolve(planner, item)) for item in bucket]
            jobs.append(filewriter.FileJob(os.path.join(self.path, names[-1]), entries, self._direct))
        with gc_pause.lifted():  # the bytes: few objects, and in a background save most of its time
            files = self._sink(jobs, self._step, self.sync_files)
        for name, written in zip(names, files, strict=True):
            self.fs.add(os.path.join(self.path, name), written)
            results += [WriteResult(index=key, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))
                        for key, offset, length in written.places]
        future: Future = Future()
        future.set_result(results)
        return future

    def _written_early(self, items: list[WriteItem]) -> tuple[list[WriteResult], list[WriteItem]]:
        """The results of the plan's items written early, and the items still to write. Where
        the early items land is known before they are written (unless one needed a copy), so
        this does not wait for those writes: DCP's `.metadata` and the rest of the save go on
        while the disk takes them, and the commit waits for them (`fs.durable()`)."""
        if self._early_error is not None:
            raise self._early_error
        if self._early is None:
            return [], list(items)
        started = self._early
        if any(places is None for places in started.places):
            places = [written.places for written in started.done.result()]
        else:
            places = started.places
        early: dict[tuple, _StorageInfo] = {}
        for i, (name, file_places) in enumerate(zip(self._early_names, places, strict=True)):
            self.fs.add(os.path.join(self.path, name), functools.partial(_written_as_planned, started.done, i, file_places))
            early.update((key, _StorageInfo(name, offset, length)) for key, offset, length in file_places)
        results, rest = [], []
        for item in items:
            found = None
            if item.tensor_data is not None:
                chunk = item.tensor_data.chunk
                found = early.pop((item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes)), None)
            if found is None:
                rest.append(item)
            else:
                results.append(WriteResult(index=item.index, size_in_bytes=found.length, storage_data=found))
        if early:
            logger.warning("%d tensors written early are not in the save plan (their bytes are unused): %s",
                           len(early), sorted(early)[:3])
        return results, rest


def _written_as_planned(done: concurrent.futures.Future, index: int,
                        places: list[tuple[object, int, int]]) -> filewriter.WrittenFile:
    """File `index` of early writes, once written, checked to hold its entries where DCP was told."""
    written = done.result()[index]
    if written.places != places:
        raise RuntimeError("a data file written early does not hold its entries where the save plan says")
    return written


def _early_pieces(state: dict[str, Any], world_size: int,
                  planned: list[WriteItem] | None) -> list[tuple[tuple, torch.Tensor]]:
    """((DCP key, chunk offsets, chunk sizes), local tensor) of each piece `write_early` writes."""
    flat = flatten_state_dict(state)[0]
    if planned is None:
        return [((key, *_local_chunk(value)), local_values(value)) for key, value in flat.items()
                if isinstance(value, torch.Tensor) and local_values(value).numel() and _only_here(value, world_size)]
    pieces = []
    for item in planned:
        chunk, value = item.tensor_data.chunk, flat[item.index.fqn]
        offsets, sizes = _local_chunk(value)
        local = local_values(value)
        if tuple(chunk.sizes) != sizes:  # a slice of the rows this rank holds (`policy.dedup`)
            local = local.narrow(0, chunk.offsets[0] - offsets[0], chunk.sizes[0])
        pieces.append(((item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes)), local))
    return pieces


def _local_chunk(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of this rank's part of `t` in the whole tensor, as DCP plans it."""
    if not isinstance(t, DTensor):
        return (0,) * t.dim(), tuple(t.shape)
    return dtensor_chunk(tuple(t.shape), t.device_mesh, tuple(t.placements))


@functools.lru_cache(maxsize=256)
def dtensor_chunk(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of this rank's part of a DTensor of `shape` laid out as `placements` on
    `mesh`. Cached: it is costly next to a small tensor's write, and a model's layers repeat a
    few shapes."""
    sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(offsets), tuple(sizes)


def _only_here(t: torch.Tensor, world_size: int) -> bool:
    """Whether no other rank holds these values, so any save plan has this rank write them: a
    DTensor sharded on every dimension of a mesh of all the ranks (on a smaller mesh, FSDP's
    beside tensor parallelism, the ranks outside it may hold the same shard). The caller also
    leaves out an empty shard: empty shards of one tensor on several ranks are one chunk to DCP."""
    if world_size == 1:
        return True
    return (isinstance(t, DTensor) and t.device_mesh.size() == world_size
            and all(isinstance(p, Shard) for p in t.placements))


def _resolve(planner: SavePlanner, item: WriteItem) -> bytes | torch.Tensor:
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        return bytes(data.getbuffer())
    return data.detach()


class TorchFileWriter(_LoadableWriter):
    """PyTorch's own writer, for `io_engine = "torch"`: the same calls as `DataFileWriter`, but
    nothing is written early and no checksum is computed while writing (`durable` reads each
    file this rank wrote once for its CRC-32)."""

    def __init__(self, path: str, staged: Callable[[], None] = _staged, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs = _NewFiles()
        self._staged = staged
        self._written: Future[list[WriteResult]] | None = None

    def write_early(self, state: dict[str, Any], rank: int, world_size: int, cache: PlanCache | None = None,
                    ready: Callable[[torch.Tensor], None] | None = None,
                    wait_across: Callable[[torch.Tensor], filewriter.CountWait] | None = None) -> None:
        """Nothing is written before DCP plans."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._staged()
        self._written = super().write_data(plan, planner)
        return self._written

    def wait_early(self) -> None:
        """Nothing was written early."""

    def durable(self) -> dict[str, tuple[int, str]]:
        """`dcp.save` returned after fsyncing every file (`sync_files`); each file this rank wrote
        is read here once for its CRC-32. Reported to the commit, a file rank 0 does not see (a
        rank writing to a disk of its own) fails the commit."""
        names = {result.storage_data.relative_path for result in (self._written.wait() if self._written else [])}
        return {rel: (os.path.getsize(full), file_crc32(full)) for rel in sorted(names)
                for full in [os.path.join(self.path, rel)]}


def make_storage_writer(path: str, sink: filewriter.Sink = filewriter.write_files, step: int | None = None,
                        files_per_rank: int = 1, fast: bool = True, sync: bool = True,
                        direct: bool = False, staged: Callable[[], None] = _staged) -> DataFileWriter | TorchFileWriter:
    """Writer of a DCP step folder, by the fast engine or (`fast=False`) PyTorch's. `dcp.save`
    returns once the data files are written (their fsync, with `sync`, may still run);
    `writer.durable()` waits for it and returns each file's size and CRC-32, recorded as it was
    written. `step` arms the `write` fail point; `write_data` first waits for `staged()` (the
    state's staging, `Staged.done`); `direct` writes the files around the page cache
    (`checkpoint.direct_io`; the fast engine only)."""
    if not fast:
        return TorchFileWriter(path, staged, sync_files=sync, single_file_per_rank=True, thread_count=files_per_rank)
    return DataFileWriter(path, sink, step, files_per_rank, sync, staged, direct)


def make_storage_reader(path: str, metadata: Metadata | None = None, threads: int = 1, fast: bool = True,
                        before_read: Callable[[dict[str, list[tuple[int, int]]]], None] | None = None,
                        agree: Callable[[Callable[[], None]], None] | None = None) -> SafeFileSystemReader:
    """Reader of a DCP folder on `threads` I/O threads (PyTorch's reads with `fast=False`);
    pass `metadata` if it is already read, `before_read` and `agree` as
    `SafeFileSystemReader` takes them."""
    return SafeFileSystemReader(path, metadata, threads, fast, before_read, agree)


def _data_file(prefix: str, number: int) -> str:
    """A data file's name: the rank's prefix in the global plan (`FileSystemWriter`'s
    `__{rank}_`) and a number."""
    return f"{prefix}{number}.distcp"


def make_save_planner(policy: str = Checkpoint.dedup_policy, min_slice_bytes: int = Checkpoint.dedup_min_slice_bytes,
                      cache: PlanCache | None = None) -> DedupSavePlanner:
    """DCP's save planner with replicated values written as `checkpoint.dedup_policy` says,
    reusing what `cache` holds of the last save's plan when nothing changed."""
    return DedupSavePlanner(policy, min_slice_bytes, cache)


def make_load_planner() -> SafeLoadPlanner:
    return SafeLoadPlanner()
