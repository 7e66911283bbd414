"""Integrity: checksums recorded while writing, `verify`, `verify_on_load`, `clean`, a full disk."""

from __future__ import annotations

import json
import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
import zlib
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan_ckpt import (CheckpointError, CheckpointManager, CheckpointSaveError, ConfigError,
                             CorruptCheckpointError, NewerVersionError, OlderVersionError, cli, commit, layout)
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.storage.local import LOCK_FILE

from .helpers import ROOT, Holder, assert_same, read_checkpoint, spawn
from .jobs import make_job


def _saved(tmp_path, steps=4, **kw) -> str:
    job = make_job(str(tmp_path), steps=steps, interval=2, keep_latest_k=0, **kw)
    job.run_to(steps, steps=steps)
    job.manager.close()
    return os.path.join(tmp_path, "checkpoint")


def test_a_copy_of_a_step_taken_while_it_commits_or_is_removed_reads_as_ours_and_partial(tmp_path):
    """A tool that lists a step folder, then copies what it listed (`cp -r`, a sync tool) beside
    a live job: listed before the commit (the in-progress marker, which the commit removed), or
    before retention renamed the commit marker onto the in-progress one, the copy held the data
    files and neither marker: another program's finished step by its `.metadata`, loaded
    unverified in place of the run's newer complete steps, and never removed."""
    folder = _saved(tmp_path)
    step4 = layout.step_dir(folder, 4)
    assert sorted(os.listdir(step4))[:2] == [".metadata", commit.MARKER] and commit.is_in_progress(step4)
    copy = str(tmp_path / "copy" / "checkpoint")
    shutil.copytree(folder, copy)
    os.remove(os.path.join(layout.step_dir(copy, 4), commit.MARKER))  # listed before the commit, or renamed since
    assert [(s.step, s.status) for s in layout.scan(copy)] == [(2, layout.COMPLETE), (4, layout.PARTIAL)]
    job = make_job(str(tmp_path / "copy"), steps=4)
    assert job.manager.load() and job.train_state.step == 2
    job.manager.close()
    commit.uncommit(step4)  # retention's first move: the in-progress marker is there all along
    assert commit.is_in_progress(step4) and not commit.is_committed(step4)


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_manifest_checksums_are_those_of_the_bytes_on_disk(tmp_path):
    step2 = layout.step_dir(_saved(tmp_path), 2)
    info = commit.read_marker(step2)
    assert set(info.files) == {".metadata", "__0_0.distcp", "__0_1.distcp"}  # tensors, then values
    for rel, entry in info.files.items():
        with open(os.path.join(step2, rel), "rb") as f:
            data = f.read()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert commit.verify(step2) == []


@pytest.mark.parametrize("victim", [".metadata", "__0_0.distcp"])
def test_one_flipped_byte_in_any_file_is_found(tmp_path, capsys, victim):
    folder = _saved(tmp_path)
    step4 = layout.step_dir(folder, 4)
    size = os.path.getsize(os.path.join(step4, victim))
    for offset in (0, size // 2, size - 1):
        _flip_byte(os.path.join(step4, victim), offset)
        assert cli.main(["verify", step4]) == 1
        assert f"CORRUPT {step4}/{victim}: CRC-32" in capsys.readouterr().out
        _flip_byte(os.path.join(step4, victim), offset)  # restore
    assert cli.main(["verify", step4]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{step4}: 2 files, ") and out.rstrip().endswith("all intact")


def test_verify_on_load_falls_back_to_the_newest_intact_step(tmp_path, caplog):
    folder = _saved(tmp_path, steps=6, last_save_model_only=False)
    _flip_byte(os.path.join(layout.step_dir(folder, 6), "__0_0.distcp"), 100)
    job = make_job(str(tmp_path), steps=6, verify_on_load=True)
    assert job.manager.load()
    assert job.train_state.step == 4
    assert "step 6 is corrupt" in caplog.text
    job.manager.close()
    strict = make_job(str(tmp_path), steps=6, verify_on_load=True, verify_fallback=False)
    with pytest.raises(CorruptCheckpointError, match=r"step 6 failed verification: .*step-6/__0_0.distcp: CRC-32"):
        strict.manager.load()
    chosen = make_job(str(tmp_path), steps=6, verify_on_load=True, load_step=6)
    with pytest.raises(CorruptCheckpointError, match="step 6 failed verification"):
        chosen.manager.load()
    # without verify_on_load a file cut short is found by its size alone
    os.truncate(os.path.join(layout.step_dir(folder, 6), ".metadata"), 10)
    with pytest.raises(CorruptCheckpointError, match=r"step 6 failed verification: .*step-6/.metadata: 10 bytes, the "
                                                     r"manifest says \d+"):
        make_job(str(tmp_path), steps=6, verify_fallback=False).manager.load()


@pytest.mark.parametrize("cut", ["missing", "short"])
def test_a_step_copied_without_some_of_its_files_is_passed_over_without_verify_on_load(tmp_path, caplog, capsys, cut):
    """A copy cut short (rsync stopped, `cp step-6/* dst/`, which leaves `.metadata` out, a copy
    taken while retention deleted the step) keeps its commit marker: `list` and `load()` took it
    for whole, and the load failed on the file without trying the step before."""
    folder = _saved(tmp_path, steps=6, last_save_model_only=False)
    data = os.path.join(layout.step_dir(folder, 6), "__0_0.distcp")
    if cut == "missing":
        os.remove(data)
    else:
        os.truncate(data, os.path.getsize(data) // 2)
    assert cli.main(["list", folder, "--json", "-q"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert (listed["latest_loadable"], listed["steps"][-1]["status"]) == (4, "cut_short")
    assert "step-6/__0_0.distcp: " in listed["steps"][-1]["problem"]
    assert cli.main(["inspect", layout.step_dir(folder, 6), "--json", "-q"]) == 0  # said complete
    assert json.loads(capsys.readouterr().out)["status"] == "cut_short"
    assert cli.main(["inspect", layout.step_dir(folder, 6), "-q"]) == 0
    assert "step-6: cut short: files its COMMITTED.json names are missing or shorter" in capsys.readouterr().out
    job = make_job(str(tmp_path), steps=6)
    assert job.manager.load()
    assert job.train_state.step == 4
    assert re.search(rf"step 6 is corrupt, trying the previous complete step: .*step-6/__0_0.distcp: "
                     rf"{'missing' if cut == 'missing' else '[0-9]+ bytes, the manifest says [0-9]+'}", caplog.text)
    job.manager.close()


def test_when_every_step_fails_verification_the_load_refuses_and_keeps_them(tmp_path, caplog):
    """`verify_fallback` passing over every step must not start the job from scratch: its
    first save's retention would then delete the damaged steps, which a repair may still save."""
    folder = _saved(tmp_path, steps=6, last_save_model_only=False)
    steps = [s.step for s in layout.scan(folder)]
    for step in steps:
        _flip_byte(os.path.join(layout.step_dir(folder, step), "__0_0.distcp"), 100)
    job = make_job(str(tmp_path), steps=6, verify_on_load=True)
    with pytest.raises(CorruptCheckpointError, match=f"^every complete step in {re.escape(folder)} failed "
                                                     "verification or holds another step than its folder's name"):
        job.manager.load()
    job.manager.close()
    assert [s.step for s in layout.scan(folder)] == steps and len(steps) >= 2
    assert all(f"step {step} is corrupt, trying the previous complete step" in caplog.text for step in steps)


def test_a_damaged_commit_marker_is_a_problem_verify_fallback_passes_over(tmp_path, caplog):
    folder = _saved(tmp_path, steps=6, last_save_model_only=False)
    marker = os.path.join(layout.step_dir(folder, 6), commit.MARKER)
    os.truncate(marker, os.path.getsize(marker) // 2)
    job = make_job(str(tmp_path), steps=6, verify_on_load=True)
    assert job.manager.load()
    assert job.train_state.step == 4
    assert f"step 6 is corrupt, trying the previous complete step: {marker} is not a valid commit marker" in caplog.text
    job.manager.close()
    strict = make_job(str(tmp_path), steps=6, verify_on_load=True, verify_fallback=False)
    with pytest.raises(CorruptCheckpointError, match=r"step 6 failed verification: .*step-6/COMMITTED.json is not a "
                                                     r"valid commit marker"):
        strict.manager.load()


def test_clean_removes_partial_folders(tmp_path, capsys):
    folder = _saved(tmp_path)
    shutil.copytree(layout.step_dir(folder, 2), layout.step_dir(folder, 9))
    commit.uncommit(layout.step_dir(folder, 9))
    assert cli.main(["clean", folder]) == 0
    assert "1 partial step folder removed" in capsys.readouterr().out
    assert [(s.step, s.committed) for s in layout.scan(folder)] == [(2, True), (4, True)]


def test_clean_keeps_a_partial_step_committed_after_it_was_listed(tmp_path, capsys, monkeypatch):
    """A job's save committed between clean's listing and its removal of that step (`--force`,
    or a file system whose lock does not reach the job's node): looked at again, and kept."""
    folder = _saved(tmp_path)
    step = layout.step_dir(folder, 9)
    shutil.copytree(layout.step_dir(folder, 2), step)
    with open(os.path.join(step, commit.MARKER), "rb") as f:
        marker = f.read()
    commit.uncommit(step)
    sized = layout.folder_bytes

    def committed_meanwhile(path: str) -> int:  # the sizes are taken after the listing
        if path == step:
            with open(os.path.join(step, commit.MARKER), "wb") as f:
                f.write(marker)
            os.remove(os.path.join(step, commit.IN_PROGRESS))
        return sized(path)

    monkeypatch.setattr(layout, "folder_bytes", committed_meanwhile)
    assert cli.main(["clean", folder]) == 0
    assert capsys.readouterr().out.splitlines() == [f"kept {step} (no longer partial: a job is writing there?)",
                                                    "0 partial step folders removed, 0 B"]
    assert os.listdir(step) and layout.status_of(step) == layout.COMPLETE


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 3 MB file system (tmpfs): saves into it run out of space."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_fails_the_save_cleanly_and_keeps_the_previous_step(tiny_disk):
    job = make_job(tiny_disk, steps=10, interval=1, keep_latest_k=0, last_save_model_only=False)
    job.step()
    job.manager.save(1)  # ~2.1 MB: fits
    job.step()
    with pytest.raises(CheckpointSaveError, match=r"saving step 2 to .*step-2 failed: .*file system holding it is full"):
        job.manager.save(2)
    folder = os.path.join(tiny_disk, "checkpoint")
    assert layout.committed_steps(folder) == [1]
    assert commit.verify(layout.step_dir(folder, 1)) == []
    job.manager.close()
    fresh = make_job(tiny_disk, steps=10)
    assert fresh.manager.load() and fresh.train_state.step == 1
    fresh.manager.close()


_SAVE_PAST_A_FILE_SIZE_LIMIT = """
import resource, sys, torch
from torchtitan_ckpt import CheckpointManager, CheckpointSaveError, layout
from torchtitan_ckpt.config import Checkpoint
folder, mode = sys.argv[1], sys.argv[2]
model = torch.nn.Module()
model.register_buffer("b", torch.ones(1 << 16))  # 256 KiB
config = Checkpoint(enable=True, interval=1, async_mode=mode, save_threads=1)
with CheckpointManager(config, [model], base_folder=folder) as manager:
    manager.save(1)
    manager.wait()
    model.b.fill_(2.0)
    model.register_buffer("big", torch.ones(1 << 20))  # 4 MiB, past the limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    try:
        manager.save(2)
        manager.wait()
    except CheckpointSaveError as e:
        print(e)
"""


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_a_file_past_the_process_file_size_limit_fails_the_save_naming_the_limit(tmp_path, mode):
    """A batch system's file-size limit (`ulimit -f`): the save failed with "File too large" and
    no word of the limit (with the pinned mode, torch's "unable to resize file" of the staging
    buffer); step 1 stays the one loaded."""
    run = subprocess.run([sys.executable, "-c", _SAVE_PAST_A_FILE_SIZE_LIMIT, str(tmp_path), mode],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "saving step 2 to" in run.stdout and ("a file reached this process's limit of file size, 1048576 bytes: "
                                                 "raise it, `ulimit -f`") in run.stdout, run.stdout
    folder = str(tmp_path / "checkpoint")
    assert layout.committed_steps(folder) == [1]
    model = torch.nn.Module()
    model.register_buffer("b", torch.zeros(1 << 16))
    with CheckpointManager(Checkpoint(enable=True), [model], base_folder=str(tmp_path)) as manager:
        assert manager.load() and bool((model.b == 1.0).all())


@pytest.mark.parametrize("consolidation", ["one_pass", "all_ranks"])
def test_a_full_disk_fails_a_hugging_face_export_as_a_save_error(tiny_disk, consolidation):
    """The two-phase export let DCP's own exception (a BaseException) out of save(), past a
    training loop's `except Exception`."""
    job = make_job(tiny_disk, steps=10, interval=1, keep_latest_k=0, last_save_in_hf=True,
                   consolidation=consolidation)
    job.step()
    job.manager.save(1)
    _fill(tiny_disk, leave=65536)  # less than the export
    with pytest.raises(CheckpointSaveError, match=r"saving step 2 to .*step-2 failed: .*No space left on device"):
        job.manager.save(2, last_step=True)
    job.manager.close()
    assert layout.committed_steps(os.path.join(tiny_disk, "checkpoint")) == [1]


def _fill(disk: str, leave: int = 0) -> None:
    """Take all but `leave` bytes of the file system `disk` with a file of its own."""
    free = os.statvfs(disk)
    with open(os.path.join(disk, "filler"), "ab") as f:
        f.write(b"\0" * (free.f_bavail * free.f_frsize - leave))


def _linear_job(disk: str, **config) -> CheckpointManager:
    """A manager of a 256 x 256 linear layer and its AdamW state (about 0.8 MB a step) in `disk`."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256, bias=False)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 256)).sum().backward()
    opt.step()
    config = Checkpoint(**{"enable": True, "interval": 1, "last_save_model_only": False, **config})
    return CheckpointManager(config, [model], opt, base_folder=disk)


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_a_failed_background_save_is_told_when_it_fails_and_where(tiny_disk, mode, caplog):
    """A background save that failed was heard of only at the next due save(), an interval
    later, whose own step went unsaved without a word; the failing frame was dropped on the way
    (`from None`, and the writer process's exception crossed its pipe without frames)."""
    manager = _linear_job(tiny_disk, keep_latest_k=0, async_mode=mode)
    manager.save(1)
    manager.wait()
    _fill(tiny_disk, leave=300_000)  # less than a step
    manager.save(2)
    deadline = time.monotonic() + 60
    ours = lambda: [r.getMessage() for r in caplog.records  # noqa: E731 (DCP's own logger says it too)
                    if r.levelname == "ERROR" and r.name.startswith("torchtitan_ckpt")]
    while not ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    told = ours()
    assert told and told[0].startswith("saving step 2 to ") and "No space left on device" in told[0], told
    assert told[0].endswith("(in the background; the next save(), wait(), load() or close() raises it)")
    with pytest.raises(CheckpointSaveError) as failed:
        manager.save(3)
    assert failed.value.step == 2 and failed.value.unsaved == 3
    assert str(failed.value).endswith("step 3 is not saved either: the save(3) raising this saved nothing")
    chain, error = [], failed.value
    while error is not None:
        chain.append(error)
        error = error.__cause__
    where = "".join(str(e) for e in chain) + "".join(
        "".join(traceback.format_tb(e.__traceback__)) for e in chain)
    # the frame that met the full disk (a data file's or DCP's metadata), in this process or the writer's
    assert re.search(r"torchtitan_ckpt/(io|dcp)/\w+\.py", where), where
    os.remove(os.path.join(tiny_disk, "filler"))
    manager.save(4)
    manager.close()
    assert layout.committed_steps(os.path.join(tiny_disk, "checkpoint")) == [1, 4]


def test_a_step_is_deleted_on_a_disk_with_no_byte_free(tiny_disk):
    """Deleting a step wrote its in-progress marker first: on a full disk that write failed, so
    retention (and a save replacing a step) could never give the space back."""
    manager = _linear_job(tiny_disk, keep_latest_k=0)
    manager.save(1)
    manager.save(2)
    manager.close()
    _fill(tiny_disk)
    assert os.statvfs(tiny_disk).f_bavail == 0
    folder = os.path.join(tiny_disk, "checkpoint")
    commit.remove_step(layout.step_dir(folder, 1))
    assert layout.committed_steps(folder) == [2] and os.statvfs(tiny_disk).f_bavail > 0


def test_a_restart_with_fewer_steps_kept_frees_a_full_disk(tiny_disk):
    """Old steps went only after a save succeeded, and the failed save's folder held its space:
    on a disk that held the steps kept but not one more, every save failed, and lowering
    keep_latest_k for the restart changed nothing. The load now deletes what retention would
    (and the failed save's folder) before the first save."""
    manager = _linear_job(tiny_disk, keep_latest_k=2)
    manager.save(1)
    manager.save(2)
    _fill(tiny_disk, leave=300_000)  # less than a step
    with pytest.raises(CheckpointSaveError, match=r"saving step 3 .*file system holding it is full: .* lower "
                                                  r"checkpoint.keep_latest_k"):
        manager.save(3)
    manager.close()
    folder = os.path.join(tiny_disk, "checkpoint")
    before = [(f.step, f.status) for f in layout.scan(folder)]
    assert before == [(1, "complete"), (2, "complete"), (3, "partial")]
    evaluation = _linear_job(tiny_disk, keep_latest_k=1, load_only=True)
    assert evaluation.load()
    evaluation.close()
    assert [(f.step, f.status) for f in layout.scan(folder)] == before  # a job that only loads deletes nothing
    manager = _linear_job(tiny_disk, keep_latest_k=1)
    assert manager.load()
    assert [(f.step, f.status) for f in layout.scan(folder)] == [(2, "complete")]
    assert manager.save(3)
    manager.close()
    assert layout.committed_steps(folder) == [3]
    loaded = _linear_job(tiny_disk, keep_latest_k=1, load_only=True)
    assert loaded.load()
    loaded.close()


def test_a_job_starts_on_a_full_disk(tiny_disk):
    """The lock file's holder (a pid, for the message of another job) did not fit: the job
    failed at start with a raw ENOSPC, and `clean`, the way to free the disk, with it."""
    _fill(tiny_disk)
    manager = _linear_job(tiny_disk)
    assert not manager.load()
    manager.close()
    assert os.path.getsize(os.path.join(tiny_disk, "checkpoint", LOCK_FILE)) == 0


@pytest.mark.parametrize("free", [0, 8192])
def test_a_conversion_into_a_full_disk_fails_as_such_and_leaves_nothing(tmp_path, tiny_disk, free, capsys):
    """It ended with exit 2 ("input that is not what the command needs") and a bare "[Errno 28]"
    naming no folder; with no byte free, the half-made `OUT.partial` stayed."""
    from torchtitan_ckpt.example.model import FLAVORS, Transformer, hf_config
    from torchtitan_ckpt.hf.files import RECORDED_CONFIG

    step = str(tmp_path / "step-1")  # a DCP step that records its HF config, as the example job's with HF keys
    dcp.save(Transformer(FLAVORS["debugmodel"]).state_dict(), checkpoint_id=step)
    with open(os.path.join(step, RECORDED_CONFIG), "w") as f:
        json.dump(hf_config(FLAVORS["debugmodel"]), f)
    _fill(tiny_disk, leave=free)
    out = os.path.join(tiny_disk, "hf")
    assert cli.main(["convert", "--to", "hf", step, out, "-q"]) == cli.EXIT_FAILED
    assert f"the file system holding {out} is full: " in capsys.readouterr().err
    assert sorted(os.listdir(tiny_disk)) == ["filler"]


def test_verify_passes_over_the_in_progress_marker_temporary_file(tmp_path, capsys):
    """A deletion stopped by a full disk (older versions) left `IN_PROGRESS.json.tmp` in a
    complete step: verify called the step CORRUPT, a file added after the commit."""
    folder = _saved(tmp_path)
    open(os.path.join(layout.step_dir(folder, 2), commit.IN_PROGRESS + ".tmp"), "w").close()
    assert cli.main(["verify", layout.step_dir(folder, 2)]) == 0, capsys.readouterr()


def test_a_partial_step_chosen_for_deletion_and_committed_since_is_left_alone(tmp_path):
    """Retention's choice is a listing's: a step listed partial (another writer's save in flight,
    where the file system takes no locks) was uncommitted and deleted once that save finished."""
    from torchtitan_ckpt.storage.local import LocalStore

    folder = _saved(tmp_path)
    listed = next(f for f in layout.scan(folder) if f.step == 4)
    store = LocalStore(folder)
    with pytest.raises(CheckpointError, match=r"step-4 was chosen as a partial step and is complete now: left alone"):
        store.remove(layout.StepFolder(listed.step, listed.path, layout.PARTIAL, listed.linked))
    assert layout.committed_steps(folder) == [2, 4]
    assert commit.verify(layout.step_dir(folder, 4)) == []


def test_clean_goes_on_past_a_partial_step_it_cannot_remove(tmp_path, capsys):
    """The first step that could not be removed ended the command (exit status 2): the partial
    steps after it stayed."""
    folder = _saved(tmp_path)
    for step in (7, 9):
        shutil.copytree(layout.step_dir(folder, 2), layout.step_dir(folder, step))
        commit.uncommit(layout.step_dir(folder, step))
    busy = os.path.join(layout.step_dir(folder, 7), "mounted")
    os.mkdir(busy)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", busy], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        assert cli.main(["clean", folder]) == 1
    finally:
        subprocess.run(["umount", "-l", busy], check=False)
    out, err = capsys.readouterr()
    assert f"error: {layout.step_dir(folder, 7)} could not be removed: [Errno 16] Device or resource busy" in err
    assert f"removed {layout.step_dir(folder, 9)} (partial)" in out
    assert [s.step for s in layout.scan(folder)] == [2, 4, 7]


def test_a_save_stopped_while_marking_its_folder_leaves_a_partial_step(tmp_path, caplog):
    """A folder holding only the in-progress marker's temporary file (a full disk while it was
    written) read as another program's: never removed by retention or clean. Its removal is
    logged as an unfinished save's, not an old checkpoint's."""
    folder = _saved(tmp_path)
    os.mkdir(layout.step_dir(folder, 3))
    open(os.path.join(layout.step_dir(folder, 3), commit.IN_PROGRESS + ".tmp"), "w").close()
    assert layout.status_of(layout.step_dir(folder, 3)) == layout.PARTIAL
    job = make_job(str(tmp_path), steps=10, interval=2)
    with caplog.at_level("INFO", logger="torchtitan_ckpt.deleter"):
        job.run_to(6, steps=10)
        job.manager.close()
    assert 3 not in [s.step for s in layout.scan(folder)]
    assert f"deleted the unfinished save of step 3 ({layout.step_dir(folder, 3)})" in caplog.messages


_OTHER_VERSIONS = {
    "newer": (lambda raw: {**raw, "version": commit.FORMAT_VERSION + 1}, NewerVersionError,
              r"a newer torchtitan_ckpt .* read it with that one"),
    "newer_with_a_new_field": (lambda raw: {**raw, "version": commit.FORMAT_VERSION + 1, "hash_algo": "sha256"},
                               NewerVersionError, r"a newer torchtitan_ckpt .* read it with that one"),
    "older": (lambda raw: {**raw, "version": 1, "files": {rel: e["size"] for rel, e in raw["files"].items()}},
              OlderVersionError, r"an older torchtitan_ckpt .* resume from it with the version that wrote it"),
}


@pytest.mark.parametrize("version", list(_OTHER_VERSIONS))
def test_a_step_of_another_version_is_refused_never_passed_over_and_replaced(tmp_path, capsys, version):
    """A step another torchtitan_ckpt committed is not damaged: `verify_fallback` passed over a
    newer one (a downgrade) as corrupt, the job resumed at the step before, and its next save
    replaced it; with a field this version lacks, it read as damaged; an older one (version 1
    markers listed each file's size alone) read as damaged, and `list` called it corrupt."""
    rewrite, error, told = _OTHER_VERSIONS[version]
    folder = _saved(tmp_path, steps=6, last_save_model_only=False)
    marker = os.path.join(layout.step_dir(folder, 6), commit.MARKER)
    with open(marker) as f:
        written = rewrite(json.load(f))
    with open(marker, "w") as f:
        json.dump(written, f)
    for verify in (False, True):
        job = make_job(str(tmp_path), steps=10, interval=2, verify_on_load=verify)
        with pytest.raises(error, match=rf"{marker} is of version {written['version']}, written by {told}"):
            job.manager.load()
        job.manager.close()
    assert cli.main(["list", "--json", folder]) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    assert [(s["step"], s["status"]) for s in steps] == [(2, "complete"), (4, "complete"),
                                                         (6, version.split("_")[0])]


def test_a_step_an_older_version_left_while_committing_is_partial(tmp_path):
    """Versions before the in-progress marker left a step killed while writing its commit marker
    holding DCP's `.metadata`, the data files and the marker's temporary file: it read as
    another program's finished step, and a load took it over the last complete one."""
    folder = _saved(tmp_path, steps=6, last_save_model_only=False)
    step6 = layout.step_dir(folder, 6)
    os.rename(os.path.join(step6, commit.MARKER), os.path.join(step6, commit.MARKER + ".tmp"))
    os.remove(os.path.join(step6, commit.IN_PROGRESS))  # those versions wrote none
    assert layout.status_of(step6) == layout.PARTIAL
    linked = layout.step_dir(folder, 5)  # a link by that name is none of ours: another program's step
    shutil.copytree(step6, linked)
    os.remove(os.path.join(linked, commit.MARKER + ".tmp"))
    os.symlink(os.path.join(step6, commit.MARKER + ".tmp"), os.path.join(linked, commit.MARKER + ".tmp"))
    assert layout.status_of(linked) == layout.FOREIGN
    shutil.rmtree(linked)
    job = make_job(str(tmp_path), steps=10, interval=2)
    assert job.manager.load()
    assert job.train_state.step == 4
    job.manager.close()


def _rank_1_never_saves(rank: int, world_size: int, folder: str) -> None:
    import time

    from .helpers import stay_until, then_release

    config = Checkpoint(enable=True, interval=1, collective_timeout_s=10)
    manager = CheckpointManager(config, [torch.nn.Linear(2, 2)], base_folder=folder)
    done = os.path.join(folder, "done")
    if rank == 1:
        stay_until(done)  # alive but gone astray: it never joins the save
        return
    import logging

    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("torchtitan_ckpt.group").addHandler(handler)
    start = time.monotonic()
    with then_release(done), pytest.raises(CheckpointSaveError, match=r"saving step 1 .* rank\(s\) 1 had not "
                                                                      r"entered it after \d+ s \(this rank waits "
                                                                      r"checkpoint.collective_timeout_s = 10 s\)"):
        manager.save(1)
    # while it waited, the lowest rank waiting named the rank that never came
    assert warned == ["a checkpoint collective has waited 2.5 s (of checkpoint.collective_timeout_s = 10 s) for "
                      "rank(s) 1, which have not entered it: stuck, or in another call of the manager (see their "
                      "logs)"], warned
    assert time.monotonic() - start < 60  # the timeout, not a hang
    assert layout.committed_steps(os.path.join(folder, "checkpoint")) == []


@pytest.mark.multirank
def test_a_missing_rank_times_out_instead_of_hanging(tmp_path):
    from .helpers import spawn

    spawn(2, _rank_1_never_saves, str(tmp_path))


_SECOND_JOB = """
import sys
from torch import nn
from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.storage.local import LOCK_FILE
from torchtitan_ckpt.errors import ConfigError
for load_only in (True, False):
    try:
        manager = CheckpointManager(Checkpoint(enable=True, folder=sys.argv[1], load_only=load_only), [nn.Linear(2, 2)])
        print("loaded", manager.load())
        manager.close()
    except ConfigError as e:
        print(e)
        sys.exit(3)
"""


def test_a_second_job_saving_into_a_folder_in_use_is_refused_at_start(tmp_path):
    """The same run started again while the first still ran replaced the first's step in
    flight; the first then committed a marker over the second's files, and both said saved."""
    folder = str(tmp_path / "checkpoint")
    first = CheckpointManager(Checkpoint(enable=True, folder=folder, interval=1), [torch.nn.Linear(2, 2)])
    first.save(1)
    second = [sys.executable, "-c", _SECOND_JOB, folder]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    refused = subprocess.run(second, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 3, refused.stderr
    assert refused.stdout.splitlines() == [  # a job that only loads is let in
        "loaded True",
        f"checkpoint.folder = {folder!r}: another process (pid {os.getpid()} on {os.uname().nodename}) uses {folder} "
        "to save into: one job saves into a folder at a time; stop that job first, or give this one a folder of "
        "its own (where its host is down, NFSv3 keeps its lock until that host is up again: once sure no job saves "
        "there, remove the lock file). Where that process is a rank of this job, its ranks made their managers "
        "without joining one process group: call torch.distributed.init_process_group() before making the "
        "CheckpointManager"]
    assert layout.committed_steps(folder) == [1]
    clean = subprocess.run([sys.executable, "-m", "torchtitan_ckpt.cli", "clean", folder], capture_output=True,
                           text=True, timeout=120, env=env)
    assert clean.returncode == 2 and (f"uses {folder} to save into: clean removes partial steps, and that job's save "
                                      "in flight is one: run it once the job has ended") in clean.stderr, clean.stderr
    first.save(2)
    first.close()
    ran = subprocess.run(second, capture_output=True, text=True, timeout=120, env=env)
    assert ran.returncode == 0 and ran.stdout.splitlines() == ["loaded True", "loaded True"], ran.stderr


def test_a_folder_another_user_saved_into_is_held_by_the_next_users_job(tmp_path):
    """A team folder: the lock file the first user's job made (0600 then) refused every other
    user's job and `clean`, with a bare PermissionError. Another uid is stood for by root
    without its power to override file modes."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is not installed")
    folder = str(tmp_path / "checkpoint")
    os.mkdir(folder, 0o777)
    os.chmod(folder, 0o2775)  # a team's folder
    with CheckpointManager(Checkpoint(enable=True, folder=folder, interval=1), [torch.nn.Linear(2, 2)]) as manager:
        manager.save(1)
    held = os.path.join(folder, LOCK_FILE)
    assert os.stat(held).st_mode & 0o777 == 0o664  # writable by the team, as the folder is
    os.chown(held, 1000, 1000)  # and one the next user cannot write is held read-only
    os.chmod(held, 0o644)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    other_user = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps", "-all"]
    ran = subprocess.run([*other_user, sys.executable, "-c", _SECOND_JOB, folder], capture_output=True, text=True,
                         timeout=120, env=env)
    if "setpriv:" in ran.stderr:
        pytest.skip(f"setpriv cannot drop capabilities here: {ran.stderr.strip()}")
    assert ran.returncode == 0 and ran.stdout.splitlines() == ["loaded True", "loaded True"], ran.stderr
    clean = subprocess.run([*other_user, sys.executable, "-m", "torchtitan_ckpt.cli", "clean", folder],
                           capture_output=True, text=True, timeout=120, env=env)
    assert clean.returncode == 0, clean.stderr



def test_two_managers_of_one_process_never_save_into_one_folder_in_turn(tmp_path):
    """An RLHF job's actor and critic (or an EMA copy) given one `[checkpoint]` section: each
    one's saves replaced the other's steps, and a resumed actor's load() took the critic's
    weights (same shapes), with a warning alone. Now once one has saved there, the other's
    save() is refused (however the folder is named) until the first is closed; loads, a
    `load_only` manager's, and a trainer that makes its manager again without closing the first
    go on."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (tmp_path / "link").symlink_to(folder)
    models = {}

    def manager(name: str, where=folder, **settings) -> CheckpointManager:
        models[name] = torch.nn.Linear(2, 2)
        torch.nn.init.constant_(models[name].weight, {"actor": 1.0, "critic": 2.0}.get(name, 3.0))
        return CheckpointManager(Checkpoint(enable=True, folder=str(where), interval=1, **settings), [models[name]])

    actor, critic = manager("actor"), manager("critic", tmp_path / "link")
    assert not actor.load() and not critic.load()
    actor.save(1)
    with pytest.raises(CheckpointError, match=r"save\(1\) refused: another CheckpointManager of this process, not "
                                              r"closed, has saved into .*link since this one was made"):
        critic.save(1)
    assert read_checkpoint(str(folder / "step-1"))["weight"].eq(1.0).all()
    assert critic.load() and models["critic"].weight.eq(1.0).all()  # an evaluation's load of the actor's step
    actor.close()
    critic.save(2)  # the folder is the critic's now
    again = manager("rebuilt")  # the critic's trainer made again, the first not closed
    assert again.load() and models["rebuilt"].weight.eq(1.0).all()
    again.save(3)
    with pytest.raises(CheckpointError, match=r"save\(4\) refused"):
        critic.save(4)
    reference = manager("reference", load_only=True)  # a frozen reference model's: it only reads
    assert reference.load() and models["reference"].weight.eq(1.0).all()
    reference.save(4)  # does nothing (load_only), and holds nothing back
    again.save(4)
    assert layout.committed_steps(str(folder)) == [1, 2, 3, 4]
    for m in (reference, critic, again):
        m.close()


def test_a_manager_made_again_without_closing_the_first_waits_for_its_save_in_flight(tmp_path):
    """A trainer that makes its manager again (a notebook's cell run again) while the first one's
    background save is in flight: the new one's load() passed over that step as unfinished and
    started from scratch, and its save of the same step would meet the first one's."""
    def manager(seen: list[int]) -> tuple[Holder, CheckpointManager]:
        data = Holder({"seen": seen})
        return data, CheckpointManager(Checkpoint(enable=True, interval=1, async_mode="async"), [torch.nn.Linear(2, 2)],
                                       states={"data": data}, base_folder=str(tmp_path))

    seen = list(range(500_000))  # a value written (and read back, `_loadable`) for a while: still in flight below
    _, first = manager(seen)
    first.save(1)
    pid = os.fork()
    if pid == 0:  # a forked child's manager waits for none of its parent's saves (whose threads it has not)
        code = 1
        try:
            manager([])
        except ConfigError as e:
            code = 0 if "another process" in str(e) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if not done[0]:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done[0] and done[1] == 0, "the forked child did not refuse the folder in time"
    data, again = manager([])
    assert again.load() and data.value == {"seen": seen}
    again.save(2)
    again.close()
    first.close()
    assert layout.committed_steps(str(tmp_path / "checkpoint")) == [1, 2]


def test_the_hold_is_one_however_the_folder_is_named_and_lets_go_of_what_it_cannot_use(tmp_path):
    """Two managers of one process over one folder, one through a link to it: the second was
    refused as "another process" with this process's pid; then, taken in, either's load deleted
    the other's step in flight as partial: neither is the folder's sole writer while both hold
    it (and the second is warned of). A fifo where the lock file goes kept its descriptor (and
    flock) open after a bare EINVAL; a hard link there to a user's file would have been
    truncated (it is replaced by a file of the job's own, the user's untouched: a `cp -al` backup
    of the folder stopped every restart of the job). A forked child closing a manager died of a
    KeyError (its copy of the hold is forgotten at the fork)."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (tmp_path / "link").symlink_to(folder)
    first = CheckpointManager(Checkpoint(enable=True, folder=str(folder)), [torch.nn.Linear(2, 2)])
    second = CheckpointManager(Checkpoint(enable=True, folder=str(tmp_path / "link")), [torch.nn.Linear(2, 2)])
    assert not first._store.sole_writer and not second._store.sole_writer  # neither deletes the other's save
    pid = os.fork()
    if pid == 0:  # the child closes its copies, and the parent's hold stays
        code = 1
        try:
            first.close()
            code = 0
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    second.close()
    assert first._store.sole_writer
    first.close()
    os.remove(folder / LOCK_FILE)
    os.mkfifo(folder / LOCK_FILE)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ConfigError, match=rf"{LOCK_FILE} is not a regular file \(a fifo\?\), so .* cannot be held "
                                          "by this job: remove it"):
        CheckpointManager(Checkpoint(enable=True, folder=str(folder)), [torch.nn.Linear(2, 2)])
    assert len(os.listdir("/proc/self/fd")) == fds
    os.remove(folder / LOCK_FILE)
    (tmp_path / "notes.txt").write_text("the user's")
    os.link(tmp_path / "notes.txt", folder / LOCK_FILE)  # holding would truncate the user's file
    # a snapshot's link to the lock of a job running there: that job is named, and the link
    running = os.open(folder / LOCK_FILE, os.O_RDWR)
    fcntl.flock(running, fcntl.LOCK_EX)
    try:
        with pytest.raises(ConfigError, match=r"another process \(the user's\) uses .* \(its lock file .* is a hard "
                                              r"link, shared with another folder's: a `cp -al`"):
            CheckpointManager(Checkpoint(enable=True, folder=str(folder)), [torch.nn.Linear(2, 2)])
    finally:
        os.close(running)
    with CheckpointManager(Checkpoint(enable=True, folder=str(folder), interval=1), [torch.nn.Linear(2, 2)]) as manager:
        assert manager.save(1)  # none holds the link now: replaced by a lock file of the job's
        assert os.stat(folder / LOCK_FILE).st_nlink == 1
        probe = os.open(folder / LOCK_FILE, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):  # the new file is the one held
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(probe)
        other = os.open(tmp_path / "notes.txt", os.O_RDONLY)
        try:  # the other name's file is free: a job in the folder it belongs to starts
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
    assert (tmp_path / "notes.txt").read_text() == "the user's"
    assert sorted(os.listdir(folder)) == [LOCK_FILE, "step-1"]
    os.remove(folder / LOCK_FILE)
    os.symlink(tmp_path / "notes.txt", folder / LOCK_FILE)  # a `cp -rs` copy's: "[Errno 40] Too many levels..."
    with pytest.raises(ConfigError, match=rf"{LOCK_FILE} is a symbolic link \(a `cp -rs` copy of the folder\?\), so "
                                          r".* cannot be held by this job: remove it \(the job makes its own\)"):
        CheckpointManager(Checkpoint(enable=True, folder=str(folder)), [torch.nn.Linear(2, 2)])
    assert (tmp_path / "notes.txt").read_text() == "the user's"


def test_a_run_folder_moved_while_its_job_saves_is_not_made_again_at_the_old_name(tmp_path):
    """`mv run run2` beside the running job: its next save made the folder again at the old
    name, unheld, and saved on there without a word; a resume from run2 went back to its old
    steps. A folder removed (not moved) is made again and held, as before."""
    model = torch.nn.Linear(2, 2)
    manager = CheckpointManager(Checkpoint(enable=True, interval=1), [model], base_folder=str(tmp_path / "run"))
    manager.save(1)
    os.rename(tmp_path / "run", tmp_path / "run2")
    with pytest.raises(CheckpointSaveError, match=r"saving step 2 to .*run/checkpoint/step-2 failed: CheckpointError: "
                                                  r".*run/checkpoint was moved since this job began saving there "
                                                  rf"\(the {LOCK_FILE} it holds is no longer in it\); this step is not "
                                                  r"saved: move the folder back"):
        manager.save(2)
    assert not os.path.exists(tmp_path / "run")
    manager.close()
    assert layout.committed_steps(str(tmp_path / "run2" / "checkpoint")) == [1]
    # removed, not moved (its steps deleted to free the disk): the job saves on into it anew, held
    manager = CheckpointManager(Checkpoint(enable=True, interval=1), [model], base_folder=str(tmp_path / "run2"))
    beside = CheckpointManager(Checkpoint(enable=True), [model], base_folder=str(tmp_path / "run2"))  # shares the hold
    manager.save(2)
    shutil.rmtree(tmp_path / "run2" / "checkpoint")
    manager.save(3)
    beside.close()
    assert layout.committed_steps(str(tmp_path / "run2" / "checkpoint")) == [3]
    second = subprocess.run([sys.executable, "-c", _SECOND_JOB, str(tmp_path / "run2" / "checkpoint")],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert second.returncode == 3 and "another process" in second.stdout, second.stdout + second.stderr  # held again
    shutil.rmtree(tmp_path / "run2" / "checkpoint")  # removed, and another job takes the folder meanwhile
    os.makedirs(tmp_path / "run2" / "checkpoint")
    other = os.open(tmp_path / "run2" / "checkpoint" / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(other, fcntl.LOCK_EX)
    try:
        for step in (4, 5):  # refused at each save, never saved unheld beside that job
            with pytest.raises(CheckpointSaveError, match="another process"):
                manager.save(step)
    finally:
        os.close(other)
    assert layout.committed_steps(str(tmp_path / "run2" / "checkpoint")) == []
    manager.close()


def _in_a_daemon(folder: str, env: dict) -> None:
    try:  # a daemon process may start none: the writer process of async_with_pinned_mem fails the start
        CheckpointManager(Checkpoint(enable=True, folder=folder, async_mode="async_with_pinned_mem"),
                          [torch.nn.Linear(2, 2)])
    except ConfigError as e:
        assert "it is daemonic (a multiprocessing.Pool's worker, a Process(daemon=True)); use async" in str(e)
    else:
        raise AssertionError("the manager started")
    ran = subprocess.run([sys.executable, "-c", _SECOND_JOB, folder], capture_output=True, text=True, timeout=120,
                         env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr  # the failed start let go of the folder


def test_a_manager_that_fails_to_start_after_holding_its_folder_lets_go_of_it(tmp_path):
    import multiprocessing

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    daemon = multiprocessing.get_context("spawn").Process(target=_in_a_daemon, args=(str(tmp_path / "ck"), env),
                                                          daemon=True)
    daemon.start()
    daemon.join(180)
    assert daemon.exitcode == 0


# ------------------------------------------------------------------ what mutation testing found unchecked


def test_verify_checks_the_files_it_is_given_and_names_a_size_that_differs(tmp_path):
    """Each rank of `verify_on_load` checks its share of the files: a damaged file outside it is
    another rank's to find. A file of another size is named as such (before its bytes are read)."""
    step = layout.step_dir(_saved(tmp_path), 4)
    _flip_byte(os.path.join(step, ".metadata"), 0)
    assert commit.verify(step, files=["__0_0.distcp"]) == []
    assert len(commit.verify(step)) == 1
    data = os.path.join(step, "__0_0.distcp")
    size = os.path.getsize(data)
    os.truncate(data, size - 1)
    assert f"{data}: {size - 1} bytes, the manifest says {size}" in commit.verify(step, files=["__0_0.distcp"])
    with pytest.raises(ValueError, match="threads = 0"):
        commit.verify(step, threads=0)


@pytest.mark.parametrize("threads", [1, 3])
def test_verify_on_load_checks_files_on_the_load_threads(tmp_path, monkeypatch, threads):
    """It checked on 4 threads whatever `load_threads` said."""
    _saved(tmp_path)
    seen, real = [], commit.check_files
    monkeypatch.setattr(commit, "check_files", lambda *a: seen.append(a[3]) or real(*a))
    job = make_job(str(tmp_path), steps=4, verify_on_load=True, load_threads=threads)
    assert job.manager.load()
    job.manager.close()
    assert seen == [threads]


def test_a_commit_markers_temporary_file_left_in_a_step_is_not_one_of_its_files(tmp_path):
    step = layout.step_dir(_saved(tmp_path), 4)
    open(os.path.join(step, commit.MARKER + ".tmp"), "w").write("{}")
    assert commit.verify(step) == []
    assert cli.main(["verify", step]) == 0


def test_a_step_linked_in_from_another_run_is_loaded_and_never_changed(tmp_path):
    """A step folder that is a link to another run's step loads as that step; retention, and a
    deletion reaching it through a race, leave the other run's step as it was."""
    other = _saved(tmp_path / "other", steps=8)  # steps 2, 4, 6 full, 8 the model alone
    job = make_job(str(tmp_path / "mine"), steps=8, interval=2, keep_latest_k=1)
    job.run_to(2, steps=8)
    folder = os.path.join(tmp_path, "mine", "checkpoint")
    os.symlink(layout.step_dir(other, 6), layout.step_dir(folder, 6))
    job.manager.close()
    resumed = make_job(str(tmp_path / "mine"), steps=8, interval=2, keep_latest_k=1, init_seed=1)
    assert resumed.manager.load() and resumed.train_state.step == 6
    saved = read_checkpoint(layout.step_dir(other, 6))
    assert_same(resumed.model.state_dict(), {k: saved[k] for k in resumed.model.state_dict()})
    resumed.run_to(8, steps=8)
    resumed.manager.close()
    with pytest.raises(OSError, match="is a symlink"):
        commit.remove_step(layout.step_dir(folder, 6))
    assert commit.is_committed(layout.step_dir(other, 6)) and commit.verify(layout.step_dir(other, 6)) == []


@pytest.mark.parametrize("entry", ["beside_data", "a_folder"])
def test_a_folder_with_the_marking_file_and_more_is_not_ours(tmp_path, entry):
    """Only a folder holding the in-progress marker's temporary file and nothing else is a save
    of ours stopped while marking it; another program's folder holding such a name and its data,
    or a folder by that name, read as ours and was removed by `clean`."""
    marking = commit.IN_PROGRESS + ".tmp"
    steps = [tmp_path / f"step-{i}" for i in range(1, 9)]
    for step in steps:
        step.mkdir()
    if entry == "beside_data":  # listed first in some of them, whatever order the file system lists in
        for i, step in enumerate(steps):
            for name in (marking, f"data-{i}.bin")[:: 1 if i % 2 else -1]:
                (step / name).write_bytes(b"data")
    else:
        for step in steps:
            (step / marking).mkdir()
            (step / marking / "data").write_bytes(b"data")
    assert [layout.status_of(str(step)) for step in steps] == [layout.UNKNOWN] * len(steps)
    assert cli.main(["clean", str(tmp_path)]) == 0
    assert all(len(list(step.rglob("*"))) == 2 for step in steps)


def test_a_marker_that_is_a_link_loop_is_passed_over(tmp_path):
    """A commit marker that cannot be looked at for another reason than permissions (a link loop)
    is unknown, passed over for the step before, not a folder this user may not read."""
    folder = _saved(tmp_path)
    marker = os.path.join(layout.step_dir(folder, 4), commit.MARKER)
    os.remove(marker)
    os.symlink(marker, marker)
    assert layout.status_of(layout.step_dir(folder, 4)) == layout.UNKNOWN
    job = make_job(str(tmp_path), steps=4, interval=2, init_seed=1, load_only=True)  # step 4 is in a save's way
    assert job.manager.load() and job.train_state.step == 2
    job.manager.close()


def test_every_file_a_writer_reports_on_the_disk_was_fsynced_whole(tmp_path, monkeypatch):
    """The commit fsyncs no file its writers report on the disk: DCP fsyncs `.metadata`, which
    it writes through the checksumming stream, and fsynced it with its bytes still in the
    stream's buffer (0 bytes on the disk; a power loss then left a committed step with no index)."""
    synced: dict[str, int] = {}
    fsync = os.fsync

    def seen(fd: int) -> None:
        synced[os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).removesuffix(".tmp")] = os.fstat(fd).st_size
        fsync(fd)

    monkeypatch.setattr(os, "fsync", seen)
    config = Checkpoint(enable=True, folder=str(tmp_path), interval=2, last_save_model_only=False)
    with CheckpointManager(config, [torch.nn.Linear(2, 2)]) as manager:
        manager.save(2)  # a small `.metadata`, which its writes leave in the buffer
    step = layout.step_dir(str(tmp_path), 2)
    info = commit.read_marker(step)
    assert {rel: synced.get(rel) for rel in info.files} == {rel: e["size"] for rel, e in info.files.items()}


def test_retention_leaves_a_step_holding_a_users_files_as_it_is(tmp_path, caplog):
    """Evaluation results and a repository kept in a step folder were deleted with the step by
    retention, the log saying only that the step was deleted."""
    job = make_job(str(tmp_path), steps=6, interval=2, keep_latest_k=1)
    job.run_to(2, steps=6)
    step_2 = os.path.join(tmp_path, "checkpoint", "step-2")
    os.makedirs(os.path.join(step_2, ".git"))
    for name in ("eval_results.json", os.path.join(".git", "HEAD")):
        with open(os.path.join(step_2, name), "w") as f:
            f.write("mine")
    job.run_to(6, steps=6)
    job.manager.close()
    assert layout.committed_steps(os.path.join(tmp_path, "checkpoint"))[0] == 2
    with open(os.path.join(step_2, "eval_results.json")) as f:
        assert f.read() == "mine"
    assert commit.verify(step_2) == []
    assert re.search(r"could not delete .*step-2: .*step-2 holds 3 file\(s\) or folder\(s\) its COMMITTED.json does "
                     r"not list, not written by torchtitan_ckpt \(.git, .git/HEAD, eval_results.json\): the step is "
                     r"left as it is", caplog.text)
    os.remove(os.path.join(step_2, "eval_results.json"))
    shutil.rmtree(os.path.join(step_2, ".git"))
    os.makedirs(os.path.join(step_2, "empty"))  # a folder alone, and a link to one, are a user's as much
    os.symlink(tmp_path, os.path.join(step_2, "results"))
    with pytest.raises(CheckpointError, match=r"step-2 holds 2 file\(s\) or folder\(s\) .*\(empty, results\)"):
        commit.remove_step(step_2)
    assert os.path.isdir(os.path.join(step_2, "empty")) and commit.verify(step_2) == []


def test_a_step_ahead_holding_a_users_files_is_refused_before_training(tmp_path):
    """A job resumed at step 2 with step 4 ahead holding a user's file trained on, and its save
    of step 4 failed then: a save never removes what it did not write."""
    job = make_job(str(tmp_path), steps=6, interval=2, keep_latest_k=0)
    job.run_to(4, steps=6)
    job.manager.close()
    with open(os.path.join(tmp_path, "checkpoint", "step-4", "eval_results.json"), "w") as f:
        f.write("mine")
    again = make_job(str(tmp_path), steps=6, interval=2, keep_latest_k=0, load_step=2)
    with pytest.raises(CheckpointError, match=r"step\(s\) 4 hold files their COMMITTED.json does not list "
                                              r"\(eval_results.json: a user's\?\) and this job, starting from step 2, "
                                              r"saves step 4 .* a save never replaces files it did not write"):
        again.manager.load()
    again.manager.close()


def _ranks_seeing_a_step_ahead_otherwise(rank: int, world_size: int, folder: str) -> None:
    from torchtitan_ckpt import commit as committed

    config = Checkpoint(enable=True, interval=2, keep_latest_k=0, collective_timeout_s=5)
    with CheckpointManager(config, [torch.nn.Linear(2, 2)], base_folder=folder) as manager:
        manager.save(2)
        manager.save(4)
    if rank == 0:
        with open(os.path.join(folder, "checkpoint", "step-4", "eval_results.json"), "w") as f:
            f.write("mine")
    torch.distributed.barrier()
    if rank == 1:  # this rank looked at step 4 before the user's file came
        committed.unlisted = lambda path: []
    with CheckpointManager(replace(config, load_step=2), [torch.nn.Linear(2, 2)], base_folder=folder) as again:
        with pytest.raises(CheckpointError, match=r"step\(s\) 4 hold files their COMMITTED.json does not list"):
            again.load()


def test_every_rank_refuses_a_step_ahead_alike(tmp_path):
    """Each rank checked the steps ahead on its own: one that saw a user's file arrive later
    than another entered the load's collectives while the other refused, and waited there until
    the collective timeout, failing with a CollectiveError that named no step."""
    spawn(2, _ranks_seeing_a_step_ahead_otherwise, str(tmp_path))
