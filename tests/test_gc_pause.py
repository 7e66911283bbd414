"""The cyclic garbage collector is paused while a save or a load builds DCP's objects, and is
back as it was afterwards (`gc_pause`)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan_ckpt import CheckpointManager, gc_pause
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.dcp import storage
from torchtitan_ckpt.io import filewriter


def test_no_collection_runs_during_a_save_or_a_load(tmp_path):
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(40)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 8)).sum().backward()
    opt.step()
    config = Checkpoint(enable=True, folder=str(tmp_path / "ck"), interval=1, last_save_model_only=False)
    collections: list[tuple[str, int]] = []
    phase = ["outside"]

    def seen(stage: str, info: dict) -> None:
        if stage == "start":
            collections.append((phase[0], info["generation"]))

    gc.callbacks.append(seen)
    try:
        with CheckpointManager(config, [model], opt) as manager:
            phase[0] = "save"
            manager.save(1)
            phase[0] = "load"
            assert manager.load(1)
            phase[0] = "outside"
        garbage = [[] for _ in range(5000)]
        for a, b in zip(garbage, garbage[1:]):
            a.append(b)
        del garbage
    finally:
        gc.callbacks.remove(seen)
    assert gc.isenabled()
    # at most the one collection the allocations made meanwhile trigger as the collector resumes
    # (a save of this model triggers dozens without the pause)
    assert sum(c[0] == "save" for c in collections) <= 1, collections
    assert sum(c[0] == "load" for c in collections) <= 1, collections
    assert any(c[0] == "outside" for c in collections), "the collector never ran: nothing was measured"


@contextlib.contextmanager
def _paused_on_another_thread() -> Iterator[None]:
    """The block runs while another thread is inside a pause."""
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with gc_pause.paused():
            inside.set()
            leave.wait(10)

    other = threading.Thread(target=hold)
    other.start()
    inside.wait(10)
    try:
        yield
    finally:
        leave.set()
        other.join(10)


def test_the_collector_resumes_when_the_last_holder_leaves_and_stays_off_if_it_was():
    assert gc.isenabled()
    with _paused_on_another_thread():
        with gc_pause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the other thread is still inside
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_pause.paused():
            pass
        assert not gc.isenabled()  # the program's choice stands
    finally:
        gc.enable()


def test_a_process_forked_during_a_pause_starts_with_the_collector_on():
    """A worker forked while a background save holds the pause would otherwise never collect."""
    with gc_pause.paused():
        assert not gc.isenabled()
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status, never return into pytest
            ok = gc.isenabled()
            with gc_pause.paused():  # the fresh lock and count work
                ok = ok and not gc.isenabled()
            ok = ok and gc.isenabled()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert not gc.isenabled()  # the parent's pause is untouched
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()


def test_a_pause_lifted_lets_the_collector_run_unless_another_holds_it():
    assert gc.isenabled()
    with gc_pause.lifted():  # outside any pause: nothing to lift
        assert gc.isenabled()
    with gc_pause.paused():
        with gc_pause.lifted():
            assert gc.isenabled()
        assert not gc.isenabled()
        with gc_pause.paused(), gc_pause.lifted():
            assert not gc.isenabled()  # this thread's other pause holds
    assert gc.isenabled()
    with _paused_on_another_thread(), gc_pause.lifted():
        assert not gc.isenabled()  # another thread's pause is not this thread's to lift
    assert gc.isenabled()


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_a_background_save_lets_the_collector_run_while_it_waits_for_the_disk(tmp_path, mode):
    """A background save paused the collector from its start to its commit: with a save at each
    step, the training loop's cyclic garbage waited for every save (hundreds of MB in a review's
    loop). Its commit, which waits until the data is durable, runs with the collector on."""
    commits: list[bool] = []
    handler = logging.Handler()
    handler.emit = lambda record: commits.append(gc.isenabled()) if record.msg.startswith("saved step") else None
    logger = logging.getLogger("torchtitan_ckpt.manager")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        config = Checkpoint(enable=True, folder=str(tmp_path / "ck"), interval=1, async_mode=mode)
        with CheckpointManager(config, [torch.nn.Linear(8, 8)]) as manager:
            for step in (1, 2):
                manager.save(step)
                manager.wait()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert commits == [True, True]


def test_a_writer_lets_the_collector_run_while_it_writes_its_bytes(tmp_path):
    """Within a save's pause, the data files' bytes and the wait for the staging copy, most of a
    background save's time, run with the collector on (`gc_pause.lifted`)."""
    seen: list[bool] = []

    def sink(jobs, step, sync):
        seen.append(gc.isenabled())
        return filewriter.write_files(jobs, step, sync)

    writer = storage.DataFileWriter(str(tmp_path), sink, step=1, staged=lambda: seen.append(gc.isenabled()))
    with gc_pause.paused():
        dcp.save({"w": torch.ones(4)}, storage_writer=writer, no_dist=True)
        assert not gc.isenabled()
    assert seen == [True, True]
