"""Asynchronous saving: what is written is the state at save(), failures surface, semantics hold."""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import replace
from typing import NamedTuple

import pytest
import torch

from torchtitan_ckpt import CheckpointSaveError, layout, staging

from .helpers import ROOT, Holder, TensorState, assert_same, read_checkpoint
from .jobs import make_job

MODES = ["async", "async_with_pinned_mem"]


def _snapshot(job) -> dict[str, torch.Tensor]:
    """Model tensors and AdamW first moments, under the names the checkpoint uses."""
    out = {k: v.clone() for k, v in job.model.state_dict().items()}
    for name, p in job.model.named_parameters():
        out[f"optimizer.state.{name}.exp_avg"] = job.opt.state[p]["exp_avg"].clone()
    return out


@pytest.mark.parametrize("mode", MODES)
def test_background_save_holds_the_values_at_save_time(tmp_path, mode):
    job = make_job(str(tmp_path), steps=10, interval=2, async_mode=mode, keep_latest_k=0)
    for _ in range(2):
        job.step()
    before = _snapshot(job)
    assert job.manager.save(2)
    job.step()  # training goes on while the save is staged and written
    assert not torch.equal(job.model.output.weight, before["output.weight"])
    job.manager.wait()
    saved = read_checkpoint(layout.step_dir(os.path.join(tmp_path, "checkpoint"), 2))
    assert_same({k: saved[k] for k in before}, before)
    job.manager.close()


@pytest.mark.parametrize("mode", MODES)
def test_async_checkpoints_equal_synchronous_ones(tmp_path, mode):
    runs = {}
    for name, m in (("sync", "disabled"), ("bg", mode)):
        job = make_job(str(tmp_path / name), steps=6, interval=2, async_mode=m, keep_latest_k=0,
                       last_save_model_only=False)
        job.run_to(6, steps=6)  # training mutates in place right after every save()
        job.manager.close()
        runs[name] = os.path.join(tmp_path, name, "checkpoint")
    for step in (2, 4, 6):
        assert_same(read_checkpoint(layout.step_dir(runs["sync"], step)),
                    read_checkpoint(layout.step_dir(runs["bg"], step)))


def test_pinned_mode_reuses_its_buffer(tmp_path):
    job = make_job(str(tmp_path), steps=10, interval=1, async_mode="async_with_pinned_mem")
    job.run_to(2, steps=10)
    stager = job.manager._saves.stager  # noqa: SLF001 - the buffer is the point of this mode
    places = {path: p.view.data_ptr() for path, p in stager._places.items()}  # noqa: SLF001
    assert stager.nbytes >= sum(t.numel() * t.element_size() for t in _snapshot(job).values())
    job.run_to(4, steps=10)
    assert {path: p.view.data_ptr() for path, p in stager._places.items()} == places  # noqa: SLF001
    job.manager.close()


def _stage(stager, state):
    copies = stager.layout(state)
    copies.run()
    return copies.staged


def test_staging_moves_only_the_tensors_that_changed_and_needs_no_copy_to_write():
    from torchtitan_ckpt.io.filewriter import exact_storage
    from torchtitan_ckpt.io.stagers import SharedArenas

    stager = SharedArenas()
    state = {"w": torch.randn(64, 64), "t": torch.randn(8, 16).t(), "scalar": torch.tensor(2.0),
             "empty": torch.zeros(0, 3), "pos": torch.arange(5, dtype=torch.uint8), "step": 3}
    first = _stage(stager, state)
    assert_same(first, state)
    assert first["t"].stride() == state["t"].stride()
    arena = {v.untyped_storage().data_ptr() for v in first.values() if isinstance(v, torch.Tensor) and v.numel()}
    assert len(arena) == 1 and first["w"].is_shared()
    size = stager.nbytes

    state["pos"] = torch.arange(7, dtype=torch.uint8)  # a dataloader position of another length
    second = _stage(stager, state)
    assert_same(second, state)
    assert second["w"].data_ptr() == first["w"].data_ptr() and second["t"].data_ptr() == first["t"].data_ptr()
    assert second["pos"].untyped_storage().data_ptr() not in arena  # a small arena of its own
    assert size < stager.nbytes <= size + 64
    for value in second.values():  # the writer writes each straight from its arena
        if isinstance(value, torch.Tensor) and value.numel():
            exact = exact_storage(value, copy=False)
            assert exact is not None and exact.data_ptr() == value.data_ptr()
            assert exact.untyped_storage().nbytes() == value.numel() * value.element_size()

    state = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in state.items()}
    third = _stage(stager, state)  # every tensor but pos changed: the first arena is freed
    assert_same(third, state)
    doubles = sum(-(-state[k].numel() * 8 // 64) * 64 for k in ("w", "t", "scalar", "empty"))
    assert stager.nbytes == doubles + 64  # the new arena and pos's; the first one is gone


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_pinned_mode_needs_no_open_file_per_tensor(tmp_path):
    """2400 tensors (800 parameters and their AdamW moments) are staged and written by the
    writer process with a few open files in either process, not one per tensor (past common
    `ulimit -n` limits of 1024; 4005 open files before the arena), and load back exactly."""
    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(400)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    config = Checkpoint(enable=True, interval=1, async_mode="async_with_pinned_mem", keep_latest_k=0)
    folder = str(tmp_path)
    before = _open_files(os.getpid())
    with CheckpointManager(config, [model], optimizers=opt, base_folder=folder) as manager:
        for step in (1, 2):
            manager.save(step)
            manager.wait()
            assert _open_files(os.getpid()) - before < 50
            assert _open_files(manager._saves.stager.writer._proc.pid) < 50  # noqa: SLF001 - what it holds open
    saved = read_checkpoint(layout.step_dir(os.path.join(folder, "checkpoint"), 2))
    assert_same({k: saved[k] for k in model.state_dict()}, model.state_dict())
    moments = {f"optimizer.state.{name}.exp_avg_sq": opt.state[p]["exp_avg_sq"] for name, p in model.named_parameters()}
    assert_same({k: saved[k] for k in moments}, moments)


class _Unwritable:
    """A train state whose value cannot be serialised: the background write fails."""

    def __init__(self, key: str = "value"):
        self.fail = False
        self.key = key

    def state_dict(self):
        return {self.key: (lambda: None) if self.fail else 1}

    def load_state_dict(self, sd):
        pass


@pytest.mark.parametrize("mode", MODES)
def test_background_failure_surfaces_with_its_step(tmp_path, mode):
    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    model = torch.nn.Linear(4, 4)
    state = _Unwritable()
    manager = CheckpointManager(Checkpoint(enable=True, interval=1, async_mode=mode), [model],
                                states={"extra": state}, base_folder=str(tmp_path))
    manager.save(1)
    state.fail = True
    manager.save(2)  # returns: the write fails in the background
    with pytest.raises(CheckpointSaveError,  # "Can't pickle local object", or in Python 3.13 "Can't get ..."
                       match=r"saving step 2 to .*step-2 failed: .*local object '_Unwritable.state_dict.<locals>"):
        manager.save(3)  # the failure is raised, once, and this save is not made
    state.fail = False
    manager.save(3)
    manager.close()
    folder = os.path.join(tmp_path, "checkpoint")
    # step 2 never became visible, and its leftover is removed once step 3 is committed
    assert [(s.step, s.committed) for s in layout.scan(folder)] == [(1, True), (3, True)]


@pytest.mark.parametrize("mode", MODES)
def test_a_staging_copy_failing_in_the_background_fails_its_save_and_the_next_goes_on(tmp_path, mode, monkeypatch):
    """The copy runs after `save()` returned (no `verify_staging`): one failing (host memory, a
    device error) ends the count the write waits on, so the save fails instead of waiting for
    copies that never come, and the job's next save is made."""
    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint
    from torchtitan_ckpt.io import stagers

    def failing(self):
        raise MemoryError("injected: no memory for the staging copy")

    with CheckpointManager(Checkpoint(enable=True, interval=1, async_mode=mode, keep_latest_k=0),
                           [torch.nn.Linear(64, 64)], base_folder=str(tmp_path)) as manager:
        manager.save(1)
        manager.wait()
        monkeypatch.setattr(stagers.Copies, "run", failing)
        assert manager.save(2)
        with pytest.raises(CheckpointSaveError, match=r"saving step 2 to .*step-2 failed: MemoryError: injected"):
            manager.wait()
        monkeypatch.undo()
        manager.save(3)
    assert layout.committed_steps(os.path.join(tmp_path, "checkpoint")) == [1, 3]


def test_a_save_the_writer_process_could_not_be_sent_fails_and_the_next_starts_a_new_writer(tmp_path):
    """The pipe to the writer process broke while a save's files were sent: what the writer read
    of the message is unknown, so it is stopped, that save fails, and the next save starts
    another writer and is made."""
    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    with CheckpointManager(Checkpoint(enable=True, interval=1, async_mode="async_with_pinned_mem", keep_latest_k=0),
                           [torch.nn.Linear(64, 64)], base_folder=str(tmp_path)) as manager:
        manager.save(1)
        manager.wait()
        writer = manager._saves.stager.writer  # noqa: SLF001 - the pipe to it is what breaks
        first, conn = writer._proc.pid, writer._conn  # noqa: SLF001

        def broken(message) -> None:
            del conn.send_bytes  # once
            raise BrokenPipeError(32, "Broken pipe")

        conn.send_bytes = broken
        manager.save(2)
        with pytest.raises(CheckpointSaveError, match=r"saving step 2 to .*step-2 failed"):
            manager.wait()
        manager.save(3)
        manager.wait()
        assert manager._saves.stager.writer._proc.pid != first  # noqa: SLF001
    assert layout.committed_steps(os.path.join(tmp_path, "checkpoint")) == [1, 3]


def test_close_waits_for_the_save_in_flight(tmp_path):
    job = make_job(str(tmp_path), steps=10, interval=3, async_mode="async")
    job.run_to(3, steps=10)
    job.manager.close()
    assert layout.committed_steps(os.path.join(tmp_path, "checkpoint")) == [3]


@pytest.mark.parametrize("mode", MODES)
def test_the_saved_line_tells_the_wait_for_the_save_before_apart_from_the_save(tmp_path, mode, caplog, monkeypatch):
    """The clock of a save started before `save()` waited for the save in flight, so saves
    coming faster than the disk took them read as slow saves, and the wait itself, which is
    what training loses, was told nowhere."""
    import time

    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    commit = CheckpointManager._commit

    def slow_first(self, step, *args):  # a disk slower than the interval: step 1 is in flight at save(2)
        if step == 1:
            time.sleep(0.5)
        return commit(self, step, *args)

    monkeypatch.setattr(CheckpointManager, "_commit", slow_first)
    manager = CheckpointManager(Checkpoint(enable=True, interval=1, async_mode=mode, keep_latest_k=0),
                                [torch.nn.Linear(4, 4)], base_folder=str(tmp_path))
    with caplog.at_level("INFO", logger="torchtitan_ckpt"):
        manager.save(1)
        manager.save(2)
        manager.close()
    saved = {int(r.getMessage().split()[2]): r.getMessage() for r in caplog.records
             if r.getMessage().startswith("saved step")}
    assert "waited" not in saved[1], saved[1]
    assert re.search(r" s on it\); save\(\) first waited \d+\.\d\d s for the save before it$", saved[2]), saved[2]
    # and what of a background save's time the training spent: save() itself, not the commit's 0.5 s
    spent = re.search(r"[0-9.]+ KB in ([0-9.]+) s, [0-9.]+ GB/s, in the background \(the training thread spent "
                      r"([0-9.]+) s on it\)", saved[1])
    assert spent and float(spent[2]) < 0.5 <= float(spent[1]), saved[1]


def _failing_rank_1(rank: int, world_size: int, folder: str, mode: str) -> None:
    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    state = _Unwritable(key=f"rank{rank}")  # not replicated: each rank writes its own
    model = torch.nn.Linear(4, 4)
    with CheckpointManager(Checkpoint(enable=True, interval=1, async_mode=mode), [model],
                           states={"extra": state}, base_folder=folder) as manager:
        manager.save(1)
        state.fail = rank == 1  # only rank 1's background write breaks
        manager.save(2)
        with pytest.raises(CheckpointSaveError, match="saving step 2 to .*step-2 failed" + (" on rank 1" if rank == 0 else "")
                           + r": CheckpointError: state value 'extra.rank1' \(function\) cannot be saved"):
            manager.wait()  # ... and every rank hears of it, naming the rank
    assert layout.committed_steps(os.path.join(folder, "checkpoint")) == [1]


@pytest.mark.multirank
def test_a_failure_on_one_rank_reaches_every_rank(tmp_path):
    from .helpers import spawn

    spawn(2, _failing_rank_1, str(tmp_path), "async")


@pytest.mark.parametrize("async_mode", ["async", "async_with_pinned_mem"])
def test_training_held_by_a_stuck_save_is_told_in_the_log(tmp_path, caplog, monkeypatch, async_mode):
    """A save that keeps training waiting (its writer process stopped, or its file written held
    up here) is named in the log each `_SLOW_WAIT_S` s while it does, and the save ends
    committed once it goes on."""
    import signal
    import threading
    import time

    from torchtitan_ckpt.io import filewriter

    monkeypatch.setattr(staging, "_SLOW_WAIT_S", 0.1)  # told after 0.1, 0.3, 0.7 s
    job = make_job(str(tmp_path), steps=10, interval=1, async_mode=async_mode, keep_latest_k=0)
    job.run_to(1, steps=10)
    job.manager.wait()
    writer = job.manager._saves.stager.writer  # noqa: SLF001 - the writer process is what is held
    held, release = threading.Event(), threading.Event()
    if writer is None:  # written on a thread of this process: the file's write is held
        write = filewriter.write_files

        def held_write(*args, **kwargs):
            held.set()
            release.wait(60)
            return write(*args, **kwargs)
        monkeypatch.setattr(job.manager._saves.stager, "sink", lambda: held_write)  # noqa: SLF001
    job.step()
    waited: list[BaseException | None] = []

    def wait() -> None:
        try:
            job.manager.wait()
            waited.append(None)
        except BaseException as e:
            waited.append(e)
    told: list[str] = []
    caplog.clear()  # the first save may have waited for the writer process to start
    with caplog.at_level("WARNING", logger="torchtitan_ckpt.staging"):
        if writer is not None:
            os.kill(writer.pid, signal.SIGSTOP)
        try:
            assert job.manager.save(2)
            waiting = threading.Thread(target=wait)
            waiting.start()
            deadline = time.monotonic() + 60
            while len(told) < 2 and time.monotonic() < deadline:
                told = [r.getMessage() for r in caplog.records if "so far for the background save" in r.getMessage()]
                time.sleep(0.05)
        finally:
            if writer is not None:
                os.kill(writer.pid, signal.SIGCONT)
            release.set()
        waiting.join(60)
    assert waited == [None]
    assert len(told) >= 2 and all("step-2, still being written or committed: slow, or held by" in m for m in told), told
    assert all(f"writer process (pid {writer.pid})" in m for m in told) if writer is not None else held.is_set()
    assert layout.committed_steps(os.path.join(tmp_path, "checkpoint")) == [1, 2]
    job.manager.close()


def test_pinned_mode_writes_in_its_own_process_and_survives_losing_it(tmp_path):
    """The files are written by a writer process; when it dies, the save in flight fails naming
    its step, the previous step stays loadable, and the next save starts a new writer."""
    import signal

    job = make_job(str(tmp_path), steps=10, interval=1, async_mode="async_with_pinned_mem", keep_latest_k=0)
    saves = job.manager._saves  # noqa: SLF001 - the writer process is what is under test
    job.run_to(1, steps=10)
    job.manager.wait()
    writer = saves.stager.writer
    assert writer.alive and writer._proc.pid != os.getpid()  # noqa: SLF001
    os.kill(writer._proc.pid, signal.SIGKILL)  # noqa: SLF001 - e.g. the OOM killer
    writer._proc.join()  # noqa: SLF001
    job.step()
    # the dead writer is noticed before the save and replaced, so this save works
    assert job.manager.save(2)
    job.manager.wait()
    assert saves.stager.writer is not writer and saves.stager.writer.alive
    folder = os.path.join(tmp_path, "checkpoint")
    assert layout.committed_steps(folder) == [1, 2]

    # a writer killed while it holds a save: that save fails, with its step
    job.step()
    os.kill(saves.stager.writer._proc.pid, signal.SIGSTOP)  # noqa: SLF001 - hold it mid-save ...
    assert job.manager.save(3)
    os.kill(saves.stager.writer._proc.pid, signal.SIGKILL)  # noqa: SLF001 - ... then kill it
    with pytest.raises(CheckpointSaveError, match="saving step 3 to .*step-3 failed.*writer process exited"):
        job.manager.wait()
    assert layout.committed_steps(folder) == [1, 2]
    saved = read_checkpoint(layout.step_dir(folder, 2))  # the previous step is intact
    assert saved.keys() >= set(job.model.state_dict())
    job.step()
    assert job.manager.save(4)
    job.manager.close()
    assert layout.committed_steps(folder) == [1, 2, 4]


def test_the_writer_process_dies_with_its_rank(tmp_path):
    """A rank killed without any cleanup takes its writer process with it (no orphan left to
    write into a folder a restarted job is using)."""
    import signal
    import subprocess
    import sys
    import time

    script = ("import sys, time\n"
              "from torchtitan_ckpt.io.writer_process import WriterProcess\n"
              "if __name__ == '__main__':\n"
              "    w = WriterProcess()\n"
              "    w([])\n"  # a round trip: the writer is up and tied to this process
              "    print(w._proc.pid, flush=True)\n"
              "    time.sleep(120)\n")
    path = tmp_path / "rank.py"
    path.write_text(script)
    rank = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    writer_pid = int(rank.stdout.readline())
    os.kill(writer_pid, signal.SIGSTOP)  # busy or stopped, it cannot notice the closed pipe itself
    os.kill(rank.pid, signal.SIGKILL)
    rank.wait()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and os.path.exists(f"/proc/{writer_pid}"):
            try:
                with open(f"/proc/{writer_pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # a zombie has exited
                        break
            except FileNotFoundError:  # reaped between the two looks
                break
            time.sleep(0.05)
        else:
            assert not os.path.exists(f"/proc/{writer_pid}"), "the writer outlived its rank"
    finally:
        if os.path.exists(f"/proc/{writer_pid}"):
            os.kill(writer_pid, signal.SIGKILL)


def _staging_fails_on_rank_1(rank: int, world_size: int, folder: str) -> None:
    """Staging fails on rank 1 only: laying the copies out (pinned: a sparse tensor has no
    strides to give its place), or copying (`verify_staging`, where `save()` waits for staging:
    a tensor with no data). Both ranks get the save's error, naming the cause, from the save's
    write, and the next save finds the ranks in step; before, rank 1 left the save before DCP's
    collectives and rank 0 waited in them until the timeout."""
    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    cases = [("async_with_pinned_mem", False, lambda: torch.ones(4).to_sparse(), "sparse"),
             ("async", True, lambda: torch.empty(4, device="meta"), "meta")]
    for mode, verify, bad, cause in cases:
        state, sub = TensorState(torch.ones(4)), os.path.join(folder, mode)
        config = Checkpoint(enable=True, interval=1, async_mode=mode, verify_staging=verify, keep_latest_k=0,
                            collective_timeout_s=60)
        with CheckpointManager(config, [torch.nn.Linear(4, 4)], states={"extra": state}, base_folder=sub) as manager:
            manager.save(1)
            if rank == 1:
                state.value = bad()  # a tensor staging cannot copy
            manager.save(2)
            with pytest.raises(CheckpointSaveError, match=f"saving step 2 to .*step-2 failed.*{cause}"):
                manager.wait()
            state.value = torch.ones(4)
            manager.save(3)
        assert layout.committed_steps(os.path.join(sub, "checkpoint")) == [1, 3], mode


@pytest.mark.multirank
def test_a_staging_failure_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    from .helpers import spawn

    spawn(2, _staging_fails_on_rank_1, str(tmp_path))


def _writer_of_rank_1_dies_mid_save(rank: int, world_size: int, folder: str) -> None:
    import signal

    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    model = torch.nn.Linear(64, 64)
    config = Checkpoint(enable=True, interval=1, async_mode="async_with_pinned_mem")
    with CheckpointManager(config, [model], base_folder=folder) as manager:
        manager.save(1)
        manager.wait()
        writer = manager._saves.stager.writer  # noqa: SLF001 - its death is the failure under test
        if rank == 1:
            os.kill(writer._proc.pid, signal.SIGSTOP)  # noqa: SLF001 - hold the save ...
        manager.save(2)
        if rank == 1:
            os.kill(writer._proc.pid, signal.SIGKILL)  # noqa: SLF001 - ... and lose the writer
        with pytest.raises(CheckpointSaveError, match="saving step 2 to .*step-2 failed"):
            manager.wait()  # on both ranks: rank 0's own writer was fine
    assert layout.committed_steps(os.path.join(folder, "checkpoint")) == [1]


@pytest.mark.multirank
def test_a_writer_process_lost_on_one_rank_fails_the_step_on_every_rank(tmp_path):
    from .helpers import spawn

    spawn(2, _writer_of_rank_1_dies_mid_save, str(tmp_path))


class _ValueState:
    """A user state of one value that DCP pickles whole (a tuple holding a tensor, a named tuple)."""

    def __init__(self, value):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = sd["value"]


class _Position(NamedTuple):
    """Built from its fields, not from one iterable."""

    step: int
    seen: int


@pytest.mark.parametrize("mode", ["disabled", *MODES])
def test_a_value_pickled_whole_is_saved_as_it_is_in_every_mode(tmp_path, mode):
    """A tuple holding a tensor is one pickled value to DCP: staged as a view of the pinned
    buffer, it carried the whole buffer into the step (4 bytes became the model's size); a
    tuple type that is not built from one iterable failed the async modes while staged (a
    save of it now fails naming it, as no load reads a class of the job's own:
    test_states)."""
    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    model = torch.nn.Linear(512, 512)  # 1 MiB of parameters
    states = {"rng": _ValueState((torch.arange(4, dtype=torch.uint8), 1)), "pos": _ValueState(_Position(3, 7))}
    config = Checkpoint(enable=True, interval=1, async_mode=mode, keep_latest_k=0)
    with CheckpointManager(config, [model], states=states, base_folder=str(tmp_path)) as manager:
        with pytest.raises(CheckpointSaveError, match=r"state value 'pos.value' \(tests.test_async._Position\) would "
                                                      r"be refused by every load"):
            manager.save(1)
            manager.wait()
        states["pos"].value = 7
        manager.save(1)
    step = layout.step_dir(os.path.join(tmp_path, "checkpoint"), 1)
    size = sum(os.path.getsize(os.path.join(step, f)) for f in os.listdir(step))
    params = sum(p.nbytes for p in model.parameters())
    assert size < params * 1.1, (size, params)
    loaded = {"rng": _ValueState(None)}
    with CheckpointManager(config, [torch.nn.Linear(512, 512)], states=loaded, base_folder=str(tmp_path)) as manager:
        assert manager.load()
    assert torch.equal(loaded["rng"].value[0], torch.arange(4, dtype=torch.uint8)) and loaded["rng"].value[1] == 1


class _FailingOnRank1:
    def __init__(self, rank: int):
        self.rank = rank

    def state_dict(self) -> dict:
        if self.rank == 1:
            raise RuntimeError("the data loader's state is gone on rank 1")
        return {"position": 3}

    def load_state_dict(self, sd: dict) -> None:
        pass


def _state_fails_on_rank_1(rank: int, world_size: int, folder: str) -> None:
    import time

    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    for mode in ["disabled", *MODES]:
        sub = os.path.join(folder, mode)
        config = Checkpoint(enable=True, interval=1, async_mode=mode, keep_latest_k=0, collective_timeout_s=120)
        with CheckpointManager(config, [torch.nn.Linear(4, 4)], states={"extra": _FailingOnRank1(rank)},
                               base_folder=sub) as manager:
            start = time.monotonic()
            with pytest.raises(CheckpointSaveError, match="saving step 1 to .*step-1 failed.*state is gone on rank 1"):
                manager.save(1)
                manager.wait()
            assert time.monotonic() - start < 60, mode  # heard at once, not at the collective's timeout
        assert layout.committed_steps(os.path.join(sub, "checkpoint")) == [], mode


@pytest.mark.multirank
def test_a_state_that_fails_on_one_rank_fails_the_save_on_every_rank_at_once(tmp_path):
    """A user state whose `state_dict()` raises on one rank: every rank's save fails with it in
    the save's first round, in every mode (the other rank waited in that round for the
    collective timeout, then its next save paired with this rank's earlier one)."""
    from .helpers import spawn

    spawn(2, _state_fails_on_rank_1, str(tmp_path))


def test_the_writer_process_ignores_the_signals_a_terminal_sends_the_job(tmp_path):
    """Ctrl-C reaches every process of the foreground group: the writer process ignores it,
    so the save in flight completes as the rank decides (it died, and the save with it)."""
    import signal

    job = make_job(str(tmp_path), steps=10, interval=1, async_mode="async_with_pinned_mem", keep_latest_k=0)
    job.run_to(1, steps=10)
    job.manager.wait()
    writer = job.manager._saves.stager.writer  # noqa: SLF001 - the writer process is what is under test
    for sig in (signal.SIGINT, signal.SIGTERM):
        os.kill(writer._proc.pid, sig)  # noqa: SLF001
    job.step()
    assert job.manager.save(2)
    job.manager.wait()
    assert job.manager._saves.stager.writer is writer and writer.alive  # noqa: SLF001
    job.manager.close()
    assert layout.committed_steps(os.path.join(tmp_path, "checkpoint")) == [1, 2]


_SIGNALS_AS_THE_WRITER_STARTS = """
import os, signal, sys, torch
from torchtitan_ckpt import CheckpointManager, layout
from torchtitan_ckpt.config import Checkpoint
config = Checkpoint(enable=True, interval=1, async_mode="async_with_pinned_mem")
with CheckpointManager(config, [torch.nn.Linear(4, 4)], base_folder=sys.argv[1]) as manager:
    manager.save(1)  # the first save starts the writer, which imports torch for seconds
    writer = manager._saves.stager.writer._proc.pid
    os.kill(writer, signal.SIGINT)  # as a terminal's Ctrl-C reaches every process of the job
    os.kill(writer, signal.SIGTERM)
    manager.wait()
print(layout.committed_steps(os.path.join(sys.argv[1], "checkpoint")))
"""


def test_the_writer_process_ignores_the_signals_of_the_job_from_its_start(tmp_path):
    """multiprocessing's resource tracker, started by the process's first spawn, unblocked SIGINT
    and SIGTERM on the thread that starts writers: a Ctrl-C killed the first writer while it
    imported torch, and the save in flight (a preemption's) with it. A process of its own: the
    tracker starts once per process."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", _SIGNALS_AS_THE_WRITER_STARTS, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert run.returncode == 0 and run.stdout.splitlines() == ["[1]"], run.stderr[-3000:]


_CTRL_C_AGAIN_AND_AGAIN_IN_CLOSE = """
import signal, sys, time, torch
from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.storage import lock
commit = CheckpointManager._commit
def slow(self, step, *args):  # a disk slower than the user's patience
    time.sleep(1.5)
    return commit(self, step, *args)
CheckpointManager._commit = slow
manager = CheckpointManager(Checkpoint(enable=True, interval=1, async_mode="async"), [torch.nn.Linear(4, 4)],
                            base_folder=sys.argv[1])
manager.save(1)
def interrupt(*_):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, interrupt)
signal.setitimer(signal.ITIMER_REAL, 0.2, 0.2)
try:
    manager.close()
except KeyboardInterrupt:
    signal.setitimer(signal.ITIMER_REAL, 0)
    print(manager.save_in_flight, lock.held(manager._store._lock))
"""


def test_close_interrupted_again_and_again_keeps_the_folder_held_while_the_save_goes_on(tmp_path):
    """Ctrl-C pressed again while `close()` waited for the save in flight: close() let go of the
    folder's lock (and the checkpoint group) while the save was still written, which the exit
    then waited for; a job started meanwhile could have saved beside it."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", _CTRL_C_AGAIN_AND_AGAIN_IN_CLOSE, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert run.returncode == 0 and run.stdout.splitlines() == ["True True"], run.stdout + run.stderr[-3000:]
    assert layout.committed_steps(os.path.join(tmp_path, "checkpoint")) == [1]  # the exit waited for it


_EXITS_WITHOUT_CLOSE = """
import gc, sys, threading, torch
from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import Checkpoint
mode, how, folder = sys.argv[1:]
config = Checkpoint(enable=True, interval=1, async_mode=mode, save_threads=2, keep_latest_k=0)
managers = []
def train():
    managers.append(CheckpointManager(config, [torch.nn.Linear(1024, 1024)], base_folder=folder))
    managers[0].save(1)
    if how == "in_a_thread":  # the writer process takes the second save (the first starts it)
        managers[0].wait()
        managers[0].save(2)
if how == "in_a_thread":  # a notebook's, a service's: the thread that made the manager ends first
    thread = threading.Thread(target=train)
    thread.start()
    thread.join()
else:
    train()
if how not in ("in_flight", "in_a_thread"):
    managers[0].wait()
if how == "dropped":  # the manager is gone, its writer process is not
    managers.clear()
    gc.collect()
sys.exit(0)  # no close(): with "in_flight", the save is still in flight
"""


@pytest.mark.parametrize("how", ["in_flight", "saved", "dropped", "in_a_thread"])
@pytest.mark.parametrize("mode", MODES)
def test_a_script_that_exits_with_a_save_in_flight_still_commits_it(tmp_path, mode, how):
    """The save is waited for at exit, before the interpreter's thread pools stop taking work
    (with two writer threads, the save was left partial and nothing said so), and the exit
    then stops the writer process (`multiprocessing`'s exit waited for it forever), that of a
    manager dropped without `close()` too (its exit hook went with it). A manager made on a
    thread that ended before the exit kept its writer process (the kernel killed it with that
    thread, and the save in flight with it)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", _EXITS_WITHOUT_CLOSE, mode, how, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert run.returncode == 0, run.stderr
    if how in ("in_flight", "in_a_thread") and staging._NO_THREADS_AT_EXIT:  # noqa: SLF001 - CPython gh-113964
        assert "starts no thread at exit: close the CheckpointManager" in run.stderr
        assert layout.committed_steps(os.path.join(tmp_path, "checkpoint")) == [1][:how == "in_a_thread"], run.stderr
        return
    assert layout.committed_steps(os.path.join(tmp_path, "checkpoint")) == [1, 2][:1 + (how == "in_a_thread")], \
        run.stderr


_ENDS_IN_A_CHILD = """
import multiprocessing, sys, torch
from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import Checkpoint
def train(how, folder):
    config = Checkpoint(enable=True, interval=1, async_mode="async_with_pinned_mem", keep_latest_k=0)
    manager = CheckpointManager(config, [torch.nn.Linear(1024, 1024)], base_folder=folder)
    manager.save(1)
    if how == "raises":  # the frames of its traceback keep the manager
        raise RuntimeError("the training failed")
if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=train, args=sys.argv[1:])
    child.start()
    child.join(90)
    print("exit code", child.exitcode)
    child.kill()
"""


@pytest.mark.parametrize("how", ["returns", "raises"])
def test_a_process_multiprocessing_started_exits_with_its_manager_unclosed(tmp_path, how):
    """A rank `torch.multiprocessing.spawn` or a `Process` runs whose manager is not closed:
    `multiprocessing` ends such a process by joining its children before the interpreter's exit
    hooks run, and the writer process, which ignores the SIGTERM sent first, was waited for
    forever. Its save in flight is finished and the writer stopped first."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_ENDS_IN_A_CHILD)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, str(script), how, str(tmp_path)], capture_output=True, text=True,
                         timeout=150, env={**os.environ, "PYTHONPATH": root})
    assert run.stdout.splitlines() == [f"exit code {int(how == 'raises')}"], run.stdout + run.stderr[-3000:]
    assert layout.committed_steps(os.path.join(tmp_path, "checkpoint")) == [1], run.stderr


_IN_A_POOL = """
import multiprocessing, sys, threading, torch
from torchtitan_ckpt import CheckpointManager, ConfigError
from torchtitan_ckpt.config import Checkpoint
def trial(mode):
    config = Checkpoint(enable=True, interval=1, async_mode=mode, folder=sys.argv[1] + "/" + mode)
    try:
        with CheckpointManager(config, [torch.nn.Linear(2, 2)]) as manager:
            manager.save(1)
        said = "saved"
    except ConfigError as e:
        said = str(e)
    return said, sorted(t.name for t in threading.enumerate() if t.name.startswith("ckpt-"))
if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # a sweep's worker: a daemonic process
        for said, threads in pool.map(trial, ["async_with_pinned_mem", "async"]):
            print(said, threads)
"""


def test_a_daemonic_process_is_told_it_cannot_start_the_writer_process(tmp_path):
    """A `multiprocessing.Pool`'s worker (a hyper-parameter sweep's) may start no process:
    `async_with_pinned_mem` failed there on `multiprocessing`'s bare AssertionError, leaving its
    threads running."""
    import subprocess
    import sys

    script = tmp_path / "sweep.py"
    script.write_text(_IN_A_POOL)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=150,
                         env={**os.environ, "PYTHONPATH": root})
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "checkpoint.async_mode = 'async_with_pinned_mem': saves through a writer process, which this process may not "
        "start: it is daemonic (a multiprocessing.Pool's worker, a Process(daemon=True)); use async, which needs "
        "none []", "saved []"]


_FORKS_WITH_A_SAVE_IN_FLIGHT = """
import multiprocessing, sys, time, torch
from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import Checkpoint
config = Checkpoint(enable=True, interval=1, async_mode="async", keep_latest_k=0)
manager = CheckpointManager(config, [torch.nn.Linear(2048, 4096)], base_folder=sys.argv[1])
manager.save(1)
if not manager.save_in_flight:  # this process was held up until the save had ended
    print("ended first")
    sys.exit(0)
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0,))  # a data loader's worker
child.start()
child.join(60)
print("child", child.exitcode)
manager.close()
"""


def test_a_process_forked_during_a_save_exits_without_waiting_for_it(tmp_path):
    """The exit's wait for a save in flight is the process's that made it: a forked child (a
    data loader's worker) inherits the hook but not the save's threads, and waited forever."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", _FORKS_WITH_A_SAVE_IN_FLIGHT, str(tmp_path)], capture_output=True,
                         text=True, timeout=180, env={**os.environ, "PYTHONPATH": root})
    if "ended first" in run.stdout:
        pytest.skip("the save ended before the fork (the test process was held up)")
    assert run.returncode == 0 and "child 0" in run.stdout, run.stdout + run.stderr


def test_a_manager_that_never_saves_starts_no_writer_process(tmp_path):
    """A job that only loads never starts a writer process, nor waits for one to start (close()
    waited for it to finish importing torch, 30 s and a warning on a loaded machine)."""
    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    config = Checkpoint(enable=True, async_mode="async_with_pinned_mem", load_only=True)
    with CheckpointManager(config, [torch.nn.Linear(8, 8)], base_folder=str(tmp_path)) as manager:
        manager.load()  # nothing to load
        assert manager._saves.stager.writer is None  # noqa: SLF001 - the writer process is what is under test


_START_METHOD_AFTER_A_SAVE = """
import multiprocessing, sys, torch
from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import Checkpoint
model = torch.nn.Linear(8, 8)
config = Checkpoint(enable=True, interval=1, async_mode="async_with_pinned_mem")
with CheckpointManager(config, [model], base_folder=sys.argv[1]) as manager:
    manager.save(1)
    manager.wait()
    print("after the writer started:", multiprocessing.get_start_method(allow_none=True))
    multiprocessing.set_start_method("forkserver")  # the host's choice, made late
    with torch.no_grad():
        model.weight.fill_(2.0)
    manager.save(2)
with CheckpointManager(Checkpoint(enable=True), [model := torch.nn.Linear(8, 8)], base_folder=sys.argv[1]) as m:
    assert m.load() and (model.weight == 2.0).all()
print("ok", multiprocessing.get_start_method())
"""


def test_the_writer_process_leaves_the_default_start_method_to_the_host(tmp_path):
    """Spawning the writer fixed the process's default start method (`spawn` asks for it), so a
    script setting its own afterwards failed with "context has already been set"."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _START_METHOD_AFTER_A_SAVE, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == ["after the writer started: None", "ok forkserver"]


_NO_THREAD_LEFT = """
import resource, sys, torch
from torchtitan_ckpt import CheckpointManager, CheckpointSaveError, ConfigError, layout
from torchtitan_ckpt.config import Checkpoint
folder, mode, when = sys.argv[1], sys.argv[2], sys.argv[3]
config = Checkpoint(enable=True, interval=1, async_mode=mode)


def no_thread_left():  # the address space for a thread's stack is gone: no thread starts
    vm = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (4 << 20), resource.RLIM_INFINITY))


if when == "make":
    no_thread_left()
    try:
        CheckpointManager(config, [torch.nn.Linear(4, 4)], base_folder=folder)
    except ConfigError as e:
        print(e)
else:
    model = torch.nn.Linear(4, 4)
    if when == "memory":
        model.register_buffer("big", torch.ones(1 << 24))  # 64 MiB: its copy finds no room
    manager = CheckpointManager(config, [model], base_folder=folder)
    no_thread_left()
    try:
        manager.save(1)
        manager.wait()
    except CheckpointSaveError as e:
        print(e)
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    manager.close()
    print("committed", layout.committed_steps(folder + "/checkpoint"))
"""


@pytest.mark.parametrize("mode, when", [("async", "make"), ("async_with_pinned_mem", "make"), ("async", "save"),
                                        ("async", "memory")])
def test_a_process_that_may_start_no_more_threads_is_told_so(tmp_path, mode, when):
    """A container's pids limit, `ulimit -u` or `-v` reached: the manager's construction and
    `save()` raised a bare `RuntimeError: can't start new thread` (past a loop's `except
    CheckpointSaveError`), and a save thread started on demand failed after the save's work was
    queued, which could commit the step that `save()` said failed. A copy of the state that
    finds no memory says what holds it and the setting that holds none."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _NO_THREAD_LEFT, str(tmp_path), mode, when], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    if when == "make":
        assert run.stdout.startswith(f"checkpoint.async_mode = '{mode}': its background saves need threads of their "
                                     "own, and this process may start no more (can't start new thread)"), run.stdout
    elif when == "memory":
        assert run.stdout.splitlines()[-1] == "committed []", run.stdout
        assert run.stdout.startswith(f"saving step 1 to {tmp_path}/checkpoint/step-1 failed: RuntimeError: "), (
            run.stdout)
        assert "can't allocate memory: you tried to allocate 67108864 bytes" in run.stdout, run.stdout
        assert ("(a background save holds a copy of the rank's state in host memory until it is written, and found "
                "no room for it: free memory, or save with checkpoint.async_mode = 'disabled', which holds none)"
                ) in run.stdout, run.stdout
    else:
        assert run.stdout.splitlines() == [
            f"saving step 1 to {tmp_path}/checkpoint/step-1 failed: RuntimeError: can't start new thread (this "
            "process may start no more threads: its limit of processes, `ulimit -u` or a container's pids limit, or "
            "of memory for their stacks, `ulimit -v`, is reached; raise it, or lower checkpoint.save_threads)",
            "committed []"], run.stdout


def test_a_step_queued_for_deletion_is_not_queued_again():
    """Retention picks a step again until it is gone: a second request while the first is
    queued or running is dropped (its removal failed, warning about a step deleted fine)."""
    import threading

    from torchtitan_ckpt.deleter import BackgroundDeleter

    removing, release, removed = threading.Event(), threading.Event(), []

    def remove(folder: layout.StepFolder) -> None:
        removing.set()
        release.wait(30)
        removed.append(folder.step)

    deleter = BackgroundDeleter(remove, str)
    step_1, step_2 = (layout.StepFolder(s, f"/nowhere/step-{s}", "COMPLETE") for s in (1, 2))
    deleter.submit([step_1])
    assert removing.wait(30)
    deleter.submit([step_1, step_2, step_2])  # step 1 is being deleted, step 2 queued twice
    release.set()
    deleter.drain()
    deleter.submit([step_1])  # done: a later request is honoured
    deleter.close()
    assert removed == [1, 2, 1]


_NO_SHARED_MEMORY = """
import multiprocessing, sys, threading, torch
from torchtitan_ckpt import CheckpointManager, ConfigError
from torchtitan_ckpt.config import Checkpoint
try:
    CheckpointManager(Checkpoint(enable=True, async_mode="async_with_pinned_mem"), [torch.nn.Linear(2, 2)],
                      base_folder=sys.argv[1])
except ConfigError as e:
    print(e)
print("children", len(multiprocessing.active_children()), "threads", threading.active_count())
"""


def test_pinned_mode_without_shared_memory_is_refused_at_start_leaving_nothing_running(tmp_path):
    """A read-only /dev/shm (a container's): the constructor failed with torch's raw error, and
    left the writer process and its reply thread running, per attempt."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to give the test a read-only /dev/shm")
    shell = f"mount -t tmpfs -o ro tmpfs /dev/shm && exec {sys.executable} -c \"$0\" {tmp_path}"
    run = subprocess.run(["unshare", "-m", "sh", "-c", shell, _NO_SHARED_MEMORY], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    if run.stderr.startswith(("unshare:", "mount:")):  # no mount namespace for this user or container
        pytest.skip(f"cannot make a mount namespace here: {run.stderr.strip()[-200:]}")
    lines = run.stdout.splitlines()
    assert lines[0].startswith("checkpoint.async_mode = 'async_with_pinned_mem': needs shared memory, which this "
                               "machine refuses"), run.stdout + run.stderr
    assert lines[1] == "children 0 threads 1"


_SMALL_SHARED_MEMORY = """
import sys, torch
from torchtitan_ckpt import CheckpointManager, CheckpointSaveError
from torchtitan_ckpt.config import Checkpoint
manager = CheckpointManager(Checkpoint(enable=True, interval=1, async_mode="async_with_pinned_mem"),
                            [torch.nn.Linear(1024, 1024)], base_folder=sys.argv[1])
manager.save(1)
try:
    manager.wait()
except CheckpointSaveError as e:
    print(e)
manager.close()
"""


def test_pinned_mode_with_too_little_shared_memory_says_so_not_that_the_disk_is_full(tmp_path):
    """A small /dev/shm (docker's default is 64 MB) failed the save with torch's "No space left
    on device (28)" beside the checkpoint's path, which sends the reader to the wrong disk."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to give the test a small /dev/shm")
    shell = f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} -c \"$0\" {tmp_path}"
    run = subprocess.run(["unshare", "-m", "sh", "-c", shell, _SMALL_SHARED_MEMORY], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    if run.stderr.startswith(("unshare:", "mount:")):  # no mount namespace for this user or container
        pytest.skip(f"cannot make a mount namespace here: {run.stderr.strip()[-200:]}")
    said = run.stdout.strip()
    assert said.startswith("saving step 1 to "), run.stdout + run.stderr
    assert re.search(r"async_with_pinned_mem could not stage [0-9.]+ MB in shared memory \(", said), said
    assert re.search(r"/dev/shm has [0-9.]+ [KM]?B free of 1\.05 MB: give the machine or container more", said), said


_FORKED_CHILD_CLOSES = """
import os, signal, sys, torch
from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import Checkpoint
mode, folder = sys.argv[1:]
manager = CheckpointManager(Checkpoint(enable=True, interval=1, async_mode=mode, keep_latest_k=0),
                            [torch.nn.Linear(1024, 1024)], base_folder=folder)
for step in (1, 2):
    manager.save(step)  # in flight at the fork
    pid = os.fork()
    if pid == 0:
        signal.alarm(30)  # a child still waiting then dies of SIGALRM
        manager.close()
        os._exit(0)
    print("child", os.waitpid(pid, 0)[1], flush=True)
manager.close()
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_forked_child_closing_its_copy_leaves_the_parents_saves_alone(tmp_path, mode):
    """A child forked with a save in flight waited forever in `close()` for a save whose threads
    are its parent's; in pinned mode it stopped its parent's writer process."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _FORKED_CHILD_CLOSES, mode, str(tmp_path)], capture_output=True,
                         text=True, timeout=180, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["child", "0", "child", "0"], run.stderr[-3000:]
    assert "writer process is gone" not in run.stderr
    assert layout.committed_steps(os.path.join(tmp_path, "checkpoint")) == [1, 2]


def test_managers_made_one_after_another_share_one_exit_hook(tmp_path):
    """Each async manager registered an exit hook of its own, kept after its `close()`: a process
    making a manager per evaluation piled them up (128 after 125 managers)."""
    import threading

    from torchtitan_ckpt import Checkpoint, CheckpointManager

    model = torch.nn.Linear(2, 2)
    hooks = []
    for step in range(1, 5):
        with CheckpointManager(Checkpoint(enable=True, interval=1, async_mode="async"), [model],
                               base_folder=str(tmp_path)) as manager:
            manager.save(step)
        hooks.append(len(threading._threading_atexits))
    assert hooks[-1] == hooks[0], hooks


def test_a_manager_without_the_optimizer_copies_the_model_in_save(tmp_path):
    """One model given to two managers, the optimizer to the first only (an evaluation copy's
    folder beside the training one): the second deferred its parameters' copy, and no step of its
    own waited for it, so its steps held values of later steps."""
    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(3)))  # copies that take a while
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    config = Checkpoint(enable=True, interval=1, keep_latest_k=0, async_mode="async")
    saved = {}
    with CheckpointManager(replace(config, folder=str(tmp_path / "train")), [model], optimizers=opt) as train, \
            CheckpointManager(replace(config, folder=str(tmp_path / "eval")), [model]) as evaluation:
        for step in range(1, 5):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()  # waits for the training manager's copy, never for the evaluation one's
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
            train.save(step)
            evaluation.save(step)
    for step, expected in saved.items():
        assert_same(read_checkpoint(str(tmp_path / "eval" / f"step-{step}")), expected)


@pytest.mark.parametrize("verify", [False, True])
def test_a_trunk_another_manager_s_optimizer_trains_is_copied_in_save(tmp_path, verify):
    """An actor and a critic sharing a trunk, each with its manager and an optimizer of its own,
    the critic's over its head alone: the critic's manager deferred the copy of every parameter
    of its model, the trunk too, which the actor's step (waiting for the actor's copy alone)
    changed while it was copied: the critic's steps held the trunk of later steps, or a mix
    (most runs), which `verify_staging` found every time (`StagingMismatchError`)."""
    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    torch.manual_seed(0)
    trunk = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(3)))  # copies that take a while
    actor, critic = torch.nn.Sequential(trunk, torch.nn.Linear(2048, 8)), torch.nn.Sequential(trunk, torch.nn.Linear(2048, 1))
    opt_actor, opt_critic = torch.optim.SGD(actor.parameters(), lr=1.0), torch.optim.SGD(critic[1].parameters(), lr=1.0)
    config = Checkpoint(enable=True, interval=1, keep_latest_k=0, async_mode="async", verify_staging=verify)
    saved = {}
    with CheckpointManager(replace(config, folder=str(tmp_path / "actor")), [actor], optimizers=opt_actor) as a, \
            CheckpointManager(replace(config, folder=str(tmp_path / "critic")), [critic], optimizers=opt_critic) as c:
        for p in itertools.chain(actor.parameters(), critic.parameters()):
            p.grad = torch.ones_like(p)
        for step in range(1, 5):
            opt_actor.step()  # waits for the actor manager's copy, never for the critic one's
            opt_critic.step()
            saved[step] = {k: v.clone() for k, v in critic.state_dict().items()}
            a.save(step)
            c.save(step)  # its copy begins after the actor's, which the next actor step waits for alone
    for step, expected in saved.items():
        got = read_checkpoint(str(tmp_path / "critic" / f"step-{step}"))
        assert_same({k: got[k] for k in expected}, expected)


_PICKLES_ITS_OWN_CLASS = """
import pickle, sys, threading, torch
from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import Checkpoint
class Record:  # a class of the training script: pickled by reference to __main__
    pass
failures, stop = [], threading.Event()
def report():  # a telemetry thread, a queue to a spawned worker
    while not stop.is_set():
        try:
            pickle.dumps(Record())
        except Exception as e:
            failures.append(type(e).__name__)
reporter = threading.Thread(target=report)
reporter.start()
config = Checkpoint(enable=True, interval=1, async_mode="async_with_pinned_mem", folder=sys.argv[1])
with CheckpointManager(config, [torch.nn.Linear(8, 8)]) as manager:
    manager.save(1)
stop.set()
reporter.join()
print(len(failures), sorted(set(failures)))
"""


def test_another_thread_pickles_the_scripts_classes_while_the_writer_starts(tmp_path):
    """The writer was started with `sys.modules["__main__"]` swapped for an empty module, for
    the whole process: another thread pickling an object of a class of the script then failed
    (thousands of PicklingErrors per start)."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_PICKLES_ITS_OWN_CLASS)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=150,
                         env={**os.environ, "PYTHONPATH": root})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == ["0 []"], run.stdout


_WITH_A_DEFAULT_SOCKET_TIMEOUT = """
import multiprocessing.spawn, socket, sys, torch
socket.setdefaulttimeout(60)  # a job's HTTP client set it for every socket of the process
theirs = multiprocessing.spawn.get_preparation_data
seen = []
def wrapped(name):  # another library's wrapper of spawn's preparation
    seen.append(name)
    return theirs(name)
multiprocessing.spawn.get_preparation_data = wrapped
from torchtitan_ckpt import CheckpointManager, layout
from torchtitan_ckpt.config import Checkpoint
config = Checkpoint(enable=True, interval=1, async_mode="async_with_pinned_mem", folder=sys.argv[1])
with CheckpointManager(config, [torch.nn.Linear(8, 8)]) as manager:
    for step in range(1, 4):
        manager.save(step)
        manager.wait()
print(layout.committed_steps(sys.argv[1]), multiprocessing.spawn.get_preparation_data is wrapped, len(seen))
"""


def test_the_writer_process_works_under_a_default_socket_timeout_and_another_librarys_spawn_wrapper(tmp_path):
    """`socket.setdefaulttimeout` made the socket object over the writer's pipe non-blocking, and
    with it the pipe the replies come by: saves failed ("BlockingIOError") and the writer was
    killed. Starting the writer put back the `spawn` preparation it found at import, undoing a
    wrapper another library had put there since (and skipping it for the writer's start)."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_WITH_A_DEFAULT_SOCKET_TIMEOUT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True, text=True,
                         timeout=150, env={**os.environ, "PYTHONPATH": root})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == ["[1, 2, 3] True 1"], run.stdout + run.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint16, torch.float32])
def test_an_empty_tensor_of_a_dtype_of_no_storage_class_is_saved_by_the_writer_process(tmp_path, dtype):
    """Tensors handed to the writer by value (an empty one has no place in the staging memory)
    were pickled plainly, which torch cannot read back for a dtype of no storage class
    (float8, uint16): every save failed in the writer ("UntypedStorage has no attribute
    dtype")."""
    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    class Extra:
        def __init__(self):
            self.t = torch.zeros(0).to(dtype)

        def state_dict(self):
            return {"t": self.t, "u": torch.arange(4).to(dtype)}

        def load_state_dict(self, state):
            pass

    config = Checkpoint(enable=True, interval=1, async_mode="async_with_pinned_mem")
    with CheckpointManager(config, [torch.nn.Linear(2, 2)], states={"extra": Extra()},
                           base_folder=str(tmp_path)) as manager:
        manager.save(1)
        manager.wait()
    saved = read_checkpoint(layout.step_dir(str(tmp_path / "checkpoint"), 1))
    assert saved["extra.t"].dtype == dtype and saved["extra.t"].numel() == 0
    assert torch.equal(saved["extra.u"].view(torch.uint8), torch.arange(4).to(dtype).view(torch.uint8))


def test_a_message_the_writer_process_cannot_map_stops_it_instead_of_leaving_it_a_buffer_short(tmp_path):
    """A message whose shared buffers the writer could not map (here its limit of open files
    leaves no room) was answered with its error and the writer went on, without the buffers
    the message registered, which the training process counted as registered: every later
    write of that memory failed with a bare KeyError. The writer now stops; the descriptors it
    received are closed."""
    import resource

    from torchtitan_ckpt.errors import WriterProcessError
    from torchtitan_ckpt.io.filewriter import Entry, FileJob
    from torchtitan_ckpt.io.writer_process import WriterProcess, fd_shared

    writer = WriterProcess()
    try:
        writer([FileJob(str(tmp_path / "warm"), [Entry("k", torch.zeros(4), None)])])
        arena = fd_shared(torch.arange(256, dtype=torch.uint8))
        limit = resource.prlimit(writer.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(writer.pid, resource.RLIMIT_NOFILE, (3, limit[1]))  # no descriptor may be received
        with pytest.raises(RuntimeError, match="the writer process received 0 of the 1 shared buffers sent"):
            writer([FileJob(str(tmp_path / "a"), [Entry("k", arena[16:32], None)])])
        with pytest.raises(WriterProcessError, match="the checkpoint writer process exited"):
            writer([FileJob(str(tmp_path / "b"), [Entry("k", arena[16:32], None)])])
    finally:
        writer.close()


def test_the_writer_process_takes_a_message_naming_more_buffers_than_one_send_passes(tmp_path):
    """Linux passes at most 253 descriptors in one message: a writer started (or restarted
    after a failure) for a state of more arenas was handed them all at once, refused with
    EINVAL, killed, and so again at every save."""
    from torchtitan_ckpt.io.filewriter import Entry, FileJob
    from torchtitan_ckpt.io.writer_process import WriterProcess, fd_shared

    arenas = [fd_shared(torch.full((64,), i % 251, dtype=torch.uint8)) for i in range(300)]
    writer = WriterProcess()
    try:
        written = writer([FileJob(str(tmp_path / "f"), [Entry(str(i), a[:8], None) for i, a in enumerate(arenas)])])
    finally:
        writer.close()
    assert len(written) == 1 and written[0].size >= 300 * 8


def test_a_small_view_handed_to_the_writer_process_by_value_sends_its_bytes_alone():
    """A tensor not in the staging memory goes by value: a 16-byte view of a 64 MiB tensor sent
    all 64 MiB through the pipe."""
    from torchtitan_ckpt.io.writer_process import WriterProcess, _pickled

    big = torch.zeros(16 << 20)
    writer = WriterProcess()
    try:
        message, fds = _pickled(writer._ref(big[4:8], {}))
    finally:
        writer.close()
    assert fds == [] and len(message) < 4096, len(message)


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_a_tensor_that_requires_grad_and_is_no_leaf_inside_a_value_saves_as_a_sync_save_does(tmp_path, mode):
    """A loss kept without `detach()` in a tuple of a user state (pickled whole by the save): the
    synchronous save wrote it, the background modes failed each save with torch's deepcopy error
    (which speaks of weight_norm)."""
    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()
    assert not loss.is_leaf
    config = Checkpoint(enable=True, folder=str(tmp_path / "ckpt"), interval=1, async_mode=mode)
    with CheckpointManager(config, [torch.nn.Linear(1, 1)], states={"best": Holder({"best": (loss, 7)})}) as manager:
        assert manager.save(1)
        manager.wait()
    back = Holder({"best": None})
    with CheckpointManager(config, [torch.nn.Linear(1, 1)], states={"best": back}) as manager:
        assert manager.load()
    assert back.value["best"][1] == 7 and back.value["best"][0].item() == 6.0


def test_verify_staging_and_tied_loads_compare_a_conjugated_parameter_by_its_values(tmp_path):
    """A complex parameter held as `x.conj()` (a Parameter keeps the lazy bit): every
    `verify_staging` save failed with torch's bare error on a byte view of it, and a load into
    a model tying it failed blaming the model's `load_state_dict`."""
    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    class Model(torch.nn.Module):
        def __init__(self, tie: bool = False):
            super().__init__()
            self.c = torch.nn.Parameter(torch.complex(torch.arange(3.0), torch.arange(3.0) + 5).conj())
            if tie:
                self.d = self.c

    model = Model()
    assert model.c.is_conj()
    config = Checkpoint(enable=True, folder=str(tmp_path / "a"), interval=1, async_mode="async", verify_staging=True)
    with CheckpointManager(config, [model], optimizers=torch.optim.SGD(model.parameters(), lr=0.1)) as manager:
        assert manager.save(1)
        manager.wait()
    tied = Checkpoint(enable=True, folder=str(tmp_path / "b"), interval=1)
    with CheckpointManager(tied, [Model(tie=True)]) as manager:
        assert manager.save(1)
    back = Model(tie=True)
    with torch.no_grad():
        back.c.zero_()
    with CheckpointManager(tied, [back]) as manager:
        assert manager.load()
    assert torch.equal(back.c, model.c) and back.d is back.c


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_a_manager_made_under_inference_mode_saves(tmp_path, mode):
    """An evaluation job whose main() runs under torch.inference_mode(): with
    async_with_pinned_mem every save failed ("Inplace update to inference tensor outside
    InferenceMode"), the staging thread writing a tensor made on the caller's thread."""
    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    model = torch.nn.Linear(64, 64)
    config = Checkpoint(enable=True, interval=1, async_mode=mode, keep_latest_k=0, folder=str(tmp_path / "c"))
    with torch.inference_mode():
        manager = CheckpointManager(config, [model])
        manager.load()
        for step in (1, 2):
            model.weight.data.add_(1.0)
            manager.save(step)
        manager.close()
    assert layout.committed_steps(str(tmp_path / "c")) == [1, 2]
    assert_same(read_checkpoint(layout.step_dir(str(tmp_path / "c"), 2)), model.state_dict())


_TRAINS_ON_AFTER_MAIN = """
import sys, threading, torch
from torchtitan_ckpt import CheckpointError, CheckpointManager
from torchtitan_ckpt.config import Checkpoint
mode, folder = sys.argv[1:]
manager = CheckpointManager(Checkpoint(enable=True, interval=1, async_mode=mode, keep_latest_k=0, folder=folder),
                            [torch.nn.Linear(2, 2)])
manager.save(1)
def train():
    threading.main_thread().join()  # the script returned; the training thread goes on
    for call in (lambda: manager.save(2), manager.load):
        try:
            call()
        except CheckpointError as e:
            print(e)
    manager.close()
threading.Thread(target=train).start()
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_save_after_the_main_thread_ended_says_why_it_cannot_run(tmp_path, mode):
    """A script whose training thread goes on after the main thread returned: saves and loads
    failed with "cannot schedule new futures after interpreter shutdown" (or a writer process
    gone, with a warning that the interpreter exits), naming neither the cause nor the way out."""
    import subprocess
    import sys

    folder = str(tmp_path / "c")
    run = subprocess.run([sys.executable, "-c", _TRAINS_ON_AFTER_MAIN, mode, folder], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    said = ("called after the main thread ended: Python takes no new work in thread pools then (saves and loads use "
            "them) and has stopped the checkpoint's background work; have the main thread wait for the training "
            "thread (thread.join()) before it ends")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.splitlines() == [f"save(2) {said}", f"load() {said}"], run.stderr[-3000:]
    assert layout.committed_steps(folder) == [1]


_SAVES_WHILE_THE_EXIT_HOOK_RUNS = """
import logging, sys, threading, time, torch
from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.io import writer_process
logging.basicConfig(level=logging.ERROR)
manager = CheckpointManager(Checkpoint(enable=True, interval=1, async_mode="async_with_pinned_mem", keep_latest_k=0,
                                       folder=sys.argv[1]), [torch.nn.Linear(2, 2)])
manager.save(1)
manager.wait()
writer_process._close_at_exit()  # as at the exit, with a daemon trainer still saving: its writer is closed
try:
    manager.save(2)  # once made a writer that nothing closed, and the exit waited on it for ever
    manager.wait()
except Exception as e:
    print(type(e).__name__, str(e).splitlines()[0])
"""


def test_no_writer_process_is_started_once_the_exit_closed_them(tmp_path):
    """A daemon thread saving on while the exit hook closed the writers started a new one
    ("the checkpoint writer process is gone; starting a new one"), which nothing closed:
    multiprocessing's exit then waited on it for ever."""
    import subprocess
    import sys

    folder = str(tmp_path / "c")
    run = subprocess.run([sys.executable, "-c", _SAVES_WHILE_THE_EXIT_HOOK_RUNS, folder], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "the process is exiting (its main thread ended): no checkpoint writer process is started" in run.stdout, \
        run.stdout + run.stderr[-3000:]
    assert layout.committed_steps(folder) == [1]
