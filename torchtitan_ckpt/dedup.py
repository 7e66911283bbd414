"""Who writes a value that several ranks hold: pure policies, and the DCP planner that applies one.

Every rank plans a write for every value it holds, so a tensor replicated across HSDP replicas,
a replicated norm or a plain tensor is planned by several ranks, and the coordinator keeps one
copy. Which copy it keeps decides how many bytes each rank writes (the busiest rank sets the save
time) and how many files a loader opens. DCP keeps the copy of the rank with the fewest bytes so
far, counting every item at its *global* size and in state-dict order; the policies here count
the bytes each rank really writes:

- `balanced`: largest replicated values first, each to the holder with the fewest bytes so far;
- `lowest_rank`: the lowest holder, so replicated values sit in as few files as possible;
- `replica_slices`: each of the R holders writes 1/R of a large value's rows (dim 0); DCP stores
  the parts as chunks of one tensor and reassembles them on load at any world size.

The policies work on plain data (what each rank holds, by key) so they are tested without a
process group; `DedupSavePlanner` turns DCP save plans into that data and back.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

Key = Hashable
"""A value's identity across ranks; keys must compare with each other (ties are broken by key)."""


@dataclass(frozen=True)
class Item:
    """What a rank holds of one value: its bytes, and its length on dim 0 (0 when it has no rows:
    a 0-dim tensor or a non-tensor value, whose pickled size is unknown when planning: 0 bytes)."""

    nbytes: int
    rows: int = 0


@dataclass(frozen=True)
class Write:
    """`rank` writes rows `rows` (on dim 0) of a value, or the whole value when `rows` is None."""

    rank: int
    rows: range | None = None


Layout = Sequence[Mapping[Key, Item]]
"""Rank -> the values it holds. A key held by several ranks is replicated across them."""

Assignment = dict[Key, list[Write]]
"""Key -> the writes that store it: one whole write, or one row range per holder."""

Policy = Callable[[Layout], Assignment]

RECORD_BYTES = 1300
"""What a file holds around each write besides its data: DCP writes every item as a `torch.save`
record (measured: 1261 B for a float, 1573 B around a tensor). `balanced` counts it, so that
hundreds of small values (flattened optimizer hyper-parameters) do not all land on one rank."""


def holders(layout: Layout) -> dict[Key, list[int]]:
    """Key -> the ranks holding it, ascending."""
    out: dict[Key, list[int]] = {}
    for rank, items in enumerate(layout):
        for key in items:
            out.setdefault(key, []).append(rank)
    return out


def lowest_rank(layout: Layout) -> Assignment:
    """Each value is written whole by the lowest rank holding it."""
    return {key: [Write(ranks[0])] for key, ranks in holders(layout).items()}


def balanced(layout: Layout) -> Assignment:
    """Each replicated value is written whole by the holder that has the fewest bytes to write
    (data plus `RECORD_BYTES` per write) once its own values are counted; largest values are
    placed first, ties go to the lower rank."""
    owners = holders(layout)
    out, loads = _unshared(layout, owners)
    _place_whole([k for k, ranks in owners.items() if len(ranks) > 1], layout, owners, loads, out)
    return out


def replica_slices(layout: Layout, min_slice_bytes: int) -> Assignment:
    """Each of the R holders of a replicated value writes a contiguous 1/R of its rows (the first
    holder the first rows; sizes differ by at most one row). Values smaller than
    `min_slice_bytes * R` or with fewer than R rows are placed whole, as `balanced` does."""
    owners = holders(layout)
    out, loads = _unshared(layout, owners)
    whole = []
    for key in sorted(k for k, ranks in owners.items() if len(ranks) > 1):
        ranks, item = owners[key], layout[owners[key][0]][key]
        if item.nbytes < min_slice_bytes * len(ranks) or item.rows < len(ranks):
            whole.append(key)
            continue
        n = len(ranks)
        parts = [range(i * item.rows // n, (i + 1) * item.rows // n) for i in range(n)]
        out[key] = [Write(rank, rows) for rank, rows in zip(ranks, parts)]
        for rank, rows in zip(ranks, parts):
            loads[rank] += item.nbytes // item.rows * len(rows) + RECORD_BYTES
    _place_whole(whole, layout, owners, loads, out)
    return out


def _unshared(layout: Layout, owners: dict[Key, list[int]]) -> tuple[Assignment, list[int]]:
    """Values only one rank holds (it writes them), and the bytes each rank writes for them
    (with `RECORD_BYTES` per value)."""
    out: Assignment = {}
    loads = [0] * len(layout)
    for key, ranks in owners.items():
        if len(ranks) == 1:
            out[key] = [Write(ranks[0])]
            loads[ranks[0]] += layout[ranks[0]][key].nbytes + RECORD_BYTES
    return out, loads


def _place_whole(keys: list[Key], layout: Layout, owners: dict[Key, list[int]],
                 loads: list[int], out: Assignment) -> None:
    """Largest first, each to its least-loaded holder (the lower rank on a tie); updates `loads`."""
    size = {key: layout[owners[key][0]][key].nbytes + RECORD_BYTES for key in keys}
    for key in sorted(keys, key=lambda k: (-size[k], k)):
        rank = min(owners[key], key=lambda r: (loads[r], r))
        loads[rank] += size[key]
        out[key] = [Write(rank)]


POLICIES: dict[str, Callable[..., Assignment]] = {
    "balanced": balanced,
    "lowest_rank": lowest_rank,
    "replica_slices": replica_slices,
}


def make_policy(name: str, min_slice_bytes: int = 1 << 20) -> Policy:
    """The policy called `name` (`checkpoint.dedup_policy`) as a function of the layout alone."""
    if name not in POLICIES:
        raise ValueError(f"unknown dedup policy {name!r}; expected one of {', '.join(POLICIES)}")
    if name == "replica_slices":
        return functools.partial(replica_slices, min_slice_bytes=min_slice_bytes)
    return POLICIES[name]


# ----------------------------------------------------------------------------- what a plan costs


@dataclass(frozen=True)
class DedupSummary:
    """What an assignment means for a save: tensor bytes each rank writes, how many files (one per
    rank) hold replicated tensors, and the most files one rank opens to reload its replicated
    tensors in the same layout."""

    policy: str
    bytes_per_rank: tuple[int, ...]
    replicated_files: int
    max_files_to_load: int

    @property
    def imbalance(self) -> float:
        """Max over mean of `bytes_per_rank`: 1.0 is perfectly even."""
        total = sum(self.bytes_per_rank)
        return max(self.bytes_per_rank) * len(self.bytes_per_rank) / total if total else 1.0

    def line(self) -> str:
        return (f"dedup {self.policy}: {len(self.bytes_per_rank)} rank(s) write "
                f"{sum(self.bytes_per_rank) / 1e9:.3f} GB of tensors, the busiest "
                f"{max(self.bytes_per_rank, default=0) / 1e9:.3f} GB (max/mean {self.imbalance:.3f}); "
                f"replicated tensors in {self.replicated_files} file(s), a rank reloads its own "
                f"from up to {self.max_files_to_load}")


def summarize(layout: Layout, assignment: Assignment, policy: str) -> DedupSummary:
    """The cost of `assignment` on `layout`. Values of 0 bytes (non-tensor values) open no file."""
    owners = holders(layout)
    loads = [0] * len(layout)
    writers: dict[Key, set[int]] = {}
    for key, writes in assignment.items():
        item = layout[owners[key][0]][key]
        for w in writes:
            loads[w.rank] += item.nbytes if w.rows is None else item.nbytes // item.rows * len(w.rows)
        if len(owners[key]) > 1 and item.nbytes > 0:
            writers[key] = {w.rank for w in writes}
    per_rank = [set().union(*(writers[k] for k in items if k in writers)) for items in layout]
    return DedupSummary(policy, tuple(loads), len(set().union(*writers.values())),
                        max(map(len, per_rank), default=0))


# ----------------------------------------------------------------------------- DCP save plans


def _key(item: WriteItem) -> Key:
    # the index hint (`MetadataIndex.index`) differs between ranks and is not part of the identity
    return (item.index.fqn, tuple(item.index.offset or ()))


def _item(item: WriteItem) -> Item:
    if item.tensor_data is None:
        return Item(0)
    sizes = item.tensor_data.chunk.sizes
    return Item(math.prod(sizes) * item.tensor_data.properties.dtype.itemsize, sizes[0] if sizes else 0)


def layout_of(plans: Sequence[SavePlan]) -> list[dict[Key, Item]]:
    """The layout described by every rank's local save plan (rank i's plan at index i)."""
    return [{_key(w): _item(w) for w in plan.items} for plan in plans]


def writers_of(plans: Sequence[SavePlan]) -> Assignment:
    """The assignment made by deduplicated plans whose items are written whole (DCP's own dedup)."""
    return {_key(w): [Write(rank)] for rank, plan in enumerate(plans) for w in plan.items}


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
    training job saves the same tensors and values every time, only their contents change.
    Planning and shipping a 1.6 GB state's plans took 10-15% of its save on the benchmark
    machine (PyTorch's own path: 0.85x with its plan cache on, paired runs). Reset it after a
    failed save, so every rank starts over together."""

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


def layout_key(state_dict: Mapping[str, object]) -> tuple | None:
    """Everything DCP's local save plan of a flattened state dict is computed from: per value its
    name and, for a tensor, its global shape, dtype, layout, autograd and pinning flags, and for a
    DTensor also its mesh and placements (the local shard's place follows from those). Equal keys
    give equal plans, so a cached plan stands in for planning again: planning a 1.6 GB state's
    DTensors took 0.1-0.2 s of the save's CPU per rank, the key takes 10 ms for 500 values. None
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

    def __init__(self, policy: str = "balanced", min_slice_bytes: int = 1 << 20, cache: PlanCache | None = None):
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
        """The data of a write: what DCP's planner returns, or the rows of a slice."""
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
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
