"""A folder held by one process at a time: an exclusive `flock` on a lock file, shared by the
stores of the process that holds it and released by the last of them (or by the process's end,
however it ends). Two jobs writing one folder would each replace the other's step in flight."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import secrets
import stat
from collections.abc import Callable

from ..errors import CheckpointError
from ..io import safe_open

logger = logging.getLogger(__name__)

_HOLDER_BYTES = 128
"""The holder's description (`pid N on HOST`) written in the lock file, at most."""


@dataclasses.dataclass
class _Hold:
    """How this process holds one lock file."""

    fd: int
    """The descriptor it is locked by; -1 on a file system without locks."""
    stores: int = 1
    """How many stores of this process use it."""
    written: bytes | None = None
    """The holder's description this process wrote in it (`taken_over`); None where none was."""


_HOLDERS: dict[str, _Hold] = {}
"""Lock file (its folder's real path) -> how this process holds it."""


def _key(lock: str) -> str:
    """One name for a lock file however its folder is reached (a link to it, `..`); the file's
    own name is never resolved (a link there is refused when it is opened)."""
    return os.path.join(os.path.realpath(os.path.dirname(lock)), os.path.basename(lock))


def claim(lock: str, what: str, remedy: str, named: bool = True) -> tuple[str, bool]:
    """Hold the lock file `lock` (made if need be, never through a link) for this process;
    returns its name to `release` it by, and True when no other store of this process held it.
    Held by another process: a `CheckpointError` saying that process (its pid, written in the
    file) uses `what`, and the `remedy`. The file is as writable by its group as its folder (a
    team's folder: by each user who may save there, whose exclusive lock NFS grants only on a
    file open for writing), never by other users; one this user cannot write is held all the
    same where the file system allows, its holder's pid left as it was, as it is without `named`
    (a short hold, `clean`'s, that a job on another node seeing its lock file changed would take
    for a job's: `taken_over`). On a file system without locks, `what` is used unheld, as before."""
    key = _key(lock)
    if key in _HOLDERS:
        _HOLDERS[key].stores += 1
        return key, False
    flags = os.O_NOFOLLOW | os.O_NONBLOCK  # a fifo in its place is opened without waiting, then refused
    try:
        fd = os.open(key, os.O_RDWR | os.O_CREAT | flags, 0o666)
        writable = True
    except PermissionError:
        try:
            fd, writable = os.open(key, os.O_RDONLY | flags), False
        except PermissionError as e:  # another user's, of its mode: whom to ask
            raise CheckpointError(f"{what} cannot be held by this job: {safe_open.denied(key, e.strerror)}; ask its "
                                  "owner to make it readable to you (a team's folder wants umask 002)") from None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise CheckpointError(f"{key} is a symbolic link (a `cp -rs` copy of the folder?), so {what} cannot be "
                              "held by this job: remove it (the job makes its own) and start again") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{key} is not a regular file (a fifo?), so {what} cannot be held by this job: "
                                  "remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            info = os.fstat(fd)  # as it is now it is locked: another job may have replaced it meanwhile
            try:
                now = os.stat(key, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
                how = "removed" if now is None else "replaced (as a job replaces a hard link there)"
                raise CheckpointError(f"{what} cannot be held by this job: its lock file {key} was {how} while this "
                                      f"job took it: {remedy}, or start again")
            if info.st_nlink != 1:  # not locked by another: a hard link's other name is not ours to write
                linked, fd = fd, _unlinked(key, what)  # only the holder of its lock replaces it
                os.close(linked)  # the other folder's alone now, and free
                info, writable = os.fstat(fd), True
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                logger.warning("%s: not locked (%s); one job at a time is assumed: a second job saving there "
                               "would replace this one's steps in flight", what, e)
                os.close(fd)
                _HOLDERS[key] = _Hold(-1)  # shared by this process's stores all the same
                return key, True
            holder = os.pread(fd, _HOLDER_BYTES, 0).decode(errors="replace").strip()
            linked = (f" (its lock file {key} is a hard link, shared with another folder's: a `cp -al` or `rsync "
                      "--link-dest` copy of a folder a job saves into? That process may be saving into the other "
                      "folder; once it restarts, the two are apart)" if info.st_nlink != 1 else "")
            raise CheckpointError(
                f"another process ({holder or 'pid unknown'}) uses {what}{linked}: {remedy}") from None
        hold = _Hold(fd)
        if writable and named:
            if info.st_uid == os.geteuid():  # as writable as the folder: NFS locks only what one may write
                try:  # never by others: in a folder any user may write to (/tmp) one would stop every save
                    os.fchmod(fd, stat.S_IMODE(os.stat(os.path.dirname(key)).st_mode) & 0o664)
                except OSError as e:  # FAT has no modes (ENOSYS through FUSE): the lock holds without one
                    logger.info("%s: held, but its mode could not be set on %s (%s)", what, key, e.strerror)
            os.ftruncate(fd, 0)
            try:
                mine = f"pid {os.getpid()} on {os.uname().nodename}".encode()[:_HOLDER_BYTES]
                os.pwrite(fd, mine, 0)
                hold.written = mine
            except OSError as e:  # a full disk: the holder's name only informs, the lock holds without it
                logger.info("%s: held, but its holder could not be written in %s (%s)", what, key, e.strerror)
    except BaseException:
        os.close(fd)
        raise
    _HOLDERS[key] = hold
    return key, True


def _unlinked(key: str, what: str) -> int:
    """A new lock file in the place of `key`, locked, whose descriptor is returned: `key` is a
    hard link (a `cp -al` or `rsync --link-dest` copy of the folder shares its file), whose
    other name is not ours to write in, and which a job in the other folder would find locked.
    Made under a name of its own and renamed over `key`, so a process opening `key` finds it
    locked. Where this user may not make it, refused naming the link."""
    made = f"{key}.{os.getpid()}.{secrets.token_hex(4)}.new"
    try:
        fd = os.open(made, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        raise CheckpointError(f"{key} is a hard link, its file shared with another name (a `cp -al` snapshot of the "
                              f"folder?), so {what} cannot be held by this job, and no lock file can be made beside "
                              f"it ({e.strerror}): remove it (the job makes its own) and start again") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(made, key)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.remove(made)
        raise
    logger.info("%s: its lock file %s was a hard link, shared with another name (a `cp -al` copy of the folder?): "
                "replaced by one of its own", what, key)
    return fd


def held(key: str) -> bool:
    """Whether the lock file `claim` named `key` is locked by this process (not on a file system
    without locks, where `claim` goes on unlocked)."""
    return key in _HOLDERS and _HOLDERS[key].fd >= 0


def taken_over(key: str) -> str | None:
    """The holder the lock file `key`, which this process holds, names now, where that is not
    this process: another process whose lock the file system granted too, on another node (its
    locks hold only on each node: NFS mounted `nolock` or `local_lock`, Lustre's `localflock`,
    FUSE). The file is opened anew, which on NFS reads what the server holds. None where this
    process wrote no holder in it, or the file cannot be read now."""
    mine = _HOLDERS[key].written if key in _HOLDERS else None
    if mine is None:
        return None
    try:
        fd = os.open(key, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        now = os.pread(fd, _HOLDER_BYTES, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None if now == mine else now.decode(errors="replace").strip() or "a process that wrote no name"


MOVED, REMOVED = "moved", "removed"


def whereabouts(key: str) -> str | None:
    """Where the lock file this process holds by `key` went, when it is no longer at that name:
    `MOVED` (it has a name elsewhere: its folder was moved, `mv` beside the running job) or
    `REMOVED` (it has none: the folder was deleted); None where it is in place, or the file
    system does not lock."""
    hold = _HOLDERS.get(key)
    if hold is None or hold.fd < 0:
        return None
    try:
        now = os.stat(key, follow_symlinks=False)
    except FileNotFoundError:
        now = None
    except OSError:  # not known to be gone
        return None
    mine = os.fstat(hold.fd)
    if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
        return None
    return MOVED if mine.st_nlink else REMOVED


def renew(key: str, claim_again: Callable[[], tuple[str, bool]]) -> None:
    """Hold the lock file `key` again, made anew by `claim_again` (a `claim` of it), where it was
    `REMOVED`: every store of this process that held the old one holds the new one. Where that
    fails (another job took the folder meanwhile), the old hold stays: each save tries again."""
    hold = _HOLDERS.pop(key)
    try:
        again, _ = claim_again()
    except BaseException:
        _HOLDERS[key] = hold
        raise
    if hold.fd >= 0:
        os.close(hold.fd)
    _HOLDERS[again].stores = hold.stores


def shared(key: str) -> bool:
    """Whether another store of this process holds the lock file `claim` named `key` too."""
    return key in _HOLDERS and _HOLDERS[key].stores > 1


def release(key: str) -> None:
    """One store of this process stops using what the lock file `claim` named `key` holds; the
    last one unlocks it (a child forked since, a data loader's worker, shares the lock until it
    is unlocked). In a forked child, whose parent holds the lock (`_forget_holders`), nothing."""
    if key not in _HOLDERS:
        return
    hold = _HOLDERS[key]
    if hold.stores > 1:
        hold.stores -= 1
        return
    del _HOLDERS[key]
    if hold.fd >= 0:
        fcntl.flock(hold.fd, fcntl.LOCK_UN)
        os.close(hold.fd)


def _forget_holders() -> None:
    """In a forked child: its copies of the lock files' descriptors are closed (the parent
    still holds the locks), so that a child outliving its parent does not keep them."""
    for hold in _HOLDERS.values():
        if hold.fd >= 0:
            os.close(hold.fd)
    _HOLDERS.clear()


os.register_at_fork(after_in_child=_forget_holders)
