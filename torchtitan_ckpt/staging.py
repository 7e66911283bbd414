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

import contextlib
import functools
import logging
import multiprocessing.util
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from typing import Any

import torch

from . import faults, gc_pause
from .errors import ConfigError, StagingMismatchError, in_chain, no_thread
from .io.dtypes import same_bytes
from .io.filewriter import CountWait, Sink, write_files
from .io.stagers import (Copies, Deferred, FreshCopies, SharedArenas, Stager, copied_value, nothing_deferred,
                         tensors_of, traversed_list)

logger = logging.getLogger(__name__)

_NO_THREADS_AT_EXIT = (3, 12, 0) <= sys.version_info[:3] < (3, 12, 3)
"""Python 3.12.0-3.12.2 start no thread once the interpreter is exiting (CPython gh-113964,
fixed in 3.12.3), so a save still in flight at exit cannot finish there."""
_EXIT_THREADS_NOTE = (" (this Python, 3.12.0 to 3.12.2, starts no thread at exit: close the CheckpointManager "
                      "before the script ends, or use Python 3.12.3 or later)")


def _no_thread_at_exit(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from or during, is that refusal of a thread."""
    return in_chain(error, lambda e: isinstance(e, RuntimeError) and "interpreter shutdown" in str(e)) is not None

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

    def submit(self, state: dict[str, Any], job: SaveJob, deferred: Deferred = nothing_deferred) -> None:
        job.run(lambda: Staged(state))

    def in_flight(self) -> bool:
        return False

    def wait(self) -> None:
        """Nothing is ever in flight."""

    def settle(self) -> None:
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
    every other tensor is staged now where `stage_now` can (`SharedArenas.stage_now`), else cloned on
    its device (no host synchronisation), and every other value is deep-copied, so that nothing
    but a change to a deferred tensor reaches what is staged."""
    if isinstance(state, torch.Tensor):
        if deferred(path):
            return state
        staged = stage_now(path, state)
        return state.detach().clone() if staged is None else staged
    if isinstance(state, dict):
        return {k: freeze(v, deferred, (*path, k), stage_now) for k, v in state.items()}
    if traversed_list(state):
        return [freeze(v, deferred, (*path, i), stage_now) for i, v in enumerate(state)]
    if type(state) in _IMMUTABLE or type(state) is tuple and all(type(v) in _IMMUTABLE for v in state):
        return state
    return copied_value(state, path)


_IMMUTABLE = frozenset({int, float, bool, str, bytes, type(None)})
"""Leaf types `freeze` keeps as they are (and flat tuples of them, as Adam's `betas`): an
optimizer's settings are thousands of them."""


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
        devices = {t.device for _, t in tensors_of(state) if t.is_cuda}  # a DTensor's is its shard's
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

_SLOW_WAIT_S = 60.0
"""How long a caller waits for a background save before the log says so."""


class BackgroundSaves:
    """Stage, write and commit on a background thread; `submit()` returns before the copy. Where
    the copies go and who writes the files is the stager's (`io.stagers`: `async` or
    `async_with_pinned_mem`); with the writer process of the latter, the background thread
    only plans, waits and commits, so training keeps the GIL.

    With `verify=True` (`checkpoint.verify_staging`, a debug setting) staging is done inside
    `submit()` instead, and the first `wait_for_staging()` or `wait()` after it compares the
    deferred tensors with their staged copies: one changed in between (by anything but the
    optimizer's step, which the hook runs before) is a `StagingMismatchError` naming it."""

    def __init__(self, stager: Stager, verify: bool = False, saves: bool = True):
        self.stager = stager
        self._pool = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="ckpt-save")
        self._held = _Held(self._pool, stager)
        self._pending: Future | None = None
        self._staging: Future | None = None
        self._path = ""
        """The step folder of the last save submitted, for the log."""
        self._copies = _CopyStream()
        self._verify = verify
        self._check: list[tuple[tuple, torch.Tensor, torch.Tensor]] = []
        """(path, live tensor, its staged copy) for each deferred tensor, with `verify`."""
        try:
            _start_threads(self._pool, _THREADS)
            stager.start(saves)
        except BaseException as e:
            starved = isinstance(e, RuntimeError) and no_thread(e)
            self._pool.shutdown(wait=not starved)  # the threads started are idle: gone at once
            if not starved:
                raise
            raise ConfigError("checkpoint.async_mode", stager.mode,
                              f"its background saves need threads of their own, and this process may start no "
                              f"more ({e}): its limit of processes (`ulimit -u`, a container's pids limit) or of "
                              "memory for their stacks (`ulimit -v`) is reached; raise it, or save with "
                              "async_mode = 'disabled'") from e
        _wait_at_exit(self)

    def submit(self, state: dict[str, Any], job: SaveJob, deferred: Deferred = nothing_deferred) -> None:
        self.wait()
        self._path = job.path
        try:
            sink = self.stager.sink()
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
                self._check = [(path, t, _at(copies[0].staged, path)) for path, t in tensors_of(frozen)
                               if deferred(path)]
        held = [frozen]  # let go of once laid out: `freeze`'s clones are not kept for the whole save
        self._pending = self._pool.submit(job.run, lambda: _take(laid_out, copies, held), sink)
        self._pending.add_done_callback(_log_failure)

    def _stage(self, frozen: dict[str, Any], marks: dict, step: int, laid_out: Future, into: list[Copies],
               owned: Deferred) -> None:
        """Lay the copies out (`laid_out` says when, or how it failed), then make them."""
        try:
            copies = self.stager.layout(frozen, owned)
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

    def _wait_for(self, futures: list[Future]) -> None:
        """Block until `futures` are done, saying in the log after `_SLOW_WAIT_S` s, and again
        after twice as long each time, that the caller still waits: a writer process, file
        system or rank that is stuck would otherwise hold it in silence."""
        start, wait = time.monotonic(), _SLOW_WAIT_S
        while wait_for(futures, timeout=wait).not_done:
            staging, writer = self._staging, self.stager.writer
            logger.warning("waited %.0f s so far for the background save to %s, still being %s: slow, or held by "
                           "something stuck (a file system, a rank%s)", time.monotonic() - start, self._path,
                           "staged" if staging is not None and not staging.done() else "written or committed",
                           f", this rank's writer process (pid {writer.pid})" if writer is not None else "")
            wait *= 2

    def wait_for_staging(self) -> None:
        """Block until the last submitted state is staged (a staging failure is raised by
        `wait()`, with its step); with `verify`, check the deferred tensors first."""
        if self._staging is not None:
            self._wait_for([self._staging])
        check, self._check = self._check, []  # each save's tensors are compared once
        _compare(check, "the optimizer's step")

    def in_flight(self) -> bool:
        """True while a background save is still being staged, written or committed (staging
        can end after the save: its thread marks the last copies made, then lets go of them)."""
        return any(f is not None and not f.done() for f in (self._pending, self._staging))

    def wait(self) -> None:
        """Block until the save in flight is committed, and its staging has stopped (a save
        that failed early may leave it copying into the arenas the next save reuses); raise
        the save's failure if it had one."""
        pending, staging = self._pending, self._staging
        self._wait_for([f for f in (pending, staging) if f is not None])  # interrupted: both still tracked
        self._pending, self._staging, check, self._check = None, None, self._check, []
        if pending is not None:
            pending.result()
        _compare(check, "the next save(), wait(), load() or close()")  # a save that did not fail

    def settle(self) -> None:
        """Block until the save in flight has ended, raising nothing: its failure is logged, and
        raised by `wait()`."""
        self._wait_for([f for f in (self._pending, self._staging) if f is not None])

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
        self.stager.end_writes()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self.stager.release()  # first: stopping the writer may wait, and be interrupted
            self.stager.end_writes()

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
    """What a `BackgroundSaves` holds beyond its saves: its thread pool and its stager (with any
    arenas and writer process)."""

    def __init__(self, pool: ThreadPoolExecutor, stager: Stager):
        self.pool, self.stager = pool, stager

    def abandon(self) -> None:
        """Let go of them waiting for nothing: for an owner collected unclosed (no save of its can
        be in flight then, as a save holds its owner), inside a garbage collection on any thread,
        maybe while the exit's `finish_at_exit` closes the writer on another."""
        self.pool.shutdown(wait=False)
        self.stager.abandon()


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
    `threading._register_atexit`, private, where this Python has it. In a process that
    `multiprocessing` started (`torch.multiprocessing.spawn`'s ranks), which joins its children
    as its target returns, before those hooks: in a finalizer of its own, run first."""
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
    multiprocessing.util.Finalize(None, finish, exitpriority=_FINISH_FIRST)


_FINISH_FIRST = 100
"""The priority of the `multiprocessing` finalizer that finishes the saves in flight: among
the first to run (any value of at least 0 runs before the children are joined)."""


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
    return BackgroundSaves(SharedArenas() if async_mode == "async_with_pinned_mem" else FreshCopies(), verify, saves)
