"""`torchtitan-ckpt convert`: DCP step folder <-> Hugging Face folder, on one rank or under torchrun.

    torchtitan-ckpt convert --to hf STEP_DIR OUT_DIR [--flavor F | --hf-assets DIR] [--dtype bfloat16]
    torchrun --nproc_per_node 4 -m torchtitan_ckpt.hf.convert --to dcp HF_DIR OUT_DIR

With several ranks every tensor is split by rows across them (a 1-D gloo mesh), so each rank
reads and holds about 1/N of the model; the HF export then gathers one tensor at a time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
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
from .save import MODES, save_hf

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
            max_shard_size: str = "5GB", consolidation: str = "one_pass", threads: int = 4) -> None:
    """Convert the model in `src` to format `to` ("hf" or "dcp") in `dst`; call on every rank."""
    if adapter_name not in ADAPTERS:
        raise ValueError(f"unknown adapter {adapter_name!r}; expected one of {', '.join(ADAPTERS)}")
    if to not in ("hf", "dcp"):
        raise ValueError(f"--to {to!r}: expected 'hf' or 'dcp'")
    spec = ADAPTERS[adapter_name]
    assets = hf_assets_path if to == "hf" else (hf_assets_path or src)
    args = model_args(spec, flavor, assets)
    adapter = spec.adapter(args, assets)
    state = empty_state_dict(spec, args)
    if to == "hf":
        _read_dcp(state, src)
        save_hf(state, dst, adapter, dtype=DTYPES[dtype] if dtype else None, max_shard_size=max_shard_size,
                mode=consolidation, num_threads=threads)
    else:
        load_hf(state, src, adapter)
        _write_dcp(state, dst)


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


def add_convert_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `convert` sub-command to the `torchtitan-ckpt` parser's subparsers."""
    p = subparsers.add_parser("convert", help="convert a model between DCP and Hugging Face format",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--to", required=True, choices=("hf", "dcp"), help="the format to write")
    p.add_argument("src", help="a DCP step folder (--to hf) or an HF folder (--to dcp)")
    p.add_argument("dst", help="the folder to write")
    p.add_argument("--adapter", default="llama3", choices=sorted(ADAPTERS), help="the model family")
    p.add_argument("--flavor", help="model preset; default: from config.json of the HF folder")
    p.add_argument("--hf-assets", help="HF folder whose config.json and file split an export copies")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating tensors of an HF export")
    p.add_argument("--max-shard-size", default="5GB", help="largest HF file when there is no assets index")
    p.add_argument("--consolidation", default="one_pass", choices=MODES,
                   help="how the HF files are written (see checkpoint.consolidation)")
    p.add_argument("--threads", type=int, default=4, help="I/O threads per rank for the HF files")
    return p


def run_convert(args: argparse.Namespace) -> int:
    """Run a parsed `convert` command (under torchrun when WORLD_SIZE is set); 0 on success."""
    rank = int(os.environ.get("RANK", "0"))
    if not logging.getLogger().handlers:  # progress: one line per file written
        logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                            format=f"[rank{rank}] %(asctime)s %(name)s %(levelname)s: %(message)s")
    started = "WORLD_SIZE" in os.environ and not dist.is_initialized()
    if started:
        dist.init_process_group("gloo")
    try:
        convert(args.to, args.src, args.dst, args.adapter, flavor=args.flavor,
                hf_assets_path=args.hf_assets, dtype=args.dtype, max_shard_size=args.max_shard_size,
                consolidation=args.consolidation, threads=args.threads)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if started:
            dist.destroy_process_group()
    if rank == 0:
        print(f"converted {args.src} -> {args.dst} ({args.to})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_ckpt.hf.convert")
    sub = parser.add_subparsers(dest="command")
    add_convert_parser(sub)
    return run_convert(parser.parse_args(["convert", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
