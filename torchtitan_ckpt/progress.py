"""Progress of long command-line work, in bytes: a tqdm bar on a terminal, periodic log lines
(done, rate, time left) when the output is a file or a pipe, nothing when disabled.

A `Progress` is called as `progress(phase, nbytes, total)`: `nbytes` more bytes of `phase` are
done, out of `total` for that phase on this rank. Calls may come from several threads. A new
phase name ends the previous phase (its bar, or a last line with its duration and throughput).
The library functions that report progress take a `(nbytes, total)` callable; `Progress.phase`
makes one for a named phase.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL = 10.0
"""Seconds between two progress lines when the output is not a terminal."""


def fmt_bytes(n: float) -> str:
    """1234567 -> '1.23 MB' (powers of 1000, as disks and `du --si` count)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def gb_per_s(nbytes: float, secs: float) -> float:
    """A throughput for a log line, in GB/s (powers of 1000); a zero duration counts as 1 ns."""
    return nbytes / 1e9 / max(secs, 1e-9)


def _fmt_seconds(s: float) -> str:
    s = int(s + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def launched_rank() -> int:
    """This process's rank as a launcher (torchrun) gives it in `RANK`; 0 in a plain process, or
    where `RANK` holds no number (set by something else)."""
    value = os.environ.get("RANK", "0").strip()
    return int(value) if value.isdecimal() else 0


def this_rank_draws() -> bool:
    """Under torchrun only rank 0 shows progress; a plain process is rank 0."""
    return launched_rank() == 0


class Progress:
    """Bytes done per phase; see the module docstring. `close()` ends the last phase."""

    def __init__(self, command: str, *, enabled: bool = True, stream: TextIO | None = None,
                 interval: float = DEFAULT_INTERVAL):
        self.command = command
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and _isatty(self.stream)
        self.interval = interval
        self._lock = threading.Lock()
        self._phase: str | None = None
        self._bar: tqdm | None = None
        self._done = self._total = 0
        self._started = self._last_line = 0.0

    def __call__(self, phase: str, nbytes: int, total: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            if phase != self._phase:
                self._end_phase()
                self._start_phase(phase, total)
            self._total = max(total, self._done + nbytes)
            self._done += nbytes
            if self._bar is not None:
                self._bar.total = self._total
                self._bar.update(nbytes)
            elif nbytes and self._done < self._total and time.monotonic() - self._last_line >= self.interval:
                self._log_line()

    def phase(self, name: str) -> Callable[[int, int], None]:
        """A `(nbytes, total)` callback that reports into phase `name`."""
        return lambda nbytes, total: self(name, nbytes, total)

    def close(self) -> None:
        with self._lock:
            self._end_phase()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_phase(self, phase: str, total: int) -> None:
        self._phase, self._done, self._total = phase, 0, total
        self._started = self._last_line = time.monotonic()
        if self.tty:
            width = _columns(self.stream)  # 0 on a terminal that never set its size (serial, new pty)
            self._bar = tqdm(total=total, desc=f"{self.command}: {phase}", unit="B", unit_scale=True,
                             unit_divisor=1000, file=self.stream, dynamic_ncols=width > 0,
                             ncols=None if width else 80, nrows=None if width else 24, mininterval=0.2)
        else:
            logger.info("%s: %s %s", self.command, phase, fmt_bytes(total))

    def _log_line(self) -> None:
        self._last_line = now = time.monotonic()
        rate = self._done / max(now - self._started, 1e-9)
        left = (self._total - self._done) / rate if rate > 0 else float("inf")
        eta = _fmt_seconds(left) if left != float("inf") else "?"
        logger.info("%s: %s %s of %s (%.0f%%), %s/s, %s left", self.command, self._phase, fmt_bytes(self._done),
                    fmt_bytes(self._total), 100 * self._done / max(self._total, 1), fmt_bytes(rate), eta)

    def _end_phase(self) -> None:
        if self._phase is None:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        else:
            secs = time.monotonic() - self._started
            logger.info("%s: %s %s in %.2f s (%s/s)", self.command, self._phase, fmt_bytes(self._done), secs,
                        fmt_bytes(self._done / max(secs, 1e-9)))
        self._phase = None


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0
