"""The optimizer step pre-hook that holds a step back while a background save still copies what
the step would change.

Each optimizer given to a manager gets one pre-hook of this module, registered the first time
and never removed: removing a hook while the optimizer walks its hooks (a step on the training
thread, a `close()` on a watchdog's thread or in a signal handler) fails that step
("OrderedDict mutated during iteration"). The waits attached to an optimizer are a tuple that
`attach` and `detach` replace whole, so a step calls those attached when it began; a manager
detaches once its last save is done. Each wait is held weakly: a manager collected unclosed is
no longer waited on, and an optimizer dropped takes its entry with it.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

_attached: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[weakref.WeakMethod, ...]] = \
    weakref.WeakKeyDictionary()
"""Optimizer -> the waits (bound methods of managers, held weakly) its step calls first."""
_lock = threading.Lock()
"""Held by `attach` and `detach` (two managers made on two threads); a step reads without it."""


def attach(optimizer: torch.optim.Optimizer, wait: Callable[[], None]) -> None:
    """Call `wait` (a bound method, held weakly) before each of `optimizer`'s steps, until
    `detach`."""
    with _lock:
        if optimizer not in _attached:
            optimizer.register_step_pre_hook(_hook())
        _attached[optimizer] = (*_live(optimizer), weakref.WeakMethod(wait))


def detach(optimizer: torch.optim.Optimizer, wait: Callable[[], None]) -> None:
    """No longer call `wait` before `optimizer`'s steps; a step already walking its waits may
    call it once more."""
    with _lock:
        if optimizer in _attached:
            _attached[optimizer] = tuple(ref for ref in _live(optimizer) if ref() != wait)


def waits(optimizer: torch.optim.Optimizer) -> list[Callable[[], None]]:
    """The waits attached to `optimizer` whose managers are alive."""
    return [wait for ref in _attached.get(optimizer, ()) if (wait := ref()) is not None]


def _live(optimizer: torch.optim.Optimizer) -> tuple[weakref.WeakMethod, ...]:
    return tuple(ref for ref in _attached.get(optimizer, ()) if ref() is not None)


def _before_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    for wait in waits(optimizer):
        wait()


@functools.cache
def _hook() -> Callable[..., None]:
    """`_before_step`, never compiled with an optimizer step that `torch.compile` compiles: a
    wait on another thread, which Dynamo traced again at every step (up to its recompile
    limit). Made at the first use, not at import (it imports Dynamo)."""
    return torch.compiler.disable(_before_step)
