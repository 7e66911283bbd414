"""What every on-disk format provides, and what it is given to work with."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ..config import Checkpoint
from ..errors import CheckpointError
from ..group import CheckpointGroup
from ..io.filewriter import Sink
from ..policy.schedule import SaveKind

if TYPE_CHECKING:  # storage.base imports layout, which imports the formats
    from ..staging import Staged
    from ..storage.base import Store


@dataclass
class Context:
    """What a format needs of the job: the `[checkpoint]` config, the checkpoint group, and the
    state-dict adapter for formats that rename the model's tensors (None when the job has none)."""

    config: Checkpoint
    group: CheckpointGroup
    adapter: Any | None = None
    staged: bool = False
    """Whether the formats write into a rank's local staging folder (`Store.staged`)."""


@dataclass
class Written:
    """A rank's part of a step, handed to the commit."""

    durable: Callable[[], dict[str, tuple[int, str]]] = dict
    """Waits until this rank's files are on the disk; returns their (size, CRC-32 hex) by path
    relative to the step folder, as computed while writing (files missing from it are read
    once by the commit)."""
    summary: str = ""
    """A line about the save for rank 0 to log (e.g. bytes per rank), or empty."""
    joint: tuple[str, ...] = ()
    """Files every rank wrote parts of at their final offsets (`Store.publish`)."""
    last: tuple[str, ...] = ()
    """Files published after every rank's others: the index that says the step is whole."""


@dataclass
class StepIndex:
    """What a step holds, known before anything is read."""

    tensors: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Saved key -> the whole tensor's shape, for every tensor."""
    values: frozenset[str] = frozenset()
    """Saved keys of non-tensor values."""
    dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    """Saved key -> the dtype it was saved in, for every tensor (where the format records one)."""
    native: Any = None
    """The format's own index (DCP's `Metadata`), passed back to `read`."""
    rope_layout: str | None = None
    """The RoPE layout of the q/k rows, where the step records it (`hf.files.RECORDED_LAYOUT`,
    which `convert --to dcp` writes)."""

    def keys(self) -> set[str]:
        return set(self.tensors) | set(self.values)

    def model_names(self, states: Collection[str]) -> list[str]:
        """The step's model tensors, in order: those whose name is under none of `states` (the
        model's are at the top level; one named "model.*", as transformers names them, is one)."""
        return sorted(k for k in self.tensors if k.partition(".")[0] not in states)

    def require(self, path: str, state: dict[str, Any], hint: str = "was it saved from a different model?",
                spare: Callable[[], Collection[str]] = tuple) -> None:
        """A `CheckpointError` naming the tensors of `state` (a state dict to load, as DCP
        flattens it) that the step at `path` does not hold, or holds in another shape (DCP names
        the first it meets, deep in its planning), with `hint` on what differs (one it holds as
        another kind of value is the format's to refuse). Of `spare()`, saved names that no name
        of `state` takes (asked for only where a tensor is missing), those of a missing tensor's
        shape are named too: a module renamed since the save shows as both (on this rank: a
        pipeline stage holds the others' layers in none)."""
        flat, held = flatten_state_dict(state)[0], self.keys()
        missing = [k for k, v in flat.items() if isinstance(v, torch.Tensor) and k not in held]
        prefix = _nesting(missing, held)
        shapes = {tuple(flat[k].shape) for k in missing}
        if missing and not prefix and (alike := [k for k in spare() if self.tensors.get(k) in shapes]):
            hint += (f" It holds {len(alike)} tensors of those shapes that this rank loads none of, e.g. "
                     f"{alike[:3]}: renamed since the save?")
        if prefix == "module.":
            hint = ("its names carry the 'module.' prefix of DistributedDataParallel (or DataParallel), which saves "
                    "of torchtitan_ckpt before 2026-12-05 (DataParallel's: 2026-12-07) kept (now no step holds it): "
                    "load it with that version")
        elif prefix:
            hint = (f"it holds every one under the prefix {prefix!r}: another framework's checkpoint, which nests "
                    "the model (accelerate's FSDP folders under 'model.', Lightning's under 'state_dict.'); save its "
                    f"tensors again without the prefix (dcp.load into a dict of '{prefix}' + name, dcp.save of the "
                    "names alone) and load that")
        if missing:
            raise CheckpointError(f"{path} lacks {len(missing)} tensors this job has, e.g. {missing[:3]}; {hint}")
        resized = [f"{k} {tuple(v.shape)} saved as {self.tensors[k]}" for k, v in flat.items()
                   if isinstance(v, torch.Tensor) and k in self.tensors and tuple(v.shape) != self.tensors[k]]
        if resized:
            raise CheckpointError(f"{path} holds {len(resized)} tensors of this job in other shapes, e.g. "
                                  f"{'; '.join(resized[:3])}; {hint}")


def _nesting(missing: list[str], held: Collection[str]) -> str | None:
    """The prefix under which `held` has every one of the `missing` names, if there is one."""
    if not missing:
        return None
    first = "." + missing[0]
    fitting = [prefix for name in held if name.endswith(first)
               for prefix in [name[:len(name) - len(missing[0])]] if all(prefix + k in held for k in missing)]
    return min(fitting, key=len, default=None)  # `module.` over `_orig_mod.module.`, on every rank alike


class StepFormat(ABC):
    """One on-disk format. Methods run on every rank unless they say otherwise."""

    name: str
    """As recorded in the commit marker's `format`."""

    title: str
    """As messages name it."""

    def __init__(self, context: Context):
        self.ctx = context

    index_files: tuple[str, ...]
    """Files of which one in a folder makes it a finished step of this format (the format's
    own writer puts it last): what `holds` and a remote store's first look at a folder test."""

    @classmethod
    def holds(cls, path: str) -> bool:
        """Whether the folder `path` holds a step in this format (one of its `index_files`)."""
        return any(os.path.isfile(os.path.join(path, name)) for name in cls.index_files)

    @classmethod
    def finished_by(cls, path: str) -> str | None:
        """The id of the save that finished the step in the folder `path`, where its index
        records one: for a save of ours, its in-progress marker's (`commit.started_by`). None
        where it records none, or cannot be read (a load says why)."""
        return None

    @classmethod
    @abstractmethod
    def contents(cls, path: str) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], list[str]]:
        """What the step at `path` holds, from its index alone (no tensor data is read): its
        tensors (name, dtype, shape) and the names of its other values, each sorted by name."""

    @abstractmethod
    def write(self, path: str, step: int, kind: SaveKind, staged: Staged, sink: Sink) -> Written:
        """Write `staged.state` (model tensors at the top level, other states nested under their
        names) into the existing folder `path`; the data files' bytes go through `sink`. A
        tensor's bytes may be read once `staged.ready(tensor)` returns (a background save's
        staging may still be copying it in), every tensor's once `staged.done()` does."""

    @abstractmethod
    def index(self, path: str, store: Store) -> StepIndex:
        """Read what the step at `path` holds, checking its index file. `store` holds `path`:
        a format fetches through it (`Store.fetch`, `fetch_ranges`) the files it reads."""

    @abstractmethod
    def read(self, path: str, index: StepIndex, state: dict[str, Any], store: Store,
             check: Callable[[], None]) -> None:
        """Fill this rank's part of `state` (tensors in place, other values replaced) from the
        step; raise on this rank's failure (the caller makes it every rank's).

        Everything the format can check of the step is checked, and every value that is not a
        tensor is read, before any tensor is written; then `check()` runs, and every rank's
        checks are agreed on in one `group.run` that every rank joins once (a failure on any
        rank there leaves every rank's tensors as they were). A failure once tensors are being
        written is a `PartialLoadError`."""

    holds_states: bool = False
    """Whether a step in this format can hold the job's states besides the model (optimizer,
    schedulers, data...). A step in a format that cannot holds the model alone: a job that
    resumes passes over another program's such step without reading its index."""

    named_as_state: bool = False
    """Whether a step's tensors are named as the job's state names them (the model's, the
    optimizer's under `optimizer.`...), so that a load can tell what it holds that no rank loads."""

    on_training_thread: bool = False
    """Whether saves must run on the training thread (their collectives use the training mesh)
    rather than in the background."""
