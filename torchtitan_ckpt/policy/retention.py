"""Which old steps to delete once a new step has committed: a pure policy over step folders."""

from __future__ import annotations

from ..layout import PARTIAL, StepFolder


def steps_to_delete(folders: list[StepFolder], keep_latest_k: int) -> list[StepFolder]:
    """Folders to remove once a new step has committed: complete steps beyond the newest
    `keep_latest_k` (0 keeps all), and partial folders older than the newest complete step
    (left by a crash; nothing will ever complete them). The newest complete step is never chosen,
    nor is any folder this package did not write (foreign or unknown), nor a step folder that is
    a symlink (another run's, linked in)."""
    committed = sorted((f for f in folders if f.committed), key=lambda f: f.step)
    if not committed:
        return []
    newest = committed[-1].step
    doomed = committed[:-keep_latest_k] if keep_latest_k > 0 else []
    doomed += [f for f in folders if f.status == PARTIAL and f.step < newest]
    return sorted((f for f in doomed if not f.linked), key=lambda f: f.step)
