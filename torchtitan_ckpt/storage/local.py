"""The local or shared file system: the formats write the checkpoint folder itself, and the
commit is `commit.write_marker`'s fsync-and-rename."""

from __future__ import annotations

import logging
import os
import uuid

from .. import commit, faults, layout
from ..errors import CheckpointError, ConfigError, RankFailed
from ..io import durable, safe_open
from ..group import CheckpointGroup
from . import lock
from .base import Store, warn_replacing

logger = logging.getLogger(__name__)

_PROBE = ".probe-{token}-rank{rank}"
LOCK_FILE = ".torchtitan_ckpt.lock"
"""In the checkpoint folder: held by the job that saves there (`LocalStore._hold`)."""


class LocalStore(Store):
    """A folder on a file system; every rank must see the same one (`check`)."""

    def __init__(self, folder: str):
        self.url = self.root = os.path.abspath(folder)  # a relative folder stays where it was made
        self._lock: str | None = None  # the lock file, while this store holds the folder (`_hold`)

    def check(self, group: CheckpointGroup, write: bool = True) -> None:
        """With `write`, every rank writes a probe file into the folder (one that cannot be
        written fails now, not at the first save after hours of training), then looks for every
        other rank's: a folder that is not shared (a node-local disk) would otherwise give a step
        whose marker lists only rank 0's files, complete to look at and missing every other
        node's shards. Rank 0 then holds the folder for the job (`_hold`)."""
        if not write:
            return
        token = group.broadcast(uuid.uuid4().hex)
        probes = [os.path.join(self.root, _PROBE.format(token=token, rank=r)) for r in range(group.world_size)]
        try:
            group.run(lambda: self._write_probe(probes[group.rank]))
        except RankFailed as failed:
            raise ConfigError("checkpoint.folder", self.root, f"cannot write there: {failed} (a job that only reads "
                              "its steps sets checkpoint.load_only = true)") from None
        # rank 0 looks for every rank's probe, the others for rank 0's: a rank and rank 0 that see
        # each other's files share the folder, so every rank shares it, in O(ranks) lookups
        looked = range(group.world_size) if group.is_coordinator else [0]
        unseen = group.all_gather([r for r in looked if not os.path.exists(probes[r])])
        os.remove(probes[group.rank])
        for rank, missing in enumerate(unseen):
            if missing:
                raise ConfigError("checkpoint.folder", self.root, (
                    f"rank {rank} does not see the files rank(s) {missing} wrote there: the folder is not "
                    "shared by every rank (a node-local disk?), and a step saved there would be spread over "
                    "the nodes with no node holding all of it. Use a file system every rank shares, or "
                    "object storage (checkpoint.folder = 's3://bucket/prefix', docs/storage.md)"))
        try:
            group.run(self._hold, coordinator_only=True)
        except RankFailed as failed:
            raise ConfigError("checkpoint.folder", self.root, str(failed.error or failed)) from None

    def _hold(self) -> None:
        """Hold the folder for this job until `close` (`lock.claim` on `LOCK_FILE` in it): a
        second job saving into it (the same run started again while the first still runs)
        would replace the first's step in flight, whose marker would then list the second's
        files, and each would report its save done. A second manager of this process shares the
        hold, with a warning (`users`: only one of the two may save or load there)."""
        self._lock, first = self._claim()
        if not first:  # shared: neither deletes the other's steps in flight (`sole_writer`)
            logger.warning("another CheckpointManager of this process holds %s and is not closed: while both save, "
                           "the second one to save there is refused. close() the first (a trainer "
                           "building its manager again; one dropped without close() holds the folder until the "
                           "process ends), or give each manager a folder of its own", self.root)

    def _claim(self) -> tuple[str, bool]:
        return lock.claim(os.path.join(self.root, LOCK_FILE), f"{self.root} to save into",
                          "one job saves into a folder at a time; stop that job first, or give this one a folder of "
                          "its own (where its host is down, NFSv3 keeps its lock until that host is up again: once "
                          "sure no job saves there, remove the lock file). Where that process is a rank of this job, its "
                          "ranks made their managers without joining one process group: call "
                          "torch.distributed.init_process_group() before making the CheckpointManager")

    @property
    def sole_writer(self) -> bool:
        """On rank 0, which holds the lock (`_hold`), where the file system locks, and no other
        store of this process holds it too (another manager's save may be in flight there)."""
        return self._lock is not None and lock.held(self._lock) and not lock.shared(self._lock)

    def close(self) -> None:
        if self._lock is not None:
            lock.release(self._lock)
            self._lock = None

    def _write_probe(self, probe: str) -> None:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise NotADirectoryError(f"{self.root} is a file, not a folder")
        durable.make_dir(self.root, exist_ok=True)
        with open(probe, "w"):
            pass

    def step_around(self) -> str | None:
        return layout.step_folder_around(self.root)

    def scan(self, folder: str) -> list[layout.StepFolder]:
        return layout.scan(folder)

    def prepare(self, path: str, step: int) -> None:
        self._check_in_place(removed_ok=True)
        if os.path.lexists(path):  # a leftover of ours, or a step saved again: it is replaced
            folder = layout.StepFolder(step, path, layout.status_of(path), layout.linked_in(path))
            if folder.linked:
                linked = path if os.path.islink(path) else os.path.join(path, commit.MARKER)
                raise CheckpointError(f"{linked} is a link to {os.path.realpath(linked)}: a step folder linked in "
                                      "from elsewhere is never replaced; remove it or save into another folder")
            if denied := self.unremovable(folder):
                raise CheckpointError(f"{path} exists and this user may not remove it ({denied}): ask its owner, "
                                      "or save into another folder")
            commit.refuse_unlisted(path, self.unlisted(folder))
            if not self.replaceable(folder):
                raise CheckpointError(f"{path} exists and was not written by torchtitan_ckpt; it is "
                                      "never replaced: move it away or save into another folder")
            if layout.empty_step(path):
                os.rmdir(path)
            else:
                if folder.status == layout.COMPLETE:
                    warn_replacing(path)
                commit.remove_step(path)
        durable.make_dir(path)
        commit.mark_in_progress(path)  # ours from now on, even if this save crashes
        faults.hit("prepare", step)

    def unlisted(self, folder: layout.StepFolder) -> list[str]:
        return commit.unlisted(folder.path)

    def empty(self, folder: layout.StepFolder) -> bool:
        return layout.empty_step(folder.path)

    def unremovable(self, folder: layout.StepFolder) -> str | None:
        return safe_open.removal_denied(folder.path)

    def copy_of(self, path: str) -> tuple[int, int] | None:
        """The commit marker's inode and modification time: one file on a shared file system
        (NFS and parallel file systems give every client the server's), another for a copy on
        each node's disk; None where it cannot be read (the verification says why)."""
        try:
            st = os.stat(os.path.join(path, commit.MARKER))
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns

    def commit(self, path: str, info: commit.CommitInfo, checksums: dict[str, tuple[int, str]]) -> None:
        """Not where another job has claimed the folder since (`lock.taken_over`): the two would
        replace each other's steps in flight."""
        self._check_in_place()
        if self._lock is not None and (other := lock.taken_over(self._lock)):
            raise CheckpointError(
                f"{self.root}: {other} claimed this folder after this job did (its {LOCK_FILE} names it): this file "
                "system's locks hold only on each node (NFS mounted nolock or local_lock, Lustre's localflock, "
                "FUSE), and two jobs saving there replace each other's steps; this step is not committed. Give "
                "each job a folder of its own")
        commit.write_marker(path, info, checksums)

    def _check_in_place(self, removed_ok: bool = False) -> None:
        """Refuse a save into a folder moved since this job took it (`lock.whereabouts`): the save
        would make it again at the old name, unheld, and the run would go on in two places. One
        removed (its steps deleted while the job runs), before a save starts (`removed_ok`): made
        and held again, with a warning."""
        where = lock.whereabouts(self._lock) if self._lock is not None else None
        if where == lock.REMOVED and removed_ok:
            logger.warning("%s was removed while this job saved there: its steps are gone; the job saves on into "
                           "it anew", self.root)
            if not os.path.isdir(self.root):
                durable.make_dir(self.root)
            lock.renew(self._lock, self._claim)
        elif where is not None:
            raise CheckpointError(f"{self.root} was {where} since this job began saving there (the {LOCK_FILE} it "
                                  "holds is no longer in it); this step is not saved: "
                                  + ("move the folder back, or start the job again from where it is now"
                                     if where == lock.MOVED else "save again"))

    def remove(self, folder: layout.StepFolder) -> None:
        if folder.status == layout.PARTIAL and (now := layout.status_of(folder.path)) != layout.PARTIAL:
            raise CheckpointError(f"{folder.path} was chosen as a partial step and is {now} now: left alone (does "
                                  "another job save into this folder?)")
        commit.refuse_unlisted(folder.path, self.unlisted(folder))
        commit.uncommit(folder.path)  # a half-deleted folder must read as partial
        faults.hit("purge", folder.step)
        commit.remove_step(folder.path)
