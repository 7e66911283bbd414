"""Every mesh the example job builds, on 4 real gloo ranks: each layout trains, saves, resumes on
its own layout with the losses of an uninterrupted run, and its step loads on every other layout
of the same model and on 1 rank with every tensor equal to what was saved and to what PyTorch's
own `dcp.load` (`FileSystemReader`) reads from the folder.

One 4-rank spawn for the whole matrix (a process start costs more than a layout's saves and
loads): each saved layout, then the loads on the other layouts, each mesh built in turn; rank 0
reports what differs per saved layout, and each is its own test."""

from __future__ import annotations

import filecmp
import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.tensor import DTensor

from torchtitan_ckpt import CheckpointManager, layout
from torchtitan_ckpt.example.config import JobConfig, load_job_config
from torchtitan_ckpt.example.data import build_dataloader
from torchtitan_ckpt.example.model import FLAVORS, hf_adapter
from torchtitan_ckpt.example.parallel import ParallelDims, pipeline_parts
from torchtitan_ckpt.example.train import Run, TrainState, build_model, build_run, train_steps
from torchtitan_ckpt.dcp import load_plan, storage
from torchtitan_ckpt.dcp.storage import dtensor_chunk
from torchtitan_ckpt.hf import load_hf, save_hf
from torchtitan_ckpt.hf.load import read_hf_layout
from torchtitan_ckpt.states import ModelState, OptimizerState

from .helpers import RecordedReads, data_file_use, spawn

pytestmark = pytest.mark.multirank

DENSE, MOE = "debugmodel_mesh", "qwen3_moe_debug"
LAYOUTS = {
    "fsdp4": (),
    "hsdp2x2": ("--parallelism.data_parallel_replicate_degree", "2"),
    "tp2_fsdp2": ("--parallelism.tensor_parallel_degree", "2"),
    "tp4": ("--parallelism.tensor_parallel_degree", "4"),
    # the dense model: two stages (model parts) per rank; the MoE one has 2 layers, one stage each
    "pp2_fsdp2": ("--parallelism.pipeline_parallel_degree", "2"),
    "ep2_fsdp2": ("--parallelism.expert_parallel_degree", "2"),
    # 3-D meshes, loaded on only
    "pp2_tp2": ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"),
    "hsdp2_ep2": ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.expert_parallel_degree", "2"),
}
SAVED_ON = {DENSE: ("fsdp4", "hsdp2x2", "tp2_fsdp2", "tp4", "pp2_fsdp2"), MOE: ("ep2_fsdp2",)}
MODEL_LAYOUTS = {DENSE: (*SAVED_ON[DENSE], "pp2_tp2"), MOE: ("ep2_fsdp2", "fsdp4", "hsdp2x2", "pp2_fsdp2", "hsdp2_ep2")}
"""The layouts of each model: the MoE flavor has per-head q/k norms, so no tensor parallelism."""


def _config(folder: str, flavor: str, name: str | None, *extra: str) -> JobConfig:
    interleaved = ("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B") \
        if name == "pp2_fsdp2" and flavor == DENSE else ()
    return load_job_config(None, [
        "--job.dump_folder", folder, "--model.flavor", flavor, "--training.steps", "4",
        "--training.local_batch_size", "2", "--training.seq_len", "8", "--checkpoint.enable", "true",
        "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0",
        "--checkpoint.last_save_model_only", "false", *(LAYOUTS[name] if name else ()), *interleaved, *extra])


def _full(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _gathered(run: Run) -> dict[str, Any] | None:
    """Rank 0: the whole model and optimizer state of every rank's parts, flattened to the
    checkpoint's keys, as full tensors (None on the other ranks)."""
    state = {**ModelState(run.parts).state_dict(),
             "optimizer": OptimizerState(run.parts, run.optimizers).state_dict()}
    flat, _ = flatten_state_dict(state)
    mine = {k: _full(flat[k]) for k in sorted(flat)}  # full_tensor: the same order on a mesh's ranks
    mine = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in mine.items()}
    if not dist.is_initialized() or run.dims.world_size == 1:
        return mine
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()} if dist.get_rank() == 0 else None


def _all_ranks(found: Any) -> list[Any]:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, found)
    return every


def _differences(expected: dict[str, Any], got: dict[str, Any], what: str) -> list[str]:
    """What differs, bit for bit (dtype included), one line per key."""
    if sorted(got) != sorted(expected):
        return [f"{what}: keys {sorted(set(got) ^ set(expected))[:5]} are on one side only"]
    return [f"{what}: {key} differs" for key, value in expected.items()
            if not (value.dtype == got[key].dtype and torch.equal(value, got[key]) if isinstance(value, torch.Tensor)
                    else value == got[key])]


def _torch_reads(path: str, keys: list[str]) -> dict[str, Any]:
    """What PyTorch's own reader loads from the step folder, for `keys`."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype)
             if isinstance(metadata[k], TensorStorageMetadata) else None for k in keys}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return state


def _with_manager(config: JobConfig, run: Run, rank: int, fn, **kw) -> Any:
    tc = config.training
    loader = build_dataloader(FLAVORS[config.model.flavor].vocab_size, tc.seq_len, tc.local_batch_size, tc.seed, run.dims.dp_rank(rank), run.dims.dp)
    train_state = TrainState()
    with CheckpointManager(config.checkpoint, run.parts, optimizers=run.optimizers, lr_schedulers=run.schedulers,
                           dataloader=loader, states={"train_state": train_state},
                           base_folder=config.job.dump_folder, **kw) as manager:
        return fn(manager, loader, train_state)


def _train_and_resume(rank: int, world_size: int, folder: str, flavor: str, name: str) -> tuple[Any, list[str]]:
    """Train 3 steps (saving step 2), then resume a new run from step 2; the loss of step 3
    must be the same bits. Returns the state as of step 2 and the differences (rank 0)."""
    config = _config(folder, flavor, name)
    run = build_run(config, world_size, rank, torch.device("cpu"))

    def straight(manager, loader, train_state):
        batches = iter(loader)
        train_steps(config, run, batches, train_state, manager, 2)
        saved = _gathered(run)
        return saved, train_steps(config, run, batches, train_state, manager, 3)

    saved, rest = _with_manager(config, run, rank, straight)
    config = _config(folder, flavor, name, "--checkpoint.load_step", "2")  # the seed is the data's too
    resumed = build_run(config, world_size, rank, torch.device("cpu"))

    def resume(manager, loader, train_state):
        assert manager.load() and train_state.step == 2
        return train_steps(config, resumed, iter(loader), train_state, manager, 3)

    pairs = [None] * world_size
    dist.all_gather_object(pairs, (rest, _with_manager(config, resumed, rank, resume)))
    wrong = [f"{name}: rank {r} resumed with losses {b}, not {a}" for r, (a, b) in enumerate(pairs) if a != b]
    return saved, wrong


def _load_on(config: JobConfig, world_size: int, rank: int, group: Any = None) -> dict[str, Any] | None:
    run = build_run(config, world_size, rank, torch.device("cpu"))
    with CheckpointManager(config.checkpoint, run.parts, optimizers=run.optimizers, lr_schedulers=run.schedulers,
                           base_folder=config.job.dump_folder, process_group=group) as manager:
        assert manager.load()
    return _gathered(run)


_OUR_PLAN = storage.SafeLoadPlanner.create_local_plan


def _plans_checked_against_dcp(differing: list[str]) -> None:
    """Every local load plan of this process is made by `dcp.load_plan` and compared, item for
    item with its index hints, with the plan DCP's own planner makes for the same state; a line
    per load that is not, or whose plan differs, goes to `differing`."""

    def checked(self) -> LoadPlan:
        checked.calls += 1
        if not load_plan.matches(self.state_dict, self.metadata, self.original_state_dict):
            differing.append(f"rank {dist.get_rank()}: a load not planned by dcp.load_plan")
        plan = _OUR_PLAN(self)
        theirs = DefaultLoadPlanner.create_local_plan(self)

        def hinted(p):
            return [(i, i.dest_index.index, i.storage_index.index) for i in p.items]
        if hinted(plan) != hinted(theirs):
            differing.append(f"rank {dist.get_rank()}: a load plan of {len(plan.items)} items differs from DCP's "
                             f"({len(theirs.items)} items)")
        return plan

    checked.calls = 0
    storage.SafeLoadPlanner.create_local_plan = checked


def _matrix(rank: int, world_size: int, folder: str, flavor: str, saved_on: str) -> list[str]:
    """Train, resume, and load on every other layout of `flavor` and on 1 rank; what differs
    (rank 0), and any load plan that differs from DCP's own (any rank)."""
    plans: list[str] = []
    _plans_checked_against_dcp(plans)
    saved, wrong = _train_and_resume(rank, world_size, folder, flavor, saved_on)
    path = layout.step_dir(os.path.join(folder, "checkpoint"), 2)
    if rank == 0:
        wrong += _differences(saved, _torch_reads(path, sorted(saved)), f"{saved_on}: dcp.load")
    for name in MODEL_LAYOUTS[flavor]:
        if name != saved_on:
            got = _load_on(_config(folder, flavor, name, "--training.seed", "7", "--checkpoint.load_step", "2"),
                           world_size, rank)
            wrong += _differences(saved, got, f"saved on {saved_on}, loaded on {name}") if rank == 0 else []
    alone = dist.new_group([0])
    if rank == 0:
        config = _config(folder, flavor, None, "--training.seed", "7", "--checkpoint.load_step", "2")
        wrong += _differences(saved, _load_on(config, 1, 0, alone), f"saved on {saved_on}, loaded on 1 rank")
    if storage.SafeLoadPlanner.create_local_plan.calls == 0:
        plans.append(f"rank {rank}: no load plan was compared with DCP's")
    return wrong + [line for found in _all_ranks(plans) for line in found]


def _model_state(run: Run) -> dict[str, Any] | None:
    return {k: v for k, v in _gathered(run).items() if not k.startswith("optimizer.")} \
        if dist.get_rank() == 0 else _gathered(run)


def _hf(rank: int, world_size: int, folder: str, flavor: str, name: str, reference: str) -> list[str]:
    """Export from the layout: the files of a 1-rank export, byte for byte, each byte written
    by one rank. Import that folder
    into the layout (other weights before): every tensor equal, each rank reading exactly the
    bytes it needs (`_bytes_to_read`)."""
    config = _config(folder, flavor, name)
    run = build_run(config, world_size, rank, torch.device("cpu"))
    adapter = hf_adapter(FLAVORS[flavor])
    out = os.path.join(folder, "hf")
    written = []
    save_hf(ModelState(run.parts).state_dict(), out, adapter, max_shard_size=HF_SHARD,
            progress=lambda n, total: written.append(n))
    every = [None] * world_size
    dist.all_gather_object(every, sum(written))
    wrong = [f"{name}: HF export: {f} differs from 1 rank's" for f in _differing_files(reference, out)] \
        if rank == 0 else []
    tensors = sum(e.nbytes for e in read_hf_layout(reference).values())
    wrong += [f"{name}: HF export: the ranks wrote {every} bytes, not {tensors} once"] \
        if rank == 0 and sum(every) != tensors else []
    other = build_run(_config(folder, flavor, name, "--training.seed", "7"), world_size, rank, torch.device("cpu"))
    state = ModelState(other.parts)
    sd = state.state_dict()
    with RecordedReads() as recorded:
        load_hf(sd, reference, adapter)
    state.load_state_dict(sd)
    held = _bytes_to_read(sd, adapter)
    counts = [None] * world_size
    dist.all_gather_object(counts, (sum(n for _, _, n in recorded.reads), held))
    expected, got = _model_state(run), _model_state(other)
    if rank == 0:
        wrong += [f"{name}: HF import: rank {r} read {a} bytes for the {b} it needs"
                  for r, (a, b) in enumerate(counts) if a != b]
        wrong += _differences(expected, got, f"{name}: HF import")
    return wrong


def _bytes_to_read(sd: dict[str, Any], adapter: Any) -> int:
    """The bytes of the HF files a rank needs: those of the blocks it holds, whole heads of a
    q/k projection or norm (RoPE's row order moves rows within a head, so a shard that cuts a
    head reads the rest of it)."""
    total = 0
    sources = adapter.hf_sources(adapter.state_dict_shapes())  # sd may be a pipeline stage's part
    for name, value in sd.items():
        source = sources[name]
        local = value.to_local() if isinstance(value, DTensor) else value
        lo = dtensor_chunk(tuple(value.shape), value.device_mesh, tuple(value.placements))[0][0] \
            if isinstance(value, DTensor) else 0
        block = len(source.row_order) or 1
        rows = -(-(lo + local.shape[0]) // block) * block - lo // block * block
        total += local.nbytes // local.shape[0] * rows
    return total


def _hf_through_the_manager(rank: int, world_size: int, folder: str, flavor: str, name: str,
                            reference: str) -> list[str]:
    """The example job's own HF path: the last step saved in HF format from the layout (the
    files of a 1-rank export, byte for byte), then a new run's initial load from that step on
    the layout (every tensor as saved)."""
    config = _config(folder, flavor, name, "--checkpoint.last_save_in_hf", "true",
                     "--checkpoint.last_save_model_only", "true", "--checkpoint.hf_max_shard_size", HF_SHARD)
    run, adapter = build_run(config, world_size, rank, torch.device("cpu")), hf_adapter(FLAVORS[flavor])
    _with_manager(config, run, rank, lambda manager, *_: manager.save(1, last_step=True), state_dict_adapter=adapter)
    step = layout.step_dir(os.path.join(folder, "checkpoint"), 1)
    wrong = [f"{name}: HF step: {f} differs from 1 rank's" for f in os.listdir(reference)
             if not filecmp.cmp(os.path.join(reference, f), os.path.join(step, f), shallow=False)] if rank == 0 else []
    config = _config(os.path.join(folder, "again"), flavor, name, "--training.seed", "7",
                     "--checkpoint.initial_load_path", step, "--checkpoint.initial_load_in_hf", "true")
    other = build_run(config, world_size, rank, torch.device("cpu"))
    _with_manager(config, other, rank, lambda manager, *_: manager.load(), state_dict_adapter=adapter)
    expected, got = _model_state(run), _model_state(other)
    return wrong + (_differences(expected, got, f"{name}: HF initial load") if rank == 0 else [])


def _pipeline_on_two_ranks(rank: int, folder: str, reference: str) -> list[str]:
    """Pipeline stages alone, on a checkpoint group of ranks 0 and 1: each holds one stage of
    plain tensors. Export (one pass, and through DCP's shard files with `all_ranks`), then
    import the reference into other weights: what each rank holds, reading only its bytes."""
    pair = dist.new_group([0, 1])
    if rank > 1:
        return []
    config = _config(folder, DENSE, None)
    dims, adapter = ParallelDims(pp=2), hf_adapter(FLAVORS[DENSE])
    sd = ModelState([p for _, p in pipeline_parts(build_model(config), dims, rank)]).state_dict()
    wrong = []
    for mode in ("one_pass", "all_ranks"):
        out = os.path.join(folder, mode)
        save_hf(sd, out, adapter, max_shard_size=HF_SHARD, process_group=pair, mode=mode)
        wrong += [f"pp2 on 2 ranks, {mode}: {f} differs from 1 rank's" for f in _differing_files(reference, out)]
    seed7 = build_model(_config(folder, DENSE, None, "--training.seed", "7"))
    other = ModelState([p for _, p in pipeline_parts(seed7, dims, rank)]).state_dict()
    with RecordedReads() as recorded:
        load_hf(other, reference, adapter, process_group=pair)
    read = sum(n for _, _, n in recorded.reads)
    wrong += [f"pp2 on 2 ranks: rank {rank} read {read} bytes for the {_bytes_to_read(other, adapter)} it holds"] \
        if read != _bytes_to_read(other, adapter) else []
    return wrong + _differences(sd, other, f"pp2 on 2 ranks: HF import on rank {rank}")


def _differing_files(a: str, b: str) -> list[str]:
    names = sorted(f for f in os.listdir(a) if f.endswith((".safetensors", ".json")))
    if names != sorted(f for f in os.listdir(b) if f.endswith((".safetensors", ".json"))):
        return [f"the file list {sorted(os.listdir(b))}"]
    return [f for f in names if not filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False)]


DEDUP_NORM = "layers.0.attention_norm.weight"
"""A norm: replicated over tensor-parallel ranks (and FSDP-sharded over the data-parallel ones)."""


def _dedup(rank: int, world_size: int, folder: str, name: str, policy: str) -> dict[str, Any]:
    """Save with `policy`; rank 0 reports the norm's chunks and the ranks that wrote them, the
    bytes on disk no item uses, and what `dcp.load` reads that differs from the state."""
    config = _config(folder, DENSE, name, "--checkpoint.dedup_policy", policy,
                     "--checkpoint.dedup_min_slice_bytes", "1")
    run = build_run(config, world_size, rank, torch.device("cpu"))
    with CheckpointManager(config.checkpoint, run.parts, optimizers=run.optimizers,
                           base_folder=config.job.dump_folder) as manager:
        manager.save(1, last_step=True)
    saved = _gathered(run)
    if rank != 0:
        return {}
    path = layout.step_dir(os.path.join(folder, "checkpoint"), 1)
    metadata = dcp.FileSystemReader(path).read_metadata()
    chunks = metadata.state_dict_metadata[DEDUP_NORM].chunks
    writers = {int(metadata.storage_data[MetadataIndex(DEDUP_NORM, c.offsets)].relative_path.split("_")[2])
               for c in chunks}
    return {"chunks": len(chunks), "writers": sorted(writers),
            "unused": sum(disk - used for used, disk in data_file_use(path).values()),
            "differs": _differences(saved, _torch_reads(path, sorted(saved)), f"{name} {policy}")}


CASES = [(flavor, name) for flavor, names in SAVED_ON.items() for name in names]
DEDUP_CASES = [(name, policy) for name in ("tp2_fsdp2", "tp4") for policy in ("balanced", "lowest_rank",
                                                                              "replica_slices")]
HF_CASES = [*CASES, (DENSE, "pp2_tp2"), (MOE, "pp2_fsdp2")]
"""Pipeline stages too: the dense pp2_fsdp2 puts layers 0 and 2 on one rank (Interleaved1F1B),
pp2_tp2 has plain tensors on every tp rank of a stage, and the MoE one FSDP-sharded experts."""
HF_SHARD = "40KB"
"""Several HF files per export."""


def _every_layout(rank: int, world_size: int, folder: str, references: dict[str, str], out: str) -> None:
    """One process start for the whole matrix: each saved layout in turn, in its own folder;
    then the HF export and import of each layout, and the dedup policies under TP."""
    found = {f"{flavor}-{name}": _matrix(rank, world_size, os.path.join(folder, name), flavor, name)
             for flavor, name in CASES}
    found.update({f"hf-{flavor}-{name}": _hf(rank, world_size, os.path.join(folder, "hf_" + name), flavor, name,
                                             references[flavor]) for flavor, name in HF_CASES})
    found["hf-manager-pp2_fsdp2"] = _hf_through_the_manager(rank, world_size, os.path.join(folder, "hf_manager"),
                                                           DENSE, "pp2_fsdp2", references[DENSE])
    found["hf-pp2-2ranks"] = [w for ws in _all_ranks(_pipeline_on_two_ranks(rank, os.path.join(folder, "hf_pp2"),
                                                                           references[DENSE])) for w in ws]
    found.update({f"dedup-{name}-{policy}": _dedup(rank, world_size, os.path.join(folder, f"{name}_{policy}"),
                                                   name, policy) for name, policy in DEDUP_CASES})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)


def _reference_export(folder: str, flavor: str) -> str:
    """The HF export of the flavor's seed-0 model from one process."""
    config = _config(folder, flavor, None)
    out = os.path.join(folder, "hf_" + flavor)
    save_hf(ModelState([build_model(config)]).state_dict(), out, hf_adapter(FLAVORS[flavor]), max_shard_size=HF_SHARD)
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, str]:
    folder = str(tmp_path_factory.mktemp("hf"))
    return {flavor: _reference_export(folder, flavor) for flavor in (DENSE, MOE)}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, references) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("meshes")
    spawn(4, _every_layout, str(folder), references, str(folder / "found.json"))
    with open(folder / "found.json") as f:
        return json.load(f)


@pytest.mark.parametrize("flavor,saved_on", CASES)
def test_save_on_one_layout_load_on_every_other(matrix, flavor, saved_on):
    assert matrix[f"{flavor}-{saved_on}"] == []


@pytest.mark.parametrize("flavor,layout_name", HF_CASES)
def test_hf_export_and_import_on_each_layout(matrix, flavor, layout_name):
    assert matrix[f"hf-{flavor}-{layout_name}"] == []


def test_hf_export_and_import_with_pipeline_stages_on_two_ranks(matrix):
    assert matrix["hf-pp2-2ranks"] == []


def test_the_job_saves_and_loads_hf_steps_with_pipeline_stages(matrix):
    assert matrix["hf-manager-pp2_fsdp2"] == []


@pytest.mark.parametrize("flavor", [DENSE, MOE])
def test_the_exports_load_in_transformers_with_equal_logits(references, flavor):
    """Every layout's export is these files byte for byte (above); `transformers` reads them."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(references[flavor], dtype=torch.float32).eval()
    model = build_model(_config(references[flavor], flavor, None))
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(tokens).logits - model(tokens)).abs().max() < 1e-5


@pytest.mark.parametrize("name,policy,chunks,writers", [
    ("tp2_fsdp2", "balanced", 2, None), ("tp2_fsdp2", "lowest_rank", 2, [0, 2]),
    ("tp2_fsdp2", "replica_slices", 4, [0, 1, 2, 3]),
    ("tp4", "balanced", 1, None), ("tp4", "lowest_rank", 1, [0]), ("tp4", "replica_slices", 4, [0, 1, 2, 3])])
def test_dedup_policies_on_tensor_parallel_replicated_norms(matrix, name, policy, chunks, writers):
    """A norm's shard is held by every tp rank: written once (as slices by each holder with
    replica_slices), no byte written twice or unused, and read back as saved."""
    found = matrix[f"dedup-{name}-{policy}"]
    assert found["chunks"] == chunks and found["unused"] == 0 and found["differs"] == []
    assert found["writers"] == writers if writers else len(found["writers"]) == chunks
