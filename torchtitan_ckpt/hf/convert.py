"""DCP step folder <-> Hugging Face folder, on one rank or under torchrun (`convert`, which the
`torchtitan-ckpt convert` command runs):

    torchtitan-ckpt convert --to hf STEP_DIR OUT_DIR [--flavor F | --hf-assets DIR] [--dtype bfloat16]
    torchrun --nproc_per_node 4 -m torchtitan_ckpt.cli convert --to dcp HF_DIR OUT_DIR

With several ranks every tensor is split by rows across them (a 1-D gloo mesh), so each rank
reads and holds about 1/N of the model; the HF export then gathers one tensor at a time.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.tensor as dtensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh

from .. import commit
from ..dcp import storage
from ..errors import CheckpointError, CheckpointNotFoundError
from ..example.model import FLAVORS, ModelArgs, Transformer
from .adapter import CONFIG_FILE, StateDictAdapter
from .llama import LlamaAdapter, llama_args_from_hf_config
from .load import load_hf
from .save import save_hf

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class AdapterSpec:
    """What converting one model family needs: its adapter, its presets, its model (for the
    names and shapes of its state dict) and how to read its args from an HF `config.json`."""

    adapter: Callable[[Any, str | None], StateDictAdapter]
    flavors: dict[str, Any]
    model: Callable[[Any], torch.nn.Module]
    args_from_hf_config: Callable[[dict[str, Any], str], Any]


ADAPTERS: dict[str, AdapterSpec] = {
    "llama3": AdapterSpec(LlamaAdapter, FLAVORS, Transformer, llama_args_from_hf_config),
}


def model_args(spec: AdapterSpec, flavor: str | None, hf_dir: str | None) -> ModelArgs:
    """The flavor's args when one is named, else those of `hf_dir/config.json`."""
    if flavor is not None:
        if flavor not in spec.flavors:
            raise ValueError(f"unknown flavor {flavor!r}; expected one of {', '.join(spec.flavors)}")
        return spec.flavors[flavor]
    if hf_dir is None:
        raise ValueError("name a --flavor or an HF folder (--hf-assets) whose config.json gives the model")
    path = os.path.join(hf_dir, CONFIG_FILE)
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read the model config {path}: {e}") from e
    return spec.args_from_hf_config(config, path)


def empty_state_dict(spec: AdapterSpec, args: Any) -> dict[str, Any]:
    """Uninitialised tensors shaped as the model's state dict, split by rows over every rank
    when torch.distributed is initialised (so each rank holds about 1/N of the model)."""
    with torch.device("meta"):
        shapes = {k: (v.shape, v.dtype) for k, v in spec.model(args).state_dict().items()}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {k: dtensor.empty(*shape, dtype=dtype, device_mesh=mesh, placements=[dtensor.Shard(0)])
            for k, (shape, dtype) in shapes.items()}


def convert(to: str, src: str, dst: str, adapter_name: str = "llama3", *, flavor: str | None = None,
            hf_assets_path: str | None = None, dtype: str | None = None,
            max_shard_size: str = "5GB", consolidation: str = "one_pass", threads: int = 4,
            progress: Callable[[str, int, int], None] | None = None) -> None:
    """Convert the model in `src` to format `to` ("hf" or "dcp") in `dst`; call on every rank.
    `progress(phase, nbytes, total)` hears of this rank's bytes read ("reading", once the read is
    done) and written ("writing": as the HF files are written, or once the DCP save is done)."""
    if adapter_name not in ADAPTERS:
        raise ValueError(f"unknown adapter {adapter_name!r}; expected one of {', '.join(ADAPTERS)}")
    if to not in ("hf", "dcp"):
        raise ValueError(f"--to {to!r}: expected 'hf' or 'dcp'")
    spec = ADAPTERS[adapter_name]
    assets = hf_assets_path if to == "hf" else (hf_assets_path or src)
    args = model_args(spec, flavor, assets)
    adapter = spec.adapter(args, assets)
    state = empty_state_dict(spec, args)
    report = progress or (lambda phase, nbytes, total: None)
    nbytes = _local_bytes(state)
    report("reading", 0, nbytes)
    if to == "hf":
        _read_dcp(state, src)
        report("reading", nbytes, nbytes)
        save_hf(state, dst, adapter, dtype=DTYPES[dtype] if dtype else None, max_shard_size=max_shard_size,
                mode=consolidation, num_threads=threads, progress=lambda n, total: report("writing", n, total))
    else:
        load_hf(state, src, adapter)
        report("reading", nbytes, nbytes)
        report("writing", 0, nbytes)
        _write_dcp(state, dst)
        report("writing", nbytes, nbytes)


def _local_bytes(state: dict[str, Any]) -> int:
    """Bytes of this rank's part of every tensor of `state`."""
    local = (t.to_local() if isinstance(t, dtensor.DTensor) else t for t in state.values())
    return sum(t.numel() * t.element_size() for t in local)


def _read_dcp(state: dict[str, Any], path: str) -> None:
    md_path = os.path.join(path, storage.METADATA_FILE)
    if not os.path.isfile(md_path):
        raise CheckpointNotFoundError(f"{path} is not a DCP checkpoint folder (no {storage.METADATA_FILE})")
    metadata = storage.read_metadata(md_path)
    missing = [k for k in state if k not in metadata.state_dict_metadata]
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} tensors of this model: {missing}; "
                              "is --flavor (or --hf-assets) the model it was saved from?")
    try:
        dcp.load(state, storage_reader=storage.make_storage_reader(path), planner=storage.make_load_planner())
    except CheckpointException as e:
        cause = storage.root_cause(e)
        if isinstance(cause, KeyboardInterrupt):
            raise cause from None
        raise CheckpointError(f"reading {path} failed: {type(cause).__name__}: {cause}") from None


def _write_dcp(state: dict[str, Any], path: str) -> None:
    """A model-only DCP folder with a commit marker, loadable as `initial_load_path`."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(state, storage_writer=storage.make_storage_writer(path), planner=storage.make_save_planner())
    if rank == 0:
        commit.write_marker(path, commit.CommitInfo(step=0, states=["model"], world_size=world))
    if dist.is_initialized():
        dist.barrier()
