"""`CheckpointGroup.run` on real ranks: every rank hears of every failure, and decides alike."""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import subprocess
import sys

import pytest
import torch

from torchtitan_ckpt.errors import (AdapterMismatchError, CheckpointSaveError, CollectiveError, ConfigError,
                                    PartialLoadError, RankFailed, StorageError, UnsafePickleError)
from torchtitan_ckpt.group import CheckpointGroup

from .helpers import spawn, stay_until, then_release


def _failing(rank: int, world_size: int) -> None:
    group = CheckpointGroup()

    def fn() -> int:
        if rank == 1:
            raise KeyError("w")
        return rank

    with pytest.raises(RankFailed) as one:  # rank 1 alone fails: rank 0 names it
        group.run(fn)
    assert one.value.rank == 1 and "KeyError" in one.value.kinds
    assert (one.value.error is None) == (rank == 0)

    def both() -> None:
        raise (ValueError if rank == 0 else KeyError)("x")

    with pytest.raises(RankFailed) as two:  # each rank describes its own failure, kinds of all
        group.run(both)
    assert two.value.rank == rank
    assert {"ValueError", "KeyError", "LookupError"} <= set(two.value.kinds)
    assert group.run(lambda: rank * 10) == [0, 10]


def test_every_rank_gets_the_kinds_of_every_failure():
    spawn(2, _failing)


def _interrupted_and_out_of_step(rank: int, world_size: int) -> None:
    group = CheckpointGroup()

    def fn() -> int:
        if rank == 0:
            raise KeyboardInterrupt  # a SIGINT (or a handler's sys.exit) inside the round
        return rank

    if rank == 0:  # the interrupt is raised on its rank after the round, which the others hear of
        with pytest.raises(KeyboardInterrupt):
            group.run(fn)
    else:
        with pytest.raises(RankFailed, match="rank 0: KeyboardInterrupt"):
            group.run(fn)
    assert group.run(lambda: rank) == [0, 1]  # still in step
    if rank == 0:
        group._rounds += 1  # as a rank that left a round before its gather (a signal between the two)
    with pytest.raises(CollectiveError, match=r"out of step: .* rounds are \[4, 3\]"):
        group.run(lambda: rank)
    if rank == 1:  # in another call of the manager (load() where rank 0 saves): a plain gather
        assert group.all_gather(("load", -1))[0][0] == 5
    else:  # which it unpacked as a round: ValueError
        with pytest.raises(CollectiveError, match=r"out of step: .* rounds are \[5, 'another exchange'\]; .* or the "
                                                  "ranks called them otherwise"):
            group.run(lambda: rank)


def test_an_interrupted_rank_fails_the_round_on_every_rank_and_ranks_out_of_step_are_named():
    """A rank leaving a round without its gather paired its next round with the others' (a save
    on rank 1 returned as committed when rank 0, interrupted in its commit, went on to close())."""
    spawn(2, _interrupted_and_out_of_step)


def _interrupted_inside_a_collective(rank: int, world_size: int, folder: str, gone: str) -> None:
    import signal
    import time

    import torch

    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint
    from torchtitan_ckpt.errors import CheckpointError

    config = Checkpoint(enable=True, interval=1, collective_timeout_s=5, keep_latest_k=0)
    manager = CheckpointManager(config, [torch.nn.Linear(2, 2)], base_folder=folder)
    manager.save(1)
    if rank == 1:  # interrupted while it waits for rank 0 in the first exchange of save(2)'s first gather
        def interrupt(*_):
            raise KeyboardInterrupt
        signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 1)
        with then_release(gone):  # rank 0 comes to save(2) once this rank has left its collectives
            with pytest.raises(KeyboardInterrupt):
                manager.save(2)
            start = time.monotonic()
            with pytest.raises(CheckpointError, match=r"rank 1 was interrupted \(KeyboardInterrupt\) inside a "
                                                      r"collective among the checkpoint's 2 ranks, which cannot pair "
                                                      r"their later collectives with its own any more: restart the "
                                                      r"job"):
                manager.save(3)  # at once: no collective entered
            assert time.monotonic() - start < 1
            manager.close()
    else:
        stay_until(gone)
        with pytest.raises(CheckpointError, match="CollectiveError: a collective among the checkpoint's 2 ranks "
                                                  "failed on rank 0"):
            manager.save(2)  # its partner gone, not garbage unpickled
        manager.close()


def test_a_rank_interrupted_inside_a_collective_enters_no_other(tmp_path):
    """A KeyboardInterrupt between the two exchanges of an object all-gather: the rank's next
    collective paired with the rest of that one on rank 0, which unpickled garbage, and gloo
    aborted the interrupted rank (SIGABRT)."""
    spawn(2, _interrupted_inside_a_collective, str(tmp_path), str(tmp_path / "gone"))


def _stuck_inside_dcp(rank: int, world_size: int, folder: str, gone: str) -> None:
    import torch

    from torchtitan_ckpt import Checkpoint, CheckpointManager, CheckpointSaveError
    from torchtitan_ckpt.dcp import planner

    config = Checkpoint(enable=True, interval=1, keep_latest_k=0, collective_timeout_s=3)
    with CheckpointManager(config, [torch.nn.Linear(2, 2)], base_folder=folder) as manager:
        manager.save(1)
        if rank == 1:  # stuck in DCP's planning (a slow state, a hung file system) until rank 0 gave up
            plan = planner.DedupSavePlanner.create_local_plan

            def stuck(self):
                stay_until(gone)
                return plan(self)
            planner.DedupSavePlanner.create_local_plan = stuck
        with then_release(gone) if rank == 0 else contextlib.nullcontext():
            with pytest.raises(CheckpointSaveError, match=f"saving step 2 .* failed: CollectiveError: a collective "
                                                          f"among the checkpoint's 2 ranks failed on rank {rank} "):
                manager.save(2)
            with pytest.raises(CheckpointSaveError, match=f"CollectiveError: rank {rank}: an earlier collective "
                                                          "among the checkpoint's 2 ranks failed .*restart the job"):
                manager.save(3)  # not a wait for a peer whose connection is gone
        if rank == 0:
            stay_until(gone + ".1")
        else:
            open(gone + ".1", "w").close()


def test_a_collective_of_dcp_that_times_out_is_named_and_no_later_one_is_entered(tmp_path):
    """A rank stuck inside `dcp.save` (in DCP's own collectives, not the group's rounds): gloo's
    timeout reached the caller as a bare RuntimeError quoting gloo's source, and the next save
    waited for a peer gloo had cut off."""
    spawn(2, _stuck_inside_dcp, str(tmp_path), str(tmp_path / "gone"))


def _two_groups_over_one(rank: int, world_size: int, done: str) -> None:
    import time

    made = CheckpointGroup(timeout_s=3)
    over = CheckpointGroup(made.pg)  # as an HF export makes one over its manager's group
    if rank == 1:
        stay_until(done)  # never joins
        return
    with then_release(done):
        with pytest.raises(CollectiveError, match="failed on rank 0"):
            over.all_gather(1)
        start = time.monotonic()
        with pytest.raises(CollectiveError, match=r"^rank 0: an earlier collective among the checkpoint's 2 ranks "
                                                  r"failed .*restart the job"):
            made.all_gather(2)
        assert time.monotonic() - start < 1
    made.close()


def test_a_failed_collective_is_known_to_every_group_over_the_same_process_group(tmp_path):
    spawn(2, _two_groups_over_one, str(tmp_path / "done"))


def _own_failure_kept(rank: int, world_size: int, done: str) -> None:
    group = CheckpointGroup(timeout_s=10)
    if rank == 1:
        stay_until(done)  # never joins the round
        return

    def fn() -> None:
        raise OSError("the disk is gone")

    with then_release(done), pytest.raises(CollectiveError, match=r"rank\(s\) 1 had not entered it after .*"
                                                                  r"checkpoint.collective_timeout_s = 10 s.* "
                                                                  r"\(this rank had failed first: OSError: the disk "
                                                                  r"is gone\)"):
        group.run(fn)


def test_a_rank_own_failure_is_kept_when_the_round_times_out(tmp_path):
    spawn(2, _own_failure_kept, str(tmp_path / "done"))


def _few_files(rank: int, world_size: int) -> None:
    import logging  # noqa: PLC0415
    import resource  # noqa: PLC0415

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchtitan_ckpt.group").addHandler(handler)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    for room, warned in ((1000, False), (30, True)):  # the group needs a few here: made either way
        said.clear()
        open_now = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + room, hard))
        group = CheckpointGroup()
        try:
            assert group.run(lambda: rank) == [0, 1]
        finally:
            group.close()
        assert bool(said) is warned
    assert said[0].startswith(f"rank {rank}: the checkpoint's gloo group of 2 ranks holds a connection to each, and "
                              f"this process has {open_now} files open of the {open_now + 30} it may open (ulimit -n)")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
def test_a_limit_on_open_files_too_low_for_the_group_is_warned_of_with_the_way_out(tmp_path):
    """Gloo holds a connection to every rank: at thousands of ranks under `ulimit -n` 1024, making
    the group failed with gloo's "epoll_create: Too many open files" alone."""
    spawn(2, _few_files)


def test_a_group_without_a_cpu_backend_is_refused_at_start(tmp_path):
    """Checkpoint collectives exchange CPU objects (from background threads too): a group whose
    backend serves only GPU tensors (TorchTitan's NCCL world, here a real gloo group made for
    CUDA tensors only) is refused when the manager's group is made, naming what to pass."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"serves only \['cuda'\] tensors.*new_group\(backend='gloo'\)"):
            CheckpointGroup(dist.new_group(backend="cuda:gloo"))
        assert CheckpointGroup(dist.new_group(backend="gloo")).world_size == 1
    finally:
        dist.destroy_process_group()


def test_one_off_calls_on_a_gpu_only_default_group_share_one_gloo_group(tmp_path):
    """`load_hf` and `save_hf` without a group, under a default group that carries only GPU
    tensors: one gloo group is made for them the first time and kept (not one per call)."""
    import torch.distributed as dist

    from torchtitan_ckpt.group import cpu_world

    dist.init_process_group("cuda:gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        first = cpu_world()
        assert first is not dist.group.WORLD and first is cpu_world()
        assert CheckpointGroup(first).all_gather("x") == ["x"]
    finally:
        dist.destroy_process_group()


def _managers_in_a_loop(rank: int, world_size: int, folder: str) -> None:
    import os
    import threading

    import torch

    from torchtitan_ckpt import Checkpoint, CheckpointManager

    def held() -> tuple[int, int]:
        return len(os.listdir("/proc/self/fd")), threading.active_count() + len(os.listdir("/proc/self/task"))

    model = torch.nn.Linear(2, 2)
    counts = []
    for step in range(1, 7):  # an evaluation loop: a manager per checkpoint
        with CheckpointManager(Checkpoint(enable=True, interval=1), [model], base_folder=folder) as manager:
            manager.save(step)
        counts.append(held())
    # 4 managers more kept +20 descriptors and +12 threads; a loaded machine's lazily made threads
    # (torch's pools, the allocator's) and descriptors come on top now and then, far fewer
    (fds, threads), (first_fds, first_threads) = counts[-1], counts[1]
    assert fds <= first_fds + 8 and threads <= first_threads + 6, counts


def test_managers_made_and_closed_in_a_loop_leave_no_group_behind(tmp_path):
    """Each manager's own gloo group (sockets, pipes, threads) was kept until the process ended."""
    spawn(2, _managers_in_a_loop, str(tmp_path))


def test_a_manager_closed_after_the_world_was_made_again_closes(tmp_path):
    """Its group went with the world it was made in (an elastic restart within the process):
    `close()` raised destroying it."""
    import torch
    import torch.distributed as dist

    from torchtitan_ckpt import Checkpoint, CheckpointManager

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'one'}", rank=0, world_size=1)
    manager = CheckpointManager(Checkpoint(enable=True, interval=1), [torch.nn.Linear(2, 2)],
                                base_folder=str(tmp_path))
    manager.save(1)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'two'}", rank=0, world_size=1)
    try:
        manager.close()
    finally:
        dist.destroy_process_group()


def _shut_down_with_a_save_in_flight(rank: int, world_size: int, folder: str) -> None:
    import threading

    import torch
    import torch.distributed as dist

    from torchtitan_ckpt import Checkpoint, CheckpointManager, CheckpointSaveError

    manager = CheckpointManager(Checkpoint(enable=True, interval=1, async_mode="async"),
                                [torch.nn.Linear(4096, 4096)], base_folder=folder)
    manager.save(1)
    assert manager.save_in_flight  # 64 MB to write: the save goes on past the teardown
    dist.destroy_process_group()  # a training script's teardown, before close()
    with pytest.raises((CheckpointSaveError, CollectiveError), match=r"shut down torch.distributed|torch.distributed was shut down "
                                        r"\(destroy_process_group\(\)\) while the checkpoint still had collectives"):
        manager.close()
    watch = [t for t in threading.enumerate() if t.name == "ckpt-collective-watch"]  # it held the job's store
    for thread in watch:
        thread.join(10)  # woken by close(): it ends at once
    assert not any(t.is_alive() for t in watch)
    dist.init_process_group("gloo", init_method=f"file://{folder}/again", rank=rank, world_size=world_size)


def test_a_world_shut_down_with_a_save_in_flight_is_named(tmp_path):
    """`destroy_process_group()` before `close()` with a background save in flight: DCP went on
    as a single process on the rank that shut down first ("a rank reused its cached save plan,
    but the coordinator has none", as rank 0's on rank 1), its peer was told that another rank
    had not joined, and the watch of the checkpoint's collectives stayed, holding the job's
    store."""
    spawn(2, _shut_down_with_a_save_in_flight, str(tmp_path))


_LEAVING = """
import atexit, logging, sys
from torchtitan_ckpt.group import leave
logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
atexit.register(lambda: print("atexit ran", file=sys.stderr))
sys.stdout.write("no newline yet")
logging.getLogger("job").info("done")
leave(3)
"""


@pytest.mark.parametrize("launched", [True, False])
def test_leave_ends_a_launched_rank_without_teardown_once_its_output_is_flushed(tmp_path, launched):
    """A rank torchrun launched skips the interpreter's teardown (where gloo's worker threads may
    abort it), with its buffered output and logs written; any other process exits as usual."""
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    if launched:
        env["WORLD_SIZE"] = "1"
    log = tmp_path / "job.log"
    done = subprocess.run([sys.executable, "-c", _LEAVING, str(log)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3
    assert done.stdout == "no newline yet"
    assert "INFO:job:done" in log.read_text()
    assert ("atexit ran" in done.stderr) is not launched


def _late_after_the_other_gave_up(rank: int, world_size: int, folder: str, gone: str) -> None:
    """Rank 1 comes to save(2) after rank 0's wait ran out and rank 0 closed its manager."""
    import torch

    from torchtitan_ckpt import Checkpoint, CheckpointManager, CheckpointSaveError

    config = Checkpoint(enable=True, interval=1, keep_latest_k=0, collective_timeout_s=3)
    gave_up = then_release(gone) if rank == 0 else contextlib.nullcontext()
    with gave_up, CheckpointManager(config, [torch.nn.Linear(2, 2)], base_folder=folder) as manager:
        manager.save(1)
        if rank == 1:
            stay_until(gone)  # rank 0 waited its 3 s out and closed its manager
        with pytest.raises(CheckpointSaveError) as failed:
            manager.save(2)
    said = str(failed.value)
    if rank == 0:  # it waited the timeout out: rank 1 never came
        assert "rank(s) 1 had not entered it after" in said, said
    else:  # its peer was gone as it came: nobody is named, least of all rank 0, which had come
        assert "had not entered it" not in said and "another rank did not join it" in said, said


def test_a_rank_that_comes_after_its_peer_gave_up_does_not_name_the_peer(tmp_path):
    """The rank that gave up closed its counter (it was deleted, and read back as 0: the late
    rank named as missing the rank that had waited for it)."""
    spawn(2, _late_after_the_other_gave_up, str(tmp_path), str(tmp_path / "gone"))


def _rank_0_at_its_part_of_a_round(rank: int, world_size: int) -> None:
    import logging
    import time

    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("torchtitan_ckpt.group").addHandler(handler)
    group = CheckpointGroup(timeout_s=8)
    group.run(lambda: time.sleep(4), coordinator_only=True)  # past the warning's 2 s: rank 1 waits, rank 0 works
    group.close()
    assert warned == [], warned


def test_a_rank_at_its_own_part_of_a_round_is_not_warned_of_as_stuck():
    """Ranks were counted in at the gather, after their part of the round: rank 1 warned that
    rank 0, deleting old steps for the round (a coordinator-only part), had not come."""
    spawn(2, _rank_0_at_its_part_of_a_round)


def _one_group_two_managers(rank: int, world_size: int, folder: str) -> None:
    import torch
    import torch.distributed as dist

    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    def manager(name: str, group) -> CheckpointManager:
        config = Checkpoint(enable=True, folder=os.path.join(folder, name), interval=1, async_mode="async")
        return CheckpointManager(config, [torch.nn.Linear(2, 2)], process_group=group)

    whole = dist.new_group(backend="gloo")  # of every rank: each manager makes a group of its own over it
    model, ema = manager("model", whole), manager("ema", whole)
    assert model.save(1) and ema.save(1)
    model.close()
    ema.close()
    pair = dist.new_group(ranks=[0, 1], backend="gloo")  # of some ranks: used as given
    if rank == 2:  # a rank the group leaves out
        with pytest.raises(ValueError, match=r"this rank \(rank 2 of the world\) is not in it"):
            manager("pair", pair)
        return
    model = manager("model", pair)
    with pytest.raises(ValueError, match=r"the process_group given carries the collectives of the CheckpointManager "
                                         r"of .*/model, which is not closed: two managers' background saves on one "
                                         r"group would cross their collectives"):
        manager("ema", pair)
    model.save(2)
    model.close()
    manager("ema", pair).close()  # the group is free again


def test_a_group_carries_one_managers_collectives_at_a_time(tmp_path):
    """One gloo group given to a model's manager and an EMA's: their background saves crossed
    collectives and gloo aborted the process ("Received data size doesn't match"); a group of
    every rank is now only named, each manager making its own over it. A rank the given group
    leaves out failed with an AttributeError."""
    spawn(3, _one_group_two_managers, str(tmp_path))


def test_a_rank_torchrun_launched_without_a_process_group_is_refused(tmp_path, monkeypatch):
    """Under torchrun without `init_process_group`, each rank was a job of one: rank 1 failed
    on rank 0's lock of the folder as on "another process" using it, or, where the two did not
    overlap, replaced rank 0's steps with its own."""
    from torchtitan_ckpt import Checkpoint, CheckpointManager  # noqa: PLC0415
    from torchtitan_ckpt.errors import CheckpointError  # noqa: PLC0415

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(CheckpointError, match=r"^this process was launched as rank 1 of WORLD_SIZE = 2 \(torchrun\), "
                                              r"and torch.distributed is not initialised: .* Call "
                                              r"torch.distributed.init_process_group\(\) before making"):
        CheckpointManager(Checkpoint(enable=True), [torch.nn.Linear(2, 2)], base_folder=str(tmp_path))
    assert os.listdir(tmp_path) == []
    assert CheckpointGroup().world_size == 1  # a one-off read's (load_hf on each rank of an inference job)
    monkeypatch.setenv("WORLD_SIZE", "1")  # a launch of one rank is a job of one
    with CheckpointManager(Checkpoint(enable=True), [torch.nn.Linear(2, 2)], base_folder=str(tmp_path)) as manager:
        assert manager.save(500)


def test_errors_whose_constructor_takes_other_arguments_than_their_message_pickle_and_copy():
    """torch.distributed passes a rank's failure to the others pickled (DCP's load and save): an
    error made by `cls(*error.args)` failed to unpickle (tests/test_hf_multirank.py has one on
    two ranks), and `copy.copy` of one failed alike."""
    saved = CheckpointSaveError(3, "/ck/step-3", OSError(28, "No space left on device"), "; free some")
    saved.unsaved = 4
    for error in (ConfigError("checkpoint.interval", 0, "expected an integer >= 1"), saved,
                  PartialLoadError("/ck/step-2", KeyboardInterrupt()), UnsafePickleError("a.pt", "is cut", True),
                  AdapterMismatchError("state dict -> HF", ["x"], ["y"], "hint"), StorageError(5, "refused"),
                  RankFailed(1, "ValueError: bad", ("ValueError", "Exception"), None)):
        for back in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
            assert type(back) is type(error) and str(back) == str(error) and back.args == error.args
            assert {k: str(v) for k, v in vars(back).items()} == {k: str(v) for k, v in vars(error).items()}
    assert pickle.loads(pickle.dumps(StorageError(5, "refused"))).errno == 5


def test_another_ranks_partial_load_of_a_path_no_terminal_shows_is_told_once():
    """Another rank's `PartialLoadError` reaches this one as its escaped text (`RankFailed`): the
    part this rank's error says anyway was matched against the raw path, so a path holding a
    newline gave the whole text twice."""
    path = "/ck\npt/step-3"
    theirs = PartialLoadError(path, OSError(5, "Input/output error"))
    mine = PartialLoadError(path, RankFailed(1, f"{type(theirs).__name__}: {theirs}", ("PartialLoadError",), None))
    assert str(mine).count("Input/output error") == 1 and str(mine).count("ck\\npt") == 1, str(mine)
    assert "\n" not in str(mine)


def _training_on_the_group_given(rank: int, world_size: int, folder: str, mode: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    train = dist.new_group(backend="gloo", timeout=timedelta(seconds=8))  # training's, carrying its gradients
    torch.manual_seed(0)  # one model on both ranks
    model = torch.nn.Linear(2, 2)
    config = Checkpoint(enable=True, folder=folder, interval=1, async_mode=mode)
    with CheckpointManager(config, [model], process_group=train) as manager:
        for step in (1, 2, 3):
            assert manager.save(step)
            grad = torch.ones(4)
            dist.all_reduce(grad, group=train)  # while the background save runs its collectives
            dist.barrier(group=train)
            assert grad.tolist() == [2.0] * 4
        manager.wait()
    from torchtitan_ckpt import layout

    assert layout.committed_steps(folder)[-1] == 3
    loaded = torch.nn.Linear(2, 2)
    with CheckpointManager(config, [loaded], process_group=train) as again:  # its group is kept
        assert again.load()
    assert torch.equal(loaded.weight, model.weight)


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_training_collectives_on_the_group_given_do_not_cross_a_background_save(tmp_path, mode):
    """A manager given the group the training uses (its data-parallel group) ran the background
    save's collectives on it while the training thread ran a gradient all-reduce and a barrier
    there: both ranks waited out the group's timeout and no step was committed. The manager's
    collectives run on a gloo group of its own over the given group's ranks."""
    spawn(2, _training_on_the_group_given, str(tmp_path / "ckpt"), mode)


class _FailsOnRank:
    def __init__(self, failing: int):
        self.failing = failing

    def state_dict(self):
        import torch.distributed as dist

        if dist.get_rank() == self.failing:
            raise RuntimeError("no state here")
        return {"x": torch.zeros(1)}

    def load_state_dict(self, state):
        pass


def _subgroup_names_job_ranks(rank: int, world_size: int, folder: str) -> None:
    import logging

    import torch.distributed as dist

    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint
    from torchtitan_ckpt.errors import CheckpointSaveError

    pair = dist.new_group([3, 1], backend="gloo")  # every rank makes it; 1 and 3 are in it
    if rank not in (1, 3):
        return
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("torchtitan_ckpt").addHandler(handler)
    logging.getLogger("torchtitan_ckpt").setLevel(logging.INFO)
    config = Checkpoint(enable=True, folder=folder, interval=1)
    with CheckpointManager(config, [torch.nn.Linear(2, 2)], states={"odd": _FailsOnRank(3)},
                           process_group=pair) as manager:
        with pytest.raises(CheckpointSaveError) as failed:
            manager.save(1)
    assert "RuntimeError: no state here" in str(failed.value)  # rank 3's own, said as such
    if rank == 1:
        assert ("failed on rank 1 of the checkpoint's group (rank 3 of the job): RuntimeError: no state here"
                in str(failed.value)), failed.value
        assert any("the checkpoint's ranks are those of the process_group given, the job's ranks 1, 3" in s
                   for s in said), said


def test_a_manager_on_a_subgroup_names_the_jobs_rank_beside_the_groups(tmp_path):
    """A manager on ranks 1 and 3 of four named a failure on rank 3 of the job "rank 1": the log
    a user opens is the job's rank's."""
    spawn(4, _subgroup_names_job_ranks, str(tmp_path / "ckpt"))
