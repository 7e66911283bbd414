"""Pure policies: the save schedule, retention, step-folder naming and the commit marker."""

from __future__ import annotations

import logging
import os
import zlib

import pytest

from torchtitan_ckpt import commit, layout
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.errors import CheckpointError, NewerVersionError
from torchtitan_ckpt.layout import StepFolder
from torchtitan_ckpt.policy.retention import newer_steps, steps_to_delete
from torchtitan_ckpt.policy.schedule import SaveKind, save_kind

from .helpers import syscalls


def _kinds(config: Checkpoint, steps: int) -> dict[int, SaveKind]:
    out = {}
    for step in range(0, steps + 1):
        kind = save_kind(step, step == steps, config)
        if kind is not None:
            out[step] = kind
    return out


def test_schedule():
    F, M = SaveKind.FULL, SaveKind.MODEL_ONLY
    assert _kinds(Checkpoint(enable=True, interval=3), 7) == {3: F, 6: F, 7: M}
    assert _kinds(Checkpoint(enable=True, interval=3, last_save_model_only=False), 6) == {3: F, 6: F}
    assert _kinds(Checkpoint(enable=True, interval=5, enable_first_step_checkpoint=True), 5) == {1: F, 5: M}
    assert _kinds(Checkpoint(enable=True, create_seed_checkpoint=True), 2) == {0: SaveKind.SEED, 2: M}
    assert _kinds(Checkpoint(enable=True, load_only=True, interval=1), 4) == {}
    assert _kinds(Checkpoint(enable=False, interval=1), 4) == {}
    # a preemption's save: in full off the interval; the run's last save stays what its config says
    assert save_kind(7, False, Checkpoint(enable=True, interval=5), force=True) is F
    assert save_kind(7, True, Checkpoint(enable=True, interval=5), force=True) is M
    assert save_kind(7, False, Checkpoint(enable=True, load_only=True), force=True) is None


def _folders(committed: list[int], partial: list[int] = (), foreign: list[int] = (),
             unknown: list[int] = ()) -> list[StepFolder]:
    kinds = ((committed, layout.COMPLETE), (partial, layout.PARTIAL), (foreign, layout.FOREIGN),
             (unknown, layout.UNKNOWN))
    return [StepFolder(s, f"step-{s}", status) for steps, status in kinds for s in steps]


def test_retention_counts_complete_steps_only():
    doomed = steps_to_delete(_folders([1, 2, 3, 4, 5], partial=[6]), keep_latest_k=2, committed_now=5)
    assert [f.step for f in doomed] == [1, 2, 3]  # the partial 6 is newer: maybe still being written
    doomed = steps_to_delete(_folders([4, 8], partial=[2, 6]), keep_latest_k=1, committed_now=8)
    assert [f.step for f in doomed] == [2, 4, 6]
    assert steps_to_delete(_folders([1, 2, 3]), keep_latest_k=0, committed_now=3) == []


def test_retention_never_chooses_a_folder_it_did_not_write():
    doomed = steps_to_delete(_folders([5, 9], partial=[3], foreign=[1, 2, 7, 10], unknown=[4, 8]), keep_latest_k=1,
                             committed_now=9)
    assert [f.step for f in doomed] == [3, 5]
    assert steps_to_delete(_folders([], foreign=[1, 2]), keep_latest_k=1, committed_now=3) == []
    assert steps_to_delete(_folders([7]), keep_latest_k=1, committed_now=7) == []


def test_a_marker_of_a_newer_version_is_refused_as_such(tmp_path):
    """Version 99 was read as if it were this one's."""
    commit.write_marker(str(tmp_path), commit.CommitInfo(step=1, states=["model"], version=99))
    with pytest.raises(NewerVersionError, match=r"COMMITTED.json is of version 99, written by a newer "
                                                     r"torchtitan_ckpt than this one \(version 2 and older\)"):
        commit.read_marker(str(tmp_path))


def test_retention_neither_counts_nor_chooses_a_linked_step():
    """Another run's step 7 linked in: counted, it had the job's own step 5 deleted in its
    favour with `keep_latest_k = 2`, and the other run may delete its step 7 at any time."""
    folders = [StepFolder(5, "step-5", layout.COMPLETE), StepFolder(7, "step-7", layout.COMPLETE, linked=True),
               StepFolder(9, "step-9", layout.PARTIAL, linked=True), StepFolder(10, "step-10", layout.COMPLETE)]
    assert steps_to_delete(folders, keep_latest_k=2, committed_now=10) == []
    assert [f.step for f in steps_to_delete(folders, keep_latest_k=1, committed_now=10)] == [5]


def test_retention_after_going_back_keeps_the_step_just_saved_and_leaves_the_newer_ones():
    """The job loaded step 200 of a run that had reached 300 and saves 210: with
    `keep_latest_k = 1`, counting 300 deleted 210 as soon as it committed (and 200 with it), so
    a crash left only the steps of the abandoned run. Now 200 goes, 210 stays, and 300 (with its
    partial 250) is left alone and named."""
    folders = _folders([100, 200, 210, 300], partial=[150, 250])
    assert [f.step for f in steps_to_delete(folders, keep_latest_k=1, committed_now=210)] == [100, 150, 200]
    assert [f.step for f in newer_steps(folders, 210)] == [300]
    assert [f.step for f in steps_to_delete(folders, keep_latest_k=2, committed_now=210)] == [100, 150]


def test_retention_passing_the_steps_of_the_run_left_behind_removes_them_not_its_own():
    """`load_step = 4` in a folder of a run that had reached 8; this job saves 6, then 9. Step 8,
    counted as one of the newest two, kept 8 and 9 and removed this job's 6: a damaged 9 then
    fell back to the run left behind. It is neither counted nor kept once passed."""
    folders = _folders([4, 6, 8, 9])
    assert [f.step for f in steps_to_delete(folders, keep_latest_k=2, committed_now=6, left={8})] == []
    assert [f.step for f in steps_to_delete(folders, keep_latest_k=2, committed_now=9, left={8})] == [4, 8]
    assert steps_to_delete(folders, keep_latest_k=0, committed_now=9, left={8}) == []  # retention off: all kept


def test_the_step_just_committed_is_never_chosen_even_among_those_left_behind():
    """A step the job saved again after going back (6, among the steps it left, {6, 8}) is the
    step just committed: never deleted."""
    folders = _folders([4, 6, 8])
    assert 6 not in [f.step for f in steps_to_delete(folders, keep_latest_k=2, committed_now=6, left={6, 8})]


def test_step_names():
    assert layout.parse_step("step-12") == 12
    assert layout.parse_step("step-0") == 0
    # one spelling per step: `step-007` or `step-\u0667` (an Arabic-Indic 7) is not step 7's folder
    for name in ("step-", "step-x", "step-1.tmp", "foo", "step--1", "step-007", "step-\u0667", "step-7\n"):
        assert layout.parse_step(name) is None
    assert layout.step_dir("ck", 3) == os.path.join("ck", "step-3")


def test_scan_sees_marker_and_ignores_other_entries(tmp_path):
    """A file or a dangling link by a step's name is unknown (in the way of a save there, never
    loaded or deleted); a folder whose marker is a link (a `cp -rs` copy of a step, a hub cache's
    snapshot) is complete and linked in (never counted by retention or deleted); one whose marker
    is a fifo is unknown."""
    for name in ("step-1", "step-2", "step-10", "step-11", "other"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-3").write_text("a file, not a step folder")
    os.symlink(str(tmp_path / "gone"), str(tmp_path / "step-4"))
    commit.write_marker(str(tmp_path / "step-10"), commit.CommitInfo(step=10, states=["model"]))
    commit.write_marker(str(tmp_path / "step-1"), commit.CommitInfo(step=1, states=["model"]))
    os.symlink(str(tmp_path / "step-10" / commit.MARKER), str(tmp_path / "step-11" / commit.MARKER))
    (tmp_path / "step-12").mkdir()
    os.mkfifo(tmp_path / "step-12" / commit.MARKER)
    assert [(s.step, s.status, s.linked) for s in layout.scan(str(tmp_path))] == [
        (1, "complete", False), (2, "unknown", False), (3, "unknown", False), (4, "unknown", True),
        (10, "complete", False), (11, "complete", True), (12, "unknown", False)]
    assert [layout.folder_bytes(str(tmp_path / name)) for name in ("step-3", "step-4")] == [25, len(str(tmp_path)) + 5]
    assert layout.committed_steps(str(tmp_path)) == [1, 10, 11]
    assert layout.scan(str(tmp_path / "missing")) == []


def test_folder_bytes_counts_what_sparse_files_hold(tmp_path):
    """A step fetched by byte ranges is mostly holes: the load's log counts what it holds."""
    (tmp_path / "whole").write_bytes(b"x" * 10_000)
    with open(tmp_path / "sparse", "wb") as f:
        f.seek(64 << 20)
        f.write(b"y" * 4096)
    assert layout.folder_bytes(str(tmp_path)) == 10_000 + (64 << 20) + 4096
    assert 10_000 + 4096 <= layout.folder_bytes(str(tmp_path), held=True) < 1 << 20


def test_marker_records_a_manifest(tmp_path):
    (tmp_path / "a.distcp").write_bytes(b"x" * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"y" * 3)
    # a.distcp's checksum comes from its writer; sub/b is read once
    info = commit.write_marker(str(tmp_path), commit.CommitInfo(step=5, states=["model", "optimizer"]),
                               {"a.distcp": (10, "0000abcd")})
    assert info.files == {"a.distcp": {"size": 10, "crc32": "0000abcd"},
                          os.path.join("sub", "b"): {"size": 3, "crc32": f"{zlib.crc32(b'yyy'):08x}"}}
    again = commit.read_marker(str(tmp_path))
    assert again == info and again.total_bytes == 13 and not again.model_only
    # verify() recomputes: the writer's (made-up) checksum for a.distcp does not match the bytes
    assert commit.verify(str(tmp_path)) == [f"{tmp_path}/a.distcp: CRC-32 {zlib.crc32(b'x' * 10):08x}, "
                                            "the manifest says 0000abcd"]
    commit.uncommit(str(tmp_path))
    assert not commit.is_committed(str(tmp_path))


def test_marker_refuses_a_file_whose_size_changed_after_writing(tmp_path):
    (tmp_path / "a.distcp").write_bytes(b"x" * 10)
    with pytest.raises(OSError, match="a.distcp has 10 bytes on disk, its writer wrote 12"):
        commit.write_marker(str(tmp_path), commit.CommitInfo(step=5, states=["model"]), {"a.distcp": (12, "0")})
    assert not commit.is_committed(str(tmp_path))


def test_balanced_groups_put_the_largest_first_into_the_lightest_group():
    from torchtitan_ckpt.policy.split import balanced_groups

    assert balanced_groups([1, 7, 3, 5], 2, lambda x: x) == [[7, 1], [5, 3]]
    assert balanced_groups([4], 3, lambda x: x) == [[4]]
    assert balanced_groups([], 2, lambda x: x) == [[]]


def test_in_order_runs_keep_the_order_and_cut_at_the_target():
    from torchtitan_ckpt.policy.split import in_order_runs

    assert in_order_runs([2, 2, 2, 2, 2], lambda x: x, 4) == [[2, 2], [2, 2], [2]]
    assert in_order_runs([2, 2, 2, 2, 2], lambda x: x, 4, max_runs=2) == [[2, 2], [2, 2, 2]]


def test_the_deleter_outlives_a_failed_deletion_and_drain_waits_for_the_queue(tmp_path):
    """Retention's deletions run on one thread: a deletion that fails with any error is logged
    and the next ones still run (before, an error other than `OSError` ended the thread and
    every later deletion silently never happened); `drain()`, which `load()` calls before it
    looks for steps, returns once every deletion submitted is done."""
    import shutil
    import threading

    from torchtitan_ckpt.deleter import BackgroundDeleter

    folders = []
    for step in (1, 2):
        os.makedirs(tmp_path / f"step-{step}")
        folders.append(StepFolder(step, str(tmp_path / f"step-{step}"), layout.COMPLETE))
    gate, removed = threading.Event(), []

    def remove(folder: StepFolder) -> None:
        gate.wait(10)
        if folder.step == 1:
            raise ValueError("the store refused to delete step 1")
        shutil.rmtree(folder.path)
        removed.append(folder.step)

    deleter = BackgroundDeleter(remove, str)
    deleter.submit(folders)
    threading.Timer(0.3, gate.set).start()
    assert deleter.drain(timeout_s=60)  # a deleter thread that died with the error never drains
    assert removed == [2] and not os.path.exists(folders[1].path) and os.path.exists(folders[0].path)
    deleter.close()
    after = threading.Thread(target=deleter.drain, daemon=True)  # a load() after close() waits for nothing
    after.start()
    after.join(5)
    assert not after.is_alive()


def test_a_step_deleted_while_retention_listed_the_folder_is_not_deleted_again(tmp_path, caplog):
    """Retention lists the folder while the deleter ends an earlier retention's deletion of a
    step: that step, listed before it went, is not queued again (its second removal found it
    gone and warned that another job might be saving into the folder)."""
    from torchtitan_ckpt.deleter import BackgroundDeleter
    from torchtitan_ckpt.storage.local import LocalStore

    folder = tmp_path / "checkpoint"
    for step in (1, 2):
        _committed_step(str(folder / f"step-{step}"))
    store = LocalStore(str(folder))
    deleter = BackgroundDeleter(store.remove, store.describe)
    listed_at = deleter.mark()  # this retention's listing begins
    listed = store.scan(str(folder))
    deleter.submit([f for f in listed if f.step == 1])  # an earlier retention's deletion, ending meanwhile
    assert deleter.drain(timeout_s=60) and not os.path.exists(folder / "step-1")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torchtitan_ckpt"):
        deleter.submit([f for f in listed if f.step == 1], listed_at)
        assert deleter.drain(timeout_s=60)
    assert "could not delete" not in caplog.text and "deleted" not in caplog.text
    _committed_step(str(folder / "step-1"))  # saved again (a step counter gone back), listed after: deleted
    listed_at = deleter.mark()
    deleter.submit([f for f in store.scan(str(folder)) if f.step == 1], listed_at)
    deleter.close()
    assert not os.path.exists(folder / "step-1") and os.path.exists(folder / "step-2")


def _committed_step(path: str) -> None:
    """A committed step folder of ours: DCP's `.metadata`, data files, one in a subfolder."""
    os.makedirs(os.path.join(path, "sub"))
    for rel in (".metadata", "__0_0.distcp", "__1_0.distcp", os.path.join("sub", "extra.bin")):
        with open(os.path.join(path, rel), "wb") as f:
            f.write(rel.encode() * 10)
    commit.write_marker(path, commit.CommitInfo(step=3, states=["model"], world_size=2))


class _Stop(Exception):
    pass


def test_a_step_being_deleted_reads_as_partial_whenever_the_deletion_stops(tmp_path):
    """Deleting a step folder of ours, stopped after any number of files (as a kill would), leaves
    a folder that reads as partial (ours, cleaned later): the in-progress marker goes last. A
    deletion in directory order could remove it before `.metadata`, and the rest then read as
    another program's loadable checkpoint."""
    for stop_after in range(4):  # the four files besides the marker
        path = str(tmp_path / f"step-{stop_after}")
        _committed_step(path)
        count = []

        def removed(nbytes: int) -> None:
            count.append(nbytes)
            if len(count) > stop_after:
                raise _Stop

        with pytest.raises(_Stop):
            commit.remove_step(path, removed)
        assert layout.status_of(path) == layout.PARTIAL, stop_after
    path = str(tmp_path / "step-9")
    _committed_step(path)
    commit.remove_step(path)
    assert not os.path.lexists(path)


def test_a_file_written_into_a_step_while_it_is_deleted_leaves_it_partial(tmp_path):
    """A job still writing there (a file created after the folder was listed): the folder cannot
    be removed; it is marked ours and partial again, the new file kept, and the error says so. The
    next cleaning removes it."""
    path = str(tmp_path / "step-3")
    _committed_step(path)
    count = []

    def removed(nbytes: int) -> None:
        count.append(nbytes)
        if len(count) == 4:  # the last file listed is gone
            with open(os.path.join(path, "late.bin"), "wb") as f:
                f.write(b"late")

    with pytest.raises(CheckpointError, match=rf"^{path}: files appeared in it while it was removed .* it is left "
                                               "partial, to be removed once nothing writes there$"):
        commit.remove_step(path, removed)
    assert layout.status_of(path) == layout.PARTIAL
    assert sorted(os.listdir(path)) == [commit.IN_PROGRESS, "late.bin"]
    commit.remove_step(path)
    assert not os.path.lexists(path)


def test_a_subfolder_swapped_for_a_link_while_a_step_is_deleted_is_never_removed_through(tmp_path):
    """Another writer of the checkpoint folder turning a step's subfolder into a link to a folder
    of its own mid-deletion: the rest of the subfolder's files were removed through the link, from
    that folder (names were joined to the path, resolved anew at each removal)."""
    path = str(tmp_path / "step-3")
    os.makedirs(os.path.join(path, "sub"))
    outside = tmp_path / "theirs"
    outside.mkdir()
    for name in ("a", "b", "c"):
        (outside / name).write_bytes(b"theirs")
        with open(os.path.join(path, "sub", name), "wb") as f:
            f.write(b"ours")
    commit.write_marker(path, commit.CommitInfo(step=3, states=["model"], world_size=1))
    moved = str(tmp_path / "moved")

    def removed(nbytes: int) -> None:
        if not os.path.lexists(moved):  # after the first file: swap the subfolder for a link
            os.rename(os.path.join(path, "sub"), moved)
            os.symlink(outside, os.path.join(path, "sub"))

    commit.remove_step(path, removed)
    assert not os.path.lexists(path)
    assert sorted(p.name for p in outside.iterdir()) == ["a", "b", "c"]


def test_a_commit_refuses_a_step_missing_a_file_its_writers_wrote(tmp_path):
    path = str(tmp_path / "step-3")
    os.makedirs(path)
    with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
        f.write(b"x" * 10)
    written = {"__0_0.distcp": (10, "%08x" % zlib.crc32(b"x" * 10)), "__1_0.distcp": (10, "00000000")}
    with pytest.raises(OSError, match=r"\['__1_0.distcp'\] \(1 files\) were written but are not in the step folder"):
        commit.write_marker(path, commit.CommitInfo(step=3, states=["model"], world_size=2), written)
    assert not commit.is_committed(path)


def test_a_commit_makes_the_files_entries_durable_before_its_marker(tmp_path, monkeypatch):
    """The step folder was first fsynced after the marker's rename: a power loss could keep the
    marker and lose the entry of a data file or of `.metadata` (a file system that does not
    order metadata writes), a step `list` calls complete and no load reads."""
    from .jobs import make_job  # noqa: PLC0415

    job = make_job(str(tmp_path), steps=2, interval=2)
    calls = syscalls(monkeypatch)
    job.run_to(2, steps=2)
    job.manager.close()
    step = str(tmp_path / "checkpoint" / "step-2")
    marker = next(i for i, c in enumerate(calls) if c == ("replace", os.path.join(step, commit.MARKER)))
    metadata = max(i for i, (_, path) in enumerate(calls[:marker]) if path.endswith(".metadata"))
    assert ("fsync", step) in calls[metadata:marker], calls[metadata:marker]


def test_a_removal_makes_the_files_removals_durable_before_the_marker_s(tmp_path, monkeypatch):
    """The step folder was fsynced only after its marker's removal: a power loss could keep that
    removal and not a data file's, leaving files without a marker, which read as another
    program's step (loaded unverified)."""
    path = str(tmp_path / "step-3")
    os.makedirs(path)
    for name in ("__0_0.distcp", ".metadata"):
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"x")
    commit.write_marker(path, commit.CommitInfo(step=3, states=["model"], world_size=1))
    calls = syscalls(monkeypatch)
    commit.remove_step(path)
    marker = calls.index(("remove", os.path.join(path, commit.IN_PROGRESS)))
    last_data = max(i for i, (call, name) in enumerate(calls) if call == "unlink" and name in ("__0_0.distcp",
                                                                                               ".metadata"))
    assert ("fsync", path) in calls[last_data:marker], calls
