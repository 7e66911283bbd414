"""DCP step folder <-> Hugging Face folder, on one rank or under torchrun (`convert`, which the
`torchtitan-ckpt convert` command runs):

    torchtitan-ckpt convert --to dcp HF_DIR OUT_DIR [--adapter llama|mistral|mixtral|qwen2|qwen3|qwen3_moe]
                                    [--rope-layout interleaved|halves]
    torchtitan-ckpt convert --to hf STEP_DIR OUT_DIR [--hf-assets DIR] [--dtype bfloat16]
                                    [--rope-layout interleaved|halves]
    torchrun --nproc_per_node 4 -m torchtitan_ckpt.cli convert --to dcp HF_DIR OUT_DIR

No model is built: the adapter, picked by `config.json`'s `model_type`, gives the name and shape
of every tensor, and the DCP side is those names -> tensors (`--to hf` reads a step of TorchTitan
0.3 by the names it renamed them to: `_TITAN_03_NAMES`). `--to dcp` records the HF config in
the step folder (`hf_config.json`) and the RoPE layout it permuted q/k for (`rope_layout.json`),
so `--to hf` of that folder needs neither `--hf-assets` nor `--rope-layout` for its weights and
config; the tokenizer and generation files and the file split come only from `--hf-assets`. With
several ranks every tensor is split by rows across them (a 1-D gloo mesh), so each rank reads
and holds about 1/N of the model; the HF export then writes each rank's rows in place (one pass;
the two-phase modes gather whole tensors).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.tensor as dtensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.device_mesh import init_device_mesh

from .. import commit
from ..config import BUILTIN_STATES, Checkpoint
from ..dcp import storage
from ..dcp.metadata import METADATA_FILE, read_metadata
from ..errors import AdapterMismatchError, CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..io import IO_THREADS, durable, safe_open
from ..io.dtypes import EXPORT_DTYPES
from ..io.tensors import local_bytes
from .adapter import ROPE_LAYOUTS, TIED_HEAD, StateDictAdapter
from .files import CONFIG_FILE, MAX_RECORDED_LAYOUT_BYTES, RECORDED_CONFIG, RECORDED_LAYOUT
from .load import check_hf_dir, load_hf
from .model_config import read_config_json
from .registry import adapter_for_config
from .save import save_hf

logger = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]
"""`progress(phase, nbytes, total)`: this rank's bytes read ("reading") and written ("writing")."""


def convert(to: str, src: str, dst: str, adapter_name: str | None = None, *, hf_assets_path: str | None = None,
            dtype: str | None = None, max_shard_size: str | int = Checkpoint.hf_max_shard_size,
            consolidation: str = Checkpoint.consolidation, threads: int = IO_THREADS, progress: Progress | None = None,
            rope_layout: str | None = None) -> None:
    """Convert the model in `src` to format `to` ("hf" or "dcp") in `dst`; call on every rank.
    The adapter is `adapter_name` (one of `ADAPTERS`), else the config's `model_type`, for a
    model whose RoPE is `rope_layout` (`adapter.ROPE_LAYOUTS`; None: the family's default).
    `progress` hears of the bytes read (once the read is done) and written (as the HF files are
    written, or once the DCP save is done). `dtype`, `max_shard_size` and `consolidation` are
    `save_hf`'s, for `to` "hf"; `threads` reads (`to` "dcp") or writes (`to` "hf") the HF files."""
    if to not in ("hf", "dcp"):
        raise ValueError(f"--to {to!r}: expected 'hf' or 'dcp'")
    report = progress or (lambda phase, nbytes, total: None)
    if to == "dcp":
        to_dcp(src, dst, adapter_name, hf_assets_path, report, rope_layout, threads)
    else:
        to_hf(src, dst, adapter_name, hf_assets_path, report, rope_layout,
              dtype=EXPORT_DTYPES[dtype] if dtype else None, max_shard_size=max_shard_size,
              consolidation=consolidation, threads=threads)


def to_dcp(hf_dir: str, dst: str, adapter_name: str | None = None, hf_assets_path: str | None = None,
           report: Progress = lambda phase, nbytes, total: None, rope_layout: str | None = None,
           threads: int = IO_THREADS) -> None:
    """Write the HF folder `hf_dir` as a model-only DCP step folder `dst`, with its tensors
    renamed and permuted by the adapter of its `config.json` (or `hf_assets_path`'s), read with
    `threads` threads per rank."""
    config_path = os.path.join(hf_assets_path or hf_dir, CONFIG_FILE)
    if os.path.isfile(os.path.join(hf_dir, METADATA_FILE)) and not os.path.lexists(config_path):
        raise CheckpointNotFoundError(f"{hf_dir} is a DCP checkpoint (it holds {METADATA_FILE}), not a Hugging Face "
                                      "folder: convert --to hf exports it")
    adapter = adapter_for_config(read_config_json(config_path), hf_assets_path or hf_dir, adapter_name, config_path,
                                 rope_layout)
    shapes = adapter.state_dict_shapes()
    meta = {k: torch.empty(shape, device="meta") for k, shape in shapes.items()}
    sources = adapter.hf_sources(meta)
    layout = check_hf_dir(meta, hf_dir, sources, tied_copies=adapter.tied_copies)  # before allocating
    dtypes = {k: layout[source.hf_names[0]].dtype for k, source in sources.items()}
    state = empty_state_dict(shapes, dtypes)
    nbytes = local_bytes(state)
    load_hf(state, hf_dir, adapter, num_threads=threads)
    report("reading", nbytes, nbytes)
    _write_dcp(state, dst, adapter.config.raw, adapter.rope_layout)
    report("writing", nbytes, nbytes)


def to_hf(step_dir: str, dst: str, adapter_name: str | None = None, hf_assets_path: str | None = None,
          report: Progress = lambda phase, nbytes, total: None, rope_layout: str | None = None,
          **export: Any) -> None:
    """Export the model of the DCP step folder `step_dir` to the HF folder `dst`; the config is
    `hf_assets_path`'s `config.json`, else the one `to_dcp` recorded; the RoPE layout is
    `rope_layout`, else the step's (`recorded_rope_layout`). `export`: `save_hf`'s dtype,
    max_shard_size, consolidation (its mode) and threads."""
    if not os.path.isfile(os.path.join(step_dir, METADATA_FILE)):  # the source before its config
        raise CheckpointNotFoundError(f"{step_dir} is not a DCP checkpoint folder (no {METADATA_FILE})")
    config_path = os.path.join(hf_assets_path, CONFIG_FILE) if hf_assets_path else \
        os.path.join(step_dir, RECORDED_CONFIG)
    if not os.path.isfile(config_path):
        raise CheckpointNotFoundError(
            f"{config_path} not found: --hf-assets must name an HF folder holding the model's {CONFIG_FILE}"
            if hf_assets_path else f"{step_dir} records no HF config ({RECORDED_CONFIG}); pass --hf-assets "
            f"with the HF folder whose {CONFIG_FILE} describes the model")
    layout = rope_layout or recorded_rope_layout(step_dir)
    adapter = adapter_for_config(read_config_json(config_path), hf_assets_path, adapter_name, config_path, layout)
    if layout is None and adapter.rope_layout != "interleaved":
        raise CheckpointError(
            f"{step_dir} does not record the RoPE layout of its model (a step the training job saved), and "
            f"{adapter_name or adapter.config.model_type} models differ in it: pass --rope-layout halves (TorchTitan's "
            "Qwen3) or interleaved (this package's example model)")
    shapes, dtypes, stored = _dcp_tensors(step_dir, adapter)
    held = empty_state_dict({stored[k]: shape for k, shape in shapes.items()},
                            {stored[k]: dtype for k, dtype in dtypes.items()})
    _read_dcp(held, step_dir)
    state = {k: held[stored[k]] for k in shapes}
    nbytes = local_bytes(state)
    report("reading", nbytes, nbytes)
    save_hf(state, dst, adapter, dtype=export["dtype"], max_shard_size=export["max_shard_size"],
            mode=export["consolidation"], num_threads=export["threads"],
            progress=lambda n, total: report("writing", n, total))


def recorded_rope_layout(step_dir: str) -> str | None:
    """The RoPE layout of the model whose q/k rows the step holds, as far as the step says: the
    one `to_dcp` recorded (`RECORDED_LAYOUT`), else None (a step the training job saved, or one
    of an older `to_dcp`, which permuted every family before one release and followed the
    family's default after it: the caller must know). Read as any file of a checkpoint: at
    most a few KB, and one of `ROPE_LAYOUTS`, else `CorruptCheckpointError`."""
    path = os.path.join(step_dir, RECORDED_LAYOUT)
    if not os.path.isfile(path):
        return None
    data = safe_open.read_bounded(path, "the recorded RoPE layout", MAX_RECORDED_LAYOUT_BYTES)
    try:
        recorded = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"cannot read {path}: {e}") from e
    layout = recorded.get("rope_layout") if isinstance(recorded, dict) else None
    if layout not in ROPE_LAYOUTS:
        raise CorruptCheckpointError(f"{path}: rope_layout = {layout!r}, expected one of {', '.join(ROPE_LAYOUTS)}; "
                                     "pass --rope-layout with the model's")
    return layout


_TITAN_03_NAMES = ((".attention.wq.", ".attention.qkv_linear.wq."), (".attention.wk.", ".attention.qkv_linear.wk."),
                   (".attention.wv.", ".attention.qkv_linear.wv."),
                   (".moe.experts.w1", ".moe.routed_experts.inner_experts.w1_EFD"),
                   (".moe.experts.w3", ".moe.routed_experts.inner_experts.w3_EFD"),
                   (".moe.experts.w2", ".moe.routed_experts.inner_experts.w2_EDF"),
                   (".moe.expert_bias", ".moe.expert_bias_E"))
"""How TorchTitan 0.3 renamed the tensors that the adapters know (or leave out: `unmapped`) by
TorchTitan 0.2's (and this package's example's) names, part for part, in the same layout; and
the head, `lm_head.weight`."""
_TITAN_03_HEAD = "lm_head.weight"


def _titan_03_name(name: str) -> str:
    """`name`, as TorchTitan 0.2 names a tensor, as TorchTitan 0.3 names it."""
    if name == TIED_HEAD:
        return _TITAN_03_HEAD
    for old, new in _TITAN_03_NAMES:
        if old in name:
            return name.replace(old, new)
    return name


def _step_names(names: Iterable[str], saved: Mapping[str, Any]) -> dict[str, str]:
    """The adapter's tensor `names` -> the names the step holds them under: TorchTitan 0.3's
    where the step holds its q projection by them, else the adapter's own."""
    newer = any(_titan_03_name(k) in saved for k in names if ".attention.wq." in k)
    return {k: _titan_03_name(k) if newer else k for k in names}


def _dcp_tensors(path: str, adapter: StateDictAdapter) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype],
                                                                 dict[str, str]]:
    """The shapes and dtypes of the adapter's tensors in the DCP folder `path`, checked against
    the config's shapes and their data files (`_check_stored`) before anything is allocated (a
    tied head may be absent), and the names the step holds them under (`_step_names`). Every
    other model tensor of the step is an `AdapterMismatchError` (an export would drop it), but
    for those the adapter leaves out (`unmapped`), which are logged."""
    metadata = read_metadata(os.path.join(path, METADATA_FILE))
    saved = metadata.state_dict_metadata
    every = adapter.state_dict_shapes()
    stored = _step_names([*every, *adapter.unmapped], saved)
    shapes = {k: v for k, v in every.items() if stored[k] in saved or k in adapter.shapes}
    found = {f"{stored[k]} {list(saved[stored[k]].size)}" for k in shapes
             if stored[k] in saved and hasattr(saved[stored[k]], "size")}
    expected = {f"{stored[k]} {list(v)}" for k, v in shapes.items()}
    states = set(commit.read_marker(path).states if commit.is_committed(path) else BUILTIN_STATES) - {"model"}
    held = {stored[k] for k in shapes}
    left = sorted(stored[k] for k in adapter.unmapped if stored[k] in saved)
    others = {f"{k} {list(v.size)}" for k, v in saved.items()  # a renamed module shows as unknown and missing
              if k not in held and k not in left and hasattr(v, "size") and k.partition(".")[0] not in states}
    if found != expected or others:
        raise AdapterMismatchError(f"{path}: tensors in the checkpoint (unknown) vs the HF config's (missing)",
                                   list(found - expected | others), list(expected - found))
    if left:
        logger.warning("%s: the export leaves out %d model tensor(s) that the adapter maps to no Hugging Face "
                       "tensor, e.g. %s: the exported model lacks them", path, len(left), left[:3])
    _check_stored(path, metadata, [stored[k] for k in shapes])
    return shapes, {k: saved[stored[k]].properties.dtype for k in shapes}, {k: stored[k] for k in shapes}


def _check_stored(path: str, metadata: Metadata, keys: list[str]) -> None:
    """Raise `CorruptCheckpointError` naming the data file and the tensor unless every chunk of
    the tensors `keys` has a storage entry of at least the chunk's bytes that lies in its data
    file (apart from the other entries there: `validate` checked that): the tensors allocated for
    them then take no more memory than the folder's files hold, whatever sizes `.metadata`
    claims."""
    places: dict[str, list[tuple[int, str]]] = {}
    for key in keys:
        md = metadata.state_dict_metadata[key]
        for chunk in md.chunks:
            info = metadata.storage_data[MetadataIndex(key, chunk.offsets)]
            nbytes = math.prod(chunk.sizes) * md.properties.dtype.itemsize
            if info.length < nbytes:
                raise CorruptCheckpointError(
                    f"{os.path.join(path, info.relative_path)}: the chunk of '{key}' at {list(chunk.offsets)} holds "
                    f"{nbytes} bytes, but its storage entry only {info.length}; the checkpoint is damaged or crafted")
            places.setdefault(info.relative_path, []).append((info.offset + info.length, key))
    for name, ends in places.items():
        size = safe_open.file_size(path, name, "a data file named in .metadata")
        stop, key = max(ends)
        if stop > size:
            raise CorruptCheckpointError(f"{os.path.join(path, name)}: the storage entry of '{key}' claims bytes "
                                         f"up to {stop} of its {size}; the checkpoint is damaged or crafted")


def empty_state_dict(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """Uninitialised tensors of `shapes` and `dtypes`, split by rows over every rank when
    torch.distributed is initialised (so each rank holds about 1/N of the model)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {k: torch.empty(shape, dtype=dtypes[k], device="cpu") for k, shape in shapes.items()}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {k: dtensor.empty(*shape, dtype=dtypes[k], device_mesh=mesh, placements=[dtensor.Shard(0)])
            for k, shape in shapes.items()}


def _read_dcp(state: dict[str, Any], path: str) -> None:
    try:
        dcp.load(state, storage_reader=storage.make_storage_reader(path), planner=storage.make_load_planner())
    except CheckpointException as e:
        cause = storage.root_cause(e)
        if isinstance(cause, KeyboardInterrupt):
            raise cause from None
        raise CheckpointError(f"reading {path} failed: {type(cause).__name__}: {cause}") from None


def _write_dcp(state: dict[str, Any], path: str, hf_config: dict[str, Any], rope_layout: str) -> None:
    """A model-only DCP folder with the HF config it came from, the RoPE layout its q/k rows are
    in and a commit marker, loadable as `initial_load_path`."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == 0:
        durable.make_dir(path, exist_ok=True)
        durable.write_json(os.path.join(path, RECORDED_CONFIG), hf_config, indent=2)
        durable.write_json(os.path.join(path, RECORDED_LAYOUT), {"rope_layout": rope_layout})
    if dist.is_initialized():
        dist.barrier()
    dcp.save(state, storage_writer=storage.make_storage_writer(path), planner=storage.make_save_planner())
    if rank == 0:
        commit.write_marker(path, commit.CommitInfo(step=0, states=["model"], world_size=world))
    if dist.is_initialized():
        dist.barrier()
