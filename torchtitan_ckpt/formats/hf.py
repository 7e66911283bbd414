"""Hugging Face's format: `config.json`, safetensors files and their index, which `transformers`
loads as they are. Holds the model only, renamed by the job's state-dict adapter (`hf/`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError, CorruptCheckpointError, different_copies
from ..hf import load_hf, save_hf
from ..hf.load import read_hf_layout
from ..hf.files import INDEX_FILE, SINGLE_FILE, is_model_file
from ..io.dtypes import EXPORT_DTYPES
from ..io.filewriter import Sink
from ..policy.schedule import SaveKind
from .base import StepFormat, StepIndex, Written

if TYPE_CHECKING:  # storage.base imports layout, which imports the formats
    from ..staging import Staged
    from ..storage.base import Store


class HfFormat(StepFormat):
    name = "hf"
    title = "Hugging Face"
    index_files = (INDEX_FILE, SINGLE_FILE)
    on_training_thread = True  # it reads the live model; the two-phase modes gather on the training mesh

    def _adapter(self, path: str) -> Any:
        if self.ctx.adapter is None:
            raise CheckpointError(f"{path} is in Hugging Face format; pass state_dict_adapter= to "
                                  "CheckpointManager to read or write it")
        return self.ctx.adapter

    @classmethod
    def contents(cls, path: str) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], list[str]]:
        """The model's tensors, under HF's names, from the index and the safetensors headers."""
        return [(name, e.dtype, tuple(e.shape)) for name, e in sorted(read_hf_layout(path).items())], []

    def write(self, path: str, step: int, kind: SaveKind, staged: Staged, sink: Sink) -> Written:
        """Write the model (floating tensors cast to `export_dtype`); the commit reads each file
        once for its CRC-32. The safetensors files are written jointly by every rank, and the
        index is published last."""
        ck = self.ctx.config
        staged.done()
        save_hf(staged.state, path, self._adapter(path), dtype=EXPORT_DTYPES[ck.export_dtype],
                max_shard_size=ck.hf_max_shard_size, process_group=self.ctx.group.pg, mode=ck.consolidation,
                num_threads=ck.consolidation_threads, keep_shards=ck.keep_hf_shards, shared=not self.ctx.staged)
        joint = sorted(filter(is_model_file, os.listdir(path)))
        return Written(joint=tuple(joint), last=(INDEX_FILE,))

    def index(self, path: str, store: Store) -> StepIndex:
        """Names are the adapter's business (`read` checks them against the model): an HF step
        holds the model and nothing else. In a folder every rank reads for itself (not object
        storage's), the ranks agree on its files' names and sizes first."""
        self._adapter(path)
        if not store.staged:
            described = store.describe(path)
            if differ := self.ctx.group.differing(self.ctx.group.each(lambda: _files(path), f"listing {described}")):
                raise CorruptCheckpointError(different_copies(f"{described} (its safetensors files)", differ))
        return StepIndex()

    def read(self, path: str, index: StepIndex, state: dict[str, Any], store: Store,
             check: Callable[[], None]) -> None:
        """The step is fetched from `store` in a round of its own: a rank whose download failed
        fails every rank there, before `load_hf`'s collectives."""
        group = self.ctx.group
        local = group.each(lambda: store.fetch(path), f"fetching {store.describe(path)}")
        load_hf(state, local, self._adapter(path), process_group=group.pg,
                num_threads=self.ctx.config.load_threads, check=check)


def _files(path: str) -> list[tuple[str, int]]:
    """The names and sizes of the model's files in the folder `path`."""
    with os.scandir(path) as entries:
        return sorted((e.name, e.stat().st_size) for e in entries if e.name == INDEX_FILE or is_model_file(e.name))
