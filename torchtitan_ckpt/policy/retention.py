"""Which old steps to delete once a new step has committed: a pure policy over step folders."""

from __future__ import annotations

from collections.abc import Collection

from ..layout import PARTIAL, StepFolder


def steps_to_delete(folders: list[StepFolder], keep_latest_k: int, committed_now: int,
                    left: Collection[int] = ()) -> list[StepFolder]:
    """Folders to remove once step `committed_now` has committed: complete steps beyond the
    newest `keep_latest_k` (0 keeps all) up to `committed_now`, and partial folders older than
    it (left by a crash; nothing will ever complete them). Steps above it are left alone: they
    are from before the job went back to an older step (`load(step)`, `load_step`), and
    counting them would delete the steps this job saves next, as soon as each commits. Those
    steps (`left`: the complete steps newer than the one the job loaded) are not counted once
    the job's steps pass them either, and go then: kept, the run left behind's step 8 would
    outlive the job's own step 6 (`load_step = 4`, then 6 and 9 saved, `keep_latest_k = 2`),
    and a step 9 found damaged would fall back to it. Never chosen: `committed_now`, any folder
    this package did not write (foreign or unknown). A step folder that is a symlink (another
    run's, linked in) is neither chosen nor counted: the job's own steps are not deleted in
    favour of one that its run may delete."""
    mine = [f for f in folders if f.step <= committed_now and not f.linked]
    committed = sorted((f for f in mine if f.committed and f.step not in left), key=lambda f: f.step)
    doomed = committed[:-keep_latest_k] if keep_latest_k > 0 else []
    doomed += [f for f in mine if f.committed and f.step in left] if keep_latest_k > 0 else []
    doomed += [f for f in mine if f.status == PARTIAL and f.step < committed_now]
    return sorted((f for f in doomed if f.step != committed_now), key=lambda f: f.step)


def newer_steps(folders: list[StepFolder], committed_now: int) -> list[StepFolder]:
    """Complete steps above `committed_now`: `load()` without a step would pick them over it."""
    return [f for f in folders if f.committed and f.step > committed_now]
