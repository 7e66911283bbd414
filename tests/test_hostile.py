"""Hostile and damaged checkpoints: a crafted or broken folder ends in our own error naming the
file, entry or key, within a time limit, with nothing outside the checkpoint read, changed or
deleted, and no state of the job changed when the checkpoint's content is refused."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import traceback
import zlib
from dataclasses import replace

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata

from torchtitan_ckpt import (CheckpointError, CheckpointManager, CheckpointSaveError, ConfigError, CorruptCheckpointError,
                             cli, commit)
from torchtitan_ckpt.config import Checkpoint, validate_tree
from torchtitan_ckpt.dcp import storage
from torchtitan_ckpt.dcp.metadata import MAX_METADATA_BYTES, METADATA_FILE, read_metadata
from torchtitan_ckpt.errors import PartialLoadError
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.hf import consolidate as C
from torchtitan_ckpt.policy.schedule import SaveKind
from torchtitan_ckpt.states import CheckedState
from torchtitan_ckpt.storage.local import LOCK_FILE

from .helpers import ROOT, forged_whole, read_checkpoint, spawn, within
from .jobs import make_job

SENTINEL = b"sentinel: never to be read, changed or deleted\n"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    """A dump folder whose checkpoint holds one full step, 2."""
    dump = str(tmp_path_factory.mktemp("pristine"))
    job = make_job(dump, steps=2, interval=2, keep_latest_k=0, last_save_model_only=False)
    job.run_to(2, steps=2)
    job.manager.close()
    return dump


@pytest.fixture
def ckpt(tmp_path, pristine):
    """(dump folder, step-2 folder, sentinel file outside the checkpoint) of a fresh copy."""
    dump = str(tmp_path / "dump")
    shutil.copytree(pristine, dump)
    sentinel = tmp_path / "outside.distcp"
    sentinel.write_bytes(SENTINEL)
    return dump, os.path.join(dump, "checkpoint", "step-2"), sentinel


def _load(dump: str, **checkpoint):
    job = make_job(dump, steps=2, interval=2, keep_latest_k=0, **checkpoint)
    with within(60):
        job.manager.load()
    return job


def _refused(dump: str, match: str, **checkpoint) -> None:
    """A fresh job's load raises our error matching `match` and leaves the job as it was (its
    fresh state differs from step 2's in every parameter: `_differs_from`)."""
    job = make_job(dump, steps=2, interval=2, keep_latest_k=0, **checkpoint)
    before = _snapshot(job)
    with pytest.raises(CorruptCheckpointError, match=match), within(60):
        job.manager.load()
    _unchanged(job, before)


def _recommit(step: str) -> None:
    """Make the marker's manifest match the files again, as an attacker would."""
    commit.write_marker(step, commit.read_marker(step))


def _edit_metadata(step: str, edit) -> None:
    path = os.path.join(step, METADATA_FILE)
    with open(path, "rb") as f:
        md = pickle.load(f)  # our own test file: plain pickle is fine here
    edit(md)
    with open(path, "wb") as f:
        pickle.dump(md, f)
    _recommit(step)


def _storage_of(md, fqn: str):
    return next(i for i in md.storage_data if i.fqn == fqn)


def _untouched(sentinel) -> None:
    assert sentinel.read_bytes() == SENTINEL


# ---------------------------------------------------------------- 1. paths that escape the folder


@pytest.mark.parametrize("verify_on_load", [False, True])
@pytest.mark.parametrize("name", ["../../outside.distcp", "/etc/passwd", "/dev/zero"])
def test_storage_paths_outside_the_step_folder_are_refused(ckpt, name, verify_on_load):
    dump, step, sentinel = ckpt

    def point_out(md):
        index = _storage_of(md, "train_state.step")
        md.storage_data[index] = replace(md.storage_data[index], relative_path=name, length=1 << 30)

    _edit_metadata(step, point_out)
    _refused(dump, f"'train_state.step'.*{name}.*outside the checkpoint folder", verify_on_load=verify_on_load)
    _untouched(sentinel)


def test_a_data_file_linked_outside_the_folder_is_refused(ckpt):
    dump, step, sentinel = ckpt
    os.remove(os.path.join(step, "__0_1.distcp"))
    os.symlink(sentinel, os.path.join(step, "__0_1.distcp"))
    _recommit(step)
    _refused(dump, rf"__0_1.distcp: .* link to {sentinel}, outside the checkpoint folder")
    os.remove(os.path.join(step, "__0_1.distcp"))
    os.symlink("/dev/zero", os.path.join(step, "__0_1.distcp"))
    _refused(dump, "__0_1.distcp: .* link to /dev/zero")
    _untouched(sentinel)


def test_a_data_file_linked_into_a_folder_named_like_its_own_is_refused(ckpt):
    """`step-2/x` linking to `step-2-copy/x`: its target's path starts with the step folder's,
    and is outside it all the same."""
    dump, step, sentinel = ckpt
    beside = step + "-copy"
    os.mkdir(beside)
    os.replace(os.path.join(step, "__0_1.distcp"), os.path.join(beside, "__0_1.distcp"))
    os.symlink(os.path.join(beside, "__0_1.distcp"), os.path.join(step, "__0_1.distcp"))
    _recommit(step)
    _refused(dump, rf"__0_1.distcp: .* link to {beside}/__0_1.distcp, outside the checkpoint folder")
    _untouched(sentinel)


def test_a_file_swapped_for_a_link_out_while_it_is_opened_is_never_read(tmp_path):
    """Another writer of the folder swapping a file's name between the file and a link out of the
    folder: the check of the name and the open saw different files (the outside file was read
    115-340 times in 10 s of tries)."""
    import threading

    from torchtitan_ckpt.io import safe_open

    root, outside = tmp_path / "step", tmp_path / "outside"
    root.mkdir()
    outside.write_bytes(SENTINEL)
    (root / "real").write_bytes(b"ours")
    name = str(root / "data")
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            for target in (root / "real", outside):
                os.symlink(target, name + ".new")
                os.replace(name + ".new", name)

    swapper = threading.Thread(target=swap)
    swapper.start()
    read, refused = set(), 0
    try:
        for _ in range(3000):
            try:
                with os.fdopen(safe_open.open_fd(str(root), "data", "the file"), "rb") as f:
                    read.add(f.read())
            except CorruptCheckpointError:
                refused += 1
    finally:
        stop.set()
        swapper.join()
    assert read <= {b"ours"} and refused


# ---------------------------------------------------------------- 2. a FIFO never blocks


@pytest.mark.parametrize("victim", [METADATA_FILE, "__0_1.distcp"])
@pytest.mark.parametrize("verify_on_load", [False, True])
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(ckpt, victim, verify_on_load):
    dump, step, _ = ckpt
    path = os.path.join(step, victim)
    os.remove(path)
    os.mkfifo(path)
    with pytest.raises(CheckpointError, match=rf"{victim}.* not a regular file"):
        _load(dump, verify_on_load=verify_on_load, verify_fallback=False)


def test_a_fifo_as_the_marker_is_refused_without_blocking(ckpt, capsys):
    dump, step, _ = ckpt
    os.remove(os.path.join(step, commit.MARKER))
    os.mkfifo(os.path.join(step, commit.MARKER))
    with pytest.raises(CorruptCheckpointError, match=f"{commit.MARKER}.* not a regular file"), within(30):
        commit.read_marker(step)
    with within(30):
        assert cli.main(["list", os.path.dirname(step)]) == 1  # no complete step (docs/cli.md)
    assert "unknown" in capsys.readouterr().out  # a marker that is no regular file is not ours
    job = make_job(dump, steps=2, interval=2)
    with within(60), pytest.raises(CheckpointError, match=r"step\(s\) 2 were not written by torchtitan_ckpt"):
        job.manager.load()  # never loaded; and in the way of the save at step 2, so refused now


# ---------------------------------------------------------------- 3. symlinked step folders


def _other_run(tmp_path) -> tuple[str, bytes]:
    """Another checkpoint's committed step: (its folder, its marker's bytes)."""
    other = tmp_path / "other" / "step-1"
    other.mkdir(parents=True)
    (other / "weights").write_bytes(SENTINEL)
    commit.write_marker(str(other), commit.CommitInfo(step=1, states=["model"]))
    return str(other), (other / commit.MARKER).read_bytes()


def test_retention_never_deletes_or_uncommits_through_a_linked_step(tmp_path, capsys):
    other, marker = _other_run(tmp_path)
    os.makedirs(tmp_path / "dump" / "checkpoint")
    os.symlink(other, tmp_path / "dump" / "checkpoint" / "step-1")
    job = make_job(str(tmp_path / "dump"), steps=6, interval=2, keep_latest_k=1)
    job.run_to(6, steps=6)
    job.manager.close()
    # step 4 stays too: step 6 holds only the model, and 4 is where a run goes on
    assert sorted(os.listdir(tmp_path / "dump" / "checkpoint")) == [LOCK_FILE, "step-1", "step-4", "step-6"]
    assert (tmp_path / "other" / "step-1" / commit.MARKER).read_bytes() == marker
    assert cli.main(["clean", str(tmp_path / "dump" / "checkpoint")]) == 0
    assert os.path.islink(tmp_path / "dump" / "checkpoint" / "step-1")
    capsys.readouterr()
    assert cli.main(["list", str(tmp_path / "dump" / "checkpoint"), "--json"]) == 0
    assert [(s["step"], s["linked"]) for s in json.loads(capsys.readouterr().out)["steps"]] == [
        (1, True), (4, False), (6, False)]
    assert cli.main(["list", str(tmp_path / "dump" / "checkpoint")]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert ["linked in, never deleted" in line for line in lines] == [True, False, False]


def test_a_save_never_replaces_a_linked_step_folder(tmp_path):
    other, marker = _other_run(tmp_path)
    os.makedirs(tmp_path / "dump" / "checkpoint")
    os.symlink(other, tmp_path / "dump" / "checkpoint" / "step-2")
    job = make_job(str(tmp_path / "dump"), steps=2, interval=2)
    with pytest.raises(CheckpointSaveError, match="step-2 is a link to .*: a step folder linked in from elsewhere "
                                                  "is never replaced"):
        job.run_to(2, steps=2)
    job.manager.close()
    assert (tmp_path / "other" / "step-1" / commit.MARKER).read_bytes() == marker
    assert sorted(os.listdir(other)) == [commit.MARKER, "weights"]


def test_clean_leaves_a_linked_partial_step_alone(tmp_path, capsys):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_bytes(SENTINEL)
    os.makedirs(tmp_path / "ckpt")
    os.symlink(target, tmp_path / "ckpt" / "step-3")
    assert cli.main(["clean", str(tmp_path / "ckpt")]) == 0
    assert "0 partial step folders removed" in capsys.readouterr().out
    assert (target / "keep").read_bytes() == SENTINEL


# ---------------------------------------------------------------- 4. the dataloader's size


@pytest.mark.parametrize("field, value", [("length", 2**40), ("length", -1), ("length", 0), ("offset", 2**40)])
def test_a_dataloader_entry_its_file_does_not_hold_is_refused(ckpt, field, value):
    """The dataloader's position is a value of the step's bytes: its length and offset come from
    `.metadata` and are checked against its file before a buffer of that length exists."""
    dump, step, _ = ckpt

    def edit(md):
        setattr(md.storage_data[_storage_of(md, "dataloader.dp_rank_0")], field, value)

    _edit_metadata(step, edit)
    _refused(dump, r"dataloader.dp_rank_0")


# ---------------------------------------------------------------- 5. states that cannot be applied


def _snapshot(job) -> tuple:
    """What a load changes of `job`: its model's tensors, its optimizer, step and schedule."""
    return ({k: v.clone() for k, v in job.model.state_dict().items()}, copy.deepcopy(job.opt.state_dict()),
            job.train_state.step, job.sched.last_epoch)


def _unchanged(job, snapshot: tuple) -> None:
    model, opt, step, epoch = snapshot
    now = job.model.state_dict()
    assert [k for k, v in model.items() if not torch.equal(now[k], v)] == []
    assert job.opt.state_dict() == opt and not job.opt.state  # a fresh optimizer stays without state
    assert (job.train_state.step, job.sched.last_epoch) == (step, epoch)


def _differs_from(pristine: str, job, snapshot: tuple) -> None:
    """Every parameter saved in the step differs from the job's (so `_unchanged` tells a load,
    even of one tensor, from none)."""
    saved = read_checkpoint(os.path.join(pristine, "checkpoint", "step-2"))
    assert [n for n, _ in job.model.named_parameters() if torch.equal(saved[n], snapshot[0][n])] == []


def _refused_unchanged(job, pristine: str, error: type, problem: str) -> None:
    """`job`'s load raises `error` matching `problem` and leaves the job as it was, though the
    step differs from it."""
    before = _snapshot(job)
    with pytest.raises(error, match=problem), within(60):
        job.manager.load()
    _unchanged(job, before)
    _differs_from(pristine, job, before)


def _craft(dump: str, edit) -> None:
    """Overwrite step 2 with the state saved there, edited by `edit`, committed as a save would."""
    job = _load(dump)
    state = job.manager._state_for_save(SaveKind.FULL)
    edit(state)
    step = os.path.join(dump, "checkpoint", "step-2")
    shutil.rmtree(step)
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=storage.make_storage_writer(step))
    commit.write_marker(step, commit.CommitInfo(step=2, states=["model", *job.manager._states]))
    job.manager.close()


def _garbled_loader_bytes(state):
    data = bytearray(state["dataloader"]["dp_rank_0"])
    at = data.index(b"_index_sampler_state")  # a key in its pickle: no longer UTF-8
    data[at : at + 2] = b"\xff\xff"
    state["dataloader"]["dp_rank_0"] = bytes(data)


def _five_as_param_groups(state):
    groups = state["optimizer"]["param_groups"]
    groups[next(iter(groups))] = 5  # a parameter's settings: a number instead of a table


def _text_as_last_epoch(state):
    state["lr_scheduler"]["last_epoch"] = "2"


def _two_rate_functions(state):
    state["lr_scheduler"]["lr_lambdas"] = [None, None]  # the job's LambdaLR has one param group


def _text_as_base_rates(state):
    state["lr_scheduler"]["base_lrs"] = "0.1"


def _text_in_base_rates(state):
    state["lr_scheduler"]["base_lrs"] = ["0.1"]  # as many as the job's param groups: no change of the job's


def _no_optimizer_entries(state):
    state["optimizer"] = {}  # the marker still lists it


def _value_as_moment(state):
    moments = next(iter(state["optimizer"]["state"].values()))
    moments["exp_avg"] = 0.5  # a number where the optimizer has a tensor


@pytest.mark.parametrize("edit, problem", [
    (_garbled_loader_bytes, "dataloader.dp_rank_0 is not plain data"),
    (_five_as_param_groups, "no optimizer settings .* for 1 parameters, e.g. \\['tok_embeddings.weight'\\]"),
    (_text_as_last_epoch, "lr_scheduler.last_epoch is '2', not a step count"),
    (_two_rate_functions, r"lr_scheduler.lr_lambdas holds 2 value\(s\), one per param group of the saved optimizer, "
                          r"where this job's optimizer has 1 param groups"),
    (_text_as_base_rates, r"lr_scheduler.base_lrs is '0.1', where this job's scheduler has \[0.01\]"),
    (_text_in_base_rates, r"lr_scheduler.base_lrs is \['0.1'\], where this job's scheduler has \[0.01\]"),
    (_no_optimizer_entries, r"no optimizer settings .* for \d+ parameters"),
    (_value_as_moment, "a value where this job has a tensor.*'optimizer.state.tok_embeddings.weight.exp_avg'"),
])
def test_a_state_that_cannot_be_applied_is_refused_before_anything_changes(ckpt, pristine, edit, problem):
    dump, _, _ = ckpt
    _craft(dump, edit)
    damaged = edit in (_text_as_last_epoch, _text_as_base_rates, _text_in_base_rates)
    _refused_unchanged(make_job(dump, steps=2, interval=2), pristine,
                       CorruptCheckpointError if damaged else CheckpointError, problem)


# ---------------------------------------------------------------- 5. nothing is written before all is checked


def _items(step: str) -> list[tuple[str, int, int, bool]]:
    """(file, offset, length, is a tensor) of every item of a DCP step, in file order."""
    md = read_metadata(os.path.join(step, METADATA_FILE))
    return sorted((os.path.join(step, info.relative_path), info.offset, info.length,
                   not isinstance(md.state_dict_metadata[index.fqn], BytesStorageMetadata))
                  for index, info in md.storage_data.items())


def _patch(file: str, at: int, data: bytes) -> None:
    with open(file, "r+b") as f:
        f.seek(at)
        f.write(data)


def _damage_last_tensor_header(step: str) -> str:
    file, offset, length, _ = [i for i in _items(step) if i[3]][-1]
    with open(file, "rb") as f:
        f.seek(offset)
        at = f.read(length).index(b"_rebuild_tensor_v2")
    _patch(file, offset + at, b"_rebuild_tensor_v9")  # a global no tensor header names
    return "could run code; refused"


def _damage_last_value(step: str) -> str:
    items = _items(step)
    file, offset, length, _ = [i for i in items if not i[3]][-1]
    assert any(tensor and f != file for f, _, _, tensor in items)  # tensors in a file read alongside
    _patch(file, offset, b"\0" * length)
    return "is not a value this load can read"


def _short_zip64_extra(step: str) -> str:
    """The last tensor's storage record made a zip64 record (32-bit sizes full) whose zip64
    extra field declares 16 bytes where 0 follow (it was a raw `struct.error`)."""
    file, offset, length, _ = [i for i in _items(step) if i[3]][-1]
    with open(file, "rb") as f:
        f.seek(offset)
        item = f.read(length)
    name = item.index(b"/data/0", item.rindex(b"PK\x01\x02", 0, item.rindex(b"/data/0")))
    entry = item.rindex(b"PK\x01\x02", 0, name)
    nlen = struct.unpack_from("<H", item, entry + 28)[0]
    _patch(file, offset + entry + 20, b"\xff" * 8)  # compressed and uncompressed size: "see zip64"
    _patch(file, offset + entry + 30, struct.pack("<H", 4))  # an extra field of 4 bytes...
    _patch(file, offset + entry + 46 + nlen, struct.pack("<HH", 1, 16))  # ...a zip64 one, "16 bytes long"
    return r"^(?![\s\S]*struct\.error)[\s\S]*item '.*' .*is not a readable torch.save archive"


def _last_tensor_directory_entry(step: str, name: bytes) -> tuple[str, int]:
    """(file, position) of the zip directory entry of the record whose name ends in `name`, in
    the last tensor's item."""
    file, offset, length, _ = [i for i in _items(step) if i[3]][-1]
    with open(file, "rb") as f:
        f.seek(offset)
        item = f.read(length)
    return file, offset + item.rindex(b"PK\x01\x02", 0, item.index(name, item.index(b"PK\x01\x02")))


def _rename_in_directory(step: str) -> str:
    """The last tensor's `version` record renamed `archiv//version` in its zip directory (found
    by fuzzing): torch's zip reader refuses the archive; with io_engine = "torch" the load
    failed after tensors were written."""
    file, entry = _last_tensor_directory_entry(step, b"/version")
    _patch(file, entry + 46, b"archiv//version")
    return r"item '.*' .*is not a readable torch.save archive \(record b'archiv//version' is not named as torch.save"


def _storage_record_made_a_folder(step: str) -> str:
    """The last tensor's storage record given the MS-DOS folder attribute in its zip directory
    (found by fuzzing): torch's zip reader then reads none of its bytes; with io_engine = "torch"
    the tensor loaded as uninitialised memory, without an error."""
    file, entry = _last_tensor_directory_entry(step, b"/data/0")
    _patch(file, entry + 38, struct.pack("<I", 0x10))
    return r"item '.*' .*is not a readable torch.save archive \(record b'.*/data/0' is not a file stored uncompressed"


@pytest.mark.parametrize("engine", ["fast", "torch"])
@pytest.mark.parametrize("damage", [_damage_last_tensor_header, _damage_last_value, _short_zip64_extra,
                                    _rename_in_directory, _storage_record_made_a_folder])
def test_a_damaged_item_is_refused_before_any_tensor_is_written(ckpt, pristine, damage, engine):
    """Without verify_on_load: the damage is found in the reader's first pass, after the items
    before it were checked and before any of them is read into the job's tensors, whichever
    engine then reads them."""
    dump, step, _ = ckpt
    problem = damage(step)
    _refused_unchanged(make_job(dump, steps=2, interval=2, io_engine=engine), pristine, CorruptCheckpointError,
                       problem)


def _flip_a_byte(step: str) -> str:
    """Flip the middle byte of the step's largest data file; returns the file."""
    file = max((os.path.join(step, f) for f in os.listdir(step) if f.endswith(".distcp")), key=os.path.getsize)
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return file


def test_a_flipped_byte_with_verify_on_load_changes_nothing(ckpt, pristine):
    dump, step, _ = ckpt
    file = _flip_a_byte(step)
    job = make_job(dump, steps=2, interval=2, verify_on_load=True, verify_fallback=False)
    _refused_unchanged(job, pristine, CorruptCheckpointError, f"{file}: CRC-32")


class _Saboteur(CheckedState):
    """A job's state whose check runs after the load checked everything and before it writes a
    tensor: armed with a step folder, it cuts the step's largest data file in half there, as a
    storage losing a file's end under a running load would; armed with a rank, it refuses its
    values on that rank only."""

    def __init__(self, cut: str | None = None, refuse_on: int | None = None):
        self.cut, self.refuse_on = cut, refuse_on

    def state_dict(self) -> dict:
        return {"armed": 1}

    def load_state_dict(self, state_dict: dict) -> None:
        pass

    def check_loaded(self, state_dict: dict) -> None:
        if self.cut:
            file = max((os.path.join(self.cut, f) for f in os.listdir(self.cut) if f.endswith(".distcp")),
                       key=os.path.getsize)
            os.truncate(file, os.path.getsize(file) // 2)
            self.cut = None
        if self.refuse_on is not None and torch.distributed.get_rank() == self.refuse_on:
            raise CorruptCheckpointError(f"saboteur: refused on rank {self.refuse_on}")


def _saved_with_saboteur(dump: str) -> str:
    job = make_job(dump, steps=4, interval=2, extra_states={"saboteur": _Saboteur()})
    job.run_to(2, steps=4)  # a full save: step 4 would be the last, model-only one
    job.manager.close()
    return os.path.join(dump, "checkpoint", "step-2")


def test_a_file_cut_while_it_is_read_leaves_the_job_refusing_to_save(tmp_path):
    dump = str(tmp_path / "dump")
    step = _saved_with_saboteur(dump)
    shutil.copytree(step, tmp_path / "intact")
    job = make_job(dump, steps=4, interval=2, extra_states={"saboteur": _Saboteur(cut=step)})
    partial = "failed after it had begun writing .*cut short.* do not train or save"
    with pytest.raises(PartialLoadError, match=partial) as half, within(60):
        job.manager.load()
    assert half.value.__cause__ is not half.value  # raised from itself: a walk of the causes never ended
    assert "cut short" in "".join(traceback.format_exception(half.value.__cause__))
    with pytest.raises(CheckpointError, match="save\\(4\\) refused: the job's state is not one step's"):
        job.manager.save(4, last_step=True)
    with pytest.raises(CheckpointError, match="every complete step in .* failed verification") as refused, within(60):
        job.manager.load()  # its file found shorter than its manifest says: nothing written, the job still half-loaded
    assert not isinstance(refused.value, PartialLoadError)
    with pytest.raises(CheckpointError, match="save\\(4\\) refused: the job's state is not one step's"):
        job.manager.save(4, last_step=True)
    shutil.rmtree(step)
    shutil.copytree(tmp_path / "intact", step)
    with within(60):
        assert job.manager.load()
    assert job.train_state.step == 2
    assert job.manager.save(4, last_step=True)
    job.manager.close()


def test_a_safetensors_file_cut_while_it_is_read_is_a_partial_load(tmp_path):
    from torchtitan_ckpt.example.model import FLAVORS, Transformer, hf_adapter
    from torchtitan_ckpt.hf import load_hf, save_hf

    torch.manual_seed(0)
    model = Transformer(FLAVORS["debugmodel"])
    save_hf(model.state_dict(), str(tmp_path), hf_adapter(model.args))
    file = next(str(p) for p in tmp_path.glob("*.safetensors"))
    with pytest.raises(PartialLoadError, match=f"loading {tmp_path} failed after .*{file} ends at byte"):
        load_hf(model.state_dict(), str(tmp_path), hf_adapter(model.args),
                check=lambda: os.truncate(file, os.path.getsize(file) // 2))


def _refused_on_two_ranks(rank: int, world_size: int, dump: str, case: str) -> None:
    if case == "one rank refuses":
        job = make_job(dump, steps=2, interval=2, extra_states={"saboteur": _Saboteur(refuse_on=1)})
        problem = "saboteur: refused on rank 1"
    else:
        job = make_job(dump, steps=2, interval=2, extra_states={"saboteur": _Saboteur()}, verify_on_load=True,
                       verify_fallback=False)
        problem = "CRC-32"
    before = _snapshot(job)
    with pytest.raises(CheckpointError, match=problem), within(60):
        job.manager.load()
    _unchanged(job, before)  # on rank 0 too, whose own checks passed
    job.manager.close()


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["one rank refuses", "a flipped byte with verify_on_load"])
def test_a_load_refused_on_one_of_two_ranks_changes_nothing_on_either(tmp_path, case):
    dump = str(tmp_path / "dump")
    step = _saved_with_saboteur(dump)
    if case != "one rank refuses":
        _flip_a_byte(step)
    spawn(2, _refused_on_two_ranks, dump, case)


def _metadata_bomb_on_two_ranks(rank: int, world_size: int, dump: str) -> None:
    job = make_job(dump, steps=2, interval=2, extra_states={"saboteur": _Saboteur()})
    with pytest.raises(CorruptCheckpointError, match=r"step-2/\.metadata.*unfold to more than"), within(60):
        job.manager.load()
    job.manager.close()


@pytest.mark.multirank
def test_a_metadata_pickle_bomb_is_refused_on_every_rank_from_rank_0s_scan(tmp_path):
    """Rank 0 scans the `.metadata` every rank read (the others compare digests): its refusal
    reaches both ranks, within the time limit, naming the file."""
    dump = str(tmp_path / "dump")
    step = _saved_with_saboteur(dump)
    with open(os.path.join(step, ".metadata"), "wb") as f:
        f.write(_shared_tuples(500))
    forged_whole(step)
    spawn(2, _metadata_bomb_on_two_ranks, dump)


# ---------------------------------------------------------------- 6. the commit marker


@pytest.mark.parametrize("field, value, problem", [
    ("files", {"../../outside.distcp": {"size": 1, "crc32": "00000000"}}, "outside the checkpoint folder"),
    ("files", {"/etc/passwd": {"size": 1, "crc32": "00000000"}}, "outside the checkpoint folder"),
    ("files", {"__0_0.distcp": {}}, r"files\['__0_0.distcp'\]"),
    ("files", {".//__0_0.distcp": {"size": 1, "crc32": "00000000"}}, r"files names '\.//__0_0.distcp', not as"),
    ("files", {"a": {"size": 1, "crc32": "00000000"}, "a/b": {"size": 1, "crc32": "00000000"}},
     r"files names 'a' both as a file and as the folder of 'a/b'"),
    ("files", {"a": {"size": 1, "crc32": "00000000"}, "a/b/c": {"size": 1, "crc32": "00000000"}},
     r"files names 'a' both as a file and as the folder of 'a/b/c'"),
    ("files", {"a\x00b": {"size": 1, "crc32": "00000000"}}, "which is not a file name"),
    ("files", {"x" * 300: {"size": 1, "crc32": "00000000"}}, r"longer than a file name can be"),
    ("files", None, "files is a NoneType"),
    ("states", [1], "states"),
    ("states", [""], "states"),
    ("step", "2", "step"),
    ("world_size", 0, "world_size"),
])
def test_a_crafted_marker_is_refused_by_verify_list_and_load(ckpt, capsys, field, value, problem):
    dump, step, sentinel = ckpt
    path = os.path.join(step, commit.MARKER)
    raw = json.loads(open(path).read())
    raw[field] = value
    open(path, "w").write(json.dumps(raw))
    with within(30):
        assert cli.main(["verify", step]) == 1  # a damaged step, as a damaged file of it is
    out = capsys.readouterr()
    assert out.out.startswith(f"CORRUPT {step}") and commit.MARKER in out.out and out.err == ""
    assert f"{zlib.crc32(SENTINEL):08x}" not in out.out + out.err  # the outside file was not read
    _listed_corrupt(step, capsys, problem)
    _refused(dump, f"{commit.MARKER}.*{problem}")
    _untouched(sentinel)


def test_names_from_a_checkpoint_reach_the_terminal_escaped(ckpt, capsys):
    """A manifest name with a newline and escape codes printed raw by `verify` faked an "ok" row;
    an index naming such a file printed it raw in the error of `inspect`."""
    _, step, _ = ckpt
    path = os.path.join(step, commit.MARKER)
    raw = json.loads(open(path).read())
    raw["files"]["x\nok      /all/fine\x1b[2K\x1b[1A"] = {"size": 1, "crc32": "00000000"}
    open(path, "w").write(json.dumps(raw))
    hf = os.path.join(os.path.dirname(step), "hf")
    os.makedirs(hf)
    index = os.path.join(hf, "model.safetensors.index.json")
    with within(30):
        assert cli.main(["verify", step]) == 1
        out = capsys.readouterr().out
        open(index, "w").write(json.dumps({"weight_map": {"w": "gone\x1b[31m\nerror: injected"}}))
        assert cli.main(["inspect", hf]) == 2
    err = capsys.readouterr().err
    assert "CORRUPT" in out and "\\nok      /all/fine\\x1b[2K" in out and "\x1b" not in out + err
    assert [line for line in out.splitlines() if line.startswith("ok")] == []
    assert "\\x1b[31m\\nerror: injected" in err and len(err.splitlines()) == 1


FORGED = "x\n[rank0] FAKE\x1b[2J\rY"
"""A name that, written raw, starts a log line of its own, clears the terminal and overwrites a line."""


def _forges(text: str) -> bool:
    return "\x1b" in text or "\r" in text or any(line.startswith("[rank0] FAKE") for line in text.splitlines())


def test_fields_of_a_checkpoint_reach_logs_errors_and_listings_escaped(ckpt, capsys, caplog):
    """A marker's CRC-32 text reached the ERROR of a corrupt step (`verify_on_load`) and the
    error raised, raw; a state's name of the marker, `list`'s contents column; a subfolder's
    name, `list`'s hint; an unknown config key, its `ConfigError`."""
    dump, step, _ = ckpt
    path = os.path.join(step, commit.MARKER)
    raw = json.loads(open(path).read())
    raw["files"][next(iter(raw["files"]))]["crc32"] = FORGED
    raw["states"].append(FORGED)
    open(path, "w").write(json.dumps(raw))
    with caplog.at_level(logging.INFO, logger="torchtitan_ckpt"), pytest.raises(CorruptCheckpointError) as fell:
        _load(dump, verify_on_load=True)
    told = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(told) == 1 and "the manifest says x\\n[rank0] FAKE\\x1b[2J\\rY" in told[0], told
    assert not _forges(told[0]) and "each is named above" in str(fell.value)
    with pytest.raises(CorruptCheckpointError) as fell:
        _load(dump, verify_on_load=True, verify_fallback=False)
    assert "x\\n[rank0] FAKE\\x1b[2J\\rY" in str(fell.value) and not _forges(str(fell.value))
    os.makedirs(os.path.join(dump, "a" + FORGED, "step-1"))  # the first subfolder holding steps
    with within(30):
        cli.main(["list", os.path.dirname(step)])
        cli.main(["inspect", step])
        cli.main(["list", dump])
    out = capsys.readouterr().out
    assert out.count("FAKE") == 2 and not _forges(out), out  # the contents column, the hint
    toml = os.path.join(dump, "job.toml")
    open(toml, "w").write(f"[checkpoint]\n{json.dumps(FORGED)} = 1\n")  # a TOML basic string is JSON's
    with pytest.raises(ConfigError) as fell:
        load_job_config(toml, [])
    assert "FAKE" in str(fell.value) and not _forges(str(fell.value))


def _listed_corrupt(step: str, capsys, problem: str) -> None:
    """`list` goes on past the step, listed as corrupt with the marker's problem (exit 1:
    nothing loadable)."""
    with within(30):
        assert cli.main(["list", "--json", os.path.dirname(step)]) == 1
    listed = json.loads(capsys.readouterr().out)["steps"]
    assert [s["status"] for s in listed] == ["corrupt"]
    assert re.search(f"{commit.MARKER}.*{problem}", listed[0]["problem"]), listed[0]["problem"]


def test_a_deeply_nested_marker_is_refused(ckpt, capsys):
    dump, step, _ = ckpt
    open(os.path.join(step, commit.MARKER), "w").write("[" * 100_000 + "]" * 100_000)
    with within(30):
        assert cli.main(["verify", step]) == 1
    assert f"{commit.MARKER} is not a valid commit marker: RecursionError" in capsys.readouterr().out
    _listed_corrupt(step, capsys, "RecursionError")
    _refused(dump, f"{commit.MARKER}.*RecursionError")


# ---------------------------------------------------------------- 7, 8. .metadata fields, chunk coverage


def _set(attr_path: str, value):
    def edit(md):
        entry = md.state_dict_metadata["norm.weight"]
        *parents, last = attr_path.split(".")
        for p in parents:
            entry = getattr(entry, p)
        setattr(entry, last, value)
    return edit


@pytest.mark.parametrize("edit, problem", [
    (_set("properties", None), "'norm.weight' has properties None"),
    (_set("size", [[64]]), "'norm.weight' has size"),
    (_set("chunks", []), "'norm.weight' of size \\[64\\] has chunks holding 0 of its 64 elements"),
    (_set("chunks", [ChunkStorageMetadata(torch.Size([0]), torch.Size([32]))]), "holding 32 of its 64"),
    (_set("chunks", [ChunkStorageMetadata(torch.Size([0]), torch.Size([32]))] * 2), "overlap"),
    (_set("chunks", [ChunkStorageMetadata(torch.Size([40]), torch.Size([32]))]), "outside its size"),
    (_set("properties.dtype", torch.uint1), "'norm.weight' has the dtype torch.uint1, which no tensor DCP writes"),
    (_set("properties.dtype", torch.qint8), "'norm.weight' has the dtype torch.qint8, which no tensor DCP writes"),
    (lambda md: setattr(md, "state_dict_metadata", None), "must be dicts"),
    (lambda md: md.state_dict_metadata.__setitem__(7, md.state_dict_metadata["norm.weight"]), "key 7"),
])
def test_malformed_metadata_is_refused_by_inspect_and_load(ckpt, capsys, edit, problem):
    dump, step, _ = ckpt
    _edit_metadata(step, edit)
    assert cli.main(["inspect", step]) == 2
    assert METADATA_FILE in capsys.readouterr().err
    _refused(dump, problem)


def test_a_dtype_the_item_does_not_have_is_refused(ckpt):
    """`convert` makes its tensors from `.metadata`'s dtypes: a float tensor declared bool was
    read into bool tensors, cast silently, and exported."""
    dump, step, _ = ckpt
    _edit_metadata(step, _set("properties.dtype", torch.bool))
    _refused(dump, "item 'norm.weight' .*holds torch.float32 values where the checkpoint's metadata says torch.bool")


def test_a_byte_item_longer_than_its_file_is_refused_naming_it(ckpt):
    dump, step, _ = ckpt

    def lengthen(md):  # moved past the file's other items, so that it shares no bytes with one
        index = _storage_of(md, "train_state.step")
        info = md.storage_data[index]
        end = max(i.offset + i.length for i in md.storage_data.values() if i.relative_path == info.relative_path)
        md.storage_data[index] = replace(info, offset=end, length=2**29)

    _edit_metadata(step, lengthen)
    _refused(dump, "item 'train_state.step' .*cut short")


@pytest.mark.parametrize("fqn, length, problem", [
    ("train_state.step", 2**40, r"entry 'train_state.step' is stored in 1099511627776 bytes, more than the "
                                r"1073741824 it can take"),
    ("output.weight", None, r"entry 'output.weight' has a chunk at \[0, 0\] stored in \d+ bytes, more than the "
                            r"\d+ it can take"),
], ids=["value", "tensor"])
def test_an_item_longer_than_its_entry_can_hold_is_refused_before_it_is_read(ckpt, fqn, length, problem):
    """An item's length comes from `.metadata`: one far past what the entry holds (a tensor's
    elements and 16 MiB of framing, a value at most 1 GiB) is refused, not read whole into
    memory (a length running into a sparse hole of the data file read 2 GiB, 4.4 GB resident)."""
    dump, step, _ = ckpt

    def lengthen(md):
        index = _storage_of(md, fqn)
        info = md.storage_data[index]
        md.storage_data[index] = replace(info, length=length or info.length + (32 << 20))

    _edit_metadata(step, lengthen)
    _refused(dump, problem)


def test_entries_sharing_bytes_are_refused_before_any_is_read(ckpt):
    """Every value entry pointed at the bytes of one (each read once per entry): a 12 MB step with a
    10 MB value peaked at 3.1 GB before a load failed."""
    dump, step, _ = ckpt

    def alias(md):
        first, *rest = [i for i in md.storage_data if i.fqn.startswith("train_state.")]
        for index in rest:
            md.storage_data[index] = md.storage_data[first]

    _edit_metadata(step, alias)
    _refused(dump, r"storage entries 'train_state\..*' and 'train_state\..*' share bytes of '__0_\d.distcp'")


@pytest.mark.parametrize("how", ["respelled", "linked"])
def test_entries_sharing_bytes_under_another_name_are_refused(ckpt, how):
    """`./x` or a link to `x` counted as another file, so the values all read one entry's bytes."""
    dump, step, _ = ckpt
    with open(os.path.join(step, METADATA_FILE), "rb") as f:
        first = min((i for i in pickle.load(f).storage_data if i.fqn.startswith("train_state.")), key=str)
    if how == "linked":
        with open(os.path.join(step, METADATA_FILE), "rb") as f:
            target = pickle.load(f).storage_data[first].relative_path
        os.symlink(target, os.path.join(step, "alias.distcp"))

    def alias(md):
        info = md.storage_data[first]
        other = "./" + info.relative_path if how == "respelled" else "alias.distcp"
        md.storage_data[next(i for i in md.storage_data if i.fqn.startswith("train_state.") and i != first)] = \
            replace(info, relative_path=other)

    _edit_metadata(step, alias)
    _refused(dump, r"not as DCP spells one" if how == "respelled" else r"share bytes of")


def _bounded_load(rank: int, world_size: int, dump: str, problem: str, headroom: int) -> None:
    """Load `dump` with the address space capped at `headroom` bytes past what the job holds:
    a buffer sized from the checkpoint, even one never touched, fails the cap before our check
    would have refused it, and the peak resident size may grow by a few MB only."""
    import resource

    job = make_job(dump, steps=2, interval=2, keep_latest_k=0)
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + headroom, resource.RLIM_INFINITY))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    with pytest.raises(CorruptCheckpointError, match=problem), within(60):
        job.manager.load()
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - peak
    assert grown < 64 << 20, f"the refused load grew the resident size by {grown >> 20} MiB"


def _out_to_dev_zero(md):
    index = _storage_of(md, "train_state.step")
    md.storage_data[index] = replace(md.storage_data[index], relative_path="/dev/zero", length=1 << 30)


def _long_loader(md):
    md.storage_data[_storage_of(md, "dataloader.dp_rank_0")].length = 2**40


def _long_byte_item(md):
    index = _storage_of(md, "train_state.step")
    md.storage_data[index] = replace(md.storage_data[index], length=2**40)


@pytest.mark.parametrize("edit, problem", [
    (_out_to_dev_zero, "outside the checkpoint folder"),
    (_long_loader, "dataloader.dp_rank_0"),
    (_long_byte_item, "'train_state.step' is stored in 1099511627776 bytes"),
])
def test_sizes_from_a_crafted_metadata_allocate_nothing_large(ckpt, edit, problem):
    """1 GiB from /dev/zero took the loader from 310 MB to 1.33 GB before the checks."""
    dump, step, _ = ckpt
    _edit_metadata(step, edit)
    spawn(1, _bounded_load, dump, problem, 512 << 20)


# ---------------------------------------------------------------- 9. a dangling symlink


def test_a_dangling_symlink_in_a_step_folder_breaks_neither_list_nor_load(ckpt):
    dump, step, _ = ckpt
    os.symlink("/nonexistent/file", os.path.join(step, "dangling"))
    assert cli.main(["list", os.path.dirname(step)]) == 0
    job = _load(dump)
    assert job.train_state.step == 2


# ---------------------------------------------------------------- 10. convert's config.json


@pytest.mark.parametrize("config, problem", [
    ("[1, 2]", "config.json = 'list': a config.json must hold a JSON object"),
    ({"num_attention_heads": 0}, "config.json: num_attention_heads = 0"),
    ({"hidden_size": "64"}, "config.json: hidden_size = '64'"),
    ({"vocab_size": 2**40}, "config.json: vocab_size = 1099511627776"),
    ({"num_hidden_layers": 10**7}, "config.json: num_hidden_layers = 10000000"),
])
def test_convert_to_dcp_refuses_a_hostile_config_before_writing(tmp_path, capsys, config, problem):
    from torchtitan_ckpt.example.model import FLAVORS, hf_config

    hf = tmp_path / "hf"
    hf.mkdir()
    text = config if isinstance(config, str) else json.dumps({**hf_config(FLAVORS["debugmodel"]), **config})
    (hf / "config.json").write_text(text)
    with within(30):
        assert cli.main(["convert", "--to", "dcp", str(hf), str(tmp_path / "out")]) == 2
    assert problem in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no output, not even a partial one


# ---------------------------------------------------------------- 11. consolidate's shards


def _shard(path, header: dict, sharding, data: bytes = b"\0" * 16) -> None:
    header = {**header, "__metadata__": {"DCP_SHARDING_INFO": json.dumps(sharding)}}
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("entry, sharding", [
    ({"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}, {"w": {"saved_offsets": [0]}}),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, {"w": {"saved_offsets": [0.5]}}),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, {"w": [0]}),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, [1]),
    ({"dtype": "F32", "shape": [-4], "data_offsets": [0, 0]}, {"w": {"saved_offsets": [0]}}),
    ({"dtype": "F32", "shape": [2**60], "data_offsets": [0, 8]}, {"w": {"saved_offsets": [0]}}),
])
def test_malformed_shards_are_refused_and_kept(tmp_path, entry, sharding):
    shards = tmp_path / "in"
    shards.mkdir()
    _shard(shards / "shard-00000-model-00001-of-00001.safetensors", {"w": entry}, sharding)
    with pytest.raises(C.InvalidShardsError, match="shard-00000-model-00001-of-00001.safetensors"), within(30):
        C.consolidate_safetensors(str(shards), str(tmp_path / "out"))
    assert os.listdir(shards) == ["shard-00000-model-00001-of-00001.safetensors"]
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_consolidate_keeps_its_input_unless_asked(tmp_path):
    shards = tmp_path / "in"
    shards.mkdir()
    _shard(shards / "shard-00000-model-00001-of-00001.safetensors", {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
           {"w": {"saved_offsets": [0]}})
    C.consolidate_safetensors(str(shards), str(tmp_path / "out"))
    assert os.listdir(shards) == ["shard-00000-model-00001-of-00001.safetensors"]
    C.consolidate_safetensors(str(shards), str(tmp_path / "out2"), remove_shards=True)
    assert not shards.exists()


def test_the_consolidate_command_keeps_its_input_unless_asked_and_refuses_bad_shards(tmp_path, capsys):
    shards = tmp_path / "in"
    shards.mkdir()
    _shard(shards / "shard-00000-model-00001-of-00001.safetensors", {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
           {"w": {"saved_offsets": [0]}})
    assert cli.main(["consolidate", str(shards), str(tmp_path / "out")]) == 0
    assert os.listdir(shards) == ["shard-00000-model-00001-of-00001.safetensors"]
    assert cli.main(["consolidate", "--remove-shards", str(shards), str(tmp_path / "out2")]) == 0
    assert not shards.exists()
    shards.mkdir()
    _shard(shards / "shard-00000-model-00001-of-00001.safetensors", {"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 0]}},
           {"w": {"saved_offsets": [0]}})
    with within(30):
        assert cli.main(["consolidate", str(shards), str(tmp_path / "out3")]) == 2
    assert "shard-00000-model-00001-of-00001.safetensors" in capsys.readouterr().err
    assert os.listdir(shards) == ["shard-00000-model-00001-of-00001.safetensors"]
    assert not any(name.startswith("out3") for name in os.listdir(tmp_path))  # no output, not even a partial one


# ---------------------------------------------------------------- 12. config values


@pytest.mark.parametrize("key, value", [
    ("checkpoint.hf_max_shard_size", "9" * 400),
    ("checkpoint.collective_timeout_s", "inf"),
    ("checkpoint.save_threads", str(2**62)),
    ("checkpoint.folder", "ck\0pt"),
    ("optimizer.lr", "nan"),
    ("training.max_norm", "nan"),
])
def test_config_values_out_of_bounds_name_their_key(key, value):
    with pytest.raises(ConfigError) as e:
        load_job_config(None, [f"--{key}", value])
    assert e.value.key == key


def test_a_deeply_nested_toml_is_a_config_error(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=rf"{path}.*nested too deeply"), within(30):
        load_job_config(path)


def test_a_huge_shard_size_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="hf_max_shard_size = '1111.*at most 2\\*\\*62 bytes"):
        validate_tree(Checkpoint(hf_max_shard_size="1" * 400 + "GB"))


# ---------------------------------------------------------------- small ones


def test_verify_needs_a_thread(ckpt, capsys):
    _, step, _ = ckpt
    with pytest.raises(SystemExit) as stopped:
        cli.main(["verify", step, "--threads", "0"])
    assert stopped.value.code == 2  # a usage error (docs/cli.md)
    assert "threads = 0: expected 1 to" in capsys.readouterr().err


def test_a_short_zip64_extra_field_is_not_a_struct_error():
    from torchtitan_ckpt.io import torch_archive

    with pytest.raises(torch_archive.UnrecognisedArchive, match="zip64"):
        torch_archive._zip64_fields(struct.pack("<HH", 1, 24) + b"\0" * 8, 0xFFFFFFFF, 0xFFFFFFFF, 0)


def test_async_with_pinned_mem_saves_from_a_script_without_a_main_guard(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch\n"
        "from torchtitan_ckpt import CheckpointManager\n"
        "from torchtitan_ckpt.config import Checkpoint\n"
        "print('top level ran', flush=True)\n"
        "m = CheckpointManager(Checkpoint(enable=True, async_mode='async_with_pinned_mem', interval=1),\n"
        "                      [torch.nn.Linear(4, 4)], base_folder=sys.argv[1])\n"
        "m.save(1, last_step=True)\n"
        "m.close()\n")
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("top level ran") == 1
    assert commit.is_committed(str(tmp_path / "checkpoint" / "step-1"))


@pytest.mark.parametrize("exports", [True, False])  # the note was once per process: [False] first hid it
def test_an_export_dtype_is_a_note_where_nothing_is_exported(tmp_path, caplog, exports):
    """Not where a periodic Hugging Face copy is cast to it (the note said it never applied)."""
    argv = ["--checkpoint.export_dtype", "bfloat16", "--checkpoint.last_save_model_only", "false",
            "--checkpoint.hf_export_interval", "5" if exports else "0"]
    with caplog.at_level("INFO"):  # the TOML's loading and the manager's making: said by either, it is heard
        config = load_job_config(None, argv).checkpoint
        CheckpointManager(config, torch.nn.Linear(2, 2), base_folder=tmp_path).close()
    assert config.export_dtype == "bfloat16"
    assert ("checkpoint.export_dtype = 'bfloat16' does not apply" in caplog.text) is not exports


# ---------------------------------------------------------------- Hugging Face files


def test_an_hf_index_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    from torchtitan_ckpt.hf.adapter import read_index

    os.mkfifo(tmp_path / "model.safetensors.index.json")
    with pytest.raises(CorruptCheckpointError, match="model.safetensors.index.json.* not a regular file"), within(30):
        read_index(str(tmp_path / "model.safetensors.index.json"))


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_a_safetensors_file_that_is_a_fifo_or_a_link_out_is_refused(tmp_path, kind):
    from torchtitan_ckpt.hf.safetensors_io import read_header

    folder = tmp_path / "hf"
    folder.mkdir()
    path = folder / "model-00001-of-00001.safetensors"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        (tmp_path / "outside.safetensors").write_bytes(SENTINEL)
        os.symlink(tmp_path / "outside.safetensors", path)
    refused = f"{path}.*(not a regular file|outside the checkpoint)"
    with pytest.raises(CorruptCheckpointError, match=refused), within(30):
        read_header(str(path))


# ---------------------------------------------------------------- 13. input that costs without bound


def _in_child(fn, seconds: int = 30) -> tuple[bool, str] | None:
    """What `fn()` raises in a forked child, as (whether it is a `CorruptCheckpointError`,
    "Type: message"), or None when it returns. The test fails when the child runs past
    `seconds`: hashing or printing in C is out of `within`'s reach, so a regression must not
    run in the test's own process. The child may map 1 GiB more than it inherits."""
    import multiprocessing
    import resource

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def run():
        with open("/proc/self/status") as f:
            mapped = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.RLIM_INFINITY))
        try:
            fn()
            send.send(None)
        except BaseException as e:
            send.send((isinstance(e, CorruptCheckpointError), f"{type(e).__name__}: {str(e)[:2000]}"))

    child = ctx.Process(target=run)
    child.start()
    try:
        if not receive.poll(seconds):
            pytest.fail(f"still running after {seconds} s")
        return receive.recv()
    finally:
        child.kill()
        child.join()


def _refused_in_child(fn, match: str) -> None:
    outcome = _in_child(fn)
    assert outcome is not None, "accepted"
    ours, message = outcome
    assert ours and re.search(match, message), message


def _shared_tuples(levels: int) -> bytes:
    """A pickle of {t: 1} where t = (t, t), `levels` times over, through the memo: a few bytes a
    level, and 2**levels steps to hash t."""
    out = bytearray(b"\x80\x02Nr" + struct.pack("<I", 0))  # None, memo 0
    for i in range(levels):  # (t_i, t_i), memo i + 1
        out += (b"j" + struct.pack("<I", i)) * 2 + b"\x86r" + struct.pack("<I", i + 1)
    return bytes(out + b"}j" + struct.pack("<I", levels) + b"K\x01s.")  # {t: 1}


def _deep_tuple(levels: int) -> bytes:
    """A pickle of {((((None,),),)...): 1}, the tuple `levels` deep (hashing it recurses in C)."""
    return b"\x80\x04}N" + b"\x85" * levels + b"K\x01s."


BOMBS = [(_shared_tuples(500), "unfold to more than"), (_deep_tuple(100_000), "nest more than 100 deep")]


@pytest.mark.parametrize("bomb, problem", BOMBS)
def test_a_metadata_pickle_that_costs_without_bound_is_refused_naming_the_file(tmp_path, bomb, problem):
    path = tmp_path / METADATA_FILE
    path.write_bytes(bomb)
    _refused_in_child(lambda: read_metadata(str(path)), rf"{path}: its pickle builds objects that {problem}")


def test_a_real_metadata_passes_the_pickle_check(tmp_path):
    """DCP's own writer and ours, a model's and an optimizer's tensors and plain values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata

    from torchtitan_ckpt.example.model import FLAVORS, Transformer

    model = Transformer(FLAVORS["debugmodel"])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "extra": {"step": 3, "name": "x"}}
    for name, writer in [("ours", storage.make_storage_writer), ("dcp", dcp.FileSystemWriter)]:
        dcp.save(state, storage_writer=writer(str(tmp_path / name)), no_dist=True)
        with within(30):
            assert isinstance(read_metadata(str(tmp_path / name / METADATA_FILE)), Metadata)


def _small_step(path: str, tensors: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, storage_writer=storage.make_storage_writer(path), no_dist=True)


def _load_small(path: str, state: dict) -> None:
    """Load `state` from the step `path` as the manager does: `.metadata` read and checked first."""
    try:
        metadata = read_metadata(os.path.join(path, METADATA_FILE))
        storage.load_on_this_rank(state, storage.make_storage_reader(path, metadata), storage.make_load_planner())
    except BaseException as e:  # DCP wraps a reader's failure in its CheckpointException
        raise storage.root_cause(e) from None


def _item_of(path: str, fqn: str) -> tuple[str, int, int]:
    md = read_metadata(os.path.join(path, METADATA_FILE))
    info = next(s for i, s in md.storage_data.items() if i.fqn == fqn)
    return os.path.join(path, info.relative_path), info.offset, info.length


def _raw_edit(path: str, edit) -> None:
    """Edit a small step's `.metadata` (our own test file: plain pickle)."""
    file = os.path.join(path, METADATA_FILE)
    with open(file, "rb") as f:
        md = pickle.load(f)
    edit(md)
    with open(file, "wb") as f:
        pickle.dump(md, f)


def _archive(records: list[tuple[str, bytes]]) -> bytes:
    """A zip of stored records, as `torch.save` frames an item."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in records:
            z.writestr(name, data)
    return buf.getvalue()


@pytest.mark.parametrize("bomb, problem", [(_shared_tuples(250), "unfold to more than"),
                                           (_deep_tuple(3000), "nest more than 100 deep")])
def test_a_tensor_header_pickle_that_costs_without_bound_is_refused_naming_the_file(tmp_path, bomb, problem):
    """The item's archive is replaced by one whose header pickle (`data.pkl`) is the bomb (small
    enough to be read with the item's first bytes)."""
    path = str(tmp_path / "step")
    _small_step(path, {"a": torch.ones(4), "w": torch.ones(4)})
    file, _, _ = _item_of(path, "w")
    crafted = _archive([("archive/data.pkl", bomb), ("archive/byteorder", b"little"), ("archive/data/0", b"\0" * 16)])
    at = os.path.getsize(file)
    with open(file, "ab") as f:
        f.write(crafted)

    def move(md):
        index = next(i for i in md.storage_data if i.fqn == "w")
        md.storage_data[index] = replace(md.storage_data[index], offset=at, length=len(crafted))

    _raw_edit(path, move)
    state = {"a": torch.zeros(4), "w": torch.zeros(4)}
    _refused_in_child(lambda: _load_small(path, state),
                      rf"{file}: item 'w' .*has a header pickle that builds objects that {problem}")


@pytest.mark.parametrize("bomb, problem", BOMBS)
@pytest.mark.parametrize("where", ["plain pickle", "archive", "archive torch.load reads"])
def test_value_pickles_that_cost_without_bound_are_refused(bomb, problem, where):
    """A dataloader's state (a plain pickle), a non-tensor value's archive, and one whose
    `data.pkl` is not its first record, which goes to `torch.load`."""
    from torchtitan_ckpt.io import torch_archive

    records = [("archive/data.pkl", bomb), ("archive/byteorder", b"little")]
    read = {"plain pickle": lambda: torch_archive.load_plain_pickle(bomb),
            "archive": lambda: torch_archive.load_plain(_archive(records)),
            "archive torch.load reads": lambda: torch_archive.load_plain(_archive(records[::-1]))}[where]
    _refused_in_child(read, rf"its pickle builds objects that {problem}")


def test_a_value_item_that_is_a_pickle_stream_is_not_handed_to_torch_load(tmp_path):
    """`torch.load` reads bytes that do not start as a zip as its legacy format: pickles."""
    path = str(tmp_path / "step")
    _small_step(path, {"n": 1, "w": torch.ones(4)})
    file, _, _ = _item_of(path, "n")
    at = os.path.getsize(file)
    with open(file, "ab") as f:
        f.write(BOMBS[0][0])

    def move(md):
        index = next(i for i in md.storage_data if i.fqn == "n")
        md.storage_data[index] = replace(md.storage_data[index], offset=at, length=len(BOMBS[0][0]))

    _raw_edit(path, move)
    state = {"n": None, "w": torch.zeros(4)}
    _refused_in_child(lambda: _load_small(path, state),
                      rf"{file}: item 'n' .*is not a readable torch.save archive \(no zip record at its start\)")


def test_a_metadata_file_larger_than_any_is_refused_unread(tmp_path):
    path = tmp_path / METADATA_FILE
    path.write_bytes(b"")
    os.truncate(path, MAX_METADATA_BYTES + 1)  # sparse: nothing on the disk
    with pytest.raises(CorruptCheckpointError, match=rf"{path} is {MAX_METADATA_BYTES + 1} bytes, more than"):
        read_metadata(str(path))


def test_a_dataloader_state_that_costs_without_bound_is_refused_naming_it(ckpt, pristine):
    dump, _, _ = ckpt
    _craft(dump, lambda state: state["dataloader"].__setitem__("dp_rank_0", _shared_tuples(24)))
    _refused_unchanged(make_job(dump, steps=2, interval=2), pristine, CorruptCheckpointError,
                       "dataloader.dp_rank_0 .*its pickle builds objects that unfold to more than")


def _shared_lists(levels: int) -> list:
    """A list whose repr is 2**levels long: each level holds the one below twice."""
    x: list = [0]
    for _ in range(levels):
        x = [x, x]
    return x


def _real_small_metadata(tmp_path):
    path = str(tmp_path / "small")
    _small_step(path, {"w": torch.ones(3), "n": 1})
    return path, read_metadata(os.path.join(path, METADATA_FILE))


@pytest.mark.parametrize("field, problem", [
    ("size", "'w' has size \\[\\[\\[\\["),
    ("properties.dtype", "'w' has properties TensorProperties\\(dtype="),
    ("chunks", "'w' has chunks \\("),
    ("chunks.0.offsets", "'w' has a chunk ChunkStorageMetadata\\(offsets="),
    ("storage.offset", "storage entry 'w' has offset \\[\\["),
])
def test_messages_about_crafted_values_stay_short(tmp_path, field, problem):
    """A value of the wrong type is shown by a bounded repr (its own is 2**40 long)."""
    from torchtitan_ckpt.dcp import validate

    path, md = _real_small_metadata(tmp_path)
    shared = _shared_lists(40)
    w = md.state_dict_metadata["w"]
    owner = {"size": w, "properties.dtype": w.properties, "chunks": w, "chunks.0.offsets": w.chunks[0],
             "storage.offset": next(s for i, s in md.storage_data.items() if i.fqn == "w")}[field]
    setattr(owner, field.rpartition(".")[2], (shared,) if field == "chunks" else shared)
    outcome = _in_child(lambda: validate.check_metadata(md, path, "crafted/.metadata"))
    assert outcome is not None and outcome[0] and re.search(problem, outcome[1]), outcome
    assert len(outcome[1]) < 1000


def test_a_storage_reference_of_a_crafted_value_stays_short():
    import io

    from torchtitan_ckpt.io import torch_archive

    with pytest.raises(torch_archive.UnrecognisedArchive, match=r"storage reference \[\[\[") as refused, within(30):
        torch_archive.HeaderUnpickler(io.BytesIO(b"")).persistent_load(_shared_lists(40))
    assert len(str(refused.value)) < 1000


def _chunks_metadata(size: list[int], chunks: list[tuple[list[int], list[int]]]):
    """Metadata of one float tensor 'w' of `size` in `chunks` (offsets, sizes), each with a
    storage entry."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (Metadata, MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)

    boxes = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), boxes)
    return Metadata({"w": entry}, storage_data={MetadataIndex("w", b.offsets): _StorageInfo("__0_0.distcp", i, 1)
                                                 for i, b in enumerate(boxes)})


def test_the_overlap_check_of_many_chunks_takes_about_their_number(tmp_path):
    """A [1, N] tensor in N [1, 1] chunks: the sweep along dimension 0 compared every pair."""
    from torchtitan_ckpt.dcp import validate

    n = 20_000
    md = _chunks_metadata([1, n], [([0, i], [1, 1]) for i in range(n)])
    with within(30):
        validate.check_metadata(md, str(tmp_path), "many/.metadata")
    md = _chunks_metadata([1, n], [([0, i], [1, 1]) for i in range(n - 2)] + [([0, n - 3], [1, 2])])
    with pytest.raises(CorruptCheckpointError, match=rf"'w' has chunks at \[0, {n - 3}\] and \[0, {n - 3}\] "
                                                     "that overlap"), within(30):
        validate.check_metadata(md, str(tmp_path), "many/.metadata")


@pytest.mark.parametrize("size, chunks, overlap", [
    ([6, 4], [([r, c], [2, 2]) for r in (0, 2, 4) for c in (0, 2)], False),  # a grid
    ([6, 4], [([0, 0], [1, 2]), ([1, 0], [5, 2]), ([0, 2], [4, 2]), ([4, 2], [2, 2])], False),  # rows sliced
    ([3, 3], [([0, 0], [2, 1]), ([0, 1], [1, 2]), ([1, 2], [2, 1]), ([2, 0], [1, 2]), ([1, 1], [1, 1])], False),
    ([2, 2, 2], [([i, j, 0], [1, 1, 2]) for i in (0, 1) for j in (0, 1)], False),
    ([4, 4], [([0, 0], [2, 4]), ([1, 0], [1, 4]), ([3, 0], [1, 4])], True),  # 16 elements held, row 1 twice
    ([3, 3], [([0, 0], [2, 1]), ([0, 1], [1, 2]), ([1, 2], [2, 1]), ([2, 0], [1, 2]), ([0, 0], [1, 1])], True),
])
def test_the_overlap_check_accepts_tilings_and_refuses_overlaps(tmp_path, size, chunks, overlap):
    """A grid, rows sliced within its blocks, a pinwheel (no straight cut splits it), 3-D."""
    from torchtitan_ckpt.dcp import validate

    md = _chunks_metadata(size, chunks)
    with contextlib.nullcontext() if not overlap else pytest.raises(CorruptCheckpointError, match="overlap"):
        validate.check_metadata(md, str(tmp_path), "tiles/.metadata")


def test_chunks_too_irregular_to_check_are_refused(tmp_path, monkeypatch):
    from torchtitan_ckpt.dcp import validate

    monkeypatch.setattr(validate, "MAX_CELLS", 4)
    md = _chunks_metadata([3, 3], [([r, c], [1, 1]) for r in range(3) for c in range(3)])
    problem = "'w' has 9 chunks whose edges cut it into 9 pieces, more than the 4 "
    with pytest.raises(CorruptCheckpointError, match=problem):
        validate.check_metadata(md, str(tmp_path), "grid/.metadata")


def test_a_transformed_storage_entry_is_refused_before_any_tensor_is_written(tmp_path):
    """It was read by DCP after every other tensor was written, and decompressed without bound."""
    path = str(tmp_path / "step")
    _small_step(path, {"a": torch.ones(4), "b": torch.ones(4)})

    def compress(md):
        index = next(i for i in md.storage_data if i.fqn == "a")
        md.storage_data[index] = replace(md.storage_data[index], transform_descriptors=["zstd"])

    _raw_edit(path, compress)
    state = {"a": torch.zeros(4), "b": torch.zeros(4)}
    with pytest.raises(CorruptCheckpointError, match=rf"{path}/.metadata: storage entry 'a' is stored through the "
                                                     r"transforms \['zstd'\]"), within(30):
        _load_small(path, state)
    assert not state["a"].any() and not state["b"].any()


@pytest.mark.parametrize("field, value", [
    ("size", [3]), ("size", (3,)), ("chunks.0.offsets", [0]), ("chunks.0.sizes", (3,)),
])
def test_sizes_and_offsets_must_be_torch_sizes(tmp_path, field, value):
    """A list passed the check and failed later in `.numel()` or in DCP with a bare error."""
    from torchtitan_ckpt.dcp import validate

    path, md = _real_small_metadata(tmp_path)
    w = md.state_dict_metadata["w"]
    setattr(w if field == "size" else w.chunks[0], field.rpartition(".")[2], value)
    with pytest.raises(CorruptCheckpointError, match="crafted/.metadata: entry 'w' has .*torch.Size"):
        validate.check_metadata(md, path, "crafted/.metadata")


def test_a_metadata_global_of_torch_is_checked_before_torch_is_asked_for_it(tmp_path, monkeypatch):
    """`getattr(torch, name)` runs torch's module `__getattr__`, which imports submodules."""
    asked = []
    monkeypatch.setattr(torch, "__getattr__", lambda name: asked.append(name) or None, raising=False)
    path = tmp_path / METADATA_FILE
    path.write_bytes(b"\x80\x02ctorch\nnot_a_dtype_but_a_lazy_module\n.")
    with pytest.raises(CorruptCheckpointError, match=rf"{path} references torch.not_a_dtype_but_a_lazy_module"):
        read_metadata(str(path))
    assert asked == []


def _read_sizes(monkeypatch) -> list[int]:
    """The sizes of the reader's `posio.read_bytes` calls, from now on."""
    from torchtitan_ckpt.io import posio

    sizes: list[int] = []
    real = posio.read_bytes
    monkeypatch.setattr(posio, "read_bytes", lambda fd, at, n: sizes.append(n) or real(fd, at, n))
    return sizes


def _central_entry(item: bytes, name: bytes) -> int:
    """Where the zip directory entry of record `name` starts in `item`."""
    at = item.rindex(name) - 46
    assert item[at : at + 4] == b"PK\x01\x02"
    return at


@pytest.mark.parametrize("claim", ["directory", "byteorder"])
def test_a_zip_directory_or_byteorder_record_claiming_the_item_is_not_read(tmp_path, monkeypatch, claim):
    """A 256 KiB tensor's archive whose zip directory, or byteorder record, claims most of it:
    they were read whole (then the whole item again, by torch.load)."""
    path = str(tmp_path / "step")
    _small_step(path, {"w": torch.ones(1 << 16)})
    file, offset, length = _item_of(path, "w")
    with open(file, "rb") as f:
        f.seek(offset)
        item = f.read(length)
    if claim == "directory":  # the end record (zip64's, which torch.save writes and its reader takes then)
        zip64 = item.rfind(b"PK\x06\x06")
        if zip64 >= 0:
            _patch(file, offset + zip64 + 40, struct.pack("<QQ", length - 22, 0))
        else:
            _patch(file, offset + length - 10, struct.pack("<II", length - 22, 0))
        problem = f"has a zip directory of {length - 22} bytes"
    else:  # the record's sizes in its directory entry
        _patch(file, offset + _central_entry(item, b"archive/byteorder") + 20, struct.pack("<II", 200_000, 200_000))
        problem = "has a byteorder record of 200000 bytes"
    sizes = _read_sizes(monkeypatch)
    with pytest.raises(CorruptCheckpointError, match=rf"{file}: item 'w' .*{problem}"), within(30):
        _load_small(path, {"w": torch.zeros(1 << 16)})
    assert max(sizes) <= 8192


@pytest.mark.parametrize("case", ["shorter than its chunk", "past the file's end", "over another entry"])
def test_convert_to_hf_checks_the_data_files_before_allocating(tmp_path, monkeypatch, case):
    """`.metadata` and the HF config agree on the model; the data file holds 4 KB."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (Metadata, MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)

    from torchtitan_ckpt.example.model import FLAVORS, hf_config
    from torchtitan_ckpt.hf import convert
    from torchtitan_ckpt.hf.files import RECORDED_CONFIG
    from torchtitan_ckpt.hf.model_config import read_hf_config
    from torchtitan_ckpt.hf.registry import adapter_for_config

    step = tmp_path / "step"
    step.mkdir()
    config = step / RECORDED_CONFIG
    config.write_text(json.dumps(hf_config(FLAVORS["debugmodel"])))
    shapes = adapter_for_config(read_hf_config(str(config)), None, None, str(config)).state_dict_shapes()
    (step / "__0_0.distcp").write_bytes(b"\0" * 4096)
    entries, places, at = {}, {}, 0
    for key, shape in shapes.items():
        chunk = ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))
        entries[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), [chunk])
        nbytes = 4 * math.prod(shape) + 1024
        length = {"shorter than its chunk": 8}.get(case, nbytes)
        start = 0 if case == "over another entry" else at
        places[MetadataIndex(key, chunk.offsets)] = _StorageInfo("__0_0.distcp", start, length)
        at += length
    if case == "over another entry":
        os.truncate(step / "__0_0.distcp", max(i.length for i in places.values()))  # sparse
    with open(step / METADATA_FILE, "wb") as f:
        pickle.dump(Metadata(entries, storage_data=places), f)
    monkeypatch.setattr(convert, "empty_state_dict", lambda *_: pytest.fail("tensors allocated before the check"))
    data = f"{step}/__0_0.distcp: "
    problem = {"shorter than its chunk": data + r"the chunk of '.*' at \[0.*\] holds \d+ bytes, but its storage "
                                                r"entry only 8",
               "past the file's end": data + r"the storage entry of '.*' claims bytes up to \d+ of its 4096",
               "over another entry": rf"{step}/{METADATA_FILE}: storage entries '.*' and '.*' share bytes of "
                                     "'__0_0.distcp'"}[case]
    with pytest.raises(CorruptCheckpointError, match=problem), within(30):
        convert.convert("hf", str(step), str(tmp_path / "out"))


def test_a_value_whose_bytes_hold_a_record_signature_loads_through_the_whole_archive():
    """A value's header pickle is cut at the first record signature after it; a value whose own
    bytes hold one (a zip, or an int written as those bytes) gives a cut-short pickle, which the
    scan calls malformed: such a value is read from its whole archive, each pickle record checked,
    not refused."""
    import io

    from torchtitan_ckpt.io import torch_archive

    value = {"blob": b"PK\x03\x04 a zip inside a value", "n": 67324752}
    buf = io.BytesIO()
    torch.save(value, buf)
    assert torch_archive.load_plain(buf.getvalue()) == value


def test_an_archive_with_two_records_of_one_name_is_refused():
    """Torch's zip reader could find either of two records named alike (case aside): the one
    the scan checked, or the other."""
    import io
    import zipfile

    from torchtitan_ckpt.io import torch_archive

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps(1))
        z.writestr("archive/DATA.pkl", pickle.dumps(2))
    with pytest.raises(torch_archive.MalformedArchive, match="two records named"):
        torch_archive.torch_load(buf.getvalue())


def _colliding_ints(n: int) -> bytes:
    """A pickle of {k * (2**61 - 1): 0 for k in 1..n}, written opcode by opcode (building the
    dict is what takes quadratic time): every key hashes to 0."""
    out = [b"\x80\x04}("]
    for k in range(1, n + 1):
        value = k * (2**61 - 1)
        key = value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)
        out += [b"\x8a" + bytes([len(key)]) + key, b"K\x00"]  # LONG1, BININT1
    return b"".join(out + [b"u."])


@pytest.mark.parametrize("where", ["metadata", "value", "set from a list"])
def test_a_pickle_whose_dict_keys_share_a_hash_is_refused_before_it_is_built(tmp_path, where):
    """0.84 MB of ints sharing one hash took 18 s to unpickle as `.metadata` (83 s at twice the
    size) and 36 s as a value, then loaded: quadratic in the pickle's size."""
    from torchtitan_ckpt.io import torch_archive

    bomb = _colliding_ints(20_000)
    path = tmp_path / METADATA_FILE
    path.write_bytes(bomb)
    as_set = pickle.dumps({k * (2**61 - 1) for k in range(1, 5001)}, protocol=2)  # set([...]), as torch.save does
    read = {"metadata": lambda: read_metadata(str(path)),
            "value": lambda: torch_archive.load_plain_pickle(bomb),
            "set from a list": lambda: torch_archive.load_plain_pickle(as_set)}[where]
    _refused_in_child(read, r"its pickle .* more than 4096 (keys|values) whose hashes it can choose")


def test_a_file_of_exactly_the_bound_is_read_and_one_byte_more_refused(tmp_path):
    from torchtitan_ckpt.io.safe_open import read_bounded

    path = tmp_path / "f.json"
    path.write_bytes(b"x" * 100)
    assert read_bounded(str(path), "a file", 100) == b"x" * 100
    with pytest.raises(CorruptCheckpointError, match="is larger than 99 bytes"):
        read_bounded(str(path), "a file", 99)


def test_check_pickle_edges_of_its_rules():
    """Rules no other test met at their edge: an object changed after another took it in; keys
    whose hashes a pickle chooses that fit in exactly 8 bytes; the length it returns is through
    STOP, not what follows."""
    from torchtitan_ckpt.io.untrusted import UnsafePickleError, check_pickle

    grown = b"\x80\x02]]q\x00ah\x00K\x01a0."  # outer = []; inner = []; outer.append(inner); inner.append(1)
    assert pickle.loads(grown) == [[1]]
    with pytest.raises(UnsafePickleError, match="changes an object after another object took it in"):
        check_pickle(grown, "x")
    eight = [b"\x80\x04}("]
    for k in range(4097):  # 2**62 + k: 8 bytes, beyond the hash's modulus
        eight += [b"\x8a\x08" + (2**62 + k).to_bytes(8, "little", signed=True), b"K\x00"]
    with pytest.raises(UnsafePickleError, match="more than 4096 keys whose hashes it can choose"):
        check_pickle(b"".join(eight + [b"u."]), "x")
    assert check_pickle(b"\x80\x02K\x01." + b"after", "x") == 5


def test_a_dict_of_many_tuple_keys_is_refused_and_of_small_ints_read():
    """Tuples hash from their items (a pickle can make many share one); distinct small ints never
    share one, and strings hash with a secret of the process."""
    from torchtitan_ckpt.io import torch_archive
    from torchtitan_ckpt.io.untrusted import MAX_CHOSEN_KEYS

    assert len(torch_archive.load_plain_pickle(pickle.dumps({i: (i, 0.5) for i in range(100_000)}))) == 100_000
    assert len(torch_archive.load_plain_pickle(pickle.dumps({(i, 0): 1 for i in range(MAX_CHOSEN_KEYS)}))) > 0
    with pytest.raises(CorruptCheckpointError, match="more than 4096 keys whose hashes it can choose"):
        torch_archive.load_plain_pickle(pickle.dumps({(i, 0): 1 for i in range(MAX_CHOSEN_KEYS + 1)}))


def test_metadata_storage_keys_that_share_a_hash_are_refused(tmp_path):
    """DCP's storage keys are objects of its own class, hashed from their name and offset: ones a
    file made share a hash are unpickled under a hash with a secret of the process (so building
    the dict costs no more than any other), then counted and refused."""
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    import itertools

    offsets = itertools.product([k * (2**61 - 1) for k in range(4)], repeat=4)  # each item hashes to 0
    storage_data = {MetadataIndex("w", torch.Size(offset)): None for offset in offsets}
    path = tmp_path / METADATA_FILE
    path.write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, storage_data=storage_data)))
    with pytest.raises(CorruptCheckpointError, match=rf"{path}: 256 storage keys share one hash"):
        read_metadata(str(path))


def test_a_storage_record_key_that_is_no_number_is_not_read_as_one():
    """`torch.save` numbers its records: a header naming another key (a lone surrogate, which
    pickle carries and no file name encodes) goes to the reader that checks the whole archive."""
    import io

    from torchtitan_ckpt.io import torch_archive

    buf = io.BytesIO()
    torch.save(torch.zeros(4), buf)
    _, pkl, _ = torch_archive.header_pickle(buf.getvalue())
    assert isinstance(torch_archive.unpickle_header(torch_archive.HeaderUnpickler, pkl)[0], torch_archive.SavedTensor)
    crafted = pkl.replace(b"X\x01\x00\x00\x000", b"X\x03\x00\x00\x00\xed\xa0\x80")
    assert crafted != pkl
    with pytest.raises(torch_archive.UnrecognisedArchive, match="storage reference"):
        torch_archive.unpickle_header(torch_archive.HeaderUnpickler, crafted)


@pytest.mark.parametrize("name, limit", [("COMMITTED.json", 64 << 20),
                                         ("model.safetensors.index.json", 64 << 20)])
def test_a_json_file_larger_than_any_real_one_is_refused_unread(tmp_path, name, limit):
    """A marker or index of a few real bytes and a sparse hole of GiBs was read whole (4.5 GB
    resident for 2 GiB)."""
    from torchtitan_ckpt.hf.adapter import read_index

    path = tmp_path / name
    path.write_bytes(b"{}")
    os.truncate(path, limit + 1)
    read = commit.read_marker if name == "COMMITTED.json" else lambda p: read_index(str(p / name))
    with pytest.raises(CorruptCheckpointError, match=rf"{name}: the .* is larger than {limit} bytes"):
        read(tmp_path)


def test_sizing_a_linked_step_never_walks_where_the_link_leads(tmp_path):
    """`list` sized a `step-N` link to `/` by walking the whole file system; a linked step counts
    its own files only, and a file removed meanwhile counts nothing."""
    from torchtitan_ckpt import layout

    target = tmp_path / "elsewhere"
    (target / "deep").mkdir(parents=True)
    (target / "data").write_bytes(b"x" * 10)
    (target / "deep" / "more").write_bytes(b"x" * 1000)
    (tmp_path / "step-9").symlink_to(target)
    assert layout.folder_bytes(str(tmp_path / "step-9")) == 10
    assert layout.folder_bytes(str(target)) == 1010


def test_an_optimizer_setting_of_another_kind_is_refused_naming_it(tmp_path):
    """A learning rate saved as text loaded, and the job's next optimizer step failed."""
    job = make_job(str(tmp_path), steps=4, interval=2, keep_latest_k=0)
    job.run_to(2, steps=4)
    job.opt.param_groups[0]["lr"] = "boom"
    job.opt.param_groups[0]["betas"] = (0.9, 0.95)
    assert job.manager.save(4)
    job.manager.close()
    _refused(str(tmp_path), r"optimizer.param_groups.\S+\.lr is 'boom', where this job's optimizer has 0.0\d+")
