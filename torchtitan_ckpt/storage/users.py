"""Managers of one process using one checkpoint folder at the same time (an RLHF job's actor and
critic, or an EMA copy, built from one `[checkpoint]` section): each one's saves would replace
the other's steps of the same number, and its `load()` could take the other's. A manager that
saves may save or load only while no other manager of this process that saves there, not
closed, has saved or loaded there since it was made; one that only loads (`load_only`: a
frozen reference model's) is never refused, nor refuses another. A trainer that builds its manager again without closing the
first one goes on: the first is not used after the second is made."""

from __future__ import annotations

import itertools
import os
import weakref

from ..errors import CheckpointError
from . import scheme_of

_CLOCK = itertools.count(1)
"""Orders the making and the calls of this process's managers."""

_USERS: weakref.WeakSet[FolderUser] = weakref.WeakSet()
"""One per manager of this process, until it is closed or collected."""


class FolderUser:
    """A manager's use of the folder `url` (a link to it or a relative path names the same)."""

    def __init__(self, url: str, saves: bool):
        self.url = url
        self._saves = saves
        self._place = url if scheme_of(url) else os.path.realpath(url)
        self._made = next(_CLOCK)
        self._used = 0
        _USERS.add(self)

    def use(self, call: str) -> None:
        """Before each `save()` or `load()` (`call`), on every rank: refused where another
        manager of this process has saved or loaded in the folder since this one was made."""
        if self._saves and any(u is not self and u._saves and u._place == self._place and u._used > self._made
                               for u in list(_USERS)):
            raise CheckpointError(
                f"{call} refused: another CheckpointManager of this process, not closed, has saved or loaded in "
                f"{self.url} since this one was made. Each one's saves would replace the other's steps of the same "
                "number, and its load() could take the other's: give each manager a folder of its own "
                "(checkpoint.folder, or base_folder=), or close() the other one")
        self._used = next(_CLOCK)

    def close(self) -> None:
        _USERS.discard(self)
