"""Export a (possibly sharded) model state dict as a Hugging Face safetensors folder.

Every rank takes part, each with the tensors it holds (with pipeline stages, part of the model:
the tensors of all ranks must make up the whole). The adapter renames (and for `wq`/`wk`
permutes) the tensors, floating tensors are cast to the export dtype, the ranks agree on one plan
from the blocks each holds (`hf.consolidate.plan_one_pass`), and the file split comes from the
adapter's assets or `plan_files` over the whole model. The bytes are then written by
`hf.consolidate` in one of three modes (`checkpoint.consolidation`): `one_pass` (default) writes
the final files directly, each rank its own bytes at their final offsets; `all_ranks` and `rank0`
first save per-rank shard files through DCP's `HuggingFaceStorageWriter`, then consolidate them
on every rank or on rank 0. Rank 0 reads the `config.json` to write (the assets', refused unless
it describes the adapter's model) and the assets' generation and tokenizer files (`ASSET_FILES`),
then clears the folder and writes them before any tensor file is created; the index is written last, once every byte (`config.json` included) is durable:
a folder with an index is complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import typing
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from ..dcp.storage import root_cause
from ..io import IO_THREADS, durable, safe_open
from ..io.dtypes import CAST_ON_EXPORT, exported_state
from ..io.materialised import check_materialised, check_tensor_dict
from ..io.untrusted import shown
from .consolidate import OnePassPlan, clear_model_files, consolidate_safetensors, plan_one_pass
from .consolidate import write_safetensors_one_pass
from ..errors import AdapterMismatchError, CheckpointError, RankFailed, counted, few
from ..config import Checkpoint, Consolidation
from ..group import CheckpointGroup, cpu_world
from ..progress import fmt_bytes, gb_per_s
from .adapter import ForeignAdapter, PermutedRows, RowOf, StateDictAdapter, as_adapter, check_names
from .files import (ASSET_FILES, CONFIG_FILE, INDEX_FILE, MAX_ASSET_BYTES, SAFETENSORS_DTYPES, TEMPLATES,
                    is_dcp_shard_file)
from .planner import parse_size, plan_files

logger = logging.getLogger(__name__)

MODES = typing.get_args(Consolidation)
SHARDS = "sharded"
"""Subfolder of the per-rank shard files in the two-phase modes (removed once consolidated)."""


def save_hf(model_state_dict: dict[str, Any], out_dir: str | os.PathLike[str], adapter: StateDictAdapter | Any, *,
            dtype: torch.dtype | None = None, max_shard_size: str | int = Checkpoint.hf_max_shard_size,
            process_group: Any | None = None, mode: str = Checkpoint.consolidation, num_threads: int = IO_THREADS,
            keep_shards: bool = False, progress: Callable[[int, int], None] | None = None,
            shared: bool = True) -> None:
    """Write `model_state_dict` (our names) to `out_dir` in HF format; call on every rank.
    Floating tensors are cast to `dtype` when given. The split follows the adapter's assets'
    index, else `plan_files(..., max_shard_size)`. `mode` is one of `MODES`. `progress(nbytes,
    total)` hears of the final files' bytes this rank writes. The ranks of `process_group`
    (default: every rank, as for `load_hf`) take part. Without `shared` (each rank has its own
    `out_dir`, to be combined by an object store's upload), `mode` must be `one_pass`: each
    rank's copy of a file holds its own bytes only, zeros elsewhere. `adapter` is ours or any
    with TorchTitan's surface (`to_hf`, `from_hf`; the export then copies the `config.json` of
    its `hf_assets_path`)."""
    if mode not in MODES:
        raise ValueError(f"unknown HF export mode {mode!r}; expected one of {', '.join(MODES)}")
    if not shared and mode != "one_pass":
        raise ValueError(f"HF export mode {mode!r} needs a folder every rank shares; use one_pass")
    if dtype is not None and dtype not in CAST_ON_EXPORT:
        raise ValueError(f"dtype = {dtype}: an export is cast to one of {', '.join(map(str, CAST_ON_EXPORT))}, "
                         "or keeps the model's dtypes (None)")
    check_tensor_dict(model_state_dict, "save_hf", num_threads)
    start = time.perf_counter()
    out_dir = os.fspath(out_dir)
    if adapter is None:
        raise TypeError("save_hf needs the model's state-dict adapter (adapter_for_hf_dir, or TorchTitan's)")
    adapter = as_adapter(adapter)
    group = CheckpointGroup(process_group or cpu_world())
    plan = _plan(group, adapter, model_state_dict, dtype)
    hf_sd = plan.state_dict
    if not plan.specs:
        raise CheckpointError(f"exporting to {out_dir}: the model has no tensors")
    mapping = assets_file_split(adapter, plan.specs, log=group.rank == 0) or \
        plan_files({name: spec.nbytes for name, spec in plan.specs.items()}, parse_size(max_shard_size))
    dtypes = [SAFETENSORS_DTYPES[spec.dtype] for spec in plan.specs.values()]  # the model's: its first float's
    config_dtype = dtype or next((d for d in dtypes if d.is_floating_point), dtypes[0])

    def prepare(sync: bool) -> list[str]:  # on rank 0; the config is read (and checked) before the folder is touched
        try:
            config, assets = adapter.export_config(config_dtype), read_assets(adapter.hf_assets_path)
            return _clear_and_write_config(out_dir, config, assets, sync)
        except OSError as e:
            raise CheckpointError(f"preparing {out_dir} failed on rank 0: {type(e).__name__}: {e}") from e

    if mode == "one_pass":  # rank 0 fsyncs config.json with its tensor data
        write_safetensors_one_pass(hf_sd, out_dir, mapping, process_group=group.pg, num_threads=num_threads,
                                   progress=progress, plan=plan, prepare=lambda: prepare(False), shared=shared)
    else:
        try:
            group.run(lambda: prepare(True), coordinator_only=True)
        except RankFailed as failed:
            failed.reraise(f"preparing {out_dir}")
        shards = os.path.join(out_dir, SHARDS)
        writer = HuggingFaceStorageWriter(shards, save_distributed=True, fqn_to_index_mapping=mapping)
        try:
            whole, gathered = _whole_tensors(hf_sd)
            if gathered and group.rank == 0:
                logger.warning("%s (%s): every rank gathers the sharded weights it exports whole (experts, q/k "
                               "projections whose shards cut a head), %s held at once on each: consolidation = "
                               "'one_pass' writes them from the ranks holding them", out_dir, mode,
                               fmt_bytes(gathered))
            with group.carrying():
                dcp.save(whole, storage_writer=writer, process_group=group.pg)
        except CheckpointException as e:  # a BaseException, past a training loop's `except Exception`
            root = root_cause(e, group.rank)
            raise root from root.__cause__  # DCP's wrapping left out, the failure's own cause kept
        consolidate_safetensors(shards, out_dir, mapping, process_group=group.pg, num_threads=num_threads,
                                remove_shards=not keep_shards, all_ranks=mode == "all_ranks", progress=progress,
                                shapes={name: spec.shape for name, spec in plan.specs.items()})
    if group.rank == 0:
        secs = time.perf_counter() - start
        total = sum(spec.nbytes for spec in plan.specs.values())
        logger.debug("exported %s (%s): %s, %s in %.2f s, %.2f GB/s", out_dir, mode,
                    counted(len(set(mapping.values())), "file"), fmt_bytes(total), secs, gb_per_s(total, secs))


def _plan(group: CheckpointGroup, adapter: StateDictAdapter | ForeignAdapter, state_dict: dict[str, Any],
          dtype: torch.dtype | None) -> OnePassPlan:
    """Every rank's tensors cast to `dtype`, converted to HF names and planned in one collective
    step (a pipeline stage's rank converts its part), so that a failure on one rank (a cast that
    finds no memory) fails every rank there; then the ranks' tensors together must be the whole
    model, checked alike on every rank."""
    def converted() -> dict[str, Any]:  # a tensor without memory fails the export before its folder is touched
        check_materialised(state_dict, "save_hf", "the state dict's", export=True)
        return adapter.to_hf(exported_state(state_dict, dtype, widen=True), complete=False)

    plan = plan_one_pass(converted, group, adapter.hf_names)
    if adapter.hf_names is not None:
        check_names("the ranks' state dicts -> HF", plan.specs, adapter.hf_names)
    return plan


def _whole_tensors(hf_sd: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """`RowOf` experts and `PermutedRows` as tensors, for the two-phase modes' DCP save: a sharded
    grouped weight is gathered (once) on every rank, as is a q/k projection whose shards cut a
    head, which `one_pass`, writing each expert and each row from the rank that holds it, avoids;
    with the bytes so gathered, all held until the save ends. A tensor that is not contiguous is
    packed: PyTorch's safetensors writer refuses it. One of no elements is whole on every rank."""
    full: dict[int, torch.Tensor] = {}
    out, gathered = {}, 0
    for name, value in hf_sd.items():
        if isinstance(value, PermutedRows):
            value = value.full()
            gathered += value.numel() * value.element_size()
        elif isinstance(value, RowOf):
            if id(value.tensor) not in full:
                t = value.tensor
                full[id(t)] = t.full_tensor() if isinstance(t, DTensor) else t
                gathered += t.numel() * t.element_size() if isinstance(t, DTensor) else 0
            value = full[id(value.tensor)][value.index]
        elif isinstance(value, DTensor) and not value.numel():  # FSDP2 shards it as (0, 0): its shape is lost
            value = torch.empty(value.shape, dtype=value.dtype, device="cpu")
        if isinstance(value, DTensor) and not _plain(value.to_local()):  # a transposed shard, say
            value = DTensor.from_local(_values(value.to_local()), value.device_mesh, value.placements,
                                       shape=value.shape, stride=torch.empty(value.shape, device="meta").stride())
        elif isinstance(value, torch.Tensor) and not _plain(value):
            value = _values(value)
        out[name] = value
    return out, gathered


def _plain(t: torch.Tensor) -> bool:
    """Whether `t`'s memory holds its values in order: contiguous, and not a lazily conjugated
    or negated view (`x.conj()`, `x.conj().imag`), whose memory holds other values than it
    shows and which the safetensors writer would write as they lie."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _values(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` whose memory holds its values in order (`_plain`)."""
    return t.resolve_conj().resolve_neg().contiguous()


def assets_file_split(adapter: Any, exported: Collection[str], log: bool = True) -> dict[str, int] | None:
    """HF name -> file index of the `exported` tensors, from the adapter's assets' index (None
    without one). An exported tensor it lacks is an `AdapterMismatchError` naming it. Its other
    names (the Hub's DeepSeek-V3 MTP layer, an FP8 checkpoint's `weight_scale_inv`s, a tied
    checkpoint's copy of the embedding, Llama-2's RoPE buffers) are left out, counted in a log
    line when `log`: a file only they fill is not written, and the files after it are numbered
    on (`plan_output_files`)."""
    mapping, exported = adapter.fqn_to_index_mapping, set(exported)
    if mapping is None:
        return None
    where = f"{adapter.hf_assets_path}/{INDEX_FILE}"
    if missing := exported - set(mapping):
        raise AdapterMismatchError(f"{where}, the file split of the adapter's hf_assets_path, lacks tensors the "
                                   "model exports (missing)", [], sorted(missing))
    if (extra := sorted(set(mapping) - exported)) and log:
        logger.info("%s: leaving %s of the file split out of the export, which the model does not have, "
                    "such as %s", where, counted(len(extra), "tensor"), ", ".join(map(shown, extra[:3])))
    return {name: i for name, i in mapping.items() if name in exported}


def read_assets(hf_assets_path: str | None) -> dict[str, bytes]:
    """The assets' files of `ASSET_FILES` there are (a hub cache's links to its blobs followed),
    each at most `MAX_ASSET_BYTES`, and the templates of `TEMPLATES` (at most that in all), by
    path in the folder."""
    if hf_assets_path is None:
        return {}
    assets = {name: safe_open.read_bounded(os.path.join(hf_assets_path, name), f"the assets' {name}",
                                           MAX_ASSET_BYTES)
              for name in ASSET_FILES if os.path.isfile(os.path.join(hf_assets_path, name))}
    templates = os.path.join(hf_assets_path, TEMPLATES)
    if os.path.isdir(templates):
        left, others = MAX_ASSET_BYTES, []
        for name in sorted(os.listdir(templates)):
            if not _TEMPLATE.fullmatch(name) or not os.path.isfile(os.path.join(templates, name)):
                others.append(name)
                continue
            data = safe_open.read_bounded(os.path.join(templates, name), f"the assets' {TEMPLATES}", left)
            assets[f"{TEMPLATES}/{name}"], left = data, left - len(data)
        if others:
            logger.warning("%s: %s, not a chat template's file (NAME.jinja, of letters, digits, '_', '-' and '.'); "
                           "not exported", templates, few([shown(name) for name in others], 3))
    return assets


_TEMPLATE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.jinja", re.ASCII)


def _clear_and_write_config(out_dir: str, config: dict[str, Any], assets: dict[str, bytes], sync: bool) -> list[str]:
    """Make `out_dir` exist and hold no earlier export (`_clear`), then write `config.json` and
    the assets' other files (durably with `sync`; else the caller fsyncs them); returns their
    paths. A link there is replaced, never written through: a hub cache's `config.json` links to
    a blob of the cache, and any link may lead out of the folder. Not atomically: the folder has
    no index until the export is done."""
    durable.make_dir(out_dir, exist_ok=True)
    _clear(out_dir)
    _tell_left_assets(out_dir, assets)
    files = {CONFIG_FILE: json.dumps(config, indent=2).encode(), **assets}
    templates = any(name.startswith(TEMPLATES + "/") for name in files)
    if templates:
        _own_folder(os.path.join(out_dir, TEMPLATES))
    for name, data in files.items():
        with os.fdopen(durable.create_replacing(os.path.join(out_dir, name)), "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
    if sync:
        if templates:
            durable.fsync_path(os.path.join(out_dir, TEMPLATES))
        durable.fsync_path(out_dir)
    return [os.path.join(out_dir, name) for name in files]


def _own_folder(path: str) -> None:
    """Make the folder `path` of an export (a link there is replaced, never followed)."""
    if os.path.islink(path) or os.path.lexists(path) and not os.path.isdir(path):
        os.remove(path)
    durable.make_dir(path, exist_ok=True)


def _tell_left_assets(out_dir: str, assets: dict[str, bytes]) -> None:
    """Warn of the tokenizer and generation files an earlier export (or the user) left in
    `out_dir` that these assets do not replace: they are not removed (they may be the user's),
    and `AutoTokenizer` would read them with the new ones (an old `chat_template.jinja` wins over
    the new assets' template inside `tokenizer_config.json`)."""
    templates = os.path.join(out_dir, TEMPLATES)
    found = [name for name in ASSET_FILES if os.path.lexists(os.path.join(out_dir, name))]
    if os.path.isdir(templates) and not os.path.islink(templates):
        found += [f"{TEMPLATES}/{name}" for name in sorted(os.listdir(templates))]
    if left := [name for name in found if name not in assets]:
        logger.warning("%s: %s left from before, which the assets of this export do not have: they stay, and "
                       "transformers reads them with this export's files; remove them if they belong to an earlier "
                       "export", out_dir, ", ".join(map(shown, left)))


def _clear(out_dir: str) -> None:
    """Remove an earlier export's files from `out_dir`: the index first (the folder stops being
    complete), then the model files, then the shard files a two-phase export kept in `SHARDS`
    (which the next two-phase export would consolidate with its own). Files of other names,
    another format's (Mistral's `consolidated.safetensors`) or the user's, stay. A link named
    `SHARDS` is removed, never followed: the shards are written, then deleted, in a folder of
    the export's own."""
    clear_model_files(out_dir)
    shards = os.path.join(out_dir, SHARDS)
    if os.path.islink(shards):
        os.remove(shards)
    elif os.path.isdir(shards):
        for name in filter(is_dcp_shard_file, os.listdir(shards)):
            os.remove(os.path.join(shards, name))
        if not os.listdir(shards):
            os.rmdir(shards)
