"""The load path's reader (`storage.make_storage_reader`): it loads bit for bit what DCP's own
`FileSystemReader` loads, on one rank and resharded across ranks, and a damaged file is refused
with an error naming the file and the item."""

from __future__ import annotations

import ctypes
import io
import mmap
import dataclasses
import os
import pickle
import resource
import subprocess
import sys
import time
import zipfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from torchtitan_ckpt import CheckpointError, CorruptCheckpointError
from torchtitan_ckpt.dcp import storage
from torchtitan_ckpt.dcp.metadata import METADATA_FILE, read_metadata
from torchtitan_ckpt.example.config import load_job_config

from .helpers import ROOT, data_file_use, spawn

_OBJECTS = {"lr": 3e-4, "betas": (0.9, 0.95), "name": "adamw", "flags": [True, None], "nested": {"k": 2}}


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(64, 33, generator=g),
        "bf16": torch.randn(17, 5, generator=g).to(torch.bfloat16),
        "i64": torch.arange(-50, 50),
        "bool": torch.rand(9, generator=g) > 0.5,
        "c64": torch.randn(4, 3, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 7),
        "transposed": torch.randn(6, 10, generator=g).t(),  # saved with its strides (10 x 6, stride (1, 10))
        "f8": torch.randn(12, generator=g).to(torch.float8_e4m3fn),  # saved as an untyped storage
        "u16": torch.arange(0, 60000, 1000).to(torch.uint16),
    }


def _save(path: str) -> None:
    dcp.save({**_tensors(), **_OBJECTS}, storage_writer=storage.make_storage_writer(path))


def _load(path: str, reader, planner) -> dict:
    blank = {k: {kk: None for kk in v} if isinstance(v, dict) else None for k, v in _OBJECTS.items()}
    state = {**{k: torch.zeros_like(v) for k, v in _tensors().items()}, **blank}
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except CheckpointException as e:  # DCP's wrapper of every rank's failure
        raise storage.root_cause(e) from None
    return state


def _assert_bitwise(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor):
            assert (x.dtype, x.shape, x.stride()) == (y.dtype, y.shape, y.stride()), key
            assert torch.equal(x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8)), key
        else:
            assert x == y and type(x) is type(y), key


@pytest.mark.parametrize("threads", [1, 3])
def test_loads_bit_for_bit_what_dcp_loads(tmp_path, threads):
    path = str(tmp_path / "ckpt")
    _save(path)
    ours = _load(path, storage.make_storage_reader(path, threads=threads), storage.make_load_planner())
    theirs = _load(path, FileSystemReader(path), DefaultLoadPlanner())
    _assert_bitwise(ours, theirs)
    _assert_bitwise(ours, {**_tensors(), **_OBJECTS})


def test_strided_tensors_are_read_through_temporaries_of_at_most_the_piece_size(tmp_path, monkeypatch):
    """A transposed or channels-last tensor is saved with its strides, so its bytes are not in
    the destination's row-major order: they go through temporaries, split along the dimension
    of largest stride so that each spans at most `_PIECE_BYTES` (split along dim 0, the
    transposed one's first temporary spanned all of it)."""
    from torchtitan_ckpt.io import reader

    g = torch.Generator().manual_seed(1)
    tensors = {"transposed": torch.randn(64, 48, generator=g).t(),
               "channels_last": torch.randn(8, 16, 3, 3, generator=g).to(memory_format=torch.channels_last)}
    path = str(tmp_path / "ckpt")
    dcp.save(dict(tensors), storage_writer=storage.make_storage_writer(path))
    monkeypatch.setattr(reader, "_PIECE_BYTES", 1024)
    reads = []
    real = reader._Item.readinto

    def recording(self, at, buf):
        reads.append(len(buf))
        real(self, at, buf)

    monkeypatch.setattr(reader._Item, "readinto", recording)
    state = {k: torch.zeros_like(v) for k, v in tensors.items()}
    dcp.load(state, storage_reader=storage.make_storage_reader(path), planner=storage.make_load_planner())
    _assert_bitwise(state, tensors)
    assert sum(reads) >= sum(t.numel() * 4 for t in tensors.values()) and max(reads) <= 1024


def test_metadata_given_to_the_reader_is_not_read_again(tmp_path):
    path = str(tmp_path / "ckpt")
    _save(path)
    metadata = read_metadata(os.path.join(path, METADATA_FILE))
    os.remove(os.path.join(path, METADATA_FILE))
    ours = _load(path, storage.make_storage_reader(path, metadata, threads=2), storage.make_load_planner())
    _assert_bitwise(ours, {**_tensors(), **_OBJECTS})


def _item(path: str, fqn: str) -> tuple[str, int, int]:
    """(file, offset, length) of the item holding `fqn`."""
    metadata = read_metadata(os.path.join(path, METADATA_FILE))
    (index, info), = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == fqn]
    return os.path.join(path, info.relative_path), info.offset, info.length


def _read(file: str, offset: int, length: int) -> bytes:
    with open(file, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _patch(file: str, at: int, data: bytes) -> None:
    with open(file, "r+b") as f:
        f.seek(at)
        f.write(data)


def _shrink_record(file: str, offset: int, length: int) -> int:
    """Make the zip directory of the item at `offset` say its storage record is 4 bytes shorter
    than it is; returns the record's true size."""
    item = _read(file, offset, length)
    name = zipfile.ZipFile(io.BytesIO(item)).namelist()[0].split("/")[0] + "/data/0"
    central = item.rindex(name.encode()) - 46  # the record's entry in the zip directory
    assert item[central : central + 4] == b"PK\x01\x02"
    nbytes = int.from_bytes(item[central + 24 : central + 28], "little")
    smaller = (nbytes - 4).to_bytes(4, "little")
    _patch(file, offset + central + 20, smaller + smaller)  # compressed and uncompressed sizes
    return nbytes


def test_a_storage_record_of_the_wrong_size_is_refused_naming_the_file(tmp_path):
    path = str(tmp_path / "ckpt")
    _save(path)
    file, offset, length = _item(path, "f32")
    nbytes = _shrink_record(file, offset, length)
    assert nbytes == 64 * 33 * 4
    with pytest.raises(CorruptCheckpointError, match=rf"{file}: item 'f32' .*storage record of {nbytes - 4} bytes; "
                                                     rf"its header says 2112 x torch.float32 = {nbytes} bytes"):
        _load(path, storage.make_storage_reader(path, threads=2), storage.make_load_planner())


def test_a_header_whose_view_runs_past_its_storage_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    _save(path)
    file, offset, length = _item(path, "f32")
    at = _read(file, offset, length).index(b"K!K\x01\x86")  # the pickled stride (33, 1) of the 64 x 33 tensor
    _patch(file, offset + at, b"K\x22K\x01\x86")  # stride (34, 1): 2174 elements of 2112
    with pytest.raises(CorruptCheckpointError, match=rf"{file}: item 'f32' .*stride \[34, 1\].* runs past its 2112"):
        _load(path, storage.make_storage_reader(path), storage.make_load_planner())


def test_a_file_cut_short_is_refused_naming_the_file(tmp_path):
    path = str(tmp_path / "ckpt")
    _save(path)
    file, offset, length = _item(path, "f32")
    with open(file, "r+b") as f:
        f.truncate(offset + length // 2)
    with pytest.raises(CorruptCheckpointError, match=rf"{file}: item '\w+' .*cut short"):
        _load(path, storage.make_storage_reader(path), storage.make_load_planner())


def test_a_tensor_header_naming_other_code_is_refused_naming_the_file(tmp_path):
    path = str(tmp_path / "ckpt")
    _save(path)
    file, offset, length = _item(path, "bf16")
    at = _read(file, offset, length).index(b"_rebuild_tensor_v2")
    _patch(file, offset + at, b"_rebuild_tensor_v9")  # a global that no tensor header names
    with pytest.raises(CorruptCheckpointError, match=rf"{file}: item 'bf16' .*could run code; refused"):
        _load(path, storage.make_storage_reader(path), storage.make_load_planner())


def _central_entry(item: bytes, name: bytes) -> int:
    """Where the zip directory entry of the record whose name ends in `name` starts in `item`."""
    return item.rindex(b"PK\x01\x02", 0, item.index(name, item.index(b"PK\x01\x02")))


@pytest.mark.parametrize("fast", [True, False])
def test_an_item_whose_directory_gives_its_header_pickle_another_size_is_read_as_torch_reads_it(tmp_path, fast):
    """torch's zip reader takes `data.pkl`'s bytes as the zip directory gives them; ours read
    the first record up to the next one. The directory saying one byte fewer made torch fail
    (after other tensors were written, with `io_engine = "torch"`) where ours loaded."""
    path = str(tmp_path / "ckpt")
    _save(path)
    file, offset, length = _item(path, "bf16")
    item = _read(file, offset, length)
    entry = _central_entry(item, b"/data.pkl")
    size = int.from_bytes(item[entry + 24 : entry + 28], "little")
    _patch(file, offset + entry + 20, 2 * (size - 1).to_bytes(4, "little"))  # its compressed and full sizes
    with pytest.raises(CheckpointException, match="EOFError"):
        dcp.load({"bf16": torch.zeros(17, 5, dtype=torch.bfloat16)}, storage_reader=FileSystemReader(path))
    with pytest.raises(CorruptCheckpointError, match=rf"{file}: item 'bf16' .*has a pickle that is not well formed "
                                                     r"\(ValueError: 'the pickle ends before its STOP opcode'\)"):
        _load(path, storage.make_storage_reader(path, fast=fast), storage.make_load_planner())


def _archive(records: list[tuple[str, object]]) -> bytearray:
    """A zip of torch's writer holding `records` (name -> a value pickled), in that order."""
    buf = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(buf)
    for name, value in records:
        data = pickle.dumps(value, protocol=2)
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return bytearray(buf.getvalue())


def test_a_value_whose_directory_names_another_header_pickle_is_read_as_torch_reads_it():
    """Archives holding two pickles, of which ours read the first record's (1) and torch.load
    the one named `data.pkl` in the zip directory (2): one whose directory swaps the names, and
    one whose first record is `data.pkl` a folder deeper (torch's folder is the first name's
    first segment)."""
    from torchtitan_ckpt.io import torch_archive

    swapped = _archive([("data.pkl", 1), ("zata.pkl", 2)])
    for old, new in [(b"/data.pkl", b"/yata.pkl"), (b"/zata.pkl", b"/data.pkl")]:
        at = swapped.index(old, swapped.index(b"PK\x01\x02"))
        swapped[at : at + len(new)] = new
    deeper = _archive([("b/data.pkl", 1), ("data.pkl", 2)])
    for archive in (bytes(swapped), bytes(deeper)):
        assert torch.load(io.BytesIO(archive), weights_only=True) == 2
        assert torch_archive.load_plain(archive) == 2


def test_an_item_of_fewer_dimensions_than_its_metadata_says_is_refused_naming_it(tmp_path):
    """The metadata's entry of a 2-D tensor pointed at the item of a 1-D one: a raw IndexError."""
    path = str(tmp_path / "ckpt")
    _save(path)
    md_path = os.path.join(path, METADATA_FILE)
    with open(md_path, "rb") as f:
        md = pickle.load(f)  # our own test file: plain pickle is fine here
    index = {i.fqn: i for i in md.storage_data}

    def copied(fqn: str):
        """A copy of `fqn`'s item at the end of its file (entries never share bytes)."""
        info = md.storage_data[index[fqn]]
        with open(os.path.join(path, info.relative_path), "r+b") as f:
            f.seek(info.offset)
            item = f.read(info.length)
            end = f.seek(0, os.SEEK_END)
            f.write(item)
        return dataclasses.replace(info, offset=end)

    md.storage_data[index["f32"]] = copied("i64")
    with open(md_path, "wb") as f:
        pickle.dump(md, f)
    file = _item(path, "i64")[0]
    for fast in (True, False):
        with pytest.raises(CorruptCheckpointError, match=rf"{file}: item 'f32' .*does not hold the region \[0, 0\] "
                                                         r"\+ \[64, 33\] .*\(it holds \[100\]\)"):
            _load(path, storage.make_storage_reader(path, fast=fast), storage.make_load_planner())
    md.storage_data[index["f32"]] = copied("u16")  # an item read by torch.load
    with open(md_path, "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(CorruptCheckpointError, match=rf"{file}: item 'f32' .*does not hold the region \[0, 0\] "
                                                     r"\+ \[64, 33\] .*\(it holds \[60\]\)"):
        _load(path, storage.make_storage_reader(path), storage.make_load_planner())


def _record_bytes(item: bytes, name: bytes) -> int:
    """Where the bytes of the record whose local header names `name` start in `item`."""
    header = item.rindex(b"PK\x03\x04", 0, item.index(name))
    nlen, xlen = (int.from_bytes(item[at : at + 2], "little") for at in (header + 26, header + 28))
    return header + 30 + nlen + xlen


@pytest.mark.parametrize("edit, problem", [("version", "maximum supported version"),
                                           ("requires_grad", "floating point and complex dtype can require")])
def test_an_item_torch_load_refuses_is_refused_by_either_engine(tmp_path, edit, problem):
    """A version record of 99, or an int tensor marked as requiring grad: the fast reader read
    neither, and loaded the item that torch.load (and `io_engine = "torch"`, after writing
    other tensors) refuses."""
    path = str(tmp_path / "ckpt")
    _save(path)
    file, offset, length = _item(path, "i64")
    item = _read(file, offset, length)
    if edit == "version":
        at = _record_bytes(item, b"/version")
        assert item[at : at + 2] == b"3\n"
        _patch(file, offset + at, b"99")
    else:
        at = item.index(b"\x89ccollections\nOrderedDict")  # requires_grad (False), then the hooks
        _patch(file, offset + at, b"\x88")
    for fast in (True, False):
        with pytest.raises(CorruptCheckpointError, match=rf"{file}: item 'i64' .*{problem}"):
            _load(path, storage.make_storage_reader(path, fast=fast), storage.make_load_planner())


def test_load_threads_must_be_positive():
    with pytest.raises(ValueError, match="checkpoint.load_threads = 0"):
        load_job_config(None, ["--checkpoint.load_threads", "0"])


# ---------------------------------------------------------------- several ranks


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(name))
    return {"a": torch.randn(12, 10, generator=g), "b": torch.randn(9, 6, generator=g).to(torch.bfloat16),
            "c": torch.arange(7, dtype=torch.int64)}[name]


def _sharded(world_size: int, placements: dict[str, int], zeros: bool) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    out: dict = {}
    for name, dim in placements.items():
        full = torch.zeros_like(_full(name)) if zeros else _full(name)
        out[name] = distribute_tensor(full, mesh, [Shard(dim)])
    return out


def _save_on_ranks(rank: int, world_size: int, path: str) -> None:
    state = {**_sharded(world_size, {"a": 0, "b": 1, "c": 0}, zeros=False), "lr": 0.5, "rep": torch.arange(5.0)}
    dcp.save(state, storage_writer=storage.make_storage_writer(path))


def _load_resharded(rank: int, world_size: int, path: str) -> None:
    """Each tensor sharded on the other dimension than when saved: saved chunks are read
    narrowed on a non-leading dimension ('a') and into non-contiguous destinations ('b')."""
    loaded = []
    for reader, planner in [(storage.make_storage_reader(path, threads=2), storage.make_load_planner()),
                            (FileSystemReader(path), DefaultLoadPlanner())]:
        state = {**_sharded(world_size, {"a": 1, "b": 0, "c": 0}, zeros=True), "lr": None, "rep": torch.zeros(5)}
        dcp.load(state, storage_reader=reader, planner=planner)
        loaded.append(state)
    ours, theirs = loaded
    for name in ("a", "b", "c"):
        assert torch.equal(ours[name].to_local(), theirs[name].to_local()), name
        assert torch.equal(ours[name].full_tensor(), _full(name)), name
    assert ours["lr"] == theirs["lr"] == 0.5
    assert torch.equal(ours["rep"], torch.arange(5.0))


@pytest.mark.multirank
def test_a_checkpoint_of_2_ranks_resharded_on_3_loads_as_dcp_loads_it(tmp_path):
    path = str(tmp_path / "ckpt")
    spawn(2, _save_on_ranks, path)
    spawn(3, _load_resharded, path)


def _fsdp_job(world_size: int, folder: str, seed: int):
    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.example.train import build_model, shard_model

    config = load_job_config(None, ["--checkpoint.enable", "true", "--checkpoint.interval", "1", "--checkpoint.load_threads", "3",
                                    "--training.seed", str(seed)])
    model = build_model(config)
    shard_model(model, world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    return model, opt, CheckpointManager(config.checkpoint, [model], optimizers=opt, base_folder=folder)


def _fsdp_round_trip(rank: int, world_size: int, folder: str) -> None:
    from torchtitan_ckpt.states import ModelState, OptimizerState

    model, opt, manager = _fsdp_job(world_size, folder, seed=0)
    torch.manual_seed(rank)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    with manager:
        manager.save(1)
    if rank == 0:  # each rank's shards written early (while DCP planned); after, the values every rank
        # holds (the optimizer's settings and steps), all by one rank
        use = data_file_use(os.path.join(folder, "checkpoint", "step-1"))
        assert list(use) == ["__0_0.distcp", "__0_1.distcp", *(f"__{r}_0.distcp" for r in range(1, world_size))], use
        assert all(used == size for used, size in use.values()), use
    # ours: the manager's load; DCP's own: its reader and planner, into the same kind of state
    fresh, fresh_opt, fresh_manager = _fsdp_job(world_size, folder, seed=1)
    with fresh_manager:
        assert fresh_manager.load()
    ref, ref_opt, _ = _fsdp_job(world_size, folder, seed=2)
    states = {"optimizer": OptimizerState([ref], [ref_opt])}
    state = {**ModelState([ref]).state_dict(), **states}
    dcp.load(state, storage_reader=FileSystemReader(os.path.join(folder, "checkpoint", "step-1")))
    ModelState([ref]).load_state_dict({k: v for k, v in state.items() if k != "optimizer"})
    for got, want in [(fresh.state_dict(), ref.state_dict()), (fresh.state_dict(), model.state_dict())]:
        for key in want:
            assert torch.equal(got[key].to_local(), want[key].to_local()), key
    for got, want in [(fresh_opt, ref_opt), (fresh_opt, opt)]:
        for p_got, p_want in zip(got.param_groups[0]["params"], want.param_groups[0]["params"]):
            for k, v in want.state[p_want].items():
                g = got.state[p_got][k]
                assert torch.equal(g.to_local() if hasattr(g, "to_local") else g,
                                   v.to_local() if hasattr(v, "to_local") else v), k
        assert got.param_groups[0]["lr"] == want.param_groups[0]["lr"]
    _damaged_rank_fails_every_rank(rank, world_size, folder)


def _damaged_rank_fails_every_rank(rank: int, world_size: int, folder: str) -> None:
    """A record only rank 1 reads is damaged: rank 1 names the file, rank 0 names rank 1."""
    step = os.path.join(folder, "checkpoint", "step-1")
    file = os.path.join(step, "__1_0.distcp")
    dist.barrier()
    if rank == 0:
        metadata = read_metadata(os.path.join(step, METADATA_FILE))
        info = max((s for s in metadata.storage_data.values() if s.relative_path == "__1_0.distcp"),
                   key=lambda s: s.length)  # a tensor shard of rank 1
        _shrink_record(file, info.offset, info.length)
    dist.barrier()
    _, _, manager = _fsdp_job(world_size, folder, seed=3)
    expected = {0: (CheckpointError, rf"failed on rank 1: CorruptCheckpointError: {file}: item"),
                1: (CorruptCheckpointError, rf"{file}: item .* storage record of")}[rank]
    with manager, pytest.raises(expected[0], match=expected[1]):
        manager.load()


@pytest.mark.multirank
def test_an_fsdp_checkpoint_resumes_as_dcp_loads_it_and_a_damaged_shard_fails_every_rank(tmp_path):
    spawn(2, _fsdp_round_trip, str(tmp_path))


def test_the_fill_reads_nearby_tensors_in_one_read_and_skips_what_it_does_not_load(tmp_path, monkeypatch):
    """Tensors a few KB of framing apart are read by one vectored read per run; a tensor not
    loaded that lies between them (more than `_GAP` bytes) starts a new read; the values are
    DCP's own either way."""
    from torchtitan_ckpt.io import posio, reader

    g = torch.Generator().manual_seed(1)
    saved = {f"w{i}": torch.randn(32, 256, generator=g) for i in range(8)}  # 32 KiB each, in key order
    path = str(tmp_path / "step")
    dcp.save(saved, storage_writer=storage.make_storage_writer(path))
    reads: list[int] = []
    real = posio.read_into
    monkeypatch.setattr(reader.posio, "read_into", lambda fd, bufs, at: reads.append(len(bufs)) or real(fd, bufs, at))
    skipped = {"w3", "w4"}  # 64 KiB and their framing between w2 and w5: more than the gap read through
    wanted = {k: torch.zeros_like(v) for k, v in saved.items() if k not in skipped}
    dcp.load(wanted, storage_reader=storage.make_storage_reader(path), planner=storage.make_load_planner())
    assert all(torch.equal(wanted[k], saved[k]) for k in wanted)
    assert reads == [6, 6]  # w0-w2 and w5-w7, each tensor after the framing before it

    reads.clear()  # framing between tensors is bounded per read: a crafted one cannot make it large
    monkeypatch.setattr(reader, "_SCRATCH", 1)
    wanted = {k: torch.zeros_like(v) for k, v in saved.items() if k not in skipped}
    dcp.load(wanted, storage_reader=storage.make_storage_reader(path), planner=storage.make_load_planner())
    assert all(torch.equal(wanted[k], saved[k]) for k in wanted) and reads == [2] * 6


def _evict(path: str) -> None:
    """Drop `path`'s pages from the page cache and wait until none is left (mincore):
    `POSIX_FADV_DONTNEED` skips pages still under I/O, such as a read-ahead of the last load,
    which land in the cache afterwards."""
    libc = ctypes.CDLL(None, use_errno=True)
    page, size = os.sysconf("SC_PAGE_SIZE"), os.path.getsize(path)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # ours: mincore reports the page cache
        start = ctypes.c_char.from_buffer(mapped)
        try:
            held = (ctypes.c_ubyte * (-(-size // page)))()
            for _ in range(2000):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                if libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), held) != 0:
                    raise OSError(ctypes.get_errno(), "mincore")
                if not any(b & 1 for b in held):
                    return
                time.sleep(0.01)
            raise AssertionError(f"{path}: pages stay in the page cache")
        finally:
            del start
            mapped.close()


def _drops_and_tells(path: str) -> bool:
    """Whether a file's pages leave the page cache on `POSIX_FADV_DONTNEED` (not on tmpfs) and
    `preadv(RWF_NOWAIT)` then says so (a file of its own: a missed probe starts read-ahead)."""
    with open(path, "wb") as f:
        f.write(bytes(1 << 16))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)
        return False
    except BlockingIOError:
        return True
    except OSError:  # EOPNOTSUPP
        return False
    finally:
        os.close(fd)


def _saved_where_cold_shows(saved: dict[str, torch.Tensor], tmp_path) -> str:
    """`saved` as a DCP step in `tmp_path`; the test is skipped on a file system that keeps a
    file's pages after `POSIX_FADV_DONTNEED` or cannot tell."""
    path = str(tmp_path / "step")
    dcp.save(saved, storage_writer=storage.make_storage_writer(path))
    if not _drops_and_tells(str(tmp_path / "probe")):
        pytest.skip("this file system keeps a file's pages after POSIX_FADV_DONTNEED, or cannot tell")
    return path


@pytest.mark.skipif(not getattr(os, "RWF_NOWAIT", 0), reason="no preadv(RWF_NOWAIT) to tell a cold page cache")
def test_every_run_of_a_file_out_of_the_page_cache_is_read_as_cold(tmp_path, monkeypatch):
    """A file cut into runs read on several threads: each run is judged cold or cached before
    any run reads (a run's reads spill a few KB into the next run's start, which then looked
    cached and kept the first pass's islands in the page cache, splitting the fill's reads)."""
    from torchtitan_ckpt.io import reader

    g = torch.Generator().manual_seed(2)
    saved = {f"w{i:02d}": torch.randn(16, 256, generator=g) for i in range(48)}  # 16 KiB each
    path = _saved_where_cold_shows(saved, tmp_path)
    judged: list[bool] = []
    events: list[str] = []  # every probe comes before the load's first read of the file
    real, real_init, real_read = reader._Cursor.forget_read, reader._Cursor.__init__, reader.posio.read_bytes
    monkeypatch.setattr(reader._Cursor, "forget_read", lambda self: judged.append(self.cold) or real(self))
    monkeypatch.setattr(reader._Cursor, "__init__", lambda self, *a: real_init(self, *a) or events.append("probe"))
    monkeypatch.setattr(reader.posio, "read_bytes", lambda *a: events.append("read") or real_read(*a))
    for _ in range(3):
        for name in os.listdir(path):
            fd = os.open(os.path.join(path, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            _evict(os.path.join(path, name))
        wanted = {k: torch.zeros_like(v) for k, v in saved.items()}
        dcp.load(wanted, storage_reader=storage.make_storage_reader(path, threads=6), planner=storage.make_load_planner())
        assert all(torch.equal(wanted[k], saved[k]) for k in saved)
        assert events[:6] == ["probe"] * 6 and "probe" not in events[6:], events
        events.clear()
    # Whether a probe finds the page cache cold is the kernel's: the probe as it was (each run's
    # thread probing when it got there) judged 1-4 of these 18 runs warm, usually 3, and so does
    # the probe as it is on a busy machine with a fast disk (a probe that misses starts a
    # read-ahead, which may land before the next run's probe; 2-5 of 18 under load here), 0 on a
    # quiet one. The order above is what the change guarantees, and a load judges some run cold.
    assert len(judged) == 18 and judged.count(True) >= 3, (judged.count(False), judged)


def _resident(path: str, start: int, stop: int) -> bool:
    """Whether every page of bytes [start, stop) of `path` is in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    first, end = start - start % page, -(-stop // page) * page
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), end - first, access=mmap.ACCESS_COPY, offset=first)
        at = ctypes.c_char.from_buffer(mapped)
        try:
            held = (ctypes.c_ubyte * ((end - first) // page))()
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(at)), ctypes.c_size_t(end - first), held) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return all(b & 1 for b in held)
        finally:
            del at
            mapped.close()


@pytest.mark.skipif(not getattr(os, "RWF_NOWAIT", 0), reason="no preadv(RWF_NOWAIT) to tell a cold page cache")
def test_a_cold_run_reads_its_first_tensor_bytes_ahead_before_the_fill(tmp_path, monkeypatch):
    """On a cold cache the check pass asks the kernel for the first `_AHEAD` bytes of each run's
    tensors, so the disk works while the ranks agree; by the time the fill starts they are in
    the page cache, and what lies past them is not (the first pass dropped what it read)."""
    from torchtitan_ckpt.io import reader

    g = torch.Generator().manual_seed(3)
    saved = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(6)}  # 1 MiB each
    path = _saved_where_cold_shows(saved, tmp_path)
    monkeypatch.setattr(reader, "_AHEAD", 1 << 20)
    seen: list[tuple[bool, bool]] = []
    real_fill = reader.ItemReader.fill

    def fill(self, planner):
        (run,) = self._checked
        first, last = run.planned[0], run.planned[-1]
        head = (reader._start(first), reader._start(first) + (1 << 20))
        middle = reader._start(last) + (256 << 10), reader._start(last) + (768 << 10)
        for _ in range(3000):  # the kernel reads it in the background
            if _resident(first.item.cursor.path, *head):
                break
            time.sleep(0.01)
        seen.append((_resident(first.item.cursor.path, *head), _resident(last.item.cursor.path, *middle)))
        return real_fill(self, planner)

    monkeypatch.setattr(reader.ItemReader, "fill", fill)
    (data,) = [name for name in os.listdir(path) if name.endswith(".distcp")]
    os.fsync(fd := os.open(os.path.join(path, data), os.O_RDONLY))
    os.close(fd)
    _evict(os.path.join(path, data))
    wanted = {k: torch.zeros_like(v) for k, v in saved.items()}
    dcp.load(wanted, storage_reader=storage.make_storage_reader(path, threads=1), planner=storage.make_load_planner())
    assert all(torch.equal(wanted[k], saved[k]) for k in saved)
    assert seen == [(True, False)]


_LOAD_UNDER_A_LIMIT = """
import resource, sys, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torchtitan_ckpt import CorruptCheckpointError
from torchtitan_ckpt.dcp import storage
path, soft, hard = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
state = {f"t{i}": torch.full((3,), float(i)) for i in range(150)}
dcp.save(state, storage_writer=FileSystemWriter(path, single_file_per_rank=False))  # a file per tensor
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
blank = {k: torch.zeros(3) for k in state}
try:
    storage.load_on_this_rank(blank, storage.make_storage_reader(path), storage.make_load_planner())
except BaseException as e:  # DCP's CheckpointException is a BaseException
    e = storage.root_cause(e)
    print("corrupt" if isinstance(e, CorruptCheckpointError) else "refused", type(e).__name__, e)
    sys.exit(3)
assert all(torch.equal(blank[k], state[k]) for k in state)
print("soft limit", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _load_under_a_limit(path, soft: int, hard: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _LOAD_UNDER_A_LIMIT, str(path), str(soft), str(hard)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_step_of_more_files_than_the_soft_limit_of_open_files_loads(tmp_path):
    """150 data files against a soft limit of 100 open descriptors (Linux's default is 1024, a
    1-rank load of a 2048-rank step reads 2048 files): the load raises the soft limit toward
    the hard one (they were reported as a corrupt checkpoint, "Too many open files")."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 400:
        pytest.skip(f"this machine's hard limit of open files is {hard}")
    run = _load_under_a_limit(tmp_path / "step", 100, hard)
    assert run.returncode == 0, run.stdout + run.stderr
    assert 200 <= int(run.stdout.split()[-1]) <= 400


def test_a_step_of_more_files_than_the_hard_limit_is_refused_as_this_machine_s_limit(tmp_path):
    run = _load_under_a_limit(tmp_path / "step", 100, 100)
    assert run.returncode == 3, run.stdout + run.stderr
    assert run.stdout.startswith("refused CheckpointError"), run.stdout
    assert "150 files" in run.stdout and "ulimit -Hn" in run.stdout


_SAVE_UNDER_A_LIMIT = """
import resource, sys, torch
from torchtitan_ckpt import CheckpointManager, CheckpointSaveError
from torchtitan_ckpt.config import Checkpoint
folder, soft, hard, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
model = torch.nn.Module()
for i in range(200):
    model.register_buffer(f"b{i}", torch.full((4096,), float(i)))
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
config = Checkpoint(enable=True, interval=1, save_threads=150, async_mode=mode)
try:
    with CheckpointManager(config, [model], base_folder=folder) as manager:
        manager.save(1)
except CheckpointSaveError as e:
    print("refused", e)
    sys.exit(3)
back = torch.nn.Module()
for i in range(200):
    back.register_buffer(f"b{i}", torch.zeros(4096))
with CheckpointManager(Checkpoint(enable=True), [back], base_folder=folder) as manager:
    assert manager.load()
assert all(torch.equal(getattr(back, f"b{i}"), torch.full((4096,), float(i))) for i in range(200))
print("soft limit", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


@pytest.mark.parametrize("mode", ["disabled", "async_with_pinned_mem"])
def test_a_save_of_more_files_than_the_soft_limit_of_open_files_raises_it(tmp_path, mode):
    """150 files a rank holds open at once (each until its fsync ends) against a soft limit of
    100: the save failed, "Too many open files", where a load raises the soft limit; and it
    names checkpoint.save_threads where the hard limit is short too."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 400:
        pytest.skip(f"this machine's hard limit of open files is {hard}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    for soft, limit in [(100, hard), (100, 100)]:
        folder = tmp_path / str(limit)
        run = subprocess.run([sys.executable, "-c", _SAVE_UNDER_A_LIMIT, str(folder), str(soft), str(limit), mode],
                             capture_output=True, text=True, timeout=300, env=env)
        if limit == hard:
            assert run.returncode == 0, run.stdout + run.stderr
            assert int(run.stdout.split()[-1]) > 150
        else:
            assert run.returncode == 3, run.stdout + run.stderr
            assert "the files this rank writes at once are" in run.stdout, run.stdout
            assert "lower checkpoint.save_threads" in run.stdout, run.stdout


def test_lazily_conjugated_and_negated_views_save_what_they_show_and_leave_later_saves_alone(tmp_path):
    """A conjugate or negative view holds other values in its storage than it shows: it is
    saved as what it shows, and the framing of a later plain tensor of the same kind does not
    take its bits (the framing cache keyed them out: every later save of the process loaded
    conjugated, by DCP's reader too)."""
    z = torch.tensor([1 + 2j, 3 - 4j, -5j], dtype=torch.complex64)
    x = torch.tensor([1.5, -2.0, 3.0])
    steps = [({"z": z.conj(), "x": torch._neg_view(x)}, {"z": z.conj(), "x": -x}),
             ({"z": z.clone(), "x": x.clone()}, {"z": z, "x": x})]
    for k, (state, shown) in enumerate(steps):
        path = str(tmp_path / f"step-{k}")
        writer = storage.make_storage_writer(path)
        dcp.save(state, storage_writer=writer, planner=storage.make_save_planner())
        for reader, planner in [(storage.make_storage_reader(path), storage.make_load_planner()),
                                (FileSystemReader(path), DefaultLoadPlanner())]:
            blank = {"z": torch.zeros(3, dtype=torch.complex64), "x": torch.zeros(3)}
            dcp.load(blank, storage_reader=reader, planner=planner)
            assert torch.equal(blank["z"], shown["z"].resolve_conj()), (k, type(reader).__name__, blank["z"])
            assert torch.equal(blank["x"], shown["x"].resolve_neg()), (k, type(reader).__name__, blank["x"])


def test_values_under_keys_that_are_not_text_load_under_those_keys(tmp_path):
    """DCP spells every key of a value's path as text: a value under the number 0 came back under
    "0", beside the 0 the caller's dict holds (DCP's own reader does so still)."""
    saved = {"extra": {0: 1.5, 1: torch.ones(2), 2: {3: "deep", "k": (4, 5)}, "s": None}}
    path = str(tmp_path / "step")
    dcp.save(saved, storage_writer=storage.make_storage_writer(path))
    state = {"extra": {0: None, 1: torch.zeros(2), 2: {3: None, "k": None}, "s": 7}}
    dcp.load(state, storage_reader=storage.make_storage_reader(path), planner=storage.make_load_planner())
    assert state["extra"].keys() == {0, 1, 2, "s"} and state["extra"][2].keys() == {3, "k"}
    assert state["extra"][0] == 1.5 and torch.equal(state["extra"][1], torch.ones(2))
    assert state["extra"][2] == {3: "deep", "k": (4, 5)} and state["extra"]["s"] is None
