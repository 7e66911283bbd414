"""A `.metadata` this user's save wrote is loaded without the pickle scan that guards against
crafted ones (`io/own_writes.py`); any other is scanned."""

from __future__ import annotations

import hashlib
import os

import torch

from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.io import own_writes

NOT_SCANNED = "step-1/.metadata: not scanned, this user's save wrote it"


def test_a_step_this_user_saved_loads_without_its_metadata_scanned(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = Checkpoint(enable=True, folder=str(tmp_path / "ck"), interval=1, last_save_model_only=False)
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(config, [model]) as manager:
        manager.save(1)
    with open(tmp_path / "ck" / "step-1" / ".metadata", "rb") as f:
        assert own_writes.known(hashlib.sha256(f.read()).digest())
    with caplog.at_level("DEBUG", logger="torchtitan_ckpt.formats.dcp"), CheckpointManager(config, [model]) as manager:
        assert manager.load()
    assert NOT_SCANNED in caplog.text
    caplog.clear()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "another user's cache"))
    with caplog.at_level("DEBUG", logger="torchtitan_ckpt.formats.dcp"), CheckpointManager(config, [model]) as manager:
        assert manager.load()
    assert NOT_SCANNED not in caplog.text


def test_the_list_is_read_only_where_no_one_else_could_have_written_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    listed = tmp_path / "torchtitan_ckpt" / "own-metadata"
    digest = hashlib.sha256(b"a .metadata").digest()
    own_writes.remember(digest)
    assert own_writes.known(digest) and not own_writes.known(hashlib.sha256(b"another").digest())
    assert oct(listed.stat().st_mode & 0o777) == "0o600"
    listed.chmod(0o666)  # another user may have listed a crafted file's digest
    assert not own_writes.known(digest)
    own_writes.remember(hashlib.sha256(b"not written there").digest())
    assert listed.read_bytes().count(b"\n") == 1
    listed.chmod(0o600)
    listed.parent.chmod(0o777)  # another user could put a file of theirs in its place
    assert not own_writes.known(digest)
    listed.parent.chmod(0o700)
    assert own_writes.known(digest)
    os.rename(listed, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", listed)  # a link is not followed
    assert not own_writes.known(digest)


def test_the_newest_digests_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(own_writes, "KEPT", 4)
    digests = [hashlib.sha256(bytes([i])).digest() for i in range(10)]
    for digest in digests:
        own_writes.remember(digest)
    kept = [own_writes.known(d) for d in digests]
    assert kept[-4:] == [True] * 4 and not kept[0]
    assert (tmp_path / "torchtitan_ckpt" / "own-metadata").stat().st_size <= 2 * 4 * 65
    assert os.listdir(tmp_path / "torchtitan_ckpt") == ["own-metadata"]


def test_a_rewrite_left_by_a_killed_process_stops_no_later_one(tmp_path, monkeypatch):
    """A process killed while rewriting the list leaves its file beside it; a later process with
    its pid (containers reuse them) still keeps the list short."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(own_writes, "KEPT", 4)
    (tmp_path / "torchtitan_ckpt").mkdir(mode=0o700)
    for left in (f"own-metadata.{os.getpid()}", f"own-metadata.{os.getpid()}.0123456789abcdef"):
        (tmp_path / "torchtitan_ckpt" / left).write_bytes(b"")
    for i in range(20):
        own_writes.remember(hashlib.sha256(bytes([i])).digest())
    assert (tmp_path / "torchtitan_ckpt" / "own-metadata").stat().st_size <= 2 * 4 * 65


def test_without_a_cache_folder_nothing_is_kept(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    digest = hashlib.sha256(b"x").digest()
    own_writes.remember(digest)
    assert not own_writes.known(digest) and os.listdir(tmp_path) == []
