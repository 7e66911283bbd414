"""How a save overlaps training: one strategy per `async_mode`, picked once.

A strategy receives the resolved state (plain nested dicts of tensors and values, taken at the
step being saved) and a `SaveJob`: the phases that prepare the step folder, write the state
through DCP and commit the step. Synchronous saving runs them in place. The asynchronous strategies first *stage* the state, i.e. copy every tensor into CPU
memory the training loop never touches, so `save()` can return while the copy is written in the
background; training may then update weights and optimizer state in place without changing what
is written (CPU tensors are copied too: aliasing them is how async DCP once wrote wrong data).

At most one save is in flight: `submit()` first waits for the previous one. A failure of the
background save is kept and raised by the next `submit()`, `wait()` or `close()`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import faults
from .io.filewriter import Sink, write_files
from .io.writer_process import WriterProcess

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class SaveJob:
    """One save, as phases that every rank runs in this order. Each raises `CheckpointSaveError`
    (naming the step) on any rank's failure, on every rank."""

    step: int
    path: str
    prepare: Callable[[], None]
    """Create the step folder (replacing a partial leftover)."""
    write: Callable[[dict[str, Any], Sink], Any]
    """Write the state with `dcp.save` (planning and collectives in this process; the data
    files' bytes through the sink); returns what `commit` needs (the files this rank wrote
    with their checksums, the dedup summary)."""
    commit: Callable[[Any], None]
    """Make the step visible (the commit marker), log it, apply retention."""

    def run(self, state: dict[str, Any], sink: Sink = write_files) -> None:
        self.prepare()
        self.commit(self.write(state, sink))


class SynchronousSaves:
    """`async_mode = "disabled"`: the training loop waits until the step is committed."""

    def submit(self, state: dict[str, Any], job: SaveJob) -> None:
        job.run(state)

    def in_flight(self) -> bool:
        return False

    def wait(self) -> None:
        """Nothing is ever in flight."""

    def close(self) -> None:
        """Nothing to shut down."""


def _copy_tensor(t: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """A CPU copy of `t` (written into `into`, `t`'s shape, when given), keeping a DTensor's
    placement."""
    local = _local(t).detach()
    copied = local.to("cpu", copy=True) if into is None else into.copy_(local)
    if isinstance(t, DTensor):
        return DTensor.from_local(copied, t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return copied


_ALIGN = 64
"""Bytes each staged tensor's place in an arena is aligned to (any dtype's, and a cache line)."""


@dataclass(frozen=True)
class _Place:
    """Where one tensor of the state is staged: `arena[offset:]`, with `strides`, for tensors
    matching `kind` (type, dtype, device type, local shape, strides)."""

    arena: torch.Tensor
    offset: int
    strides: tuple[int, ...]
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
        self._pinned: dict[int, torch.Tensor] = {}  # address registered with CUDA -> its arena

    @property
    def nbytes(self) -> int:
        """Bytes held between saves."""
        return sum(a.numel() for a in self._arenas().values())

    def _arenas(self) -> dict[int, torch.Tensor]:
        return {p.arena.data_ptr(): p.arena for p in self._places.values()}

    def stage(self, state: Any) -> Any:
        if self.reuse:
            new = {path: t for path, t in _tensors(state, ())
                   if path not in self._places or self._places[path].kind != _kind(t)}
            if new:
                self._allocate(new)
        return self._stage(state, ())

    def _stage(self, state: Any, path: tuple) -> Any:
        if isinstance(state, torch.Tensor):
            return self._stage_tensor(state, path)
        if isinstance(state, dict):
            return {k: self._stage(v, (*path, k)) for k, v in state.items()}
        if isinstance(state, (list, tuple)):
            return type(state)(self._stage(v, (*path, i)) for i, v in enumerate(state))
        return copy.deepcopy(state)

    def _stage_tensor(self, t: torch.Tensor, path: tuple) -> torch.Tensor:
        if not self.reuse:
            return _copy_tensor(t)
        local, place = _local(t), self._places[path]
        into = place.arena[place.offset:place.offset + local.nbytes].view(local.dtype)
        return _copy_tensor(t, into.as_strided(local.shape, place.strides))

    def _allocate(self, tensors: dict[tuple, torch.Tensor]) -> None:
        """One new arena with an aligned place for each of `tensors`; arenas left with no place
        in use are freed (unpinned first)."""
        offsets, size = {}, 0
        for path, t in tensors.items():
            offsets[path] = size
            size += -(-_local(t).nbytes // _ALIGN) * _ALIGN
        arena = torch.empty(size, dtype=torch.uint8).share_memory_()
        if any(_local(t).is_cuda for t in tensors.values()):
            self._pin(arena)
        for path, t in tensors.items():
            kind = _kind(t)
            self._places[path] = _Place(arena, offsets[path], kind[-1], kind)
        live = self._arenas()
        for address in [a for a in self._pinned if a not in live]:
            self._unpin(address)

    def _pin(self, arena: torch.Tensor) -> None:
        if not arena.numel():
            return
        error = int(torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 1))  # 1: portable
        if error:  # raised here: a CUDA error left pending would surface in unrelated code later
            raise RuntimeError(f"pinning a {arena.numel()}-byte staging buffer failed (cudaError {error}); "
                               'checkpoint.async_mode = "async" stages without pinning')
        self._pinned[arena.data_ptr()] = arena

    def _unpin(self, address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)
        del self._pinned[address]

    def release(self) -> None:
        """Drop every arena (unpinning the pinned ones)."""
        for address in list(self._pinned):
            self._unpin(address)
        self._places.clear()


def _tensors(state: Any, path: tuple):
    """(path, tensor) for every tensor of a nested state, in the order `Stager._stage` visits them."""
    if isinstance(state, torch.Tensor):
        yield path, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _tensors(v, (*path, k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from _tensors(v, (*path, i))


def _kind(t: torch.Tensor) -> tuple:
    """What a tensor's place must match to be reused: type, dtype, device type, local shape,
    and last the strides of its copy (its own when dense, as `empty_like` keeps them)."""
    local = _local(t)
    strides = local.stride() if local.is_contiguous() else torch.empty_like(local, device="meta").stride()
    return type(t), local.dtype, local.device.type, tuple(local.shape), tuple(strides)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class BackgroundSaves:
    """Stage in `submit()`, then write and commit on a background thread.

    `async`: fresh CPU copies each save, files written by the background thread.
    `async_with_pinned_mem`: long-lived shared-memory staging arenas, reused, and the files
    written by a separate writer process that reads them (the background thread then
    only plans, waits and commits, so training keeps the GIL)."""

    def __init__(self, reuse_buffer: bool):
        self.stager = Stager(reuse=reuse_buffer)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-save")
        self._pending: Future | None = None
        self.writer = WriterProcess() if reuse_buffer else None

    def submit(self, state: dict[str, Any], job: SaveJob) -> None:
        self.wait()
        sink = self._sink()
        staged = self.stager.stage(state)
        faults.hit("staging", job.step)
        self._pending = self._pool.submit(job.run, staged, sink)

    def _sink(self) -> Sink:
        """Where the files go; a writer process that died (its save failed and said so) is
        replaced here, on the training thread, which the new process's life is tied to."""
        if self.writer is None:
            return write_files
        if not self.writer.alive:
            logger.warning("the checkpoint writer process is gone (exit code %s); starting a new one",
                           self.writer.exitcode)
            self.writer.close()
            self.writer = WriterProcess()
        return self.writer.write

    def in_flight(self) -> bool:
        """True while a background save is still being written or committed."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its failure if it had one."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self.stager.release()
            if self.writer is not None:
                self.writer.close()


def make_strategy(async_mode: str) -> SynchronousSaves | BackgroundSaves:
    """The strategy for a validated `checkpoint.async_mode`."""
    if async_mode == "disabled":
        return SynchronousSaves()
    return BackgroundSaves(reuse_buffer=async_mode == "async_with_pinned_mem")
