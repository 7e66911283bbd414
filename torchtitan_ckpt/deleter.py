"""The background thread that deletes the step folders retention chose (`policy.retention`)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from .layout import StepFolder

logger = logging.getLogger(__name__)


class BackgroundDeleter:
    """Deletes step folders on a daemon thread so a save never waits for `rm -r`, each with
    `remove` (the store's: marker first, so a half-deleted step reads as partial)."""

    def __init__(self, remove: Callable[[StepFolder], None]) -> None:
        self._remove = remove
        self._queue: queue.Queue[StepFolder | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ckpt-deleter", daemon=True)
        self._thread.start()

    def submit(self, folders: list[StepFolder]) -> None:
        for folder in folders:
            self._queue.put(folder)

    def drain(self) -> None:
        """Wait until every deletion submitted so far is done (a load must not pick a step
        that is about to go)."""
        self._queue.join()

    def close(self) -> None:
        """Finish pending deletions and stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (folder := self._queue.get()) is not None:
            try:
                self._remove(folder)
                logger.info("deleted old checkpoint step %d (%s)", folder.step, folder.path)
            except Exception as e:  # any failure: the thread keeps serving the next deletions
                logger.warning("could not delete %s: %s: %s", folder.path, type(e).__name__, e)
            finally:
                self._queue.task_done()
        self._queue.task_done()  # the stop: a `drain()` after `close()` returns at once
