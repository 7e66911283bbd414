"""Where a background save's copy of the state is made, and who writes it: one strategy per
asynchronous `async_mode`, chosen once (`staging.make_strategy`).

- `FreshCopies` (`async`): each save's copies in fresh host memory, let go of once written, and
  the files written by the save's background thread.
- `SharedArenas` (`async_with_pinned_mem`): long-lived shared-memory arenas, overwritten by each
  save, and the files written by a writer process that maps them.

Both lay a state out first (`layout`: where each tensor goes, nothing copied yet) and hand back
its `Copies`, which the staging thread makes in order while a writer waits for each tensor's
copy only (`Copies.ready`), so the disk starts on the first tensors while later ones are copied.
"""

from __future__ import annotations

import bisect
import copy
import logging
import multiprocessing
import os
import pickle
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError, ConfigError
from ..progress import fmt_bytes
from .filewriter import CountWait, Sink, write_files
from .tensors import local_values
from .writer_process import WriterProcess, fd_shared

logger = logging.getLogger(__name__)

Deferred = Callable[[tuple], bool]
"""Whether the tensor at a path of the state (its keys, in order) may be staged after `submit()`
returns: true only for tensors that nothing changes in place before `wait_for_staging()`."""


def nothing_deferred(path: tuple) -> bool:
    return False


class Stager(ABC):
    """Where a background save's copies go and who writes them. The walk over a state that
    pairs each tensor with its copy is shared; a strategy says where a tensor goes (`_into`)
    and which of the save's own tensors it stages as they are (`_as_is`)."""

    mode: str
    """The `checkpoint.async_mode` it serves, as messages name it."""
    pinned = False
    """Whether copies go into pinned memory (a GPU source's copy then does not block the host)."""
    count: torch.Tensor | None = None
    """See `Copies`: the copies made, in shared memory, for a writer process; None without one."""
    writer: WriterProcess | None = None
    """The process that writes the files, while one runs (`async_with_pinned_mem`)."""

    def layout(self, state: Any, owned: Deferred = nothing_deferred) -> Copies:
        """Where each tensor of `state` is staged (allocating what is new), and the staged
        state; nothing is copied until `Copies.run`. `owned(path)`: the tensor there is the
        save's own (`freeze`'s clone, or a copy `stage_now` made)."""
        self._prepare(state)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged = self._walk(state, (), pairs, owned)
        pairs.sort(key=lambda pair: pair[1].nbytes, reverse=True)  # the order the files take them (`balanced_groups`)
        return Copies(staged, pairs, non_blocking=self.pinned, count=self.count)

    def _walk(self, state: Any, path: tuple, pairs: list, owned: Deferred) -> Any:
        if isinstance(state, torch.Tensor):
            if owned(path) and self._as_is(path, state):
                return state
            copied, staged = _destination(state, self._into(path))
            pairs.append((local_values(state).detach(), copied))
            return staged
        if isinstance(state, dict):
            return {k: self._walk(v, (*path, k), pairs, owned) for k, v in state.items()}
        if traversed_list(state):
            return [self._walk(v, (*path, i), pairs, owned) for i, v in enumerate(state)]
        return copied_value(state, path)

    def _prepare(self, state: Any) -> None:
        """Make room for the tensors of `state` before they are laid out."""

    @abstractmethod
    def _as_is(self, path: tuple, t: torch.Tensor) -> bool:
        """Whether the save's own tensor `t` is staged as it is, uncopied."""

    @abstractmethod
    def _into(self, path: tuple) -> torch.Tensor | None:
        """Where the tensor at `path` is copied: a place of its shape, or None for fresh memory."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held between saves."""

    @abstractmethod
    def start(self, saves: bool) -> None:
        """Start what writes the files, as the strategy is made (`saves`: the job saves)."""

    @abstractmethod
    def stage_now(self, path: tuple, t: torch.Tensor) -> torch.Tensor | None:
        """`t`, the tensor at `path`, copied now to where it is staged, and that copy; None where
        it cannot be (`freeze` clones it)."""

    @abstractmethod
    def sink(self) -> Sink:
        """Where a save's files go; called on the training thread as each save is submitted."""

    @abstractmethod
    def end_writes(self) -> None:
        """Stop what writes the files (a later `sink` starts it again)."""

    @abstractmethod
    def release(self) -> None:
        """Let go of what is held between saves."""

    @abstractmethod
    def abandon(self) -> None:
        """`release` and `end_writes` waiting for nothing: for an owner collected unclosed, maybe
        while the exit's `end_writes` runs on another thread."""


class FreshCopies(Stager):
    """`async`: every save's copies in fresh host memory, freed once written; the save's
    background thread writes the files."""

    mode = "async"

    @property
    def nbytes(self) -> int:
        return 0

    def start(self, saves: bool) -> None:
        """Nothing to start."""

    def stage_now(self, path: tuple, t: torch.Tensor) -> torch.Tensor | None:
        """Nothing is laid out ahead of a save to copy into."""
        return None

    def sink(self) -> Sink:
        return write_files

    def _as_is(self, path: tuple, t: torch.Tensor) -> bool:
        """The save's own tensor in host memory: a copy of it would hold three of it at once."""
        return local_values(t).device.type == "cpu"

    def _into(self, path: tuple) -> torch.Tensor | None:
        return None

    def end_writes(self) -> None:
        """The save's own thread writes."""

    def release(self) -> None:
        """Nothing is held between saves."""

    def abandon(self) -> None:
        """Nothing is held between saves."""


_STAGE_NOW_BYTES = 1 << 16
"""Below this, a tensor `SharedArenas.stage_now` is asked for is cloned instead: a small clone
costs less than finding its place (docs/performance.md, "Peak host memory")."""

_ALIGN = 64
"""Bytes each staged tensor's place in an arena is aligned to (any dtype's, and a cache line)."""


@dataclass(frozen=True)
class _Place:
    """Where one tensor of the state is staged: `view`, of `arena`, for tensors matching `kind`
    (type, dtype, device type, local shape, strides)."""

    arena: torch.Tensor
    view: torch.Tensor
    kind: tuple


class SharedArenas(Stager):
    """`async_with_pinned_mem`: the copies are kept and overwritten by the next save (no
    allocation once warm), in shared-memory arenas that the writer process maps once and reads
    without a copy, page-locked (pinned) when they receive GPU tensors so those copies run at
    DMA speed. The first save stages every tensor into one arena; a later save stages the
    tensors that changed shape, dtype or strides, or are new (a dataloader position of another
    length, moments after the optimizer's first step), into one more arena of just their size;
    an arena whose tensors have all moved to newer ones is freed. Each arena is one
    shared-memory file descriptor in the rank and in its writer, so a state needs a few, not
    one per tensor (thousands for a large model, past common `ulimit -n` limits). The writer
    process (training keeps the GIL) starts on each tensor as soon as its copy is made, by a
    count of the copies made in shared memory."""

    mode = "async_with_pinned_mem"
    pinned = True

    def __init__(self) -> None:
        self._places: dict[tuple, _Place] = {}
        """Path in the state -> its place; kept for paths a later state lacks (the next full
        save after a model-only one reuses them)."""
        self._pinned: dict[int, tuple[torch.Tensor, torch.device]] = {}
        """Address registered with CUDA -> (its arena, the device whose tensors it receives)."""
        try:  # a normal tensor, made under a caller's inference_mode too: the staging thread writes it
            with torch.inference_mode(False):
                self.count = fd_shared(torch.zeros(1, dtype=torch.int64, device="cpu"))
        except RuntimeError as e:  # first: nothing is started yet that a failure would leave behind
            raise ConfigError("checkpoint.async_mode", self.mode, "needs shared memory, which this machine "
                              f"refuses ({e}); use async, which needs none") from e

    def start(self, saves: bool) -> None:
        """Start the writer process where the job saves, so that it is up by the first save (it
        takes seconds to import torch); else by the first save, should one come (`sink`)."""
        if saves:
            if multiprocessing.current_process().daemon:
                raise ConfigError("checkpoint.async_mode", self.mode, "saves through a writer process, which this "
                                  "process may not start: it is daemonic (a multiprocessing.Pool's worker, a "
                                  "Process(daemon=True)); use async, which needs none")
            self.writer = WriterProcess()

    def sink(self) -> Sink:
        """The writer process; started here, and one that died (its save failed and said so)
        replaced, on the training thread, which the process's life is tied to."""
        if self.writer is not None and not self.writer.alive:
            logger.warning("the checkpoint writer process is gone (exit code %s); starting a new one",
                           self.writer.exitcode)
            self.writer.close()
            self.writer = None
        if self.writer is None:
            self.writer = WriterProcess()
        return self.writer

    @property
    def nbytes(self) -> int:
        return sum(a.numel() for a in self._arenas().values())

    def _arenas(self) -> dict[int, torch.Tensor]:
        return {p.arena.data_ptr(): p.arena for p in self._places.values()}

    def stage_now(self, path: tuple, t: torch.Tensor) -> torch.Tensor | None:
        """A host tensor of `_STAGE_NOW_BYTES` or more whose place is laid out already (a warm
        save) copied into it now, on the caller's thread, and that staged copy; else None. Call
        only while no staging runs (they share the places)."""
        t = t.detach()  # a Parameter's place is a plain tensor's (`freeze` clones it so), and no graph is kept
        place = self._places.get(path)
        local = local_values(t)
        if place is None or local.nbytes < _STAGE_NOW_BYTES or local.device.type != "cpu" or place.kind != _kind(t):
            return None
        copied, staged = _destination(t, place.view.detach())  # an alias of its own: the save alone holds it
        copied.copy_(local)
        return staged

    def _prepare(self, state: Any) -> None:
        new = {path: t for path, t in tensors_of(state)
               if path not in self._places or self._places[path].kind != _kind(t)}
        if new:
            self._allocate(new)

    def _as_is(self, path: tuple, t: torch.Tensor) -> bool:
        """Only a tensor `stage_now` copied into its place already: the writer process reads
        the arenas alone."""
        return self._places[path].view.data_ptr() == local_values(t).data_ptr()

    def _into(self, path: tuple) -> torch.Tensor | None:
        return self._places[path].view.detach()  # an alias of its own: the save alone holds it

    def _allocate(self, tensors: dict[tuple, torch.Tensor]) -> None:
        """One new arena with an aligned place for each of `tensors`; arenas left with no place
        in use are freed (unpinned first)."""
        offsets, size = {}, 0
        for path, t in tensors.items():
            offsets[path] = size
            size += -(-local_values(t).nbytes // _ALIGN) * _ALIGN
        try:
            with torch.inference_mode(False):  # as `count`: written outside a caller's inference_mode
                arena = fd_shared(torch.empty(size, dtype=torch.uint8, device="cpu"))
        except RuntimeError as e:
            if "shm" not in str(e) and "shared memory" not in str(e):  # not shared memory's (no memory at all)
                raise
            raise RuntimeError(_no_shared_memory(size, e)) from e
        device = next((local_values(t).device for t in tensors.values() if local_values(t).is_cuda), None)
        if device is not None:
            self._pin(arena, device)
        for path, t in tensors.items():
            kind, local = _kind(t), local_values(t)
            view = arena[offsets[path]:offsets[path] + local.nbytes].view(local.dtype)
            self._places[path] = _Place(arena, view.as_strided(local.shape, kind[-1]), kind)
        live = self._arenas()
        for address in [a for a in self._pinned if a not in live]:
            self._unpin(address)

    def _pin(self, arena: torch.Tensor, device: torch.device) -> None:
        """Register `arena` with CUDA, on `device`: a raw CUDA call on a thread that never chose a
        device would open a context on GPU 0 (memory there for every rank of the node)."""
        if not arena.numel():
            return
        with torch.cuda.device(device):
            error = int(torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 1))  # 1: portable
        if error:  # raised here: a CUDA error left pending would surface in unrelated code later
            raise RuntimeError(f"pinning a {arena.numel()}-byte staging buffer failed (cudaError {error}); "
                               'checkpoint.async_mode = "async" stages without pinning')
        self._pinned[arena.data_ptr()] = (arena, device)

    def _unpin(self, address: int) -> None:
        _, device = self._pinned.pop(address)
        with torch.cuda.device(device):
            torch.cuda.cudart().cudaHostUnregister(address)

    def end_writes(self) -> None:
        """Stop the writer process (it is started again by the next save's `sink`)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def release(self) -> None:
        """Drop every arena (unpinning the pinned ones), and the count shared with the writer."""
        for address in list(self._pinned):
            self._unpin(address)
        self._places.clear()
        self.count = None

    def abandon(self) -> None:
        self.release()
        if (writer := self.writer) is not None:
            writer.stop()


class Copies:
    """One staging's copies, made in order by `run`. `ready(t)` blocks until the copy that `t` is
    (or is a view of) is made, so a writer may start on the first tensors while later ones are
    still being copied; the copies go at memory speed, the writes at the disk's."""

    def __init__(self, staged: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]], non_blocking: bool,
                 count: torch.Tensor | None = None):
        self.staged = staged
        """The state with each tensor replaced by its copy (made by `run`)."""
        self._pairs = pairs  # (source, destination) local tensors, in the order copied; dropped once done
        self._total = len(pairs)
        self._non_blocking = non_blocking  # into pinned arenas: a GPU copy does not block the host
        spans = sorted((dst.data_ptr(), i) for i, (_, dst) in enumerate(pairs) if dst.numel())
        self._starts = [start for start, _ in spans]
        self._ends = [start + pairs[i][1].nbytes for start, i in spans]  # a copy is dense: its bytes are one stretch
        self._order = [i for _, i in spans]
        self._made = 0
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._count = count
        """A shared-memory copy of the count of copies made (-1 once staging failed), for a
        writer process; reset here, as one save's staging starts."""
        if count is not None:
            count.fill_(0)

    def run(self) -> None:
        """Make every copy, in order, and mark each one made once its bytes are final: a CPU
        source's when `copy_` returns; a GPU source's (queued on the current stream, the side
        stream of `_CopyStream`) when an event recorded after it has completed. So the writes
        start on the first tensors while later ones are still being copied, from a GPU too."""
        queued: list[tuple[int, torch.cuda.Event | None]] = []  # copies not yet marked, in order
        for i, (source, destination) in enumerate(self._pairs):
            destination.copy_(source, non_blocking=self._non_blocking and source.is_cuda)
            queued.append((i, torch.cuda.current_stream(source.device).record_event() if source.is_cuda else None))
            while queued and (queued[0][1] is None or queued[0][1].query()):
                self._mark(queued.pop(0)[0] + 1)
        for i, event in queued:
            if event is not None:
                event.synchronize()
            self._mark(i + 1)

    def finish(self) -> None:
        """Every copy is made and final; the sources are let go (on a GPU, clones or casts made
        for this save would otherwise stay in its memory until the save is committed)."""
        self._pairs = []
        self._mark(self._total)

    def fail(self, error: BaseException) -> None:
        """Staging failed: whoever waits for a copy, now or later, gets `error`."""
        self._pairs = []
        with self._cond:
            self._error = error
            if self._count is not None:
                self._count.fill_(-1)
            self._cond.notify_all()

    def _mark(self, made: int) -> None:
        with self._cond:
            self._made = made
            if self._count is not None:  # after the copies' bytes: a reader of the count sees them
                self._count.fill_(made)
            self._cond.notify_all()

    def _needed(self, t: torch.Tensor) -> int:
        """How many copies must be made before `t`'s bytes are final."""
        if not t.numel():
            return 0
        found = bisect.bisect_right(self._starts, t.data_ptr()) - 1
        if found < 0 or t.data_ptr() >= self._ends[found]:
            return 0  # no copy's: a tensor staged as it is (`layout`'s `owned`)
        return self._order[found] + 1

    def ready(self, t: torch.Tensor) -> None:
        """Block until the copy holding `t`'s bytes is made (raising staging's failure)."""
        self._wait(self._needed(t))

    @property
    def counted(self) -> bool:
        """Whether the copies made are counted in shared memory (`wait_across` works)."""
        return self._count is not None

    def wait_across(self, t: torch.Tensor) -> CountWait:
        """`ready(t)` as a writer process can wait for it (needs the shared count)."""
        return CountWait(self._count, self._needed(t))

    def done(self) -> None:
        """Block until every copy is made (raising staging's failure)."""
        self._wait(self._total)

    def _wait(self, made: int) -> None:
        with self._cond:
            while self._made < made and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error


def tensors_of(state: Any, path: tuple = ()):
    """(path, tensor) for every tensor of a nested state, in the order `layout` visits them."""
    if isinstance(state, torch.Tensor):
        yield path, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from tensors_of(v, (*path, k))
    elif traversed_list(state):
        for i, v in enumerate(state):
            yield from tensors_of(v, (*path, i))


def traversed_list(value: Any) -> bool:
    """Whether DCP saves the items of `value` one by one, as it does a list holding a tensor, a
    dict or such a list; any other list, a tuple (a named one too) and every other value it
    pickles whole, tensors inside included. Staging looks inside the same containers: a tensor
    staged as a view of a shared buffer inside a value pickled whole would carry the whole
    buffer into the checkpoint."""
    return isinstance(value, list) and any(isinstance(v, (torch.Tensor, dict)) or traversed_list(v) for v in value)


def _kind(t: torch.Tensor) -> tuple:
    """What a tensor's place must match to be reused: type, dtype, device type, local shape,
    and last the strides of its copy (its own when dense, as `empty_like` keeps them)."""
    local = local_values(t)
    strides = local.stride() if local.is_contiguous() else torch.empty_like(local, device="meta").stride()
    return type(t), local.dtype, local.device.type, tuple(local.shape), tuple(strides)


def _destination(t: torch.Tensor, into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(where `t`'s local tensor is copied: `into`, `t`'s shape, or fresh CPU memory of its
    strides; the staged value: that copy, as a DTensor of `t`'s placement if `t` is one)."""
    local = local_values(t)
    copied = torch.empty_like(local, device="cpu") if into is None else into
    if isinstance(t, DTensor):
        # not `DTensor.from_local`: it moves a local tensor to the mesh's device type (a CUDA
        # mesh's copy would go back to the GPU, before anything is copied into it)
        return copied, DTensor(copied, t._spec, requires_grad=False)
    return copied, copied


def copied_value(value: Any, path: tuple) -> Any:
    """A deep copy of the state's `value` at `path`. What `deepcopy` refuses and a pickle takes
    (a tensor that requires grad and is not a leaf: a loss kept without `detach()`, which a
    synchronous save writes) is copied through a pickle, as the save will write it; one neither
    copies (a lock, an open file), which no save could write either, is named as a synchronous
    save names it."""
    try:
        return copy.deepcopy(value)
    except Exception as e:
        try:
            return pickle.loads(pickle.dumps(value))  # this process's own objects, pickled here
        except Exception:
            raise CheckpointError(f"state value '{'.'.join(map(str, path))}' ({type(value).__name__}) cannot be "
                                  f"saved: {type(e).__name__}: {e}") from None


_SHARED_MEMORY = "/dev/shm"
"""Where torch's shared memory lives on Linux: a tmpfs of its own, often small in containers."""


def _no_shared_memory(size: int, error: Exception) -> str:
    """Why `size` bytes of staging arena could not be had, in words that send the reader to
    shared memory rather than to the checkpoint's disk, which the error's errno suggests."""
    try:
        stat = os.statvfs(_SHARED_MEMORY)
        free, total = stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize
        room = f"; {_SHARED_MEMORY} has {fmt_bytes(free)} free of {fmt_bytes(total)}"
    except OSError:
        room = ""
    return (f"async_with_pinned_mem could not stage {fmt_bytes(size)} in shared memory ({error}){room}: give "
            f"the machine or container more (docker run --shm-size), or use checkpoint.async_mode = \"async\", "
            "which stages in the process's own memory")
