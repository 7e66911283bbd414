"""Import a Hugging Face safetensors folder into a (possibly sharded) model state dict.

The names, shapes and dtypes in the folder's index and file headers are checked against what
the adapter expects before any tensor data is read. Then each rank reads, from the files
themselves, the byte ranges of its own shard of every tensor, straight into the shard's memory
(`torchtitan_ckpt.hf.shards`). The adapter's permuted tensors (Llama's `wq`/`wk`, whose rows move
within a head) cost each rank at most one head's rows more than its shard; no full tensor is
ever built.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..dcp.storage import dtensor_chunk
from ..errors import AdapterMismatchError, CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..errors import PartialLoadError, RankFailed, counted, few
from ..group import CheckpointGroup, cpu_world
from ..progress import fmt_bytes, gb_per_s
from .adapter import ForeignAdapter, HFSource, StateDictAdapter, as_adapter, check_names, read_index
from .files import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, is_model_file, is_unused_tensor
from .model_config import read_hf_config
from ..io import IO_THREADS, safe_open
from ..io.dtypes import converts
from ..io.materialised import check_materialised, check_tensor_dict
from ..io.posio import tensor_bytes
from ..io.tensors import local_values, memory_of, unwrapped_values
from ..io.untrusted import shown
from .safetensors_io import TensorEntry, read_exact, read_header
from .shards import plan_reads, read_all

logger = logging.getLogger(__name__)


def read_hf_layout(hf_dir: str) -> dict[str, TensorEntry]:
    """Name -> dtype, shape and position of every tensor of an HF folder (index + headers, no
    data), but for those `transformers` ignores too (`is_unused_tensor`: Llama-2's RoPE
    buffers), left out with a log line. A model file the index does not list is an error (an
    older copy left behind?); other safetensors files are another format's (Mistral's
    `consolidated.safetensors`), ignored with a log line, as `transformers` ignores them."""
    index, weight_map = _weight_map(hf_dir)
    _check_unlisted(hf_dir, index, set(weight_map.values()))
    unused = {name for name in weight_map if is_unused_tensor(name)}
    if unused:
        logger.info("%s: ignoring %s like %s, buffers that transformers recomputes from the config",
                    hf_dir, counted(len(unused), "tensor"), shown(min(unused)))
    entries: dict[str, TensorEntry] = {}
    for file in sorted(set(weight_map.values())):
        path = os.path.join(hf_dir, file)
        if not os.path.isfile(path):
            raise CheckpointNotFoundError(f"{index} lists {file}, which does not exist")
        header = read_header(path)
        for name in (n for n, f in weight_map.items() if f == file and n not in unused):
            if name not in header:
                raise CorruptCheckpointError(f"{index} puts {name} in {file}, whose header lacks it")
            entries[name] = header[name]
    return entries


def _weight_map(hf_dir: str) -> tuple[str, dict[str, str]]:
    """The file describing `hf_dir` (its index, else its one model file) and its tensor ->
    file map."""
    index = os.path.join(hf_dir, INDEX_FILE)
    if os.path.isfile(index):
        return index, read_index(index)
    if os.path.isfile(os.path.join(hf_dir, SINGLE_FILE)):
        index = os.path.join(hf_dir, SINGLE_FILE)
        if not (header := read_header(index)):  # else called a stray beside itself (`_check_unlisted`)
            raise CorruptCheckpointError(f"{index} holds no tensor: no model to read")
        return index, dict.fromkeys(header, SINGLE_FILE)
    if os.path.isfile(hf_dir):
        raise CheckpointNotFoundError(f"{hf_dir} is a file: name the folder that holds it (its {INDEX_FILE} or "
                                      f"{SINGLE_FILE} and config.json)")
    raise CheckpointNotFoundError(f"{hf_dir} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def _check_unlisted(hf_dir: str, index: str, listed: set[str]) -> None:
    """Refuse model files of `hf_dir` that `index` does not list; log other safetensors files."""
    unlisted = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors") and f not in listed)
    stale = [f for f in unlisted if is_model_file(f)]
    if stale:
        raise CheckpointError(f"{hf_dir} holds {stale} besides the checkpoint that "
                              f"{os.path.basename(index)} describes; move them away")
    if unlisted:
        logger.info("%s: ignoring %s, which %s does not list (not the model files of a Hugging Face export)",
                    hf_dir, unlisted, os.path.basename(index))


def load_hf(state_dict: dict[str, Any], hf_dir: str | os.PathLike[str], adapter: StateDictAdapter | Any,
            process_group: Any | None = None, num_threads: int = IO_THREADS,
            check: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Fill `state_dict` (our names; tensors or DTensors, read in place) from the HF folder
    `hf_dir`; call on every rank. Returns `state_dict`. Raises `AdapterMismatchError` naming
    the differing tensors, or `CheckpointError` naming wrong shapes or dtypes, before reading
    any data, when the folder is not the adapter's: every rank's checks (and the caller's
    `check()`) pass before any rank writes a tensor, and a failure after that is a
    `PartialLoadError`. Up to `num_threads` threads read on each rank, each its own stretch of
    the files front to back (`checkpoint.load_threads` in the manager): a few sequential
    streams keep a disk busier than one (one reads when most bytes need a buffer, e.g. a
    checkpoint in another dtype, since the threads would take turns at it). `adapter` is ours
    or any with TorchTitan's surface (`to_hf`, `from_hf`), which reads whole tensors."""
    check_tensor_dict(state_dict, "load_hf", num_threads)
    hf_dir = os.fspath(hf_dir)
    if adapter is None:
        raise TypeError("load_hf needs the model's state-dict adapter (adapter_for_hf_dir(hf_dir), or TorchTitan's)")
    adapter = as_adapter(adapter)
    start = time.perf_counter()
    group = CheckpointGroup(process_group or cpu_world())
    # with pipeline stages a rank holds part of the model: the folder must fit all ranks' names
    # (name -> shape and dtype, which an adapter of whole tensors is asked about)
    every: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for part in group.all_gather({name: (tuple(v.shape), v.dtype) for name, v in state_dict.items()}):
        every.update(part)
    planned: list[tuple[Callable[[], int], int]] = []
    try:  # every rank raises if one failed: its own error, or one naming the failing rank
        group.run(lambda: (check_materialised({k: unwrapped_values(v) for k, v in state_dict.items()}, "load_hf",
                                              "the state dict's"),
                           planned.append(_checked(state_dict, hf_dir, adapter, num_threads, every,
                                                   group.is_coordinator)), check()))
    except RankFailed as failed:
        failed.reraise(f"reading {hf_dir}")
    fill, total = planned[0]
    try:
        nbytes = group.run(fill)[group.rank]
    except RankFailed as failed:
        raise PartialLoadError(hf_dir, failed.error or failed) from failed.error
    secs = time.perf_counter() - start
    if group.is_coordinator:
        logger.info("loaded %s: %s (%s read by rank 0) in %.2f s, %.2f GB/s per rank", hf_dir,
                    fmt_bytes(total), fmt_bytes(nbytes), secs, gb_per_s(nbytes, secs))
    return state_dict


def _checked(state_dict: dict[str, Any], hf_dir: str, adapter: StateDictAdapter | ForeignAdapter, num_threads: int,
             every: dict[str, tuple[tuple[int, ...], torch.dtype]],
             log: bool = True) -> tuple[Callable[[], int], int]:
    """Check `hf_dir` against `state_dict` (this rank's part of the model whose names, shapes
    and dtypes, on all ranks, are `every`) and plan this rank's reads, writing nothing. Returns
    the function that reads them (returning the bytes read) and the bytes in the folder. `log`:
    whether this rank logs what the whole model leaves (the coordinator)."""
    all_sources = adapter.hf_sources(every)
    if all_sources is None:  # an adapter of whole tensors only (`ForeignAdapter`)
        return _read_through(state_dict, hf_dir, adapter, every, log)
    sources = {name: all_sources[name] for name in state_dict if name in all_sources}
    zeroed = [name for name in state_dict if name not in all_sources]  # the adapter's `unmapped`
    if zeroed and log:
        logger.info("%s: setting %d model tensor(s) that the Hugging Face format has no place for to zero, as its "
                    "model has none, e.g. %s", hf_dir, len(zeroed), zeroed[:3])
    layout = check_hf_dir(state_dict, hf_dir, sources, {n for s in all_sources.values() for n in s.hf_names},
                          adapter.tied_copies)
    with torch.no_grad():
        reads, seen = [], set()
        for name, source in sources.items():
            where = memory_of(state_dict[name])
            if where not in seen:  # tied weights: one tensor's memory under two names
                seen.add(where)
                reads += plan_reads(name, state_dict[name], source, layout)

    def fill() -> int:
        with torch.no_grad():
            for name in zeroed:
                local_values(state_dict[name]).zero_()
            return read_all(reads, num_threads)
    return fill, sum(e.nbytes for e in layout.values())


def check_hf_dir(state_dict: dict[str, Any], hf_dir: str, sources: dict[str, HFSource],
                 hf_names: Iterable[str] | None = None,
                 tied_copies: Collection[str] = ()) -> dict[str, TensorEntry]:
    """The layout of `hf_dir`, once the names, shapes and dtypes of the adapter's `sources` of
    `state_dict` (values need only a shape and a dtype: meta tensors do) are checked to fit.
    The folder holds `hf_names` (the whole model's, of which `state_dict` may be a pipeline
    stage's part; default: the names of `sources`). It may also hold `tied_copies` (the
    adapter's: a tied model's head) when its own `config.json` ties the embedding too (some tied
    checkpoints store the head as well, a copy of the embedding, and `transformers` ties it to
    the embedding): they are left unread, with a log line. Without such a config they are the
    folder's own head, which a tied model would lose: refused as names the adapter does not
    know."""
    layout = read_hf_layout(hf_dir)
    copies = sorted(set(tied_copies) & set(layout))
    if copies and _ties_embedding(hf_dir):
        logger.info("%s: ignoring %s: its config.json ties the embedding to the head, which is read from the "
                    "embedding", hf_dir, copies)
        layout = {name: entry for name, entry in layout.items() if name not in copies}
    check_names(hf_dir, layout, {n for s in sources.values() for n in s.hf_names} if hf_names is None else hf_names)
    _check_fit(hf_dir, state_dict, sources, layout)
    return layout


def _ties_embedding(hf_dir: str) -> bool:
    """Whether the `config.json` of `hf_dir` says tie_word_embeddings = true."""
    path = os.path.join(hf_dir, CONFIG_FILE)
    return os.path.isfile(path) and read_hf_config(path).tie_word_embeddings


def _read_through(state_dict: dict[str, Any], hf_dir: str, adapter: Any,
                  every: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  log: bool = True) -> tuple[Callable[[], int], int]:
    """For an adapter that converts whole tensors only (`ForeignAdapter`): each rank reads the tensors
    of its own part of the model whole (a pipeline stage's; with no stages, all of them) and
    converts them with `from_hf` while checking; the function returned copies its own part of each
    into `state_dict` and returns the bytes this rank read. `every` names the tensors of all ranks
    (with their shapes and dtypes). As TorchTitan's own manager does, only the HF tensors the
    adapter's `to_hf` names for the model's tensors (`_adapter_names`) are read and given to
    `from_hf`: one the folder lacks, for any rank, is an `AdapterMismatchError` naming it, before
    any is read; the folder's others (the Hub's DeepSeek-V3 MTP layer), which `from_hf` would fail
    on, are left unread, counted in one log line; the block scales of a named tensor stored in FP8
    (`<name>_scale_inv`) are read with it, for an adapter that dequantizes, and an FP8 value
    `from_hf` gives back for a tensor of another dtype is a `CheckpointError` (a cast would be
    silently wrong). `from_hf` must give back each tensor mapped, and nothing the model lacks, or
    `AdapterMismatchError` names the difference; the model's other tensors (TorchTitan 0.3.0's MoE
    `expert_bias_E`, which has no HF counterpart) keep their values, named in one log line (a
    warning when tensors of the folder go unread too: a misnaming adapter). Each value to be copied
    must be a whole plain tensor of the model's shape, else `CheckpointError` names it, before any
    is written; so must its dtype `converts` to the model's. An adapter whose `to_hf` cannot be
    asked tensor by tensor gets the HF tensors of the whole model on every rank (`_whole_names`).
    Returns that function and the bytes of the tensors all ranks read."""
    maps = _adapter_names(adapter, every)
    if maps is None:
        named, wanted = _whole_names(adapter, every)
    else:
        named, wanted = {name for name, hf in maps.items() if hf}, {h for hf in maps.values() for h in hf}
    layout, unread = _wanted_layout(hf_dir, wanted, log)
    part, whole = _own_part(adapter, layout, maps, state_dict)
    read = layout if part is None else {h: layout[h] for h in part}
    ours = adapter.from_hf(_read_whole(read))
    if quantized := sorted(name for name, value in ours.items() if name in every and isinstance(value, torch.Tensor)
                           and _fp8(value.dtype) and value.dtype != every[name][1]):
        raise CheckpointError(
            f"{hf_dir} stores {', '.join(quantized[:3])}{' and others' if len(quantized) > 3 else ''} in FP8 and "
            "the adapter's from_hf gives them back undequantized: cast to the model's dtype they would be wrong "
            "(their block scales unapplied). Dequantize the checkpoint first, or use an adapter that does")
    unknown, missing = set(ours) - set(every), (named if part is None else named & set(state_dict)) - set(ours)
    if unknown or missing:
        raise AdapterMismatchError(hf_dir, sorted(unknown), sorted(missing))
    left = [name for name in every if name not in named and name not in (ours if part is None else whole)]
    if left and log:  # with tensors of the folder unread too, maybe the adapter does not know the model's names
        logger.log(logging.WARNING if unread else logging.INFO, "%s: leaving %d tensor(s) of the model as they are, "
                   "which the adapter maps to no Hugging Face tensor: %s%s", hf_dir, len(left), few(left),
                   f"; and {len(unread)} tensor(s) of the folder are not read, which the adapter maps to no tensor "
                   "of the model: where it misnames them, these keep their initial values" if unread else "")
    wrong, not_whole = [], []
    for name, dest in state_dict.items():
        value = ours.get(name)
        if value is None:
            continue
        if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
            not_whole.append(f"{name} ({type(value).__name__})")
        elif tuple(value.shape) != tuple(dest.shape):
            wrong.append(f"{name}: {tuple(value.shape)} in the checkpoint, {tuple(dest.shape)} expected")
        elif not converts(value.dtype, dest.dtype):
            wrong.append(f"{name}: {value.dtype} from the adapter's from_hf, {dest.dtype} expected {_CASTS}")
    if not_whole:
        raise CheckpointError(
            f"reading {hf_dir}: the adapter's from_hf gives {', '.join(not_whole)}, not a whole torch.Tensor; "
            "a TorchTitan adapter used before for a sharded export keeps that export's sharding: load with a "
            "new adapter")
    if wrong:
        raise CheckpointError(f"{hf_dir} does not fit this model: {'; '.join(wrong)}")
    nbytes = sum(entry.nbytes for entry in read.values())

    def fill() -> int:
        with torch.no_grad():
            for name, dest in state_dict.items():
                if name not in ours or not dest.numel():  # FSDP2's local (0, 0) of a tensor of no elements
                    continue
                offsets, sizes = dtensor_chunk(tuple(dest.shape), dest.device_mesh, tuple(dest.placements)) \
                    if isinstance(dest, DTensor) else ((0,) * dest.dim(), tuple(dest.shape))
                local = local_values(dest)
                local.copy_(ours[name][tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
        return nbytes
    return fill, sum(entry.nbytes for entry in layout.values())


def _meta(every: dict[str, tuple[tuple[int, ...], torch.dtype]], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Plain meta tensors (no data, and none of a DTensor's sharding for TorchTitan's adapters to
    remember) of the model's tensors `names` (`every`: name -> shape and dtype)."""
    return {n: torch.empty(every[n][0], dtype=every[n][1], device="meta") for n in names}


def _adapter_names(adapter: Any, every: dict[str, tuple[tuple[int, ...], torch.dtype]]
                   ) -> dict[str, set[str]] | None:
    """The HF names the adapter maps each of the model's tensors to (`every`: name -> shape and
    dtype): what its `to_hf` gives for the tensor alone (`_meta`). A tensor it drops (TorchTitan
    0.3.0's MoE `expert_bias_E`; a tied head, which `from_hf` may still give back) maps to none.
    Where that differs from the model's whole `to_hf` (an HF tensor made of several, which `to_hf`
    gives only for all of them, as fused q, k and v or gate and up projections; a tied head it
    drops only beside the embedding), a tensor that maps to none or to names the whole does not
    give maps to the names the whole no longer gives without it. A tensor it cannot convert
    alone or leave out (an adapter that expects the others of a fused tensor) maps to what it
    gives for the tensors of its module, else of the one or two modules above it. None when
    `to_hf` fails on the whole model or on such a module."""
    def to_hf(names: Iterable[str]) -> set[str]:
        return set(adapter.to_hf(_meta(every, names)))

    def module(name: str) -> set[str]:
        parts = name.split(".")
        groups = [[n for n in every if n.startswith(".".join(parts[:-depth]) + ".")]
                  for depth in (1, 2, 3) if len(parts) > depth]
        for group in groups[:-1]:
            try:
                return to_hf(group)
            except Exception:  # noqa: BLE001 - it needs more of the tensors beside it
                continue
        return to_hf(groups[-1] if groups else [name])

    def alone(name: str) -> set[str]:
        try:
            return to_hf([name])
        except Exception:  # noqa: BLE001 - fused with tensors it expects beside it
            return module(name)

    def without(name: str) -> set[str]:
        try:
            return whole - to_hf(n for n in every if n != name)
        except Exception:  # noqa: BLE001 - the tensors fused with it expect it
            return module(name)
    try:
        whole = to_hf(every)
        maps = {name: alone(name) for name in every}
        if whole != {h for hf in maps.values() for h in hf}:
            for name in [name for name, hf in maps.items() if not hf or not hf <= whole]:
                maps[name] = without(name)
    except Exception as e:  # noqa: BLE001 - an adapter we do not know: the whole model's names only
        logger.debug("the adapter's to_hf fails on meta tensors (%r): every rank reads the whole model", e)
        return None
    return maps


def _whole_names(adapter: Any, every: dict[str, tuple[tuple[int, ...], torch.dtype]]
                 ) -> tuple[set[str], set[str] | None]:
    """For an adapter whose names are not known tensor by tensor (`_adapter_names`): the model's
    tensors `from_hf` gives back from the HF tensors `to_hf` gives for the whole model, and those
    HF names, asked with meta tensors (`_meta`); every tensor, and all of the folder's (None),
    where it cannot be asked so."""
    try:
        hf = adapter.to_hf(_meta(every, every))
        return set(adapter.from_hf(dict(hf))) & set(every), set(hf)
    except Exception as e:  # noqa: BLE001 - an adapter we do not know: require every tensor
        logger.debug("the adapter cannot convert meta tensors (%r): every tensor of the model is required from "
                     "the checkpoint, and every tensor of the folder read", e)
        return set(every), None


def _own_part(adapter: Any, layout: dict[str, TensorEntry], maps: dict[str, set[str]] | None,
              state_dict: dict[str, Any]) -> tuple[set[str] | None, set[str]]:
    """The HF tensors of `layout` (the whole model's) this rank reads for its part of the model
    (`state_dict`: a pipeline stage's), and the model's tensors `from_hf` gives back from all of
    `layout`; both found by asking `from_hf` about meta tensors of the folder's shapes. The first
    is the HF names `to_hf` maps the part's tensors to (`maps`) when `from_hf` converts them
    alone and gives back each of the part's tensors it gives back from the whole folder (a tied
    head comes from the embedding, which another stage holds); else None, every tensor of
    `layout`. Where `from_hf` cannot be asked, None and no tensor given back named."""
    if maps is None:
        return None, set()
    wanted = {h for name in state_dict for h in maps[name]}
    part = {h for h in layout if h in wanted or h.removesuffix(FP8_SCALE_SUFFIX) in wanted}

    def given_back(names: set[str]) -> set[str]:
        return set(adapter.from_hf({h: torch.empty(layout[h].shape, dtype=layout[h].dtype, device="meta")
                                    for h in names}))
    try:
        whole = given_back(set(layout))
        own = whole if part == set(layout) else given_back(part)
    except Exception as e:  # noqa: BLE001 - an adapter we do not know: it gets the whole folder
        logger.debug("the adapter's from_hf fails on meta tensors (%r): every rank reads every tensor", e)
        return None, set()
    return (part if whole & set(state_dict) <= own else None), whole


def _wanted_layout(hf_dir: str, wanted: set[str] | None, log: bool) -> tuple[dict[str, TensorEntry], list[str]]:
    """The layout of the tensors `wanted` of `hf_dir` (None: all of them), with the block scales
    of those stored in FP8, and the folder's other tensors' names: `AdapterMismatchError` names
    those the folder lacks; the others are left out, counted in one log line when `log`."""
    layout = read_hf_layout(hf_dir)
    if wanted is None:
        return layout, []
    if absent := wanted - set(layout):
        raise AdapterMismatchError(f"{hf_dir}: the adapter's to_hf maps the model to tensors the folder lacks "
                                   "(missing)", [], sorted(absent))
    wanted = wanted | {scale for name in wanted if name in layout and _fp8(layout[name].dtype)
                       and (scale := name + FP8_SCALE_SUFFIX) in layout}
    if (extra := sorted(set(layout) - wanted)) and log:
        logger.info("%s: ignoring %s of the folder that the model does not have, such as %s", hf_dir,
                    counted(len(extra), "tensor"), ", ".join(map(shown, extra[:3])))
    return {name: layout[name] for name in wanted}, extra


FP8_SCALE_SUFFIX = "_scale_inv"
"""`<tensor>_scale_inv`: the block scales of a tensor an FP8 checkpoint (DeepSeek-V3's, Qwen3-*-FP8)
stores in 8 bits, which a dequantizing adapter multiplies it by."""


def _fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _read_whole(layout: dict[str, TensorEntry]) -> dict[str, torch.Tensor]:
    """Every tensor of `layout`, whole, read by position from its file opened as `safe_open`
    opens one. Not through `safetensors`' own loader, which opens the file again by its name
    and maps it: a file cut short after `read_hf_layout` checked it would be its error, not one
    naming the truncation, or, once mapped, a SIGBUS that ends the process."""
    by_file: dict[str, list[tuple[str, TensorEntry]]] = {}
    for name, entry in layout.items():
        by_file.setdefault(entry.path, []).append((name, entry))
    out: dict[str, torch.Tensor] = {}
    for path, entries in sorted(by_file.items()):
        with safe_open.open_path(path, "a safetensors file") as f:
            for name, entry in sorted(entries, key=lambda ne: ne[1].offset):
                out[name] = torch.empty(entry.shape, dtype=entry.dtype, device="cpu")
                read_exact(f.fileno(), [tensor_bytes(out[name])], entry.offset, path)
    return out


_CASTS = "(floating-point dtypes are cast; others only into a dtype that holds each of their values)"


def _check_fit(hf_dir: str, state_dict: dict[str, Any], sources: dict[str, HFSource],
               layout: dict[str, TensorEntry]) -> None:
    """Every HF tensor has the shape of ours (of one row of ours for a grouped tensor), or
    `AdapterMismatchError` names both shapes; and a dtype that `converts` to ours (an integer
    that would wrap is refused), or `CheckpointError` names each one that does not."""
    shapes, wrong = ([], []), []
    for name, source in sorted(sources.items()):
        value = state_dict[name]
        expected = tuple(value.shape[1:]) if source.stack else tuple(value.shape)
        if source.stack and len(source.stack) != value.shape[0]:
            shapes[1].append(f"{name}: {len(source.stack)} experts, {value.shape[0]} expected")
        for hf in source.hf_names:
            entry = layout[hf]
            if tuple(entry.shape) != expected:
                shapes[0].append(f"{hf} {list(entry.shape)}")
                shapes[1].append(f"{hf} {list(expected)}")
            elif source.row_order and (not entry.shape or entry.shape[0] % source.block_rows):
                wrong.append(f"{hf}: {tuple(entry.shape)} is not made of whole blocks of "
                             f"{source.block_rows} rows, which the adapter reorders")
            elif not converts(entry.dtype, value.dtype):
                wrong.append(f"{hf}: {entry.dtype} in {os.path.basename(entry.path)}, {value.dtype} expected {_CASTS}")
    if shapes[1]:
        raise AdapterMismatchError(f"{hf_dir}: shapes in the checkpoint (unknown) vs this model's (missing)",
                                   sorted(set(shapes[0])), sorted(set(shapes[1])))
    if wrong:
        raise CheckpointError(f"{hf_dir} does not fit this model: {'; '.join(dict.fromkeys(wrong))}")
