"""How a save overlaps training. A strategy is picked once from `async_mode`.

`SynchronousSaves` runs the whole save (write and commit) inside `save()`.
"""

from __future__ import annotations

from collections.abc import Callable


class SynchronousSaves:
    """`async_mode = "disabled"`: the training loop waits until the step is committed."""

    def submit(self, save: Callable[[], None]) -> None:
        save()

    def wait(self) -> None:
        """Nothing is ever in flight."""

    def close(self) -> None:
        """Nothing to shut down."""


def make_strategy(async_mode: str) -> SynchronousSaves:
    if async_mode == "disabled":
        return SynchronousSaves()
    # config validation rejects every other mode before a manager is built
    raise ValueError(f"unsupported async_mode {async_mode!r}")
