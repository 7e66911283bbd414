"""Dedup policies on real HSDP saves over gloo: which files hold what, and exact reloads elsewhere.

One 4-rank run (a 2x2 mesh: ranks r and r+2 hold the same shards) and one 2-rank run (2x1: both
ranks hold everything) each save the same trained state with every policy and with DCP's default
planner, then load every checkpoint into plain FSDP on their own ranks; the 2-rank run also loads
the 4-rank checkpoints. The parent process reads every checkpoint whole (one rank).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.dcp import storage
from torchtitan_ckpt.dcp.metadata import METADATA_FILE, read_metadata
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.dcp.planner import DedupSavePlanner, PlanCache
from torchtitan_ckpt.states import ModelState, OptimizerState
from torchtitan_ckpt.example.train import build_model, shard_model

from .helpers import DEBUG_CONFIG, assert_same, data_file_use, read_checkpoint, spawn

pytestmark = pytest.mark.multirank

POLICIES = ("balanced", "lowest_rank", "replica_slices")
MIN_SLICE = 4096  # the debug model's 8-16 KB shards are sliced, its 128-256 B norms are not
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)


def _job(world_size: int, replicate: int):
    model = build_model(load_job_config(DEBUG_CONFIG))
    shard_model(model, world_size, replicate)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)


def _full_state(model, opt) -> dict:
    """Model and optimizer state as one rank-0 dict, keyed as the checkpoint keys them."""
    state = get_model_state_dict(model, options=FULL)
    optim = get_optimizer_state_dict(model, opt, options=FULL)
    return {**state, **{f"optimizer.{k}": v for k, v in optim.items()}}


def _poison(model, opt) -> None:
    """NaN in every parameter and optimizer value: a value the load misses fails the comparison."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
        for state in opt.state.values():
            for value in state.values():
                value.fill_(float("nan"))


def _same_on_every_replica(model, opt) -> None:
    """Give every replica the first replica's values. The policies write different ranks' copies
    of a replicated value, so comparing them with DCP's default needs replicas that are equal bit
    for bit; this makes it so instead of relying on the training step to (one CI run saw a
    policy's `tok_embeddings.weight` differ from the default's, not reproduced in 60 runs)."""
    group = model.tok_embeddings.weight.device_mesh.get_group("dp_replicate")
    first = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for p in model.parameters():
            for value in (p, *opt.state[p].values()):
                local = value.to_local() if isinstance(value, DTensor) else value
                dist.broadcast(local, src=first, group=group)


def _save_all(rank: int, world_size: int, root: str) -> None:
    """One training step on a 2 x (world_size / 2) HSDP mesh, saved with every planner."""
    model, opt = _job(world_size, 2)
    tokens = torch.randint(0, model.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(tokens).float().square().mean().backward()
    opt.step()  # so that the optimizer has moments to save
    _same_on_every_replica(model, opt)
    state = {**ModelState([model]).state_dict(), "optimizer": OptimizerState([model], [opt])}
    summaries = {}
    for name in (*POLICIES, "default"):
        planner = DefaultSavePlanner() if name == "default" else storage.make_save_planner(name, MIN_SLICE)
        dcp.save(state, storage_writer=storage.make_storage_writer(os.path.join(root, name)), planner=planner)
        if rank == 0 and name != "default":
            summaries[name] = [list(planner.summary.bytes_per_rank), planner.summary.replicated_files]
    full = _full_state(model, opt)
    if rank == 0:
        torch.save(full, os.path.join(root, "trained.pt"))
        with open(os.path.join(root, "summaries.json"), "w") as f:
            json.dump(summaries, f)


def _reload_all(rank: int, world_size: int, root: str, sources: list[str]) -> None:
    """Every policy's checkpoint from each of `sources`, loaded into plain FSDP by the manager."""
    model, opt = _job(world_size, 1)
    for source in sources:
        for name in POLICIES:
            _poison(model, opt)
            config = Checkpoint(enable=True, folder=os.path.join(root, "none"), initial_load_model_only=False,
                                initial_load_path=os.path.join(source, name))
            with CheckpointManager(config, [model], optimizers=opt) as manager:
                assert manager.load()
            full = _full_state(model, opt)
            if rank == 0:
                torch.save(full, os.path.join(root, f"loaded-{os.path.basename(source)}-{name}.pt"))


def _save_and_reload(rank: int, world_size: int, root: str, sources: list[str]) -> None:
    _save_all(rank, world_size, root)
    _reload_all(rank, world_size, root, sources)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, str]:
    two = str(tmp_path_factory.mktemp("2"))
    four = str(tmp_path_factory.mktemp("4"))
    spawn(4, _save_and_reload, four, [four])
    spawn(2, _save_and_reload, two, [two, four])
    return {2: two, 4: four}


def _metadata(path: str):
    return read_metadata(os.path.join(path, METADATA_FILE))


def _files(path: str) -> dict[str, dict[tuple, int]]:
    """Tensor key -> (chunk offsets) -> rank whose file holds that chunk."""
    md = _metadata(path)
    out: dict[str, dict[tuple, int]] = defaultdict(dict)
    for index, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata[index.fqn], TensorStorageMetadata):
            out[index.fqn][tuple(index.offset)] = int(re.match(r"__(\d+)_", info.relative_path).group(1))
    return out


def _bytes_per_rank(path: str, world_size: int) -> list[int]:
    """Tensor bytes in each rank's file, from the chunks the metadata records."""
    md = _metadata(path)
    loads = [0] * world_size
    for fqn, chunks in _files(path).items():
        tensor = md.state_dict_metadata[fqn]
        for chunk in tensor.chunks:
            loads[chunks[tuple(chunk.offsets)]] += chunk.sizes.numel() * tensor.properties.dtype.itemsize
    return loads


def _imbalance(loads: list[int]) -> float:
    return max(loads) * len(loads) / sum(loads)


@pytest.mark.parametrize("world_size", [2, 4])
def test_lowest_rank_writes_replicas_in_the_first_replicas_files(runs, world_size):
    files = _files(os.path.join(runs[world_size], "lowest_rank"))
    shards = world_size // 2  # the first replica is ranks 0 .. shards - 1
    assert {rank for chunks in files.values() for rank in chunks.values()} == set(range(shards))
    if world_size == 2:  # everything is replicated on both ranks: all of it in rank 0's file
        assert all(rank == 0 for chunks in files.values() for rank in chunks.values())


@pytest.mark.parametrize("world_size", [2, 4])
def test_balanced_is_even_in_tensor_bytes_and_at_least_as_even_as_dcp_default(runs, world_size):
    root = runs[world_size]
    ours = _bytes_per_rank(os.path.join(root, "balanced"), world_size)
    default = _bytes_per_rank(os.path.join(root, "default"), world_size)
    assert sum(ours) == sum(default)
    # in tensor bytes; the records of the values without rows, every rank's settings and steps,
    # are one rank's (test_values_without_rows_every_rank_reads_are_in_one_file)
    assert _imbalance(ours) <= 1.01 and max(ours) <= max(default), (ours, default)
    with open(os.path.join(root, "summaries.json")) as f:
        summaries = json.load(f)
    for name in POLICIES:  # the planner's own account is what lands in the files
        assert summaries[name][0] == _bytes_per_rank(os.path.join(root, name), world_size)
    assert summaries["lowest_rank"][1] == world_size // 2


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("policy", POLICIES)
def test_values_without_rows_every_rank_reads_are_in_one_file(runs, world_size, policy):
    """The optimizer's settings and steps (a few per parameter, every rank reads them all) were
    spread over every rank's file by `balanced` and `replica_slices`: each rank opened every
    rank's file on load."""
    md = _metadata(os.path.join(runs[world_size], policy))
    files = {info.relative_path for index, info in md.storage_data.items()
             if not isinstance(md.state_dict_metadata[index.fqn], TensorStorageMetadata)
             or not md.state_dict_metadata[index.fqn].size}
    assert len(files) == 1, files


@pytest.mark.parametrize("world_size", [2, 4])
def test_replica_slices_writes_large_shards_in_two_parts(runs, world_size):
    root = runs[world_size]
    default = _metadata(os.path.join(root, "default")).state_dict_metadata
    sliced = _metadata(os.path.join(root, "replica_slices")).state_dict_metadata
    files = _files(os.path.join(root, "replica_slices"))
    parts = 0
    for fqn, md in default.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        for chunk in md.chunks:
            start, rows = (chunk.offsets[0], chunk.sizes[0]) if chunk.sizes else (0, 1)
            inside = sorted((c for c in sliced[fqn].chunks
                             if not c.sizes or start <= c.offsets[0] < start + rows), key=lambda c: c.offsets)
            if chunk.sizes.numel() * md.properties.dtype.itemsize < 2 * MIN_SLICE:
                assert [(c.offsets, c.sizes) for c in inside] == [(chunk.offsets, chunk.sizes)]
                continue
            half = rows // 2
            assert [(c.offsets[0], c.sizes[0]) for c in inside] == [(start, half), (start + half, half)]
            shard = start // rows  # its two replicas write one part each
            assert {files[fqn][tuple(c.offsets)] for c in inside} == {shard, shard + world_size // 2}
            parts += 1
    # weights and both moments of: on 2 ranks everything but the norms (16 tensors); on 4, both
    # halves of the embeddings, output, wq, wo and MLP weights (24 shards; wk, wv halves are 4 KB)
    assert parts == {2: 3 * 16, 4: 3 * 24}[world_size]


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_policy_loads_back_exactly_on_1_2_and_4_ranks(runs, world_size):
    root = runs[world_size]
    trained = torch.load(os.path.join(root, "trained.pt"), weights_only=True)
    reference = read_checkpoint(os.path.join(root, "default"))
    assert_same({k: reference[k] for k in trained}, trained)
    for name in POLICIES:
        assert_same(read_checkpoint(os.path.join(root, name)), reference)  # 1 rank, in this process
        loaded_on = [2, 4] if world_size == 4 else [2]
        for ranks in loaded_on:
            path = os.path.join(runs[ranks], f"loaded-{os.path.basename(root)}-{name}.pt")
            loaded = torch.load(path, weights_only=True)
            assert_same(loaded, trained)


def test_hsdp_job_saves_through_the_manager_with_the_policy(tmp_path):
    """The example job on a 2x1 HSDP mesh: every save goes through the configured policy, and the
    manager logs bytes per rank and the files holding replicated tensors after each save."""
    from .helpers import run_job

    log = run_job(str(tmp_path), "--parallelism.data_parallel_replicate_degree", "2",
                  "--checkpoint.dedup_policy", "lowest_rank", "--training.steps", "10", nproc=2)
    lines = re.findall(r"step (\d+) dedup lowest_rank: .*replicated values in (\d+) file", log)
    assert [(int(s), int(n)) for s, n in lines] == [(5, 1), (10, 1)]  # interval save, last step
    step5 = os.path.join(tmp_path, "checkpoint", "step-5")
    files = {index.fqn: info.relative_path for index, info in _metadata(step5).storage_data.items()}
    # only rank 1's own dataloader position is not replicated; everything else is in rank 0's file
    assert files.pop("dataloader.dp_rank_1") == "__1_0.distcp"
    assert set(files.values()) == {"__0_0.distcp"}


class _Recording(DedupSavePlanner):
    """The planner under test, noting whether each local plan it produced was sent in full."""

    def __init__(self, sent: list[bool], cache: PlanCache):
        super().__init__("replica_slices", MIN_SLICE, cache)
        self._sent = sent

    def create_local_plan(self):
        plan = super().create_local_plan()
        self._sent.append(plan.usable)
        return plan


def _saves_with_a_plan_cache(rank: int, world_size: int, root: str) -> None:
    model, _ = _job(world_size, 2)  # 2 x 1: both ranks hold every tensor, replicas sliced between them
    cache, sent, planned, early = PlanCache(), [], [], []
    plan_afresh = default_planner.create_default_local_save_plan

    def counting_plan(*args, **kwargs):
        planned[-1] = True
        return plan_afresh(*args, **kwargs)

    default_planner.create_default_local_save_plan = counting_plan

    def save(name: str, extra: dict) -> tuple[dict, dict]:
        state = {**ModelState([model]).state_dict(), **extra}
        os.makedirs(os.path.join(root, name), exist_ok=True)  # the manager's prepare, which early writes need
        writer = storage.make_storage_writer(os.path.join(root, name))
        planned.append(False)
        planner = _Recording(sent, cache)
        writer.write_early(state, rank, world_size, cache)
        dcp.save(state, storage_writer=writer, planner=planner)
        early.append(writer.early_bytes)
        writer.fs.durable()
        # a reused local plan is the plan DCP makes of this state (guards the layout key against torch changes)
        fresh_plan = plan_afresh(planner.state_dict, planner.is_coordinator)
        assert dataclasses.replace(fresh_plan, planner_data=planner.mappings) == planner._local_plan, name
        values = {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone() for k, v in state.items()}
        return values, dict(extra)

    def bump() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)

    extra = {f"rank{rank}": torch.full((3,), float(rank))}
    saved = {"1": save("1", extra)}
    bump()
    saved["2"] = save("2", extra)  # same plans: nothing is planned or sent, the last global plan is reused
    bump()
    if rank == 1:
        extra["rank1.more"] = torch.arange(5.0)  # rank 1's plan changes; rank 0's cached one is used
    saved["3"] = save("3", extra)
    bump()
    saved["4"] = save("4", extra)
    bump()
    if rank == 0:
        extra["rank0"] = torch.full((4,), 7.0)  # same names, another shape: rank 0 must plan again
    saved["5"] = save("5", extra)
    assert sent == [True, False, rank == 1, False, rank == 0], sent
    assert planned == sent, planned
    # a rank whose layout is unchanged starts on what the last plan gave it before DCP plans (on
    # 2x1 replicas, nothing is written early without a plan); saves 3 and 5 replan those writes
    assert [n > 0 for n in early] == [not s for s in sent], early

    fresh, _ = _job(world_size, 2)
    for name, (values, extras) in saved.items():
        state = {**ModelState([fresh]).state_dict(), **{k: torch.full_like(v, float("nan")) for k, v in extras.items()}}
        dcp.load(state, storage_reader=storage.make_storage_reader(os.path.join(root, name)))
        for key, value in state.items():
            got = value.full_tensor() if hasattr(value, "full_tensor") else value
            assert torch.equal(got, values[key]), f"save {name}: {key}"


def test_an_unchanged_plan_is_reused_and_every_save_loads_back_exactly(tmp_path):
    spawn(2, _saves_with_a_plan_cache, str(tmp_path))


class _Rows:
    """A 2 x 3 tensor sharded by rows over 4 ranks: ranks 2 and 3 hold empty shards."""

    def __init__(self, mesh):
        self.mesh = mesh

    def state_dict(self):
        return {"g": distribute_tensor(torch.arange(6.0).reshape(2, 3), self.mesh, [Shard(0)])}

    def load_state_dict(self, state_dict):
        pass


def _empty_shards(rank: int, world_size: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    config = Checkpoint(enable=True, folder=root, interval=1, last_save_model_only=False)
    with CheckpointManager(config, torch.nn.Linear(2, 2), states={"x": _Rows(mesh)}) as manager:
        manager.save(1)  # the first save: pieces only this rank holds are written before DCP plans
    dist.barrier()
    step = os.path.join(root, "step-1")
    assert all(used == size for used, size in data_file_use(step).values()), data_file_use(step)
    state = {"x": {"g": torch.zeros(2, 3)}}
    dcp.load(state, checkpoint_id=step, no_dist=True)
    assert torch.equal(state["x"]["g"], torch.arange(6.0).reshape(2, 3))


def test_empty_shards_are_not_written_before_the_plan(tmp_path):
    """Two ranks' empty shards of one tensor are one chunk to DCP: neither writes it early, so no
    data file holds bytes the plan does not use."""
    spawn(4, _empty_shards, str(tmp_path))
