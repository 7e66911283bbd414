"""Folders another user may write to (a team's, `/tmp`): a link or a hard link planted at the name
of a file the package is about to write is replaced, never written through, so no file of the
user's elsewhere is overwritten; the lock file is never writable by other users."""

from __future__ import annotations

import os
import stat

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan_ckpt import Checkpoint, CheckpointManager
from torchtitan_ckpt.dcp import storage
from torchtitan_ckpt.example.model import FLAVORS, Transformer, hf_adapter
from torchtitan_ckpt.hf import save_hf
from torchtitan_ckpt.hf.files import INDEX_FILE
from torchtitan_ckpt.io import durable, filewriter
from torchtitan_ckpt.storage.local import LOCK_FILE

from .helpers import assert_same, read_checkpoint

PRECIOUS = b"the user's own file\n"


def _victim(tmp_path, name: str = "victim") -> str:
    path = tmp_path / name
    path.write_bytes(PRECIOUS)
    return str(path)


def _plant(folder: str, names: list[str], victim: str, hard: bool = False) -> None:
    os.makedirs(folder, exist_ok=True)
    for name in names:
        (os.link if hard else os.symlink)(victim, os.path.join(folder, name))


@pytest.mark.parametrize("hard", [False, True], ids=["symlink", "hard_link"])
def test_a_json_file_is_never_written_through_a_link_at_its_temporary_name(tmp_path, hard):
    victim = _victim(tmp_path)
    _plant(str(tmp_path / "out"), ["marker.json" + durable.TMP_SUFFIX], victim, hard)
    durable.write_json(str(tmp_path / "out" / "marker.json"), {"step": 1})
    assert open(victim, "rb").read() == PRECIOUS
    assert (tmp_path / "out" / "marker.json").read_text() == '{"step": 1}'


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("hard", [False, True], ids=["symlink", "hard_link"])
def test_a_data_file_is_never_written_through_a_link_at_its_name(tmp_path, direct, hard):
    victim = _victim(tmp_path)
    _plant(str(tmp_path / "step"), ["__0_0.distcp"], victim, hard)
    job = filewriter.FileJob(str(tmp_path / "step" / "__0_0.distcp"), [filewriter.Entry("t", torch.ones(64))],
                             direct=direct)
    assert [w.durable() for w in filewriter.write_files([job])]  # written and fsynced
    assert open(victim, "rb").read() == PRECIOUS
    assert not os.path.islink(job.path) and os.path.getsize(job.path) > 0


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "torch"])
def test_a_dcp_save_never_writes_through_links_in_its_folder(tmp_path, fast):
    """DCP's `.metadata` goes through a temporary name the writer makes as any data file; the
    torch engine's files too (PyTorch's writer, through the file system given to it)."""
    victim = _victim(tmp_path)
    step = str(tmp_path / "step-1")
    _plant(step, ["__0_0.distcp", ".metadata.tmp", ".metadata"], victim)
    state = {"w": torch.arange(12.0).reshape(3, 4)}
    dcp.save(state, storage_writer=storage.make_storage_writer(step, fast=fast))
    assert open(victim, "rb").read() == PRECIOUS
    assert_same(read_checkpoint(step), state)


@pytest.mark.parametrize("mode", ["one_pass", "rank0"])
def test_an_export_never_writes_through_links_planted_in_its_folder(tmp_path, mode):
    """Another user's link at the index's temporary name overwrote a file of the exporting
    user's with the index (`save_hf` into a folder others may write to)."""
    victim = _victim(tmp_path)
    model = Transformer(FLAVORS["debugmodel"])
    out = str(tmp_path / "hf")
    _plant(out, [INDEX_FILE + durable.TMP_SUFFIX, "model-00001-of-00001.safetensors", "config.json"], victim)
    save_hf(model.state_dict(), out, hf_adapter(model.args), mode=mode)
    assert open(victim, "rb").read() == PRECIOUS
    assert not any(os.path.islink(os.path.join(out, name)) for name in os.listdir(out))


def test_the_lock_file_of_a_folder_any_user_may_write_to_is_not_writable_by_others(tmp_path):
    """It was made as writable as its folder: in `/tmp`-like folder, by every user, any of whom
    could then write another holder into it and stop each later save of the job."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    folder.chmod(0o1777)
    with CheckpointManager(Checkpoint(enable=True, interval=1), [torch.nn.Linear(2, 2)],
                           base_folder=str(tmp_path)) as manager:
        manager.save(1)
        assert not stat.S_IMODE((folder / LOCK_FILE).stat().st_mode) & 0o002
