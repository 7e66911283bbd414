"""The background thread that deletes the step folders retention chose (`policy.retention`)."""

from __future__ import annotations

import logging
import queue
import shutil
import threading

from . import commit, faults
from .layout import StepFolder

logger = logging.getLogger(__name__)


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
