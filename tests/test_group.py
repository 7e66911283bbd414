"""`CheckpointGroup.run` on real ranks: every rank hears of every failure, and decides alike."""

from __future__ import annotations

import pytest

from torchtitan_ckpt.errors import RankFailed
from torchtitan_ckpt.group import CheckpointGroup

from .helpers import spawn


def _failing(rank: int, world_size: int) -> None:
    group = CheckpointGroup()

    def fn() -> int:
        if rank == 1:
            raise KeyError("w")
        return rank

    with pytest.raises(RankFailed) as one:  # rank 1 alone fails: rank 0 names it
        group.run(fn)
    assert one.value.rank == 1 and "KeyError" in one.value.kinds
    assert (one.value.error is None) == (rank == 0)

    def both() -> None:
        raise (ValueError if rank == 0 else KeyError)("x")

    with pytest.raises(RankFailed) as two:  # each rank describes its own failure, kinds of all
        group.run(both)
    assert two.value.rank == rank
    assert {"ValueError", "KeyError", "LookupError"} <= set(two.value.kinds)
    assert group.run(lambda: rank * 10) == [0, 10]


def test_every_rank_gets_the_kinds_of_every_failure():
    spawn(2, _failing)


def test_a_group_without_a_cpu_backend_is_refused_at_start(tmp_path):
    """Checkpoint collectives exchange CPU objects (from background threads too): a group whose
    backend serves only GPU tensors (TorchTitan's NCCL world, here a real gloo group made for
    CUDA tensors only) is refused when the manager's group is made, naming what to pass."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"serves only \['cuda'\] tensors.*new_group\(backend='gloo'\)"):
            CheckpointGroup(dist.new_group(backend="cuda:gloo"))
        assert CheckpointGroup(dist.new_group(backend="gloo")).world_size == 1
    finally:
        dist.destroy_process_group()


def test_one_off_calls_on_a_gpu_only_default_group_share_one_gloo_group(tmp_path):
    """`load_hf` and `save_hf` without a group, under a default group that carries only GPU
    tensors: one gloo group is made for them the first time and kept (not one per call)."""
    import torch.distributed as dist

    from torchtitan_ckpt.group import cpu_world

    dist.init_process_group("cuda:gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        first = cpu_world()
        assert first is not dist.group.WORLD and first is cpu_world()
        assert CheckpointGroup(first).all_gather("x") == ["x"]
    finally:
        dist.destroy_process_group()
