"""Which old steps to delete once a new step has committed: a pure policy over step folders."""

from __future__ import annotations

from collections.abc import Collection

from ..layout import PARTIAL, StepFolder


def steps_to_delete(folders: list[StepFolder], keep_latest_k: int, committed_now: int,
                    keep: Collection[int] = ()) -> list[StepFolder]:
    """Folders to remove once step `committed_now` has committed: complete steps beyond the
    newest `keep_latest_k` (0 keeps all) up to `committed_now`, and partial folders older than
    it (left by a crash; nothing will ever complete them). Steps above it are left alone: they
    are from before the job went back to an older step (`load(step)`, `load_step`), and
    counting them would delete the steps this job saves next, as soon as each commits. Never
    chosen either: `committed_now`, the steps in `keep` (the step a run resumes from, when the
    ones after it hold only the model), any folder this package did not write (foreign or
    unknown), a step folder that is a symlink (another run's, linked in)."""
    mine = [f for f in folders if f.step <= committed_now]
    committed = sorted((f for f in mine if f.committed), key=lambda f: f.step)
    doomed = committed[:-keep_latest_k] if keep_latest_k > 0 else []
    doomed += [f for f in mine if f.status == PARTIAL and f.step < committed_now]
    return sorted((f for f in doomed if not f.linked and f.step != committed_now and f.step not in keep),
                  key=lambda f: f.step)


def newer_steps(folders: list[StepFolder], committed_now: int) -> list[StepFolder]:
    """Complete steps above `committed_now`: `load()` without a step would pick them over it."""
    return [f for f in folders if f.committed and f.step > committed_now]
