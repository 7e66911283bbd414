"""How a save overlaps training: one strategy per `async_mode`, picked once.

A strategy receives the resolved state (plain nested dicts of tensors and values, taken at the
step being saved) and a `SaveJob`: the phases that prepare the step folder, write the state
through DCP and commit the step. Synchronous saving runs them in place. The asynchronous
strategies first *stage* the state, i.e. copy every tensor into CPU memory the training loop never
touches, so the copy can be written in the background (CPU tensors are copied too: aliasing them
is how async DCP once wrote wrong data).

Staging itself runs in the background too, overlapped with the next step's forward and backward,
which change neither the parameters nor the optimizer's state. `submit()` only fixes what the
rest of the step could change: every value that is not a tensor is copied, and so is every tensor
outside the *deferred* ones (the caller names them: parameters and the optimizer's per-parameter
state); the deferred tensors are copied by the background thread, and whatever would change them
first calls `wait_for_staging()` (the manager's optimizer step pre-hook). On a GPU those copies run
on a side CUDA stream that waits for the work queued before `save()`, with `non_blocking` copies
into pinned buffers, and staging is done once that stream has finished them.

Writing overlaps staging: the save gets the staged state (`Staged`) as soon as its copies are
laid out, and writes each tensor as soon as its copy is made (`Copies.ready`; on a GPU, once an
event recorded after its copy on the side stream has completed), so the disk starts on the
first tensors while the last are still being copied (DCP's early writes,
`dcp.storage.DataFileWriter.write_early`). The writer process of `async_with_pinned_mem` is
handed those files at once too, and waits for each tensor's copy on a shared-memory count of
the copies made (`Staged.wait_across`).

At most one save is in flight: `submit()` first waits for the previous one. A failure of the
background save is kept and raised by the next `submit()`, `wait()` or `close()`.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import functools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import faults, gc_pause
from .errors import CheckpointError, ConfigError, StagingMismatchError, in_chain, no_thread
from .io.dtypes import same_bytes
from .io.tensors import local_values
from .io.filewriter import CountWait, Sink, write_files
from .io.writer_process import WriterProcess

logger = logging.getLogger(__name__)

_NO_THREADS_AT_EXIT = (3, 12, 0) <= sys.version_info[:3] < (3, 12, 3)
"""Python 3.12.0-3.12.2 start no thread once the interpreter is exiting (CPython gh-113964,
fixed in 3.12.3), so a save still in flight at exit cannot finish there."""
_EXIT_THREADS_NOTE = (" (this Python, 3.12.0 to 3.12.2, starts no thread at exit: close the CheckpointManager "
                      "before the script ends, or use Python 3.12.3 or later)")


def _no_thread_at_exit(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from or during, is that refusal of a thread."""
    return in_chain(error, lambda e: isinstance(e, RuntimeError) and "interpreter shutdown" in str(e)) is not None

Deferred = Callable[[tuple], bool]
"""Whether the tensor at a path of the state (its keys, in order) may be staged after `submit()`
returns: true only for tensors that nothing changes in place before `wait_for_staging()`."""


def _nothing_deferred(path: tuple) -> bool:
    return False


StageNow = Callable[[tuple, torch.Tensor], "torch.Tensor | None"]
"""The tensor at a path of the state copied to where it is staged, now, and that copy (None
where it cannot be)."""


def _not(deferred: Deferred, path: tuple) -> bool:
    return not deferred(path)


def _at_once(t: torch.Tensor) -> None:
    """Every tensor's bytes are final already."""


def _nothing() -> None:
    """Nothing to wait for."""


@dataclass(frozen=True)
class Staged:
    """The state a save writes, and when its tensors' bytes may be read: a background save
    hands it over while staging is still copying the tensors in, so the writes start on the
    first tensors copied instead of after the last."""

    state: dict[str, Any]
    ready: Callable[[torch.Tensor], None] = _at_once
    """Blocks until the bytes of a tensor of `state` (or of a view of one) are final; raises
    staging's failure."""
    done: Callable[[], None] = _nothing
    """Blocks until every tensor's bytes are final; raises staging's failure."""
    wait_across: Callable[[torch.Tensor], CountWait] | None = None
    """For a writer process (which cannot call `ready`): a picklable wait for a tensor's bytes,
    over a shared-memory count of the copies made; None where staging keeps no such count."""


@dataclass(frozen=True)
class SaveJob:
    """One save, as phases that every rank runs in this order. Each raises `CheckpointSaveError`
    (naming the step) on any rank's failure, on every rank."""

    step: int
    path: str
    prepare: Callable[[], None]
    """Create the step folder (replacing a partial leftover)."""
    write: Callable[[Staged, Sink], Any]
    """Write the state with `dcp.save` (planning and collectives in this process; the data
    files' bytes through the sink); returns what `commit` needs (the files this rank wrote
    with their checksums, the dedup summary)."""
    commit: Callable[[Any], None]
    """Make the step visible (the commit marker), log it, apply retention."""

    def run(self, state: Callable[[], Staged], sink: Sink = write_files) -> None:
        """Every phase, in order. `state()` is asked for once the step folder is prepared, so a
        background save prepares it while the state is still being staged. The garbage
        collector is paused while the step's objects are built (`gc_pause`), not in the commit,
        which waits for the data to be durable."""
        with gc_pause.paused():
            self.prepare()
            written = self.write(state(), sink)
        self.commit(written)


class SynchronousSaves:
    """`async_mode = "disabled"`: the training loop waits until the step is committed."""

    def submit(self, state: dict[str, Any], job: SaveJob, deferred: Deferred = _nothing_deferred) -> None:
        job.run(lambda: Staged(state))

    def in_flight(self) -> bool:
        return False

    def wait(self) -> None:
        """Nothing is ever in flight."""

    def wait_for_staging(self) -> None:
        """Nothing is ever staged."""

    def close(self) -> None:
        """Nothing to shut down."""

    def abandoner(self) -> Callable[[], None]:
        """Nothing to let go of (`BackgroundSaves.abandoner`)."""
        return lambda: None


def freeze(state: Any, deferred: Deferred, path: tuple = (), stage_now: StageNow = lambda path, t: None) -> Any:
    """`state` as it is now, except for the deferred tensors: those are kept as they are (live),
    every other tensor is staged now where `stage_now` can (`Stager.stage_now`), else cloned on
    its device (no host synchronisation), and every other value is deep-copied, so that nothing
    but a change to a deferred tensor reaches what is staged."""
    if isinstance(state, torch.Tensor):
        if deferred(path):
            return state
        staged = stage_now(path, state)
        return state.detach().clone() if staged is None else staged
    if isinstance(state, dict):
        return {k: freeze(v, deferred, (*path, k), stage_now) for k, v in state.items()}
    if _traversed_list(state):
        return [freeze(v, deferred, (*path, i), stage_now) for i, v in enumerate(state)]
    if type(state) in _IMMUTABLE or type(state) is tuple and all(type(v) in _IMMUTABLE for v in state):
        return state
    return _copied(state, path)


def _copied(value: Any, path: tuple) -> Any:
    """A deep copy of the state's `value` at `path`; one nothing copies (a lock, an open file),
    which no save could write either, named as a synchronous save names it."""
    try:
        return copy.deepcopy(value)
    except Exception as e:
        raise CheckpointError(f"state value '{'.'.join(map(str, path))}' ({type(value).__name__}) cannot be saved: "
                              f"{type(e).__name__}: {e}") from None


_IMMUTABLE = frozenset({int, float, bool, str, bytes, type(None)})
"""Leaf types `freeze` keeps as they are (and flat tuples of them, as Adam's `betas`): an
optimizer's settings are thousands of them."""


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


_STAGE_NOW_BYTES = 1 << 16
"""Below this, a tensor `Stager.stage_now` is asked for is cloned instead: a small clone costs
less than finding its place (docs/performance.md, "Peak host memory")."""

_ALIGN = 64
"""Bytes each staged tensor's place in an arena is aligned to (any dtype's, and a cache line)."""


@dataclass(frozen=True)
class _Place:
    """Where one tensor of the state is staged: `view`, of `arena`, for tensors matching `kind`
    (type, dtype, device type, local shape, strides)."""

    arena: torch.Tensor
    view: torch.Tensor
    kind: tuple


class Stager:
    """Copies a state into CPU memory. With `reuse=True` the copies are kept and overwritten by
    the next save (no allocation once warm), in shared-memory arenas that the writer process
    maps once and reads without a copy, page-locked (pinned) when they receive GPU tensors so
    those copies run at DMA speed. The first save stages every tensor into one arena; a later
    save stages the tensors that changed shape, dtype or strides, or are new (a dataloader
    position of another length, moments after the optimizer's first step), into one more arena
    of just their size; an arena whose tensors have all moved to newer ones is freed. Each arena is
    one shared-memory file descriptor in the rank and in its writer, so a state needs a few,
    not one per tensor (thousands for a large model, past common `ulimit -n` limits)."""

    def __init__(self, reuse: bool):
        self.reuse = reuse
        self._places: dict[tuple, _Place] = {}
        """Path in the state -> its place; kept for paths a later state lacks (the next full
        save after a model-only one reuses them)."""
        self._pinned: dict[int, tuple[torch.Tensor, torch.device]] = {}
        """Address registered with CUDA -> (its arena, the device whose tensors it receives)."""

    @property
    def nbytes(self) -> int:
        """Bytes held between saves."""
        return sum(a.numel() for a in self._arenas().values())

    def _arenas(self) -> dict[int, torch.Tensor]:
        return {p.arena.data_ptr(): p.arena for p in self._places.values()}

    def layout(self, state: Any, count: torch.Tensor | None = None, owned: Deferred = _nothing_deferred) -> Copies:
        """Where each tensor of `state` is staged (allocating what is new), and the staged
        state; nothing is copied until `Copies.run`. `count`: see `Copies`. `owned(path)`: the
        tensor there is the save's own (`freeze`'s clone); without `reuse`, one in host memory
        is staged as it is (a second copy would hold three of it at once)."""
        if self.reuse:
            new = {path: t for path, t in _tensors(state, ())
                   if path not in self._places or self._places[path].kind != _kind(t)}
            if new:
                self._allocate(new)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged = self._layout(state, (), pairs, owned)
        pairs.sort(key=lambda pair: pair[1].nbytes, reverse=True)  # the order the files take them (`balanced_groups`)
        return Copies(staged, pairs, non_blocking=self.reuse, count=count)

    def stage_now(self, path: tuple, t: torch.Tensor) -> torch.Tensor | None:
        """With `reuse`, a host tensor of `_STAGE_NOW_BYTES` or more whose place is laid out
        already (a warm save) copied into it now, on the caller's thread, and that staged copy;
        else None. Call only while no staging runs (they share the places)."""
        t = t.detach()  # a Parameter's place is a plain tensor's (`freeze` clones it so), and no graph is kept
        place = self._places.get(path) if self.reuse else None
        local = local_values(t)
        if place is None or local.nbytes < _STAGE_NOW_BYTES or local.device.type != "cpu" or place.kind != _kind(t):
            return None
        copied, staged = _destination(t, place.view.detach())  # an alias of its own: the save alone holds it
        copied.copy_(local)
        return staged

    def _layout(self, state: Any, path: tuple, pairs: list, owned: Deferred) -> Any:
        if isinstance(state, torch.Tensor):
            if not self.reuse and owned(path) and local_values(state).device.type == "cpu":
                return state
            into = None
            if self.reuse:
                into = self._places[path].view.detach()  # an alias of its own: the save alone holds it
                if owned(path) and into.data_ptr() == local_values(state).data_ptr():
                    return state  # staged there already (`stage_now`)
            copied, staged = _destination(state, into)
            pairs.append((local_values(state).detach(), copied))
            return staged
        if isinstance(state, dict):
            return {k: self._layout(v, (*path, k), pairs, owned) for k, v in state.items()}
        if _traversed_list(state):
            return [self._layout(v, (*path, i), pairs, owned) for i, v in enumerate(state)]
        return _copied(state, path)

    def _allocate(self, tensors: dict[tuple, torch.Tensor]) -> None:
        """One new arena with an aligned place for each of `tensors`; arenas left with no place
        in use are freed (unpinned first)."""
        offsets, size = {}, 0
        for path, t in tensors.items():
            offsets[path] = size
            size += -(-local_values(t).nbytes // _ALIGN) * _ALIGN
        try:
            arena = torch.empty(size, dtype=torch.uint8).share_memory_()
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

    def release(self) -> None:
        """Drop every arena (unpinning the pinned ones)."""
        for address in list(self._pinned):
            self._unpin(address)
        self._places.clear()


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
            return 0  # no copy's: a tensor staged as it is (`Stager.layout`'s `owned`)
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


def _tensors(state: Any, path: tuple):
    """(path, tensor) for every tensor of a nested state, in the order `Stager.layout` visits them."""
    if isinstance(state, torch.Tensor):
        yield path, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _tensors(v, (*path, k))
    elif _traversed_list(state):
        for i, v in enumerate(state):
            yield from _tensors(v, (*path, i))


def _traversed_list(value: Any) -> bool:
    """Whether DCP saves the items of `value` one by one, as it does a list holding a tensor, a
    dict or such a list; any other list, a tuple (a named one too) and every other value it
    pickles whole, tensors inside included. Staging looks inside the same containers: a tensor
    staged as a view of a shared buffer inside a value pickled whole would carry the whole
    buffer into the checkpoint."""
    return isinstance(value, list) and any(isinstance(v, (torch.Tensor, dict)) or _traversed_list(v) for v in value)


def _kind(t: torch.Tensor) -> tuple:
    """What a tensor's place must match to be reused: type, dtype, device type, local shape,
    and last the strides of its copy (its own when dense, as `empty_like` keeps them)."""
    local = local_values(t)
    strides = local.stride() if local.is_contiguous() else torch.empty_like(local, device="meta").stride()
    return type(t), local.dtype, local.device.type, tuple(local.shape), tuple(strides)


class _CopyStream:
    """The CUDA side of staging: the copies run on a side stream of each device the state uses
    (the training streams keep computing), after the work queued on the caller's current stream
    before `save()`, and staging is done when that stream has finished them. CPU states skip it."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def mark(self, state: Any) -> dict[torch.device, torch.cuda.Event]:
        """On the training thread: an event after the work queued so far on each CUDA device
        the state's tensors are on."""
        if not torch.cuda.is_initialized():  # no tensor can be on a GPU: skip the walk over the state
            return {}
        devices = {t.device for _, t in _tensors(state, ()) if t.is_cuda}  # a DTensor's is its shard's
        return {d: torch.cuda.current_stream(d).record_event() for d in devices}

    def run(self, marks: dict[torch.device, torch.cuda.Event], copy_all: Callable[[], Any]) -> Any:
        """`copy_all()` with its CUDA copies on side streams after `marks`, once they are done."""
        if not marks:
            return copy_all()
        streams = [self._stream(device) for device in marks]
        for stream, event in zip(streams, marks.values()):
            stream.wait_event(event)
        try:
            with contextlib.ExitStack() as current:  # each device's copies on its own side stream
                for stream in streams:
                    current.enter_context(torch.cuda.stream(stream))
                return copy_all()
        finally:  # after a failure too: the sources must outlive the copies already queued
            for stream in streams:
                stream.synchronize()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


_THREADS = 2
"""A background save's threads: one stages, the other writes and commits."""


class BackgroundSaves:
    """Stage, write and commit on a background thread; `submit()` returns before the copy.

    `async`: fresh CPU copies each save, files written by the background thread.
    `async_with_pinned_mem`: long-lived shared-memory staging arenas, reused, and the files
    written by a separate writer process that reads them (the background thread then
    only plans, waits and commits, so training keeps the GIL).

    With `verify=True` (`checkpoint.verify_staging`, a debug setting) staging is done inside
    `submit()` instead, and the first `wait_for_staging()` or `wait()` after it compares the
    deferred tensors with their staged copies: one changed in between (by anything but the
    optimizer's step, which the hook runs before) is a `StagingMismatchError` naming it."""

    def __init__(self, reuse_buffer: bool, verify: bool = False, saves: bool = True):
        self.stager = Stager(reuse=reuse_buffer)
        self._pool = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="ckpt-save")
        self._held = _Held(self._pool, self.stager)
        self._pending: Future | None = None
        self._staging: Future | None = None
        self._path = ""
        """The step folder of the last save submitted, for the log."""
        self._copies = _CopyStream()
        self._verify = verify
        self._check: list[tuple[tuple, torch.Tensor, torch.Tensor]] = []
        """(path, live tensor, its staged copy) for each deferred tensor, with `verify`."""
        self._pinned = reuse_buffer
        try:
            self._count = torch.zeros(1, dtype=torch.int64).share_memory_() if reuse_buffer else None
            """The copies made of the save being staged, in shared memory, so that the writer
            process starts on each tensor as soon as its copy is made (`Copies`)."""
        except RuntimeError as e:  # first: nothing is started yet that a failure would leave behind
            raise ConfigError("checkpoint.async_mode", "async_with_pinned_mem", "needs shared memory, which "
                              f"this machine refuses ({e}); use async, which needs none") from e
        try:
            _start_threads(self._pool, _THREADS)
            self.writer = WriterProcess() if reuse_buffer and saves else None
        except RuntimeError as e:
            self._pool.shutdown(wait=False)
            if not no_thread(e):
                raise
            raise ConfigError("checkpoint.async_mode", "async_with_pinned_mem" if reuse_buffer else "async",
                              f"its background saves need threads of their own, and this process may start no "
                              f"more ({e}): its limit of processes (`ulimit -u`, a container's pids limit) or of "
                              "memory for their stacks (`ulimit -v`) is reached; raise it, or save with "
                              "async_mode = 'disabled'") from e
        _wait_at_exit(self)

    @property
    def writer(self) -> WriterProcess | None:
        """`async_with_pinned_mem`'s writer process: started with the strategy, so that it is up
        by the first save (it takes seconds to import torch) when the job saves, else never (by
        the first save, should one come)."""
        return self._held.writer

    @writer.setter
    def writer(self, writer: WriterProcess | None) -> None:
        self._held.writer = writer

    def submit(self, state: dict[str, Any], job: SaveJob, deferred: Deferred = _nothing_deferred) -> None:
        self.wait()
        self._path = job.path
        try:
            sink = self._sink()
            frozen = freeze(state, deferred, stage_now=self.stager.stage_now)
        except Exception as e:  # raised by the save's write, inside DCP's protocol, where every rank hears of it
            self._pending = self._pool.submit(job.run, functools.partial(_failed, e, {}))
            self._pending.add_done_callback(_log_failure)
            return
        marks = self._copies.mark(frozen)
        laid_out: Future = Future()
        copies: list[Copies] = []
        owned = functools.partial(_not, deferred)  # `freeze` cloned the tensors it does not defer
        staging = self._staging = self._pool.submit(self._stage, frozen, marks, job.step, laid_out, copies, owned)
        if self._verify:
            wait_for([staging])  # a failure is the save's, raised on every rank by its write
            if staging.exception() is None:
                self._check = [(path, t, _at(copies[0].staged, path)) for path, t in _tensors(frozen, ())
                               if deferred(path)]
        held = [frozen]  # let go of once laid out: `freeze`'s clones are not kept for the whole save
        self._pending = self._pool.submit(job.run, lambda: _take(laid_out, copies, held), sink)
        self._pending.add_done_callback(_log_failure)

    def _stage(self, frozen: dict[str, Any], marks: dict, step: int, laid_out: Future, into: list[Copies],
               owned: Deferred) -> None:
        """Lay the copies out (`laid_out` says when, or how it failed), then make them."""
        try:
            copies = self.stager.layout(frozen, self._count, owned)
        except BaseException as e:
            laid_out.set_exception(e)
            raise
        into.append(copies)
        laid_out.set_result(None)
        try:
            self._copies.run(marks, copies.run)
            faults.hit("staging", step)
        except BaseException as e:
            copies.fail(e)
            raise
        copies.finish()

    def wait_for_staging(self) -> None:
        """Block until the last submitted state is staged (a staging failure is raised by
        `wait()`, with its step); with `verify`, check the deferred tensors first."""
        if self._staging is not None:
            wait_for([self._staging])
        check, self._check = self._check, []  # each save's tensors are compared once
        _compare(check, "the optimizer's step")

    def _sink(self) -> Sink:
        """Where the files go; the writer process is started, and one that died (its save failed
        and said so) replaced, here, on the training thread, which the process's life is tied to."""
        if not self._pinned:
            return write_files
        if self.writer is not None and not self.writer.alive:
            logger.warning("the checkpoint writer process is gone (exit code %s); starting a new one",
                           self.writer.exitcode)
            self.writer.close()
            self.writer = None
        if self.writer is None:
            self.writer = WriterProcess()
        return self.writer

    def in_flight(self) -> bool:
        """True while a background save is still being staged, written or committed (staging
        can end after the save: its thread marks the last copies made, then lets go of them)."""
        return any(f is not None and not f.done() for f in (self._pending, self._staging))

    def wait(self) -> None:
        """Block until the save in flight is committed, and its staging has stopped (a save
        that failed early may leave it copying into the arenas the next save reuses); raise
        the save's failure if it had one."""
        pending, staging = self._pending, self._staging
        wait_for([f for f in (pending, staging) if f is not None])  # interrupted: both still tracked
        self._pending, self._staging, check, self._check = None, None, self._check, []
        if pending is not None:
            pending.result()
        _compare(check, "the next save(), wait(), load() or close()")  # a save that did not fail

    def finish_at_exit(self) -> None:
        """A script that ends without `close()`: a save in flight is waited for (and its failure
        logged) before the interpreter stops thread pools, which the save still uses; then the
        writer process is stopped, before `multiprocessing`'s exit joins it (it ignores the
        SIGTERM sent first, and would wait for the pipe this process holds: forever)."""
        if self.in_flight():
            logger.warning("the interpreter is exiting with a save in flight (%s): waiting for it (close the "
                           "CheckpointManager to wait for it yourself)", self._path)
            try:
                self.wait()
            except Exception as e:
                logger.error("the save in flight at exit failed: %s%s", e,
                             _EXIT_THREADS_NOTE if _NO_THREADS_AT_EXIT and _no_thread_at_exit(e) else "")
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self.stager.release()
            if self.writer is not None:
                self.writer.close()
                self.writer = None

    def abandoner(self) -> Callable[[], None]:
        """What lets go of what `close` would, waiting for nothing, for an owner's finalizer (the
        owner collected unclosed): it holds what must be let go of (`_Held`), not this strategy,
        whose kept failure may hold the owner through the variables of the calls it went through."""
        return self._held.abandon


def _start_threads(pool: ThreadPoolExecutor, count: int) -> None:
    """Start the `count` threads of `pool` now: one started on demand by a `submit` could fail
    to start (a process at its limit of threads) after the work was queued, which then ran on
    the other thread all the same: a save said failed was committed."""
    started = threading.Barrier(count + 1)
    try:
        for _ in range(count):
            pool.submit(started.wait)  # each holds its thread until all have started
        started.wait()
    except BaseException:
        started.abort()
        raise


class _Held:
    """What a `BackgroundSaves` holds beyond its saves: its thread pool, its staging arenas and
    its writer process."""

    def __init__(self, pool: ThreadPoolExecutor, stager: Stager):
        self.pool, self.stager = pool, stager
        self.writer: WriterProcess | None = None

    def abandon(self) -> None:
        """Let go of them waiting for nothing: for an owner collected unclosed (no save of its can
        be in flight then, as a save holds its owner), inside a garbage collection on any thread,
        maybe while the exit's `finish_at_exit` closes the writer on another."""
        self.pool.shutdown(wait=False)
        self.stager.release()
        if (writer := self.writer) is not None:
            writer.stop()


def _take(laid_out: Future, copies: list[Copies], held: list[dict[str, Any]]) -> Staged:
    """The staged state once laid out, its copies still being made, taken out of `copies` so
    that the save alone holds it: a fresh copy (`async`) is freed on the save's thread once
    written, not by the next `save()` (unmapping a whole state's copy takes tens of ms). If it
    could not be laid out (no room in /dev/shm on this rank, a pinning refused), the state
    as frozen, whose every wait raises that failure: the save's write raises it inside DCP's
    protocol, where every rank hears of it, rather than this rank leaving the others waiting.
    `held`: the frozen state, let go of here."""
    frozen = held.pop()
    try:
        laid_out.result()
    except Exception as e:
        return _failed(e, frozen)
    del frozen
    taken = copies.pop()
    return Staged(taken.staged, taken.ready, taken.done, taken.wait_across if taken.counted else None)


_AT_EXIT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""The background saves the interpreter's exit finishes (`_wait_at_exit`), each with the pid of
the process that made it: one exit hook per process serves them all (one per manager stayed
registered after its `close()`)."""
_HOOKED: set[int] = set()
"""The processes whose exit hook is registered."""


def _wait_at_exit(saves: Any) -> None:
    """Have the interpreter's exit finish `saves` (`finish_at_exit`) before `concurrent.futures`
    stops taking work (its exit hook is registered the same way, earlier, and runs later) and
    before any `atexit` function (`multiprocessing` joins its children in one):
    `threading._register_atexit`, private, where this Python has it."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return
    pid = os.getpid()
    _AT_EXIT[saves] = pid
    if pid in _HOOKED:
        return
    _HOOKED.add(pid)

    def finish() -> None:  # a forked child (a data loader's worker) inherits the saves, not their threads
        for alive, made_in in list(_AT_EXIT.items()):
            if made_in == pid == os.getpid():
                alive.finish_at_exit()
    register(finish)


_SHARED_MEMORY = "/dev/shm"
"""Where torch's shared memory lives on Linux: a tmpfs of its own, often small in containers."""


def _no_shared_memory(size: int, error: Exception) -> str:
    """Why `size` bytes of staging arena could not be had, in words that send the reader to
    shared memory rather than to the checkpoint's disk, which the error's errno suggests."""
    try:
        stat = os.statvfs(_SHARED_MEMORY)
        room = (f"; {_SHARED_MEMORY} has {stat.f_bavail * stat.f_frsize / 1e9:.3f} GB free of "
                f"{stat.f_blocks * stat.f_frsize / 1e9:.3f} GB")
    except OSError:
        room = ""
    return (f"async_with_pinned_mem could not stage {size / 1e9:.3f} GB in shared memory ({error}){room}: give "
            f"the machine or container more (docker run --shm-size), or use checkpoint.async_mode = \"async\", "
            "which stages in the process's own memory")


def _log_failure(save: Future) -> None:
    """Say at once that a background save failed: the training loop hears of it only at its
    next `save()`, `wait()`, `load()` or `close()`, which may be an interval of hours away. Its
    text as of now (the record keeps no reference to the failure, whose frames may hold the
    staged state, nor sees what the raise adds to it later)."""
    if not save.cancelled() and (error := save.exception()) is not None:
        logger.error("%s (in the background; the next save(), wait(), load() or close() raises it)", str(error))


def _failed(error: Exception, state: dict[str, Any]) -> Staged:
    """`state`, staged for a save that cannot be made: every wait for its bytes raises `error`."""
    def failed(*_: Any) -> None:
        raise error
    return Staged(state, failed, failed)


def _at(state: Any, path: tuple) -> Any:
    for key in path:
        state = state[key]
    return state


def _compare(check: list[tuple[tuple, torch.Tensor, torch.Tensor]], until: str) -> None:
    """With `verify`: raise if a live tensor of `check` (path, live tensor, its staged copy)
    changed since `submit()`, `until` now (said in the message)."""
    for path, live, staged in check:
        if not same_bytes(live, staged):
            raise StagingMismatchError(
                f"{'.'.join(map(str, path))} changed between save() and {until}; the checkpoint would "
                "hold a mix of old and new values. Change the state only after the optimizer's step, "
                "or call maybe_wait_for_staging() first")


def make_strategy(async_mode: str, verify: bool = False, saves: bool = True) -> SynchronousSaves | BackgroundSaves:
    """The strategy for a validated `checkpoint.async_mode` (`verify`: `checkpoint.verify_staging`;
    `saves`: false for a job that only loads)."""
    if async_mode == "disabled":
        return SynchronousSaves()
    return BackgroundSaves(reuse_buffer=async_mode == "async_with_pinned_mem", verify=verify, saves=saves)
