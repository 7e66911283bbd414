"""Single-process round trips through real DCP files: what a save writes and what a load restores."""

from __future__ import annotations

import dataclasses
import gc
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan_ckpt import (Checkpoint, CheckpointError, CheckpointManager, CheckpointNotFoundError,
                             CheckpointSaveError, ConfigError, CorruptCheckpointError, commit, layout)
from torchtitan_ckpt import step_hooks
from torchtitan_ckpt.dcp.metadata import METADATA_FILE
from torchtitan_ckpt.formats.base import _nesting
from torchtitan_ckpt.storage.local import LOCK_FILE

from .helpers import Holder, TensorState, assert_same, data_file_use, forged_whole, read_checkpoint
from .jobs import make_job


def _folder(tmp_path) -> str:
    return os.path.join(tmp_path, "checkpoint")


def test_saves_at_interval_first_step_and_last_step(tmp_path):
    job = make_job(str(tmp_path), steps=7, interval=3, enable_first_step_checkpoint=True, keep_latest_k=0)
    job.run_to(7, steps=7)
    job.manager.close()
    assert layout.committed_steps(_folder(tmp_path)) == [1, 3, 6, 7]
    states = {s: commit.read_marker(layout.step_dir(_folder(tmp_path), s)).states for s in (3, 7)}
    assert states[3] == ["model", "optimizer", "lr_scheduler", "dataloader", "train_state"]
    assert states[7] == ["model"]


def test_last_step_is_model_only_in_export_dtype(tmp_path):
    job = make_job(str(tmp_path), steps=3, interval=10, export_dtype="bfloat16")
    job.run_to(3, steps=3)
    job.manager.close()
    saved = read_checkpoint(layout.step_dir(_folder(tmp_path), 3))
    expected = {k: v.to(torch.bfloat16) for k, v in job.model.state_dict().items()}
    assert "freqs_cis" not in saved  # a non-persistent buffer is not state
    assert_same(saved, expected)


def test_a_model_only_save_names_values_beyond_the_export_dtype(tmp_path, caplog):
    job = make_job(str(tmp_path), steps=3, interval=10, export_dtype="float16")
    job.run_to(2, steps=3)
    with torch.no_grad():
        job.model.norm.weight[0] = 1e6
    job.run_to(3, steps=3)
    job.manager.close()
    assert "norm.weight: 1 finite value(s) beyond float16's range (+-65504) are exported as inf" in caplog.messages
    assert read_checkpoint(layout.step_dir(_folder(tmp_path), 3))["norm.weight"][0] == float("inf")


@pytest.mark.parametrize("save_threads", [1, 3])
def test_resume_restores_every_state(tmp_path, save_threads):
    job = make_job(str(tmp_path), steps=8, interval=2, save_threads=save_threads)
    job.run_to(4, steps=8)
    job.manager.close()
    step4 = layout.step_dir(_folder(tmp_path), 4)
    use = data_file_use(step4)
    # the tensors, written while DCP plans, in `save_threads` files; then the values in as many
    assert list(use) == [f"__0_{i}.distcp" for i in range(2 * save_threads)]
    assert all(used == size for used, size in use.values())  # nothing written twice or unused
    later = [job.step() for _ in range(2)]  # what training would do after step 4

    fresh = make_job(str(tmp_path), steps=8, interval=2, init_seed=123)  # different init and data order
    assert fresh.manager.load()
    assert fresh.train_state.step == 4
    assert fresh.sched.last_epoch == 4
    assert [fresh.step() for _ in range(2)] == later
    assert_same(fresh.model.state_dict(), job.model.state_dict())
    fresh.manager.close()


def test_half_written_step_is_never_loaded_nor_counted(tmp_path):
    job = make_job(str(tmp_path), steps=20, interval=2, keep_latest_k=2)
    job.run_to(4, steps=20)
    folder = _folder(tmp_path)
    # a later save of ours that crashed before its commit: the data is there, the in-progress
    # marker too, the commit marker is not
    shutil.copytree(layout.step_dir(folder, 4), layout.step_dir(folder, 6))
    commit.uncommit(layout.step_dir(folder, 6))
    assert layout.status_of(layout.step_dir(folder, 6)) == layout.PARTIAL
    job.manager.close()

    fresh = make_job(str(tmp_path), steps=20, interval=2, keep_latest_k=2)
    assert fresh.manager.load()
    assert fresh.train_state.step == 4
    fresh.train_state.step = 100  # later saves
    for step in (102, 104):
        fresh.manager.save(step)
    fresh.manager.close()
    steps = {s.step: s.committed for s in layout.scan(folder)}
    # keep_latest_k = 2 counts complete steps only; the partial step 6 is older than the
    # newest complete step, so it is cleaned up too
    assert steps == {102: True, 104: True}


def test_many_steps_passed_over_for_one_reason_are_one_warning(tmp_path, caplog):
    """A job killed over and over left a partial step each time: one warning line apiece."""
    job = make_job(str(tmp_path), steps=20, interval=2)
    job.run_to(2, steps=20)
    job.manager.close()
    folder = _folder(tmp_path)
    for step in range(3, 8):
        os.mkdir(layout.step_dir(folder, step))
        commit.mark_in_progress(layout.step_dir(folder, step))
    fresh = make_job(str(tmp_path), steps=20, interval=2)
    assert fresh.manager.load() and fresh.train_state.step == 2
    fresh.manager.close()
    assert [m for m in caplog.messages if m.startswith("ignoring")] == [
        f"ignoring {layout.step_dir(folder, 3)}, {layout.step_dir(folder, 4)}, {layout.step_dir(folder, 5)} and 2 "
        f"more: its save did not finish (no {commit.MARKER})"]


def test_a_job_that_only_loads_tells_of_a_save_in_flight_at_info(tmp_path, caplog):
    """An evaluation job loading from a run that is training meets the training's save in flight
    (a partial step newer than every complete one) at almost every load: an INFO line, where a
    job that goes on training (a crashed save ahead of its resume) gets a warning. So does an
    empty step folder: one a save is starting in, or that a save stopped in before its first file."""
    job = make_job(str(tmp_path), steps=20, interval=2)
    job.run_to(2, steps=20)
    job.manager.close()
    os.mkdir(layout.step_dir(_folder(tmp_path), 4))
    commit.mark_in_progress(layout.step_dir(_folder(tmp_path), 4))
    os.mkdir(layout.step_dir(_folder(tmp_path), 5))  # another program's, which even a loading job is warned of
    (pathlib.Path(layout.step_dir(_folder(tmp_path), 5)) / "notes.txt").write_text("not a checkpoint")
    os.mkdir(layout.step_dir(_folder(tmp_path), 6))
    for load_only, level in ((True, "INFO"), (False, "WARNING")):
        caplog.clear()
        reader = make_job(str(tmp_path), steps=20, interval=2, load_only=load_only)
        assert reader.manager.load() and reader.train_state.step == 2
        reader.manager.close()
        told = {r.getMessage().split(":")[0]: r.levelname for r in caplog.records
                if r.getMessage().startswith("ignoring")}
        assert told == {f"ignoring {layout.step_dir(_folder(tmp_path), 4)}": level,
                        f"ignoring {layout.step_dir(_folder(tmp_path), 5)}": "WARNING",
                        f"ignoring {layout.step_dir(_folder(tmp_path), 6)}": level}
        assert (f"ignoring {layout.step_dir(_folder(tmp_path), 6)}: empty: a save that stopped (or is starting) "
                "before its first file; the save of its step replaces it") in caplog.messages


def test_keep_latest_k_keeps_newest_complete_steps(tmp_path):
    job = make_job(str(tmp_path), steps=10, interval=1, keep_latest_k=3, last_save_model_only=False)
    job.run_to(10, steps=10)
    job.manager.close()
    assert layout.committed_steps(_folder(tmp_path)) == [7, 8, 9, 10]  # k before the last save, as TorchTitan


def test_keep_latest_k_one_keeps_the_newest(tmp_path):
    job = make_job(str(tmp_path), steps=5, interval=1, keep_latest_k=1, last_save_model_only=False)
    job.run_to(5, steps=5)
    job.manager.close()
    assert layout.committed_steps(_folder(tmp_path)) == [4, 5]  # the last save runs no retention


def test_a_step_saved_again_while_retention_deletes_it_stays(tmp_path):
    """A step counter gone back in the process (no load between): `save(38)` right after
    `save(41)` queued the deletion of steps 1 to 40 on the background deleter. The deleter
    removed step 38 after its new save had committed (5 of 5 tries with 60 steps)."""
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(Checkpoint(enable=True, interval=1), [model], base_folder=str(tmp_path)) as manager:
        for step in range(1, 41):
            manager.save(step)
    with CheckpointManager(Checkpoint(enable=True, interval=1, keep_latest_k=1), [model],
                           base_folder=str(tmp_path)) as manager:
        assert manager.save(41) and manager.save(38)
    assert [(s.step, s.status) for s in layout.scan(_folder(tmp_path))][-2:] == [(38, "complete"), (41, "complete")]


def test_a_preemptions_forced_save_is_the_step_a_resume_takes(tmp_path):
    """The documented preemption pattern passed `last_step=True` at the preempted step: a
    model-only save, which the resume passed over for the last interval's step (3 steps lost)."""
    job = make_job(str(tmp_path), steps=20, interval=5)
    while job.train_state.step < 8:
        job.step()
        job.manager.save(job.train_state.step, force=job.train_state.step == 8)
    job.manager.close()
    resumed = make_job(str(tmp_path), steps=20, interval=5)
    assert resumed.manager.load() and resumed.train_state.step == 8
    assert_same(resumed.opt.state_dict()["state"][0], job.opt.state_dict()["state"][0])
    resumed.manager.close()


class _Retention:
    """A state whose `state_dict()`, which a load calls once it has chosen its step and read its
    index, removes the newest complete step first (`commit.remove_step`, as the retention of a
    job saving into the folder does), `times` times."""

    def __init__(self, folder: str, times: int):
        self.folder, self.times, self.removed = folder, times, []

    def state_dict(self):
        if len(self.removed) < self.times:
            self.removed.append(layout.committed_steps(self.folder)[-1])
            commit.remove_step(layout.step_dir(self.folder, self.removed[-1]))
        return {"n": 1}

    def load_state_dict(self, state):
        pass


def test_a_step_removed_while_it_is_read_is_passed_over_for_the_newest(tmp_path, caplog):
    """An evaluation job reading the folder of a training job that keeps one step: the step it
    read was removed under it, and its load failed as a damaged checkpoint (47 of 76 loads)."""
    job = make_job(str(tmp_path), steps=20, interval=1, extra_states={"other": _Retention("", 0)})
    job.run_to(6, steps=20)
    job.manager.close()
    folder = _folder(tmp_path)
    reader = make_job(str(tmp_path), steps=20, load_only=True, extra_states={"other": _Retention(folder, 2)})
    assert reader.manager.load() and reader.train_state.step == 4
    reader.manager.close()
    assert f"{folder}: step 6 was removed while it was read" in caplog.text
    reader = make_job(str(tmp_path), steps=20, load_only=True, extra_states={"other": _Retention(folder, 4)})
    with pytest.raises(CheckpointNotFoundError, match=r"steps were removed while this job read them, 4 times "
                                                      r"\(the last: step 1\): .*\(checkpoint.keep_latest_k\)"):
        reader.manager.load()
    reader.manager.close()


def test_exclude_from_loading_leaves_those_states_fresh(tmp_path):
    job = make_job(str(tmp_path), steps=8, interval=3)
    job.run_to(3, steps=8)
    job.manager.close()

    fresh = make_job(str(tmp_path), steps=8, interval=3, exclude_from_loading=["lr_scheduler", "dataloader"])
    assert fresh.manager.load()
    assert fresh.sched.last_epoch == 0  # scheduler not restored
    # dataloader not restored (its state is TorchTitan's layout: the position pickled per dp rank)
    assert pickle.loads(fresh.loader.state_dict()["dp_rank_0"])["_num_yielded"] == 0
    assert fresh.train_state.step == 3  # the rest is
    assert_same(fresh.opt.state_dict()["state"][0], job.opt.state_dict()["state"][0])
    fresh.manager.close()


def test_exclude_from_loading_must_name_a_state_of_the_job(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.exclude_from_loading.*no state named data_loader"):
        make_job(str(tmp_path), exclude_from_loading=["data_loader"])


def test_model_parts_whose_names_collide_are_refused(tmp_path):
    """The parts are saved as one flat dict: two parts with a `lin.weight` each saved and loaded
    one of them, without a word. A GAN's two models, given as two parts, are told the way in
    (the advice named pipeline stages alone, and the other ways in were refused in turn)."""
    parts = []
    for _ in range(2):
        part = torch.nn.Module()
        part.lin = torch.nn.Linear(4, 4)
        parts.append(part)
    with pytest.raises(ValueError, match=r"model parts 0 and 1 both have a state named 'lin.weight'.* go in as one part "
                                         r"naming each: nn.ModuleDict\(\{'generator': g, 'discriminator': d\}\)"):
        CheckpointManager(Checkpoint(enable=True), parts, base_folder=str(tmp_path))
    assert not (tmp_path / "checkpoint").exists()
    gan = torch.nn.ModuleDict({"generator": parts[0], "discriminator": parts[1]})
    optimizers = [torch.optim.Adam(p.parameters()) for p in parts]
    with CheckpointManager(Checkpoint(enable=True), [gan], optimizers=optimizers,
                           lr_schedulers=[torch.optim.lr_scheduler.StepLR(o, 2) for o in optimizers],
                           base_folder=str(tmp_path)) as manager:
        manager.save(1, force=True)
    assert {"generator.lin.weight", "discriminator.lin.weight"} <= set(read_checkpoint(str(tmp_path / "checkpoint" /
                                                                                          "step-1")))


def test_a_closed_manager_refuses_to_load(tmp_path):
    manager = CheckpointManager(Checkpoint(enable=True), [torch.nn.Linear(2, 2)], base_folder=str(tmp_path))
    manager.close()
    with pytest.raises(CheckpointError, match=r"load\(\) called after close\(\)"):
        manager.load()


def test_load_only_loads_but_never_saves(tmp_path):
    job = make_job(str(tmp_path), steps=8, interval=2)
    job.run_to(2, steps=8)
    job.manager.close()

    reader = make_job(str(tmp_path), steps=8, interval=2, load_only=True)
    assert reader.manager.load()
    reader.run_to(6, steps=8)
    reader.manager.close()
    assert layout.committed_steps(_folder(tmp_path)) == [2]


def test_initial_load_path_used_only_when_folder_is_empty(tmp_path):
    source = make_job(str(tmp_path / "a"), steps=4, interval=2, init_seed=7)
    source.run_to(2, steps=4)
    source.manager.close()
    step2 = layout.step_dir(_folder(tmp_path / "a"), 2)

    job = make_job(str(tmp_path / "b"), steps=4, interval=2, initial_load_path=step2)
    assert job.manager.load()
    assert_same(job.model.state_dict(), source.model.state_dict())
    assert job.train_state.step == 0  # initial_load_model_only: the rest starts fresh
    job.run_to(2, steps=4)  # now b has a step of its own ...
    job.manager.close()
    before = {k: v.clone() for k, v in job.model.state_dict().items()}

    again = make_job(str(tmp_path / "b"), steps=4, interval=2, initial_load_path=step2)
    assert again.manager.load()  # ... which wins over initial_load_path
    assert again.train_state.step == 2
    assert_same(again.model.state_dict(), before)
    again.manager.close()


def test_a_load_tells_the_bytes_it_read_not_the_folders(tmp_path, caplog):
    """A model-only load of a full step told the whole folder's size (model, optimizer state and
    all), and its GB/s from that: the bytes the ranks read into the job's tensors now."""
    from torchtitan_ckpt.progress import fmt_bytes

    source = make_job(str(tmp_path / "a"), steps=4, interval=2)
    source.run_to(2, steps=4)
    source.manager.close()
    step2 = layout.step_dir(_folder(tmp_path / "a"), 2)
    model = sum(t.nbytes for t in source.model.state_dict().values())
    everything = model + sum(t.nbytes for s in source.opt.state.values() for t in s.values())
    for model_only, told in ((True, model), (False, everything)):
        job = make_job(str(tmp_path / f"b{model_only}"), steps=4, interval=2, initial_load_path=step2,
                       initial_load_model_only=model_only)
        caplog.clear()
        with caplog.at_level("INFO", logger="torchtitan_ckpt.manager"):
            assert job.manager.load()
        line = next(m for m in caplog.messages if m.startswith("loaded "))
        assert line.startswith(f"loaded the initial checkpoint {step2}{' (model only)' if model_only else ''}: "), line
        assert f": {fmt_bytes(told)} in " in line, line
        job.manager.close()
    resumed = make_job(str(tmp_path / "a"), steps=4, interval=2)
    caplog.clear()
    with caplog.at_level("INFO", logger="torchtitan_ckpt.manager"):
        assert resumed.manager.load()
    assert next(m for m in caplog.messages if m.startswith("loaded ")).startswith(f"loaded step 2 from {step2}: ")
    resumed.manager.close()
    assert model < everything < layout.folder_bytes(step2)


def test_initial_load_path_full_state(tmp_path):
    source = make_job(str(tmp_path / "a"), steps=4, interval=2)
    source.run_to(2, steps=4)
    source.manager.close()
    step2 = layout.step_dir(_folder(tmp_path / "a"), 2)
    job = make_job(str(tmp_path / "b"), steps=4, interval=2, initial_load_path=step2,
                   initial_load_model_only=False)
    assert job.manager.load()
    assert job.train_state.step == 2 and job.sched.last_epoch == 2
    job.manager.close()


def test_initial_load_path_is_checked_when_it_is_used(tmp_path):
    """A restart that resumes from a step of its own never reads initial_load_path: that it is
    gone since (deleted by the run that wrote it) does not matter. Used, a missing one is our
    error naming it."""
    source = make_job(str(tmp_path / "a"), steps=4, interval=2)
    source.run_to(2, steps=4)
    source.manager.close()
    step2 = layout.step_dir(_folder(tmp_path / "a"), 2)
    job = make_job(str(tmp_path / "b"), steps=4, interval=2, initial_load_path=step2)
    assert job.manager.load()
    job.run_to(2, steps=4)
    job.manager.close()
    shutil.rmtree(tmp_path / "a")
    again = make_job(str(tmp_path / "b"), steps=4, interval=2, initial_load_path=step2)
    assert again.manager.load() and again.train_state.step == 2
    again.manager.close()

    fresh = make_job(str(tmp_path / "c"), initial_load_path=step2)
    with pytest.raises(CheckpointNotFoundError, match=rf"^checkpoint.initial_load_path = {step2} does not exist, "
                                                      r"and .*c/checkpoint has no loadable step to resume from"):
        fresh.manager.load()
    (tmp_path / "empty").mkdir()
    empty = make_job(str(tmp_path / "d"), initial_load_path=str(tmp_path / "empty"))
    with pytest.raises(CheckpointNotFoundError, match=r"empty holds no finished checkpoint of a known format"):
        empty.manager.load()
    (tmp_path / "c.txt").write_text("")
    a_file = make_job(str(tmp_path / "e"), initial_load_path=str(tmp_path / "c.txt"))
    with pytest.raises(CheckpointNotFoundError, match=r"c.txt is a file, not a step folder: name the folder "):
        a_file.manager.load()


def _optimizer_moments(opt: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    params = (p for group in opt.param_groups for p in group["params"])
    return {i: opt.state[p]["exp_avg"].clone() for i, p in enumerate(params)}


def test_saves_before_a_model_only_step_passed_over_are_not_warned_of_it(tmp_path, caplog):
    """A job resuming from step 4 past a finished run's model-only step 6 was told at each save
    before 6 that a load would pick step 6 over it, which the load passes over; and when its
    save replaced step 6, that it had gone back to an older step."""
    job = make_job(str(tmp_path), steps=6, interval=2, keep_latest_k=0)
    job.run_to(6, steps=6)
    job.manager.close()
    extended = make_job(str(tmp_path), steps=10, interval=1, keep_latest_k=0, init_seed=5)
    with caplog.at_level("WARNING", logger="torchtitan_ckpt"):
        assert extended.manager.load() and extended.train_state.step == 4
        extended.run_to(6, steps=10)
    extended.manager.close()
    assert "newer than step" not in caplog.text
    assert (f"replacing {layout.step_dir(_folder(tmp_path), 6)}, a complete step saved before (saved again: after "
            "a load that passed it over or went back to an older step, or as another kind of save)") in caplog.text


def test_a_job_gone_back_is_warned_of_the_newer_steps_once_not_at_every_save(tmp_path, caplog):
    job = make_job(str(tmp_path), steps=8, interval=1, keep_latest_k=0, last_save_model_only=False)
    job.run_to(8, steps=8)
    job.manager.close()
    back = make_job(str(tmp_path), steps=8, interval=1, keep_latest_k=0, load_step=2, last_save_model_only=False)
    with caplog.at_level("WARNING", logger="torchtitan_ckpt"):
        assert back.manager.load() and back.train_state.step == 2
        back.manager.save(3, force=True)  # replaces step 3: the warning names 4 to 8 once
        back.manager.save(4, force=True)
    back.manager.close()
    told = [r.getMessage() for r in caplog.records if "newer than step" in r.getMessage()]
    assert len(told) == 1 and "steps [4, 5, 6, 7, 8] are newer than step 3 just saved" in told[0], told


def test_a_finished_runs_model_only_step_is_not_where_a_run_resumes(tmp_path, caplog):
    """Steps 2 and 4 hold the whole state, the last step 6 the model only: a job launched again
    (or extended) resumes from step 4, not from step 6's model with its optimizer, schedule and
    data starting over (and its saves replacing the first run's)."""
    job = make_job(str(tmp_path), steps=6, interval=2, keep_latest_k=0)
    job.run_to(4, steps=6)
    at4 = (_optimizer_moments(job.opt), {k: v.clone() for k, v in job.model.state_dict().items()})
    job.run_to(6, steps=6)
    job.manager.close()
    assert commit.read_marker(layout.step_dir(_folder(tmp_path), 6)).states == ["model"]

    extended = make_job(str(tmp_path), steps=10, interval=2, init_seed=5)
    with caplog.at_level("WARNING", logger="torchtitan_ckpt"):
        assert extended.manager.load()
    assert extended.train_state.step == 4 and extended.sched.last_epoch == 4
    assert_same(_optimizer_moments(extended.opt), at4[0])
    assert_same(extended.model.state_dict(), at4[1])
    assert "step(s) 6 hold only the model (a finished run's last save): resuming from step 4" in caplog.text
    assert "this run's saves will replace them, or retention (keep_latest_k > 0) delete them" in caplog.text
    extended.manager.close()

    evaluation = make_job(str(tmp_path), steps=6, init_seed=5, load_only=True)  # saves nothing: the last model
    assert evaluation.manager.load() and evaluation.train_state.step == 0
    assert_same(evaluation.model.state_dict(), job.model.state_dict())
    evaluation.manager.close()

    step4 = layout.step_dir(_folder(tmp_path), 4)
    os.truncate(os.path.join(step4, "__0_0.distcp"), 100)
    checked = make_job(str(tmp_path), steps=6, init_seed=5, verify_on_load=True)
    assert checked.manager.load() and checked.train_state.step == 2  # step 4 fails its check: step 2
    checked.manager.close()
    shutil.rmtree(layout.step_dir(_folder(tmp_path), 2))
    corrupt = make_job(str(tmp_path), steps=6, init_seed=5, verify_on_load=True)
    with pytest.raises(CheckpointError, match=r"but the steps holding it \(4\) failed verification: resuming"):
        corrupt.manager.load()
    corrupt.manager.close()

    shutil.rmtree(step4)
    alone = make_job(str(tmp_path), steps=6, init_seed=5)
    with pytest.raises(CheckpointError, match=r"checkpoint: its newest step 6 holds only the model \(a finished run's "
                                              r"last save\) and this job restores its optimizer, lr_scheduler, "
                                              r"dataloader, train_state state too, but no step after step 0 holds it: resuming "
                                              r"would restart training over it. .* checkpoint.initial_load_path = "
                                              r"'.*step-6'"):
        alone.manager.load()
    alone.manager.close()
    excluded = make_job(str(tmp_path), steps=6, init_seed=5,
                        exclude_from_loading=["optimizer", "lr_scheduler", "dataloader", "train_state"])
    assert excluded.manager.load()  # a job that restores nothing but the model takes it
    assert_same(excluded.model.state_dict(), job.model.state_dict())
    excluded.manager.close()


def test_load_step_naming_a_model_only_step_is_refused_to_a_job_that_restores_more(tmp_path):
    """load_step = the finished run's last save (model-only) from a job that restores its optimizer
    and the rest: refused (TorchTitan's load fails on the missing keys), where it loaded the model
    alone and left every other state fresh. A job that reads the model alone takes it."""
    job = make_job(str(tmp_path), steps=6, interval=3, keep_latest_k=0)
    job.run_to(6, steps=6)
    job.manager.close()
    step6 = layout.step_dir(_folder(tmp_path), 6)
    for load, step, named in ((dict(load_step=6), -1, r"checkpoint.load_step = 6"), (dict(), 6, r"load\(6\)"),
                              (dict(load_step=6), 6, r"checkpoint.load_step = 6")):  # TorchTitan's call: load(step=)
        asked = make_job(str(tmp_path), steps=6, init_seed=5, **load)
        with pytest.raises(CheckpointError, match=(
                rf"^{named}: {step6} holds only the model \(a finished run's last save\) and this job "
                r"restores its optimizer, lr_scheduler, dataloader, train_state state too, which the step lacks. To "
                rf"train on from its model, set checkpoint.initial_load_path = '{step6}' and use another "
                r"checkpoint.folder; to read the model alone, set checkpoint.load_only = true, or add those states "
                r"to checkpoint.exclude_from_loading$")):
            asked.manager.load(step)
        assert asked.train_state.step == 0 and not asked.opt.state
        asked.manager.close()
    for reader in (dict(load_only=True),
                   dict(exclude_from_loading=["optimizer", "lr_scheduler", "dataloader", "train_state"])):
        model_alone = make_job(str(tmp_path), steps=6, init_seed=5, load_step=6, **reader)
        assert model_alone.manager.load() and model_alone.train_state.step == 0
        assert_same(model_alone.model.state_dict(), job.model.state_dict())
        model_alone.manager.close()


def test_a_state_saved_empty_loads_as_empty(tmp_path):
    """A state of the job whose `state_dict()` is empty when saved (an EMA before it starts)
    leaves no keys in the step, which the commit marker lists it in: it loads as empty, where the
    load refused the step as lacking it."""
    class Ema:
        def __init__(self, shadow: dict):
            self.shadow = shadow

        def state_dict(self) -> dict:
            return dict(self.shadow)

        def load_state_dict(self, state_dict: dict) -> None:
            self.shadow = dict(state_dict)

    job = make_job(str(tmp_path), steps=8, interval=2, extra_states={"ema": Ema({})})
    job.run_to(2, steps=8)
    job.manager.close()
    assert "ema" in commit.read_marker(layout.step_dir(_folder(tmp_path), 2)).states
    ema = Ema({"decay": torch.tensor(0.5)})
    fresh = make_job(str(tmp_path), steps=8, extra_states={"ema": ema})
    assert fresh.manager.load()
    assert ema.shadow == {} and fresh.train_state.step == 2
    fresh.manager.close()


def test_verify_on_load_checks_a_step_of_ours_named_by_initial_load_path(tmp_path):
    """A damaged step of ours reached through initial_load_path is refused as it is from
    checkpoint.folder, where it loaded unchecked."""
    source = make_job(str(tmp_path / "a"), steps=4, interval=2)
    source.run_to(2, steps=4)
    source.manager.close()
    step2 = layout.step_dir(_folder(tmp_path / "a"), 2)
    raw = source.model.state_dict()["output.weight"].numpy().tobytes()
    with open(os.path.join(step2, "__0_0.distcp"), "r+b") as f:  # one bit of a weight: the file reads as sound
        data = bytearray(f.read())
        data[data.index(raw) + 3] ^= 0x40
        f.seek(0)
        f.write(data)
    job = make_job(str(tmp_path / "b"), steps=4, initial_load_path=step2, initial_load_model_only=False,
                   verify_on_load=True, init_seed=5)
    before = {k: v.clone() for k, v in job.model.state_dict().items()}
    with pytest.raises(CorruptCheckpointError, match=rf"^checkpoint.initial_load_path = {step2} failed "
                                                     rf"verification: {step2}/__0_0.distcp: CRC-32 [0-9a-f]+, "
                                                     r"the manifest says [0-9a-f]+$"):
        job.manager.load()
    assert_same(job.model.state_dict(), before)
    job.manager.close()


def test_an_unwritable_folder_fails_at_construction_with_one_rank(tmp_path):
    """A single-process job whose checkpoint.folder cannot be written fails when the manager is
    built, naming the folder, as a multi-rank job does, not at its first save; a job that only
    loads may name such a folder."""
    (tmp_path / "afile").write_text("")
    folder = str(tmp_path / "afile" / "checkpoint")
    with pytest.raises(ConfigError, match=rf"^checkpoint.folder = '{folder}': cannot write there: rank 0: "
                                          r"NotADirectoryError"):
        make_job(str(tmp_path), folder=folder)
    make_job(str(tmp_path), folder=folder, load_only=True).manager.close()
    with pytest.raises(ConfigError, match=r"cannot write there: rank 0: NotADirectoryError: .*afile is a file, not a "
                                          r"folder \(a job that only reads its steps sets checkpoint.load_only = "
                                          r"true\)$"):
        make_job(str(tmp_path), folder=str(tmp_path / "afile"))
    job = make_job(str(tmp_path), folder="new/checkpoint")
    assert os.listdir(tmp_path / "new" / "checkpoint") == [LOCK_FILE]  # made, held, and the probe removed
    job.manager.close()


def test_a_seed_step_is_no_resume_point_for_a_finished_runs_model_only_step(tmp_path):
    """Step 0 (a seed checkpoint) and a finished run's model-only last step: neither holds the
    optimizer; the job does not restart from the seed over the finished run."""
    seed = make_job(str(tmp_path), create_seed_checkpoint=True)
    assert seed.manager.save(0)
    seed.manager.close()
    run = make_job(str(tmp_path), steps=2, interval=10)
    assert run.manager.load() and run.train_state.step == 0
    run.run_to(2, steps=2)  # the last step alone is saved, model-only
    run.manager.close()
    again = make_job(str(tmp_path), steps=2, interval=10)
    with pytest.raises(CheckpointError, match=r"its newest step 2 holds only the model .* but no step after step 0 "
                                              r"holds it"):
        again.manager.load()
    again.manager.close()


def test_retention_keeps_the_step_a_run_resumes_from_when_the_last_holds_only_the_model(tmp_path):
    job = make_job(str(tmp_path), steps=6, interval=2, keep_latest_k=1)
    job.run_to(6, steps=6)
    job.manager.close()
    assert layout.committed_steps(_folder(tmp_path)) == [4, 6]  # 6 is model-only: 4 is where a run goes on
    again = make_job(str(tmp_path), steps=8, interval=2, keep_latest_k=1)
    assert again.manager.load() and again.train_state.step == 4
    again.run_to(8, steps=8)
    again.manager.close()
    assert layout.committed_steps(_folder(tmp_path)) == [6, 8]  # 8 the model alone again, 6 where a run goes on


def test_the_last_save_leaves_the_k_steps_before_it_as_torchtitan_does(tmp_path):
    """TorchTitan runs no retention after the job's last save (model-only or full): k full steps
    stay besides it. Ours deleted one of them there (step 4 of [4, 6, 7] with k = 2)."""
    for model_only in (True, False):
        dump = tmp_path / str(model_only)
        job = make_job(str(dump), steps=7, interval=2, keep_latest_k=2, last_save_model_only=model_only)
        job.run_to(7, steps=7)
        job.manager.close()
        assert layout.committed_steps(_folder(dump)) == [4, 6, 7]


def test_a_run_gone_back_keeps_its_own_steps_over_those_it_left(tmp_path):
    """A run reached step 8 (interval 4); another started from its step 4 (`load_step`) and saved
    6 and 9 (interval 3, `keep_latest_k = 2`): retention kept the left run's 8 and removed 6."""
    first = make_job(str(tmp_path), steps=20, interval=4, keep_latest_k=0)
    first.run_to(8, steps=20)
    first.manager.close()
    back = make_job(str(tmp_path), steps=20, interval=3, keep_latest_k=2, load_step=4)
    assert back.manager.load() and back.train_state.step == 4
    back.run_to(9, steps=20)
    back.manager.close()
    assert layout.committed_steps(_folder(tmp_path)) == [6, 9]


def test_saving_over_a_complete_step_says_so(tmp_path, caplog):
    job = make_job(str(tmp_path), steps=8, interval=2, keep_latest_k=0)
    job.run_to(4, steps=8)
    job.manager.close()
    back = make_job(str(tmp_path), steps=8, interval=2, keep_latest_k=0, load_step=2)
    assert back.manager.load()
    with caplog.at_level("WARNING", logger="torchtitan_ckpt.storage.base"):
        back.run_to(4, steps=8)
    back.manager.close()
    assert f"replacing {layout.step_dir(_folder(tmp_path), 4)}, a complete step saved before" in caplog.text


def test_the_manager_checks_the_config_and_the_job_it_is_given(tmp_path):
    """A section built in Python is validated as a loaded one is; a dataloader without state, and
    Hugging Face settings the adapter cannot serve, are refused at construction, not at the
    first save or load."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"^checkpoint.interval = 0: expected >= 1"):
        CheckpointManager(Checkpoint(enable=True, interval=0), model, base_folder=str(tmp_path))
    with pytest.raises(TypeError, match=r"dataloader is a DataLoader, which has no state_dict\(\)/load_state_dict\(\)"):
        CheckpointManager(Checkpoint(enable=True), model, dataloader=torch.utils.data.DataLoader([1, 2]),
                          base_folder=str(tmp_path))

    class Whole:  # an adapter of whole tensors (TorchTitan's surface), without an assets folder
        hf_assets_path = None

        def to_hf(self, state_dict):
            return state_dict

        def from_hf(self, hf_state_dict):
            return hf_state_dict

    with pytest.raises(ConfigError, match=r"^checkpoint.initial_load_path = None: checkpoint.initial_load_in_hf "
                                          r"needs the Hugging Face folder to start from"):
        CheckpointManager(Checkpoint(enable=True, initial_load_in_hf=True), model, base_folder=str(tmp_path),
                          state_dict_adapter=Whole())
    with pytest.raises(ConfigError, match=r"^checkpoint.last_save_in_hf = True: Whole has no hf_assets_path "
                                          r"holding a config.json"):
        CheckpointManager(Checkpoint(enable=True, last_save_in_hf=True), model, base_folder=str(tmp_path),
                          state_dict_adapter=Whole())


@pytest.mark.parametrize("base, folder, key", [
    ("gs://bkt/run", "checkpoint", "base_folder"),
    ("s3:", "checkpoint", "base_folder"),
    (os.path.join("a", "x" * 256), "checkpoint", "base_folder"),
    ("out", "s3:/bkt/x", "checkpoint.folder"),
])
def test_a_bad_base_folder_is_refused_naming_it_before_anything_is_made(tmp_path, monkeypatch, base, folder, key):
    """The base folder joined with `folder` is checked as `folder` is: a mistyped URL made a
    local folder `s3:`, a name too long left the levels above it made, and an unsupported URL
    was refused naming checkpoint.folder, with a value (the two joined) no one wrote."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        CheckpointManager(Checkpoint(enable=True, folder=folder), torch.nn.Linear(2, 2), base_folder=base)
    assert (e.value.key, e.value.value) == (key, base if key == "base_folder" else folder)
    assert os.listdir(tmp_path) == []


def test_seed_checkpoint_is_model_only_step_zero(tmp_path):
    job = make_job(str(tmp_path), create_seed_checkpoint=True)
    assert job.manager.save(0)
    job.manager.close()
    info = commit.read_marker(layout.step_dir(_folder(tmp_path), 0))
    assert info.states == ["model"] and info.step == 0
    resumed = make_job(str(tmp_path), init_seed=99)
    assert resumed.manager.load()
    assert_same(resumed.model.state_dict(), job.model.state_dict())
    resumed.manager.close()


def test_a_step_renamed_or_copied_in_under_another_steps_name_is_passed_over(tmp_path, caplog):
    """`mv step-2 step-9`: the load took step-9 as the newest and restored step 2's state, the
    job trained steps 3 to 8 again over the steps saved, and each restart did so again."""
    import json
    import subprocess
    import sys

    job = make_job(str(tmp_path), steps=8, interval=2, keep_latest_k=0)
    job.run_to(6, steps=8)
    job.manager.close()
    folder = _folder(tmp_path)
    os.rename(layout.step_dir(folder, 2), layout.step_dir(folder, 9))
    resumed = make_job(str(tmp_path), steps=12, interval=2, keep_latest_k=0)
    assert resumed.manager.load() and resumed.train_state.step == 6
    assert (f"passing over {folder}/step-9 holds step 2 (its COMMITTED.json says so): renamed, or copied in under "
            "another step's name." in caplog.text)
    resumed.manager.close()
    named = make_job(str(tmp_path), steps=12, load_step=9)
    with pytest.raises(CorruptCheckpointError, match=r"step-9 holds step 2 .* name it step-2, or move it out"):
        named.manager.load()
    named.manager.close()
    listed = subprocess.run([sys.executable, "-m", "torchtitan_ckpt.cli", "list", "--json", folder],
                            capture_output=True, text=True, check=True)
    doc = json.loads(listed.stdout)
    assert [(s["step"], s["status"]) for s in doc["steps"]] == [(4, "complete"), (6, "complete"), (9, "misnamed")]
    assert doc["latest_loadable"] == 6
    # a step linked in by a relative link that leads nowhere in a copy of the run: said so, not
    # "its save did not finish, or it is not a checkpoint"
    os.symlink("../../archive/step-12", layout.step_dir(folder, 12))
    caplog.clear()
    reader = make_job(str(tmp_path), steps=12, load_only=True)
    assert reader.manager.load() and reader.train_state.step == 6
    assert (f"ignoring {folder}/step-12: a link to '../../archive/step-12', which leads nowhere (a copy of the "
            "folder that kept a relative link?)" in caplog.text)
    reader.manager.close()


def test_load_step_picks_a_step_and_names_a_missing_one(tmp_path):
    job = make_job(str(tmp_path), steps=8, interval=2, keep_latest_k=0)
    job.run_to(6, steps=8)
    job.manager.close()
    chosen = make_job(str(tmp_path), steps=8, load_step=4)
    assert chosen.manager.load() and chosen.train_state.step == 4
    chosen.manager.close()
    missing = make_job(str(tmp_path), steps=8, load_step=5)
    with pytest.raises(CheckpointNotFoundError, match=r"checkpoint/step-5 does not exist; loadable steps: \[2, 4, 6\]"):
        missing.manager.load()
    typo = make_job(str(tmp_path / "typo"), steps=8, load_step=5)  # a folder that holds no step: named so
    with pytest.raises(CheckpointNotFoundError, match=r"typo/checkpoint/step-5 does not exist; \S+/typo/checkpoint "
                                                      r"holds no step: is it the folder the run saved into\?"):
        typo.manager.load()
    typo.manager.close()
    commit.uncommit(layout.step_dir(_folder(tmp_path), 6))  # as a save that crashed leaves it
    partial = make_job(str(tmp_path), steps=8, load_step=6)
    with pytest.raises(CheckpointNotFoundError, match=r"step-6 is not loadable \(its save did not finish"):
        partial.manager.load()


def test_nothing_to_load_starts_fresh(tmp_path):
    job = make_job(str(tmp_path))
    assert not job.manager.load()
    job.manager.close()
    job.manager.close()  # idempotent


def test_disabled_manager_does_nothing(tmp_path):
    job = make_job(str(tmp_path), enable=False)
    job.run_to(3, steps=3)
    assert not job.manager.load()
    assert not os.path.exists(_folder(tmp_path))


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # creating this file is the "attack"


def test_metadata_that_would_run_code_is_refused(tmp_path):
    job = make_job(str(tmp_path), steps=4, interval=2)
    job.run_to(2, steps=4)
    job.manager.close()
    step2 = layout.step_dir(_folder(tmp_path), 2)
    evidence = str(tmp_path / "pwned")
    with open(os.path.join(step2, METADATA_FILE), "wb") as f:
        pickle.dump(_RunsCode(evidence), f)
    forged_whole(step2)
    with pytest.raises(CorruptCheckpointError, match=r"step-2/.metadata references _?io.open.*refusing"):
        make_job(str(tmp_path), steps=4).manager.load()
    assert not os.path.exists(evidence)


def test_pickled_values_are_loaded_without_running_code(tmp_path):
    evidence = str(tmp_path / "pwned")
    path = str(tmp_path / "evil")
    model = make_job(str(tmp_path / "src")).model
    forged = {**model.state_dict(), "train_state": {"step": _RunsCode(evidence), "ntokens_seen": 0}}
    dcp.save(forged, checkpoint_id=path)
    job = make_job(str(tmp_path), initial_load_path=path, initial_load_model_only=False,
                   exclude_from_loading=["optimizer", "lr_scheduler", "dataloader"])
    with pytest.raises(CorruptCheckpointError, match="'train_state.step' is not plain data.*refused"):
        job.manager.load()
    assert not os.path.exists(evidence)


def _optimizer_values(opt: torch.optim.Optimizer) -> list:
    return [(dict(g, params=None), [{k: v.clone() for k, v in opt.state[p].items()} for p in g["params"]])
            for g in opt.param_groups]


def test_optimizer_is_saved_in_torchtitans_layout_and_loads_from_it(tmp_path):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    source = make_job(str(tmp_path / "a"), steps=4, interval=2)
    source.run_to(2, steps=4)
    source.manager.close()
    keys = dcp.FileSystemReader(layout.step_dir(_folder(tmp_path / "a"), 2)).read_metadata().state_dict_metadata
    # TorchTitan's layout: every setting of every parameter its own value
    flat = get_optimizer_state_dict(source.model, source.opt,
                                    options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert "param_groups.output.weight.lr" in flat
    assert sorted(k for k in keys if k.startswith("optimizer.")) == sorted(f"optimizer.{k}" for k in flat)

    titan = os.path.join(tmp_path, "titan")
    dcp.save({**source.model.state_dict(), "optimizer": flat}, checkpoint_id=titan, no_dist=True)
    for path in (layout.step_dir(_folder(tmp_path / "a"), 2), titan):
        job = make_job(str(tmp_path / "b"), steps=4, interval=2, init_seed=5, initial_load_path=path,
                       initial_load_model_only=False,
                       exclude_from_loading=["lr_scheduler", "dataloader", "train_state"])
        for g in job.opt.param_groups:
            g["lr"], g["betas"] = 0.5, (0.1, 0.2)
        assert job.manager.load()
        job.manager.close()
        for (got_g, got_s), (want_g, want_s) in zip(_optimizer_values(job.opt), _optimizer_values(source.opt)):
            # the rate is the job's own: its schedule is left out of the load, and starts afresh
            assert {**got_g, "lr": want_g["lr"]} == want_g and got_g["lr"] == 0.5
            for got, want in zip(got_s, want_s):
                assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _partly_trained(seed: int) -> tuple[torch.nn.ModuleDict, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "unused": torch.nn.Linear(4, 4)})
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)


def test_parameters_without_optimizer_state_resume_without_it(tmp_path):
    """A parameter that never had a gradient has no AdamW state when saved: a new job resumes
    the optimizer as it was (its state for the others, none for that one), where it refused the
    step as another model's."""
    model, opt = _partly_trained(0)
    model["used"](torch.ones(2, 4)).sum().backward()
    opt.step()
    config = Checkpoint(enable=True, folder=str(tmp_path), interval=1, last_save_model_only=False)
    with CheckpointManager(config, model, optimizers=opt) as manager:
        manager.save(1)
    assert len(opt.state) == 2

    fresh_model, fresh_opt = _partly_trained(1)
    with CheckpointManager(config, fresh_model, optimizers=fresh_opt) as manager:
        assert manager.load()
    assert_same(fresh_model.state_dict(), model.state_dict())
    got, want = fresh_opt.state_dict()["state"], opt.state_dict()["state"]
    assert sorted(got) == sorted(want) == [0, 1]  # the `used` layer's weight and bias
    for index in want:
        assert_same(got[index], want[index])

    other_model, _ = _partly_trained(2)  # another optimizer: its state's names are not the step's
    sgd = torch.optim.SGD(other_model.parameters(), lr=0.5, momentum=0.9)
    with CheckpointManager(config, other_model, optimizers=sgd) as manager:
        with pytest.raises(CheckpointError, match=r"lacks 2 tensors this job has, e.g. \['optimizer.state.used.weight"
                                                  r".momentum_buffer', 'optimizer.state.used.bias.momentum_buffer'\]"):
            manager.load()
    assert not sgd.state and sgd.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("step, error, message", [
    (3.0, TypeError, r"save\(3.0\): the step must be an int, not a float"),
    (True, TypeError, r"save\(True\): the step must be an int, not a bool"),
    ("4", TypeError, r"save\('4'\): the step must be an int, not a str"),
    (None, TypeError, r"save\(None\): the step must be an int"),
    (-5, ValueError, r"save\(-5\): the step must be from 0 to 2\*\*62"),
    (2**62 + 1, ValueError, r"the step must be from 0 to 2\*\*62"),
])
def test_a_step_that_is_no_count_is_refused_before_anything_is_written(tmp_path, step, error, message):
    """`save(3.0)` wrote `step-3.0`, which no load finds; -5 and True wrote `step--5` and
    `step-True`; a step above the markers' bound was saved and then refused by every load."""
    manager = CheckpointManager(Checkpoint(enable=True, interval=1), [torch.nn.Linear(2, 2)],
                                base_folder=str(tmp_path))
    with pytest.raises(error, match=message):
        manager.save(step)
    with pytest.raises(error, match=message.replace("save", "load").replace("from 0", "from -1")):
        manager.load(step)
    manager.close()
    assert os.listdir(_folder(tmp_path)) == [LOCK_FILE]


def test_an_integer_of_numpy_or_a_tensor_is_a_step(tmp_path):
    """`for step in np.arange(...)`: the commit marker failed (an int64 is no JSON) after every
    file was written."""
    np = pytest.importorskip("numpy")
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(Checkpoint(enable=True, interval=1), [model], base_folder=str(tmp_path)) as manager:
        assert manager.save(np.int64(6)) and manager.save(torch.tensor(7))
    assert layout.committed_steps(_folder(tmp_path)) == [6, 7]
    with CheckpointManager(Checkpoint(enable=True), [torch.nn.Linear(2, 2)], base_folder=str(tmp_path)) as manager:
        assert manager.load(np.int64(6))


def test_a_model_without_memory_is_refused_before_anything_is_read_or_written(tmp_path):
    """A model built on the meta device and not materialised: load() filled nothing and said it
    had loaded; save() failed after making the step folder."""
    with CheckpointManager(Checkpoint(enable=True, interval=1), [torch.nn.Linear(2, 2)],
                           base_folder=str(tmp_path)) as manager:
        manager.save(1)
    for model in (torch.nn.Linear(2, 2, device="meta"), torch.nn.LazyLinear(2)):
        with CheckpointManager(Checkpoint(enable=True, interval=1), [model], base_folder=str(tmp_path)) as manager:
            with pytest.raises(CheckpointError, match=r"load\(\): 2 of the model's tensors have no memory yet, "
                                                      r"e.g. \['weight', 'bias'\] .*model.to_empty"):
                manager.load()
            with pytest.raises(CheckpointError, match=r"save\(\): 2 of the model's tensors have no memory yet"):
                manager.save(2)
    assert sorted(os.listdir(_folder(tmp_path))) == [LOCK_FILE, "step-1"]


def test_an_optimizer_state_without_memory_is_refused_before_the_step_folder_is_made(tmp_path):
    """Optimizer state made while the model was on the meta device (eagerly, as some
    optimizers make it), kept through `to_empty` (FSDP2 keeps its parameters): save() failed
    in torch ("Cannot copy out of meta tensor") after making the step folder."""
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    for p in list(model.parameters()):  # materialised keeping the objects the optimizer holds, as FSDP2's to_empty
        torch.utils.swap_tensors(p, torch.nn.Parameter(torch.ones(p.shape)))
    for mode in ("disabled", "async"):
        config = Checkpoint(enable=True, interval=1, async_mode=mode)
        with CheckpointManager(config, [model], optimizers=opt, base_folder=str(tmp_path)) as manager:
            with pytest.raises(CheckpointError, match=r"save\(\): 4 of the optimizer state's tensors have no memory "
                                                      r"yet, e.g. \['optimizer.state.weight.exp_avg', "):
                manager.save(1)
                manager.wait()
        assert os.listdir(_folder(tmp_path)) == [LOCK_FILE]


def test_a_model_changed_since_the_save_is_named_before_its_optimizer(tmp_path):
    """A layer added since the save: the error was the optimizer's missing settings, and
    excluding the optimizer as it advised only then showed the model's missing tensors."""
    def job(layers):
        model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(layers)])
        return model, torch.optim.AdamW(model.parameters())

    model, opt = job(1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    with CheckpointManager(Checkpoint(enable=True, interval=1), [model], opt, base_folder=str(tmp_path)) as manager:
        manager.save(1)
    model, opt = job(2)
    with CheckpointManager(Checkpoint(enable=True), [model], opt, base_folder=str(tmp_path)) as manager:
        with pytest.raises(CheckpointError, match=r"step-1 lacks 2 tensors this job has, e.g. \['1.weight', "
                                                  r"'1.bias'\]; was it saved from a different model\?"):
            manager.load()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))  # the same model, another kind of optimizer
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    sgd.step()
    with CheckpointManager(Checkpoint(enable=True), [model], sgd, base_folder=str(tmp_path)) as manager:
        with pytest.raises(CheckpointError, match=r"lacks 2 tensors this job has, e.g. \['optimizer.state.0.weight."
                                                  r"momentum_buffer', .* another kind of optimizer\? add 'optimizer' "
                                                  "to checkpoint.exclude_from_loading"):
            manager.load()


@pytest.mark.parametrize("model_only", [False, True], ids=["full", "model-only"])
def test_a_model_of_other_sizes_is_named_with_each_shape_before_anything_is_read(tmp_path, model_only):
    """A layer widened since the save: DCP's planning named its first tensor alone, in a
    `ValueError` of its own ("Size mismatch between saved torch.Size([3, 2]) and current: ...")."""
    with CheckpointManager(Checkpoint(enable=True, interval=1), [torch.nn.Sequential(torch.nn.Linear(2, 3))],
                           base_folder=str(tmp_path)) as manager:
        manager.save(1, last_step=model_only)
    wider = torch.nn.Sequential(torch.nn.Linear(2, 5))
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with CheckpointManager(Checkpoint(enable=True), [wider], base_folder=str(tmp_path)) as manager:
        with pytest.raises(CheckpointError, match=r"step-1 holds 2 tensors of this job in other shapes, e.g. "
                                                  r"0.weight \(5, 2\) saved as \(3, 2\); 0.bias \(5,\) saved as "
                                                  r"\(3,\); was it saved from a different model\?"):
            manager.load()
    assert all(torch.equal(v, before[k]) for k, v in wider.state_dict().items())


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_job_of_one_process_saves_and_loads_without_dcps_warning_of_it(tmp_path, mode):
    """DCP warns at each save outside a process group; a job of one rank (the documented resume
    on one rank) printed it on a healthy run."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(Checkpoint(enable=True, interval=1, async_mode=mode), [torch.nn.Linear(2, 2)],
                               base_folder=str(tmp_path)) as manager:
            manager.save(1)
            manager.wait()
        with CheckpointManager(Checkpoint(enable=True), [torch.nn.Linear(2, 2)], base_folder=str(tmp_path)) as manager:
            assert manager.load()
        warnings.warn("a warning of the job's own")
    assert [str(w.message) for w in caught] == ["a warning of the job's own"]


@pytest.mark.parametrize("load_only, level", [(True, "WARNING"), (False, "INFO")])
def test_a_job_that_only_loads_and_finds_nothing_is_warned(tmp_path, caplog, load_only, level):
    """An evaluation job with a mistyped folder ran on its initial weights, said at INFO alone."""
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(Checkpoint(enable=True, load_only=load_only), [model], base_folder=str(tmp_path)) as manager:
        assert not manager.load()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "from scratch" in r.getMessage()]
    assert said == [(level, f"no checkpoint in {_folder(tmp_path)} and no initial_load_path: starting from scratch"
                            + (" (load_only: the model keeps the weights it was built with)" if load_only else ""))]


def test_tensors_read_into_other_dtypes_are_told_and_warned_of_where_values_may_not_come_back(tmp_path, caplog):
    """DCP casts what it reads to the job's dtypes without a word: an int64 counter read into
    int32 wrapped, a float32 model read into bfloat16 was rounded."""
    model = torch.nn.Linear(2, 2)
    model.register_buffer("seen", torch.tensor([2**40 + 5]))
    with CheckpointManager(Checkpoint(enable=True, interval=1), [model], base_folder=str(tmp_path)) as manager:
        manager.save(1)

    def load(dtype, counter):
        caplog.clear()
        job = torch.nn.Linear(2, 2).to(dtype)
        job.register_buffer("seen", torch.zeros(1, dtype=counter))
        with CheckpointManager(Checkpoint(enable=True), [job], base_folder=str(tmp_path)) as manager:
            assert manager.load()
        return job, [(r.levelname, r.getMessage()) for r in caplog.records if "dtype" in r.getMessage()]

    job, said = load(torch.float32, torch.int64)
    assert said == [] and job.seen.item() == 2**40 + 5
    job, said = load(torch.bfloat16, torch.int64)
    assert said == [("INFO", f"{_folder(tmp_path)}/step-1: 2 tensors are read into other dtypes than saved, cast to "
                             "the job's (e.g. weight float32 -> bfloat16; bias float32 -> bfloat16)")]
    assert torch.equal(job.weight, model.weight.to(torch.bfloat16))
    job, said = load(torch.float32, torch.int32)
    assert said == [("WARNING", f"{_folder(tmp_path)}/step-1: 1 tensors are read into dtypes that may not hold their "
                                "values (e.g. seen int64 -> int32): the load casts them as the job's tensors are; "
                                "load into tensors of the saved dtypes to keep them")]


@pytest.mark.parametrize("arguments, message", [
    ({"model_parts": {"a": torch.nn.Linear(2, 2)}}, "model_parts is a dict; expected an nn.Module"),
    ({"model_parts": torch.nn.Linear(2, 2).state_dict()}, "model_parts is a OrderedDict; expected an nn.Module"),
    ({"model_parts": [torch.nn.Linear(2, 2), "x"]}, r"model_parts\[1\] is a str; expected an nn.Module"),
    ({"optimizers": {"o": None}}, "optimizers is a dict; expected a torch.optim.Optimizer"),
    ({"lr_schedulers": [lambda step: 1.0]}, r"lr_schedulers\[0\] is a function; expected an LR scheduler"),
    ({"states": [1]}, "states is a list; expected a dict"),
])
def test_arguments_of_the_wrong_kind_are_refused_naming_them(tmp_path, arguments, message):
    """A dict of optimizers was taken for its keys ('str' object has no attribute
    'param_groups'); a lambda as scheduler failed the first save, after the training up to it."""
    arguments = {"model_parts": [torch.nn.Linear(2, 2)], **arguments}
    with pytest.raises(TypeError, match=message):
        CheckpointManager(Checkpoint(enable=True), base_folder=str(tmp_path), **arguments)


def test_a_relative_folder_stays_where_it_was_when_the_manager_was_made(tmp_path, monkeypatch):
    """A relative folder was resolved at each save: after a chdir, steps went to another folder,
    made without a check, and a restarted job resumed from the older steps."""
    monkeypatch.chdir(tmp_path)
    config = Checkpoint(enable=True, interval=1, keep_latest_k=0)
    with CheckpointManager(config, [torch.nn.Linear(2, 2)], base_folder="outputs") as manager:
        manager.save(1)
        (tmp_path / "elsewhere").mkdir()
        monkeypatch.chdir(tmp_path / "elsewhere")
        manager.save(2)
        assert manager.load(1)
    assert layout.committed_steps(str(tmp_path / "outputs" / "checkpoint")) == [1, 2]
    assert os.listdir(tmp_path / "elsewhere") == []


def test_a_layer_removed_since_the_save_is_said_when_it_is_not_loaded(tmp_path, caplog):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with CheckpointManager(Checkpoint(enable=True, interval=1), [model], base_folder=str(tmp_path)) as manager:
        manager.save(1)
    smaller = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with CheckpointManager(Checkpoint(enable=True), [smaller], base_folder=str(tmp_path)) as manager:
        assert manager.load()
    assert torch.equal(smaller[0].weight, model[0].weight)
    assert "step-1 holds 2 model tensors this job's model does not have, e.g. ['1.bias', '1.weight']: they are " \
           "not loaded (a layer removed since the save?)" in caplog.text


class _Nested(torch.nn.Module):
    """A model whose names start with `model.`, as every transformers model's do."""

    def __init__(self, layers: int):
        super().__init__()
        self.model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(layers)))


def test_tensors_a_model_named_like_transformers_lacks_are_warned_of(tmp_path, caplog):
    """The warning skipped every name starting with `model.` (taken for a state's), so a
    transformers model that lost a layer since the save loaded without a word."""
    config = Checkpoint(enable=True, interval=1, keep_latest_k=0, last_save_model_only=False)
    with CheckpointManager(config, [_Nested(2)], base_folder=str(tmp_path)) as manager:
        manager.save(1)
    with caplog.at_level("WARNING", logger="torchtitan_ckpt"), \
            CheckpointManager(config, [_Nested(1)], base_folder=str(tmp_path)) as manager:
        assert manager.load()
    assert "holds 2 model tensors this job's model does not have, e.g. ['model.1.bias', 'model.1.weight']" \
        in caplog.text


def test_a_folder_nesting_the_model_under_a_prefix_is_named_for_it(tmp_path, caplog):
    """accelerate's FSDP folders hold `model.` + each name, Lightning's `state_dict.` + ...: the
    load said the tensors were missing and asked whether it was another model."""
    source = _Nested(2)
    for prefix in ("model.", "state_dict.model."):
        path = str(tmp_path / prefix)
        dcp.save({prefix + k: v for k, v in source.state_dict().items()}, checkpoint_id=path, no_dist=True)
        config = Checkpoint(enable=True, initial_load_path=path)
        with caplog.at_level("WARNING", logger="torchtitan_ckpt"), \
                CheckpointManager(config, [_Nested(2)], base_folder=str(tmp_path / "run")) as manager, \
                pytest.raises(CheckpointError, match=rf"lacks 4 tensors this job has, .*; it holds every one under "
                                                      rf"the prefix '{re.escape(prefix)}': another framework's"):
            manager.load()
    assert "model tensors this job's model does not have" not in caplog.text  # the refusal says why, alone
    assert _nesting(["x"], {"_orig_mod.module.x", "module.x", "y"}) == "module."  # the shortest, on every rank


@pytest.mark.parametrize("whose, told", [("theirs", "a dcp checkpoint of another program"),
                                         ("ours", "a model-only save of torchtitan_ckpt: a run's last save, or a seed")])
def test_a_model_only_folder_is_refused_where_the_job_asks_for_more(tmp_path, whose, told):
    """With initial_load_model_only = false, a folder holding only the model (an HF folder, a
    Trainer's checkpoint; a finished run's last save of ours) loaded its model and left the
    optimizer fresh without a word."""
    model = torch.nn.Linear(4, 4)
    if whose == "theirs":
        path = str(tmp_path / "theirs")
        dcp.save(model.state_dict(), checkpoint_id=path, no_dist=True)
    else:
        with CheckpointManager(Checkpoint(enable=True, interval=1), [model], torch.optim.AdamW(model.parameters()),
                               base_folder=str(tmp_path / "ours")) as manager:
            manager.save(1, last_step=True)
        path = layout.step_dir(str(tmp_path / "ours" / "checkpoint"), 1)
    fresh = torch.nn.Linear(4, 4)
    config = Checkpoint(enable=True, initial_load_path=path, initial_load_model_only=False)
    with CheckpointManager(config, [fresh], torch.optim.AdamW(fresh.parameters()),
                           base_folder=str(tmp_path / "run")) as manager, \
            pytest.raises(CheckpointError, match=rf"holds only the model \({told}\) and "
                                                 r"checkpoint.initial_load_model_only = false asks for this job's "
                                                 r"optimizer state too: set it to true"):
        manager.load()
    assert not torch.equal(fresh.weight, model.weight)
    config = Checkpoint(enable=True, initial_load_path=path)  # model only: as the folder is
    with CheckpointManager(config, [fresh], torch.optim.AdamW(fresh.parameters()),
                           base_folder=str(tmp_path / "run")) as manager:
        assert manager.load()
    assert torch.equal(fresh.weight, model.weight)
    evaluation = torch.nn.Linear(4, 4)  # a job that only loads takes the model it asked for with the rest
    config = Checkpoint(enable=True, initial_load_path=path, initial_load_model_only=False, load_only=True)
    with CheckpointManager(config, [evaluation], torch.optim.AdamW(evaluation.parameters()),
                           base_folder=str(tmp_path / "eval")) as manager:
        assert manager.load()
    assert torch.equal(evaluation.weight, model.weight)


def test_a_torch_save_file_as_initial_load_path_is_named_for_what_it_is(tmp_path):
    """A `.pt` (or `pytorch_model.bin`, a Lightning `.ckpt`) was told to name the folder holding
    it, which then held no checkpoint either: no way forward, nothing said of pickles."""
    evidence = str(tmp_path / "pwned")
    for name, legacy in (("model.pt", False), ("pytorch_model.bin", True)):
        path = str(tmp_path / name)
        torch.save({"weight": _RunsCode(evidence)}, path, _use_new_zipfile_serialization=not legacy)
        config = Checkpoint(enable=True, initial_load_path=path)
        with CheckpointManager(config, [torch.nn.Linear(4, 4)], base_folder=str(tmp_path / "run")) as manager, \
                pytest.raises(CheckpointNotFoundError, match=r"is a torch.save file \(a pickle\), which "
                                                             r"torchtitan_ckpt never loads .*safetensors"):
            manager.load()
    assert not os.path.exists(evidence)
    step = make_job(str(tmp_path / "src"), steps=2, interval=1)
    step.run_to(1, steps=2)
    step.manager.close()
    metadata = os.path.join(layout.step_dir(_folder(tmp_path / "src"), 1), METADATA_FILE)  # a pickle too
    config = Checkpoint(enable=True, initial_load_path=metadata)
    with CheckpointManager(config, [torch.nn.Linear(4, 4)], base_folder=str(tmp_path / "run2")) as manager, \
            pytest.raises(CheckpointNotFoundError, match=r"is a file, not a step folder: name the folder holding it"):
        manager.load()
    fifo = str(tmp_path / "model.fifo")  # told apart without opening it to read: the open would wait for a writer
    os.mkfifo(fifo)
    config = Checkpoint(enable=True, initial_load_path=fifo)
    with CheckpointManager(config, [torch.nn.Linear(4, 4)], base_folder=str(tmp_path / "run3")) as manager, \
            pytest.raises(CheckpointNotFoundError, match=r"is a file, not a step folder"):
        manager.load()


def _collected(ref: weakref.ref, limit_s: float = 30) -> bool:
    """Whether what `ref` names is collected within `limit_s`: a save's thread holds its manager
    until it has let go of the save's work, a moment after the save ends."""
    deadline = time.monotonic() + limit_s
    while True:
        gc.collect()
        if ref() is None or time.monotonic() > deadline:
            return ref() is None
        time.sleep(0.05)


@pytest.mark.parametrize("whose", ["ours", "torchtitan"])
@pytest.mark.parametrize("below", ["", "sub"])
def test_a_step_folder_as_the_checkpoint_folder_is_refused_before_anything_is_written(tmp_path, whose, below):
    """`checkpoint.folder` naming a step (or a folder in one) where the folder of steps was meant:
    refused naming the key and the way out, where `load()` started from scratch and the next
    save wrote its step and lock into that step (which then failed its `verify`)."""
    model = torch.nn.Linear(4, 4)
    folder = tmp_path / "checkpoint"
    if whose == "ours":
        with CheckpointManager(Checkpoint(enable=True, interval=1), [model], base_folder=str(tmp_path)) as manager:
            manager.save(2)
    else:  # TorchTitan's step: a DCP checkpoint of its own
        dcp.save(model.state_dict(), checkpoint_id=str(folder / "step-2"))
    step = folder / "step-2"
    before = sorted(p.name for p in step.iterdir())
    named = step / below if below else step
    for config in (Checkpoint(enable=True, interval=1, folder=str(named)),
                   Checkpoint(enable=True, interval=1, folder=str(named), load_only=True)):
        with pytest.raises(ConfigError, match=rf"checkpoint.folder = .*: is{' inside' if below else ''} the step "
                                              rf"folder {re.escape(str(step))}, not a folder of steps .*resume from "
                                              rf"{re.escape(str(folder))}, .* checkpoint.initial_load_path"):
            CheckpointManager(config, [model])
    stage = step / "stage"  # an S3 job's staging folder (a local job's initial_load_path on S3 stages there)
    with pytest.raises(ConfigError, match=rf"checkpoint.staging_folder = .*: is inside the step folder "
                                          rf"{re.escape(str(step))}: the files staged there would be in that step"):
        CheckpointManager(Checkpoint(enable=True, interval=1, folder=str(tmp_path / "other"),
                                     staging_folder=str(stage)), [model])
    os.symlink(named, tmp_path / "link")  # a link into the step leads there as well
    with pytest.raises(ConfigError, match=rf"is inside the step folder {re.escape(str(step))}, not a folder of steps"):
        CheckpointManager(Checkpoint(enable=True, interval=1, folder=str(tmp_path / "link" / "run")), [model])
    os.remove(tmp_path / "link")
    assert sorted(p.name for p in step.iterdir()) == before
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / ".metadata").write_bytes(b"")  # a folder not named as a step is none
    CheckpointManager(Checkpoint(enable=True, interval=1, folder=str(tmp_path / "scratch" / "run")), [model]).close()
    with CheckpointManager(Checkpoint(enable=True, interval=1, folder=str(tmp_path / "next"),
                                      initial_load_path=str(step)), [model]) as manager:
        assert manager.load()  # the step itself is what initial_load_path takes


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_a_manager_dropped_unclosed_is_collected_and_lets_go(tmp_path, mode, caplog):
    """A manager dropped without close() (a trainer building its manager again): the optimizer's
    step pre-hook does not keep it alive; once collected, its threads end, its writer process
    stops, and a warning says to close it. The optimizer steps on."""
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = Checkpoint(enable=True, interval=1, async_mode=mode)
    with CheckpointManager(config, [model], optimizers=opt, base_folder=str(tmp_path / "first")) as first:
        first.save(1)
    # the process's own threads (the writers' launcher, multiprocessing's sharer of descriptors)
    before = set(threading.enumerate())
    manager = CheckpointManager(config, [model], optimizers=opt, base_folder=str(tmp_path))
    manager.save(1)
    manager.wait()
    writer = getattr(manager._saves, "writer", None)  # noqa: SLF001
    process = writer._proc if writer is not None else None  # noqa: SLF001
    dropped, writer = weakref.ref(manager), weakref.ref(writer) if writer is not None else None
    del manager
    assert _collected(dropped)
    assert "collected without close()" in caplog.text
    model(torch.ones(2, 8)).sum().backward()
    assert not step_hooks.waits(opt)  # the collected manager is no longer waited on
    opt.step()
    deadline = time.monotonic() + 60
    while (set(threading.enumerate()) - before or process is not None and process.is_alive()) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not {t.name for t in set(threading.enumerate()) - before}
    assert process is None or not process.is_alive()
    assert writer is None or _collected(writer)  # its reply thread let go of it, and of the shared buffers



class _RemovedAsRead(TensorState):
    """A state whose `state_dict()`, once armed, removes `path` first: as another job's
    retention removing the step this job's load has chosen."""

    def __init__(self, path: str):
        super().__init__(torch.zeros(2))
        self.path, self.armed = path, False

    def state_dict(self):
        if self.armed:
            self.armed = False
            shutil.rmtree(self.path)
        return super().state_dict()


def test_an_initial_step_removed_while_read_is_said_removed(tmp_path):
    """`initial_load_path` naming a step of a run whose job removes it as this job reads it: not
    a damaged step (what the failure to open a data file said), and nothing of the job changed."""
    first = make_job(str(tmp_path / "first"), steps=4, interval=2, keep_latest_k=0,
                     extra_states={"extra": TensorState(torch.ones(2))})
    first.run_to(2, steps=4)
    first.manager.close()
    step = layout.step_dir(str(tmp_path / "first" / "checkpoint"), 2)
    extra = _RemovedAsRead(step)
    job = make_job(str(tmp_path / "second"), steps=4, interval=2, initial_load_path=step,
                   initial_load_model_only=False, extra_states={"extra": extra})
    before = {k: v.clone() for k, v in job.model.state_dict().items()}
    extra.armed = True
    with pytest.raises(CheckpointNotFoundError, match="was removed while this job read it"):
        job.manager.load()
    assert not os.path.exists(step)
    assert_same(job.model.state_dict(), before)
    job.manager.close()


class _FailsToSave(TensorState):
    def state_dict(self):
        raise RuntimeError("this state cannot be saved")


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_a_manager_dropped_after_a_failed_background_save_is_collected(tmp_path, mode, caplog):
    """A background save that failed, never waited for: the failure kept for the next call held,
    through the variables of the calls it went through, the manager its finalizer could not let go."""
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(Checkpoint(enable=True, interval=1, async_mode=mode), [model], optimizers=opt,
                                states={"failing": _FailsToSave(torch.zeros(1))}, base_folder=str(tmp_path))
    manager.save(1)
    deadline = time.monotonic() + 60
    while "cannot be saved" not in caplog.text and time.monotonic() < deadline:  # told at once, on the log
        time.sleep(0.05)
    dropped = weakref.ref(manager)
    del manager
    assert _collected(dropped) and "collected without close()" in caplog.text


def test_last_step_passed_at_every_save_is_warned_of_once(tmp_path, caplog):
    """`last_step=True` at every step (a constant for `step == steps`) made each save hold the
    model alone, kept from retention: the folder grew, and the resume found nothing to train on
    from, after the training. Said at the second such save."""
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(Checkpoint(enable=True, interval=1, last_save_model_only=False), [model],
                           torch.optim.AdamW(model.parameters()), base_folder=str(tmp_path)) as manager:
        for step in (1, 2, 3):
            assert manager.save(step, last_step=True)
        assert manager.load(3)  # a run of several phases in one process: each phase's end is its own
        assert manager.save(4, last_step=True)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "save(2, last_step=True) after save(1, last_step=True): last_step says the step is the run's last (its save "
        "may hold only the model, and retention does not run after it); pass it at the final step alone "
        "(last_step=(step == total_steps))"]


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_forced_save_of_the_step_just_saved_leaves_it_as_it_is(tmp_path, caplog, mode):
    """A preemption handler's `save(step, force=True)` after the schedule's save of that step
    removed the complete step and wrote it again: a kill in between (the grace period's end)
    lost it, and with keep_latest_k = 1 every step. The state at that step is on disk already."""
    model = torch.nn.Linear(2, 2)
    config = Checkpoint(enable=True, interval=2, keep_latest_k=1, async_mode=mode)
    with CheckpointManager(config, [model], torch.optim.AdamW(model.parameters()),
                           base_folder=str(tmp_path)) as manager:
        assert manager.save(2)
        manager.wait()
        marker = os.stat(os.path.join(_folder(tmp_path), "step-2", commit.MARKER))
        caplog.clear()
        with caplog.at_level("INFO", logger="torchtitan_ckpt"):
            assert not manager.save(2, force=True)
        assert caplog.messages == ["step 2 (full, dcp) holds this job's state already (saved or loaded by it): "
                                   "not saved again"]
        kept = os.stat(os.path.join(_folder(tmp_path), "step-2", commit.MARKER))
        assert (marker.st_ino, marker.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)
        assert manager.save(2, last_step=True)  # another kind (the model alone): saved over it, as before
    replaced = os.stat(os.path.join(_folder(tmp_path), "step-2", commit.MARKER))
    assert (marker.st_ino, marker.st_mtime_ns) != (replaced.st_ino, replaced.st_mtime_ns)
    assert layout.committed_steps(_folder(tmp_path)) == [2]


def test_a_job_that_saves_beside_a_runs_steps_without_loading_is_told_to_call_load(tmp_path, caplog):
    """A restarted job that never called load() trained from scratch beside the run's steps and
    was told that it "went back to an older step", which it never loaded."""
    model = torch.nn.Linear(2, 2)
    config = Checkpoint(enable=True, interval=1, keep_latest_k=0)
    with CheckpointManager(config, [model], base_folder=str(tmp_path)) as manager:
        manager.save(5)
    with CheckpointManager(config, [model], base_folder=str(tmp_path)) as manager:
        manager.save(1)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"{_folder(tmp_path)}: steps [5] are newer than step 1 just saved (this job never called load(): it started "
        "afresh beside a run's steps; call manager.load() before training to resume from them) and are kept; a load "
        "without a step would pick step 5 over it: remove them if that run is abandoned"]


def test_a_save_of_the_step_just_loaded_leaves_it_as_it_is(tmp_path):
    """A resumed loop saving at the step it loaded removed that step and wrote it again: a state
    that could not be written then (a value nothing pickles) left no step to resume from."""
    model = torch.nn.Linear(2, 2)
    state = Holder({"note": "ok"})
    config = Checkpoint(enable=True, interval=1, keep_latest_k=1)
    with CheckpointManager(config, [model], states={"extra": state}, base_folder=str(tmp_path)) as manager:
        manager.save(2)
    with CheckpointManager(config, [model], states={"extra": state}, base_folder=str(tmp_path)) as manager:
        assert manager.load()
        state.value = {"note": threading.Lock()}
        assert not manager.save(2)
        with pytest.raises(CheckpointSaveError, match=r"state value 'extra.note' \(lock\) cannot be saved"):
            manager.save(3)
    assert layout.committed_steps(_folder(tmp_path)) == [2]


def test_a_save_of_a_step_saved_before_a_load_went_back_is_made_again(tmp_path):
    """The skip of a step saved already holds until a load: a job that went back to an older
    step and trained to the same step again saves its new state there."""
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(Checkpoint(enable=True, interval=1, keep_latest_k=0), [model],
                           base_folder=str(tmp_path)) as manager:
        manager.save(1)
        with torch.no_grad():
            model.weight.add_(1)
        assert manager.save(2)
        assert manager.load(1)
        with torch.no_grad():
            model.weight.add_(2)
        assert manager.save(2)
    assert torch.equal(read_checkpoint(layout.step_dir(_folder(tmp_path), 2))["weight"], model.weight)


@pytest.mark.parametrize("model_only", [False, True], ids=["full", "model-only"])
def test_a_module_renamed_since_the_save_is_named_with_the_saved_names_of_its_shapes(tmp_path, model_only):
    """A module renamed since the save: the refusal named the job's names the step lacks, and not
    the step's names that nothing took, which say what the new names were called before."""
    def job(name):
        model = torch.nn.Module()
        model.add_module("embed", torch.nn.Embedding(5, 3))
        model.add_module(name, torch.nn.Linear(3, 4))
        return model, torch.optim.AdamW(model.parameters())

    model, opt = job("head")
    model.head(model.embed(torch.tensor([1]))).sum().backward()
    opt.step()
    with CheckpointManager(Checkpoint(enable=True, interval=1), [model], opt, base_folder=str(tmp_path)) as manager:
        manager.save(1, last_step=model_only)
    model, opt = job("output")
    config = Checkpoint(enable=True, load_only=model_only)
    with CheckpointManager(config, [model], opt, base_folder=str(tmp_path)) as manager:
        with pytest.raises(CheckpointError, match=r"step-1 lacks 2 tensors this job has, e.g. \['output.weight', "
                                                  r"'output.bias'\]; was it saved from a different model\? It holds "
                                                  r"2 tensors of those shapes that this rank loads none of, e.g. "
                                                  r"\['head.bias', 'head.weight'\]: renamed since the save\?$"):
            manager.load()


def test_a_manager_whose_start_fails_lets_go_of_the_folder_and_the_optimizer(tmp_path, monkeypatch):
    """A failure once the folder is held and the optimizer hooked (here: finding the steps to
    load) closes what was started: the folder is not held (`clean` takes it), the optimizer's
    step waits on no manager, and the trainer's next manager, made in the same process, saves."""
    from torchtitan_ckpt import manager as manager_module

    def failing(*args, **kwargs):
        raise RuntimeError("injected: the steps could not be listed")

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = Checkpoint(enable=True, interval=1)
    monkeypatch.setattr(manager_module, "TargetFinder", failing)
    with pytest.raises(RuntimeError, match="injected"):
        CheckpointManager(config, [model], optimizers=opt, base_folder=str(tmp_path))
    monkeypatch.undo()
    assert not step_hooks.waits(opt)
    folder = str(tmp_path / "checkpoint")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    clean = subprocess.run([sys.executable, "-m", "torchtitan_ckpt.cli", "clean", folder, "-q"], capture_output=True,
                           text=True, timeout=120, env=env)
    assert clean.returncode == 0, clean.stderr
    with CheckpointManager(config, [model], optimizers=opt, base_folder=str(tmp_path)) as manager:
        assert not manager.load() and manager.save(1)
    assert layout.committed_steps(folder) == [1]


def test_retention_failing_after_a_load_fails_no_load(tmp_path, monkeypatch, caplog):
    """The step is in memory once loaded: retention's failure (a permission, a file system) is
    a warning, and the job goes on with the older steps kept."""
    from torchtitan_ckpt import manager as manager_module

    job = make_job(str(tmp_path), steps=8, interval=2, keep_latest_k=0)
    job.run_to(6, steps=8)
    job.manager.close()

    def failing(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "injected")

    monkeypatch.setattr(manager_module, "steps_to_delete", failing)
    resumed = make_job(str(tmp_path), steps=8, interval=2, keep_latest_k=1)
    assert resumed.manager.load() and resumed.train_state.step == 6
    resumed.manager.close()
    assert ("step 6 is loaded, but retention could not run: [Errno 13] Permission denied: 'injected'; older steps "
            "are kept until a later save") in caplog.text
    assert layout.committed_steps(os.path.join(tmp_path, "checkpoint")) == [2, 4, 6]


@pytest.mark.parametrize("mode", ["disabled", "async_with_pinned_mem"])
def test_a_job_whose_default_device_is_not_the_cpu_saves_loads_and_exports(tmp_path, mode):
    """A training script's `torch.set_default_device` (CUDA; meta stands in for it here) reached
    the tensors the package makes for its own CPU work: a synchronous save failed, a cast load on
    one thread failed, the pinned mode's shared counter was refused, and the Hugging Face export's
    q/k rows were permuted through an index of uninitialised memory and committed."""
    from torchtitan_ckpt.example.model import FLAVORS, Transformer, hf_adapter  # noqa: PLC0415
    from torchtitan_ckpt.hf import load_hf, save_hf  # noqa: PLC0415

    torch.manual_seed(0)
    model = Transformer(FLAVORS["debugmodel"])
    reference = str(tmp_path / "reference")
    save_hf(model.state_dict(), reference, hf_adapter(model.args))
    narrow = Transformer(FLAVORS["debugmodel"])
    for p in narrow.parameters():
        p.data = p.data.to(torch.bfloat16)
    config = Checkpoint(enable=True, interval=1, async_mode=mode, load_threads=1, keep_latest_k=0)
    with torch.device("meta"):
        with CheckpointManager(config, [model], base_folder=str(tmp_path)) as manager:
            assert manager.save(1)
            manager.wait()
        with CheckpointManager(dataclasses.replace(config, load_only=True), [narrow],
                               base_folder=str(tmp_path)) as manager:
            assert manager.load()  # float32 into bfloat16: read through a buffer of the reader's
        save_hf(model.state_dict(), str(tmp_path / "hf"), hf_adapter(model.args))
    assert_same(dict(narrow.named_parameters()), {k: v.to(torch.bfloat16) for k, v in model.named_parameters()})
    for name in sorted(os.listdir(reference)):
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "reference" / name).read_bytes(), name
    loaded = Transformer(FLAVORS["debugmodel"])
    with torch.device("meta"):
        load_hf(loaded.state_dict(), str(tmp_path / "hf"), hf_adapter(model.args))
    assert_same(loaded.state_dict(), model.state_dict())


def test_a_steps_metadata_names_no_path_it_was_written_to(tmp_path):
    """`.metadata` kept the path the step was written at: a folder staged on a node's disk and
    uploaded (a step on object storage named that node's path), or `convert`'s temporary
    name, and two saves of one state differed in it."""
    from torch.distributed.checkpoint import FileSystemReader

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    for name in ("a", "b"):
        with CheckpointManager(Checkpoint(enable=True, interval=1), [model], base_folder=str(tmp_path / name)) as m:
            m.save(1)
    metas = [FileSystemReader(layout.step_dir(_folder(tmp_path / name), 1)).read_metadata().storage_meta
             for name in ("a", "b")]
    assert [m.checkpoint_id for m in metas] == [None, None]
    assert all(isinstance(m.save_id, str) and m.save_id for m in metas)
