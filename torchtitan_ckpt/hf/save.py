"""Export a (possibly sharded) model state dict as a Hugging Face safetensors folder.

Every rank takes part. File i of N is written by rank (i-1) % world_size; each tensor is
gathered to a full tensor in file order (`DTensor.full_tensor()`, cast to the export dtype
first so less is sent), and only the writing rank keeps it, streaming it into its file. Peak
extra memory per rank is one full tensor, plus the adapter's full `wq`/`wk` (see
`adapter.permute_rows`). Once every file is fsynced on every rank, rank 0 writes `config.json`
and then `model.safetensors.index.json`, last, each to a temporary name that is fsynced and
renamed: a folder with an index is complete.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from ..group import CheckpointGroup
from .adapter import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, StateDictAdapter, check_names
from .planner import parse_size, plan_files
from .safetensors_io import SafetensorsWriter, TensorEntry

logger = logging.getLogger(__name__)


def file_name(index: int, n_files: int) -> str:
    return f"model-{index:05d}-of-{n_files:05d}.safetensors"


def save_hf(model_state_dict: dict[str, Any], out_dir: str, adapter: StateDictAdapter, *,
            dtype: torch.dtype | None = None, max_shard_size: str | int = "5GB",
            process_group: Any | None = None) -> None:
    """Write `model_state_dict` (our names) to `out_dir` in HF format; call on every rank.
    Floating tensors are cast to `dtype` when given. The split follows the adapter's assets'
    index, else `plan_files(..., max_shard_size)`."""
    start = time.perf_counter()
    group = CheckpointGroup(process_group)
    rank, world = group.rank, group.world_size
    hf_sd = {name: _cast(v, dtype) for name, v in adapter.to_hf(model_state_dict).items()}
    entries = {name: TensorEntry(v.dtype, tuple(v.shape)) for name, v in hf_sd.items()}
    mapping = adapter.fqn_to_index_mapping
    if mapping is None:
        mapping = plan_files({n: e.nbytes for n, e in entries.items()}, parse_size(max_shard_size))
    else:
        check_names(f"file split of {adapter.hf_assets_path}/{INDEX_FILE}", mapping, entries)
    n_files = max(mapping.values())
    error = _try(_clear, out_dir) if rank == 0 else None
    _agree(group, error, "preparing " + out_dir)
    for index in range(1, n_files + 1):
        names = [n for n in hf_sd if mapping[n] == index]
        path = os.path.join(out_dir, file_name(index, n_files))
        writer = (index - 1) % world
        error = _write_file(path, names, hf_sd, entries, writer == rank, error)
        if rank == 0:  # takes part in every file's gathers, so it can report progress
            logger.info("[%d/%d] %s: %.1f MB, written by rank %d", index, n_files,
                        os.path.basename(path), sum(entries[n].nbytes for n in names) / 1e6, writer)
    _agree(group, error, "writing " + out_dir)
    if rank == 0:
        config = adapter.export_config(dtype or next(iter(entries.values())).dtype)
        weight_map = {n: file_name(mapping[n], n_files) for n in sorted(entries)}
        error = _try(_write_config_and_index, out_dir, config, weight_map, entries)
        secs = time.perf_counter() - start
        total = sum(e.nbytes for e in entries.values()) / 1e9
        logger.info("exported %s: %d file(s), %.3f GB in %.2f s, %.2f GB/s", out_dir, n_files,
                    total, secs, total / max(secs, 1e-9))
    _agree(group, error, "writing the index of " + out_dir)


def _try(fn, *args) -> OSError | None:
    """Run `fn`; return its OSError (for every rank to learn of) instead of raising it."""
    try:
        fn(*args)
    except OSError as e:
        return e
    return None


def _write_config_and_index(out_dir: str, config: dict[str, Any], weight_map: dict[str, str],
                            entries: dict[str, TensorEntry]) -> None:
    """`config.json`, then the index last: once the index exists, the folder is complete."""
    _write_json_durably(os.path.join(out_dir, CONFIG_FILE), config)
    total = sum(e.nbytes for e in entries.values())
    _write_json_durably(os.path.join(out_dir, INDEX_FILE),
                        {"metadata": {"total_size": total}, "weight_map": weight_map})


def _cast(value: Any, dtype: torch.dtype | None) -> Any:
    return value.to(dtype) if dtype is not None and torch.is_floating_point(value) else value


def _write_file(path: str, names: list[str], hf_sd: dict[str, Any], entries: dict[str, TensorEntry],
                mine: bool, error: BaseException | None) -> BaseException | None:
    """Gather each tensor of one file (a collective: every rank runs this for every file) and,
    on the writing rank, stream it to disk. A write failure is returned, not raised, so the
    rank keeps taking part in the gathers and every rank learns of it afterwards."""
    writer = None
    if mine and error is None:
        try:
            writer = SafetensorsWriter(path, {n: entries[n] for n in names})
        except OSError as e:
            error = e
    for name in names:
        value = hf_sd[name]
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if writer is not None and error is None:
            try:
                writer.add(name, full)
            except (OSError, ValueError) as e:
                error = e
        del full
    if writer is not None:
        try:
            writer.close()
        except (OSError, ValueError) as e:
            error = error or e
    return error


def _clear(out_dir: str) -> None:
    """Make `out_dir` exist and hold no earlier export: the index goes first (the folder stops
    being complete), then the tensor files."""
    os.makedirs(out_dir, exist_ok=True)
    index = os.path.join(out_dir, INDEX_FILE)
    if os.path.exists(index):
        os.remove(index)
    for old in glob.glob(os.path.join(out_dir, "model-*-of-*.safetensors")) + \
            glob.glob(os.path.join(out_dir, SINGLE_FILE)):
        os.remove(old)


def _write_json_durably(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _agree(group: CheckpointGroup, error: BaseException | None, what: str) -> None:
    """Every rank raises if any rank failed (a barrier too)."""
    failures = group.gather_errors(error)
    if failures:
        rank, cause = failures[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {cause}") from error
