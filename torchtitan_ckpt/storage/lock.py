"""A folder held by one process at a time: an exclusive `flock` on a lock file, shared by the
stores of the process that holds it and released by the last of them (or by the process's end,
however it ends). Two jobs writing one folder would each replace the other's step in flight."""

from __future__ import annotations

import errno
import fcntl
import logging
import os

from ..errors import CheckpointError

logger = logging.getLogger(__name__)

_HOLDER_BYTES = 128
"""The holder's description (`pid N on HOST`) written in the lock file, at most."""

_HOLDERS: dict[str, tuple[int, int]] = {}
"""Lock file -> the descriptor by which this process holds it (-1 on a file system without
locks), and how many stores of this process use it."""


def claim(lock: str, what: str, remedy: str) -> bool:
    """Hold the lock file `lock` (made if need be, never through a link) for this process; True
    when no other store of this process held it. Held by another process: a `CheckpointError`
    saying that process (its pid, written in the file) uses `what`, and the `remedy`. On a file
    system without locks, `what` is used unheld, as before."""
    if lock in _HOLDERS:
        fd, count = _HOLDERS[lock]
        _HOLDERS[lock] = fd, count + 1
        return False
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, _HOLDER_BYTES, 0).decode(errors="replace").strip()
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            logger.info("%s: not locked (%s); one job at a time is assumed", what, e)
            _HOLDERS[lock] = -1, 1  # shared by this process's stores all the same
            return True
        raise CheckpointError(f"another process ({holder or 'pid unknown'}) uses {what}: {remedy}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode()[:_HOLDER_BYTES], 0)
    _HOLDERS[lock] = fd, 1
    return True


def release(lock: str) -> None:
    """One store of this process stops using what `lock` holds; the last one unlocks it (a
    child forked since, a data loader's worker, shares the lock until it is unlocked)."""
    fd, count = _HOLDERS[lock]
    if count > 1:
        _HOLDERS[lock] = fd, count - 1
        return
    del _HOLDERS[lock]
    if fd >= 0:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _forget_holders() -> None:
    """In a forked child: its copies of the lock files' descriptors are closed (the parent
    still holds the locks), so that a child outliving its parent does not keep them."""
    for fd, _ in _HOLDERS.values():
        if fd >= 0:
            os.close(fd)
    _HOLDERS.clear()


os.register_at_fork(after_in_child=_forget_holders)
