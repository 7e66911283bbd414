"""How work is split by bytes among threads, files or ranks: pure functions over sizes.

Three shapes of split, each for the work it suits:
- `balanced_groups`: items in any order into `n` groups of about equal bytes (files written in
  parallel, where order does not matter);
- `in_order_runs`: items kept in order, cut into runs of about equal bytes (a thread reading a
  file front to back);
- `byte_ranges`: exactly equal shares, an item cut wherever a share ends (copying one output
  stream on several ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def balanced_groups(items: Sequence[T], n: int, nbytes: Callable[[T], int]) -> list[list[T]]:
    """`items` in at most `n` non-empty groups of about equal bytes, largest first into the
    lightest group (a lone empty group when there are no items)."""
    groups: list[list[T]] = [[] for _ in range(n)]
    loads = [0] * n
    for item in sorted(items, key=nbytes, reverse=True):
        lightest = loads.index(min(loads))
        groups[lightest].append(item)
        loads[lightest] += nbytes(item) or 1
    return [g for g in groups if g] or [[]]


def in_order_runs(items: Sequence[T], nbytes: Callable[[T], int], target: int,
                  max_runs: int | None = None) -> list[list[T]]:
    """`items`, in order, cut into runs of about `target` bytes each (a new run starts once the
    bytes so far reach `target` times the runs so far), at most `max_runs` of them."""
    target = max(1, target)
    runs: list[list[T]] = [[]]
    done = 0
    for item in items:
        if done >= target * len(runs) and (max_runs is None or len(runs) < max_runs):
            runs.append([])
        runs[-1].append(item)
        done += nbytes(item)
    return [run for run in runs if run]


def byte_ranges(sizes: Sequence[int], parts: int) -> list[list[tuple[int, int, int]]]:
    """Split items of `sizes` bytes, taken in order, among `parts` workers so that each gets the
    same number of bytes (within one byte): the concatenated items are cut at `total * p / parts`,
    splitting an item wherever a cut falls. Returns, per worker, (item, start, stop) ranges."""
    total = sum(sizes)
    cuts = [total * p // parts for p in range(parts + 1)]
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    pos, part = 0, 0
    for item, size in enumerate(sizes):
        start = 0
        while start < size:
            while pos + start >= cuts[part + 1]:
                part += 1
            stop = min(size, cuts[part + 1] - pos)
            out[part].append((item, start, stop))
            start = stop
        pos += size
    return out


def share(total: int, n: int) -> int:
    """`total` / `n`, rounded up: each of `n` workers' target bytes."""
    return max(1, -(-total // max(1, n)))
