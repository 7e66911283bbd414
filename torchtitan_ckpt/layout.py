"""Step folders: their names, and which of them exist under a checkpoint folder."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from . import commit

_STEP_RE = re.compile(r"^step-(\d+)$")


def step_dir(folder: str, step: int) -> str:
    """Path of the folder that holds step `step`."""
    return os.path.join(folder, f"step-{step}")


def parse_step(name: str) -> int | None:
    """`step-12` -> 12; anything else -> None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class StepFolder:
    step: int
    path: str
    committed: bool
    linked: bool = False
    """A symlink to a folder elsewhere (a run linked in): loaded from, never changed or deleted."""


def scan(folder: str) -> list[StepFolder]:
    """Every `step-N` folder under `folder`, complete or not, oldest first. A missing folder is empty."""
    if not os.path.isdir(folder):
        return []
    found = []
    for entry in os.scandir(folder):
        step = parse_step(entry.name)
        if step is not None and entry.is_dir():
            found.append(StepFolder(step, entry.path, commit.is_committed(entry.path), entry.is_symlink()))
    return sorted(found, key=lambda s: s.step)


def committed_steps(folder: str) -> list[int]:
    """Steps whose save finished (they carry a commit marker), oldest first."""
    return [s.step for s in scan(folder) if s.committed]


def folder_bytes(path: str) -> int:
    """Total size of the files under `path` (a symlink counts as itself, dangling or not)."""
    return sum(os.lstat(os.path.join(r, n)).st_size for r, _, names in os.walk(path) for n in names)
