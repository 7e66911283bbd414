"""Every mesh the example job builds, on 4 real gloo ranks: each layout trains, saves, resumes on
its own layout with the losses of an uninterrupted run, and its step loads on every other layout
of the same model and on 1 rank with every tensor equal to what was saved and to what PyTorch's
own `dcp.load` (`FileSystemReader`) reads from the folder.

One 4-rank spawn for the whole matrix (a process start costs more than a layout's saves and
loads): each saved layout, then the loads on the other layouts, each mesh built in turn; rank 0
reports what differs per saved layout, and each is its own test."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from torchtitan_ckpt import CheckpointManager, layout
from torchtitan_ckpt.example.config import JobConfig, load_job_config
from torchtitan_ckpt.example.data import build_dataloader
from torchtitan_ckpt.example.model import FLAVORS
from torchtitan_ckpt.example.train import Run, TrainState, build_run, train_steps
from torchtitan_ckpt.states import ModelState, OptimizerState

from .helpers import spawn

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
}
MODEL_LAYOUTS = {DENSE: ("fsdp4", "hsdp2x2", "tp2_fsdp2", "tp4", "pp2_fsdp2"),
                 MOE: ("ep2_fsdp2", "fsdp4", "hsdp2x2", "pp2_fsdp2")}
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
    """Train 4 steps (saving step 2), then resume a new run from step 2; the losses of steps 3
    and 4 must be the same bits. Returns the state as of step 2 and the differences (rank 0)."""
    config = _config(folder, flavor, name)
    run = build_run(config, world_size, rank, torch.device("cpu"))

    def straight(manager, loader, train_state):
        batches = iter(loader)
        train_steps(config, run, batches, train_state, manager, 2)
        saved = _gathered(run)
        return saved, train_steps(config, run, batches, train_state, manager, 4)

    saved, rest = _with_manager(config, run, rank, straight)
    config = _config(folder, flavor, name, "--checkpoint.load_step", "2")  # the seed is the data's too
    resumed = build_run(config, world_size, rank, torch.device("cpu"))

    def resume(manager, loader, train_state):
        assert manager.load() and train_state.step == 2
        return train_steps(config, resumed, iter(loader), train_state, manager, 4)

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


def _matrix(rank: int, world_size: int, folder: str, flavor: str, saved_on: str) -> list[str]:
    """Train, resume, and load on every other layout of `flavor` and on 1 rank; what differs
    (rank 0)."""
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
    return wrong


CASES = [(DENSE, name) for name in MODEL_LAYOUTS[DENSE]] + [(MOE, "ep2_fsdp2")]


def _every_layout(rank: int, world_size: int, folder: str, out: str) -> None:
    """One process start for the whole matrix: each saved layout in turn, in its own folder."""
    found = {f"{flavor}-{name}": _matrix(rank, world_size, os.path.join(folder, name), flavor, name)
             for flavor, name in CASES}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict[str, list[str]]:
    folder = tmp_path_factory.mktemp("meshes")
    spawn(4, _every_layout, str(folder), str(folder / "found.json"))
    with open(folder / "found.json") as f:
        return json.load(f)


@pytest.mark.parametrize("flavor,saved_on", CASES)
def test_save_on_one_layout_load_on_every_other(matrix, flavor, saved_on):
    assert matrix[f"{flavor}-{saved_on}"] == []
