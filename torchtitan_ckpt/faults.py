"""Fail points: SIGKILL this process at a chosen moment of a save, to test crash safety.

Set `TORCHTITAN_CKPT_FAILPOINT=PHASE@STEP` (every rank) or `PHASE@STEP:RANK` (one rank) before
starting a job. The process kills itself, without any cleanup, the first time it reaches PHASE
while saving (or, for `purge`, deleting) step STEP:

- `staging`: an async save has copied the state; the step folder, prepared while the state was
  copied, may exist, and the files written early (each tensor once its copy was made) may be
  partly written;
- `prepare`: the step folder exists and is empty;
- `write`: a data file is half written;
- `written`: `dcp.save` has returned: DCP's `.metadata` is written, the data files may still be
  being written and fsynced, the commit marker is not;
- `upload`: (object storage) this rank's first file is uploaded, its others and the marker are not;
- `commit`: the marker's temporary file is written, not yet renamed into place;
- `purge`: the old step's marker is removed, its files are not;
- `consolidate`: a Hugging Face export's bytes from this rank are written, its index is not.

Unset (the normal case), `hit()` is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "TORCHTITAN_CKPT_FAILPOINT"
PHASES = ("staging", "prepare", "write", "written", "upload", "commit", "purge", "consolidate")
_also_kill: int | None = None


def _parse(spec: str) -> tuple[str, int, int | None]:
    phase, _, rest = spec.partition("@")
    step, _, rank = rest.partition(":")
    if phase not in PHASES or not step.isdigit() or (rank and not rank.isdigit()):
        raise ValueError(f"{ENV}={spec!r}: expected PHASE@STEP or PHASE@STEP:RANK, PHASE one of "
                         f"{', '.join(PHASES)}")
    return phase, int(step), int(rank) if rank else None


def armed() -> bool:
    """True when a fail point is set for this process."""
    return bool(os.environ.get(ENV))


def hit(phase: str, step: int) -> None:
    """Kill this process if the fail point names this phase and step (and this rank)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    want_phase, want_step, want_rank = _parse(spec)
    rank = int(os.environ.get("RANK", "0"))
    if want_phase == phase and want_step == step and want_rank in (None, rank):
        if _also_kill is not None:
            os.kill(_also_kill, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def kill_also(pid: int) -> None:
    """Make a fail point reached in this process kill `pid` first: a rank's writer process
    (`writer_process`) dies with its rank, so a fail point there must kill the rank too."""
    global _also_kill
    _also_kill = pid


def hit_in(phase: str, folder: str) -> None:
    """`hit()` for the step whose folder (`.../step-N`) is being written, if it is one."""
    if not armed():
        return
    from .layout import parse_step  # noqa: PLC0415 - layout imports commit, which imports this module

    step = parse_step(os.path.basename(os.path.normpath(folder)))
    if step is not None:
        hit(phase, step)
