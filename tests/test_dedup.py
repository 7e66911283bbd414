"""Dedup policies on hand-made layouts, against DCP's own dedup, and the planner without a process group."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from torchtitan_ckpt import ConfigError
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.dcp.planner import DedupSavePlanner, layout_key, layout_of, writers_of
from torchtitan_ckpt.policy.dedup import (
    Item,
    Write,
    balanced,
    lowest_rank,
    make_policy,
    replica_slices,
    summarize,
)
from torchtitan_ckpt.dcp.storage import make_save_planner
from torchtitan_ckpt.example.parallel import ParallelDims

# rank 0 alone holds x, rank 2 alone c; a, b and the scalar s are replicated
LAYOUT = [
    {"a": Item(100, 10), "x": Item(50, 5), "s": Item(4)},
    {"a": Item(100, 10), "b": Item(60, 6), "s": Item(4)},
    {"b": Item(60, 6), "c": Item(10, 1), "s": Item(4)},
]


def _ranks(assignment: dict) -> dict:
    return {k: [(w.rank, w.rows) for w in ws] for k, ws in sorted(assignment.items())}


def test_lowest_rank():
    assert _ranks(lowest_rank(LAYOUT)) == {
        "a": [(0, None)], "b": [(1, None)], "c": [(2, None)], "s": [(0, None)], "x": [(0, None)]}
    assert summarize(LAYOUT, lowest_rank(LAYOUT), "lowest_rank").bytes_per_rank == (154, 60, 10)


def test_balanced_counts_unshared_bytes_and_places_largest_first():
    # own bytes 50, 0, 10; a (100) -> rank 1, b (60) -> rank 2 (10 < 100), s -> rank 0 (50 is least)
    assert _ranks(balanced(LAYOUT)) == {
        "a": [(1, None)], "b": [(2, None)], "c": [(2, None)], "s": [(0, None)], "x": [(0, None)]}
    summary = summarize(LAYOUT, balanced(LAYOUT), "balanced")
    assert summary.bytes_per_rank == (54, 100, 70)
    assert (summary.replicated_files, summary.max_files_to_load) == (3, 3)


def test_balanced_ties_go_to_the_lower_rank_whatever_the_order():
    keys = ["d", "b", "a", "c"]
    layout = [{k: Item(8, 2) for k in keys}, {k: Item(8, 2) for k in reversed(keys)}]
    expected = {"a": [(0, None)], "b": [(1, None)], "c": [(0, None)], "d": [(1, None)]}
    assert _ranks(balanced(layout)) == expected
    shuffled = [dict(random.Random(seed).sample(sorted(r.items()), len(r))) for seed, r in enumerate(layout)]
    assert _ranks(balanced(shuffled)) == expected


@pytest.mark.parametrize("policy, settings_rank", [
    (balanced, 0),  # rank 0: p0, 8 + 1300 B; rank 1: w whole, 400 + 1300
    (functools.partial(replica_slices, min_slice_bytes=1), 1)])  # w halved: 0 writes 1308 + 1500, 1 1500
def test_values_without_rows_held_by_the_same_ranks_go_to_one_file(policy, settings_rank):
    """Optimizer settings (one per parameter and setting) are read by every rank holding them:
    spread over the ranks' files (as they were), every rank opened every rank's file on load.
    They go together to the least loaded of their holders once the tensors are placed."""
    settings = {f"h{i}": Item(0) for i in range(6)}
    stages = [{**settings, "w": Item(400, 4), "p0": Item(8, 1)}, {**settings, "w": Item(400, 4)},
              {"s1": Item(0), "s2": Item(0)}, {"s1": Item(0), "s2": Item(0), "p3": Item(16, 2)}]
    writers = {key: [w.rank for w in ws] for key, ws in policy(stages).items()}
    assert {k: writers[k] for k in settings} == {k: [settings_rank] for k in settings}
    assert (writers["s1"], writers["s2"]) == ([2], [2])  # rank 3 writes p3


def test_replica_slices_splits_large_tensors_rows_among_holders():
    assignment = replica_slices(LAYOUT, min_slice_bytes=10)
    # a: 100 >= 2 * 10 -> rows 0-5 / 5-10; b likewise; s has no rows; then s is placed as balanced
    # does, on bytes 50 + 50, 50 + 30, 10 + 30
    assert _ranks(assignment) == {
        "a": [(0, range(0, 5)), (1, range(5, 10))], "b": [(1, range(0, 3)), (2, range(3, 6))],
        "c": [(2, None)], "s": [(2, None)], "x": [(0, None)]}
    assert summarize(LAYOUT, assignment, "replica_slices").bytes_per_rank == (100, 80, 44)


def test_replica_slices_uneven_rows_small_and_short_tensors():
    layout = [{"w": Item(7 * 8, 7), "small": Item(40, 10), "row": Item(1000, 1)} for _ in range(3)]
    assignment = make_policy("replica_slices", min_slice_bytes=15)(layout)
    assert _ranks(assignment) == {
        "w": [(0, range(0, 2)), (1, range(2, 4)), (2, range(4, 7))],  # 56 >= 3 * 15: sliced
        "row": [(0, None)],  # fewer rows than replicas: whole, to the least loaded (rank 0, 16 B)
        "small": [(1, None)],  # 40 < 3 * 15: whole; rank 1 has 16 B, rank 0 has 1016 B
    }


def test_make_policy_rejects_unknown_names():
    with pytest.raises(ValueError, match="expected one of balanced, lowest_rank, replica_slices"):
        make_policy("random", 1 << 20)


# ----------------------------------------------------------------------------- against DCP's dedup


def _write_item(fqn: str, size: tuple, offsets: tuple, sizes: tuple, dtype=torch.float32) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    props = TensorProperties(dtype=dtype)
    return WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD if size != sizes else
                     WriteItemType.TENSOR, tensor_data=TensorWriteData(chunk, props, torch.Size(size)))


def _hsdp_plans(shapes: dict[str, tuple], replicate: int, shard: int, unique: int = 0) -> list[SavePlan]:
    """FSDP2-style dim-0 shards over `shard` ranks, the same shards on each of `replicate` replicas,
    a replicated 0-dim `step` per tensor, and `unique` bytes that only each rank holds."""
    plans = []
    for rank in range(replicate * shard):
        s = rank % shard
        items = []
        for fqn, shape in shapes.items():
            per = -(-shape[0] // shard)
            start = min(s * per, shape[0])
            rows = min(per, shape[0] - start)
            items.append(_write_item(fqn, shape, (start, *[0] * (len(shape) - 1)), (rows, *shape[1:])))
            items.append(_write_item(f"step.{fqn}", (), (), ()))
        if unique:
            items.append(_write_item(f"dataloader.{rank}", (unique,), (0,), (unique,), torch.uint8))
        plans.append(SavePlan(items))
    return plans


def _llama(vocab: int, dim: int, layers: int) -> dict[str, tuple]:
    shapes = {"tok_embeddings.weight": (vocab, dim), "output.weight": (vocab, dim), "norm.weight": (dim,)}
    for i in range(layers):
        for name, shape in [("wq", (dim, dim)), ("wk", (dim // 2, dim)), ("wv", (dim // 2, dim)),
                            ("wo", (dim, dim)), ("w1", (3 * dim, dim)), ("w2", (dim, 3 * dim)),
                            ("w3", (3 * dim, dim)), ("attention_norm", (dim,)), ("ffn_norm", (dim,))]:
            shapes[f"layers.{i}.{name}.weight"] = shape
    return shapes


def _replicated(world: int, seed: int) -> list[SavePlan]:
    """Plain tensors every rank holds (DDP-style), of random row counts, in state-dict order."""
    rng = random.Random(seed)
    shapes = {f"p{i}": (rng.randint(1, 1000), 64) for i in range(40)}
    return [SavePlan([_write_item(f, s, (0, 0), s) for f, s in shapes.items()]) for _ in range(world)]


def _late_unique(world: int) -> list[SavePlan]:
    """Replicated tensors first, then a large value only rank 0 holds: DCP's dedup, which walks the
    plans in order, has already spread the replicated bytes when it meets it."""
    plans = _replicated(world, seed=7)
    plans[0].items.append(_write_item("buffer.rank0", (2000, 64), (0, 0), (2000, 64)))
    return plans


LAYOUTS = {
    "hsdp 2x1": _hsdp_plans(_llama(256, 64, 2), 2, 1),
    "hsdp 2x2": _hsdp_plans(_llama(2048, 256, 4), 2, 2, unique=1 << 16),
    "hsdp 2x3 uneven": _hsdp_plans(_llama(1001, 96, 3), 2, 3),
    "hsdp 4x1": _hsdp_plans(_llama(32000, 128, 2), 4, 1),
    "ddp 4 ranks": _replicated(4, seed=0),
    "ddp 3 ranks": _replicated(3, seed=1),
    "late unique 2 ranks": _late_unique(2),
}
# two embeddings hold 90% of the bytes: whole tensors cannot spread over 4 ranks, slices can
UNEVEN = {"hsdp 4x1"}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_balanced_is_at_least_as_even_as_dcp_default(name):
    plans = LAYOUTS[name]
    layout = layout_of(plans)
    default = summarize(layout, writers_of(dedup_save_plans(plans)), "default").imbalance
    ours = summarize(layout, balanced(layout), "balanced").imbalance
    assert ours <= default
    if name in UNEVEN:
        assert ours > 1.5
        assert summarize(layout, replica_slices(layout, 1 << 20), "replica_slices").imbalance <= 1.05
    else:
        assert ours <= 1.05


def test_dcp_default_is_uneven_where_balanced_is_not():
    plans = LAYOUTS["late unique 2 ranks"]
    layout = layout_of(plans)
    assert summarize(layout, writers_of(dedup_save_plans(plans)), "default").imbalance > 1.1
    assert summarize(layout, balanced(layout), "balanced").imbalance < 1.001


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lowest_rank_puts_replicated_values_in_fewest_files(name):
    layout = layout_of(LAYOUTS[name])
    summary = summarize(layout, lowest_rank(layout), "lowest_rank")
    groups = 1 if name.startswith("ddp") or name.startswith("late") else int(name.split("x")[1][0])
    assert summary.replicated_files == groups  # one file per shard position: its first replica's


# ----------------------------------------------------------------------------- the planner


def test_planner_writes_each_rank_its_slices():
    """Two ranks holding the same plain tensors, planned as DCP does, without a process group."""
    state = {"w": torch.arange(40.0).reshape(10, 4), "b": torch.arange(3.0), "step": torch.tensor(7.0)}
    planners = [make_save_planner("replica_slices", min_slice_bytes=16) for _ in range(2)]
    for rank, planner in enumerate(planners):
        planner.set_up_planner(state, is_coordinator=rank == 0)
    global_plan, metadata = planners[0].create_global_plan([p.create_local_plan() for p in planners])
    # w (160 B >= 2 * 16) in halves; then b (12 B, whole) to rank 0 and step to rank 1: 92 / 84 B
    assert metadata.state_dict_metadata["w"].chunks == [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([5, 4])),
        ChunkStorageMetadata(torch.Size([5, 0]), torch.Size([5, 4]))]
    written = {}
    for rank, planner in enumerate(planners):
        for item in planner.finish_plan(global_plan[rank]).items:
            written[(item.index.fqn, rank)] = planner.resolve_data(item)
    assert sorted(written) == [("b", 0), ("step", 1), ("w", 0), ("w", 1)]
    assert torch.equal(written[("w", 0)], state["w"][:5]) and torch.equal(written[("w", 1)], state["w"][5:])
    assert planners[0].summary.bytes_per_rank == (92, 84)
    assert planners[0].summary_line() == (
        "dedup replica_slices: 176 B of tensors written by 2 ranks, the busiest 92 B (max/mean 1.045); "
        "replicated values in 2 files, a rank reloads its own from up to 2 files")


def test_summary_line_is_known_only_after_planning():
    with pytest.raises(RuntimeError, match="coordinator"):
        DedupSavePlanner("lowest_rank", 1 << 20).summary_line()


def test_writers_of_reads_whole_writes():
    plans = dedup_save_plans(_replicated(2, seed=3), save_to_lowest_rank=True)
    assert set(w for ws in writers_of(plans).values() for w in ws) == {Write(0)}


# ----------------------------------------------------------------------------- the HSDP mesh shape


def _parallelism(replicate: int, shard: int):
    return load_job_config(None, ["--parallelism.data_parallel_replicate_degree", str(replicate),
                                  "--parallelism.data_parallel_shard_degree", str(shard)])


@pytest.mark.parametrize("world,replicate,shard,shape", [
    (4, 2, -1, (2, 2)), (4, 1, -1, (1, 4)), (2, 2, -1, (2, 1)), (4, 2, 2, (2, 2)), (1, 1, -1, (1, 1))])
def test_mesh_shape(world, replicate, shard, shape):
    dims = ParallelDims.from_config(_parallelism(replicate, shard).parallelism, world)
    assert (dims.dp_replicate, dims.dp_shard) == shape


@pytest.mark.parametrize("world,replicate,shard,key", [
    (4, 3, -1, "parallelism.data_parallel_replicate_degree"),
    (4, 2, 4, "parallelism.data_parallel_shard_degree"),
    (2, 1, 1, "parallelism.data_parallel_shard_degree")])
def test_mesh_shape_that_does_not_fit_the_ranks(world, replicate, shard, key):
    with pytest.raises(ConfigError) as e:
        ParallelDims.from_config(_parallelism(replicate, shard).parallelism, world)
    assert e.value.key == key and str(world) in str(e.value)


def test_layout_key_changes_with_what_the_plan_depends_on_not_with_values():
    state = {"w": torch.zeros(4, 2), "step": 3, "b": torch.ones(2, requires_grad=True)}
    key = layout_key(state)
    assert layout_key({"w": torch.randn(4, 2), "step": 9, "b": torch.full((2,), 5.0, requires_grad=True)}) == key
    for changed in ({"w": torch.zeros(2, 4)}, {"w": torch.zeros(4, 2, dtype=torch.float64)},
                    {"b": torch.ones(2)}, {"step2": 3}):
        assert layout_key({**state, **changed}) != key, changed
    assert layout_key(dict(reversed(state.items()))) != key  # the plan lists items in this order


class _Subclass(torch.Tensor):
    pass


def test_layout_key_gives_up_on_values_that_plan_themselves():
    assert layout_key({"w": torch.zeros(2).as_subclass(_Subclass)}) is None

    class Custom:
        def __create_write_items__(self, fqn, obj):
            return []

    assert layout_key({"w": torch.zeros(2), "c": Custom()}) is None
