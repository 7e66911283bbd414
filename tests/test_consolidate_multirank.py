"""Consolidation and one-pass export on real gloo ranks: bit-identical output on 2 and 3 ranks, with
fewer, as many and more files than ranks, DTensors sharded (unevenly) on dim 0 and dim 1, and one
failing rank failing every rank without leaving an index behind."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests.helpers import spawn
from tests.test_consolidate import assert_identical, read_output
from torchtitan_ckpt.hf import consolidate as C

pytestmark = pytest.mark.multirank


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "layers.0.w": torch.randn(5, 3, generator=g),                  # fp32, uneven dim-0
        "emb": torch.randn(4, 7, generator=g).bfloat16(),               # bf16, dim-1
        "ids": torch.randint(-10**12, 10**12, (9, 2), generator=g),     # int64, dim-0
        "mask": torch.rand(3, 5, generator=g) > 0.5,                    # bool, dim-1
        "norm": torch.randn(6, generator=g),                            # replicated DTensor
        "step": torch.tensor(11, dtype=torch.int64),                    # 0-dim, plain tensor
    }


SHARD_DIM = {"layers.0.w": 0, "emb": 1, "ids": 0, "mask": 1}


def sharded_state(world: int) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (world,))
    return {k: (distribute_tensor(t, mesh, [Shard(SHARD_DIM[k])]) if k in SHARD_DIM
                else distribute_tensor(t, mesh, [Replicate()]) if k == "norm" else t)
            for k, t in full_tensors().items()}


def mappings(world: int) -> dict[str, dict[str, int]]:
    names = sorted(full_tensors())
    return {f"{n}files": {k: i % n + 1 for i, k in enumerate(names)} for n in (world - 1, world, world + 2)}


def _every_mode(rank: int, world: int, root: str) -> None:
    state = sharded_state(world)
    told: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: told.append(record.getMessage())
    logging.getLogger(C.__name__).addHandler(handler)
    logging.getLogger(C.__name__).setLevel(logging.INFO)
    for label, mapping in mappings(world).items():
        shards, out, one = (os.path.join(root, f"{label}-{x}") for x in ("shards", "hf", "onepass"))
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(shards, fqn_to_index_mapping=mapping,
                                                                save_distributed=True))
        told.clear()
        C.consolidate_safetensors(shards, out, mapping, num_threads=2, all_ranks=label != "1files",
                                  remove_shards=True)
        if rank == 0:  # who copied the bytes: rank 0 alone, or every rank
            assert [m for m in told if m.startswith("consolidated")][0].split(" on ")[1].startswith(
                "rank 0 in" if label == "1files" else f"{world} ranks in"), told
        C.write_safetensors_one_pass(state, one, mapping, num_threads=2)
        dist.barrier()
        if rank == 0:
            for folder in (out, one):
                assert_identical(read_output(folder), full_tensors())
                assert len(os.listdir(folder)) == max(mapping.values()) + 1
            assert not os.path.exists(shards)


def test_three_ranks_bit_identical(tmp_path):
    spawn(3, _every_mode, str(tmp_path))


def _one_rank_fails(rank: int, world: int, root: str) -> None:
    state = sharded_state(world)
    shards = os.path.join(root, "shards")
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(shards, save_distributed=True))
    out = os.path.join(root, "hf")
    if rank == 1:
        def broken(fd, data, offset):
            raise OSError(28, "No space left on device")
        C.posio.write_all = broken  # this rank's disk is full (its own process)
    expected = OSError if rank == 1 else C.ConsolidationError
    with pytest.raises(expected, match="No space left"):
        C.consolidate_safetensors(shards, out)
    assert not os.path.exists(os.path.join(out, C.INDEX_FILE))
    assert len(os.listdir(shards)) == world  # shards are kept when the export failed
    name = sorted(os.listdir(shards))[1]  # read by rank 1
    if rank == 0:
        with open(os.path.join(shards, name), "r+b") as f:
            f.truncate(30)
    dist.barrier()
    with pytest.raises(C.InvalidShardsError, match=name if rank == 1 else f"rank 1: .*{name}"):
        C.consolidate_safetensors(shards, out)


def _two_ranks(rank: int, world: int, root: str) -> None:
    _every_mode(rank, world, os.path.join(root, "ok"))
    _one_rank_fails(rank, world, os.path.join(root, "failing"))


def test_two_ranks_bit_identical_and_a_failing_rank_fails_all(tmp_path):
    """One spawn for both: starting processes costs more here than the checks."""
    spawn(2, _two_ranks, str(tmp_path))
