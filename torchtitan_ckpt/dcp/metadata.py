"""A DCP checkpoint's `.metadata`, read without running code from it: an allow-list unpickler
(DCP's own classes, plain data, torch's dtypes), a salted index against crafted hash collisions,
a size bound, and every field checked (`validate.check_metadata`) before anything uses it."""

from __future__ import annotations

import collections
import enum
import io
import os
import pathlib
import pickle
import secrets
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ..errors import CheckpointError, CorruptCheckpointError
from ..io import safe_open
from ..io.untrusted import brief, check_pickle
from .validate import check_metadata

METADATA_FILE = ".metadata"
MAX_METADATA_BYTES = 1 << 30
"""Largest `.metadata` read (it is read whole, then checked): a model of a million chunks has
one of about 150 MB."""

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
# dtypes, layouts and memory formats pickle as attributes of the torch module; listed from its
# namespace, as `getattr(torch, name)` of another name may import a submodule
_ALLOWED_TORCH_ATTRS = {name: value for name, value in vars(torch).items()
                        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))}


_SALT = secrets.token_hex(16)
_DISTINCT = sys.hash_info.modulus
"""Non-negative ints below it hash to themselves: no two share a hash."""
MAX_SHARED_HASH = 64
"""Most storage keys of a `.metadata` that may share DCP's hash (distinct real ones share none)."""


class _SaltedIndex(MetadataIndex):
    """DCP's `MetadataIndex` as `.metadata`'s storage dict is unpickled: hashed from the text of
    its fields and a secret of this process, so that keys a crafted file made share DCP's hash
    (offsets of large or chosen numbers) cost no more to put in that dict than any others.
    `read_metadata` puts DCP's own keys back once it has counted how many share a hash."""

    def __hash__(self) -> int:
        fqn, offset = getattr(self, "fqn", None), getattr(self, "offset", None)
        if type(fqn) is str and type(offset) is torch.Size and all(0 <= x < _DISTINCT for x in offset):
            return hash((_SALT, fqn, *offset))  # such ints hash to themselves: only the secret mixes them
        return hash((_SALT, repr(fqn), repr(offset)))


def _restore_keys(metadata: Any, path: str) -> None:
    """Put DCP's `MetadataIndex` keys in place of the `_SaltedIndex` ones unpickled; more than
    `MAX_SHARED_HASH` sharing DCP's hash is a `CorruptCheckpointError` (a dict of them, and every
    lookup in it, would take quadratic time)."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict) or not all(type(k) is _SaltedIndex for k in storage):
        return  # `check_metadata` refuses it
    for k in storage:
        offset = getattr(k, "offset", None)
        if type(getattr(k, "fqn", None)) is not str or not (offset is None or type(offset) is torch.Size):
            raise CorruptCheckpointError(f"{path}: storage key {brief(k)} is not a name and an offset")
    shared = collections.Counter(MetadataIndex.__hash__(k) for k in storage).most_common(1)
    if shared and shared[0][1] > MAX_SHARED_HASH:
        raise CorruptCheckpointError(f"{path}: {shared[0][1]} storage keys share one hash; the file was crafted "
                                     "to make reading it take quadratic time")
    for k in storage:
        k.__class__ = MetadataIndex  # the same fields: DCP's class, and its hash, from here on
    metadata.storage_data = dict(storage.items())


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self._path = path

    def _enum_member(self, cls: Any, name: Any) -> enum.Enum:
        """What `getattr` may do in a `.metadata`: name a member of one of DCP's enums, as some
        Python 3.11 releases pickle an enum member (Debian 12's 3.11.2 does; 3.11.7 pickles its
        value instead)."""
        if isinstance(cls, type) and issubclass(cls, enum.Enum) and (cls.__module__, cls.__name__) in _ALLOWED_GLOBALS \
                and type(name) is str and name in cls.__members__:
            return cls.__members__[name]
        raise CorruptCheckpointError(f"{self._path}: its pickle asks for the attribute {brief(name)} of {brief(cls)}, "
                                     "where a DCP metadata file names only members of DCP's enums; refusing to load it")

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.distributed.checkpoint.metadata", "MetadataIndex"):
            return _SaltedIndex
        if (module, name) == ("builtins", "getattr"):
            return self._enum_member
        if (module, name) == ("pathlib._local", "PosixPath"):  # where Python 3.13 pickles it from
            return pathlib.PosixPath
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and name in _ALLOWED_TORCH_ATTRS:
            return _ALLOWED_TORCH_ATTRS[name]
        raise CorruptCheckpointError(
            f"{self._path} references {module[:100]}.{name[:100]}, which a DCP metadata file never holds; "
            "refusing to load it (it could run code)"
        )


def _newer_class(error: Exception) -> str | None:
    """The DCP metadata class whose `__setstate__` failed with `error` unpacking its state (one
    a newer PyTorch gave more fields, as 2.15 did `TensorProperties`), else None."""
    if not isinstance(error, ValueError) or "too many values to unpack" not in str(error):
        return None
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame if tb is not None else None
    if (frame is None or frame.f_code.co_name != "__setstate__"
            or frame.f_globals.get("__name__") != Metadata.__module__):
        return None
    owner = frame.f_locals.get("self")
    return type(owner).__name__ if owner is not None else "metadata"


def check_loadable(path: str, metadata: Metadata) -> None:
    """Rank 0, once a save wrote the `.metadata` at `path`: one larger than a load reads
    (`MAX_METADATA_BYTES`) fails the save, so that a job whose layout makes such steps learns it
    at its first save, not at a resume after hours of steps it can never load. Its size grows
    with the chunks it lists, one per shard of each tensor on each rank."""
    size = os.path.getsize(path)
    if size > MAX_METADATA_BYTES:
        chunks = sum(len(md.chunks) for md in metadata.state_dict_metadata.values()
                     if isinstance(md, TensorStorageMetadata))
        raise CheckpointError(
            f"its {METADATA_FILE} is {size} bytes, more than the {MAX_METADATA_BYTES} a load reads: this job's steps "
            f"could never be loaded. It lists {chunks} chunks of {len(metadata.state_dict_metadata)} entries, one per "
            "shard of each tensor on each rank: shard the state over fewer ranks (HSDP: a data_parallel_shard_degree "
            "below the world size, replicated across the rest), or stack the layers' tensors into fewer, larger ones")


def metadata_bytes(path: str) -> bytes:
    """The bytes of the DCP `.metadata` file `path`, of a bounded size and starting as DCP's
    pickle does."""
    with safe_open.open_path(path, "the DCP metadata file") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_METADATA_BYTES:
            raise CorruptCheckpointError(f"{path} is {size} bytes, more than the {MAX_METADATA_BYTES} of any DCP "
                                         "metadata file this reads; the file is damaged or crafted")
        if (head := f.read(1)) != b"\x80":  # protocol 2 or later, as DCP writes: told before reading the rest
            raise CorruptCheckpointError(f"{path} is not a DCP metadata file: it starts with {head!r}, where a pickle "
                                         "of protocol 2 or later (DCP's) starts with b'\\x80'; the file is damaged")
        return head + f.read()


def read_metadata(path: str, check: Callable[[bytes, str], object] = check_pickle,
                  data: bytes | None = None) -> Metadata:
    """Read a DCP `.metadata` file (or its `data`, read by `metadata_bytes`) without running
    code from it, its pickle checked first (`check(data, path)`: `check_pickle`, or a caller's
    way of having it done) and every field after (`validate.check_metadata`) against the
    folder it is in."""
    if data is None:
        data = metadata_bytes(path)
    check(data, path)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), path).load()
    except CorruptCheckpointError:
        raise
    except Exception as e:  # a crafted pickle, or one of a newer PyTorch
        if newer := _newer_class(e):
            raise CheckpointError(
                f"{path} was written by a newer PyTorch than this one ({torch.__version__}): its {newer} holds more "
                f"fields than this version's ({type(e).__name__}: {brief(str(e))}). Load it with the PyTorch that "
                "saved it, or a newer one") from e
        raise CorruptCheckpointError(f"{path} is not a readable DCP metadata file: {type(e).__name__}: "
                                     f"{brief(str(e))}") from e
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
    _restore_keys(metadata, path)
    check_metadata(metadata, os.path.dirname(path) or ".", path)
    return metadata
