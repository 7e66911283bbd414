"""Managers of one process saving into one checkpoint folder (an RLHF job's actor and critic, or
an EMA copy, built from one `[checkpoint]` section): each one's saves would replace the other's
steps of the same number, and a later load could take the other's weights. A manager may save
only while no other manager of this process, not closed, has saved there since it was made.
Loads are not held back (an evaluation reading the steps the training saves), nor is a manager
that only loads (`load_only`). A trainer that makes its manager again without closing the first
one goes on: the first does not save after the second is made, and its save in flight is waited
for by the second when it is made and at each of its calls (`settle_earlier`)."""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Callable

from ..errors import CheckpointError
from . import scheme_of

_CLOCK = itertools.count(1)
"""Orders the making and the saves of this process's managers."""

_USERS: weakref.WeakSet[FolderUser] = weakref.WeakSet()
"""One per manager of this process that saves, until it is closed or collected."""


class FolderUser:
    """A manager's saves into the folder `url` (a link to it or a relative path names the same)."""

    def __init__(self, url: str, saves: bool):
        self.url = url
        self._place = url if scheme_of(url) else os.path.realpath(url)
        self._made = next(_CLOCK)
        self._saved = 0
        self._pid = os.getpid()
        self.settle: Callable[[], None] = _nothing
        """Wait for the manager's save in flight, raising nothing (set once its saves start)."""
        if saves:
            _USERS.add(self)

    def settle_earlier(self) -> None:
        """Wait for the save in flight of each manager of this process made before this one and
        not closed that saves into the folder: a trainer that made its manager again (a
        notebook's cell run again) loaded the step before that save's, passing over the one in
        flight as unfinished, and saved the same step over it. A manager that only loads waits
        for none, nor does a forked child for its parent's (whose threads it has not)."""
        if self in _USERS:
            for user in [u for u in list(_USERS) if u is not self and u._place == self._place
                         and u._made < self._made and u._pid == os.getpid()]:
                user.settle()

    def save(self, call: str) -> None:
        """At each `save()` (`call`), on every rank: refused where another manager of this
        process has saved in the folder since this one was made; an earlier one's save in flight
        waited for first."""
        self.settle_earlier()
        if any(u is not self and u._place == self._place and u._saved > self._made for u in list(_USERS)):
            raise CheckpointError(
                f"{call} refused: another CheckpointManager of this process, not closed, has saved into {self.url} "
                "since this one was made. Each one's saves would replace the other's steps of the same number, and "
                "a load could take the other's: give each manager a folder of its own (checkpoint.folder, or "
                "base_folder=), or close() the other one")
        self._saved = next(_CLOCK)

    def close(self) -> None:
        _USERS.discard(self)


def _nothing() -> None:
    """A manager's `settle` until its saves start."""
