"""Step folders: their names, which of them exist under a checkpoint folder, and whose they are.

A folder this package writes is marked as ours from the moment it is created (the in-progress
marker, `commit.IN_PROGRESS`) until it is removed; its commit marker says it is finished. So a
step folder is:

- complete: ours, with `COMMITTED.json`; loaded, and deleted by retention beyond `keep_latest_k`;
- partial: ours, without it (a save in flight, or one that crashed); never loaded, and deleted
  once a newer step of ours is complete;
- foreign: not ours, but a finished checkpoint by its own format's test: a DCP `.metadata`
  (DCP renames it into place last; TorchTitan's own test) or a Hugging Face
  `model.safetensors(.index.json)`. Loaded, unverified; never deleted. So is a folder of ours
  in which another program has since finished a step (its `.metadata` names another save than
  our in-progress marker: TorchTitan's manager saving into a `step-N` it finds);
- unknown: not ours and neither of those (another program's save in flight, or not a
  checkpoint), a folder whose markers are not files (a folder or a fifo by their names), or a
  file by a step's name (nothing this package writes). Never loaded, never deleted;
- denied: a folder this user may not look into (another user's, of a mode that keeps it out):
  whose it is cannot be told. Never loaded, replaced or deleted; a load that would pick it (it
  is newer than every step this user may read, or named) fails, naming its owner and mode.

A step folder that is a link, or whose commit marker is one, is another's linked in: loaded
from as its status says, never counted by retention, deleted or replaced.
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

from . import commit
from .errors import CheckpointError
from .io import durable, safe_open
from .io.untrusted import brief
from .formats import FORMATS

STEP_PREFIX = "step-"
"""How every step folder's name begins (a store lists those names alone)."""

_STEP_RE = re.compile(re.escape(STEP_PREFIX) + r"(0|[1-9][0-9]*)", re.ASCII)
"""One spelling per step: no leading zeros, ASCII digits, nothing after (so `step-007`, a
non-ASCII digit or a trailing newline never name the folder of step 7)."""


HF_COPIES = "hf"
"""The folder under a checkpoint folder that the `hf_export_interval` copies go into, as step
folders of their own."""


def check_step(step: Any, call: str, low: int = 0) -> int:
    """`step` as given to `call` ("save", "load"), as an int: an integer of any kind (NumPy's,
    a 0-dim integer tensor) as its value. A bool, a float, a string, or a step outside `low` to
    `commit.MAX_COUNT` is a `TypeError` or `ValueError` naming it, before anything is written or
    read: `save(3.0)` would write `step-3.0`, which no load finds, and a NumPy integer would fail
    the commit marker after every file was written."""
    try:
        if isinstance(step, bool):
            raise TypeError
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"{call}({brief(step)}): the step must be an int, not a {type(step).__name__}") from None
    if not low <= value <= commit.MAX_COUNT:
        raise ValueError(f"{call}({brief(value)}): the step must be from {low} to 2**62")
    return value


def step_name(step: int) -> str:
    """Name of the folder that holds step `step`."""
    return f"{STEP_PREFIX}{step}"


def step_dir(folder: str, step: int) -> str:
    """Path of the folder that holds step `step`."""
    return os.path.join(folder, step_name(step))


def parse_step(name: str) -> int | None:
    """`step-12` -> 12; anything else -> None."""
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


COMPLETE, PARTIAL, FOREIGN, UNKNOWN, DENIED = "complete", "partial", "foreign", "unknown", "denied"


@dataclass(frozen=True)
class StepFolder:
    step: int
    path: str
    status: str
    """COMPLETE, PARTIAL, FOREIGN, UNKNOWN or DENIED (see the module docstring)."""
    linked: bool = False
    """Another's step linked in (`linked_in`): loaded from, never changed or deleted."""

    @property
    def committed(self) -> bool:
        return self.status == COMPLETE

    @property
    def ours(self) -> bool:
        """This package started writing it: only such folders are ever deleted."""
        return self.status in (COMPLETE, PARTIAL)

    @property
    def loadable(self) -> bool:
        return self.status in (COMPLETE, FOREIGN)


TELLING = (commit.MARKER, commit.IN_PROGRESS, *(name for fmt in FORMATS.values() for name in fmt.index_files))
"""The files `status_of` looks at: all a remote store fetches of a folder to tell its status."""


def foreign_format(path: str) -> str | None:
    """"dcp" or "hf" when `path` holds a finished checkpoint of that format, else None."""
    return next((name for name, fmt in FORMATS.items() if fmt.holds(path)), None)


def status_of(path: str) -> str:
    """Whose step folder `path` is, and whether it is finished (see the module docstring)."""
    kinds = [_kind(os.path.join(path, name)) for name in (commit.MARKER, commit.IN_PROGRESS)]
    if _DENIED in kinds:
        return DENIED
    if any(kind not in (None, stat.S_IFREG) for kind in kinds):
        return UNKNOWN  # ours are files (or links to files: a hub cache's snapshot), never a folder or a fifo
    if kinds[0] is not None:
        return FOREIGN if _finished_by_another(path, committed=True) else COMPLETE
    if kinds[1] is not None or _marking(path) or _committing(path):
        return FOREIGN if _finished_by_another(path, committed=False) else PARTIAL  # else ours: started
    return FOREIGN if foreign_format(path) else UNKNOWN


def step_folder_around(path: str) -> str | None:
    """`path`, or the nearest folder above it, when it is a step folder: ours (finished or not)
    or another program's DCP checkpoint named as a step (TorchTitan's `step-N`). A checkpoint
    folder or an output there would write into that step (a file added to a step fails its
    `verify`). Looked for above the real path: a link into a step leads there as well."""
    here = os.path.realpath(path)
    while True:
        if os.path.isdir(here) and (status_of(here) in (COMPLETE, PARTIAL) or (
                parse_step(os.path.basename(here)) is not None and foreign_format(here) == "dcp")):
            return here
        if (up := os.path.dirname(here)) == here:
            return None
        here = up


def in_step(path: str, step: str) -> str:
    """What `path` is to the step folder `step` around it (`step_folder_around`), for a message."""
    return f"{'is' if step == os.path.realpath(path) else 'is inside'} the step folder {step}"


def _finished_by_another(path: str, committed: bool) -> bool:
    """Whether another program finished a step of its own in `path`, a folder a save of ours
    began (TorchTitan's manager saves into a `step-N` it finds, removing nothing first): its
    format's index names another save than our in-progress marker does. A committed folder's
    index is read only where it is newer than the commit marker (ours is written before it)."""
    fmt = foreign_format(path)
    index = _first_file(path, FORMATS[fmt].index_files) if fmt is not None else None
    if index is None:
        return False
    if committed:
        try:
            if index.st_mtime_ns <= os.stat(os.path.join(path, commit.MARKER)).st_mtime_ns:
                return False
        except OSError:
            return False
    ours = commit.started_by(path)
    theirs = _recorded_save(fmt, path, (index.st_ino, index.st_size, index.st_mtime_ns)) if ours else None
    return theirs is not None and theirs != ours


def _first_file(path: str, names: tuple[str, ...]) -> os.stat_result | None:
    """The first of the files `names` in `path` that is there."""
    for name in names:
        try:
            return os.stat(os.path.join(path, name))
        except OSError:
            continue
    return None


@functools.lru_cache(maxsize=1024)
def _recorded_save(fmt: str, path: str, version: tuple[int, int, int]) -> str | None:
    """`finished_by` of the step in `path` (format `fmt`), read once per `version` of its index
    (inode, size, time): in a run folder copied by `cp -r`, every step's index may be newer than
    its commit marker, and each scan would read them all again."""
    return FORMATS[fmt].finished_by(path)


COMMITTING = commit.MARKER + durable.TMP_SUFFIX
"""The commit marker's temporary file: a folder holding it without the marker is a save of ours
killed while committing. Versions before the in-progress marker left no other sign of theirs: a
folder of theirs with DCP's `.metadata` read as another program's finished step, and loaded."""


def _committing(path: str) -> bool:
    """Whether `path` holds the commit marker's temporary file, a file of its own (never a link:
    this package writes none there)."""
    try:
        return stat.S_ISREG(os.lstat(os.path.join(path, COMMITTING)).st_mode)
    except OSError:
        return False


def _marking(path: str) -> bool:
    """Whether `path` holds the in-progress marker's temporary file and nothing else: a save
    that stopped while marking the folder (a full disk, a kill)."""
    try:
        with os.scandir(path) as listing:  # two entries at most: a parent of the folder may hold thousands
            entries = list(itertools.islice(listing, 2))
    except OSError:
        return False
    return (len(entries) == 1 and entries[0].name == commit.IN_PROGRESS + durable.TMP_SUFFIX
            and entries[0].is_file(follow_symlinks=False))


_DENIED = -2


def _kind(path: str) -> int | None:
    """The type bits of what `path` leads to (None: nothing there, or a dangling link; `_DENIED`:
    what this user may not look at; -1: what cannot be looked at otherwise, a link loop)."""
    try:
        return stat.S_IFMT(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        return _DENIED if e.errno in safe_open.PERMISSION else -1


def empty_step(path: str) -> bool:
    """Whether `path` is an empty folder (not a link): what a save leaves when it stops between
    creating the step folder and writing its in-progress marker (a kill; one stopped while
    writing it leaves a partial step, `status_of`). Replacing or removing it loses nothing."""
    try:
        return not os.path.islink(path) and os.path.isdir(path) and not os.listdir(path)
    except OSError:  # a folder this user may not list: not known to be empty
        return False


def linked_in(path: str) -> bool:
    """Whether the step folder at `path` is another's linked in (loaded from, never changed or
    deleted): a link itself, or a folder whose commit marker is a link (a `cp -rs` copy of a
    step; a hub cache's snapshot, where every file is a link into its blobs)."""
    return os.path.islink(path) or os.path.islink(os.path.join(path, commit.MARKER))


def scan(folder: str) -> list[StepFolder]:
    """Every `step-N` folder under `folder`, complete or not, oldest first. A missing folder is
    empty. An entry by a step's name that is not a folder (a file, a dangling link) is listed as
    unknown: never loaded or deleted, and in the way of a save of that step. A folder this user
    may enter but not list (mode 711) is refused naming its owner: its steps cannot be found."""
    if not os.path.isdir(folder):
        return []
    try:
        entries = list(os.scandir(folder))
    except PermissionError as e:
        raise CheckpointError(f"the step folders cannot be listed: {safe_open.denied(folder, e.strerror)}; ask its owner "
                              "to make it readable to you") from e
    found = []
    for entry in entries:
        step = parse_step(entry.name)
        if step is not None:
            status = status_of(entry.path) if entry.is_dir() else UNKNOWN
            found.append(StepFolder(step, entry.path, status, linked_in(entry.path)))
    return sorted(found, key=lambda s: s.step)


def committed_steps(folder: str) -> list[int]:
    """Steps whose save finished (they carry a commit marker), oldest first."""
    return [s.step for s in scan(folder) if s.committed]


def folder_bytes(path: str, held: bool = False) -> int:
    """Total size of the files under `path` (a symlink counts as itself, dangling or not; a file
    removed meanwhile, nothing); with `held`, a sparse file counts only the bytes it holds (a
    step fetched by byte ranges from object storage is mostly holes). A `path` that is itself a
    link (a step linked in from elsewhere) counts the files directly in it: never a tree the
    link leads into."""
    def size(full: str) -> int:
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            return 0
        return min(st.st_size, st.st_blocks * 512) if held else st.st_size

    if not os.path.isdir(path):  # a file or a dangling link in a step's place: itself
        return size(path)
    if os.path.islink(path):
        return sum(size(e.path) for e in os.scandir(path) if not e.is_dir(follow_symlinks=False))
    return sum(size(os.path.join(r, n)) for r, _, names in os.walk(path) for n in names)
