"""What every storage backend provides to the manager's save, commit, load and retention."""

from __future__ import annotations

import logging
import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Collection, Hashable, Mapping, Sequence

from .. import commit
from ..commit import CommitInfo
from ..errors import CorruptCheckpointError, NewerVersionError, OlderVersionError
from ..group import CheckpointGroup
from ..layout import StepFolder, folder_bytes

logger = logging.getLogger(__name__)


def warn_replacing(where: str) -> None:
    """Say that a save replaces a complete step (by `Store.prepare`, on rank 0)."""
    logger.warning("replacing %s, a complete step saved before (saved again: after a load that passed it over "
                   "or went back to an older step, or as another kind of save)", where)


class Store(ABC):
    """A checkpoint folder on some storage. Formats always write into and read from the local
    folder `root`; a remote store moves bytes between it and the remote place. Methods run on
    every rank unless they say otherwise."""

    url: str
    """The folder as the user named it (absolute for a path), for messages and rank agreement."""
    root: str
    """The local folder whose `step-N` folders the formats write and read."""
    staged: bool = False
    """Whether `root` is this rank's own local staging folder, which `publish` uploads from:
    its files need no fsync, and a file the ranks write jointly holds only this rank's bytes
    (`publish` combines them). Else every rank sees the same `root`, and it is the checkpoint."""
    sole_writer: bool = False
    """Whether a job that saves is the folder's only writer (it holds a lock on the folder): a
    partial step folder there is then a save that stopped, whatever its step, never another
    job's in flight (`CheckpointManager.load` removes it)."""

    def describe(self, path: str) -> str:
        """A local path under `root` as the user knows it (the object's URL for a remote store)."""
        return path

    def in_user_terms(self, text: str) -> str:
        """`text` (an error, a problem found) with the local paths it names under any rank's
        `root` as the user knows them (`describe`): readers name the files they read."""
        return text

    def reach(self, group: CheckpointGroup, write: bool = True) -> None:
        """At start-up, before any store of the job makes anything (`check`): the storage answers
        (and, with `write`, takes a write), leaving nothing behind; a `ConfigError` naming the
        folder otherwise (raised on every rank). A file system has nothing to reach: its
        `check` writes into the folder."""

    @abstractmethod
    def check(self, group: CheckpointGroup, write: bool = True) -> None:
        """At start-up, once every store of the job is reached: the folder is usable (and, with
        `write`, writable, and every rank sees the same one), making what the store needs on
        this node; a `ConfigError` naming the folder otherwise (raised on every rank)."""

    @abstractmethod
    def step_around(self) -> str | None:
        """The step folder (ours, or another program's DCP step named as one) that the store's
        folder is or is inside, as the user names it, else None: a job saving there would write
        into that step, and its retention remove the job's steps with it."""

    @abstractmethod
    def scan(self, folder: str) -> list[StepFolder]:
        """The `step-N` folders under the local folder `folder` (`root` or one below it), oldest
        first, with paths under `root`."""

    @abstractmethod
    def prepare(self, path: str, step: int) -> None:
        """Rank 0: make `path` an empty step folder of ours marked in progress (replacing a
        leftover of ours; refusing another program's)."""

    def replaceable(self, folder: StepFolder) -> bool:
        """Whether `prepare` would replace `folder` rather than refuse it: a step of ours (or
        what a save left before marking it: `empty`), not a link to one (a run linked in is
        loaded from, never changed), that this user may remove (`unremovable`) and that holds
        nothing of a user's (`unlisted`)."""
        return ((folder.ours and not folder.linked) or self.empty(folder)) and self.unremovable(folder) is None \
            and not self.unlisted(folder)

    @abstractmethod
    def unlisted(self, folder: StepFolder) -> list[str]:
        """What the committed step `folder` holds that its manifest does not list (a user's
        evaluation results, notes, a repository), relative to it: not written here, so never
        removed or replaced here. None ([]) for a step not committed, or whose marker cannot be
        read (no manifest to tell by)."""

    def empty(self, folder: StepFolder) -> bool:
        """Whether `folder` is what a save leaves when it stops (or is seen starting) before its
        first file: told as such to every reader, whether or not it may replace it. A store
        without folders has no such thing."""
        return False

    def unremovable(self, folder: StepFolder) -> str | None:
        """Why this user may not remove `folder` (for a message), or None: a store where a step
        is this user's to remove if it may write there has nothing to say."""
        return None

    def close(self) -> None:
        """When the job is done with the store (the manager's `close`): let go of what it
        holds on this node."""

    def prepare_rank(self, path: str) -> None:
        """Every rank, before writing: make sure this rank can write into `path`."""

    def publish(self, path: str, files: dict[str, tuple[int, str]], group: CheckpointGroup,
                joint: Sequence[str] = (), last: Sequence[str] = ()) -> dict[str, tuple[int, str]]:
        """Every rank, once its files of `path` are durable locally (`files`: their writers'
        size and CRC-32): make them durable in the store. `joint` files were written by every
        rank at their final offsets, each byte by one rank (zeros elsewhere in a rank's copy
        when the folder is `staged`); `last` ones go after every rank's others (an index
        that says the rest is complete). Returns the (size, CRC-32) of every file of this rank's
        that the commit manifest lists."""
        return files

    @abstractmethod
    def commit(self, path: str, info: CommitInfo, checksums: dict[str, tuple[int, str]]) -> None:
        """Rank 0, after every rank's `publish`: write the commit marker, last, filling `info`'s
        files and time. Nothing is returned: the round it runs in hands its result to every
        rank, and a list of every file would grow that round with the ranks squared."""

    def fetch(self, path: str, names: Sequence[str] | None = None) -> str:
        """Every rank, before reading the step (or any checkpoint folder) at `path`: make its
        files (or only those of `names` that exist, relative to `path`) readable there.
        Returns `path`."""
        return path

    def read_marker(self, path: str) -> CommitInfo:
        """The commit marker of the step of ours at `path`, fetched (`commit.read_marker`); a
        damaged one (or another version's) is refused naming the step as the user does
        (`describe`), not a downloaded copy."""
        try:
            return commit.read_marker(self.fetch(path, [commit.MARKER]))
        except (CorruptCheckpointError, NewerVersionError, OlderVersionError) as e:
            if (where := self.describe(path)) == path:
                raise
            said = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)  # unescaped: `path` as it is
            raise type(e)(said.replace(path, where)) from e  # each of these takes its message alone

    def copy_of(self, path: str) -> Hashable:
        """What tells apart the copies of the step at `path` that ranks read: ranks that give
        the same value read one copy (a shared folder, a bucket), and `verify_on_load` shares
        its files out among them; ranks reading a copy of their own (a step copied to each
        node's disk) check all of it."""
        return None

    def fetch_ranges(self, path: str, ranges: Mapping[str, Sequence[tuple[int, int]]]) -> None:
        """Every rank, before reading byte ranges of files of `path` ({file relative to `path`:
        [(offset, length)]}): make those bytes readable at their offsets there."""

    def sizes(self, path: str, names: Collection[str]) -> dict[str, int | None]:
        """For each of `names` (files of the step folder `path`, relative to it), the bytes the
        store holds of it, None where it holds nothing by that name: no byte of them is read. A
        name held as something else than a file (a link that leads nowhere, a fifo) or that may
        not be looked at is left out, for the read to name it."""
        found: dict[str, int | None] = {}
        for rel in names:
            full = os.path.join(path, rel)
            try:
                st = os.stat(full)
            except FileNotFoundError:
                if not os.path.lexists(full):
                    found[rel] = None
                continue
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                found[rel] = st.st_size
        return found

    def size(self, path: str) -> int:
        """The bytes of every file under the folder `path` in the store."""
        return folder_bytes(path)

    @abstractmethod
    def remove(self, folder: StepFolder) -> None:
        """Rank 0's deleter: delete a step of ours, its commit marker first."""
