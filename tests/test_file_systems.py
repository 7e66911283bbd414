"""File systems without what ext4, xfs, btrfs and tmpfs give: a FAT volume (through FUSE: fusefat)
sets no file mode and grows no file by `ftruncate`. Its answers are put in place of those calls,
since a test cannot mount one; a run on a real fusefat mount found both (docs/storage.md)."""

from __future__ import annotations

import errno
import glob
import os

import torch
from safetensors.torch import load_file

from tests.helpers import assert_same
from tests.jobs import make_job
from torchtitan_ckpt import layout
from torchtitan_ckpt.example.model import FLAVORS, Transformer, hf_adapter
from torchtitan_ckpt.hf import save_hf

ARGS = FLAVORS["debugmodel"]


def test_a_folder_whose_files_take_no_mode_saves_and_resumes(tmp_path, monkeypatch, caplog):
    """The lock file's mode was set as the folder's, and fusefat's ENOSYS refused every job at start."""
    def no_modes(fd, mode):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "fchmod", no_modes)
    job = make_job(str(tmp_path), steps=4, interval=2)
    job.run_to(2, steps=4)
    job.manager.close()
    assert layout.committed_steps(str(tmp_path / "checkpoint")) == [2]
    assert "held, but its mode could not be set" in caplog.text
    fresh = make_job(str(tmp_path), steps=4, interval=2, init_seed=1)
    assert fresh.manager.load()
    assert_same(fresh.model.state_dict(), job.model.state_dict())
    fresh.manager.close()


def test_an_hf_export_where_files_do_not_grow_by_ftruncate(tmp_path, monkeypatch):
    """The export made each file its final size by `ftruncate`, which fusefat refuses (EPERM)
    where it would grow the file: the last save in HF failed there."""
    shrink_only = os.ftruncate

    def ftruncate(fd, length):
        if length > os.fstat(fd).st_size:
            raise OSError(errno.EPERM, "Operation not permitted")
        shrink_only(fd, length)

    monkeypatch.setattr(os, "ftruncate", ftruncate)
    torch.manual_seed(0)
    model = Transformer(ARGS)
    save_hf(model.state_dict(), str(tmp_path), hf_adapter(ARGS), dtype=torch.float32)
    exported = {k: v for f in glob.glob(str(tmp_path / "*.safetensors")) for k, v in load_file(f).items()}
    assert_same(exported, hf_adapter(ARGS).to_hf(model.state_dict()))
