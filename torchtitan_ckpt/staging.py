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
from .filewriter import Sink, write_files
from .writer_process import WriterProcess

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


def _copy_tensor(t: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    """A CPU copy of `t` (written into `into` when given), keeping a DTensor's placement."""
    if isinstance(t, DTensor):
        local = _copy_tensor(t.to_local(), None if into is None else into.to_local())
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    if into is None:
        return t.detach().to("cpu", copy=True)
    return into.copy_(t.detach())


class Stager:
    """Copies a state into CPU memory. With `reuse=True` the copies are kept and overwritten by
    the next save of a state with the same structure (no allocation once warm), in shared memory
    so the writer process reads them without a copy, and page-locked (pinned) where they receive
    GPU tensors, so those copies run at DMA speed."""

    def __init__(self, reuse: bool):
        self.reuse = reuse
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._pinned: dict[tuple, int] = {}  # path -> address registered with CUDA

    @property
    def nbytes(self) -> int:
        """Bytes held between saves."""
        return sum(_local(t).numel() * t.element_size() for t in self._buffers.values())

    def stage(self, state: Any, path: tuple = ()) -> Any:
        if isinstance(state, torch.Tensor):
            return self._stage_tensor(state, path)
        if isinstance(state, dict):
            return {k: self.stage(v, (*path, k)) for k, v in state.items()}
        if isinstance(state, (list, tuple)):
            return type(state)(self.stage(v, (*path, i)) for i, v in enumerate(state))
        return copy.deepcopy(state)

    def _stage_tensor(self, t: torch.Tensor, path: tuple) -> torch.Tensor:
        if not self.reuse:
            return _copy_tensor(t, None)
        old = self._buffers.get(path)
        fits = (old is not None and old.dtype == t.dtype and old.shape == t.shape
                and type(old) is type(t) and _local(old).shape == _local(t).shape)
        staged = _copy_tensor(t, old if fits else None)
        if not fits:
            self._unpin(path)
            _local(staged).share_memory_()
            self._buffers[path] = staged
            if _local(t).is_cuda:
                self._pin(path, _local(staged))
        return staged

    def _pin(self, path: tuple, buffer: torch.Tensor) -> None:
        size = buffer.untyped_storage().nbytes()
        if not size:
            return
        error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), size, 1))  # 1: portable
        if error:  # raised here: a CUDA error left pending would surface in unrelated code later
            raise RuntimeError(f"pinning a {size}-byte staging buffer failed (cudaError {error}); "
                               'checkpoint.async_mode = "async" stages without pinning')
        self._pinned[path] = buffer.data_ptr()

    def _unpin(self, path: tuple) -> None:
        if (address := self._pinned.pop(path, None)) is not None:
            torch.cuda.cudart().cudaHostUnregister(address)

    def release(self) -> None:
        """Drop every buffer (unpinning the pinned ones)."""
        for path in list(self._pinned):
            self._unpin(path)
        self._buffers.clear()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class BackgroundSaves:
    """Stage in `submit()`, then write and commit on a background thread.

    `async`: fresh CPU copies each save, files written by the background thread.
    `async_with_pinned_mem`: one long-lived shared-memory staging buffer, reused, and the files
    written by a separate writer process that reads that buffer (the background thread then
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
