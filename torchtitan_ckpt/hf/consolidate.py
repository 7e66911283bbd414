"""Final HF safetensors files, written by every rank: consolidation of DCP's per-rank shards, and
a one-pass export that needs no shards at all.

Two entry points, both called collectively by every rank of a process group (or by one process
without `torch.distributed`):

- `consolidate_safetensors` turns the shard files that DCP's `HuggingFaceStorageWriter` writes with
  `save_distributed=True` (one `shard-R-model-X-of-N.safetensors` per rank and output file, whose
  header metadata `DCP_SHARDING_INFO` holds each block's offsets in the full tensor) into
  `model-0000X-of-0000N.safetensors` and `model.safetensors.index.json`.
- `write_safetensors_one_pass` writes the same final files straight from a (DTensor) state dict.

How the work is shared: the layout of the output (each tensor's file and byte offset) depends only
on names, dtypes and global shapes, so every rank computes the same layout. The bytes to copy are
then cut into `world_size` equal runs of the output stream (`policy.split.byte_ranges`), splitting a tensor
block wherever a cut falls, so W ranks help even with fewer than W files or one huge file. Rank 0
creates and pre-sizes the files and writes their headers; every rank then `os.pwrite`s its bytes
at their final offsets. A block sharded on a dimension other than the first lands in the output as
rows of contiguous runs, written one run at a time.

Memory bound: consolidation copies through one fixed buffer per thread, so a rank holds at most
`num_threads * CHUNK_BYTES` (4 x 16 MiB by default) of tensor data, plus the parsed headers (a few
hundred bytes per tensor block); it never holds a whole file or tensor, whatever the model size.
The one-pass export writes from the tensors already in memory; its only extra memory is a CPU
copy of each GPU or non-contiguous block the rank writes, all made when its writing step starts.

Durability and completeness: every rank fsyncs what it wrote; the index is written last, by rank 0,
atomically (temporary file, fsync, rename), and only after every rank reported success. Every step
ends with an all-gather of errors, so a failure on one rank fails every rank instead of hanging
them; an export that did not finish has no `model.safetensors.index.json`.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import struct
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..io import IO_THREADS, durable, posio, safe_open
from ..io.filewriter import Writeback
from ..io.untrusted import MAX_DIMS, brief
from .. import faults
from ..dcp.storage import dtensor_chunk
from ..errors import ConsolidationError, CorruptCheckpointError, InvalidShardsError, RankFailed, counted
from ..group import CheckpointGroup
from ..policy.split import byte_ranges
from ..progress import fmt_bytes, gb_per_s
from .adapter import LOCAL_PLACEMENTS, PermutedRows, RowOf
from .files import DCP_SHARD_NAME, DTYPE_NAMES, DTYPE_SIZES, INDEX_FILE, MAX_HEADER_BYTES, MAX_INDEX_BYTES
from .files import file_number, is_dcp_shard_file, is_model_file, model_file_name
from .safetensors_io import parse_header

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]
"""`progress(nbytes, total)`: `nbytes` more bytes written, of `total` this rank writes."""
PrepareFn = Callable[[], list[str]]
"""Run by rank 0 before the output files are created (to clear the folder, write `config.json`):
returns the paths of the files it wrote, which rank 0 fsyncs before the index is written."""

CHUNK_BYTES = 16 << 20
OPEN_PER_THREAD = 16
"""Files a copying thread holds open at once (outputs and shard files): its tasks run file after
file, so few are reopened, and thousands of files fit any limit of open descriptors."""
HEADER_ALIGN = 8
_SHARDING_KEY = "DCP_SHARDING_INFO"


# ---------------------------------------------------------------------------------------------
# Plain data: blocks, tensors, output files, copy tasks.


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a tensor of `shape` and safetensors `dtype`."""
    return math.prod(shape) * DTYPE_SIZES[dtype]


@dataclass(frozen=True)
class Block:
    """One block of one tensor: where it sits in the full tensor and where its bytes are (a shard
    file at `src_start`, or memory when `src` is empty)."""

    fqn: str
    dtype: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    src: str = ""
    src_start: int = 0

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)


@dataclass(frozen=True)
class TensorSpec:
    """A full tensor: what the output header says about it."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)


@dataclass(frozen=True)
class OutputFile:
    """One final file: its name, header bytes, total size, and each tensor's absolute data offset."""

    name: str
    header: bytes
    size: int
    starts: dict[str, int]


@dataclass(frozen=True)
class Task:
    """Copy bytes [start, stop) of a block (counted within the block) to the output."""

    block: Block
    start: int
    stop: int


@dataclass(frozen=True)
class Runs:
    """Where a block's bytes go in its output file: `run_bytes`-long contiguous runs, run r at
    `dst(r)`. A block that spans all but its first sharded dimension is a single run."""

    run_bytes: int
    base: int
    outer_shape: tuple[int, ...]
    outer_strides: tuple[int, ...]

    def dst(self, run: int) -> int:
        off = self.base
        for size, stride in zip(reversed(self.outer_shape), reversed(self.outer_strides)):
            run, i = divmod(run, size)
            off += i * stride
        return off


# ---------------------------------------------------------------------------------------------
# Pure planning: layout, geometry, balanced assignment, coverage.


def plan_output_files(specs: Mapping[str, TensorSpec],
                      fqn_to_index_mapping: Mapping[str, int] | None = None) -> list[OutputFile]:
    """The final files: tensors grouped by the mapping's file index (one file without a mapping),
    ordered by element size then name so that each tensor's data is aligned to its element size,
    and a header padded with spaces so that tensor data starts at a multiple of 8 bytes. The
    indices the tensors use are numbered 1..N in their order: a number no tensor uses (a gap in
    a user's mapping, the file of an assets' tensor the export leaves out) makes no file, which
    the index would not list and an import would refuse."""
    mapping = fqn_to_index_mapping or dict.fromkeys(specs, 1)
    missing = sorted(set(specs) - set(mapping))
    if missing:
        raise ValueError(f"the file split given (fqn_to_index_mapping; consolidate's --mapping) has no file index "
                         f"for {len(missing)} tensor(s) the shards hold, e.g. {missing[:5]}: give every tensor one")
    used = sorted({mapping[fqn] for fqn in specs}) or [1]
    groups: dict[int, list[TensorSpec]] = {i: [] for i in used}
    for fqn, spec in specs.items():
        groups[mapping[fqn]].append(spec)
    return [_layout_file(model_file_name(n, len(used)), groups[i]) for n, i in enumerate(used, start=1)]


def _layout_file(name: str, specs: list[TensorSpec]) -> OutputFile:
    specs = sorted(specs, key=lambda s: (-DTYPE_SIZES[s.dtype], s.fqn))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for s in specs:
        header[s.fqn] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        pos += s.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % HEADER_ALIGN)
    data_start = 8 + len(text)
    starts = {s.fqn: data_start + header[s.fqn]["data_offsets"][0] for s in specs}
    return OutputFile(name, struct.pack("<Q", len(text)) + text, data_start + pos, starts)


def block_runs(block: Block, full_shape: Sequence[int], data_start: int) -> Runs:
    """How `block` of a tensor of `full_shape`, whose data starts at `data_start` in its file,
    maps onto the file: the innermost dims it spans fully merge with the last dim it does not
    into one contiguous run; the dims outside repeat that run."""
    item = DTYPE_SIZES[block.dtype]
    ndim = len(full_shape)
    strides = [item] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * full_shape[d + 1]
    k = max((d for d in range(ndim) if block.shape[d] != full_shape[d]), default=0)
    base = data_start + sum(o * s for o, s in zip(block.offsets, strides))
    return Runs(item * math.prod(block.shape[k:]), base, tuple(block.shape[:k]), tuple(strides[:k]))


def plan_tasks(blocks: Sequence[Block], files: Sequence[OutputFile], specs: Mapping[str, TensorSpec],
               workers: int) -> list[list[Task]]:
    """Each worker's copy tasks, equal in bytes, in output order so a worker writes one mostly
    contiguous stretch of the output."""
    where = {fqn: (i, start) for i, f in enumerate(files) for fqn, start in f.starts.items()}

    def position(b: Block) -> tuple[int, int]:
        file_idx, start = where[b.fqn]
        return file_idx, block_runs(b, specs[b.fqn].shape, start).dst(0)

    ordered = sorted((b for b in blocks if b.nbytes), key=position)
    return [[Task(ordered[i], a, z) for i, a, z in ranges]
            for ranges in byte_ranges([b.nbytes for b in ordered], workers)]


def full_tensors(blocks: Sequence[Block], shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, TensorSpec]:
    """The full tensors the blocks make up; raises `InvalidShardsError` naming the tensor and the
    files when blocks disagree on dtype or rank, overlap, or leave part of a tensor uncovered.
    Each tensor's shape is `shapes[name]` where given (then every name of it must have blocks),
    else the extent of its blocks: the files record no whole shape, so a lost file of the blocks
    at a tensor's end goes unseen without `shapes`."""
    by_fqn: dict[str, list[Block]] = {}
    for b in blocks:
        by_fqn.setdefault(b.fqn, []).append(b)
    if shapes is not None and (unknown := by_fqn.keys() ^ shapes.keys()):
        raise InvalidShardsError(f"the shard files hold tensors {sorted(by_fqn.keys() - shapes.keys())[:5]} the "
                                 f"export has not and lack {sorted(shapes.keys() - by_fqn.keys())[:5]} of it "
                                 f"({len(unknown)} in all); a rank's shard file is missing or another's is in the "
                                 "folder")
    specs = {}
    for fqn, group in sorted(by_fqn.items()):
        files = sorted({b.src for b in group})
        if len({b.dtype for b in group}) > 1 or len({len(b.shape) for b in group}) > 1:
            raise InvalidShardsError(f"tensor {brief(fqn)}: its blocks in {files} disagree on dtype or rank")
        extent = tuple(max(b.offsets[d] + b.shape[d] for b in group) for d in range(len(group[0].shape)))
        shape = extent if shapes is None else tuple(shapes[fqn])
        if len(shape) != len(extent) or any(e > n for e, n in zip(extent, shape)):
            raise InvalidShardsError(f"tensor {brief(fqn)}: its blocks in {files} reach {list(extent)}, outside "
                                     f"its shape {list(shape)}")
        _check_coverage(fqn, group, shape, files)
        specs[fqn] = TensorSpec(fqn, group[0].dtype, shape)
    return specs


def _check_coverage(fqn: str, group: list[Block], shape: tuple[int, ...], files: list[str]) -> None:
    """Raise `InvalidShardsError` when two blocks holding elements overlap, or when the blocks
    (inside `shape`) hold fewer elements than it: then some block is missing."""
    pair = _overlapping(group)
    if pair is not None:
        a, b = pair
        raise InvalidShardsError(
            f"tensor {brief(fqn)}: blocks at offsets {list(a.offsets)} ({a.src}) and "
            f"{list(b.offsets)} ({b.src}) overlap")
    covered = sum(math.prod(b.shape) for b in group)
    if covered != math.prod(shape):
        raise InvalidShardsError(
            f"tensor {brief(fqn)} of shape {list(shape)}: the shards in {files} cover {covered} of "
            f"{math.prod(shape)} elements; a rank's shard file is missing")


def _overlapping(blocks: Sequence[Block]) -> tuple[Block, Block] | None:
    """Two of `blocks` (of one tensor) that share an element, or None. A sweep along the
    dimension the blocks are cut at most places: sorted by their start along it, each block is
    compared with those it starts inside of only. Blocks cut along one dimension (FSDP's rows,
    the 1,024 ranks of a large job) then cost n log n, a grid of them n times its side; comparing
    every pair took half a second per tensor at 1,024 blocks."""
    held = [b for b in blocks if b.nbytes]
    if len(held) < 2:
        return None
    if not held[0].shape:  # scalars: any two are the same element
        return held[0], held[1]
    axis = max(range(len(held[0].shape)), key=lambda d: len({b.offsets[d] for b in held}))
    held.sort(key=lambda b: b.offsets[axis])
    open_: list[Block] = []  # the blocks seen so far that reach past the current start along `axis`
    for b in held:
        open_ = [a for a in open_ if a.offsets[axis] + a.shape[axis] > b.offsets[axis]]
        for a in open_:
            if all(max(oa, ob) < min(oa + sa, ob + sb)
                   for oa, sa, ob, sb in zip(a.offsets, a.shape, b.offsets, b.shape)):
                return a, b
        open_.append(b)
    return None


# ---------------------------------------------------------------------------------------------
# Reading shard headers.


def read_shard_blocks(path: str) -> list[Block]:
    """The tensor blocks one DCP HF shard file holds, read from its header alone and checked
    against the file's size. Raises `InvalidShardsError` naming the file."""
    with safe_open.open_path(path, "a shard file") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) < 8:
            raise InvalidShardsError(f"{path}: {size} bytes, too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise InvalidShardsError(f"{path}: header of {header_len} bytes in a file of {size} bytes")
        try:
            header = parse_header(f.read(header_len))
            sharding = json.loads(header.pop("__metadata__", {})[_SHARDING_KEY])
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise InvalidShardsError(f"{path}: not a DCP HF shard file (header or {_SHARDING_KEY} "
                                     f"unreadable: {e}); save with save_distributed=True") from e
    data_start = 8 + header_len
    return [_block(path, fqn, entry, sharding, data_start, size) for fqn, entry in header.items()]


def _counts(value: Any) -> bool:
    """A list of non-negative ints, none beyond 2**62 (no real shape, offset or size is)."""
    return isinstance(value, list) and len(value) <= MAX_DIMS and all(type(v) is int and 0 <= v <= 2**62
                                                                     for v in value)


def _block(path: str, fqn: str, entry: Any, sharding: Any, data_start: int, size: int) -> Block:
    info = sharding.get(fqn, {}) if isinstance(sharding, dict) else None
    if not isinstance(entry, dict) or not isinstance(info, dict):
        raise InvalidShardsError(f"{path}: tensor {brief(fqn)} has header entry {brief(entry)} and sharding info "
                                 f"{brief(info)}; expected objects (save with save_distributed=True)")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), info.get("saved_offsets", [])
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise InvalidShardsError(f"{path}: tensor {brief(fqn)} has dtype {brief(dtype)}; known: {sorted(DTYPE_SIZES)}")
    data_offsets = entry.get("data_offsets")
    if not (_counts(shape) and _counts(offsets) and _counts(data_offsets) and len(data_offsets) == 2
            and len(offsets) == len(shape)):
        raise InvalidShardsError(f"{path}: tensor {brief(fqn)} has shape {brief(shape)}, saved_offsets "
                                 f"{brief(offsets)} and data_offsets {brief(data_offsets)}; expected lists of "
                                 "non-negative ints, one offset per dimension")
    begin, end = data_offsets
    block = Block(fqn, dtype, tuple(offsets), tuple(shape), path, data_start + begin)
    if end - begin != block.nbytes or data_start + end > size:
        raise InvalidShardsError(f"{path}: tensor {brief(fqn)} claims bytes [{begin}, {end}) after the header: "
                                 f"{block.nbytes} expected, file has {size - data_start}")
    return block


def find_shard_files(input_dir: str) -> list[str]:
    """The shard files of `input_dir`, sorted: those named as DCP's `HuggingFaceStorageWriter`
    names them (`is_dcp_shard_file`, the files a two-phase export's clearing removes). Any
    other file is ignored, another `.safetensors` one (a stray copy, a file of an earlier tool)
    with a log line: consolidated, its tensors would join the export."""
    if not os.path.isdir(input_dir):
        raise InvalidShardsError(f"{input_dir}: no such folder of shard files")
    listed = sorted(os.listdir(input_dir))
    names = [n for n in listed if is_dcp_shard_file(n)]
    ignored = [n for n in listed if n.endswith(".safetensors") and n not in names]
    if not names:
        raise InvalidShardsError(f"{input_dir}: no shard files ({DCP_SHARD_NAME})"
                                 + (f"; {ignored} are not named so" if ignored else ""))
    if ignored:
        logger.info("%s: ignoring %s, not named as DCP's shard files are (%s)", input_dir, ignored, DCP_SHARD_NAME)
    return [os.path.join(input_dir, n) for n in names]


# ---------------------------------------------------------------------------------------------
# Positioned I/O.


def _pread_all(fd: int, buf: memoryview, offset: int, path: str) -> None:
    got = posio.read_into(fd, [buf], offset)
    if got < len(buf):
        raise InvalidShardsError(f"{path}: ends at byte {offset + got}, before its data does")


def _scatter(fd: int, runs: Runs, data: memoryview, pos: int) -> None:
    """Write `data`, a block's bytes from byte `pos` on, to their places in the output file."""
    i = 0
    while i < len(data):
        run, within = divmod(pos + i, runs.run_bytes)
        n = min(runs.run_bytes - within, len(data) - i)
        posio.write_all(fd, data[i:i + n], runs.dst(run) + within)
        i += n


def _span(runs: Runs, pos: int, n: int) -> tuple[int, int]:
    """(offset, length) of the stretch of the output file that bytes [pos, pos + n) of a block
    land in (other blocks' bytes lie between its runs)."""
    first, last = pos, pos + n - 1
    lo = runs.dst(first // runs.run_bytes) + first % runs.run_bytes
    return lo, runs.dst(last // runs.run_bytes) + last % runs.run_bytes + 1 - lo


def _close(fd: int, out: Writeback | None) -> None:
    if out is not None:
        out.close()  # its queued starts act on `fd`
    os.close(fd)


class _Writer:
    """Runs one rank's tasks on `num_threads` threads, each with its own file handles (and, for
    file sources, its own CHUNK_BYTES buffer). `memory` holds each in-memory block's bytes by
    (fqn, offsets); `writeback` hands written bytes to the disk as they come (off for copies
    that are uploaded, never kept)."""

    def __init__(self, output_dir: str, files: Sequence[OutputFile], specs: Mapping[str, TensorSpec],
                 memory: Mapping[tuple, memoryview] | None = None, progress: ProgressFn | None = None,
                 writeback: bool = True):
        self.writeback = writeback
        self.output_dir = output_dir
        self.progress = progress
        self.total = 0
        self.where = {fqn: (f.name, start) for f in files for fqn, start in f.starts.items()}
        self.specs = specs
        self.memory = memory or {}
        self._stop = threading.Event()
        """Set when the calling thread leaves `run` early (an interrupt): the copies end at their
        next chunk. Left running, an interrupted command's copies went on writing into files that
        a new run of it had made in their place."""

    def run(self, tasks: Sequence[Task], num_threads: int) -> None:
        self.total = sum(t.stop - t.start for t in tasks)
        shares = byte_ranges([t.stop - t.start for t in tasks], max(1, num_threads))
        shares = [[Task(tasks[i].block, tasks[i].start + a, tasks[i].start + z) for i, a, z in s] for s in shares if s]
        errors: list[BaseException] = []
        ended = [threading.Event() for _ in shares]  # not join: after an interrupted one, 3.11's returns at once
        threads = [threading.Thread(target=self._guarded, args=(s, errors, end)) for s, end in zip(shares, ended)]
        try:
            for t in threads:
                t.start()
            for end in ended:
                end.wait()
        finally:
            self._stop.set()  # a thread not running yet copies nothing
            for t, end in zip(threads, ended):
                if t.is_alive():
                    end.wait()
        if errors:
            raise errors[0]

    def _guarded(self, tasks: list[Task], errors: list[BaseException], ended: threading.Event) -> None:
        try:
            self._copy(tasks)
        except BaseException as e:  # handed to the calling thread, which raises it
            errors.append(e)
            self._stop.set()  # the other threads' copies are of no use now
        finally:
            ended.set()

    def _copy(self, tasks: list[Task]) -> None:
        held: collections.OrderedDict[str, tuple[int, Writeback | None]] = collections.OrderedDict()

        def opened(path: str, output: bool) -> tuple[int, Writeback | None]:
            """`path` open (for writing if `output`), the least recently used file closed when
            `OPEN_PER_THREAD` are: an export of thousands of files ran out of descriptors."""
            if path in held:
                held.move_to_end(path)
                return held[path]
            while len(held) >= OPEN_PER_THREAD:
                _close(*held.popitem(last=False)[1])
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW if output else os.O_RDONLY)
            held[path] = (fd, Writeback(fd, enabled=self.writeback) if output else None)
            return held[path]

        buf = memoryview(bytearray(CHUNK_BYTES)) if not self.memory else None
        try:
            for task in tasks:
                if self._stop.is_set():
                    return
                b = task.block
                name, start = self.where[b.fqn]
                runs = block_runs(b, self.specs[b.fqn].shape, start)
                src = opened(b.src, False)[0] if b.src else -1
                dst, out = opened(os.path.join(self.output_dir, name), True)
                self._copy_task(task, runs, src, dst, out, buf)
        finally:
            for fd, out in held.values():
                _close(fd, out)

    def _copy_task(self, task: Task, runs: Runs, src: int, dst: int, out: Writeback, buf: memoryview | None) -> None:
        """Copy the task's bytes CHUNK_BYTES at a time (from its shard file through `buf`, or
        from memory), starting the disk on each chunk as soon as it is written, so the fsync
        that follows waits for the last chunks only."""
        pos = task.start
        while pos < task.stop and not self._stop.is_set():
            n = min(CHUNK_BYTES, task.stop - pos)
            if task.block.src:
                view = buf[:n]
                _pread_all(src, view, task.block.src_start + pos, task.block.src)
            else:
                view = self.memory[(task.block.fqn, task.block.offsets)][pos:pos + n]
            _scatter(dst, runs, view, pos)
            out.start(*_span(runs, pos, n))
            pos += n
            self._report(n)

    def _report(self, nbytes: int) -> None:
        if self.progress is not None:
            self.progress(nbytes, self.total)


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a block's values in CPU memory: a copy only of a GPU or non-contiguous tensor,
    or of a lazily conjugated or negated view (whose memory holds other values than it shows)."""
    return posio.tensor_bytes(t.detach().cpu().resolve_conj().resolve_neg().contiguous())


def clear_model_files(folder: str) -> None:
    """Remove an earlier export's index, first (the folder stops being complete), then its model
    files (`is_model_file`): one left beside a new export of other files would make the folder
    one that `load_hf` refuses. Files of other names (another format's, the user's) stay."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.lexists(index):
        os.remove(index)
        durable.fsync_path(folder)  # gone for good before any file of the new export is made
    for name in filter(is_model_file, os.listdir(folder)):
        os.remove(os.path.join(folder, name))


def _create_files(output_dir: str, files: Sequence[OutputFile], sync: Collection[str], header: bool = True) -> None:
    """Create every output file at its final size, with its header, in place of an earlier
    export's (`clear_model_files`); run by one rank, which fsyncs those named in `sync` now and
    the others with the tensor bytes it writes into them.
    Without `header`: a rank's own copy of files another rank heads (a folder not shared)."""
    durable.make_dir(output_dir, exist_ok=True)
    clear_model_files(output_dir)
    for f in files:
        fd = durable.create_replacing(os.path.join(output_dir, f.name))
        try:
            posio.grow(fd, f.size)
            if header:
                posio.write_all(fd, memoryview(f.header), 0)
            if f.name in sync:
                os.fsync(fd)
        finally:
            os.close(fd)


def _write_index(output_dir: str, files: Sequence[OutputFile], specs: Mapping[str, TensorSpec]) -> None:
    """Write the index atomically (the folder, which names the files it lists, is durable)."""
    weight_map = dict(sorted((fqn, f.name) for f in files for fqn in f.starts))
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs.values())}, "weight_map": weight_map}
    durable.write_json(os.path.join(output_dir, INDEX_FILE), index, indent=2)


# ---------------------------------------------------------------------------------------------
# Collective steps.


def _step(group: CheckpointGroup, what: str, fn: Callable[[], Any]) -> list[Any]:
    """Run `fn` on every rank and gather the results; every rank learns of a failure anywhere
    (and raises: its own failure, else `InvalidShardsError` or `ConsolidationError`)."""
    try:
        return group.run(fn)
    except RankFailed as failed:
        if failed.error is not None:
            raise failed.error from None
        cls = InvalidShardsError if CorruptCheckpointError.__name__ in failed.kinds else ConsolidationError
        raise cls(f"{what} failed on {failed}") from None


def _write_everything(group: CheckpointGroup, output_dir: str, files: list[OutputFile],
                      specs: Mapping[str, TensorSpec], tasks: Sequence[Task], num_threads: int,
                      values: Mapping[tuple, torch.Tensor] | None = None, progress: ProgressFn | None = None,
                      prepare: PrepareFn | None = None, shared: bool = True) -> float:
    """Create (rank 0, after `prepare`; without `shared` every rank its own copy), fill (every
    rank), fsync, then index (rank 0). Each file is fsynced once by each rank writing into it,
    after its last write; rank 0 also fsyncs what `prepare` wrote and the folder while the
    others still write. Copies in a folder not shared are uploaded, not kept: never fsynced.
    Returns the seconds taken."""
    t0 = time.perf_counter()
    file_of = {fqn: f.name for f in files for fqn in f.starts}
    own = sorted({file_of[t.block.fqn] for t in tasks}) if shared else []
    small: list[str] = []

    def create() -> None:
        if group.rank == 0:
            small.extend(prepare() if prepare is not None else [])
        if group.rank == 0 or not shared:
            _create_files(output_dir, files, sync={f.name for f in files} - set(own) if shared else (),
                          header=group.rank == 0)

    def fill() -> None:
        # on this thread, inside the step: a copy that fails fails every rank, and the writer
        # threads run no torch op (one cut short by Ctrl-C would abort the process at exit)
        memory = {key: _host_bytes(t) for key, t in (values or {}).items()}
        _Writer(output_dir, files, specs, memory, progress, writeback=shared).run(tasks, num_threads)
        for path in [os.path.join(output_dir, name) for name in own] + (small if shared else []):
            durable.fsync_path(path)
        if group.rank == 0 and shared:
            durable.fsync_path(output_dir)  # the files' names, before an index names them
        faults.hit_in("consolidate", output_dir)  # this rank's bytes are in, the index is not

    _step(group, "creating the output files", create)
    _step(group, "writing tensor data", fill)
    _step(group, "writing the index", lambda: _write_index(output_dir, files, specs) if group.rank == 0 else None)
    seconds = time.perf_counter() - t0
    mine = sum(t.stop - t.start for t in tasks)
    logger.debug("rank %d wrote %s into %s in %.2f s (%.2f GB/s)", group.rank, fmt_bytes(mine),
                 counted(len(files), "file"), seconds, gb_per_s(mine, seconds))
    return seconds


# ---------------------------------------------------------------------------------------------
# Public API.


def consolidate_safetensors(input_dir: str, output_dir: str, fqn_to_index_mapping: Mapping[str, int] | None = None,
                            *, process_group=None, num_threads: int = IO_THREADS, remove_shards: bool = False,
                            all_ranks: bool = True, progress: ProgressFn | None = None,
                            shapes: Mapping[str, Sequence[int]] | None = None) -> None:
    """Consolidate DCP HF shard files (`HuggingFaceStorageWriter(save_distributed=True)`) from
    `input_dir` into `model-0000X-of-0000N.safetensors` and `model.safetensors.index.json` in
    `output_dir`. Collective over `process_group` (a dedicated gloo group over every rank when
    None and `torch.distributed` is initialised; a single process otherwise). `all_ranks=False`
    lets rank 0 copy every byte (the others still take part in the collectives). The shard files
    are kept (as PyTorch's own consolidation keeps them) unless `remove_shards`, which deletes them
    after success. `progress(nbytes, total)` is called as this rank's copy threads write (from
    those threads). `shapes` (name -> whole shape, every tensor's), where the caller knows
    them, are checked against the blocks (`full_tensors`). Raises `InvalidShardsError` for bad
    input."""
    group = CheckpointGroup(process_group)
    t0 = time.perf_counter()
    shard_files = _step(group, "listing shards", lambda: find_shard_files(input_dir) if group.rank == 0 else None)[0]
    mine = shard_files[group.rank::group.world_size]
    blocks = [b for part in _step(group, "reading shard headers",
                                  lambda: [b for p in mine for b in read_shard_blocks(p)]) for b in part]
    specs = full_tensors(blocks, shapes)
    if fqn_to_index_mapping is not None and set(fqn_to_index_mapping) - set(specs):
        missing = sorted(set(fqn_to_index_mapping) - set(specs))
        raise InvalidShardsError(f"{input_dir}: no shard holds {missing[:5]} (named in fqn_to_index_mapping)")
    files = plan_output_files(specs, fqn_to_index_mapping)
    tasks = plan_tasks(blocks, files, specs, group.world_size if all_ranks else 1)
    my_tasks = tasks[group.rank] if group.rank < len(tasks) else []
    _write_everything(group, output_dir, files, specs, my_tasks, num_threads, progress=progress)
    if remove_shards:
        _step(group, "removing shard files", lambda: [os.remove(p) for p in mine])
        if group.rank == 0 and os.path.abspath(input_dir) != os.path.abspath(output_dir) and not os.listdir(input_dir):
            os.rmdir(input_dir)
    if group.rank == 0:
        total = sum(s.nbytes for s in specs.values())
        seconds = time.perf_counter() - t0
        copiers = f"{group.world_size} ranks" if all_ranks and group.world_size > 1 else "rank 0"
        logger.info("consolidated %s (%s) into %s in %s on %s in %.2f s (%.2f GB/s)",
                    counted(len(shard_files), "shard file"), fmt_bytes(total), counted(len(files), "file"),
                    output_dir, copiers, seconds, gb_per_s(total, seconds))


@dataclass(frozen=True)
class OnePassPlan:
    """A one-pass export the ranks agreed on: every tensor of it, in the model's order, and the
    blocks this rank writes with their values (views of the state dict's tensors), by tensor
    name and offsets."""

    specs: dict[str, TensorSpec]
    blocks: list[Block]
    values: dict[tuple[str, tuple[int, ...]], torch.Tensor]
    state_dict: dict[str, Any]
    """This rank's tensors the plan was made from."""


def plan_one_pass(state_dict: Mapping[str, Any] | Callable[[], Mapping[str, Any]], group: CheckpointGroup,
                  order: Sequence[str] | None = None) -> OnePassPlan:
    """Agree, collectively, on what each rank writes: every rank describes the blocks it holds
    (a pipeline stage's rank holds only its stage's tensors, each a block or all of it), the
    descriptions are gathered, and each block is written by the lowest rank holding it. The
    export's tensors follow `order` (HF names in the model's order, which the file split
    follows), else the order the ranks list them in, rank by rank. `state_dict` may be a
    function making it (a conversion): it then runs inside the planning step, so its failure
    on one rank is every rank's, in the same collective."""
    held: dict[str, tuple[Block, tuple[int, ...], torch.Tensor]] = {}
    made: dict[str, Any] = {}

    def describe() -> list[tuple[Block, tuple[int, ...]]]:
        made.update(state_dict() if callable(state_dict) else state_dict)
        for fqn, t in made.items():
            found = _local_block(fqn, t, _dtype_name(fqn, t))
            if found is not None:
                held[fqn] = (found[0], tuple(t.shape), found[1])
        return [(block, shape) for block, shape, _ in held.values()]

    every = _step(group, "planning the export", describe)
    specs = agreed_specs(every, order)
    first = writers(every)
    mine = []
    for block, _, local in held.values():
        if first[(block.fqn, block.offsets)] == group.rank:
            t = made[block.fqn]
            mine += _rows_at_hf_places(block, local, t.row_order) if isinstance(t, PermutedRows) else [(block, local)]
    return OnePassPlan(specs, [b for b, _ in mine if b.nbytes], {(b.fqn, b.offsets): v for b, v in mine}, made)


def agreed_specs(every: Sequence[Sequence[tuple[Block, tuple[int, ...]]]],
                 order: Sequence[str] | None = None) -> dict[str, TensorSpec]:
    """The full tensors the ranks' blocks (`(block, full shape)` per rank) belong to, in `order`
    (names it lacks last), else in the ranks' order. Raises `ValueError` naming the tensor when
    two ranks disagree on its dtype or shape."""
    specs: dict[str, TensorSpec] = {}
    for rank, blocks in enumerate(every):
        for block, shape in blocks:
            spec = TensorSpec(block.fqn, block.dtype, shape)
            if specs.setdefault(block.fqn, spec) != spec:
                other = specs[block.fqn]
                raise ValueError(f"tensor {block.fqn!r} is {spec.dtype} {list(shape)} on rank {rank} and "
                                 f"{other.dtype} {list(other.shape)} on a lower rank; every rank must hold "
                                 "the same model")
    if order is not None:
        position = {name: i for i, name in enumerate(order)}
        specs = dict(sorted(specs.items(), key=lambda item: position.get(item[0], len(position))))
    return specs


def writers(every: Sequence[Sequence[tuple[Block, Any]]]) -> dict[tuple[str, tuple[int, ...]], int]:
    """Each block's writer, by its tensor and offsets: the lowest rank holding it, so a block
    on several ranks (a replicated tensor: on every rank of a pipeline stage, on every
    tensor-parallel rank) is written once."""
    first: dict[tuple[str, tuple[int, ...]], int] = {}
    for rank, blocks in enumerate(every):
        for block, _ in blocks:
            first.setdefault((block.fqn, block.offsets), rank)
    return first


def write_safetensors_one_pass(state_dict: Mapping[str, Any], output_dir: str,
                               fqn_to_index_mapping: Mapping[str, int] | None = None, *,
                               process_group=None, num_threads: int = IO_THREADS, progress: ProgressFn | None = None,
                               plan: OnePassPlan | None = None, prepare: PrepareFn | None = None,
                               shared: bool = True) -> None:
    """Write `state_dict` (tensors, DTensors, `RowOf` experts and `PermutedRows`; on each rank
    the tensors it holds) as final HF safetensors files and index in one pass, collectively:
    the ranks agree on the layout and on who writes what (`plan_one_pass`, or `plan` when
    already agreed; a block by the lowest rank holding it, an expert by the rank holding it, a
    permuted row at its HF place by the rank holding it), write their own blocks at their final
    offsets, fsync, and rank 0 writes the index once every rank is done. No intermediate shard
    files. `progress` as for `consolidate_safetensors`; `prepare` runs on rank 0 first
    (`PrepareFn`). Without `shared`, each rank writes into its own copy of every file (zeros
    where other ranks' bytes go), to be combined by an object store's upload."""
    group = CheckpointGroup(process_group)
    plan = plan or plan_one_pass(state_dict, group)
    files = plan_output_files(plan.specs, fqn_to_index_mapping)
    tasks = [Task(b, 0, b.nbytes) for b in plan.blocks]
    _write_everything(group, output_dir, files, plan.specs, tasks, num_threads, plan.values, progress, prepare,
                      shared)


def _dtype_name(fqn: str, t: Any) -> str:
    if isinstance(t, (RowOf, PermutedRows)):
        t = t.tensor
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{fqn!r} is a {type(t).__name__}; safetensors holds tensors only")
    if t.dtype not in DTYPE_NAMES:
        raise ValueError(f"{fqn!r} has dtype {t.dtype}, which safetensors cannot hold")
    return DTYPE_NAMES[t.dtype]


def _local_block(fqn: str, t: Any, dtype: str) -> tuple[Block, torch.Tensor] | None:
    """This rank's block of `t` and its values (a view), or None when this rank holds none of
    it. Of a `RowOf` (one expert of a grouped weight), only the rank holding that row has it."""
    row = None
    if isinstance(t, RowOf):
        t, row = t.tensor, t.index
    elif isinstance(t, PermutedRows):
        t = t.tensor  # its rows in our order: `_rows_at_hf_places` places them
    if isinstance(t, DTensor):
        if t.device_mesh.get_coordinate() is None:
            return None
        if not all(isinstance(p, LOCAL_PLACEMENTS) for p in t.placements):
            raise ValueError(f"{fqn!r} has placements {t.placements}; reduce Partial tensors before exporting")
        offsets, shape = dtensor_chunk(tuple(t.shape), t.device_mesh, tuple(t.placements))
        local = t.to_local()
    else:
        shape, offsets, local = tuple(t.shape), (0,) * t.dim(), t
    if row is not None:
        if not offsets[0] <= row < offsets[0] + shape[0]:
            return None
        local, shape, offsets = local[row - offsets[0]], shape[1:], offsets[1:]
    if not local.numel() and not math.prod(shape):  # FSDP2 shards a tensor of no elements as (0, 0) on every rank
        local = local.new_empty(shape)
    elif tuple(local.shape) != tuple(shape):
        raise ValueError(f"{fqn!r}: local tensor of shape {list(local.shape)}, expected {list(shape)}")
    return Block(fqn, dtype, tuple(offsets), tuple(shape)), local


def _rows_at_hf_places(block: Block, local: torch.Tensor,
                       row_order: tuple[int, ...]) -> list[tuple[Block, torch.Tensor]]:
    """A block of rows in our order as one block per row at its HF row: our row k of each
    block of `len(row_order)` rows is HF row `row_order[k]` of that block."""
    n = len(row_order)
    rows = []
    for i in range(block.shape[0]):
        ours = block.offsets[0] + i
        hf = ours - ours % n + row_order[ours % n]
        rows.append((Block(block.fqn, block.dtype, (hf, *block.offsets[1:]), (1, *block.shape[1:])), local[i:i + 1]))
    return rows


# ---------------------------------------------------------------------------------------------
# Mapping files (`torchtitan-ckpt consolidate --mapping`).


def load_mapping(path: str) -> dict[str, int]:
    """fqn -> file index from `{fqn: index}` (integers from 1) or from an HF index's `weight_map`
    of numbered file names (`model-0000X-of-0000N.safetensors`). Read as the user's own file (a
    link, a pipe: `--mapping <(...)`), but never more than `MAX_INDEX_BYTES` of it; anything
    else raises `ValueError` naming the file and the entry."""
    with open(path, "rb") as fh:
        text = fh.read(MAX_INDEX_BYTES + 1)
    if len(text) > MAX_INDEX_BYTES:
        raise ValueError(f"{path}: larger than {MAX_INDEX_BYTES} bytes, far more than any file mapping")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    names = data.get("weight_map") if isinstance(data, dict) else None
    entries = data if names is None else names
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: expected an object, {{fqn: file index}}, or an HF index with a weight_map")
    out = {}
    for fqn, value in entries.items():
        index = value if names is None else file_number(value) if isinstance(value, str) else None
        if type(index) is not int or index < 1:
            expected = "a file index (an integer from 1)" if names is None else \
                "a numbered model file (model-0000X-of-0000N.safetensors)"
            raise ValueError(f"{path}: {brief(fqn)} maps to {brief(value)}; expected {expected}")
        out[fqn] = index
    return out
