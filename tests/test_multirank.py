"""Real multi-rank runs over gloo: bit-identical resume, resharding, the seed checkpoint."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import logging
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from torchtitan_ckpt import CheckpointManager, commit, layout
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.errors import CheckpointError
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.example.train import build_model, shard_model
from torchtitan_ckpt.storage.local import LOCK_FILE

from .helpers import (DEBUG_CONFIG, ROOT, Holder, TensorState, assert_same, fail_reads_after_fill, losses,
                      read_checkpoint, run_job, spawn, stay_until, then_release, within)

pytestmark = pytest.mark.multirank

FULL_LAST = ("--checkpoint.last_save_model_only", "false", "--checkpoint.export_dtype", "float32",
             "--checkpoint.keep_latest_k", "0")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """20 steps straight on 2 ranks, and 10 steps + a new job resuming to 20."""
    straight = str(tmp_path_factory.mktemp("straight"))
    resumed = str(tmp_path_factory.mktemp("resumed"))
    log_straight = run_job(straight, *FULL_LAST, nproc=2)
    log_first = run_job(resumed, *FULL_LAST, "--training.stop_at_step", "10", nproc=2)
    log_second = run_job(resumed, *FULL_LAST, nproc=2)
    return straight, resumed, log_straight, log_first, log_second


def test_resume_is_bit_identical(two_rank_runs):
    straight, resumed, log_straight, log_first, log_second = two_rank_runs
    assert "loaded" in log_second and "step-10" in log_second
    assert sorted(losses(log_first)) == list(range(1, 11))
    assert sorted(losses(log_second)) == list(range(11, 21))  # it resumed, it did not restart
    expected = {s: loss for s, loss in losses(log_straight).items() if s > 10}
    assert losses(log_second) == expected
    a = read_checkpoint(layout.step_dir(os.path.join(straight, "checkpoint"), 20))
    b = read_checkpoint(layout.step_dir(os.path.join(resumed, "checkpoint"), 20))
    assert any(k.startswith("optimizer.state.") for k in a)
    assert_same(a, b)  # every weight, optimizer moment, scheduler and dataloader value


def test_background_saves_equal_synchronous_ones(two_rank_runs, tmp_path):
    """The job mutates weights and optimizer state in place right after every save() returns."""
    straight = os.path.join(two_rank_runs[0], "checkpoint")
    run_job(str(tmp_path), *FULL_LAST, "--checkpoint.async_mode", "async_with_pinned_mem", nproc=2)
    folder = os.path.join(tmp_path, "checkpoint")
    assert layout.committed_steps(folder) == [5, 10, 15, 20]
    for step in (5, 20):
        assert_same(read_checkpoint(layout.step_dir(straight, step)), read_checkpoint(layout.step_dir(folder, step)))


def _commit_interrupted_on_rank_0(rank: int, world_size: int, folder: str) -> None:
    from torchtitan_ckpt.errors import CheckpointSaveError
    from torchtitan_ckpt.storage.local import LocalStore

    model = build_model(load_job_config(None, []))
    shard_model(model, world_size)
    config = Checkpoint(enable=True, interval=1, keep_latest_k=0, collective_timeout_s=30)  # bounded if it fails
    manager = CheckpointManager(config, [model], base_folder=folder)
    manager.save(1)
    if rank == 0:
        def interrupted(*_args, **_kwargs):
            raise KeyboardInterrupt  # a SIGINT arriving while rank 0 writes the commit marker

        real, LocalStore.commit = LocalStore.commit, interrupted
        try:
            with pytest.raises(KeyboardInterrupt):
                manager.save(2)
        finally:
            LocalStore.commit = real
    else:
        with pytest.raises(CheckpointSaveError, match="rank 0: KeyboardInterrupt"):
            manager.save(2)
    manager.close()  # rank 0's next rounds (a job's `finally`) are not taken for its commit's
    assert layout.committed_steps(os.path.join(folder, "checkpoint")) == [1]


def test_a_rank_interrupted_in_its_commit_fails_the_save_on_every_rank(tmp_path):
    spawn(2, _commit_interrupted_on_rank_0, str(tmp_path))


def _saved_then_fresh(world_size: int, folder: str) -> CheckpointManager:
    """Step 1 saved by a model sharded over the ranks, and a manager of another such model (its
    seed another) to load it into."""
    config = Checkpoint(enable=True, interval=1, keep_latest_k=0, collective_timeout_s=30)
    model = build_model(load_job_config(None, []))
    shard_model(model, world_size)
    with CheckpointManager(config, [model], optimizers=torch.optim.AdamW(model.parameters()),
                           base_folder=folder) as manager:
        manager.save(1)
    fresh = build_model(load_job_config(None, ["--training.seed", "7"]))
    shard_model(fresh, world_size)
    return CheckpointManager(config, [fresh], optimizers=torch.optim.AdamW(fresh.parameters()), base_folder=folder)


def _load_interrupted_on_rank_0(rank: int, world_size: int, folder: str) -> None:
    from torchtitan_ckpt.errors import CheckpointError, PartialLoadError
    from torchtitan_ckpt.io import reader

    with _saved_then_fresh(world_size, folder) as manager:
        if rank == 0:
            def interrupted(self, planner):
                real(self, planner)
                raise KeyboardInterrupt  # a SIGINT as rank 0's tensors are filled

            real, reader.ItemReader.fill = reader.ItemReader.fill, interrupted
            try:
                with pytest.raises(KeyboardInterrupt):
                    manager.load()
            finally:
                reader.ItemReader.fill = real
        else:  # its tensors are filled too, its optimizer not: half loaded as well
            with pytest.raises(PartialLoadError, match="KeyboardInterrupt"):
                manager.load()
        with pytest.raises(CheckpointError, match=r"save\(2\) refused: the job's state is not one step's"):
            manager.save(2)


def test_a_rank_interrupted_while_loading_leaves_every_rank_refusing_to_save(tmp_path):
    spawn(2, _load_interrupted_on_rank_0, str(tmp_path))


def _load_telling_its_bytes(rank: int, world_size: int, folder: str) -> None:
    from torch.distributed.tensor import DTensor

    from torchtitan_ckpt.progress import fmt_bytes

    told: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: told.append(record.getMessage())
    logging.getLogger("torchtitan_ckpt.manager").addHandler(handler)
    logging.getLogger("torchtitan_ckpt.manager").setLevel(logging.INFO)
    with _saved_then_fresh(world_size, folder) as manager:
        assert manager.load()
        tensors = manager._model.state_dict().values()  # noqa: SLF001 - what each rank reads into
    # a shard is read by its rank alone, a tensor every rank holds whole by every rank
    read = sum(t.numel() * t.element_size() * (1 if isinstance(t, DTensor) else world_size) for t in tensors)
    if rank == 0:
        assert f": {fmt_bytes(read)} in " in next(m for m in told if m.startswith("loaded ")), told


def test_a_load_tells_the_bytes_every_rank_read(tmp_path):
    spawn(2, _load_telling_its_bytes, str(tmp_path))


def _load_failing_on_rank_1(rank: int, world_size: int, folder: str) -> None:
    from torchtitan_ckpt.errors import PartialLoadError

    with _saved_then_fresh(world_size, folder) as manager:
        if rank == 1:
            fail_reads_after_fill()
        with pytest.raises(PartialLoadError) as failed:
            manager.load()
        step = os.path.join(folder, "checkpoint", "step-1")
        says = f"loading {step} failed{' on rank 1' if rank == 0 else ''} after it had begun writing the job's " \
               "tensors in place (OSError: [Errno 5] Input/output error); the model and optimizer"
        assert str(failed.value).startswith(says), str(failed.value)
        assert str(failed.value).count("loading") == 1 and "RankFailed" not in str(failed.value)
        assert str(failed.value).endswith("do not train or save them; load a step again, or restart the job")


def test_a_load_failing_on_one_rank_is_told_once_on_the_others_naming_the_rank(tmp_path):
    """Rank 0 nested rank 1's whole message in its own, with an internal type's name."""
    spawn(2, _load_failing_on_rank_1, str(tmp_path))


class _RemovesTheNewest:
    """A state whose `state_dict()`, which a load calls once it has chosen its step, removes the
    newest complete step on rank 0 (as another job's retention would) the first time."""

    def __init__(self, folder: str, rank: int):
        self.folder, self.rank, self.done = folder, rank, False

    def state_dict(self):
        if self.rank == 0 and not self.done:
            self.done = True
            commit.remove_step(layout.step_dir(self.folder, layout.committed_steps(self.folder)[-1]))
        return {"n": 1}

    def load_state_dict(self, state):
        pass


def _load_while_the_step_is_removed(rank: int, world_size: int, folder: str) -> None:
    config = Checkpoint(enable=True, interval=1, keep_latest_k=0, collective_timeout_s=30)
    model = build_model(load_job_config(None, []))
    shard_model(model, world_size)
    with CheckpointManager(config, [model], states={"other": _RemovesTheNewest("", 1)}, base_folder=folder) as manager:
        manager.save(1)
        manager.save(2)
    fresh = build_model(load_job_config(None, ["--training.seed", "7"]))
    shard_model(fresh, world_size)
    other = _RemovesTheNewest(os.path.join(folder, "checkpoint"), rank)
    with CheckpointManager(Checkpoint(enable=True, load_only=True, collective_timeout_s=30), [fresh],
                           states={"other": other}, base_folder=folder) as manager:
        assert manager.load()
    assert layout.committed_steps(os.path.join(folder, "checkpoint")) == [1]
    expected = {k: v.full_tensor() for k, v in model.state_dict().items()}  # step 2 held the same weights
    assert_same({k: v.full_tensor() for k, v in fresh.state_dict().items()}, expected)


def test_every_rank_passes_over_a_step_removed_while_it_is_read(tmp_path):
    """Rank 0 finds the step gone, rank 1 reads its share: every rank looks for the newest step
    again, together, and loads step 1."""
    spawn(2, _load_while_the_step_is_removed, str(tmp_path))


def _restart_keeping_fewer(rank: int, world_size: int, folder: str) -> None:
    model = torch.nn.Linear(4, 4)
    config = Checkpoint(enable=True, folder=folder, interval=1, keep_latest_k=3, last_save_model_only=False)
    with CheckpointManager(config, [model]) as manager:
        for step in (1, 2, 3):
            manager.save(step)
    if rank == 0:  # a save of step 5 killed: partial
        shutil.copytree(layout.step_dir(folder, 3), layout.step_dir(folder, 5))
        commit.uncommit(layout.step_dir(folder, 5))
    with CheckpointManager(replace(config, keep_latest_k=1), [model]) as manager:
        assert manager.load()  # rank 0 deletes steps 1, 2 and 5 while rank 1 waits in the round
        assert [(f.step, f.status) for f in layout.scan(folder)] == [(3, "complete")]
        manager.save(4)
    if rank == 0:  # its close() finished the deletions retention queued after save(4)
        assert layout.committed_steps(folder) == [4]


def test_a_restart_with_fewer_steps_kept_deletes_them_on_rank_0_at_load(tmp_path):
    """Retention at `load()` (a full disk's way out) runs on rank 0 in a round every rank joins."""
    spawn(2, _restart_keeping_fewer, str(tmp_path / "checkpoint"))


def _load_sharded(rank: int, world_size: int, dump_folder: str, load_step: int, out: str) -> None:
    config = load_job_config(DEBUG_CONFIG, ["--job.dump_folder", dump_folder, "--training.seed", "1234",
                                            "--checkpoint.load_step", str(load_step)])
    model = build_model(config)  # a different init, so the values must come from the checkpoint
    shard_model(model, world_size)
    with CheckpointManager(config.checkpoint, [model], base_folder=dump_folder) as manager:
        assert manager.load()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, out)


@pytest.mark.parametrize("world_size", [1, 3])
def test_checkpoint_from_2_ranks_loads_on_other_world_sizes(two_rank_runs, world_size, tmp_path):
    straight = two_rank_runs[0]
    saved = read_checkpoint(layout.step_dir(os.path.join(straight, "checkpoint"), 10))
    out = str(tmp_path / "model.pt")
    spawn(world_size, _load_sharded, straight, 10, out)
    loaded = torch.load(out, weights_only=True)
    assert loaded and set(loaded) <= set(saved)
    assert_same(loaded, {k: saved[k] for k in loaded})


def test_seed_checkpoint_from_one_process_loads_on_two_ranks(tmp_path):
    dump = str(tmp_path)
    run_job(dump, "--checkpoint.create_seed_checkpoint", "true")
    step0 = layout.step_dir(os.path.join(dump, "checkpoint"), 0)
    assert commit.read_marker(step0).states == ["model"]
    out = str(tmp_path / "model.pt")
    spawn(2, _load_sharded, dump, 0, out)
    expected = build_model(load_job_config(DEBUG_CONFIG)).state_dict()
    assert_same(torch.load(out, weights_only=True), expected)


def _wait_for_partial_step(folder: str, proc: subprocess.Popen, timeout: float = 120) -> int | None:
    """Poll until a step folder holds data but no commit marker (a save in flight)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for s in layout.scan(folder):
            if not s.committed and any(n.endswith(".distcp") for n in os.listdir(s.path)):
                return s.step
        time.sleep(0.002)
    return None


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every rank it started, at once, as a node failure would."""
    for p in [pid, *_descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_kill_during_background_save_resumes_from_previous_step(tmp_path, mode):
    dump = str(tmp_path)
    folder = os.path.join(dump, "checkpoint")
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "torchtitan_ckpt.example.train", "--config", DEBUG_CONFIG, "--job.dump_folder", dump,
            "--checkpoint.interval", "2", "--checkpoint.async_mode", mode,
            "--checkpoint.keep_latest_k", "0"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        killed_at = _wait_for_partial_step(folder, proc)
    finally:
        _kill_tree(proc.pid)  # every rank and the launcher, mid-write
        proc.wait()
    assert killed_at is not None, "the job ended before a background save could be caught in flight"
    steps = {s.step: s.committed for s in layout.scan(folder)}
    if steps.get(killed_at):
        pytest.skip("the save committed between detection and the kill; nothing to check")
    previous = max((s for s, ok in steps.items() if ok), default=0)
    assert previous < killed_at
    log = run_job(dump, "--checkpoint.interval", "2", nproc=2)
    if previous:
        assert f"loaded step {previous} from {layout.step_dir(folder, previous)}" in log
    assert f"ignoring {layout.step_dir(folder, killed_at)}: its save did not finish" in log
    assert sorted(losses(log)) == list(range(previous + 1, 21))


def _load_with_a_stale_view(rank: int, world_size: int, folder: str, out: str) -> None:
    """Rank 1's file system still shows step 10 without its marker (a node caching an older
    listing, as an NFS client may): every rank loads the step rank 0 sees."""
    from torchtitan_ckpt.storage.local import LocalStore  # noqa: PLC0415

    if rank == 1:
        real = LocalStore.scan
        LocalStore.scan = lambda self, path: [layout.StepFolder(f.step, f.path, layout.PARTIAL, f.linked)
                                              if f.step == 10 else f for f in real(self, path)]
    model = torch.nn.Linear(4, 4)
    config = Checkpoint(enable=True, folder=folder, interval=5, load_only=True)
    with CheckpointManager(config, [model]) as manager:
        assert manager.load()
    torch.save(model.weight.detach().clone(), os.path.join(out, f"rank{rank}.pt"))


def test_every_rank_loads_the_step_rank_0_sees(tmp_path):
    """Each rank listed the folder and chose a step alone: rank 1, whose view lagged, loaded
    step 5 while rank 0 loaded step 10, and no error said so."""
    folder = str(tmp_path / "checkpoint")
    model = torch.nn.Linear(4, 4)
    with CheckpointManager(Checkpoint(enable=True, folder=folder, interval=5, keep_latest_k=0), [model]) as manager:
        for step in (5, 10):
            torch.nn.init.constant_(model.weight, float(step))
            manager.save(step)
    spawn(2, _load_with_a_stale_view, folder, str(tmp_path))
    for rank in (0, 1):
        assert torch.equal(torch.load(tmp_path / f"rank{rank}.pt"), torch.full((4, 4), 10.0)), rank


def _start_in_own_folder(rank: int, world_size: int, base: str) -> None:
    from torchtitan_ckpt.errors import ConfigError  # noqa: PLC0415

    config = Checkpoint(enable=True, folder=os.path.join(base, f"rank{rank}"))
    try:
        CheckpointManager(config, [torch.nn.Linear(2, 2)])
    except ConfigError as e:
        with open(os.path.join(base, f"error{rank}"), "w") as f:
            f.write(str(e))


def test_ranks_naming_different_folders_all_fail_at_start(tmp_path):
    """Only the rank that differed from rank 0 raised; rank 0 went on to the next collective and
    failed there with a gloo error that said nothing of the folder."""
    spawn(2, _start_in_own_folder, str(tmp_path))
    for rank in (0, 1):
        assert (tmp_path / f"error{rank}").read_text().endswith(
            f"every rank must use the same folder; rank 0 uses {tmp_path}/rank0, rank 1 {tmp_path}/rank1 (a relative "
            "folder resolved in another working directory? or managers made in another order on each rank: every "
            "rank makes them in one order)"), rank


def _configured_otherwise(rank: int, world_size: int, folder: str) -> None:
    from torchtitan_ckpt.errors import ConfigError  # noqa: PLC0415

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=rf"^checkpoint.interval = {1 + rank}: every rank must have the same setting; "
                                          r"rank 0 has 1, rank 1 2 \(and checkpoint.keep_latest_k\): give every "
                                          r"rank the same config and overrides$"), within(30):
        CheckpointManager(Checkpoint(enable=True, folder=folder, interval=1 + rank, save_threads=1 + rank,
                                     keep_latest_k=3 + rank), [model])
    # a setting whose own checks (the adapter it needs, the export's round) ran first on that rank alone
    with pytest.raises(ConfigError, match=r"^checkpoint.last_save_in_hf = .*: every rank must have the same setting; "
                                          r"rank 0 has False, rank 1 True"), within(30):
        CheckpointManager(Checkpoint(enable=True, folder=folder, last_save_in_hf=rank == 1), [model])
    config = Checkpoint(enable=True, folder=folder, interval=1, save_threads=1 + rank)  # a rank's own: it may differ
    with CheckpointManager(config, [model]) as manager:
        manager.save(1)
        manager.save(2)
        with pytest.raises(CheckpointError, match=r"^the ranks called load\(\) otherwise: rank 0 loads step 1, rank 1 "
                                                  r"loads the newest step; every rank calls load\(\) alike$"), within(30):
            manager.load(1 if rank == 0 else -1)
        assert manager.load(1)  # the ranks go on together


def test_ranks_configured_or_loading_otherwise_fail_at_once_naming_what_differs(tmp_path):
    """Ranks with another interval waited on each other until the collective timeout (600 s by
    default) with a message of ranks not joining, or (keep_latest_k, exclude_from_loading)
    went on, rank 0's setting winning unsaid; ranks loading other steps were told the step's
    marker differed among them, as on node-local disks."""
    spawn(2, _configured_otherwise, str(tmp_path / "checkpoint"))


def _save_otherwise(rank: int, world_size: int, folder: str, how: str) -> None:
    from torchtitan_ckpt.errors import CheckpointSaveError, CollectiveError  # noqa: PLC0415

    model = torch.nn.Linear(4, 4)
    config = Checkpoint(enable=True, folder=folder, interval=1, keep_latest_k=0, last_save_model_only=True,
                        collective_timeout_s=10)
    done = folder + ".done"
    with CheckpointManager(config, [model]) as manager:
        manager.save(1)
        if how == "load" and rank == 0:  # rank 1 goes to a save without the load
            # rank 1's save fails and it leaves: counted into fewer collectives than rank 0, or not
            with pytest.raises(CollectiveError, match=r"rank\(s\) 1 had not entered it|another rank did not join it "
                                                      r"within"):
                manager.load()
            return
        step, last = (2 + rank, False) if how == "steps" else (2, rank == 0)
        others = {"steps": "rank 0 saves step 2 (full, dcp), rank 1 saves step 3 (full, dcp)",
                  "last_step": "rank 0 saves step 2 (model_only, dcp, last_step), rank 1 saves step 2 (full, dcp)",
                  "load": "rank 0 is not saving (it is in another call of the manager, load() say), rank 1 saves "
                          "step 2 (full, dcp)"}[how]
        expected = rf"saving step {step} .* the ranks called save\(\) otherwise: {re.escape(others)}; every rank"
        with pytest.raises(CheckpointSaveError, match=expected):
            manager.save(step, last_step=last)
        if how == "steps" and rank == 0:
            stay_until(done)  # rank 1 goes on alone to a save rank 0 never joins
        elif how == "steps":
            alone = (r"saving step 4 .* CollectiveError: a collective among the checkpoint's 2 ranks failed on rank 1 "
                     r".*: rank\(s\) 0 had not entered it after .* checkpoint.collective_timeout_s = 10 s")
            with then_release(done), pytest.raises(CheckpointSaveError, match=alone):
                manager.save(4)


@pytest.mark.parametrize("how", ["steps", "last_step", "load"])
def test_ranks_that_call_save_otherwise_fail_before_anything_is_written(tmp_path, how):
    """Rank 0 at save(1), rank 1 at save(2): each wrote its own step folder, rank 1's holding
    its file alone and no marker (another program's, to every later job: never removed, and a
    save of that step refused). Ranks that disagreed on last_step committed a step whose
    marker listed the model alone over the optimizer's state, in two dtypes."""
    folder = str(tmp_path / "checkpoint")
    spawn(2, _save_otherwise, folder, how)
    assert sorted(os.listdir(folder)) == [LOCK_FILE, "step-1"]


def _rank_1_never_builds_its_manager(rank: int, world_size: int, folder: str) -> None:
    from torchtitan_ckpt.errors import CollectiveError  # noqa: PLC0415

    if rank == 1:  # its manager is disabled: it makes none of the checkpoint's collectives
        CheckpointManager(Checkpoint(enable=False, folder=folder), [torch.nn.Linear(2, 2)]).close()
        time.sleep(6)
        return
    with pytest.raises(CollectiveError, match=r"failed on rank 0 .* another rank did not join it within "
                                              r"checkpoint.collective_timeout_s = 2 s.* Every rank makes its "
                                              r"CheckpointManager, with checkpoint.enable = true \(a disabled one "
                                              r"makes no group\)"):
        CheckpointManager(Checkpoint(enable=True, folder=folder, collective_timeout_s=2), [torch.nn.Linear(2, 2)])


def test_a_rank_that_never_builds_its_manager_fails_the_others_with_our_error(tmp_path):
    """The group the manager makes is made collectively: torch's DistStoreError ("wait timeout
    after 2000ms, keys: /default_pg/...") said nothing of what to look for."""
    spawn(2, _rank_1_never_builds_its_manager, str(tmp_path / "checkpoint"))


def _replicas_that_differ(rank: int, world_size: int, folder: str, how: str) -> None:
    from torchtitan_ckpt.errors import CheckpointSaveError  # noqa: PLC0415

    width = 32 if how == "shape" and rank == 1 else 16
    model = torch.nn.Linear(width, 4).to(torch.bfloat16 if how == "dtype" and rank == 1 else torch.float32)
    tokens = {"seen": torch.zeros(3 + rank if how == "state" else 3)}  # a rank's own, under one name
    differ = {"shape": r"weight otherwise \(float32\[4, 16\] and float32\[4, 32\]\)",
              "dtype": r"weight otherwise \(float32\[4, 16\] and bfloat16\[4, 16\]\)",
              "state": r"tokens.seen otherwise \(float32\[3\] and float32\[4\]\)"}
    with CheckpointManager(Checkpoint(enable=True, folder=folder, interval=1), [model],
                           states={"tokens": Holder(tokens)}) as manager:
        with pytest.raises(CheckpointSaveError, match=rf"saving step 1 .* ranks 0 and 1 hold {differ[how]}: the ranks "
                                                      r"save one tensor of each name, so the ranks' models differ, or a "
                                                      r"state keeps each rank's own tensor under one name \(key it by "
                                                      r"rank: docs/quickstart.md\)"):
            manager.save(1)


@pytest.mark.parametrize("how", ["shape", "dtype", "state"])
def test_ranks_whose_replicas_differ_fail_the_save(tmp_path, how):
    """Each tensor was written by one of the ranks holding it: a step of both models was
    committed, which fit neither (shapes) or held two dtypes without a word."""
    folder = str(tmp_path / "checkpoint")
    spawn(2, _replicas_that_differ, folder, how)
    assert layout.committed_steps(folder) == []


def _metadata_past_the_load_bound(rank: int, world_size: int, folder: str, engine: str) -> None:
    from torchtitan_ckpt.dcp import metadata  # noqa: PLC0415
    from torchtitan_ckpt.errors import CheckpointSaveError  # noqa: PLC0415

    model = torch.nn.Linear(16, 4)
    config = Checkpoint(enable=True, folder=folder, interval=1, io_engine=engine)
    with CheckpointManager(config, [model]) as manager:
        manager.save(1)
        size = os.path.getsize(os.path.join(folder, "step-1", metadata.METADATA_FILE))
        bound, metadata.MAX_METADATA_BYTES = metadata.MAX_METADATA_BYTES, size - 1  # as a job of more shards
        try:
            with pytest.raises(CheckpointSaveError, match=rf"saving step 2 .*step-2 failed( on rank 0)?: .*its "
                                                          rf"\.metadata is {size} bytes, more than the {size - 1} a "
                                                          r"load reads: this job's steps could never be loaded\. It "
                                                          r"lists 2 chunks of 2 entries"):
                manager.save(2)
        finally:
            metadata.MAX_METADATA_BYTES = bound
    with CheckpointManager(config, [torch.nn.Linear(16, 4)]) as manager:
        assert manager.load()  # the step before
        assert layout.committed_steps(folder) == [1]


@pytest.mark.parametrize("engine", ["fast", "torch"])
def test_a_save_whose_metadata_a_load_would_refuse_fails_on_every_rank(tmp_path, engine):
    """A `.metadata` over the bound a load reads (a state sharded over thousands of ranks) was
    saved without a word, and every step of the job refused at the resume."""
    spawn(2, _metadata_past_the_load_bound, str(tmp_path / "checkpoint"), engine)


def _a_file_rank_0_does_not_see(rank: int, world_size: int, folder: str, engine: str) -> None:
    from torchtitan_ckpt.dcp import storage  # noqa: PLC0415
    from torchtitan_ckpt.errors import CheckpointSaveError  # noqa: PLC0415

    config = Checkpoint(enable=True, folder=folder, interval=1, io_engine=engine, keep_latest_k=1)
    with CheckpointManager(config, [torch.nn.Linear(16, 4)]) as manager:
        manager.save(1)
        if rank == 1:  # its file is written and reported, then gone from where rank 0 looks (a disk of its own)
            writer = storage.TorchFileWriter if engine == "torch" else storage.DataFileWriter
            reported = writer.durable

            def then_lost(self):
                files = reported(self)
                assert files, "rank 1 wrote no file"
                for rel in files:
                    os.unlink(os.path.join(self.path, rel))
                return files
            writer.durable = then_lost
        with pytest.raises(CheckpointSaveError, match=r"saving step 2 .*\['__1_0.distcp'\] \(1 files\) were written "
                                                      r"but are not in the step folder; the step is not committed"):
            manager.save(2)
    with CheckpointManager(config, [torch.nn.Linear(16, 4)]) as manager:
        assert manager.load()  # step 1, which retention kept
        assert layout.committed_steps(folder) == [1]


@pytest.mark.parametrize("engine", ["fast", "torch"])
def test_a_save_fails_when_rank_0_does_not_see_a_file_another_rank_wrote(tmp_path, engine):
    """With `io_engine = "torch"` no rank reported its files: rank 0 committed the step from its
    own listing, without the file it could not see, and retention then deleted the last step
    that loaded."""
    spawn(2, _a_file_rank_0_does_not_see, str(tmp_path / "checkpoint"), engine)


def _ddp_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _save_under_ddp(rank: int, world_size: int, folder: str) -> None:
    model = _ddp_model(0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.1)
    ddp(torch.ones(3, 4)).sum().backward()
    opt.step()
    with CheckpointManager(Checkpoint(enable=True, interval=1), [ddp], optimizers=opt, base_folder=folder) as manager:
        manager.save(1)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, os.path.join(folder, "saved.pt"))


def test_a_model_trained_under_ddp_is_saved_under_its_own_names_and_resumes_without_ddp(tmp_path):
    """DDP's `module.` prefix was saved in every key: the step loaded only into a DDP model."""
    spawn(2, _save_under_ddp, str(tmp_path))
    saved = read_checkpoint(layout.step_dir(str(tmp_path / "checkpoint"), 1))
    assert sorted(k for k in saved if not k.startswith("optimizer.")) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert sorted(k for k in saved if k.startswith("optimizer.state."))[:3] == [
        "optimizer.state.0.bias.exp_avg", "optimizer.state.0.bias.exp_avg_sq", "optimizer.state.0.bias.step"]
    want = torch.load(tmp_path / "saved.pt")
    fresh = _ddp_model(1)
    opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with CheckpointManager(Checkpoint(enable=True), [torch.compile(fresh)], optimizers=opt,
                           base_folder=str(tmp_path)) as manager:
        assert manager.load()
    assert_same(fresh.state_dict(), want["model"])
    got = opt.state_dict()["state"]
    assert sorted(got) == sorted(want["optimizer"]["state"]) == [0, 1, 2, 3]
    for index, values in want["optimizer"]["state"].items():
        assert_same(got[index], values)



def _frozen_since_the_save(rank: int, world_size: int, folder: str) -> None:
    """Each rank a pipeline stage of names of its own, its optimizer over its own parameters
    but those `frozen` on rank 1. Rank 0 warns of optimizer state left unloaded after a load
    with stage1.bias frozen, not after one with nothing frozen."""
    def stage(frozen: tuple[str, ...]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(rank)
        part = torch.nn.ModuleDict({f"stage{rank}": torch.nn.Linear(2, 2)})
        params = [p for n, p in part.named_parameters() if rank == 0 or n not in frozen]
        return part, torch.optim.AdamW(params, lr=0.1)

    part, opt = stage(())
    part[f"stage{rank}"](torch.ones(1, 2)).sum().backward()
    opt.step()
    saved = opt.state_dict()["state"][0]["exp_avg"].clone()
    config = Checkpoint(enable=True, folder=folder, interval=1, last_save_model_only=False)
    with CheckpointManager(config, [part], optimizers=opt) as manager:
        manager.save(1)
    said: list[list[str]] = []
    handler = logging.Handler()
    handler.emit = lambda record: said[-1].append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchtitan_ckpt").addHandler(handler)
    for frozen in ((), ("stage1.bias",)):
        said.append([])
        part, opt = stage(frozen)
        with CheckpointManager(config, [part], optimizers=opt) as manager:
            assert manager.load()
        assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved)  # the weight's, loaded
    if rank == 0:
        assert [[m for m in ms if "optimizer state" in m] for ms in said] == [[], [
            f"{folder}/step-1 holds optimizer state for 1 parameter no optimizer of this job holds, e.g. "
            "['stage1.bias']: it is not loaded, and their optimizer state starts anew if they are trained again "
            "(frozen since the save, or left out of the optimizer by mistake?)"]]


def test_optimizer_state_no_rank_holds_is_said_once(tmp_path):
    """A parameter frozen since the save lost its optimizer state without a word; pipeline
    stages, each holding its own parameters, are no such loss."""
    spawn(2, _frozen_since_the_save, str(tmp_path / "checkpoint"))


def _trainable_since_the_save(rank: int, world_size: int, folder: str) -> None:
    """Each rank a pipeline stage of names of its own; saved with stage1.bias frozen (rank 1's
    optimizer over its weight alone, at a rate the schedule lowered to 0.05), resumed with it
    trainable: first in the weight's group, then in a group of its own at 0.2."""
    def stage(groups: list[dict]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(rank)
        part = torch.nn.ModuleDict({f"stage{rank}": torch.nn.Linear(2, 2)})
        named = dict(part.named_parameters())
        return part, torch.optim.AdamW([{**g, "params": [named[n] for n in g["params"]]} for g in groups], lr=0.1)

    weight, bias = f"stage{rank}.weight", f"stage{rank}.bias"
    part, opt = stage([{"params": [weight, bias] if rank == 0 else [weight]}])
    part[f"stage{rank}"](torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.param_groups[0]["lr"] = 0.05
    saved = opt.state_dict()["state"][0]["exp_avg"].clone()
    config = Checkpoint(enable=True, folder=folder, interval=1, last_save_model_only=False)
    with CheckpointManager(config, [part], optimizers=opt) as manager:
        manager.save(1)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchtitan_ckpt").addHandler(handler)
    for groups, rates in [([{"params": [bias, weight]}], [0.05]),
                          ([{"params": [weight]}, {"params": [bias], "lr": 0.2}], [0.05, 0.2])]:
        part, opt = stage(groups)
        with CheckpointManager(config, [part], optimizers=opt) as manager:
            assert manager.load()
        state = {name: opt.state[p] for name, p in part.named_parameters()}
        assert torch.equal(state[weight]["exp_avg"], saved) and (rank == 0) == bool(state[bias])
        assert [g["lr"] for g in opt.param_groups] == (rates if rank else [0.05] * len(groups))
        part[f"stage{rank}"](torch.ones(1, 2)).sum().backward()
        opt.step()  # the new parameter's state starts now
        assert all(opt.state[p] for p in part.parameters())
    if rank == 0:
        warned = [m for m in said if "no optimizer state or settings" in m]
        assert warned == 2 * [f"{folder}/step-1 holds no optimizer state or settings for 1 parameters this job's "
                              "optimizer holds, e.g. ['stage1.bias']: they start without state, with their param "
                              "group's settings (trainable since the save? or tied to another parameter then, and "
                              "no longer: to_empty() on a model built on the meta device unties; tie them again)"]


def test_a_parameter_trainable_since_the_save_starts_fresh_and_is_said_once(tmp_path):
    """Gradual unfreezing: a parameter frozen when saved, trainable at the resume, refused the
    whole optimizer's load ("no optimizer settings ... for 1 parameters"), whose only way out
    (exclude the optimizer) dropped every other parameter's moments. Now it starts without
    state and the rest loads; a group it shares with saved parameters takes their settings."""
    spawn(2, _trainable_since_the_save, str(tmp_path / "checkpoint"))


def _buffers_per_rank(rank: int, world_size: int, folder: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchtitan_ckpt").addHandler(handler)
    with CheckpointManager(Checkpoint(enable=True, folder=folder, interval=1), [model]) as manager:
        manager.save(1)  # the statistics alike: nothing said
        model(torch.full((4, 2), float(rank)) + torch.arange(4.0)[:, None])  # each rank's own batch, not synced
        manager.save(2)
        manager.save(3)  # said once
    if rank == 0:
        assert [m for m in said if "buffers" in m] == [
            "the model's buffers hold other values on rank(s) 1 than on rank(s) 0 (running statistics that FSDP does "
            "not sync, say): a step keeps one copy of each tensor that is not a DTensor (as replicated), each from any "
            "one rank, and a load gives every rank that copy. Sync them before a save (SyncBatchNorm, DDP's "
            "broadcast_buffers)"]


def test_model_buffers_that_differ_by_rank_are_warned_of_once(tmp_path):
    """BatchNorm under FSDP2, whose statistics no one syncs: each rank's came back as a mix of
    the ranks' (running_mean of one, running_var of another), without a word."""
    spawn(2, _buffers_per_rank, str(tmp_path / "checkpoint"))


class _RanksTokens:
    """A rank's count of tokens seen, keyed by rank as docs/quickstart.md says to key per-rank values."""

    def __init__(self, rank: int, tokens: int):
        self.rank, self.tokens = rank, torch.tensor(tokens)

    def state_dict(self) -> dict:
        return {f"rank_{self.rank}": self.tokens}

    def load_state_dict(self, state_dict: dict) -> None:
        self.tokens = state_dict[f"rank_{self.rank}"]


def _per_rank_job(rank: int, world_size: int, folder: str, save: bool) -> None:
    tokens = _RanksTokens(rank, 1000 * (rank + 1) if save else -1)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchtitan_ckpt").addHandler(handler)
    with CheckpointManager(Checkpoint(enable=True, folder=folder, interval=1, last_save_model_only=False),
                           [torch.nn.Linear(2, 2)], states={"tokens": tokens}) as manager:
        if save:
            manager.save(1)
        elif world_size == 1:  # after 2 ranks: rank 0's entry loads, rank 1's is said to be left
            assert manager.load() and tokens.tokens.item() == 1000
            assert f"{folder}/step-1 holds 1 entry of the job's own states that no rank loads, e.g. " \
                   "['tokens.rank_1'] (saved by 2 ranks, this job has 1): a state keyed by rank keeps the entries " \
                   "of the ranks a job has; they are not loaded" in " ".join(said)
        else:  # after 1 rank: rank 1 has no entry, and the message says why (it blamed the model)
            with pytest.raises(CheckpointError, match=r"lacks 1 entry of the state 'tokens' this job has, e\.g\. "
                                                      r"\['tokens\.rank_1'\] \(saved by 1 rank, this job has 2\): a "
                                                      "state keyed by rank has none for the ranks added; add 'tokens' "
                                                      "to checkpoint.exclude_from_loading"):
                manager.load()


def test_a_state_keyed_by_rank_resumed_at_another_world_size_is_said_so(tmp_path):
    """A job rescheduled on fewer ranks dropped the other ranks' entries without a word; on more,
    the load failed with "lacks ... tensors; was it saved from a different model?" (DCP's
    "Missing key" for values that are not tensors)."""
    spawn(2, _per_rank_job, str(tmp_path / "shrink"), True)
    spawn(1, _per_rank_job, str(tmp_path / "shrink"), False)
    spawn(1, _per_rank_job, str(tmp_path / "grow"), True)
    spawn(2, _per_rank_job, str(tmp_path / "grow"), False)


def _states_on_some_ranks(rank: int, world_size: int, folder: str) -> None:
    from torchtitan_ckpt.errors import CheckpointError  # noqa: PLC0415

    model = torch.nn.Linear(4, 4)
    config = Checkpoint(enable=True, folder=folder, interval=1)
    optimizer = torch.optim.AdamW(model.parameters()) if rank == 0 else None  # rank 1's part: no parameters
    with pytest.raises(CheckpointError, match=r"every rank must pass the manager the same kinds of state besides "
                                              r"the model; rank 0 passes \['optimizer'\], rank 1 none: "):
        CheckpointManager(config, [model], optimizer)
    user = {"user": TensorState(torch.zeros(2))} if rank == 1 else {}
    with pytest.raises(CheckpointError, match=r"rank 0 passes none, rank 1 \['user'\]"):
        CheckpointManager(config, [model], states=user)
    with CheckpointManager(config, [model]) as manager:  # nothing was held: a manager alike on every rank saves
        assert manager.save(1)


def test_ranks_passing_other_kinds_of_state_are_refused_at_start(tmp_path):
    """Rank 0 with an optimizer, rank 1 without (a pipeline stage with no parameters): the save
    committed rank 0's list of states, and every load then failed, rank 1 blaming node-local
    disks and rank 0 ranks out of step."""
    spawn(2, _states_on_some_ranks, str(tmp_path / "checkpoint"))


class _SlowToTake(TensorState):
    """A state whose load waits until `release` exists on rank 1 (a rank stuck in its own part)."""

    def __init__(self, value: torch.Tensor, release: str | None):
        super().__init__(value)
        self.release = release

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        if self.release is not None:
            stay_until(self.release)
        super().load_state_dict(sd)


def _a_rank_stuck_in_its_load(rank: int, world_size: int, folder: str, release: str) -> None:
    from torchtitan_ckpt.errors import PartialLoadError  # noqa: PLC0415

    torch.manual_seed(0)  # one model on both ranks (a replicated one is saved once)
    model = torch.nn.Linear(4, 4)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    slow = _SlowToTake(torch.zeros(2), release if rank == 1 else None)
    config = Checkpoint(enable=True, folder=folder, interval=1, collective_timeout_s=3)
    stack = then_release(release) if rank == 0 else contextlib.nullcontext()
    with stack, CheckpointManager(config, [model], states={"slow": slow}) as manager:
        manager.save(1)
        with torch.no_grad():
            model.weight.add_(1.0)
        with pytest.raises(PartialLoadError) as failed:
            manager.load(step=1)  # rank 0 waits its 3 s out for rank 1, whose tensors are read too
        # a later load would be refused: the text does not offer one
        assert str(failed.value).endswith("; restart the job (a collective failed: the ranks cannot run another)")
        assert torch.equal(model.weight, saved["weight"])  # read in place before the states' part
        with pytest.raises(CheckpointError, match=r"save\(2\) refused: the job's state is not one step's"):
            manager.save(2)


def test_a_load_whose_round_times_out_after_the_reads_is_a_partial_load(tmp_path):
    """A rank stuck in its states' part of a load (after every rank's tensors were read in place):
    the others' wait timed out with a CollectiveError, and nothing stopped them saving the
    half-loaded state."""
    spawn(2, _a_rank_stuck_in_its_load, str(tmp_path / "checkpoint"), str(tmp_path / "release"))
