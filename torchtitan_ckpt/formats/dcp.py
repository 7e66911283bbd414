"""DCP's own format: `.metadata` plus per-rank `.distcp` files, read and written through
`torch.distributed.checkpoint` with this package's storage plug-ins (`dcp/`).

`checkpoint.io_engine` picks who moves the bytes: the fast engine (`io/`, through
`dcp.storage`'s writer and reader) or PyTorch's own `FileSystemWriter` / `FileSystemReader`.
Both write the same layout, so either reads what the other wrote; the planners (dedup on save,
no code run on load) are the same.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from .. import faults
from ..errors import CheckpointError
from ..dcp import storage
from ..dcp.planner import PlanCache
from ..io.filewriter import Sink, write_files
from ..policy.schedule import SaveKind
from .base import StepFormat, StepIndex, Written

if TYPE_CHECKING:  # storage.base imports layout, which imports the formats
    from ..storage.base import Store


class DcpFormat(StepFormat):
    name = "dcp"

    def __init__(self, context):
        super().__init__(context)
        self._plan_caches: dict[SaveKind, PlanCache] = {}  # the last save plan of each kind

    @staticmethod
    def holds(path: str) -> bool:
        return os.path.isfile(os.path.join(path, storage.METADATA_FILE))

    def write(self, path: str, step: int, kind: SaveKind, state: dict[str, Any], sink: Sink) -> Written:
        ck, group = self.ctx.config, self.ctx.group
        cache = self._plan_caches.setdefault(kind, PlanCache())
        planner = storage.make_save_planner(ck.dedup_policy, ck.dedup_min_slice_bytes, cache)
        writer = storage.make_storage_writer(path, sink, step, ck.save_threads, fast=ck.io_engine == "fast",
                                             sync=not self.ctx.staged)  # a staged copy is uploaded, not kept
        try:
            if sink is write_files:  # in this process only: a writer process forgets the buffers a call does not name
                writer.write_early(state, group.rank, group.world_size, cache)
            dcp.save(state, storage_writer=writer, planner=planner, process_group=group.pg)
        except (Exception, CheckpointException) as e:
            writer.wait_early()
            self._plan_caches.pop(kind, None)  # the save failed (on every rank, for dcp.save): all plan afresh
            raise storage.root_cause(e) from None
        faults.hit("written", step)
        return Written(writer.durable, planner.summary_line() if group.is_coordinator else "")

    def index(self, path: str, store: Store) -> StepIndex:
        store.fetch(path, [storage.METADATA_FILE])
        metadata = storage.read_metadata(os.path.join(path, storage.METADATA_FILE))
        tensors, values = {}, set()
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                values.add(key)
            else:
                tensors[key] = tuple(md.size)
        return StepIndex(tensors, frozenset(values), metadata)

    def read(self, path: str, index: StepIndex, state: dict[str, Any], store: Store) -> None:
        """Only the byte ranges this rank's load plan reads are fetched from `store`."""
        missing = [k for k, v in state.items() if isinstance(v, torch.Tensor) and k not in index.tensors]
        if missing:
            raise CheckpointError(f"{path} lacks {len(missing)} model tensors this model has, "
                                  f"e.g. {missing[:3]}; was it saved from a different model?")
        ck = self.ctx.config
        reader = storage.make_storage_reader(path, index.native, ck.load_threads, fast=ck.io_engine == "fast",
                                             before_read=lambda ranges: store.fetch_ranges(path, ranges))
        try:
            storage.load_on_this_rank(state, reader, storage.make_load_planner())
        except CheckpointException as e:  # a BaseException: unwrap it for the group's `run`
            raise storage.root_cause(e) from None

