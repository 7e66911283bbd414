"""The `torch.save` archive, both ways: how a tensor's archive is framed around its storage bytes
(write) and how an item's archive is taken apart without `torch.load` (read). DCP stores every
tensor and non-tensor value of a checkpoint as one such archive (an uncompressed zip) inside a
rank's `.distcp` file; `filewriter` writes them and `reader` reads them with what is here.

What this relies on of torch, beyond its public API, in one list (a torch release that changes
one of them is met by `checkpoint.io_engine = "torch"`, which uses none of them):
- the zip layout `torch.save` writes: a `data.pkl` record holding the header pickle, one record
  per storage named by its key, a `byteorder` record, stored uncompressed, zip64 extras when large;
- the header pickle: `torch._utils._rebuild_tensor_v2`, `collections.OrderedDict`, the storage
  class names in `_STORAGE_DTYPES`, persistent ids `("storage", dtype, key, location, numel)`;
- `torch.serialization.skip_data()` leaving one hole for the storage's bytes, and the save
  settings `torch.utils.serialization.config.save` (`storage_alignment`, `compute_crc32`) that
  the framing depends on;
- `torch._weights_only_unpickler`, torch's own allow-list unpickler, for plain pickles that are
  neither plain data nor CPU tensors;
- torch's legacy format, in which `pickle.dumps` of a tensor holds its storage (read by
  `_storage_from_archive`).
An archive of another shape (float8, uint16, a compressed record) is `UnrecognisedArchive` and goes
through `torch.load(weights_only=True)`, as DCP does; a framing that differs raises at once.
Every pickle, ours to unpickle or torch's, is first checked by `untrusted.check_pickle`, and a
framing no `torch.save` writes is `MalformedArchive`: neither goes to `torch.load`.
"""

from __future__ import annotations

import collections
import io
import pickle
import re
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import _weights_only_unpickler
from torch.utils.serialization import config as serialization_config

from ..errors import MalformedArchive, UnrecognisedArchive, UnsafePickleError
from .untrusted import brief, check_pickle

_EOCD = struct.Struct("<4sHHHHIIH")
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_ZIP64_EOCD = struct.Struct("<4sQHHIIQQQQ")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_FULL32 = 0xFFFFFFFF

# the storage classes `torch.save` names in a tensor's header pickle
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}


# ---------------------------------------------------------------- the zip archive of one item


_FLAGS = 0x0808
"""The only flags `torch.save` sets on a record (sizes in a data descriptor, UTF-8 names)."""
_DOS_FOLDER = 0x10
"""The attribute that makes torch's zip reader take a record for a folder, and read none of it."""


def zip_records(read: Callable[[int, int], bytes], length: int, max_directory: int) -> dict[bytes, tuple[int, int]]:
    """Name -> (offset of its local header within the item, size) of every record of a zip
    whose records are all stored uncompressed, on one disk, as files (not folders), named
    `<folder>/<name>` with one folder, as `torch.save` writes them: any other is `UnrecognisedArchive`
    (what torch's zip reader makes of it is not worked out here). A zip directory of over
    `max_directory` bytes is `MalformedArchive`, refused before it is read."""
    if length < _EOCD.size:
        raise UnrecognisedArchive("shorter than a zip directory")
    sig, disk, cd_disk, count_here, count, cd_size, cd_offset, comment = _EOCD.unpack(
        read(length - _EOCD.size, _EOCD.size))
    if sig != b"PK\x05\x06" or comment or disk or cd_disk or count_here != count:
        raise UnrecognisedArchive("no zip directory of one disk at its end")
    locator = length - _EOCD.size - _ZIP64_LOCATOR.size
    if _FULL32 in (cd_size, cd_offset) or count == 0xFFFF or \
            (locator >= 0 and read(locator, 4) == b"PK\x06\x07"):  # torch's zip reader takes zip64's then
        count, cd_size, cd_offset = _zip64_directory(read, length)
    if cd_size > max_directory:
        raise MalformedArchive(f"has a zip directory of {cd_size} bytes, where at most {max_directory} are expected")
    if cd_offset + cd_size > length:
        raise UnrecognisedArchive("zip directory outside the item")
    directory = read(cd_offset, cd_size)
    out: dict[bytes, tuple[int, int]] = {}
    folded: set[bytes] = set()
    pos, folder = 0, None
    for _ in range(count):
        if pos + _CENTRAL.size > len(directory):
            raise UnrecognisedArchive("zip directory cut short")
        sig, _, _, flags, method, _, _, _, csize, usize, nlen, xlen, clen, disk, _, external, lho = \
            _CENTRAL.unpack_from(directory, pos)
        pos += _CENTRAL.size
        name = directory[pos : pos + nlen]
        if pos + nlen + xlen + clen > len(directory):
            raise UnrecognisedArchive(f"record {brief(name)} runs past the zip directory")
        if sig != b"PK\x01\x02" or method != 0 or flags & ~_FLAGS or disk or external & _DOS_FOLDER:
            raise UnrecognisedArchive(f"record {brief(name)} is not a file stored uncompressed as torch.save stores one")
        folder = folder or name[: name.find(b"/") + 1]
        if not folder or not name.startswith(folder) or not _PLAIN_NAME.fullmatch(name, len(folder)):
            raise UnrecognisedArchive(f"record {brief(name)} is not named as torch.save names one")
        if _FULL32 in (usize, csize, lho):
            usize, csize, lho = _zip64_fields(directory[pos + nlen : pos + nlen + xlen], usize, csize, lho)
        if usize != csize:
            raise UnrecognisedArchive(f"record {brief(name)} is compressed")
        if name.lower() in folded:  # torch's zip reader might find either: the one checked, or the other
            raise MalformedArchive(f"has two records named {brief(name)}")
        folded.add(name.lower())
        out[name] = (lho, usize)
        pos += nlen + xlen + clen
    return out


_SEGMENT = rb"(?!\.\.?(?:/|$))[A-Za-z0-9._-]+"
_PLAIN_NAME = re.compile(rb"%s(?:/%s)*" % (_SEGMENT, _SEGMENT))
"""A record's name within its folder as `torch.save` writes one (`data.pkl`, `.data/version`,
`data/0`, ...): segments of letters, digits, `.`, `_` and `-`, none empty or a folder's self
or parent."""


def _zip64_directory(read: Callable[[int, int], bytes], length: int) -> tuple[int, int, int]:
    at = length - _EOCD.size - _ZIP64_LOCATOR.size
    if at < 0:
        raise UnrecognisedArchive("no zip64 locator")
    sig, disk, eocd64, disks = _ZIP64_LOCATOR.unpack(read(at, _ZIP64_LOCATOR.size))
    if sig != b"PK\x06\x07" or disk or disks != 1 or eocd64 + _ZIP64_EOCD.size > length:
        raise UnrecognisedArchive("bad zip64 locator")
    fields = _ZIP64_EOCD.unpack(read(eocd64, _ZIP64_EOCD.size))
    if fields[0] != b"PK\x06\x06" or fields[4] or fields[5] or fields[6] != fields[7]:
        raise UnrecognisedArchive("bad zip64 directory")
    return fields[7], fields[8], fields[9]


def _zip64_fields(extra: bytes, usize: int, csize: int, lho: int) -> tuple[int, int, int]:
    """The 64-bit sizes and offset of a record whose 32-bit fields are full."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            if pos + 4 + size > len(extra):
                break
            values = iter(struct.unpack_from(f"<{size // 8}Q", extra, pos + 4))
            try:
                return tuple(next(values) if v == _FULL32 else v for v in (usize, csize, lho))
            except StopIteration:
                break
        pos += 4 + size
    raise UnrecognisedArchive("zip64 record without its sizes")


def zip_record(read: Callable[[int, int], bytes], length: int, records: dict[bytes, tuple[int, int]],
            name: bytes) -> tuple[int, int] | None:
    """(offset within the item, size) of the bytes of record `name`, or None."""
    if name not in records:
        return None
    lho, size = records[name]
    if lho + _LOCAL.size > length:
        raise UnrecognisedArchive(f"record {brief(name)} outside the item")
    fields = _LOCAL.unpack(read(lho, _LOCAL.size))
    start = lho + _LOCAL.size + fields[9] + fields[10]
    if fields[0] != b"PK\x03\x04" or start + size > length:
        raise UnrecognisedArchive(f"record {brief(name)} outside the item")
    return start, size


def local_record(buf: bytes, pos: int) -> tuple[bytes, int]:
    """Name and data offset of the zip local header at `pos` of `buf`."""
    if pos + _LOCAL.size > len(buf):
        raise UnrecognisedArchive("record header past the bytes read")
    fields = _LOCAL.unpack_from(buf, pos)
    start = pos + _LOCAL.size + fields[9] + fields[10]
    if fields[0] != b"PK\x03\x04" or start > len(buf):
        raise UnrecognisedArchive("bad record header")
    return buf[pos + _LOCAL.size : pos + _LOCAL.size + fields[9]], start


def header_pickle(buf: bytes) -> tuple[bytes, bytes, int]:
    """From an archive's first bytes: its folder name (`archive/`), the bytes of its first
    record, `data.pkl` (up to the next record's header), and where that next header starts.
    `torch.save` writes `data.pkl` first; the local headers carry no sizes, so the next header
    is found by its signature."""
    name, start = local_record(buf, 0)
    if not name.endswith(b"/data.pkl") or name.find(b"/") != len(name) - len(b"/data.pkl"):
        raise UnrecognisedArchive("no header pickle first")  # torch's reader takes the folder up to the first /
    end = buf.find(b"PK\x03\x04", start)
    if end < 0:
        raise UnrecognisedArchive("header pickle past the bytes read")
    return name[: -len(b"data.pkl")], buf[start:end], end


# ---------------------------------------------------------------- the header pickle


@dataclass(frozen=True)
class SavedTensor:
    """What a tensor item's header pickle says: dtype, storage record and view of it."""

    dtype: torch.dtype
    key: str
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _StorageRef:
    dtype: torch.dtype
    key: str
    numel: int


def _rebuild(storage, storage_offset, size, stride, requires_grad, hooks, metadata=None) -> SavedTensor:
    if not isinstance(storage, _StorageRef) or hooks or metadata:
        raise UnrecognisedArchive("a tensor with hooks or metadata")
    if type(requires_grad) is not bool or requires_grad and not (storage.dtype.is_floating_point
                                                                 or storage.dtype.is_complex):
        raise UnrecognisedArchive("a tensor that cannot require grad marked as requiring it")  # torch.load refuses it
    return SavedTensor(storage.dtype, storage.key, storage.numel, int(storage_offset),
                        tuple(int(s) for s in size), tuple(int(s) for s in stride))


class HeaderUnpickler(pickle.Unpickler):
    """Reads a tensor's header pickle into a `SavedTensor`; every global it resolves is one of
    ours, so nothing from the file runs."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise UnrecognisedArchive(f"{module[:100]}.{name[:100]}")

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], torch.dtype) and isinstance(pid[2], str) and pid[2].isascii()
                and pid[2].isdigit() and isinstance(pid[4], int)):  # torch.save numbers its records
            raise UnrecognisedArchive(f"storage reference {brief(pid)}")
        return _StorageRef(pid[1], pid[2], pid[4])


class _PlainUnpickler(pickle.Unpickler):
    """Numbers, strings, bools, None and containers of them; anything else is not read here."""

    def find_class(self, module: str, name: str) -> Any:
        raise UnrecognisedArchive(f"{module[:100]}.{name[:100]}")

    def persistent_load(self, pid: Any) -> Any:
        raise UnrecognisedArchive("a tensor")


def unpickle(unpickler: type[pickle.Unpickler], data: bytes) -> Any:
    """`data` unpickled by `unpickler`, once `check_pickle` passed it (else `UnsafePickleError`);
    any error of the unpickler's is `UnrecognisedArchive`."""
    return _unpickled(unpickler, data)[0]


def _unpickled(unpickler: type[pickle.Unpickler], data: bytes) -> tuple[Any, int]:
    """`unpickle`, and the length of the pickle read (through its STOP)."""
    length = check_pickle(data, "the value")
    try:
        return unpickler(io.BytesIO(data)).load(), length
    except UnrecognisedArchive:
        raise
    except Exception as e:  # a broken pickle: let torch.load judge it
        raise UnrecognisedArchive(str(e)) from None


def unpickle_header(unpickler: type[pickle.Unpickler], pkl: bytes) -> tuple[Any, int]:
    """`unpickle` of the record `header_pickle` cut out, and the length of its pickle: the size
    the zip directory must give `data.pkl` (`check_header_record`). One the scan finds malformed
    was cut at a record signature inside its own bytes (a zip held in a value, an int written as
    those bytes), not at the next record: the archive is `UnrecognisedArchive`, and `torch_load` reads
    it whole, every pickle record checked."""
    try:
        return _unpickled(unpickler, pkl)
    except UnsafePickleError as e:
        if e.malformed:
            raise UnrecognisedArchive("header pickle cut short") from None
        raise


def check_header_record(records: dict[bytes, tuple[int, int]], folder: bytes, length: int) -> None:
    """`UnrecognisedArchive` unless the zip directory's `data.pkl` is the first record and as long as
    the header pickle read from it: torch's zip reader finds `data.pkl` through the directory,
    so an archive whose directory names another record would be read apart by torch."""
    if records.get(folder + b"data.pkl") != (0, length):
        raise UnrecognisedArchive("a zip directory whose data.pkl is not the first record's pickle")


def check_small_records(read: Callable[[int, int], bytes], length: int, records: dict[bytes, tuple[int, int]],
                        folder: bytes) -> None:
    """`UnrecognisedArchive` unless the archive's version records hold what `torch.save` writes and its
    `.storage_alignment` a number: `torch.load` refuses other values, which the fast reader
    does not otherwise read."""
    versions = [folder + b"version", folder + b".data/version"]
    if not any(name in records for name in versions):
        raise UnrecognisedArchive("no version record")
    for name, holds in [*((v, b"3\n".__eq__) for v in versions), (folder + b".format_version", b"1".__eq__),
                        (folder + b".storage_alignment", bytes.isdigit)]:
        where = zip_record(read, length, records, name)
        if where is not None and (where[1] > 16 or not holds(read(*where))):
            raise UnrecognisedArchive(f"record {brief(name)} holds what torch.save does not write")


def _reader(data: bytes) -> Callable[[int, int], bytes]:
    """The `read(at, n)` of the zip readers above, over an archive held in memory."""
    return lambda at, n: data[at : at + n]


def load_plain(data: bytes) -> Any:
    """A non-tensor value that DCP saved with `torch.save`: plain data is unpickled here (no
    globals allowed, so no code runs); anything else by `torch_load`."""
    try:
        folder, pkl, _ = header_pickle(data)
        value, length = unpickle_header(_PlainUnpickler, pkl)
        read = _reader(data)
        records = zip_records(read, len(data), len(data))
        check_header_record(records, folder, length)
        check_small_records(read, len(data), records, folder)
        return value
    except UnrecognisedArchive:
        return torch_load(data)


def torch_load(data: bytes) -> Any:
    """`torch.load(data, weights_only=True)` of a `torch.save` archive whose every pickle
    record (`*data.pkl`, case aside, as torch's zip reader finds names) `check_pickle` passed:
    torch's allow-list unpickler hashes what it builds as any unpickler does. An archive that
    is not a zip of stored records (torch.save writes no other) is `MalformedArchive`: torch would
    read it as its legacy format, a stream of pickles."""
    if not data.startswith(b"PK\x03\x04"):  # how torch.load tells a zip from its legacy format
        raise MalformedArchive("is not a readable torch.save archive (no zip record at its start)")
    try:
        read = _reader(data)
        records = zip_records(read, len(data), len(data))
        pickles = [zip_record(read, len(data), records, name)
                   for name in records if name.lower().endswith(b"data.pkl")]
    except UnrecognisedArchive as e:
        raise MalformedArchive(f"is not a readable torch.save archive ({e})") from None
    if not pickles:
        raise MalformedArchive("is a zip without a data.pkl record")
    for start, size in pickles:
        check_pickle(data[start : start + size], "the archive")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def refusal(error: pickle.UnpicklingError) -> str:
    """What an allow-list unpickler refused, in a line (torch's message is a page of advice to
    load the file with `weights_only=False`, which would run its code)."""
    text = str(error)
    if found := re.search(r"(?:Unsupported global: GLOBAL|Trying to load unsupported GLOBAL) (\S+)", text):
        return f"it needs {found.group(1)}"
    lines = [line.strip() for line in text.splitlines() if "WeightsUnpickler error:" in line] or [text.strip()]
    return brief(lines[0].removeprefix("WeightsUnpickler error: "))


def load_plain_pickle(data: bytes) -> Any:
    """A plain pickle (`pickle.dumps`, not a `torch.save` archive), read without running code:
    plain data and CPU tensors here (`_TensorValueUnpickler`), else with the globals
    `torch.load(weights_only=True)` allows (its unpickler, which is private to torch). Anything
    else raises `pickle.UnpicklingError` (`UnsafePickleError`, one, where `check_pickle` refuses
    it)."""
    try:
        return unpickle(_TensorValueUnpickler, data)
    except UnrecognisedArchive as ours:
        try:
            with warnings.catch_warnings():  # that it may not read protocol 4: it says why if it does not
                warnings.filterwarnings("ignore", message="Detected pickle protocol")
                return _weights_only_unpickler.load(io.BytesIO(data), encoding="utf-8")
        except pickle.UnpicklingError as e:  # torch's names an opcode of protocol 4 where ours names what it met
            raise pickle.UnpicklingError(f"found {ours}") from e


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_VERSION = 1001


class _LegacyStorageUnpickler(HeaderUnpickler):
    """The reference to its storage that torch's legacy format pickles: a storage class (its
    dtype, as `HeaderUnpickler` resolves it) and a numeric key, on the CPU, no view; one
    reference only (a pickle naming others and dropping them would be read apart by torch)."""

    def persistent_load(self, pid: Any) -> _StorageRef:
        if getattr(self, "_referenced", False) or not (
                isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage" and pid[3] == "cpu"
                and pid[5] is None):
            raise UnrecognisedArchive(f"storage reference {brief(pid)}")
        self._referenced = True
        return super().persistent_load(pid[:5])


def _storage_from_archive(archive: Any) -> torch.storage.TypedStorage:
    """The storage that `pickle.dumps` of a tensor holds as `torch.save(storage,
    _use_new_zipfile_serialization=False)` bytes (which torch reads back with
    `torch.load(weights_only=False)`): torch's legacy format, a magic number, a format version,
    system information, the storage's reference and its key, each a pickle checked then read
    here with no other globals, then the storage's length and bytes, checked to be all there is."""
    if not isinstance(archive, bytes):
        raise UnrecognisedArchive("a tensor's storage that is not bytes")
    f = io.BytesIO(archive)

    def next_pickle(unpickler: type[pickle.Unpickler] = _PlainUnpickler) -> Any:
        check_pickle(archive[f.tell():], "a tensor's storage")
        return unpickler(f).load()

    magic, version, info = next_pickle(), next_pickle(), next_pickle()
    if magic != _LEGACY_MAGIC or version != _LEGACY_VERSION or not isinstance(info, dict) \
            or info.get("little_endian") is not True:
        raise UnrecognisedArchive("a tensor's storage in a format other than torch's legacy one")
    ref, keys = next_pickle(_LegacyStorageUnpickler), next_pickle()
    numel = struct.unpack("<q", f.read(8).ljust(8, b"\xff"))[0]
    if not isinstance(ref, _StorageRef) or keys != [ref.key] or numel != ref.numel or f.tell() + numel * ref.dtype.itemsize != len(archive):
        raise UnrecognisedArchive(f"a tensor's storage of {brief(numel)} elements in {len(archive) - f.tell()} bytes")
    data = (torch.frombuffer(bytearray(archive[f.tell():]), dtype=torch.uint8) if numel
            else torch.empty(0, dtype=torch.uint8, device="cpu"))
    return torch.storage.TypedStorage(wrap_storage=data.untyped_storage(), dtype=ref.dtype, _internal=True)


def _plain_tensor(storage, storage_offset, size, stride, requires_grad, hooks, metadata=None) -> torch.Tensor:
    """A tensor `pickle.dumps` wrote, as a view of its storage that `set_` checks to lie inside
    it, of at most as many elements as the storage holds (a view repeating elements, stride 0,
    could claim any number, which a copy of it would allocate)."""
    if not isinstance(storage, torch.storage.TypedStorage) or hooks or metadata or not isinstance(requires_grad, bool):
        raise UnrecognisedArchive("a tensor with hooks or metadata")
    t = torch.empty((0,), dtype=storage.dtype, device="cpu").set_(storage._untyped_storage, storage_offset, size,
                                                                  stride)
    held = storage._untyped_storage.nbytes() // storage.dtype.itemsize  # its size(), which warns of TypedStorage
    if t.numel() > held:
        raise UnrecognisedArchive(f"a view of {t.numel()} elements of a storage of {held}")
    return t.requires_grad_(requires_grad)


class _TensorValueUnpickler(_PlainUnpickler):
    """`_PlainUnpickler`, and the CPU tensors `pickle.dumps` writes (a data loader's state
    holds its generator's as one), each storage read from its archive by `_storage_from_archive`
    once: a pickle naming one archive many times gets one storage, so what it holds stays within
    the bytes it holds."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._storages: dict[int, tuple[bytes, torch.storage.TypedStorage]] = {}

    def _storage(self, archive: Any) -> torch.storage.TypedStorage:
        found = self._storages.get(id(archive))
        if found is None:
            found = self._storages[id(archive)] = (archive, _storage_from_archive(archive))  # keeps the id's object
        return found[1]

    def find_class(self, module: str, name: str) -> Any:
        found = {("torch._utils", "_rebuild_tensor_v2"): _plain_tensor,
                 ("torch.storage", "_load_from_bytes"): self._storage,
                 ("collections", "OrderedDict"): collections.OrderedDict,
                 **_PLAIN_TORCH_VALUES}.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise UnrecognisedArchive(f"{module[:100]}.{name[:100]}")
        return found


_PLAIN_TORCH_VALUES: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size, ("torch", "device"): torch.device, ("builtins", "complex"): complex}
"""Values that `torch.load(weights_only=True)` reads in a `torch.save` archive, built by their
own constructors (no code of the file's), for the plain pickles of `pickle.dumps` too: torch's
allow-list unpickler, the fallback, reads no pickle of protocol 4 or above, which `pickle.dumps`
writes (a data loader's state holding a dtype or a complex was refused at every load)."""


# ---------------------------------------------------------------- framing a tensor's archive


class _Frame(io.RawIOBase):
    """Records what `torch.save` writes under `skip_data`: the bytes before the hole left for
    the storage's bytes, and the bytes after it."""

    def __init__(self, hole: int):
        self.parts = [bytearray()]
        self._hole = hole
        self._pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.parts[-1] += view
        self._pos += len(view)
        return len(view)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR and offset == self._hole > 0 and len(self.parts) == 1:
            self.parts.append(bytearray())
            self._pos += offset
        elif {io.SEEK_SET: offset, io.SEEK_CUR: self._pos + offset}.get(whence) != self._pos:
            raise io.UnsupportedOperation(f"torch.save under skip_data seeked ({offset}, {whence}); "
                                          "this torch version frames archives differently")
        return self._pos


_FRAMES: dict[tuple, tuple[bytes, bytes]] = {}
_MAX_FRAMES = 4096


def frame(t: torch.Tensor) -> tuple[bytes, bytes]:
    """The archive `torch.save(t)` writes around `t`'s storage bytes (whose storage holds
    exactly its elements). It depends only on the tensor's dtype, shape and strides, its lazy
    conjugate and negative bits, and torch's serialization settings, so it is computed once per
    kind of tensor rather than per tensor per save."""
    settings = serialization_config.save
    key = (type(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.is_conj(), t.is_neg(),
           settings.storage_alignment, settings.compute_crc32)
    found = _FRAMES.get(key)
    if found is None:
        frame = _Frame(t.untyped_storage().nbytes())
        with torch.serialization.skip_data():
            torch.save(t, frame)
        if len(frame.parts) != (2 if t.untyped_storage().nbytes() else 1):
            raise RuntimeError("torch.save under skip_data did not leave the expected hole for the "
                               "tensor's bytes; this torch version frames archives differently")
        found = (bytes(frame.parts[0]), bytes(frame.parts[-1]) if len(frame.parts) == 2 else b"")
        if len(_FRAMES) >= _MAX_FRAMES:
            _FRAMES.clear()
        _FRAMES[key] = found
    return found
