"""How an export is split into safetensors files (pure functions over names and byte sizes).

Tensors are grouped by transformer layer (a layer is never split across files), groups keep
the order in which they are given (the model's: embeddings, layer 0, 1, ..., head), and the
fewest files that fit `max_shard_size` are filled as evenly as contiguous groups allow.
"""

from __future__ import annotations

import re
from decimal import Decimal

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_MAX_SIZE = 2**62
_LAYER = re.compile(r"^(.*?\blayers\.\d+)\.")


def parse_size(value: str | int) -> int:
    """Bytes in `value`: an int, or a string such as "5GB" (10**9, as HF counts) or "512MiB"."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        m = _SIZE.match(value) if isinstance(value, str) else None
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"size {value!r} is not a byte count like '5GB', '500MB' or '512MiB'")
        amount = Decimal(m.group(1)) * _UNITS[m.group(2).lower()]  # exact to 28 digits: 2**62 has 19
        size = int(amount) if amount <= _MAX_SIZE else _MAX_SIZE + 1
    if not 0 < size <= _MAX_SIZE:
        raise ValueError(f"size {value!r} must be positive and at most 2**62 bytes")
    return size


def layer_of(name: str) -> str:
    """The group a tensor is kept with: its `...layers.N` prefix, or its own name."""
    m = _LAYER.match(name)
    return m.group(1) if m else name


def plan_files(sizes: dict[str, int], max_shard_size: int) -> dict[str, int]:
    """Tensor name -> 1-based file index. When no group is larger than `max_shard_size`, no
    file is; a larger group (a layer is never split) makes its file larger."""
    groups: dict[str, list[str]] = {}
    for name in sizes:
        groups.setdefault(layer_of(name), []).append(name)
    order = list(groups)
    group_bytes = [sum(sizes[n] for n in groups[g]) for g in order]
    n_files = len(_fill(group_bytes, max_shard_size))
    # the smallest capacity that still needs no more files: the most even split
    lo, hi = max(group_bytes, default=0), max(max_shard_size, max(group_bytes, default=0))
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(_fill(group_bytes, mid)) <= n_files else (mid + 1, hi)
    mapping = {}
    for index, members in enumerate(_fill(group_bytes, lo), start=1):
        for g in members:
            for name in groups[order[g]]:
                mapping[name] = index
    return mapping


def _fill(group_bytes: list[int], capacity: int) -> list[list[int]]:
    """Next-fit: group indices in order, a new file whenever the next group would overflow."""
    files: list[list[int]] = []
    used = 0
    for i, size in enumerate(group_bytes):
        if not files or used + size > capacity:
            files.append([])
            used = 0
        files[-1].append(i)
        used += size
    return files
