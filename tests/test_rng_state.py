"""`RngState`: each rank's generators saved and given back, a crafted entry refused before any
generator or tensor of the job is touched."""

from __future__ import annotations

import logging
import os
import random
import struct

import numpy as np
import pytest
import torch

from torchtitan_ckpt import Checkpoint, CheckpointManager, CorruptCheckpointError, RngState

from .helpers import spawn


def _draws() -> tuple:
    """Something of each generator, the Gaussian caches included (each leaves one pending)."""
    return (torch.rand(3).tolist(), random.random(), random.gauss(0, 1), np.random.rand(2).tolist(),
            np.random.standard_normal())


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _resumed(folder: str, saved: object) -> None:
    """Save `saved` as the state `rng` and draw; seed afresh and load into an `RngState`: it draws
    the same."""
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(Checkpoint(enable=True, interval=1), [model], states={"rng": saved},
                           base_folder=folder) as manager:
        manager.save(1)
        uninterrupted = _draws()
    _seed(7)
    with CheckpointManager(Checkpoint(enable=True, interval=1), [model], states={"rng": RngState()},
                           base_folder=folder) as manager:
        assert manager.load()
        assert _draws() == uninterrupted


def test_a_resumed_job_draws_what_an_uninterrupted_one_would(tmp_path):
    _seed(1)
    random.gauss(0, 1), np.random.standard_normal()  # a cached second value pending in each
    _resumed(str(tmp_path), RngState())


class _Crafted:
    """A state saved under the name the RNG state loads: its entry of the RNG's own layout, with
    `bad` laid over it."""

    def __init__(self, bad: dict):
        self.bad = bad

    def state_dict(self) -> dict:
        entry = RngState().state_dict()
        for path, value in self.bad.items():
            *parents, last = path.split(".")
            node = entry["rank_0"]
            for p in parents:
                node = node[p]
            node[last] = value
        return entry

    def load_state_dict(self, state_dict: dict) -> None:
        raise AssertionError("never loaded")


@pytest.mark.parametrize("bad, said", [
    ({"python.state": b"\0" * 624 * 4 + struct.pack("<I", 9999)}, r"rank_0.python.state ends with the index 9999"),
    ({"python.state": b"\0" * 12}, r"rank_0.python.state is 12 bytes, not 2500"),
    ({"python.version": 2}, r"rank_0.python.version is 2, not 3"),
    ({"python.gauss": float("inf")}, r"rank_0.python.gauss is inf"),
    ({"numpy.pos": 5000}, r"rank_0.numpy: pos 5000"),
    ({"numpy.cached_gaussian": float("nan")}, r"rank_0.numpy: .*cached_gaussian nan"),
    ({"numpy.keys": torch.zeros(624, dtype=torch.int64)},
     r"holds a value where this job has a tensor, or the other way round, for \[.rng.rank_0.numpy.keys.\]"),
    ({"torch": b"\0" * 16}, r"rank_0.torch is not a cpu generator's state"),
    ({"torch": bytes(5056)}, r"rank_0.torch is not a cpu generator's state"),
], ids=["index", "words", "version", "gauss", "pos", "nan", "tensor", "short", "zeros"])
def test_a_crafted_entry_is_refused_before_the_job_changes(tmp_path, bad, said):
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(Checkpoint(enable=True, interval=1), [model], states={"rng": _Crafted(bad)},
                           base_folder=str(tmp_path)) as manager:
        manager.save(1)
    fresh = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    _seed(3)
    expected = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    with CheckpointManager(Checkpoint(enable=True, interval=1), [fresh], states={"rng": RngState()},
                           base_folder=str(tmp_path)) as manager:
        with pytest.raises(CorruptCheckpointError, match=said):
            manager.load()
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    assert torch.equal(torch.get_rng_state(), expected[0]) and random.getstate() == expected[1]
    assert (np.random.get_state()[1] == expected[2]).all()


def _per_rank(rank: int, world_size: int, folder: str, saving: bool) -> None:
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(Checkpoint(enable=True, interval=1), [model], states={"rng": RngState()},
                           base_folder=folder) as manager:
        if saving:
            _seed(10 + rank)
            manager.save(1)
            torch.save(_draws(), os.path.join(folder, f"draws-{rank}.pt"))
            return
        _seed(99)
        said: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("torchtitan_ckpt").addHandler(handler)
        assert manager.load()
        assert _draws() == torch.load(os.path.join(folder, f"draws-{rank}.pt"))
        if world_size == 1:  # rank 1's generators stay in the step, said
            assert any("holds 9 entries of the job's own states that no rank loads" in m and "rng.rank_1." in m
                       for m in said), said


def test_a_step_saved_with_a_cuda_generator_loads_on_a_host_without(tmp_path):
    """Its CUDA part is left (this host has no such generator); the others are set."""
    _seed(4)
    _resumed(str(tmp_path), _Crafted({"cuda": bytes(16)}))


def _in_a_subgroup(rank: int, world_size: int, folder: str) -> None:
    import torch.distributed as dist

    group = dist.new_group([1])  # a manager of rank 1 alone
    if rank == 1:
        _seed(21)
        with CheckpointManager(Checkpoint(enable=True, interval=1), [torch.nn.Linear(2, 2)],
                               states={"rng": RngState(group)}, process_group=group, base_folder=folder) as manager:
            manager.save(1)
            torch.save(_draws(), os.path.join(folder, "draws.pt"))
    dist.barrier()


def _alone(rank: int, world_size: int, folder: str) -> None:
    _seed(0)
    with CheckpointManager(Checkpoint(enable=True, interval=1), [torch.nn.Linear(2, 2)],
                           states={"rng": RngState()}, base_folder=folder) as manager:
        assert manager.load()
        assert _draws() == torch.load(os.path.join(folder, "draws.pt"))


@pytest.mark.multirank
def test_a_manager_on_a_subgroup_keys_the_generators_by_the_rank_in_it(tmp_path):
    """Rank 1 of the world, alone in its manager's group, saves `rank_0`: a job of one rank
    resumes it (keyed by the world's rank, it was refused as lacking `rank_0`)."""
    spawn(2, _in_a_subgroup, str(tmp_path))
    spawn(1, _alone, str(tmp_path))


@pytest.mark.multirank
def test_each_rank_gets_its_own_generators_back(tmp_path):
    """Two ranks seeded apart draw apart; each resumes its own streams, on 2 ranks and on 1."""
    spawn(2, _per_rank, str(tmp_path), True)
    spawn(2, _per_rank, str(tmp_path), False)
    spawn(1, _per_rank, str(tmp_path), False)
