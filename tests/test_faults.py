"""Crash safety: SIGKILL at chosen moments of a save, restart, and finish bit-identical.

The long run (dozens of kills over every phase) is `benchmarks/faults.py`; these are its fast cases.
"""

from __future__ import annotations

import os

import pytest

from torchtitan_ckpt import commit, faults, layout

from .helpers import assert_same, losses, read_checkpoint, run_job

pytestmark = pytest.mark.multirank

# export_dtype does not apply to a full last save: told as a note, which changes nothing
JOB = ("--checkpoint.last_save_model_only", "false", "--checkpoint.export_dtype", "bfloat16",
       "--checkpoint.keep_latest_k", "2")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    dump = str(tmp_path_factory.mktemp("straight"))
    log = run_job(dump, *JOB, nproc=2)
    return {"losses": losses(log), "final": read_checkpoint(layout.step_dir(os.path.join(dump, "checkpoint"), 20)),
            "log": log}


def test_a_setting_others_make_void_is_told_once_by_rank_0(uninterrupted):
    """Each rank loads the TOML and builds a manager; the note is the run's, said once."""
    assert uninterrupted["log"].count("checkpoint.export_dtype = 'bfloat16' does not apply: nothing is exported") == 1


@pytest.mark.parametrize("failpoint, partial_files, mode", [
    ("write@10:1", {"__1_0.distcp"}, "disabled"),                 # rank 1 dies with its data half written
    ("commit@15", {commit.MARKER + ".tmp", ".metadata"}, "disabled"),  # every rank dies before the rename
    # the fail point is reached in rank 1's writer process, which takes its rank down with it
    ("write@10:1", {"__1_0.distcp"}, "async_with_pinned_mem"),
])
def test_kill_during_a_save_then_resume_is_bit_identical(tmp_path, uninterrupted, failpoint, partial_files, mode):
    dump = str(tmp_path)
    folder = os.path.join(dump, "checkpoint")
    run_job(dump, *JOB, "--checkpoint.async_mode", mode, nproc=2, env={faults.ENV: failpoint}, expect_ok=False)
    step = int(failpoint.split("@")[1].split(":")[0])
    before = {s.step: s.committed for s in layout.scan(folder)}
    assert before[step] is False  # the step being saved is visibly partial ...
    assert partial_files <= set(os.listdir(layout.step_dir(folder, step)))
    previous = max(s for s, ok in before.items() if ok)  # ... and the previous one is intact
    assert previous == step - 5 and commit.verify(layout.step_dir(folder, previous)) == []

    log = run_job(dump, *JOB, nproc=2)
    assert f"ignoring {layout.step_dir(folder, step)}: its save did not finish" in log
    assert f"loaded step {previous} from {layout.step_dir(folder, previous)}" in log
    resumed = losses(log)
    assert resumed == {s: v for s, v in uninterrupted["losses"].items() if s > previous}
    assert_same(read_checkpoint(layout.step_dir(folder, 20)), uninterrupted["final"])
    assert layout.committed_steps(folder) == [10, 15, 20]  # k = 2 before the last save; the partial one saved again


def test_kill_during_an_hf_export_leaves_no_index(tmp_path):
    """Rank 1 dies after writing its bytes of the last step's HF files, before the index."""
    dump = str(tmp_path)
    folder = os.path.join(dump, "checkpoint")
    run_job(dump, "--checkpoint.last_save_in_hf", "true", "--training.steps", "6", nproc=2,
            env={faults.ENV: "consolidate@6:1"}, expect_ok=False)
    step6 = layout.step_dir(folder, 6)
    assert os.listdir(step6)  # files were being written ...
    assert "model.safetensors.index.json" not in os.listdir(step6)  # ... but no index
    assert not commit.is_committed(step6)
    assert layout.committed_steps(folder) == [5]
