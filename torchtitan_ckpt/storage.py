"""How state goes through `torch.distributed.checkpoint`: storage readers/writers and planners.

This is the one place that picks DCP's plug-ins for a save or a load, so later features (dedup
policy, Hugging Face format) replace a factory here instead of adding branches to the manager.
Loading runs no code from the checkpoint: `.metadata` is read with an allow-list unpickler,
tensors are read by `reader` (which parses their headers itself) and non-tensor values are plain
data or go through `torch.load(weights_only=True)` (DCP itself uses `weights_only=False`).
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .dedup import DedupSavePlanner
from . import faults, reader
from .errors import CorruptCheckpointError
from .layout import parse_step

METADATA_FILE = ".metadata"

# (module, name) pairs a DCP `.metadata` pickle may reference; anything else is refused.
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name, as weights_only allows
    ("torch", "device"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "PosixPath"),
}
# dtypes, layouts and memory formats pickle as attributes of the torch module
_ALLOWED_TORCH_ATTRS = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _ALLOWED_TORCH_ATTRS):
            return getattr(torch, name)
        raise CorruptCheckpointError(
            f"{self._path} references {module}.{name}, which a DCP metadata file never holds; "
            "refusing to load it (it could run code)"
        )


def read_metadata(path: str) -> Metadata:
    """Read a DCP `.metadata` file without running code from it."""
    with open(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f, path).load()
        except CorruptCheckpointError:
            raise
        except Exception as e:
            raise CorruptCheckpointError(f"{path} is not a readable DCP metadata file: {e}") from e
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader with a metadata read that refuses anything but DCP's own classes,
    and items read by `reader.ItemReader` on `threads` threads, straight into their destinations.

    `metadata`, when the caller has already read the folder's `.metadata`, is used instead of
    reading it again.
    """

    def __init__(self, path: str, metadata: Metadata | None = None, threads: int = 1):
        super().__init__(path)
        self._metadata = metadata
        self.threads = threads

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is None and self._metadata is not None:
            metadata = self._metadata
        else:
            metadata = read_metadata(str(self._get_metadata_path(rank)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if any(self.storage_data[req.storage_index].transform_descriptors for req in plan.items):
            return super().read_data(plan, planner)  # compressed or otherwise transformed items
        reader.ItemReader(str(self.path), self.storage_data, self.threads).read(plan.items, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are unpickled with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = reader.load_plain(value.getvalue())
        except pickle.UnpicklingError as e:
            raise CorruptCheckpointError(
                f"checkpoint value '{read_item.dest_index.fqn}' is not plain data and loading it "
                f"could run code; refused ({str(e).splitlines()[-3].strip()})"
            ) from None
        if self.flatten_state_dict:
            # the flattened key maps back to a path of keys into the caller's nested dict
            *parents, last = self.mappings[read_item.dest_index.fqn]
            node = self.original_state_dict
            for key in parents:
                node = node[key]
            node[last] = obj
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_on_this_rank(state: dict[str, Any], storage_reader: SafeFileSystemReader, planner: SafeLoadPlanner) -> None:
    """`dcp.load` of what this rank's `state` needs, without DCP's collectives.

    A default load plan has no cross-rank step: each rank reads the items its own tensors
    overlap. DCP still sends every rank's plan through rank 0 and back and gathers every rank's
    result, which cost 0.4-0.9 s of a 1.5 s cold load of 0.8 GB on 2 ranks. The caller makes a
    failure on one rank known to the others.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=storage_reader, planner=planner, no_dist=True)


def root_cause(error: BaseException) -> BaseException:
    """DCP wraps every rank's failure in one `CheckpointException` (a BaseException whose message
    is a traceback dump); return the lowest failing rank's own exception instead."""
    if isinstance(error, CheckpointException) and error.failures:
        exc, _trace = error.failures[min(error.failures)]
        return exc
    return error


class _ChecksummedStream:
    """A write-only file that computes the CRC-32 of what passes through it."""

    def __init__(self, f, on_first_write):
        self._f = f
        self.crc = 0
        self.size = 0
        self._on_first_write = on_first_write

    def write(self, data) -> int:
        n = self._f.write(data)
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view[:n], self.crc)
        self.size += n
        if self._on_first_write is not None:
            self._f.flush()
            self._on_first_write, hook = None, self._on_first_write
            hook()
        return n

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.close()

    def writable(self) -> bool:
        return True


class ChecksummingFileSystem(FileSystem):
    """DCP's local file system, recording the size and CRC-32 of every file written through it,
    as it is written (no second read). `checksums` maps a path relative to `root` to
    (size, crc32 hex)."""

    def __init__(self, root: str):
        super().__init__()
        self.root = os.path.abspath(root)
        self.checksums: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    def _rel(self, path) -> str:
        return os.path.relpath(os.path.abspath(path), self.root)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, mode) as f:
            stream = _ChecksummedStream(f, self._fault_hook(path))
            yield stream
        with self._lock:
            self.checksums[self._rel(path)] = (stream.size, f"{stream.crc:08x}")

    def _fault_hook(self, path):
        """The `write` fail point fires after the first write into a data file of a step."""
        step = parse_step(os.path.basename(self.root))
        if not faults.armed() or step is None or not str(path).endswith(".distcp"):
            return None
        return lambda: faults.hit("write", step)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if (entry := self.checksums.pop(self._rel(path), None)) is not None:
                self.checksums[self._rel(new_path)] = entry


def make_storage_writer(path: str) -> FileSystemWriter:
    """Writer of a DCP step folder. `sync_files` keeps data durable before the commit marker;
    its file system records each file's checksum while writing (`writer.fs.checksums`)."""
    writer = FileSystemWriter(path, sync_files=True, single_file_per_rank=True)
    writer.fs = ChecksummingFileSystem(path)
    return writer


def make_storage_reader(path: str, metadata: Metadata | None = None, threads: int = 1) -> SafeFileSystemReader:
    """Reader of a DCP folder on `threads` I/O threads; pass `metadata` if it is already read."""
    return SafeFileSystemReader(path, metadata, threads)


def make_save_planner(policy: str = "balanced", min_slice_bytes: int = 1 << 20) -> DedupSavePlanner:
    """DCP's save planner with replicated values written as `checkpoint.dedup_policy` says."""
    return DedupSavePlanner(policy, min_slice_bytes)


def make_load_planner() -> SafeLoadPlanner:
    return SafeLoadPlanner()
