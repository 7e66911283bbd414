"""How a step becomes visible, and how a partial one is recognised.

A step folder is complete exactly when it holds the commit marker `COMMITTED.json`, written last,
by one rank, after every rank has finished writing and every data file has been fsynced. The
marker is written to a temporary name, fsynced and renamed into place, and the folder is fsynced,
so it is either absent or whole. It records what the step holds (`states`, `format`) and a
manifest of every file with its size and CRC-32 (computed by the writers as they wrote);
`load()` trusts only folders that have it, and `verify()` checks the files against it.

Before any file is written, the folder gets the in-progress marker `IN_PROGRESS.json`: it says
that this package started writing the folder, so a save that crashed is recognised as ours
(partial, cleaned up by retention) and a folder with neither marker as another program's
(`layout.FOREIGN`, never deleted). The commit marker replaces it; a folder about to be rewritten
or deleted gets it back before it loses its commit marker.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from .io import durable
from . import faults
from .io.checksum import file_crc32
from .errors import CorruptCheckpointError

MARKER = "COMMITTED.json"
IN_PROGRESS = "IN_PROGRESS.json"
FORMAT_VERSION = 2


@dataclass
class CommitInfo:
    step: int
    states: list[str]
    """Top-level state names in the checkpoint, e.g. ["model", "optimizer", ...]."""
    format: str = "dcp"
    world_size: int = 1
    files: dict[str, dict] = field(default_factory=dict)
    """Relative file path -> {"size": bytes, "crc32": hex}, for every file but the marker."""
    created: float = 0.0
    version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(entry["size"] for entry in self.files.values())

    @property
    def model_only(self) -> bool:
        return self.states == ["model"]


def is_committed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def is_in_progress(path: str) -> bool:
    return os.path.isfile(os.path.join(path, IN_PROGRESS))


def mark_in_progress(path: str) -> None:
    """Mark `path` as a step folder this package is writing (see the module docstring)."""
    durable.write_json(os.path.join(path, IN_PROGRESS), {"started": time.time()})


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
    """Make a step invisible before it is rewritten or deleted; a crash afterwards leaves it
    partial, and still ours."""
    marker = os.path.join(path, MARKER)
    if os.path.exists(marker):
        mark_in_progress(path)
        os.remove(marker)
        durable.fsync_path(path)


def write_marker(path: str, info: CommitInfo,
                 checksums: dict[str, tuple[int, str]] | None = None) -> CommitInfo:
    """Fsync every file of the step, then atomically write the marker. `checksums` holds
    (size, crc32) of the files as their writers computed them; a file missing from it (written
    by a writer that does not checksum) is read once to compute its CRC. A file whose size on
    disk differs from what its writer wrote fails the commit. Returns the completed info."""
    info.files = {}
    for rel, size in _manifest(path).items():
        written = (checksums or {}).get(rel)
        if written is not None and written[0] != size:
            raise OSError(f"{os.path.join(path, rel)} has {size} bytes on disk, its writer wrote {written[0]}")
        info.files[rel] = {"size": size, "crc32": written[1] if written else file_crc32(os.path.join(path, rel))}
    info.created = time.time()
    for rel in info.files:
        durable.fsync_path(os.path.join(path, rel))
    durable.write_json(os.path.join(path, MARKER), asdict(info), indent=1, sort_keys=True,
                       before_replace=lambda: faults.hit("commit", info.step))
    if is_in_progress(path):  # a crash before this leaves both: complete wins
        os.remove(os.path.join(path, IN_PROGRESS))
    return info


def _check_file(path: str, rel: str, entry: dict) -> str | None:
    full = os.path.join(path, rel)
    if not os.path.isfile(full):
        return f"{full}: missing"
    size = os.path.getsize(full)
    if size != entry["size"]:
        return f"{full}: {size} bytes, the manifest says {entry['size']}"
    crc = file_crc32(full)
    if crc != entry["crc32"]:
        return f"{full}: CRC-32 {crc}, the manifest says {entry['crc32']}"
    return None


def verify(path: str, files: list[str] | None = None, threads: int = 4) -> list[str]:
    """Check a committed step's files (all, or those named) against its manifest, several files
    at a time. Returns one message per problem; empty when the step is intact."""
    info = read_marker(path)
    names = sorted(info.files) if files is None else files
    with ThreadPoolExecutor(max_workers=threads) as pool:
        found = pool.map(lambda rel: _check_file(path, rel, info.files[rel]), names)
        return [problem for problem in found if problem is not None]


def _manifest(path: str) -> dict[str, int]:
    files = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if rel not in (MARKER, MARKER + ".tmp", IN_PROGRESS):
                files[rel] = os.path.getsize(full)
    return dict(sorted(files.items()))
