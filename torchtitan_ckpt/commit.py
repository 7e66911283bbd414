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
(`layout.FOREIGN`, never deleted). It stays beside the commit marker (which wins) until the
folder is removed, last: a copy of the folder taken while a save commits, or while retention
renames the commit marker onto it (a tool that lists the folder, then copies what it listed),
holds one of the two markers at least, never data files alone, which would read as another
program's finished checkpoint. A folder about to be rewritten or deleted loses its commit
marker first.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from .io import IO_THREADS, durable, safe_open
from .io.untrusted import brief
from . import faults
from .io.checksum import file_crc32, stream_crc32
from .errors import CheckpointError, CorruptCheckpointError, NewerVersionError, OlderVersionError, few

MARKER = "COMMITTED.json"
IN_PROGRESS = "IN_PROGRESS.json"
FORMAT_VERSION = 2
"""The version of what a step holds, in its commit marker: raised by any change an older reader
would misread (the marker's fields, the files, the keys of the states: an older reader meets
them as `NewerVersionError`, not as a state it half loads); a reader refuses steps of versions
it does not read (`OlderVersionError`)."""
MAX_MARKER_BYTES = 64 << 20
"""Largest commit marker read: a step of 100,000 files lists them in about 10 MB."""


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

    @property
    def digest(self) -> bytes:
        """SHA-256 of every field: alike for copies of one step, different for another run's."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).digest()

    def misnamed(self, where: str, step: int) -> str | None:
        """What is wrong with this marker in the step folder `where`, named for `step`: it names
        another step (the folder renamed, or copied in under another name). None if not."""
        return None if self.step == step else f"{where} holds step {self.step} (its {MARKER} says so)"


def is_committed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def is_in_progress(path: str) -> bool:
    return os.path.isfile(os.path.join(path, IN_PROGRESS))


def mark_in_progress(path: str) -> None:
    """Mark `path` as a step folder this package is writing (see the module docstring)."""
    durable.write_json(os.path.join(path, IN_PROGRESS), new_mark())


MARK_BYTES = 4096
"""An in-progress marker is read up to this many bytes (ours are about 70)."""


def new_mark() -> dict[str, Any]:
    """The in-progress marker of a save starting now: when, and an id of this save, which a DCP
    `.metadata` it writes records too (`started_by`)."""
    return {"started": time.time(), "save": os.urandom(16).hex()}


def mark_id(data: bytes) -> str | None:
    """The id of the save an in-progress marker's bytes name (`new_mark`); None for one naming
    none (an older version's, or the commit marker `uncommit` moved onto it) or not a mark."""
    try:
        mark = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return mark.get("save") if isinstance(mark, dict) and isinstance(mark.get("save"), str) else None


def started_by(path: str) -> str | None:
    """The id of the save whose in-progress marker the folder `path` holds (`mark_id`); None
    where it holds none that can be read."""
    try:
        return mark_id(safe_open.read_bounded(os.path.join(path, IN_PROGRESS), "the in-progress marker", MARK_BYTES))
    except (OSError, CheckpointError):
        return None


def read_marker(path: str) -> CommitInfo:
    """The commit record of a step folder, every field checked; `CorruptCheckpointError` naming
    the marker if it is unreadable or of the wrong shape, `NewerVersionError` if a newer version
    of this package wrote it (whatever fields that version gives it), `OlderVersionError` if an
    older one whose steps this one does not read did."""
    marker = os.path.join(path, MARKER)
    try:
        raw = json.loads(safe_open.read_bounded(marker, "the commit marker", MAX_MARKER_BYTES))
        version = raw.get("version") if isinstance(raw, dict) else None
        if type(version) is int and FORMAT_VERSION < version <= MAX_COUNT:
            raise NewerVersionError(f"{marker} is of version {version}, written by a newer torchtitan_ckpt than "
                                    f"this one (version {FORMAT_VERSION} and older): read it with that one")
        if type(version) is int and 0 <= version < FORMAT_VERSION:
            raise OlderVersionError(
                f"{marker} is of version {version}, written by an older torchtitan_ckpt (before commit markers "
                f"held each file's CRC-32, version {FORMAT_VERSION}), whose steps this one does not read: resume "
                "from it with the version that wrote it, or move it out of the folder")
        info = CommitInfo(**raw)
    except CheckpointError:
        raise
    except (OSError, ValueError, TypeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{marker} is not a valid commit marker: {type(e).__name__}: {e}") from e
    if problem := _marker_problem(info, path):
        raise CorruptCheckpointError(f"{marker} is not a valid commit marker: {problem}; the step is damaged "
                                     "or was not written by torchtitan_ckpt: load another step")
    return info


MAX_COUNT = 2**62
"""The largest step, world size or version a marker may give (and so the largest step saved)."""


def _marker_problem(info: CommitInfo, path: str) -> str | None:
    def count(v: object, low: int) -> bool:
        return type(v) is int and low <= v <= MAX_COUNT

    if not count(info.step, 0) or not count(info.world_size, 1) or not count(info.version, 0):
        return (f"step {brief(info.step)}, world_size {brief(info.world_size)} and version {brief(info.version)} "
                "must be counts")
    if not isinstance(info.states, list) or not all(isinstance(s, str) and s for s in info.states):
        return f"states {brief(info.states)} is not a list of names"
    if not isinstance(info.format, str) or type(info.created) not in (int, float):
        return f"format {brief(info.format)} or created {brief(info.created)} has the wrong type"
    if not isinstance(info.files, dict):
        return f"files is a {type(info.files).__name__}, not a dict of file names"
    for rel, entry in info.files.items():
        safe_open.inside(path, rel, f"the file named in {MARKER}")
        if os.path.normpath(rel) != rel:  # `./x` beside `x`: verify would read one file once per spelling
            return f"files names {brief(rel)}, not as the step's listing spells it ({brief(os.path.normpath(rel))})"
        if (not isinstance(entry, dict) or set(entry) != {"size", "crc32"} or not count(entry["size"], 0)
                or not isinstance(entry["crc32"], str)):
            return f"files[{brief(rel)}] = {brief(entry)} is not {{'size': bytes, 'crc32': hex}}"
    # what no folder holds (a store's download of it would fail midway)
    if long := next((rel for rel in info.files if safe_open.too_long(rel)), None):
        return f"files names {brief(long)}, longer than a file name can be"
    if clash := safe_open.file_and_folder(info.files):
        return f"files names {brief(clash[0])} both as a file and as the folder of {brief(clash[1])}"
    return None


def uncommit(path: str) -> None:
    """Make a step invisible before it is rewritten or deleted; a crash afterwards leaves it
    partial, and still ours. The commit marker is renamed the in-progress one (which then names
    no save: `started_by` gives None), in one atomic step that needs no free space: on a full disk, deleting a
    step must not need what only deleting it gives back. A step folder that is a symlink (a run
    linked in from elsewhere) is never acted on through."""
    if os.path.islink(path):
        raise OSError(f"{path} is a symlink to {os.path.realpath(path)}, not a step folder this "
                      "checkpoint wrote; it is left alone")
    marker = os.path.join(path, MARKER)
    if os.path.lexists(marker):
        os.replace(marker, os.path.join(path, IN_PROGRESS))
        durable.fsync_path(path)


def unlisted(path: str) -> list[str]:
    """The files, folders and links under the committed step `path` its manifest does not list
    (a user's evaluation results, notes, a repository): not written here, so never removed
    here; for a step that is no committed folder of ours, or whose marker cannot be read (no
    manifest to tell by): none."""
    if os.path.islink(path) or not os.path.lexists(os.path.join(path, MARKER)):
        return []
    try:
        listed = read_marker(path).files
    except (CorruptCheckpointError, NewerVersionError, OlderVersionError):
        return []
    held = {os.path.relpath(os.path.join(root, name), path)  # links to folders among the folders, not walked
            for root, folders, names in os.walk(path) for name in folders + names}
    folders = {os.path.dirname(rel) for rel in listed}
    folders |= {parent for rel in folders for parent in _parents(rel)}
    return sorted(held - set(listed) - folders - set(_NOT_DATA))


def _parents(rel: str) -> list[str]:
    """The folders above the relative path `rel`."""
    parents = []
    while rel := os.path.dirname(rel):
        parents.append(rel)
    return parents


def refuse_unlisted(where: str, added: list[str]) -> None:
    """Refuse to remove or replace the committed step `where` holding `added`, files it does
    not list (`unlisted`; on object storage, objects under its prefix)."""
    if added:
        raise CheckpointError(f"{where} holds {len(added)} file(s) or folder(s) its {MARKER} does not list, not "
                              f"written by torchtitan_ckpt ({few(added, 3)}): the step is left as it is; move them "
                              "out of it for it to be removed")


def remove_step(path: str, removed: Callable[[int], None] | None = None) -> None:
    """Delete a step folder of ours: `uncommit` it, then remove every file but the in-progress
    marker, then the marker, then the folders. A crash at any point leaves a folder that reads
    as partial (ours, removed by the next cleaning), never data files with no marker, which
    would read as another program's checkpoint (and, with DCP's `.metadata` left, as loadable).
    Links inside are removed, never followed, and every name is removed relative to its folder's
    open descriptor: a folder swapped for a link meanwhile (by another writer of the checkpoint
    folder) is never removed through. A committed step holding files its manifest does not
    list is refused untouched (`refuse_unlisted`). `removed(nbytes)` hears of each file removed."""
    refuse_unlisted(path, unlisted(path))
    uncommit(path)
    marker = os.path.join(path, IN_PROGRESS)
    for root, folders, names, fd in os.fwalk(path, topdown=False):
        for name in names:
            if os.path.join(root, name) != marker:
                size = os.stat(name, dir_fd=fd, follow_symlinks=False).st_size
                os.unlink(name, dir_fd=fd)
                if removed is not None:
                    removed(size)
        for name in folders:  # a link to a folder is listed here, and was not walked into
            is_link = stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
            (os.unlink if is_link else os.rmdir)(name, dir_fd=fd)
    durable.fsync_path(path)  # the removals made durable before the marker's: a crash keeps no file without it
    if os.path.lexists(marker):
        os.remove(marker)
    try:
        os.rmdir(path)
    except OSError as e:  # the folder is marked ours again, partial: removed by a later cleaning
        mark_in_progress(path)
        if e.errno != errno.ENOTEMPTY:  # its parent is read-only, say
            raise
        raise CheckpointError(f"{path}: files appeared in it while it was removed (a job is writing there?); it "
                              "is left partial, to be removed once nothing writes there") from None
    durable.fsync_path(os.path.dirname(os.path.abspath(path)))


def write_marker(path: str, info: CommitInfo,
                 checksums: dict[str, tuple[int, str]] | None = None) -> CommitInfo:
    """Make every file of the step durable, then atomically write the marker. `checksums` holds
    (size, crc32) of the files as their writers computed them once the files were on the disk
    (`formats.Written.durable`): those are not fsynced again. A file missing from it (written by
    a writer that does not checksum) is read once to compute its CRC, and fsynced. A file whose
    size on disk differs from what its writer wrote fails the commit. Returns the completed info."""
    info.files = {}
    on_disk = manifest(path)
    for rel in set(checksums or {}) - set(on_disk):  # a listing cached by a network file system may lag
        if os.path.isfile(os.path.join(path, rel)):
            on_disk[rel] = os.path.getsize(os.path.join(path, rel))
    on_disk = dict(sorted(on_disk.items()))
    if lost := sorted(set(checksums or {}) - set(on_disk)):
        raise OSError(f"{path}: {lost[:3]} ({len(lost)} files) were written but are not in the step "
                      "folder; the step is not committed")
    for rel, size in on_disk.items():
        written = (checksums or {}).get(rel)
        if written is not None and written[0] != size:
            raise OSError(f"{os.path.join(path, rel)} has {size} bytes on disk, its writer wrote {written[0]}")
        info.files[rel] = {"size": size, "crc32": written[1] if written else file_crc32(os.path.join(path, rel))}
    info.created = time.time()
    for rel in info.files.keys() - (checksums or {}).keys():
        durable.fsync_path(os.path.join(path, rel))
    durable.fsync_path(path)  # the files' entries in the folder, before the marker that lists them
    durable.write_json(os.path.join(path, MARKER), asdict(info), indent=1, sort_keys=True,
                       before_replace=lambda: faults.hit("commit", info.step))
    return info


def check_file(path: str, rel: str, entry: dict, read: Callable[[int], None] | None = None) -> str | None:
    """The problem with one file of a step against its manifest `entry`, or None; `read(nbytes)`
    hears of its bytes as they are checksummed."""
    full = os.path.join(path, rel)
    if not os.path.lexists(full):
        return f"{full}: missing"
    try:
        fd = safe_open.open_fd(path, rel, f"the file named in {MARKER}")
    except CorruptCheckpointError as e:
        return str(e)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size != entry["size"]:
            return f"{full}: {size} bytes, the manifest says {entry['size']}"
        crc = stream_crc32(f, read)
    if crc != entry["crc32"]:
        return f"{full}: CRC-32 {crc}, the manifest says {entry['crc32']}"
    return None


def cut_short(path: str, info: CommitInfo, held: Mapping[str, int | None]) -> list[str]:
    """The files of the step at `path` its manifest `info` names that `held` (`Store.sizes` of
    them: None for one not there) gives another size than recorded, one message each: a copy
    cut short (an rsync stopped, `cp step/*`, which leaves `.metadata` out) that its marker calls
    whole, found without reading a byte."""
    return [f"{os.path.join(path, rel)}: " + ("missing" if held[rel] is None else
                                              f"{held[rel]} bytes, the manifest says {entry['size']}")
            for rel, entry in sorted(info.files.items()) if rel in held and held[rel] != entry["size"]]


def verify(path: str, files: list[str] | None = None, threads: int = IO_THREADS) -> list[str]:
    """Check a committed step's files (all, or those named) against its manifest, several files
    at a time. Returns one message per problem; empty when the step is intact."""
    info = read_marker(path)
    found = check_files(path, info, sorted(info.files) if files is None else files, threads)
    return [problem for problem in found if problem is not None]


def check_files(path: str, info: CommitInfo, files: list[str], threads: int,
                read: Callable[[int], None] | None = None) -> list[str | None]:
    """`check_file` of each of `files` against the manifest `info` of the step `path`, `threads`
    at a time, in order; `read(nbytes)` hears of the bytes checksummed, from any of the threads."""
    if type(threads) is not int or threads < 1:
        raise ValueError(f"threads = {threads!r}: files are checked on at least 1 thread")

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(lambda rel: check_file(path, rel, info.files[rel], read), files))


def files_in(path: str) -> list[str]:
    """Every file (or link) under the step folder `path` but the markers, by relative path."""
    return sorted(rel for root, _, names in os.walk(path) for name in names
                  if (rel := os.path.relpath(os.path.join(root, name), path)) not in _NOT_DATA)


def manifest(path: str) -> dict[str, int]:
    """Size of every file of the step folder `path` but the markers, by relative path, sorted."""
    return {rel: os.path.getsize(os.path.join(path, rel)) for rel in files_in(path)}


_NOT_DATA = (MARKER, MARKER + durable.TMP_SUFFIX, IN_PROGRESS, IN_PROGRESS + durable.TMP_SUFFIX)
"""The markers (and their temporary names): never part of a step's manifest."""
