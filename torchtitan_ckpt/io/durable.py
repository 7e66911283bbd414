"""Durable writes: fsync a file or folder, and write a JSON file that is either absent or whole."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any


TMP_SUFFIX = ".tmp"
"""What `write_json` adds to a file's name for the copy it writes before renaming it."""


def fsync_path(path: str) -> None:
    """Flush a file's (or a folder's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_replacing(path: str, flags: int = 0) -> int:
    """Create the file `path` for writing (returns its descriptor), removing whatever entry is
    there first, and never writing through a link or into a file that was there: a link (into a
    hub cache, out of the folder, or one another user planted in a folder others may write to)
    or a hard link to someone's file stays intact; one planted again meanwhile fails the create.
    `flags`: more `os.open` flags (`O_DIRECT`). Its mode is the umask's, as `open()` gives."""
    if os.path.lexists(path):
        os.remove(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | flags, 0o666)


def make_dir(path: str, exist_ok: bool = False) -> None:
    """Create the folder `path` and the folders above it that are missing, each one's entry
    fsynced in its parent, so a crash cannot lose a folder (and the files in it) that a write
    after this one counted on. `FileExistsError` if `path` exists, unless `exist_ok`; a folder
    that another process makes meanwhile (another rank) is taken as made, its entry fsynced by
    that process. A folder that exists is never opened (its parent may not be readable)."""
    missing, above = [], os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(above):  # a file there: mkdir below it says NotADirectoryError
        missing.append(above)
        above = os.path.dirname(above)
    for folder in [*reversed(missing), path]:
        try:
            os.mkdir(folder)
        except FileExistsError:
            if (folder == path and not exist_ok) or not os.path.isdir(folder):
                raise
            continue
        fsync_path(os.path.dirname(os.path.abspath(folder)))


def write_json(path: str, obj: Any, *, before_replace: Callable[[], None] | None = None, **dump_args: Any) -> None:
    """Write `obj` to a temporary file, fsync it, rename it to `path` and fsync the folder, so a
    crash leaves either the old state or the whole new file. `before_replace` runs between the
    fsync and the rename (a fail point)."""
    tmp = path + TMP_SUFFIX
    with os.fdopen(create_replacing(tmp), "w") as f:
        json.dump(obj, f, **dump_args)
        f.flush()
        os.fsync(f.fileno())
    if before_replace is not None:
        before_replace()
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path) or ".")
