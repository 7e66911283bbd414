"""A data loader's position (`states.DataLoaderState`) saved as TorchTitan saves it, a pickle
per data-parallel rank, and read back without running code from the checkpoint: a
`StatefulDataLoader` that shuffles holds its generator's state as a tensor, which `pickle.dumps`
writes with its storage in torch's legacy format."""

from __future__ import annotations

import io
import os
import pickle
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan_ckpt import CheckpointError, CheckpointManager
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.io import torch_archive

from .helpers import read_checkpoint

_DATA = list(range(100))


def _job(folder: str, seed: int, told_dp: bool = False) -> tuple[StatefulDataLoader, CheckpointManager]:
    """A shuffling loader (told its data-parallel rank, with `told_dp`) and a manager saving every
    third step."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(2, 2)
    loader = StatefulDataLoader(_DATA, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1234))
    if told_dp:
        loader.dp_rank, loader.dp_world_size = 0, 1
    return loader, CheckpointManager(Checkpoint(enable=True, interval=3), [model], dataloader=loader,
                                     base_folder=folder)


def _next_batch_after_three_steps(folder: str, told_dp: bool = False) -> list[int]:
    """The batch a job's loader gives after three, the third saved."""
    loader, manager = _job(folder, 0, told_dp)
    batches = iter(loader)
    for step in range(1, 4):
        next(batches)
        manager.save(step)
    manager.close()
    return next(batches).tolist()


def test_a_shuffling_stateful_dataloader_resumes_at_its_next_batch(tmp_path):
    """Its state held a tensor, and every load refused it as code ("Unsupported operand 149")."""
    expected = _next_batch_after_three_steps(str(tmp_path))
    loader, manager = _job(str(tmp_path), 1)
    assert manager.load()
    assert next(iter(loader)).tolist() == expected
    manager.close()


@pytest.mark.parametrize("saved, now", [(0, 2), (2, 0)])
def test_a_position_saved_with_other_worker_processes_is_refused_before_anything_is_loaded(tmp_path, saved, now):
    """A loader of another num_workers took the state and failed its first batch with
    torchdata's AssertionError ("State doesn't contain key '_snapshot' ..."), after the training
    state had loaded."""
    model = torch.nn.Linear(2, 2)
    config = Checkpoint(enable=True, interval=1)
    loader = StatefulDataLoader(_DATA, batch_size=4, num_workers=saved)
    batches = iter(loader)
    next(batches)
    with CheckpointManager(config, [model], dataloader=loader, base_folder=str(tmp_path)) as manager:
        manager.save(1)
    del batches
    fresh = torch.nn.Linear(2, 2)
    before = fresh.weight.clone()
    changed = StatefulDataLoader(_DATA, batch_size=4, num_workers=now)
    with CheckpointManager(config, [fresh], dataloader=changed, base_folder=str(tmp_path)) as manager, \
            pytest.raises(CheckpointError, match=rf"dataloader.dp_rank_0 was saved by a loader of num_workers = "
                                                 rf"{saved}, and this job's has num_workers = {now}: .* Set "
                                                 r"num_workers as saved, or add 'dataloader' to "
                                                 r"checkpoint.exclude_from_loading"):
        manager.load()
    assert torch.equal(fresh.weight, before)
    with CheckpointManager(replace(config, exclude_from_loading=["dataloader"]), [fresh], dataloader=changed,
                           base_folder=str(tmp_path)) as manager:
        assert manager.load()
    assert torch.equal(fresh.weight, model.weight) and len(next(iter(changed))) == 4


class _Position:
    """A loader whose state is its position."""

    def __init__(self, position: int):
        self.position = position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_a_loader_told_its_data_parallel_rank_is_saved_at_it(tmp_path):
    """A plain `StatefulDataLoader` given `dp_rank` and `dp_world_size` (ranks of one
    data-parallel rank under tensor parallelism share its data) was taken for TorchTitan's
    loader, its state saved as it was, and every load refused it as of another layout."""
    expected = _next_batch_after_three_steps(str(tmp_path), told_dp=True)
    assert {"dataloader.dp_rank_0", "dataloader.world_size"} <= set(
        read_checkpoint(str(tmp_path / "checkpoint" / "step-3")))
    loader, manager = _job(str(tmp_path), 1, told_dp=True)
    with manager:
        assert manager.load()
    assert next(iter(loader)).tolist() == expected


def test_a_loader_of_its_own_told_its_data_parallel_rank_resumes_and_a_stateful_one_of_another_layout_is_refused(
        tmp_path):
    """Any loader given `dp_rank` and `dp_world_size` but a plain `StatefulDataLoader` was taken
    for TorchTitan's, its state saved as it gave it: every step saved, and no load read it (a
    state of another layout). A loader of the user's own is given the layout; a
    `StatefulDataLoader` subclass of its own `state_dict()` not in it is refused at the save."""
    model = torch.nn.Linear(2, 2)
    saved = _Position(3)
    saved.dp_rank, saved.dp_world_size = 0, 1
    with CheckpointManager(Checkpoint(enable=True, interval=1), [model], dataloader=saved,
                           base_folder=str(tmp_path)) as manager:
        manager.save(1)
    fresh = _Position(0)
    fresh.dp_rank, fresh.dp_world_size = 0, 1
    with CheckpointManager(Checkpoint(enable=True), [model], dataloader=fresh, base_folder=str(tmp_path)) as manager:
        assert manager.load()
    assert fresh.position == 3

    class Epochs(StatefulDataLoader):
        def state_dict(self):
            return {"epoch": 2, "inner": super().state_dict()}

    loader = Epochs(_DATA, batch_size=4)
    loader.dp_rank, loader.dp_world_size = 0, 1
    with CheckpointManager(Checkpoint(enable=True, interval=1), [model], dataloader=loader,
                           base_folder=str(tmp_path / "epochs")) as manager:
        with pytest.raises(CheckpointError, match=r"taken to save TorchTitan's layout \('dp_rank_0' and 'world_size'.*"
                                                  r"its state is not in it \(\['epoch', 'inner'\]\): no load would read "
                                                  r"it, so it is not saved"):
            manager.save(1)


def test_a_dataloader_state_of_another_layout_is_refused_not_dropped(tmp_path):
    """It loaded with no error and the loader started from the beginning, with a warning that
    0 data-parallel ranks had saved it. The step holds it as an older torchtitan_ckpt saved it
    (`dataloader.rank_0`), not per data-parallel rank as TorchTitan does."""
    model = torch.nn.Linear(2, 2)
    older = str(tmp_path / "older")
    dcp.save({**model.state_dict(), "dataloader": {"rank_0": pickle.dumps({"position": 3})}}, checkpoint_id=older,
             no_dist=True)
    fresh = _Position(0)
    config = Checkpoint(enable=True, initial_load_path=older, initial_load_model_only=False)
    with CheckpointManager(config, [model], dataloader=fresh, base_folder=str(tmp_path)) as manager:
        with pytest.raises(CheckpointError, match=r"its dataloader state \('dataloader.rank_0'\) is not in TorchTitan's "
                                                  r"layout .*checkpoint.exclude_from_loading"):
            manager.load()
    assert fresh.position == 0
    with CheckpointManager(replace(config, exclude_from_loading=["dataloader"]), [model], dataloader=fresh,
                           base_folder=str(tmp_path)) as manager:
        assert manager.load()


class _Runs:
    """Unpickled, calls `os.mkdir(path)`: what a crafted checkpoint would run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


class _StorageAs:
    """Pickles as `torch.storage._load_from_bytes(archive)`, as a tensor's storage does."""

    def __init__(self, archive: bytes):
        self.archive = archive

    def __reduce__(self):
        return torch.storage._load_from_bytes, (self.archive,)


def _legacy(storage) -> bytes:
    f = io.BytesIO()
    torch.save(storage, f, _use_new_zipfile_serialization=False)
    return f.getvalue()


def test_a_tensor_in_a_plain_pickle_is_read_as_pickle_loads_reads_it():
    state = {"gen": torch.Generator().manual_seed(7).get_state(), "t": torch.arange(6.0).view(2, 3).t(),
             "empty": torch.zeros(0, dtype=torch.int64), "n": 3}
    got = torch_archive.load_plain_pickle(pickle.dumps(state))
    assert got.keys() == state.keys() and got["n"] == 3
    for k in ("gen", "t", "empty"):
        assert got[k].dtype == state[k].dtype and torch.equal(got[k], state[k])
    assert got["t"].stride() == (1, 3)


def _cut(archive: bytes) -> bytes:
    return archive[:-3]


def _longer(archive: bytes) -> bytes:
    return archive[:-8 - 5] + (2**40).to_bytes(8, "little") + archive[-5:]


@pytest.mark.parametrize("make", ["runs", "runs_inside", "cut", "longer"])
def test_a_crafted_storage_runs_nothing_and_allocates_nothing(tmp_path, make):
    """`pickle.loads` would call `torch.load(weights_only=False)` on a storage's bytes: here
    each of their pickles is checked and read with no globals but storage classes, and their
    length must be the bytes there are."""
    marker = str(tmp_path / "ran")
    archive = _legacy(torch.arange(5, dtype=torch.uint8).storage())
    archive = {"runs": lambda: pickle.dumps(_Runs(marker), protocol=2),
               "runs_inside": lambda: archive.replace(pickle.dumps(1001, protocol=2),
                                                      pickle.dumps(_Runs(marker), protocol=2)),
               "cut": lambda: _cut(archive), "longer": lambda: _longer(archive)}[make]()
    tensor = torch._utils._rebuild_tensor_v2
    data = pickle.dumps({"t": _Rebuilt(tensor, _StorageAs(archive))})
    with pytest.raises(pickle.UnpicklingError):
        torch_archive.load_plain_pickle(data)
    assert not os.path.exists(marker)


class _Rebuilt:
    """Pickles as a tensor of `size` and `stride` over the storage `storage` pickles as."""

    def __init__(self, rebuild, storage, size=(5,), stride=(1,)):
        self.rebuild, self.storage, self.size, self.stride = rebuild, storage, size, stride

    def __reduce__(self):
        return self.rebuild, (self.storage, 0, self.size, self.stride, False, {})


class _Ref:
    """Pickles as torch's legacy persistent id of a storage."""

    def __init__(self, numel: int, key: str):
        self.pid = ("storage", torch.ByteStorage, key, "cpu", numel, None)


def _pid_pickle(ref: _Ref) -> bytes:
    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return obj.pid if isinstance(obj, _Ref) else None

    out = io.BytesIO()
    Pickler(out, protocol=2).dump(ref)
    return out.getvalue()


class _PidUnpickler(pickle.Unpickler):
    def persistent_load(self, pid):  # a method: Python 3.13's unpickler refuses setting the attribute
        return pid


def _with_decoy(archive: bytes) -> bytes:
    """The legacy archive with its storage reference preceded by a decoy of 10**12 elements that
    the pickle names, then drops (POP): torch's reader sizes both."""
    f = io.BytesIO(archive)
    for _ in range(3):
        pickle.load(f)
    start = f.tell()
    pid = _PidUnpickler(f).load()
    decoy = _pid_pickle(_Ref(10**12, "2"))
    body = decoy[:-1] + pickle.POP + _pid_pickle(_Ref(pid[4], pid[2]))[2:]
    return archive[:start] + body + archive[f.tell():]


def test_a_storage_archive_naming_a_second_storage_is_refused():
    archive = _legacy(torch.arange(5, dtype=torch.uint8).storage())
    assert torch.equal(torch_archive.load_plain_pickle(pickle.dumps(_Rebuilt(
        torch._utils._rebuild_tensor_v2, _StorageAs(archive)))), torch.arange(5, dtype=torch.uint8))
    data = pickle.dumps({"t": _Rebuilt(torch._utils._rebuild_tensor_v2, _StorageAs(_with_decoy(archive)))})
    with pytest.raises(pickle.UnpicklingError):
        torch_archive.load_plain_pickle(data)


def test_an_archive_named_many_times_is_one_storage():
    """Each `_load_from_bytes` made a copy: a 27 KB pickle held 32 MB in 2000 storages."""
    archive = _legacy(torch.zeros(4096, dtype=torch.uint8).storage())  # one bytes object, named 200 times
    data = pickle.dumps([_Rebuilt(torch._utils._rebuild_tensor_v2, _StorageAs(archive), (4096,)) for _ in range(200)])
    got = torch_archive.load_plain_pickle(data)
    assert len(got) == 200 and len({t.untyped_storage().data_ptr() for t in got}) == 1


def test_a_view_of_more_elements_than_its_storage_holds_is_refused():
    archive = _StorageAs(_legacy(torch.zeros(4, dtype=torch.uint8).storage()))
    data = pickle.dumps(_Rebuilt(torch._utils._rebuild_tensor_v2, archive, (2**60,), (0,)))
    with pytest.raises(pickle.UnpicklingError):
        torch_archive.load_plain_pickle(data)
