"""`dcp.load_plan` makes the local load plan DCP's own planner makes, item for item, on
checkpoints saved in chunks of many shapes (the overlaps of resharding), for plain tensors,
values and DTensors; a state it does not plan as DCP would is left to DCP's planner."""

from __future__ import annotations

import itertools

import torch
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   TensorProperties, TensorStorageMetadata)

from torchtitan_ckpt.dcp import load_plan

from .helpers import spawn


def _grid(size: tuple[int, ...], parts: tuple[int, ...]) -> list[ChunkStorageMetadata]:
    """`size` cut into `parts[d]` near-equal pieces along each dimension d (as shards are)."""
    cuts = []
    for n, k in zip(size, parts):
        step = -(-n // k)
        cuts.append([(start, min(step, n - start)) for start in range(0, n, step)])
    return [ChunkStorageMetadata(offsets=torch.Size([o for o, _ in piece]), sizes=torch.Size([s for _, s in piece]))
            for piece in itertools.product(*cuts)]


def _hinted(plan):
    return [(item, item.dest_index.index, item.storage_index.index) for item in plan.items]


def test_the_plan_is_dcps_item_for_item():
    grids = [(1, 1), (4, 1), (1, 3), (2, 2), (3, 5)]
    state, saved = {}, {}
    for layer in range(3):  # repeated layouts, as a model's layers are
        for g, parts in enumerate(grids):
            fqn = f"layers.{layer}.w{g}"
            state[fqn] = torch.zeros(12, 10)
            saved[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([12, 10]),
                                               _grid((12, 10), parts))
        state[f"layers.{layer}.bias"] = torch.zeros(7)
        saved[f"layers.{layer}.bias"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([7]),
                                                              _grid((7,), (layer + 1,)))
    state["step"], saved["step"] = 3, BytesStorageMetadata()
    state["scalar"] = torch.zeros(())
    saved["scalar"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([]), _grid((), ()))
    metadata = Metadata(state_dict_metadata=saved)
    assert load_plan.matches(state, metadata, state)
    ours = load_plan.local_load_plan(state, metadata)
    assert len(ours.items) > len(state)  # the grids' overlaps: several reads per tensor
    assert _hinted(ours) == _hinted(create_default_local_load_plan(state, metadata, True))


def test_a_state_unlike_the_checkpoint_is_left_to_dcp():
    size = torch.Size([4, 4])
    saved = {"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, _grid((4, 4), (2, 1))),
             "step": BytesStorageMetadata(), "other_rank": BytesStorageMetadata()}
    metadata = Metadata(state_dict_metadata=saved)
    state = {"w": torch.zeros(4, 4), "step": 1}
    assert load_plan.matches(state, metadata, state)  # another rank's value in the checkpoint
    assert _hinted(load_plan.local_load_plan(state, metadata)) == \
        _hinted(create_default_local_load_plan(state, metadata, True))
    assert not load_plan.matches({**state, "extra": 2}, metadata, None)  # not in the checkpoint
    assert not load_plan.matches({"w": torch.zeros(4, 5), "step": 1}, metadata, None)  # another size
    assert not load_plan.matches({"w": torch.zeros(4, 4), "step": torch.zeros(1)}, metadata, None)  # a tensor for a value
    assert not load_plan.matches({"w": 5, "step": 1}, metadata, None)  # a value for a tensor
    # torch 2.3 flattened a dict of values as one key: a checkpoint that has it is read that way
    nested = {"w": torch.zeros(4, 4), "step": 1, "opt": {"lr": 0.1}}
    flat = {"w": nested["w"], "step": 1, "opt.lr": 0.1}
    both = Metadata(state_dict_metadata={**saved, "opt.lr": BytesStorageMetadata()})
    assert load_plan.matches(flat, both, nested)
    older = Metadata(state_dict_metadata={**saved, "opt.lr": BytesStorageMetadata(), "opt": BytesStorageMetadata()})
    assert not load_plan.matches(flat, older, nested)
    # so flattened, this state has the key "a.b" twice, which DCP's planner refuses
    twice = {"a": {"b": {"x": 1}, "t": torch.zeros(1)}, "a.b": {"y": 2}}
    keys = {"a.b.x": 1, "a.t": twice["a"]["t"], "a.b.y": 2}
    more = Metadata(state_dict_metadata={"a.b.x": BytesStorageMetadata(), "a.b.y": BytesStorageMetadata(),
                                         "a.t": TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                                      torch.Size([1]), _grid((1,), (1,))),
                                         "other_rank": BytesStorageMetadata()})
    assert load_plan.matches(keys, Metadata(state_dict_metadata={k: v for k, v in more.state_dict_metadata.items()
                                                                 if k != "other_rank"}), twice)
    assert not load_plan.matches(keys, more, twice)


def _dtensors(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    size = torch.Size([6, 4])
    saved = {f"w{i}": TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, _grid((6, 4), (3, 1)))
             for i in range(3)}
    metadata = Metadata(state_dict_metadata=saved)
    state = {k: distribute_tensor(torch.zeros(size), mesh, [Shard(d)]) for k, d in zip(saved, (0, 1, 0))}
    assert load_plan.matches(state, metadata, state)
    assert _hinted(load_plan.local_load_plan(state, metadata)) == \
        _hinted(create_default_local_load_plan(state, metadata, True))
    partial = {**state, "w0": DTensor.from_local(torch.zeros(size), mesh, [Partial()])}
    assert not load_plan.matches(partial, metadata, partial)  # DCP's planner refuses it, with its message


def test_dtensor_shards_are_planned_as_dcp_does_on_two_ranks():
    spawn(2, _dtensors)
