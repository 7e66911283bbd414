"""Which old steps to delete (a pure policy) and the background thread that deletes them."""

from __future__ import annotations

import logging
import queue
import shutil
import threading

from . import commit, faults
from .layout import StepFolder

logger = logging.getLogger(__name__)


def steps_to_delete(folders: list[StepFolder], keep_latest_k: int) -> list[StepFolder]:
    """Folders to remove once a new step has committed: complete steps beyond the newest
    `keep_latest_k` (0 keeps all), and partial folders older than the newest complete step
    (left by a crash; nothing will ever complete them). The newest complete step is never chosen."""
    committed = sorted((f for f in folders if f.committed), key=lambda f: f.step)
    if not committed:
        return []
    newest = committed[-1].step
    doomed = committed[:-keep_latest_k] if keep_latest_k > 0 else []
    doomed += [f for f in folders if not f.committed and f.step < newest]
    return sorted(doomed, key=lambda f: f.step)


class BackgroundDeleter:
    """Deletes step folders on a daemon thread so a save never waits for `rm -r`."""

    def __init__(self) -> None:
        self._queue: queue.Queue[StepFolder | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ckpt-deleter", daemon=True)
        self._thread.start()

    def submit(self, folders: list[StepFolder]) -> None:
        for folder in folders:
            self._queue.put(folder)

    def close(self) -> None:
        """Finish pending deletions and stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (folder := self._queue.get()) is not None:
            try:
                commit.uncommit(folder.path)  # a half-deleted folder must read as partial
                faults.hit("purge", folder.step)
                shutil.rmtree(folder.path)
                logger.info("deleted old checkpoint step %d (%s)", folder.step, folder.path)
            except OSError as e:
                logger.warning("could not delete %s: %s", folder.path, e)
