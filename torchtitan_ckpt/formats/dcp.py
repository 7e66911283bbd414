"""DCP's own format: `.metadata` plus per-rank `.distcp` files, read and written through
`torch.distributed.checkpoint` with this package's storage plug-ins (`dcp/`).

`checkpoint.io_engine` picks who moves the bytes: the fast engine (`io/`, through
`dcp.storage`'s writer and reader) or PyTorch's own `FileSystemWriter` / `FileSystemReader`.
Both write the same layout, so either reads what the other wrote; the planners (dedup on save,
no code run on load) are the same.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # DCP's keys, as its planner makes them
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from .. import faults
from ..config import BUILTIN_STATES
from ..errors import CheckpointError, CorruptCheckpointError, RankFailed, different_copies
from ..group import CheckpointGroup
from ..dcp import storage
from ..dcp.metadata import METADATA_FILE, metadata_bytes, read_metadata
from ..dcp.planner import PlanCache
from ..hf.convert import recorded_rope_layout
from ..hf.files import RECORDED_LAYOUT
from ..io import own_writes
from ..io.dtypes import converts
from ..io.filewriter import Sink
from ..io.untrusted import check_pickle
from ..policy.schedule import SaveKind
from .base import StepFormat, StepIndex, Written

if TYPE_CHECKING:  # storage.base imports layout, which imports the formats
    from ..staging import Staged
    from ..storage.base import Store

logger = logging.getLogger(__name__)


class DcpFormat(StepFormat):
    name = "dcp"
    title = "DCP"
    index_files = (METADATA_FILE,)
    holds_states = True
    named_as_state = True

    def __init__(self, context):
        super().__init__(context)
        self._plan_caches: dict[SaveKind, PlanCache] = {}  # the last save plan of each kind
        if context.group.pg is None:
            storage.quiet_single_process()

    @classmethod
    def finished_by(cls, path: str) -> str | None:
        """`.metadata`'s `storage_meta.save_id` (DCP's writer makes one per save; ours writes its
        in-progress marker's)."""
        try:
            meta = read_metadata(os.path.join(path, METADATA_FILE)).storage_meta
        except (OSError, CheckpointError):
            return None
        return meta.save_id if meta is not None and isinstance(meta.save_id, str) else None

    @classmethod
    def contents(cls, path: str) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], list[str]]:
        entries = sorted(read_metadata(os.path.join(path, METADATA_FILE)).state_dict_metadata.items())
        return ([(key, md.properties.dtype, tuple(md.size)) for key, md in entries
                 if isinstance(md, TensorStorageMetadata)],
                [key for key, md in entries if not isinstance(md, TensorStorageMetadata)])

    def write(self, path: str, step: int, kind: SaveKind, staged: Staged, sink: Sink) -> Written:
        """The tensors DCP's last plan (or any plan) gives this rank are written early, each as
        soon as it is staged (on helper threads, or in the writer process); the rest once the
        whole state is staged."""
        ck, group, state = self.ctx.config, self.ctx.group, staged.state
        cache = self._plan_caches.setdefault(kind, PlanCache())
        planner = storage.make_save_planner(ck.dedup_policy, ck.dedup_min_slice_bytes, cache)
        writer = storage.make_storage_writer(path, sink, step, ck.save_threads, fast=ck.io_engine == "fast",
                                             sync=not self.ctx.staged,  # a staged copy is uploaded, not kept
                                             direct=ck.direct_io, staged=staged.done)
        try:
            writer.write_early(state, group.rank, group.world_size, cache, staged.ready, staged.wait_across)
            with group.carrying():
                dcp.save(state, storage_writer=writer, planner=planner, process_group=group.pg)
        except (Exception, CheckpointException) as e:
            writer.wait_early()
            self._plan_caches.pop(kind, None)  # the save failed (on every rank, for dcp.save): all plan afresh
            root = storage.root_cause(e, group.rank)
            raise root from root.__cause__  # DCP's wrapping left out, the failure's own cause kept
        faults.hit("written", step)
        return Written(writer.durable, planner.summary_line() if group.is_coordinator and group.world_size > 1 else "")

    def index(self, path: str, store: Store) -> StepIndex:
        """With the RoPE layout a step `convert --to dcp` wrote records (fetched with the
        `.metadata`, in one listing). Each rank's reads and checks are a round of their own
        (`CheckpointGroup.each`): a rank that cannot read the file fails every rank at once."""
        group, where = self.ctx.group, os.path.join(path, METADATA_FILE)
        described = store.describe(where)

        def fetch() -> tuple[str | None, bytes]:
            rope = recorded_rope_layout(store.fetch(path, [METADATA_FILE, RECORDED_LAYOUT]))
            return rope, metadata_bytes(where)

        rope_layout, data = group.each(fetch, f"reading {described}")
        self._scanned_once(data, described)
        metadata = group.each(lambda: read_metadata(where, lambda *_: None, data), f"reading {described}")
        tensors, values, dtypes = {}, set(), {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                values.add(key)
            else:
                tensors[key], dtypes[key] = tuple(md.size), md.properties.dtype
        return StepIndex(tensors, frozenset(values), dtypes, metadata, rope_layout)

    def _scanned_once(self, data: bytes, what: str) -> None:
        """`check_pickle` of the `.metadata` every rank has read, by rank 0 for all: the ranks
        read one file, and the scan is most of the cost of reading it (`docs/performance.md`);
        not of one this user's save wrote (`own_writes`). Ranks whose bytes differ from rank
        0's (SHA-256) would load different checkpoints: refused on every rank."""
        digest = hashlib.sha256(data).digest()
        if differ := self.ctx.group.differing(digest):
            raise CorruptCheckpointError(different_copies(what, differ))

        def scan() -> None:
            if own_writes.known(digest):
                logger.debug("%s: not scanned, this user's save wrote it", what)
            else:
                check_pickle(data, what)

        try:
            self.ctx.group.run(scan, coordinator_only=True)
        except RankFailed as failed:
            if failed.error is None and CorruptCheckpointError.__name__ in failed.kinds:  # the same kind on every rank
                raise CorruptCheckpointError(f"reading {what} failed on {failed}") from None
            failed.reraise(f"reading {what}")

    def read(self, path: str, index: StepIndex, state: dict[str, Any], store: Store,
             check: Callable[[], None]) -> None:
        """Only the byte ranges this rank's load plan reads are fetched from `store`."""
        agreement = _Agreement(self.ctx.group, check, path)
        try:
            flat = flatten_state_dict(state)[0]
            _check_kinds(path, index, flat)
            if self.ctx.group.is_coordinator:
                _tell_casts(path, index, flat)
            ck = self.ctx.config
            reader = storage.make_storage_reader(path, index.native, ck.load_threads, fast=ck.io_engine == "fast",
                                                 before_read=lambda ranges: store.fetch_ranges(path, ranges),
                                                 agree=agreement)
            storage.load_on_this_rank(state, reader, storage.make_load_planner())
        except (Exception, CheckpointException) as e:  # a BaseException: unwrap it for the group's `run`
            agreement.join_failed(storage.root_cause(e))


def _check_kinds(path: str, index: StepIndex, flat: dict[str, Any]) -> None:
    """Every tensor of `flat` (the state as DCP flattens it) is a tensor in the step, and every
    other value is not: DCP would put a saved value in a tensor's place, or fail reading a
    tensor into a value."""
    swapped = [key for key, value in flat.items()
               if (key in index.values if isinstance(value, torch.Tensor) else key in index.tensors)]
    states = set(BUILTIN_STATES) - {"model"}  # a full step read model-only: its model's names
    index.require(path, flat, spare=lambda: [k for k in index.model_names(states) if k not in flat])
    if swapped:
        raise CorruptCheckpointError(f"{path} holds a value where this job has a tensor, or the other way "
                                     f"round, for {swapped[:3]}; the step is damaged or was not saved by this job")


def _tell_casts(path: str, index: StepIndex, flat: dict[str, Any]) -> None:
    """Say which tensors of `flat` (the state as DCP flattens it) are read into another dtype
    than saved, as DCP casts them without a word: a line, as a model or optimizer in a narrower
    float is how a job asks for one, and a warning where values may not come back (an integer
    that wraps, a complex that loses its imaginary part, a float made an integer)."""
    casts = [(key, index.dtypes[key], value.dtype) for key, value in flat.items()
             if isinstance(value, torch.Tensor) and key in index.dtypes and value.dtype != index.dtypes[key]]
    lossy = [c for c in casts if not converts(c[1], c[2])]

    def shown(found: list[tuple[str, torch.dtype, torch.dtype]]) -> str:
        return "; ".join(f"{key} {str(saved)[6:]} -> {str(live)[6:]}" for key, saved, live in found[:3])
    if lossy:
        logger.warning("%s: %d tensors are read into dtypes that may not hold their values (e.g. %s): the load "
                       "casts them as the job's tensors are; load into tensors of the saved dtypes to keep them",
                       path, len(lossy), shown(lossy))
    elif casts:
        logger.info("%s: %d tensors are read into other dtypes than saved, cast to the job's (e.g. %s)",
                    path, len(casts), shown(casts))


class _Agreement:
    """The one round in which every rank's checks of a load are agreed on, before any rank writes
    a tensor (`StepFormat.read`): the reader calls it with its checks; a rank that failed before
    reaching it joins it with its failure, so that every rank joins it exactly once."""

    def __init__(self, group: CheckpointGroup, check: Callable[[], None], path: str):
        self.group, self.check, self.path = group, check, path
        self.joined = False

    def __call__(self, checks: Callable[[], None]) -> None:
        self.joined = True
        try:
            self.group.run(lambda: (checks(), self.check()))
        except RankFailed as failed:
            failed.reraise(f"loading {self.path}")

    def join_failed(self, error: BaseException) -> NoReturn:
        """Raise `error`, after joining the round with it if this rank had not joined yet."""
        if not self.joined:
            def fail() -> None:
                raise error
            self(fail)
        raise error from None
