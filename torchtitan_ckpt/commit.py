"""How a step becomes visible, and how a partial one is recognised.

A step folder is complete exactly when it holds the commit marker `COMMITTED.json`, written last,
by one rank, after every rank has finished writing and every data file has been fsynced. The
marker is written to a temporary name, fsynced and renamed into place, and the folder is fsynced,
so it is either absent or whole. It records what the step holds (`states`, `format`) and a
manifest of every file with its size; `load()` trusts only folders that have it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

from .errors import CorruptCheckpointError

MARKER = "COMMITTED.json"
FORMAT_VERSION = 1


@dataclass
class CommitInfo:
    step: int
    states: list[str]
    """Top-level state names in the checkpoint, e.g. ["model", "optimizer", ...]."""
    format: str = "dcp"
    world_size: int = 1
    files: dict[str, int] = field(default_factory=dict)
    """Relative file path -> size in bytes, for every file of the step except the marker."""
    created: float = 0.0
    version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    @property
    def model_only(self) -> bool:
        return self.states == ["model"]


def is_committed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def read_marker(path: str) -> CommitInfo:
    """The commit record of a step folder; `CorruptCheckpointError` if it is unreadable."""
    marker = os.path.join(path, MARKER)
    try:
        with open(marker) as f:
            raw = json.load(f)
        return CommitInfo(**raw)
    except (OSError, ValueError, TypeError) as e:
        raise CorruptCheckpointError(f"{marker} is not a valid commit marker: {e}") from e


def uncommit(path: str) -> None:
    """Make a step invisible before it is rewritten or deleted; a crash afterwards leaves it partial."""
    marker = os.path.join(path, MARKER)
    if os.path.exists(marker):
        os.remove(marker)
        _fsync_dir(path)


def write_marker(path: str, info: CommitInfo) -> CommitInfo:
    """Fsync every file of the step, then atomically write the marker. Returns the info with
    its file manifest and time filled in."""
    info.files = _manifest(path)
    info.created = time.time()
    for rel in info.files:
        _fsync_file(os.path.join(path, rel))
    tmp = os.path.join(path, MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(asdict(info), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MARKER))
    _fsync_dir(path)
    return info


def _manifest(path: str) -> dict[str, int]:
    files = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if rel not in (MARKER, MARKER + ".tmp"):
                files[rel] = os.path.getsize(full)
    return dict(sorted(files.items()))


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
