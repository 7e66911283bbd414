"""Every mesh the example job builds, on 4 real gloo ranks: each layout trains, saves, resumes on
its own layout with the losses of an uninterrupted run, and its step loads on every other layout
of the same model and on 1 rank with every tensor equal to what was saved and to what PyTorch's
own `dcp.load` (`FileSystemReader`) reads from the folder.

One 4-rank spawn per saved layout: the loads on the other layouts happen inside the same
processes, each mesh built in turn."""

from __future__ import annotations

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


def _assert_equal(expected: dict[str, Any], got: dict[str, Any], what: str) -> None:
    assert sorted(got) == sorted(expected), what
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == got[key].dtype and torch.equal(value, got[key]), f"{what}: {key} differs"
        else:
            assert value == got[key], f"{what}: {key}: {got[key]!r} != {value!r}"


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


def _train_and_resume(rank: int, world_size: int, folder: str, flavor: str, name: str) -> dict[str, Any]:
    """Train 4 steps (saving step 2), then resume a new run from step 2; the losses of steps 3
    and 4 must be the same bits. Returns the state as of step 2 (rank 0)."""
    config = _config(folder, flavor, name)
    run = build_run(config, world_size, rank, torch.device("cpu"))

    def straight(manager, loader, train_state):
        batches = iter(loader)
        first = train_steps(config, run, batches, train_state, manager, 2)
        saved = _gathered(run)
        return first, saved, train_steps(config, run, batches, train_state, manager, 4)

    _, saved, rest = _with_manager(config, run, rank, straight)
    config = _config(folder, flavor, name, "--checkpoint.load_step", "2")  # the seed is the data's too
    resumed = build_run(config, world_size, rank, torch.device("cpu"))

    def resume(manager, loader, train_state):
        assert manager.load() and train_state.step == 2
        return train_steps(config, resumed, iter(loader), train_state, manager, 4)

    again = _with_manager(config, resumed, rank, resume)
    assert again == rest, f"{name}: the resumed losses differ: {again} != {rest}"
    return saved


def _load_on(config: JobConfig, world_size: int, rank: int, group: Any = None) -> dict[str, Any] | None:
    run = build_run(config, world_size, rank, torch.device("cpu"))
    with CheckpointManager(config.checkpoint, run.parts, optimizers=run.optimizers, lr_schedulers=run.schedulers,
                           base_folder=config.job.dump_folder, process_group=group) as manager:
        assert manager.load()
    return _gathered(run)


def _matrix(rank: int, world_size: int, folder: str, flavor: str, saved_on: str) -> None:
    saved = _train_and_resume(rank, world_size, folder, flavor, saved_on)
    path = layout.step_dir(os.path.join(folder, "checkpoint"), 2)
    if rank == 0:
        _assert_equal(saved, _torch_reads(path, sorted(saved)), f"{saved_on}: dcp.load")
    for name in MODEL_LAYOUTS[flavor]:
        if name != saved_on:
            got = _load_on(_config(folder, flavor, name, "--training.seed", "7", "--checkpoint.load_step", "2"),
                           world_size, rank)
            if rank == 0:
                _assert_equal(saved, got, f"saved on {saved_on}, loaded on {name}")
    alone = dist.new_group([0])
    if rank == 0:
        config = _config(folder, flavor, None, "--training.seed", "7", "--checkpoint.load_step", "2")
        _assert_equal(saved, _load_on(config, 1, 0, alone), f"saved on {saved_on}, loaded on 1 rank")


@pytest.mark.parametrize("flavor,saved_on", [(DENSE, name) for name in MODEL_LAYOUTS[DENSE]] + [(MOE, "ep2_fsdp2")])
def test_save_on_one_layout_load_on_every_other(tmp_path, flavor, saved_on):
    spawn(4, _matrix, str(tmp_path), flavor, saved_on)
