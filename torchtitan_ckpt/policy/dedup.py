"""Who writes a value that several ranks hold: pure policies over plain data.

Every rank plans a write for every value it holds, so a tensor replicated across HSDP replicas,
a replicated norm or a plain tensor is planned by several ranks, and the coordinator keeps one
copy. Which copy it keeps decides how many bytes each rank writes (the busiest rank sets the save
time) and how many files a loader opens. DCP keeps the copy of the rank with the fewest bytes so
far, counting every item at its *global* size and in state-dict order; the policies here count
the bytes each rank really writes:

- `balanced`: largest replicated values first, each to the holder with the fewest bytes so far
  (values without rows held by the same ranks together, to one file);
- `lowest_rank`: the lowest holder, so replicated values sit in as few files as possible;
- `replica_slices`: each of the R holders writes 1/R of a large value's rows (dim 0); DCP stores
  the parts as chunks of one tensor and reassembles them on load at any world size.

The policies work on plain data (what each rank holds, by key) so they are tested without a
process group; `dcp.planner.DedupSavePlanner` turns DCP save plans into that data and back.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import counted
from ..progress import fmt_bytes

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
record (measured: 1261 B for a float, 1573 B around a tensor). `balanced` counts it."""


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
    placed first, ties go to the lower rank; values without rows last, together (`_place_whole`)."""
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
    """Largest first, each to its least-loaded holder (the lower rank on a tie); updates `loads`.
    Values without rows (non-tensor values and 0-dim tensors: flattened optimizer settings and
    steps, a few per parameter) held by the same ranks go together to one of them, the least
    loaded: each is read by every holder on load, and spread over R files would open R files on
    every rank."""
    size = {key: layout[owners[key][0]][key].nbytes + RECORD_BYTES for key in keys}
    together: dict[tuple[int, ...], list[Key]] = {}
    for key in sorted(keys, key=lambda k: (-size[k], k)):
        if layout[owners[key][0]][key].rows == 0:
            together.setdefault(tuple(owners[key]), []).append(key)
            continue
        rank = min(owners[key], key=lambda r: (loads[r], r))
        loads[rank] += size[key]
        out[key] = [Write(rank)]
    for ranks, group in together.items():
        rank = min(ranks, key=lambda r: (loads[r], r))
        loads[rank] += sum(size[key] for key in group)
        out.update({key: [Write(rank)] for key in group})


POLICIES: dict[str, Callable[..., Assignment]] = {
    "balanced": balanced,
    "lowest_rank": lowest_rank,
    "replica_slices": replica_slices,
}


def make_policy(name: str, min_slice_bytes: int) -> Policy:
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
    rank) hold replicated values, and the most files one rank opens to reload its replicated
    values in the same layout."""

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
        return (f"dedup {self.policy}: {fmt_bytes(sum(self.bytes_per_rank))} of tensors written by "
                f"{counted(len(self.bytes_per_rank), 'rank')}, the busiest "
                f"{fmt_bytes(max(self.bytes_per_rank, default=0))} (max/mean {self.imbalance:.3f}); "
                f"replicated values in {counted(self.replicated_files, 'file')}, a rank reloads its own "
                f"from up to {counted(self.max_files_to_load, 'file')}")


def summarize(layout: Layout, assignment: Assignment, policy: str) -> DedupSummary:
    """The cost of `assignment` on `layout`."""
    owners = holders(layout)
    loads = [0] * len(layout)
    writers: dict[Key, set[int]] = {}
    for key, writes in assignment.items():
        item = layout[owners[key][0]][key]
        for w in writes:
            loads[w.rank] += item.nbytes if w.rows is None else item.nbytes // item.rows * len(w.rows)
        if len(owners[key]) > 1:
            writers[key] = {w.rank for w in writes}
    per_rank = [set().union(*(writers[k] for k in items if k in writers)) for items in layout]
    return DedupSummary(policy, tuple(loads), len(set().union(*writers.values())),
                        max(map(len, per_rank), default=0))
