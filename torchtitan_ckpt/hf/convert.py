"""`torchtitan-ckpt convert`: DCP step folder <-> Hugging Face folder, on one rank or under torchrun.

    torchtitan-ckpt convert --to dcp HF_DIR OUT_DIR [--adapter llama|mistral|qwen3|qwen3_moe]
    torchtitan-ckpt convert --to hf STEP_DIR OUT_DIR [--hf-assets DIR] [--dtype bfloat16]
    torchrun --nproc_per_node 4 -m torchtitan_ckpt.hf.convert --to dcp HF_DIR OUT_DIR

No model is built: the adapter, picked by `config.json`'s `model_type`, gives the name and shape
of every tensor, and the DCP side is those names -> tensors. `--to dcp` records the HF config in
the step folder (`hf_config.json`), so `--to hf` of that folder needs no `--hf-assets`. With
several ranks every tensor is split by rows across them (a 1-D gloo mesh), so each rank reads
and holds about 1/N of the model; the HF export then gathers one tensor at a time.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.tensor as dtensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh

from .. import commit
from ..dcp import storage
from ..errors import AdapterMismatchError, CheckpointError, CheckpointNotFoundError
from ..io import durable
from .adapter import CONFIG_FILE, StateDictAdapter
from .load import check_hf_dir, load_hf
from .model_config import read_hf_config
from .registry import ADAPTERS, adapter_for_config
from .save import MODES, save_hf

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RECORDED_CONFIG = "hf_config.json"
"""The HF `config.json` that `--to dcp` records in the DCP step folder it writes."""


def convert(to: str, src: str, dst: str, adapter_name: str | None = None, *, hf_assets_path: str | None = None,
            dtype: str | None = None, max_shard_size: str = "5GB", consolidation: str = "one_pass",
            threads: int = 4) -> None:
    """Convert the model in `src` to format `to` ("hf" or "dcp") in `dst`; call on every rank.
    The adapter is `adapter_name` (one of `ADAPTERS`), else the config's `model_type`."""
    if to not in ("hf", "dcp"):
        raise ValueError(f"--to {to!r}: expected 'hf' or 'dcp'")
    if to == "dcp":
        to_dcp(src, dst, adapter_name, hf_assets_path)
    else:
        to_hf(src, dst, adapter_name, hf_assets_path, dtype=DTYPES[dtype] if dtype else None,
              max_shard_size=max_shard_size, consolidation=consolidation, threads=threads)


def to_dcp(hf_dir: str, dst: str, adapter_name: str | None = None, hf_assets_path: str | None = None) -> None:
    """Write the HF folder `hf_dir` as a model-only DCP step folder `dst`, with its tensors
    renamed and permuted by the adapter of its `config.json` (or `hf_assets_path`'s)."""
    config_path = os.path.join(hf_assets_path or hf_dir, CONFIG_FILE)
    config = read_hf_config(config_path)
    adapter = adapter_for_config(config, hf_assets_path or hf_dir, adapter_name, config_path)
    shapes = adapter.state_dict_shapes()
    meta = {k: torch.empty(shape, device="meta") for k, shape in shapes.items()}
    sources, layout = check_hf_dir(meta, hf_dir, adapter)  # every name and shape, before allocating
    dtypes = {k: layout[source.hf_names[0]].dtype for k, source in sources.items()}
    state = empty_state_dict(shapes, dtypes)
    load_hf(state, hf_dir, adapter)
    _write_dcp(state, dst, config.raw)


def to_hf(step_dir: str, dst: str, adapter_name: str | None = None, hf_assets_path: str | None = None,
          **export: Any) -> None:
    """Export the model of the DCP step folder `step_dir` to the HF folder `dst`; the config is
    `hf_assets_path`'s `config.json`, else the one `to_dcp` recorded. `export`: `save_hf`'s
    dtype, max_shard_size, consolidation (its mode) and threads."""
    config_path = os.path.join(hf_assets_path, CONFIG_FILE) if hf_assets_path else \
        os.path.join(step_dir, RECORDED_CONFIG)
    if not os.path.isfile(config_path):
        raise CheckpointNotFoundError(f"{step_dir} records no HF config ({RECORDED_CONFIG}); pass --hf-assets "
                                      "with the HF folder whose config.json describes the model")
    adapter = adapter_for_config(read_hf_config(config_path), hf_assets_path, adapter_name, config_path)
    state = empty_state_dict(*_dcp_tensors(step_dir, adapter))
    _read_dcp(state, step_dir)
    save_hf(state, dst, adapter, dtype=export["dtype"], max_shard_size=export["max_shard_size"],
            mode=export["consolidation"], num_threads=export["threads"])


def _dcp_tensors(path: str, adapter: StateDictAdapter) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype]]:
    """The shapes and dtypes of the adapter's tensors in the DCP folder `path`, checked against
    the config's shapes before anything is allocated (a tied head may be absent)."""
    md_path = os.path.join(path, storage.METADATA_FILE)
    if not os.path.isfile(md_path):
        raise CheckpointNotFoundError(f"{path} is not a DCP checkpoint folder (no {storage.METADATA_FILE})")
    saved = storage.read_metadata(md_path).state_dict_metadata
    shapes = {k: v for k, v in adapter.state_dict_shapes().items() if k in saved or k in adapter.shapes}
    found = {f"{k} {list(saved[k].size)}" for k in shapes if k in saved and hasattr(saved[k], "size")}
    expected = {f"{k} {list(v)}" for k, v in shapes.items()}
    if found != expected:
        raise AdapterMismatchError(f"{path}: tensors in the checkpoint (unknown) vs the HF config's (missing)",
                                   list(found - expected), list(expected - found))
    return shapes, {k: saved[k].properties.dtype for k in shapes}


def empty_state_dict(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """Uninitialised tensors of `shapes` and `dtypes`, split by rows over every rank when
    torch.distributed is initialised (so each rank holds about 1/N of the model)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {k: torch.empty(shape, dtype=dtypes[k]) for k, shape in shapes.items()}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {k: dtensor.empty(*shape, dtype=dtypes[k], device_mesh=mesh, placements=[dtensor.Shard(0)])
            for k, shape in shapes.items()}


def _read_dcp(state: dict[str, Any], path: str) -> None:
    try:
        dcp.load(state, storage_reader=storage.make_storage_reader(path), planner=storage.make_load_planner())
    except CheckpointException as e:
        cause = storage.root_cause(e)
        raise CheckpointError(f"reading {path} failed: {type(cause).__name__}: {cause}") from None


def _write_dcp(state: dict[str, Any], path: str, hf_config: dict[str, Any]) -> None:
    """A model-only DCP folder with the HF config it came from and a commit marker, loadable as
    `initial_load_path`."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        durable.write_json(os.path.join(path, RECORDED_CONFIG), hf_config, indent=2)
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
    p.add_argument("--adapter", choices=sorted(ADAPTERS),
                   help="the model family; default: config.json's model_type")
    p.add_argument("--hf-assets", help="HF folder whose config.json (and file split) gives the model; "
                   "default: the HF source (--to dcp) or the config the DCP step recorded (--to hf)")
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
        convert(args.to, args.src, args.dst, args.adapter, hf_assets_path=args.hf_assets, dtype=args.dtype,
                max_shard_size=args.max_shard_size, consolidation=args.consolidation, threads=args.threads)
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
