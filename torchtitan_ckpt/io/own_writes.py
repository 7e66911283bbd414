"""The SHA-256 digests of the DCP `.metadata` files this user's saves wrote, kept in a file of
this user's own (`$XDG_CACHE_HOME/torchtitan_ckpt/own-metadata`, by default under `~/.cache`).

A load scans a `.metadata` pickle before unpickling it (`untrusted.check_pickle`), so that a
crafted one cannot make the load hash or recurse without end; the scan is pure Python and the
largest cost of a load's index (`docs/performance.md`). Bytes that are exactly what this user's
own save wrote are not crafted: a load whose `.metadata` digest is listed here skips the scan
(the unpickler's allow-list and every later check still apply). A file that another user could
have written (not this user's, or writable by others) is not read; one that cannot be read or
written changes nothing but the scan's cost."""

from __future__ import annotations

import logging
import os
import secrets
import stat

logger = logging.getLogger(__name__)

KEPT = 4096
"""Digests kept: the newest, once the file holds twice as many."""

_LINE = 65
"""Bytes of one entry: the digest in hex and a newline."""


def _file() -> str | None:
    """Where the digests are kept, or None where this user has no cache folder."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(base):  # no home folder (`~` left as it is), or a relative setting
        return None
    return os.path.join(base, "torchtitan_ckpt", "own-metadata")


def _ours(fd: int) -> bool:
    """Whether the open file is a regular file of this user's that no one else may write."""
    info = os.fstat(fd)
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


def _folder_ours(folder: str) -> bool:
    """Whether `folder` is a folder of this user's that no one else may write (where another
    could, they could put a file of theirs in the list's place between two opens)."""
    info = os.lstat(folder)
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


def remember(digest: bytes) -> None:
    """List `digest`, of a `.metadata` this process just wrote."""
    path = _file()
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        if not _folder_ours(os.path.dirname(path)):
            return
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        try:
            if not _ours(fd):
                return
            os.write(fd, digest.hex().encode() + b"\n")  # one short append: whole, beside other jobs' appends
            size = os.fstat(fd).st_size
            if size > 2 * KEPT * _LINE:
                _keep_newest(path, os.pread(fd, KEPT * _LINE, size - KEPT * _LINE))
        finally:
            os.close(fd)
    except OSError as e:
        logger.debug("%s: the digest of a .metadata this job wrote is not kept (%s); a load of it scans it", path, e)


def _keep_newest(path: str, newest: bytes) -> None:
    """Replace the file by one of its `newest` bytes' whole lines (a file beside it, renamed
    over it). The file beside it has a name no other rewrite takes: one named by the process
    alone, left by a process killed while rewriting, would fail every rewrite of a later process
    given its pid, and the list would grow without end."""
    newest = newest[newest.index(b"\n") + 1:] if b"\n" in newest else b""
    part = f"{path}.{os.getpid()}.{secrets.token_hex(8)}"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.write(fd, newest)
        finally:
            os.close(fd)
        os.replace(part, path)
    except OSError:
        os.unlink(part)
        raise


def known(digest: bytes) -> bool:
    """Whether `digest` is listed: a `.metadata` of these bytes was written by this user's save."""
    path = _file()
    if path is None:
        return False
    try:
        if not _folder_ours(os.path.dirname(path)):
            return False
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not _ours(fd):
            return False
        size = os.fstat(fd).st_size
        start = max(0, size - 2 * KEPT * _LINE)  # the newest, where a rewrite failed and it grew
        listed = os.pread(fd, size - start, start)
    except OSError:
        return False
    finally:
        os.close(fd)
    return digest.hex().encode() in listed.split(b"\n")
