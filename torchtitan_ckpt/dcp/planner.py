"""The DCP save planner that applies a dedup policy (`policy.dedup`) to every rank's plan.

`DedupSavePlanner` turns DCP's local save plans into the plain layouts the policies take, and
the policies' assignment back into plans; `PlanCache` keeps the last save's plans so a state
whose layout did not change is not planned again.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import pickle
from dataclasses import dataclass
import logging
import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # DCP's own keys, as its planner
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from ..io import torch_archive
from . import validate
from ..errors import UnsafePickleError
from ..policy.dedup import Assignment, DedupSummary, Item, Key, Write, make_policy, summarize

logger = logging.getLogger(__name__)

def _key(item: WriteItem) -> Key:
    # the index hint (`MetadataIndex.index`) differs between ranks and is not part of the identity
    return (item.index.fqn, tuple(item.index.offset or ()))


def item_bytes(item: WriteItem) -> int:
    """Bytes a rank writes for `item` (its chunk, not the whole tensor; 0 for a value's)."""
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def _item(item: WriteItem) -> Item:
    if item.tensor_data is None:
        return Item(0)
    sizes = item.tensor_data.chunk.sizes
    return Item(item_bytes(item), sizes[0] if sizes else 0)


def layout_of(plans: Sequence[SavePlan]) -> list[dict[Key, Item]]:
    """The layout described by every rank's local save plan (rank i's plan at index i)."""
    return [{_key(w): _item(w) for w in plan.items} for plan in plans]


def writers_of(plans: Sequence[SavePlan]) -> Assignment:
    """The assignment made by deduplicated plans whose items are written whole (DCP's own dedup)."""
    return {_key(w): [Write(rank)] for rank, plan in enumerate(plans) for w in plan.items}


def _check_alike(plans: Sequence[SavePlan]) -> None:
    """Every rank that holds a tensor holds it alike: one whole shape and dtype, and a piece at
    one offset of one size. Ranks whose models differ (a replica built with another width or
    dtype), or a state of each rank's own tensor under one name, would otherwise give one step
    of both, each piece taken from one of them: the step's shapes would fit neither, or its
    dtypes be mixed without a word."""
    seen: dict[str, tuple[int, tuple, dict]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            data = item.tensor_data
            if data is None:
                continue
            whole = (tuple(data.size), data.properties.dtype)
            first, first_whole, pieces = seen.setdefault(item.index.fqn, (rank, whole, {}))
            offset, sizes = tuple(data.chunk.offsets), tuple(data.chunk.sizes)
            if whole != first_whole:
                differ = f"{_shape(*first_whole)} and {_shape(*whole)}"
            elif pieces.setdefault(offset, sizes) != sizes:
                differ = f"pieces at {list(offset)} of {list(pieces[offset])} and {list(sizes)} elements"
            else:
                continue
            raise ValueError(f"ranks {first} and {rank} hold {item.index.fqn} otherwise ({differ}): the ranks save one "
                             "tensor of each name, so the ranks' models differ, or a state keeps each rank's own "
                             "tensor under one name (key it by rank: docs/quickstart.md)")


def _shape(size: tuple, dtype: torch.dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(size)}"


def _slice(item: WriteItem, rows: range) -> WriteItem:
    """The write of `rows` of `item` (relative to its chunk): a chunk of its own, so a SHARD."""
    chunk = item.tensor_data.chunk
    offsets = torch.Size([chunk.offsets[0] + rows.start, *chunk.offsets[1:]])
    sizes = torch.Size([len(rows), *chunk.sizes[1:]])
    data = dataclasses.replace(item.tensor_data, chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes))
    return WriteItem(index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD, tensor_data=data)


def apply_assignment(rank: int, plan: SavePlan, assignment: Assignment) -> SavePlan:
    """Rank `rank`'s plan, keeping only what the assignment gives it (slices as their own items)."""
    items = []
    for item in plan.items:
        for write in assignment[_key(item)]:
            if write.rank == rank:
                items.append(item if write.rows is None else _slice(item, write.rows))
    return dataclasses.replace(plan, items=items)


@dataclass
class PlanCache:
    """What the last save of one kind of state planned, kept between saves (one per manager and
    kind) so that an unchanged plan is neither sent to the coordinator nor planned again: a
    training job saves the same tensors and values every time, only their contents change, and
    planning and shipping the plans is a noticeable part of a save (`docs/performance.md`).
    Reset it after a failed save, so every rank starts over together."""

    local: SavePlan | None = None
    """This rank's local plan of the last save."""
    layout: tuple | None = None
    """The `layout_key` of the state `local` was planned from."""
    final: SavePlan | None = None
    """This rank's final plan (with its file prefix) of the last save."""
    all_local: list[SavePlan] | None = None
    """Coordinator: every rank's local plan, as planned globally last time."""
    metadata: Metadata | None = None
    summary: DedupSummary | None = None

    def tensor_writes(self, state_dict: Mapping[str, object]) -> list[WriteItem] | None:
        """The tensor writes of this rank's final plan of the last save, when `state_dict` (as
        handed to `dcp.save`) has the layout that save was planned from: unless another rank's
        state changed, this save plans the same writes, so they may start before DCP plans.
        None when there is no such plan."""
        if self.final is None or self.layout is None:
            return None
        if layout_key(flatten_state_dict(dict(state_dict))[0]) != self.layout:
            return None
        return [item for item in self.final.items if item.tensor_data is not None]


def layout_key(state_dict: Mapping[str, object]) -> tuple | None:
    """Everything DCP's local save plan of a flattened state dict is computed from: per value its
    name and, for a tensor, its global shape, dtype, layout, autograd and pinning flags, and for a
    DTensor also its mesh and placements (the local shard's place follows from those). Equal keys
    give equal plans, so a cached plan stands in for planning again, and the key costs a small
    fraction of planning every DTensor's shard anew. None
    when a value plans itself in a way the key does not describe (a tensor subclass, such as
    `ShardedTensor` or a DTensor subclass; a custom `__create_write_items__`): such a state is
    planned every time."""
    parts: list[object] = []
    for fqn, obj in state_dict.items():
        if type(obj) is DTensor:
            local = obj.to_local()
            if type(local) not in (torch.Tensor, torch.nn.Parameter):
                return None
            parts.append((fqn, obj.device_mesh, obj.placements, obj.shape,
                          local.dtype, local.layout, local.requires_grad, local.is_pinned()))
        elif type(obj) in (torch.Tensor, torch.nn.Parameter):
            parts.append((fqn, obj.shape, obj.dtype, obj.layout, obj.requires_grad, obj.is_pinned()))
        elif isinstance(obj, torch.Tensor) or hasattr(obj, "__create_write_items__"):
            return None
        else:
            parts.append(fqn)  # written as bytes, whatever it holds
    return tuple(parts)


class DedupSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with the writer of each replicated value chosen by a policy
    (`checkpoint.dedup_policy`) instead of DCP's own dedup. On the coordinator, `summary` holds
    what the plan costs once `dcp.save` has planned. With a `PlanCache`, a rank whose local plan
    equals its last one sends an empty plan, the coordinator reuses the last global plan when
    no rank's plan changed (and replans with the cached plans of the unchanged ranks when some
    did), and a rank sent an empty plan writes as it did last time."""

    def __init__(self, policy: str, min_slice_bytes: int, cache: PlanCache | None = None):
        super().__init__()
        self.policy = policy
        self._assign = make_policy(policy, min_slice_bytes)
        self.summary: DedupSummary | None = None
        self._local: dict[str, list[WriteItem]] = {}
        self._cache = cache
        self._local_plan: SavePlan | None = None
        self._layout: tuple | None = None

    def create_local_plan(self) -> SavePlan:
        cache = self._cache
        self._layout = layout_key(self.state_dict) if cache is not None else None
        if self._layout is not None and cache.local is not None and self._layout == cache.layout:
            plan = self.plan = dataclasses.replace(cache.local, planner_data=self.mappings) \
                if self.flatten_state_dict else cache.local
        else:
            plan = super().create_local_plan()
        # what this rank holds, by name: `resolve_data` cuts a slice it is asked for out of it
        self._local = {}
        for item in plan.items:
            self._local.setdefault(item.index.fqn, []).append(item)
        self._local_plan = plan
        if cache is not None and cache.final is not None and plan == cache.local:
            return SavePlan([], usable=False)
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        cache = self._cache
        if any(not p.usable for p in all_plans):
            if cache is None or cache.all_local is None or cache.metadata is None:
                raise RuntimeError("a rank reused its cached save plan, but the coordinator has none: "
                                   "the plan caches of the ranks are out of step")
            if all(not p.usable for p in all_plans):
                self.summary = cache.summary
                return [SavePlan([], usable=False)] * len(all_plans), cache.metadata
            all_plans = [p if p.usable else cached for p, cached in zip(all_plans, cache.all_local)]
        _check_alike(all_plans)
        layout = layout_of(all_plans)
        assignment = self._assign(layout)
        plans = [apply_assignment(rank, plan, assignment) for rank, plan in enumerate(all_plans)]
        self.summary = summarize(layout, assignment, self.policy)
        logger.debug("%s", self.summary.line())
        # no key is planned twice any more, so the dedup inside DCP's global planning keeps all
        global_plans, metadata = super().create_global_plan(plans)
        if cache is not None:
            cache.all_local, cache.metadata, cache.summary = all_plans, metadata, self.summary
        return global_plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if not new_plan.usable:
            if self._cache is None or self._cache.final is None:
                raise RuntimeError("the coordinator reused the last global save plan, but this rank has "
                                   "no final plan cached: the plan caches of the ranks are out of step")
            new_plan = self._cache.final
        if self._cache is not None:
            self._cache.local, self._cache.final, self._cache.layout = self._local_plan, new_plan, self._layout
        return super().finish_plan(new_plan)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """The data of a write: what DCP's planner returns, or the rows of a slice. A value
        (not a tensor) that a load would refuse is refused here, before the step is committed."""
        if write_item.type == WriteItemType.BYTE_IO:
            value = self.lookup_object(write_item.index)
            if not plain_scalar(value):
                save = functools.partial(DefaultSavePlanner.resolve_data, self, write_item)
                return _loadable(write_item.index.fqn, value, save)
            return _within_bound(write_item.index.fqn, value, io.BytesIO(_saved_scalar(pickle.dumps(value, protocol=2))))
        chunk = write_item.tensor_data.chunk
        source = self._source_of(write_item.index.fqn, chunk)
        if source.tensor_data.chunk.sizes == chunk.sizes:
            return super().resolve_data(write_item)
        tensor = super().resolve_data(source)
        start = chunk.offsets[0] - source.tensor_data.chunk.offsets[0]
        # a view: storage writers copy it into a storage of its own as they write it, one at a time
        return tensor.narrow(0, start, chunk.sizes[0])

    def _source_of(self, fqn: str, chunk: ChunkStorageMetadata) -> WriteItem:
        """The item this rank planned whose chunk contains `chunk`."""
        for item in self._local.get(fqn, []):
            have = item.tensor_data.chunk
            if all(o >= h and o + s <= h + hs for o, s, h, hs in
                   zip(chunk.offsets, chunk.sizes, have.offsets, have.sizes)):
                return item
        raise RuntimeError(f"rank was asked to write {fqn} at {list(chunk.offsets)}, which it does not hold")

    def summary_line(self) -> str:
        """One line for the log: bytes per rank and files holding replicated tensors."""
        if self.summary is None:
            raise RuntimeError("the dedup summary exists on the coordinator once dcp.save has planned")
        return self.summary.line()


_SCALARS = (bool, int, float, str, type(None))


def plain_scalar(value: object) -> bool:
    """A number, string, bool or None, or a flat tuple of them (an optimizer setting: `betas`)."""
    if type(value) is tuple:
        return all(type(v) in _SCALARS for v in value)
    return type(value) in _SCALARS


def _loadable(fqn: str, value: object, save: Callable[[], io.BytesIO]) -> io.BytesIO:
    """`save()` (DCP's `torch.save` of `value`), once `_within_bound` and the load's own reader
    (`load_plain`: no code from the file runs) reads it back: a NumPy value, a namedtuple or any
    other object a load refuses would commit a step that no load takes."""
    try:
        data = save()
    except Exception as e:  # a lambda, a lock: nothing pickles it
        raise CheckpointError(f"state value '{fqn}' ({type(value).__name__}) cannot be saved: "
                              f"{type(e).__name__}: {e}") from None
    kind = _kind(value)
    _within_bound(fqn, value, data)
    try:
        torch_archive.load_plain(data.getvalue())
    except UnsafePickleError as e:
        raise CheckpointError(
            f"state value '{fqn}' ({kind}) would be refused by every load: its pickle {e.problem}, which a "
            "load bounds as a crafted file could make it take time out of proportion to its size "
            "(docs/reliability.md); store it otherwise (many numbers as a list or a tensor)") from None
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"state value '{fqn}' ({kind}) would be refused by "
            f"every load ({torch_archive.refusal(e)}): a load runs no code from a checkpoint, so it reads plain "
            "data only (numbers, strings, bytes, lists, tuples, dicts, sets, tensors, dtypes, devices); store it "
            "as such (a NumPy value as .item() or .tolist(), a NumPy array as torch.from_numpy(...))") from None
    return data


def _kind(value: object) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _within_bound(fqn: str, value: object, data: io.BytesIO) -> io.BytesIO:
    """`data`, the saved `value`, unless it is larger than a load reads of a value (a string, a
    list, a loader's position: `validate.MAX_VALUE_BYTES`), which would commit a step that every
    load calls damaged."""
    size = data.getbuffer().nbytes
    if size > validate.MAX_VALUE_BYTES:
        raise CheckpointError(
            f"state value '{fqn}' ({_kind(value)}) takes {size} bytes saved, more than the "
            f"{validate.MAX_VALUE_BYTES} a load reads of a value that is not a tensor (a crafted file "
            "could ask for any size): store its bulk as tensors")
    return data


@functools.lru_cache(maxsize=4096)
def _saved_scalar(pickled: bytes) -> bytes:
    """`torch.save`'s bytes (DCP's format for a value) of the value `pickled` holds, made once
    per value: the same value always gives the same bytes, and a `torch.save` for each of the
    values of TorchTitan's layout (one per optimizer setting and parameter) at every save was a
    large part of a save's CPU (`docs/performance.md`). Keyed by the value's pickle, which tells
    apart what compares equal (1, 1.0, True; 0.0 and -0.0)."""
    buf = io.BytesIO()
    torch.save(pickle.loads(pickled), buf)
    return buf.getvalue()
