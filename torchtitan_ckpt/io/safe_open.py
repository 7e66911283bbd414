"""The one rule for every file name read from a checkpoint (`.metadata`, `COMMITTED.json`, an HF
index, a shard header): it names a regular file inside the checkpoint's folder.

A name must be relative, without `..` or NUL, and resolve (symlinks followed) inside the folder
(or, for a snapshot of the Hugging Face hub's cache, to a file of its own repository's `blobs`),
so a crafted entry cannot read `/etc/passwd`, another checkpoint's tensors or `/dev/zero`. It is
opened with `O_NONBLOCK` and checked to be a regular file before anything is read, so a FIFO or a
device in its place is refused instead of blocking the load forever. Anything else is a
`CorruptCheckpointError` naming the entry, except running out of descriptors, which is this
process's limit (`make_room` raises it ahead of a load that opens many files), and a file this
user may not read, named with its owner and mode.
"""

from __future__ import annotations

import errno
import logging
import os
import pwd
import resource
import stat
from collections.abc import Collection

from ..errors import CheckpointError, CorruptCheckpointError

logger = logging.getLogger(__name__)

_SPARE_FDS = 64
"""Descriptors left free beside those `make_room` is asked for (sockets, logs, the caller's own)."""
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE}


def inside(root: str, name: object, what: str) -> str:
    """The path of `name` under `root`, checked by its spelling to stay inside it (relative, no
    `..`); `what` names the entry in the error (e.g. "the storage entry 'w'")."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise CorruptCheckpointError(f"{root}: {what} names the file {name!r}, which is not a file name")
    if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise CorruptCheckpointError(f"{root}: {what} names {name!r}, outside the checkpoint folder; "
                                     "refusing to read it (the checkpoint was crafted or damaged)")
    return os.path.join(root, name)


NAME_MAX = 255
"""Longest name of a file, in bytes, that a Linux file system holds (where `os.pathconf` does
not say otherwise)."""


def too_long(rel: str) -> bool:
    """Whether a part of the relative path `rel` is longer than a file's name can be."""
    return any(len(os.fsencode(part)) > NAME_MAX for part in rel.split(os.sep))


def file_and_folder(rels: Collection[str]) -> tuple[str, str] | None:
    """Two of the normalised relative paths `rels` that no folder can hold together, one the
    folder of the other (`x`, `x/y`), as (folder, path); None when there are none."""
    for rel in rels:
        parent = os.path.dirname(rel)
        while parent:
            if parent in rels:
                return parent, rel
            parent = os.path.dirname(parent)
    return None


def _resolved_inside(root: str, name: object, what: str) -> str:
    """`inside`, and the path with its symlinks followed is inside `root` too, or a blob of the
    Hugging Face hub's cache (`_hub_blob`)."""
    path = inside(root, name, what)
    real = os.path.realpath(path)
    if not _allowed(root, real):
        raise CorruptCheckpointError(f"{path}: {what} is a link to {real}, outside the checkpoint folder; refusing "
                                     "to read it (if the link is meant, copy the folder with its links followed: "
                                     "`cp -rL`)")
    return path


def _allowed(root: str, real: str) -> bool:
    """Whether the resolved path `real` is inside `root` (resolved too), or a hub blob of it."""
    real_root = os.path.realpath(root)
    return os.path.commonpath([real_root, real]) == real_root or _hub_blob(real_root, real)


def _hub_blob(real_root: str, real: str) -> bool:
    """Whether `real` (a link's target, resolved) is a file the Hugging Face hub's cache keeps
    for the folder `real_root`, a snapshot of the cache (`<repo>/snapshots/<revision>`, whose
    files link to `<repo>/blobs/<hash>`): one directly in that repository's `blobs`. A link from
    any other folder into a cache (an old `--local-dir` download's) is not followed: nothing
    would then keep a crafted folder from reading whichever cached model it names."""
    if os.path.basename(os.path.dirname(real_root)) != "snapshots":
        return False
    return os.path.dirname(real) == os.path.join(os.path.dirname(os.path.dirname(real_root)), "blobs")


def denied(path: str, why: str) -> str:
    """What this user may not do with `path` (`why`: "Permission denied", "not writable"), for a
    message: the user, and the owner and mode of the file or folder (the nearest one that can be
    looked at), so that the user knows whom to ask."""
    def name(uid: int) -> str:
        try:
            return pwd.getpwuid(uid).pw_name
        except KeyError:
            return str(uid)

    shown = path
    while True:
        try:
            st = os.lstat(shown)
            break
        except OSError:
            if os.path.dirname(shown) == shown:
                return f"{path}: {why} for user {name(os.geteuid())}"
            shown = os.path.dirname(shown)
    return (f"{path}: {why} for user {name(os.geteuid())} ({shown} is owned by {name(st.st_uid)}, "
            f"mode {stat.filemode(st.st_mode)})")


PERMISSION = {errno.EACCES, errno.EPERM}
"""The errors of a file or folder this user may not use: not the checkpoint's fault."""


def unlink_denied(path: str) -> str | None:
    """Why this user may not remove the entry `path` from its folder (that folder not writable to
    this user, or its sticky bit over another user's entry), for a message; None when it may."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        st, up = os.lstat(path), os.stat(parent)
    except OSError:
        return None  # gone, or not looked into: the caller's own errors say so
    sticky = up.st_mode & stat.S_ISVTX and os.geteuid() not in (0, st.st_uid, up.st_uid)
    return None if os.access(parent, os.W_OK | os.X_OK) and not sticky else denied(parent, "not removable")


def removal_denied(path: str) -> str | None:
    """Why this user may not remove the folder `path` and its files (another user's step in a
    team's folder: its folder not writable to this user, or the parent's sticky bit), for a
    message; None when it may. A save would fail over it after the training up to it."""
    if (why := unlink_denied(path)) is not None:
        return why
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return None if not stat.S_ISDIR(st.st_mode) or os.access(path, os.R_OK | os.W_OK | os.X_OK) else \
        denied(path, "not removable")


def removal_refused(path: str, error: PermissionError) -> str:
    """A removal of the folder `path` refused with `error`, for a message: whom to ask
    (`removal_denied`, else the owner and mode of `path`)."""
    return removal_denied(path) or denied(path, error.strerror)


def open_fd(root: str, name: object, what: str) -> int:
    """A read-only descriptor of the regular file `name` under `root` (see `inside`); never blocks
    on a FIFO. The caller closes it."""
    path = _resolved_inside(root, name, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in _OUT_OF_DESCRIPTORS:  # this machine's limit, not the checkpoint's fault
            raise CheckpointError(f"{path}: {what} cannot be opened: {e.strerror} (this process may hold "
                                  f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}; raise `ulimit -n`)") from e
        if e.errno in PERMISSION:  # not damaged: a verify passing over it would let a save replace it
            raise CheckpointError(f"{what} cannot be opened: {denied(path, e.strerror)}; ask its owner to make it "
                                  "readable to you") from e
        raise CorruptCheckpointError(f"{path}: {what} cannot be opened: {e.strerror}") from e
    try:
        _check_opened(fd, root, path, what)
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptCheckpointError(f"{path}: {what} is not a regular file (mode {stat.filemode(mode)}); "
                                         "refusing to read it")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _check_opened(fd: int, root: str, path: str, what: str) -> None:
    """The file `fd` opened is inside `root` too: a name swapped for a link out of the folder
    between `_resolved_inside`'s check and the open (by another writer of the folder) is refused.
    Asked of the kernel (`/proc/self/fd`); without it, the check before the open stands alone."""
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return
    if not _allowed(root, real.removesuffix(" (deleted)")):
        raise CorruptCheckpointError(f"{path}: {what} became a link to {real} while it was opened, outside the "
                                     "checkpoint folder; refusing to read it")


def make_room(count: int, what: str, fewer: str = "load on more ranks") -> None:
    """Let this process open `count` more files at once: its soft limit of open descriptors
    (often 1024) is raised toward the hard one where it is short, as a rank loading the files of
    thousands of ranks needs. A `CheckpointError` naming both numbers and the way to `fewer`
    files, before anything is opened, where the hard limit is short too."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        need = len(os.listdir("/proc/self/fd")) + count + _SPARE_FDS
    except OSError:  # no /proc: left to the kernel's answer to each open
        return
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise CheckpointError(f"{what} are {count} files, open at once, and this process may hold {hard} "
                              f"descriptors (the hard limit, {soft} the soft one); raise it (`ulimit -Hn`, "
                              f"or `nofile` in /etc/security/limits.conf) or {fewer}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    logger.info("raised this process's limit of open files from %d to %d for %s", soft, need, what)


def open_path(path: str, what: str):
    """`open_fd` of a path given as a whole (its own folder is the one it must stay in), as a
    binary file object."""
    return os.fdopen(open_fd(os.path.dirname(path) or ".", os.path.basename(path), what), "rb")


def read_bounded(path: str, what: str, limit: int) -> bytes:
    """The bytes of the file at `path` (see `open_path`): a `CorruptCheckpointError` naming it
    when it holds more than `limit` (a crafted or damaged file is never read whole into memory)."""
    with open_path(path, what) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CorruptCheckpointError(f"{path}: {what} is larger than {limit} bytes, far more than any real one; "
                                     "refusing to read it")
    return data


def file_size(root: str, name: object, what: str) -> int:
    """Bytes of the regular file `name` under `root` (see `open_fd`)."""
    fd = open_fd(root, name, what)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)
