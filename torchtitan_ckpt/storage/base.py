"""What every storage backend provides to the manager's save, commit, load and retention."""

from __future__ import annotations

from abc import ABC, abstractmethod

from ..commit import CommitInfo
from ..group import CheckpointGroup
from ..layout import StepFolder


class Store(ABC):
    """A checkpoint folder on some storage. Formats always write into and read from the local
    folder `root`; a remote store moves bytes between it and the remote place. Methods run on
    every rank unless they say otherwise."""

    url: str
    """The folder as the user named it (absolute for a path), for messages and rank agreement."""
    root: str
    """The local folder whose `step-N` folders the formats write and read."""

    def describe(self, path: str) -> str:
        """A local path under `root` as the user knows it (the object's URL for a remote store)."""
        return path

    @abstractmethod
    def check(self, group: CheckpointGroup, write: bool = True) -> None:
        """At start-up: the folder is reachable (and, with `write`, writable, and every rank
        sees the same one); a `ConfigError` naming the folder otherwise (raised on every rank)."""

    @abstractmethod
    def scan(self, folder: str) -> list[StepFolder]:
        """The `step-N` folders under the local folder `folder` (`root` or one below it), oldest
        first, with paths under `root`."""

    @abstractmethod
    def prepare(self, path: str, step: int) -> None:
        """Rank 0: make `path` an empty step folder of ours marked in progress (replacing a
        leftover of ours; refusing another program's)."""

    def prepare_rank(self, path: str) -> None:
        """Every rank, before writing: make sure this rank can write into `path`."""

    def publish(self, path: str, files: dict[str, tuple[int, str]]) -> dict[str, tuple[int, str]]:
        """Every rank, once its files of `path` are durable locally (`files`: their writers'
        size and CRC-32): make them durable in the store. Returns the (size, CRC-32) of every
        file of this rank's that the commit manifest lists."""
        return files

    @abstractmethod
    def commit(self, path: str, info: CommitInfo, checksums: dict[str, tuple[int, str]]) -> CommitInfo:
        """Rank 0, after every rank's `publish`: write the commit marker, last."""

    def fetch(self, path: str) -> str:
        """Every rank, before reading the step (or any checkpoint folder) at `path`: make its
        files readable there. Returns `path`."""
        return path

    @abstractmethod
    def remove(self, folder: StepFolder) -> None:
        """Rank 0's deleter: delete a step of ours, its commit marker first."""
