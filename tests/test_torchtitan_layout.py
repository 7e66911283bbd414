"""TorchTitan's layout and its step folders, without the torchtitan package: foreign folders are
loaded and never deleted, every built-in state has TorchTitan's keys, models with state-dict hooks
and wrappers save under their own keys, and the manager has TorchTitan's API."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from torchtitan_ckpt import (CheckpointError, CheckpointManager, CheckpointNotFoundError, CheckpointSaveError, cli,
                             commit, layout)
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.dcp.metadata import METADATA_FILE
from torchtitan_ckpt.example.model import hf_adapter

from .helpers import assert_same, hub_snapshot, read_checkpoint, syscalls
from .jobs import make_job


def _folder(tmp_path) -> str:
    return os.path.join(tmp_path, "checkpoint")


def _as_foreign(path: str) -> None:
    """What another program's finished DCP step looks like: the same files, no marker of ours."""
    os.remove(os.path.join(path, commit.MARKER))
    os.remove(os.path.join(path, commit.IN_PROGRESS))


def _foreign_steps(tmp_path) -> tuple:
    """Steps 2 and 4 as another program left them (finished), step 5 as one it is still writing
    (no `.metadata` yet), and the job that wrote them at step 4 with what it did next."""
    job = make_job(str(tmp_path), steps=20, interval=2, keep_latest_k=0)
    job.run_to(4, steps=20)
    job.manager.close()
    folder = _folder(tmp_path)
    for step in (2, 4):
        _as_foreign(layout.step_dir(folder, step))
    shutil.copytree(layout.step_dir(folder, 4), layout.step_dir(folder, 5))
    os.remove(os.path.join(layout.step_dir(folder, 5), METADATA_FILE))
    return job, [job.step() for _ in range(2)]


def test_foreign_steps_resume_and_are_never_deleted(tmp_path, capsys, caplog):
    source, later = _foreign_steps(tmp_path)
    folder = _folder(tmp_path)
    assert [(s.step, s.status) for s in layout.scan(folder)] == [(2, "foreign"), (4, "foreign"), (5, "unknown")]

    fresh = make_job(str(tmp_path), steps=20, interval=2, keep_latest_k=1, init_seed=7)
    with caplog.at_level(logging.INFO, logger="torchtitan_ckpt"):
        assert fresh.manager.load()
    assert "step-4: a foreign dcp checkpoint (no COMMITTED.json: not written by torchtitan_ckpt), unverified" in caplog.text
    assert not [r for r in caplog.records if "a foreign dcp checkpoint" in r.getMessage() and r.levelno > logging.INFO]
    assert "ignoring" in caplog.text and "step-5: not written by torchtitan_ckpt" in caplog.text
    assert "step(s) 5, ahead of step 4 this job starts from, were not written by torchtitan_ckpt" in caplog.text
    assert (fresh.train_state.step, fresh.sched.last_epoch) == (4, 4)
    assert [fresh.step() for _ in range(2)] == later  # dataloader position, optimizer, model: all resumed
    assert_same(fresh.model.state_dict(), source.model.state_dict())
    fresh.manager.save(6)
    fresh.manager.save(8)
    fresh.manager.close()
    # keep_latest_k = 1 keeps one step of ours; the other program's folders all stay
    assert [(s.step, s.status) for s in layout.scan(folder)] == [
        (2, "foreign"), (4, "foreign"), (5, "unknown"), (8, "complete")]

    assert cli.main(["clean", folder]) == 0
    assert cli.main(["list", folder]) == 0
    out = capsys.readouterr().out
    assert "0 partial step folders removed" in out
    rows = [line.split()[:2] for line in out.splitlines() if line.split()[:1] in (["2"], ["4"], ["5"], ["8"])]
    assert rows == [["2", "foreign"], ["4", "foreign"], ["5", "unknown"], ["8", "complete"]]
    assert len(layout.scan(folder)) == 4
    assert cli.main(["inspect", layout.step_dir(folder, 2)]) == 0
    assert "optimizer.state.output.weight.exp_avg" in capsys.readouterr().out

    verifying = make_job(str(tmp_path), steps=20, interval=2, init_seed=7, load_only=True, verify_on_load=True,
                         verify_fallback=False, load_step=4)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torchtitan_ckpt"):
        assert verifying.manager.load()  # no manifest to verify against: loaded, not quietly
    said = [r for r in caplog.records if "a foreign dcp checkpoint" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING], said
    assert "unverified (checkpoint.verify_on_load needs the manifest a save of ours writes)" in said[0].getMessage()
    verifying.manager.close()


def test_load_step_and_initial_load_path_may_name_a_foreign_step(tmp_path):
    _foreign_steps(tmp_path)
    chosen = make_job(str(tmp_path), steps=20, load_step=2)
    assert chosen.manager.load() and chosen.train_state.step == 2
    chosen.manager.close()
    again = make_job(str(tmp_path), steps=20)
    assert again.manager.load(step=2) and again.train_state.step == 2  # load(step) wins over the newest
    again.manager.close()
    with pytest.raises(CheckpointNotFoundError, match=r"step-5 is not loadable \(not written by torchtitan_ckpt"):
        make_job(str(tmp_path), steps=20, load_step=5).manager.load()

    other = tmp_path / "other"
    initial = make_job(str(other), steps=20, initial_load_path=layout.step_dir(_folder(tmp_path), 4),
                       initial_load_model_only=False)
    assert initial.manager.load() and initial.train_state.step == 4
    initial.manager.close()


def test_a_foreign_step_0_is_a_seed_whose_model_alone_is_read(tmp_path, caplog):
    """TorchTitan writes its seed checkpoint as step 0, with every state unless its last save is
    model-only (the optimizer then holds the step count of the zero-learning-rate step that made
    its state), and loads a step 0 as the model alone: so do we."""
    job = make_job(str(tmp_path), steps=20, interval=2, keep_latest_k=0)
    job.run_to(2, steps=20)
    job.manager.close()
    folder = _folder(tmp_path)
    os.rename(layout.step_dir(folder, 2), layout.step_dir(folder, 0))
    _as_foreign(layout.step_dir(folder, 0))
    assert {k.split(".")[0] for k in read_checkpoint(layout.step_dir(folder, 0))} >= {"optimizer", "train_state"}
    fresh = make_job(str(tmp_path), steps=20, interval=2, init_seed=7)
    with caplog.at_level(logging.INFO, logger="torchtitan_ckpt"):
        assert fresh.manager.load()
    assert "step-0: a foreign dcp checkpoint" in caplog.text and "step 0, a seed: its model alone" in caplog.text
    assert_same(fresh.model.state_dict(), job.model.state_dict())
    assert (fresh.train_state.step, fresh.sched.last_epoch, fresh.opt.state_dict()["state"]) == (0, 0, {})
    fresh.manager.close()


def test_a_crashed_save_of_ours_is_partial_never_loaded_and_cleaned(tmp_path, capsys):
    job = make_job(str(tmp_path), steps=20, interval=2, keep_latest_k=0)
    job.run_to(2, steps=20)
    job.manager.close()
    folder = _folder(tmp_path)
    # prepare marks the folder ours before any file is written; a crash after DCP's .metadata
    # (a finished checkpoint by DCP's test) leaves it ours and partial
    crashed = layout.step_dir(folder, 4)
    shutil.copytree(layout.step_dir(folder, 2), crashed)
    commit.uncommit(crashed)
    assert sorted(os.listdir(crashed)) == sorted(set(os.listdir(layout.step_dir(folder, 2))) - {commit.MARKER}
                                                 | {commit.IN_PROGRESS})
    assert layout.status_of(crashed) == layout.PARTIAL
    evaluation = make_job(str(tmp_path), steps=20, load_only=True)
    assert evaluation.manager.load() and evaluation.train_state.step == 2
    evaluation.manager.close()
    with pytest.raises(CheckpointNotFoundError, match="its save did not finish"):
        make_job(str(tmp_path / "b"), steps=20, initial_load_path=crashed).manager.load()
    assert cli.main(["clean", folder]) == 0
    assert "1 partial step folder removed" in capsys.readouterr().out
    assert [s.step for s in layout.scan(folder)] == [2]
    shutil.copytree(layout.step_dir(folder, 2), crashed)
    commit.uncommit(crashed)
    fresh = make_job(str(tmp_path), steps=20)  # a job that saves: the crashed save goes at its load
    assert fresh.manager.load() and fresh.train_state.step == 2
    fresh.manager.close()
    assert [s.step for s in layout.scan(folder)] == [2]


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")  # PyTorch's writer, as TorchTitan meets it
def test_a_step_another_program_finished_in_a_folder_of_ours_is_foreign(tmp_path, capsys, caplog):
    """TorchTitan's manager saves into a `step-N` it finds, removing nothing first (PyTorch's own
    writer): over a save of ours that was killed (its in-progress marker left), or over a step of
    ours (a job gone back with `load_step`). Its step is then loaded as TorchTitan's, unverified,
    and never deleted; one whose `.metadata` is ours stays ours, however new its time."""
    job = make_job(str(tmp_path), steps=20, interval=2, keep_latest_k=0)
    job.run_to(4, steps=20)
    job.manager.close()
    folder = _folder(tmp_path)
    killed, rewritten = layout.step_dir(folder, 4), layout.step_dir(folder, 2)
    theirs = {k: v + 1 if torch.is_tensor(v) and v.is_floating_point() else v
              for k, v in read_checkpoint(killed).items()}
    for name in (commit.MARKER, METADATA_FILE):  # our save of step 4, killed while writing its data
        os.remove(os.path.join(killed, name))
    assert layout.status_of(killed) == layout.PARTIAL
    metadata = os.path.join(rewritten, METADATA_FILE)
    later = os.stat(os.path.join(rewritten, commit.MARKER)).st_mtime_ns + 10**9
    os.utime(metadata, ns=(later, later))  # as a copy may leave it: read, and found ours
    assert layout.status_of(rewritten) == layout.COMPLETE

    for path in (killed, rewritten):
        dcp.save(theirs, storage_writer=dcp.FileSystemWriter(path, overwrite=True))
        assert layout.status_of(path) == layout.FOREIGN
    fresh = make_job(str(tmp_path), steps=20, interval=2, keep_latest_k=1, verify_on_load=True, init_seed=7)
    with caplog.at_level(logging.INFO, logger="torchtitan_ckpt"):
        assert fresh.manager.load()
    assert f"loading {killed}: a foreign dcp checkpoint (written by another program over a save of ours" in caplog.text
    assert fresh.train_state.step == 4
    assert_same(fresh.model.state_dict(), {k: v for k, v in theirs.items() if k in fresh.model.state_dict()})
    fresh.manager.save(6)
    fresh.manager.save(8)
    fresh.manager.close()
    assert cli.main(["clean", folder]) == 0
    assert [(s.step, s.status) for s in layout.scan(folder)] == [(2, "foreign"), (4, "foreign"), (8, "complete")]
    capsys.readouterr()
    assert cli.main(["verify", rewritten]) == 2
    assert "holds another program's step, written over a step of ours" in capsys.readouterr().err


def test_a_committed_step_keeps_its_in_progress_marker_out_of_its_manifest(tmp_path):
    """Kept until the folder is removed (`commit`'s docstring: a copy taken mid-commit holds one
    marker at least), never one of the step's files."""
    job = make_job(str(tmp_path), steps=4, interval=2)
    job.run_to(2, steps=4)
    job.manager.close()
    step2 = layout.step_dir(_folder(tmp_path), 2)
    assert commit.IN_PROGRESS in os.listdir(step2) and layout.status_of(step2) == layout.COMPLETE
    assert commit.IN_PROGRESS not in commit.read_marker(step2).files and commit.verify(step2) == []


def test_a_save_never_replaces_a_folder_that_is_not_ours(tmp_path):
    _foreign_steps(tmp_path)
    step4 = layout.step_dir(_folder(tmp_path), 4)
    before = sorted(os.listdir(step4))
    job = make_job(str(tmp_path), steps=20, interval=2)
    job.train_state.step = 4
    with pytest.raises(CheckpointSaveError, match="step-4 exists and was not written by torchtitan_ckpt"):
        job.manager.save(4)
    job.manager.close()
    assert sorted(os.listdir(step4)) == before


def test_a_foreign_step_a_save_would_meet_is_refused_before_training(tmp_path):
    """TorchTitan's finished run left step 5 (full) and step 10 (its model-only last save); ours
    resumes from step 5 as documented, and its save at step 10 would meet TorchTitan's folder,
    which is never replaced: the load fails, saying what to do, where that save failed after
    the training up to it. Moved away, the run goes on."""
    job = make_job(str(tmp_path), steps=10, interval=5, keep_latest_k=0)
    job.run_to(10, steps=10)
    job.manager.close()
    folder = _folder(tmp_path)
    step5, step10 = (layout.step_dir(folder, s) for s in (5, 10))
    for step in (step5, step10):
        _as_foreign(step)
    extended = make_job(str(tmp_path), steps=20, interval=5, init_seed=7)
    before = {k: v.clone() for k, v in extended.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=(
            rf"^{folder}: step\(s\) 10 were not written by torchtitan_ckpt \(another program's, such as TorchTitan's "
            r"last save\) and this job, starting from step 5, saves step 10 \(checkpoint.interval = 5\); a save never "
            r"replaces a folder it did not write, so that save would fail after the training up to it. Before "
            rf"training, move {step10} out of the folder, or save into another checkpoint.folder "
            rf"\(checkpoint.initial_load_path = '{step5}' with checkpoint.initial_load_model_only = false starts it "
            r"from the same step there\)$")):
        extended.manager.load()
    assert extended.train_state.step == 0
    assert_same(extended.model.state_dict(), before)
    extended.manager.close()
    assert [(s.step, s.status) for s in layout.scan(folder)] == [(5, "foreign"), (10, "foreign")]

    shutil.move(step10, str(tmp_path / "final"))
    moved = make_job(str(tmp_path), steps=20, interval=5, init_seed=7)
    assert moved.manager.load() and moved.train_state.step == 5
    moved.run_to(10, steps=20)
    moved.manager.close()
    assert [(s.step, s.status) for s in layout.scan(folder)] == [(5, "foreign"), (10, "complete")]


def test_a_folder_of_no_known_format_a_save_would_meet_is_refused_and_an_empty_one_is_not(tmp_path):
    """Another program's step-10 still being written (files, no index yet) is never replaced
    either: refused before training too. An empty step-10 (a save of ours killed before its
    marker) is the save's to replace."""
    folder = _folder(tmp_path)
    step10 = layout.step_dir(folder, 10)
    os.makedirs(step10)
    job = make_job(str(tmp_path), steps=20, interval=5)
    assert not job.manager.load()  # empty: replaced by the save
    job.manager.close()
    with open(os.path.join(step10, "__0_0.distcp"), "wb") as f:
        f.write(b"x")
    job = make_job(str(tmp_path), steps=20, interval=5)
    with pytest.raises(CheckpointError, match=r"step\(s\) 10 were not written by torchtitan_ckpt .* saves step 10"):
        job.manager.load()
    job.manager.close()
    assert os.listdir(step10) == ["__0_0.distcp"]
    shutil.rmtree(step10)
    for make in (lambda: open(step10, "w").close(), lambda: os.symlink(str(tmp_path / "gone"), step10)):
        make()  # a file, a dangling link: not folders, and in the way of the save all the same
        job = make_job(str(tmp_path), steps=20, interval=5)
        with pytest.raises(CheckpointError, match=r"step\(s\) 10 (are links .* or )?were not written by torchtitan_ckpt"):
            job.manager.load()
        job.manager.close()
        os.remove(step10)


def test_thousands_of_foreign_steps_ahead_are_counted_not_listed(tmp_path):
    """A folder holding thousands of another run's unfinished steps made a refusal as long (3,000: 17,676
    characters); ten are named, then their count."""
    folder = _folder(tmp_path)
    for step in range(5, 3005, 5):
        os.makedirs(layout.step_dir(folder, step))
        open(os.path.join(layout.step_dir(folder, step), "__0_0.distcp"), "wb").close()
    job = make_job(str(tmp_path), steps=20, interval=5)
    with pytest.raises(CheckpointError, match=r"step\(s\) 5, 10, .*, 50 and 590 more were not written") as refused:
        job.manager.load()
    job.manager.close()
    assert len(str(refused.value)) < 1000


def test_a_linked_step_a_save_would_meet_is_refused_before_training(tmp_path):
    """Step 10, a link to another run's step 10 (ours too), ahead of step 5 that `load_step`
    names: a run linked in is never changed, so its save at step 10 would fail after the training
    (it failed in the middle of that save, with a raw OSError): refused at `load()`. The save
    itself, asked directly, refuses the link by name; the linked run is left as it was."""
    other = make_job(str(tmp_path / "other"), steps=10, interval=5, keep_latest_k=0)
    other.run_to(10, steps=10)
    other.manager.close()
    job = make_job(str(tmp_path), steps=20, interval=5)
    job.run_to(5, steps=20)
    job.manager.close()
    folder, elsewhere = _folder(tmp_path), layout.step_dir(_folder(tmp_path / "other"), 10)
    os.symlink(elsewhere, layout.step_dir(folder, 10))
    before = sorted(os.listdir(elsewhere))
    resumed = make_job(str(tmp_path), steps=20, interval=5, load_step=5)
    with pytest.raises(CheckpointError, match=(
            r"step\(s\) 10 are links to folders elsewhere \(a run linked in is never changed\) or were not "
            r"written by torchtitan_ckpt and this job, starting from step 5, saves step 10")):
        resumed.manager.load()
    resumed.manager.close()
    saving = make_job(str(tmp_path), steps=20, interval=5)
    saving.train_state.step = 10
    with pytest.raises(CheckpointSaveError, match=rf"step-10 is a link to {elsewhere}: a step folder linked in"):
        saving.manager.save(10)
    saving.manager.close()
    assert sorted(os.listdir(elsewhere)) == before and commit.is_committed(elsewhere)


def test_a_step_of_ours_in_a_hub_cache_snapshot_loads_and_a_link_farm_is_never_deleted(tmp_path):
    """A step of ours uploaded to the Hub and downloaded into its cache: every file, the commit
    marker included, is a link into the repository's blobs. Taking such a marker for another
    program's made the step unknown and unloadable; it loads, verified. The same links in a run
    folder (a `cp -rs` copy of a step) are a step linked in: never counted or deleted."""
    job = make_job(str(tmp_path / "a"), steps=6, interval=2)
    job.run_to(2, steps=6)
    job.manager.close()
    step = layout.step_dir(_folder(tmp_path / "a"), 2)
    snapshot = hub_snapshot(step, tmp_path / "hub" / "models--org--ours")
    fresh = make_job(str(tmp_path / "b"), steps=6, interval=2, init_seed=3, initial_load_path=str(snapshot),
                     verify_on_load=True)
    assert fresh.manager.load()
    assert_same(fresh.model.state_dict(), job.model.state_dict())
    fresh.manager.close()

    farm = layout.step_dir(_folder(tmp_path / "c"), 2)
    os.makedirs(farm)
    for name in os.listdir(step):
        os.symlink(os.path.join(step, name), os.path.join(farm, name))
    linked = make_job(str(tmp_path / "c"), steps=8, interval=2, keep_latest_k=1)
    linked.train_state.step = 2
    linked.run_to(6, steps=8)  # saves 4 and 6, each followed by retention
    linked.manager.close()
    assert [(s.step, s.status, s.linked) for s in layout.scan(_folder(tmp_path / "c"))] == [
        (2, "complete", True), (6, "complete", False)]
    assert sorted(os.listdir(farm)) == sorted(os.listdir(step)) and commit.is_committed(step)


def test_a_foreign_hugging_face_last_save_is_passed_over_without_an_adapter(tmp_path, caplog):
    """TorchTitan's last save with last_save_in_hf (a Hugging Face folder, model only) after its
    full step 5: a job with no state-dict adapter resumes from step 5, where reading the Hugging
    Face step's index asked for an adapter. Named by load_step, it is refused as model-only."""
    from safetensors.torch import save_file

    def build() -> tuple[nn.Module, torch.optim.Optimizer, CheckpointManager]:
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        config = Checkpoint(enable=True, folder=str(tmp_path), interval=5, keep_latest_k=0)
        return model, opt, CheckpointManager(config, model, optimizers=opt)

    model, opt, manager = build()
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    manager.save(5)
    manager.close()
    _as_foreign(layout.step_dir(str(tmp_path), 5))
    last = layout.step_dir(str(tmp_path), 12)
    os.makedirs(last)
    save_file({"weight": torch.zeros(4, 4), "bias": torch.zeros(4)}, os.path.join(last, "model.safetensors"))
    assert [(s.step, s.status) for s in layout.scan(str(tmp_path))] == [(5, "foreign"), (12, "foreign")]

    _, resumed_opt, resumed = build()
    with caplog.at_level(logging.WARNING, logger="torchtitan_ckpt"):
        assert resumed.load()
    assert "step(s) 12 hold only the model (a finished run's last save): resuming from step 5" in caplog.text
    for index in (0, 1):  # the weight's and the bias's moments: the optimizer resumed
        assert_same(resumed_opt.state_dict()["state"][index], opt.state_dict()["state"][index])
    with pytest.raises(CheckpointError, match=rf"^load\(12\): {last} holds only the model"):
        resumed.load(step=12)
    resumed.close()


@pytest.mark.parametrize("left", [[], [commit.IN_PROGRESS + ".tmp"]], ids=["empty", "marker-unfinished"])
def test_a_save_replaces_the_folder_a_save_left_before_marking_it(tmp_path, left, monkeypatch):
    """A save stopped between creating its folder and marking it (a full disk, a kill) leaves a
    folder that is empty or holds only the marker's temporary file: saving that step again
    replaces it (it was refused for good as another program's). The new folder's entry is
    fsynced in its parent before anything is written into it."""
    step2 = os.path.abspath(layout.step_dir(_folder(tmp_path), 2))
    os.makedirs(step2)
    for name in left:
        open(os.path.join(step2, name), "w").close()
    calls = syscalls(monkeypatch)
    job = make_job(str(tmp_path), steps=4, interval=2)
    job.run_to(2, steps=4)
    job.manager.close()
    assert layout.committed_steps(_folder(tmp_path)) == [2]
    made = calls.index(("mkdir", step2))  # (later ones are writers making sure it exists)
    inside = next(i for i, (_, path) in enumerate(calls[made:], made) if path.startswith(step2 + os.sep))
    assert ("fsync", os.path.dirname(step2)) in calls[made:inside], calls[made:inside]


def test_every_builtin_state_has_torchtitans_keys(tmp_path):
    job = make_job(str(tmp_path), steps=4, interval=2)
    job.run_to(2, steps=4)
    job.manager.close()
    saved = read_checkpoint(layout.step_dir(_folder(tmp_path), 2))
    sched = job.sched.state_dict()
    assert {k for k in saved if k.startswith("lr_scheduler.")} == {f"lr_scheduler.{k}" for k in sched}
    assert saved["lr_scheduler.last_epoch"] == 2 and saved["lr_scheduler.base_lrs"] == sched["base_lrs"]
    assert {k for k in saved if k.startswith("dataloader.")} == {"dataloader.dp_rank_0", "dataloader.world_size"}
    assert saved["dataloader.world_size"] == 1 and isinstance(saved["dataloader.dp_rank_0"], bytes)
    assert {k: saved[k] for k in saved if k.startswith("train_state.")} == {
        "train_state.step": 2, "train_state.ntokens_seen": 2 * 4 * 16}
    assert saved["optimizer.param_groups.output.weight.lr"] == job.opt.param_groups[0]["lr"]
    assert saved["optimizer.param_groups.output.weight.betas"] == (0.9, 0.999)
    assert not any(k.endswith(".param_names") for k in saved)


def _torchtitan_030_step(tmp_path, source) -> str:
    """A step as TorchTitan 0.3.0 lays out the scheduler (`last_epoch` alone) and a dataloader
    state saved by 2 data-parallel ranks."""
    state = read_checkpoint(layout.step_dir(_folder(tmp_path), 2))
    state = {k: v for k, v in state.items() if not k.startswith(("lr_scheduler.", "dataloader."))}
    state.update({"lr_scheduler.last_epoch": 2, "dataloader.dp_rank_0": state.get("dataloader.dp_rank_0", b""),
                  "dataloader.dp_rank_1": b"", "dataloader.world_size": 2})
    path = str(tmp_path / "titan030" / "step-2")
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


def test_a_scheduler_saved_as_last_epoch_alone_and_another_dp_degree_load(tmp_path, caplog):
    source = make_job(str(tmp_path), steps=8, interval=2)
    source.run_to(2, steps=8)
    source.manager.close()
    path = _torchtitan_030_step(tmp_path, source)
    job = make_job(str(tmp_path / "b"), steps=8, initial_load_path=path, initial_load_model_only=False)
    with caplog.at_level(logging.WARNING, logger="torchtitan_ckpt"):
        assert job.manager.load()
    job.manager.close()
    assert caplog.text.count("the dataloader state was saved by 2 data-parallel ranks and this job has 1; "
                             "the dataloader starts from the beginning") == 1
    assert (job.sched.last_epoch, job.sched._step_count) == (2, 3)
    assert job.sched.get_last_lr() == source.sched.get_last_lr()
    assert job.opt.param_groups[0]["lr"] == source.opt.param_groups[0]["lr"]


class _FusedQKV(nn.Module):
    """One `wqkv` parameter saved as `wq`/`wk`/`wv` by state-dict hooks (TorchTitan 0.3.0's
    llama3 attention does the same)."""

    def __init__(self, dim: int):
        super().__init__()
        self.wqkv = nn.Parameter(torch.randn(3 * dim, dim))
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._fuse)

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata):
        fused = state_dict.pop(prefix + "wqkv")
        for name, part in zip(("wq", "wk", "wv"), fused.chunk(3)):
            state_dict[prefix + name] = part

    @staticmethod
    def _fuse(module, state_dict, prefix, *args):
        names = [prefix + n for n in ("wq", "wk", "wv")]
        if all(n in state_dict for n in names):
            state_dict[prefix + "wqkv"] = torch.cat([state_dict.pop(n) for n in names])

    def forward(self, x):
        return x @ self.wqkv.T


def _wrapped_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    blocks = nn.ModuleList([checkpoint_wrapper(_FusedQKV(4)) for _ in range(2)])
    return torch.compile(nn.ModuleDict({"layers": blocks}))  # compiled only when called


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.ones(2, 4)
    for block in model._orig_mod["layers"]:
        x = block(x)[:, :4]
    x.sum().backward()
    opt.step()


def test_a_model_with_state_dict_hooks_and_wrappers_saves_under_its_own_keys(tmp_path):
    model = _wrapped_model(0)
    opts = [torch.optim.AdamW([p], lr=0.1) for p in model.parameters()]  # two optimizers, one part
    _train(model, opts[0])
    _train(model, opts[1])
    config = Checkpoint(enable=True, interval=1)
    with CheckpointManager(config, model, optimizers=opts, base_folder=str(tmp_path)) as manager:
        manager.save(1)
    saved = read_checkpoint(layout.step_dir(_folder(tmp_path), 1))
    assert sorted(k for k in saved if "optimizer" not in k) == [
        f"layers.{i}.{n}" for i in range(2) for n in ("wk", "wq", "wv")]
    assert sorted(k for k in saved if k.startswith("optimizer.state.")) == [
        f"optimizer.state.layers.{i}.wqkv.{n}" for i in range(2) for n in ("exp_avg", "exp_avg_sq", "step")]

    fresh = _wrapped_model(1)
    fresh_opts = [torch.optim.AdamW([p], lr=0.5) for p in fresh.parameters()]
    with CheckpointManager(config, fresh, optimizers=fresh_opts, base_folder=str(tmp_path)) as manager:
        assert manager.load()
    assert_same(fresh.state_dict(), model.state_dict())
    for got, want in zip(fresh_opts, opts):
        assert got.param_groups[0]["lr"] == 0.1
        assert_same(got.state_dict()["state"][0], want.state_dict()["state"][0])


def test_sd_adapter_is_torchtitans_name_for_state_dict_adapter(tmp_path):
    job = make_job(str(tmp_path))
    job.manager.close()
    adapter = hf_adapter(job.model.args)
    config = Checkpoint(enable=True, last_save_in_hf=True)
    with CheckpointManager(config, job.model, sd_adapter=adapter, base_folder=str(tmp_path / "x")) as manager:
        assert manager.save(1, last_step=True)
    assert os.path.isfile(os.path.join(layout.step_dir(str(tmp_path / "x" / "checkpoint"), 1),
                                       "model.safetensors.index.json"))
    with pytest.raises(TypeError, match=r"pass state_dict_adapter= or sd_adapter= \(TorchTitan's name for it\), "
                                        "not both"):
        CheckpointManager(config, job.model, state_dict_adapter=adapter, sd_adapter=adapter)


@dataclasses.dataclass
class _TitansSection:
    """The shape of TorchTitan's `[checkpoint]` section (the real ones: tests/torchtitan_interop.py)."""

    enable: bool = True
    folder: str = "checkpoint"
    interval: int = 2
    enable_ft_dataloader_checkpoints: bool = True
    initial_load_path: str = ""


def test_the_constructor_takes_torchtitans_keywords_and_section(tmp_path):
    """TorchTitan's trainer builds its manager with `checkpoint_config=` (its own section),
    `sd_adapter=` and `ft_manager=`: the same call builds ours, its section converted."""
    job = make_job(str(tmp_path))
    job.manager.close()
    with CheckpointManager(dataloader=None, model_parts=[job.model], optimizers=job.opt, lr_schedulers=None,
                           states={}, checkpoint_config=_TitansSection(), sd_adapter=None,
                           base_folder=str(tmp_path / "x"), ft_manager=None) as manager:
        assert (manager.config.interval, manager.config.initial_load_path) == (2, None)
        assert manager.save(2) and manager.load()
    with pytest.raises(TypeError, match=r"pass config= or checkpoint_config= \(TorchTitan's name for it\), not both"):
        CheckpointManager(Checkpoint(), [job.model], checkpoint_config=_TitansSection())
    with pytest.raises(TypeError, match="ft_manager: TorchFT's fault-tolerant training is not run"):
        CheckpointManager(checkpoint_config=_TitansSection(), model_parts=[job.model], ft_manager=object())
    with pytest.raises(TypeError, match=r"config is a dict, not a \[checkpoint\] section"):
        CheckpointManager({"enable": True}, [job.model])


class _Values:
    def __init__(self, values: dict):
        self.values = values

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state_dict: dict) -> None:
        self.values = dict(state_dict)


def test_small_values_are_written_as_torch_save_writes_them_each(tmp_path):
    """Small values' bytes are made once per value (one per optimizer setting adds up); values
    that compare equal but are not the same value stay apart."""
    values = {"a": 1, "b": 1.0, "c": True, "d": -0.0, "e": 0.0, "f": (1, True), "g": (1.0, 1), "h": None}
    model = nn.Linear(2, 2)
    config = Checkpoint(enable=True, interval=1)
    for step in (1, 2):  # the second save reuses the bytes the first one made
        with CheckpointManager(config, model, states={"values": _Values(values)}, base_folder=str(tmp_path)) as m:
            m.save(step)
        saved = read_checkpoint(layout.step_dir(_folder(tmp_path), step))
        got = {k.removeprefix("values."): v for k, v in saved.items() if k.startswith("values.")}
        assert [(k, type(v), repr(v)) for k, v in sorted(got.items())] == \
            [(k, type(v), repr(v)) for k, v in sorted(values.items())]


def test_a_scheduler_or_optimizer_in_another_layout_is_an_error_not_a_silent_skip(tmp_path):
    source = make_job(str(tmp_path), steps=8, interval=2)
    source.run_to(2, steps=8)
    source.manager.close()
    state = read_checkpoint(layout.step_dir(_folder(tmp_path), 2))
    for old, new, message in (
            ("lr_scheduler.", "lr_scheduler.0.", r"step-2: the checkpoint has no lr_scheduler.last_epoch \(it has lr_scheduler.0._get_lr"),
            ("optimizer.param_groups.", "optimizer.param_groups_", r"step-2: the checkpoint has no optimizer "
                                                                   r"settings .* for 21 parameters")):
        path = str(tmp_path / new / "step-2")
        dcp.save({k.replace(old, new, 1): v for k, v in state.items()}, checkpoint_id=path, no_dist=True)
        job = make_job(str(tmp_path / "b"), steps=8, initial_load_path=path, initial_load_model_only=False)
        with pytest.raises(CheckpointError, match=message + ".*exclude_from_loading"):
            job.manager.load()
        job.manager.close()


def test_an_empty_step_folder_ahead_is_no_reason_to_refuse_a_resume(tmp_path):
    """A save killed between making `step-10` and marking it leaves an empty folder, which the
    next save there replaces: the check for other programs' steps ahead passed it for one."""
    job = make_job(str(tmp_path), steps=20, interval=5, keep_latest_k=0)
    job.run_to(5, steps=20)
    job.manager.close()
    os.makedirs(layout.step_dir(_folder(tmp_path), 10))
    resumed = make_job(str(tmp_path), steps=20, interval=5, keep_latest_k=0)
    assert resumed.manager.load() and resumed.train_state.step == 5
    resumed.run_to(10, steps=20)
    resumed.manager.close()
    assert [(s.step, s.status) for s in layout.scan(_folder(tmp_path))] == [(5, "complete"), (10, "complete")]
