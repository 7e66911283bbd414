"""Python's cyclic garbage collector paused while a save or a load builds DCP's objects.

A load unpickles `.metadata` and plans, a save plans and pickles `.metadata`: tens to hundreds
of thousands of small objects. Each few hundred allocations count towards a collection, and
every so often one is a full collection, which walks every object of the process; a training
process holds hundreds of thousands (its modules, DTensor specs, plan caches), so those
collections can cost several times the work that triggered them (`docs/performance.md`).
Reference counting still frees everything that is not in a cycle, and the collector runs as
before once the last save or load in progress leaves. The pause is the process's: while a
background save builds its objects, the training thread's cyclic garbage waits too, so a
background save pauses only there, not while its bytes are written and made durable (most of
its time, with saves back to back the whole run).
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.RLock()
"""Re-entrant: a signal handler may pause from inside a pause being entered on its thread."""
_holders = 0
_mine = threading.local()
"""`held`: how many of the holders are this thread's."""
_resume = False
"""Whether the collector was enabled when the first holder paused it (a program that disabled
it itself keeps it disabled)."""


@contextmanager
def paused() -> Iterator[None]:
    """No cyclic collection while any thread is inside (a background save and a load may
    overlap); the collector's own state is back once the last one leaves. A `gc.enable()` or
    `gc.disable()` made by the program while a pause is held is overridden when it ends."""
    entered = False
    try:
        with _lock:
            _take()
            entered = True
        yield
    finally:
        if entered:
            with _lock:
                _let_go()


@contextmanager
def lifted() -> Iterator[None]:
    """Inside a `paused()` block of this thread: one pause of this thread let go for the block
    (the collector back on unless another holds it paused), and taken again after. Elsewhere,
    nothing."""
    if not getattr(_mine, "held", 0):
        yield
        return
    with _lock:
        _let_go()
    try:
        yield
    finally:
        with _lock:
            _take()


def _take() -> None:
    """One holder more, of this thread (`_lock` held): the first pauses the collector."""
    global _holders, _resume
    if _holders == 0:
        _resume = gc.isenabled()
        gc.disable()
    _holders += 1
    _mine.held = getattr(_mine, "held", 0) + 1  # a fresh count in a child forked inside a block


def _let_go() -> None:
    """One holder fewer, of this thread (`_lock` held): the last one resumes the collector. At
    least 0: a forked child leaving a block its parent entered holds none."""
    global _holders
    _holders = max(0, _holders - 1)
    _mine.held = max(0, getattr(_mine, "held", 0) - 1)
    if _holders == 0 and _resume:
        gc.enable()


def _after_fork_in_child() -> None:
    """A process forked during a pause (a data loader's worker forked while a background save
    runs) holds none of its holders, which stay in the parent: it starts unpaused, with a fresh
    lock (the parent's may have been held by another thread at the fork)."""
    global _lock, _holders, _mine
    _lock, _mine = threading.RLock(), threading.local()
    if _holders and _resume:
        gc.enable()
    _holders = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
