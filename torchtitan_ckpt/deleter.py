"""The background thread that deletes the step folders retention chose (`policy.retention`)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from .io import safe_open
from .layout import StepFolder

logger = logging.getLogger(__name__)


class BackgroundDeleter:
    """Deletes step folders on a daemon thread so a save never waits for `rm -r`, each with
    `remove` (the store's: marker first, so a half-deleted step reads as partial); each named
    in the log by `describe` (the store's: an object-storage step by its URL)."""

    def __init__(self, remove: Callable[[StepFolder], None], describe: Callable[[str], str]) -> None:
        self._remove = remove
        self._describe = describe
        self._queue: queue.SimpleQueue[StepFolder | None] = queue.SimpleQueue()
        """Simple: its `put` may run inside a garbage collection on any thread (`stop`)."""
        self._pending: set[str] = set()
        """The folders queued or being deleted: retention picks a step again until it is gone,
        and a second removal would fail (FileNotFoundError) and warn about a step deleted fine."""
        self._ended = 0
        """How many deletions have ended (`mark`)."""
        self._gone: dict[str, int] = {}
        """Each folder deleted: the count of deletions ended once its own had."""
        self._lock = threading.Lock()
        self._emptied = threading.Condition(self._lock)
        """Notified as each deletion ends: `drain` waits on it until `_pending` is empty."""
        self._thread = threading.Thread(target=self._run, name="ckpt-deleter", daemon=True)
        self._thread.start()

    def mark(self) -> int:
        """Taken before listing the folders to `submit`: a folder whose deletion ended after it was
        listed before it went, and is not deleted again (which would find it gone, and warn of
        another job saving into the folder)."""
        with self._lock:
            return self._ended

    def submit(self, folders: list[StepFolder], listed_at: int | None = None) -> None:
        """Queue the deletion of `folders`, but of none already queued or being deleted, nor, with
        `listed_at` (the `mark` taken before they were listed), of one deleted since. Without it,
        they were listed while no deletion was in flight (after `drain`)."""
        for folder in folders:
            with self._lock:
                if folder.path in self._pending or (listed_at is not None
                                                    and self._gone.get(folder.path, -1) > listed_at):
                    continue
                self._pending.add(folder.path)
            self._queue.put(folder)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every deletion submitted so far is done (a load must not pick a step
        that is about to go), at most `timeout_s`; whether they are."""
        with self._lock:
            return self._emptied.wait_for(lambda: not self._pending, timeout_s)

    def settle(self, path: str) -> None:
        """Wait for the deletions submitted so far when `path` is among them: a save about to
        write a step folder that retention chose earlier (a step counter gone back) would
        otherwise have it removed after the save."""
        with self._lock:
            pending = path in self._pending
        if pending:
            self.drain()

    def close(self) -> None:
        """Finish pending deletions and stop the thread."""
        self.stop()
        self._thread.join()

    def stop(self) -> None:
        """Have the thread end once the pending deletions are done, without waiting for it."""
        self._queue.put(None)

    def _run(self) -> None:
        while (folder := self._queue.get()) is not None:
            removed = False
            try:
                self._remove(folder)
                removed = True
                logger.info("deleted %s %d (%s)", "old checkpoint step" if folder.loadable else
                            "the unfinished save of step", folder.step, self._describe(folder.path))
            except Exception as e:  # any failure: the thread keeps serving the next deletions
                why = (safe_open.removal_refused(folder.path, e) if isinstance(e, PermissionError) else
                       f"{type(e).__name__}: {e}")
                logger.warning("could not delete %s: %s", self._describe(folder.path), why)
            finally:
                with self._lock:
                    self._ended += 1
                    if removed:  # one that failed is deleted again by the next retention that lists it
                        self._gone[folder.path] = self._ended
                    self._pending.discard(folder.path)
                    self._emptied.notify_all()
