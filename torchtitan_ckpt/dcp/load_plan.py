"""A rank's DCP load plan, with each distinct chunk layout worked out once.

DCP's default local load plan finds, for every tensor of the state, the chunks this rank holds
(for a DTensor, from its mesh and placements) and their overlaps with the chunks the checkpoint
saved. A model's layers repeat the same shapes, placements and saved chunks, so nearly all of
that work repeats: here the chunks are found once per distinct (DTensor shape, mesh,
placements) and the overlaps once per distinct (saved chunks, local chunks), by DCP's own
functions, and each tensor's read items are those with its name. The plan is the one DCP's
planner makes, item for item; a state with values the checkpoint lacks or of other sizes, or
that DCP would read as a checkpoint of torch 2.3, is left to DCP's planner, which has the rules
(and the errors) for those.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint._traverse import traverse_state_dict_v_2_3  # as DCP's planner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor, Partial

_Chunks = tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


def _key(chunks) -> _Chunks:
    return tuple((tuple(c.offsets), tuple(c.sizes)) for c in chunks)


def _named(item: ReadItem, fqn: str) -> ReadItem:
    """`item` for the tensor `fqn` (the items of equal layouts differ in their names only)."""
    dest, storage = item.dest_index, item.storage_index
    return ReadItem(type=item.type, dest_index=MetadataIndex(fqn, dest.offset, dest.index),
                    dest_offsets=item.dest_offsets, storage_index=MetadataIndex(fqn, storage.offset, storage.index),
                    storage_offsets=item.storage_offsets, lengths=item.lengths)


def _read_as_older(original: dict[str, Any], missing: set[str]) -> bool:
    """Whether DCP's planner would read the checkpoint as one saved before torch 2.4 (some of
    the keys it has and the state lacks are keys of the state flattened as 2.3 did), or refuse
    the state so flattened (a key twice)."""
    older: list[str] = []
    traverse_state_dict_v_2_3(original, lambda path, _value: older.append(".".join(map(str, path))))
    return bool(missing.intersection(older)) or len(set(older)) < len(older)  # DCP refuses a repeated key


def matches(state_dict: dict[str, Any], metadata: Metadata, original: dict[str, Any] | None) -> bool:
    """Whether `local_load_plan` plans this load as DCP's planner would: every value of the
    flattened state is in the checkpoint, each tensor a plain tensor or DTensor of its saved
    size. The checkpoint may hold more (another rank's values), unless the state unflattened
    (`original`, None when the planner does not flatten) says it is an older checkpoint."""
    saved = metadata.state_dict_metadata
    if not state_dict.keys() <= saved.keys():
        return False  # DCP's planner refuses them, or skips them in a partial load
    for fqn, obj in state_dict.items():
        md = saved[fqn]
        if isinstance(md, BytesStorageMetadata):
            if isinstance(obj, torch.Tensor):
                return False
        elif type(obj) not in (torch.Tensor, torch.nn.Parameter, DTensor) or md.size != obj.size():
            return False
        elif type(obj) is DTensor and (type(obj.to_local()) not in (torch.Tensor, torch.nn.Parameter)
                                       or any(isinstance(p, Partial) for p in obj.placements)):
            return False  # a local tensor of its own kind makes its own chunks; DCP refuses a Partial
    missing = saved.keys() - state_dict.keys()
    return not (missing and original is not None and _read_as_older(original, missing))


def local_load_plan(state_dict: dict[str, Any], metadata: Metadata) -> LoadPlan:
    """The local load plan of DCP's default planner for a state that `matches` the checkpoint."""
    chunks: dict[tuple, list[ChunkStorageMetadata]] = {}
    made: dict[tuple[_Chunks, _Chunks], list[ReadItem]] = {}
    requests: list[ReadItem] = []
    for fqn, obj in state_dict.items():
        md = metadata.state_dict_metadata[fqn]
        if isinstance(md, BytesStorageMetadata):
            requests.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn),
                                     dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(fqn),
                                     storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
            continue
        if type(obj) is DTensor:
            if obj.device_mesh.get_coordinate() is None:  # this rank holds none of it
                continue
            where = (obj.shape, obj.device_mesh, obj.placements)
            try:
                local = chunks.get(where)
            except TypeError:  # a placement of the user's own that does not hash
                where = local = None
            if local is None:
                local = obj.__create_chunk_list__()
                if where is not None:
                    chunks[where] = local
        else:
            local = [ChunkStorageMetadata(offsets=torch.Size([0] * obj.dim()), sizes=obj.size())]
        layout = (_key(md.chunks), _key(local))
        if layout in made:
            requests += [_named(item, fqn) for item in made[layout]]
        else:
            made[layout] = create_read_items_for_chunk_list(fqn, md, local)
            requests += made[layout]
    return LoadPlan(requests)
