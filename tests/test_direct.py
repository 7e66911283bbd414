"""Data files written around the page cache (`O_DIRECT`): the same bytes and checksum as the
buffered path, really not through the page cache, from every sink and async mode, and the
fallbacks where a direct write is refused."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import glob
import mmap
import os
import resource
import signal
import threading

import pytest
import torch

from torchtitan_ckpt import CheckpointManager, layout
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.io import direct, filewriter
from torchtitan_ckpt.io.writer_process import WriterProcess

from .helpers import assert_same, read_checkpoint
from .test_filewriter import _check_file, _values


def _resident(path: str) -> int:
    """Pages of `path` in the page cache (mincore over a private map: no page is faulted in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    page = os.sysconf("SC_PAGE_SIZE")
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        start = ctypes.c_char.from_buffer(mapped)
        try:
            held = (ctypes.c_ubyte * (-(-size // page)))()
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), held) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return sum(b & 1 for b in held)
        finally:
            del start
            mapped.close()


def _accepts_direct(folder) -> bool:
    fd = direct.open_direct(os.path.join(folder, "probe"))
    if fd is None:
        return False
    os.close(fd)
    os.unlink(os.path.join(folder, "probe"))
    return True


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 8 KiB: items span blocks."""
    monkeypatch.setattr(direct, "BLOCK_BYTES", 8192)
    monkeypatch.setattr(direct, "_pool", [])


@pytest.mark.parametrize("blocks", ["small", "default"])
def test_a_direct_file_holds_the_buffered_files_bytes(tmp_path, request, blocks):
    if blocks == "small":
        request.getfixturevalue("small_blocks")
    if not _accepts_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    values = _values()
    values["big"] = torch.randn(3 * direct.BLOCK_BYTES // 4 + 11)  # several blocks, and a partial last one
    paths = {}
    for how in (True, False):
        job = filewriter.FileJob(str(tmp_path / f"{how}.distcp"),
                                 [filewriter.Entry(k, v) for k, v in values.items()], direct=how)
        result = filewriter.write_file(job)
        _check_file(job.path, result, values)  # size, CRC-32, each item by torch.load
        paths[how] = job.path
    assert os.path.getsize(paths[True]) % direct.ALIGN  # the padding was cut off
    assert open(paths[True], "rb").read() == open(paths[False], "rb").read()


def test_direct_writes_leave_nothing_in_the_page_cache(tmp_path):
    if not _accepts_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    values = {"t": torch.randn(4 << 20)}  # 16 MiB
    pages = {}
    for how in (True, False):
        job = filewriter.FileJob(str(tmp_path / f"{how}.distcp"), [filewriter.Entry("t", values["t"])], direct=how)
        filewriter.write_file(job).durable()
        pages[how] = _resident(job.path)
    # the last, partial page goes through the page cache when the padding is cut off
    assert pages[True] <= 1 and pages[False] >= 4096, pages


def test_a_direct_write_the_kernel_refuses_goes_through_the_page_cache(tmp_path):
    """A write from memory that is not aligned is refused (EINVAL) on a direct descriptor: the
    flag is cleared and the same bytes are written, buffered."""
    path = str(tmp_path / "f")
    fd = direct.open_direct(path)
    if fd is None:
        pytest.skip("this file system refuses O_DIRECT")
    data = bytearray(os.urandom(3 * direct.ALIGN + 1))
    try:
        direct._pwrite(fd, memoryview(data)[1:], 0)  # noqa: SLF001 - the fallback under test
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    finally:
        os.close(fd)
    assert open(path, "rb").read() == data[1:]


def test_the_writer_process_writes_direct_files(tmp_path):
    if not _accepts_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    values = {"t": torch.randn(4 << 20).share_memory_(), "v": b"value"}
    job = filewriter.FileJob(str(tmp_path / "f.distcp"), [filewriter.Entry(k, v) for k, v in values.items()],
                             direct=True)
    writer = WriterProcess()
    try:
        (result,) = writer([job], None, True)
    finally:
        writer.close()
    assert _resident(job.path) <= 1
    _check_file(job.path, result, values)


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
@pytest.mark.parametrize("direct_io", [True, False])
def test_the_manager_writes_direct_files_unless_told_not_to(tmp_path, mode, direct_io):
    if not _accepts_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    model = torch.nn.Linear(1024, 1024)
    config = Checkpoint(enable=True, interval=1, async_mode=mode, keep_latest_k=0, direct_io=direct_io)
    with CheckpointManager(config, [model], base_folder=str(tmp_path)) as manager:
        manager.save(1)
        manager.wait()
        kept = len(direct._pool)
    assert (kept > 0) == (direct_io and mode != "async_with_pinned_mem"), kept  # the writer process has its own
    assert direct._pool == []  # close() unmapped the blocks kept for a next save (they were kept until exit)
    files = glob.glob(os.path.join(layout.step_dir(str(tmp_path / "checkpoint"), 1), "*.distcp"))
    assert files and sum(os.path.getsize(f) for f in files) > 4 << 20
    resident = sum(_resident(f) for f in files)
    assert (resident <= len(files)) if direct_io else (resident >= 1024), resident
    saved = read_checkpoint(layout.step_dir(str(tmp_path / "checkpoint"), 1))
    assert_same({k: saved[k] for k in model.state_dict()}, model.state_dict())


def test_a_failed_direct_write_raises_its_own_error_and_leaves_the_pool_usable(tmp_path, monkeypatch):
    """A write the kernel fails (here past `RLIMIT_FSIZE`: EFBIG) is the error raised, with every
    block handed back and closable (none still viewed by the error), and the next file is written
    from the same pool."""
    if not _accepts_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    full = direct._IDLE_BLOCKS + direct.BLOCKS_PER_FILE  # still full once the file took its blocks
    monkeypatch.setattr(direct, "_pool", [mmap.mmap(-1, direct.BLOCK_BYTES) for _ in range(full)])
    values = {"t": torch.randn(8 << 20)}  # 32 MiB
    job = filewriter.FileJob(str(tmp_path / "f.distcp"), [filewriter.Entry("t", values["t"])], direct=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (12 << 20, hard))
    try:
        with pytest.raises(OSError) as raised:
            filewriter.write_file(job).durable()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert raised.value.errno == errno.EFBIG
    assert not [t for t in threading.enumerate() if t.name == "ckpt-direct"]
    again = filewriter.FileJob(str(tmp_path / "g.distcp"), [filewriter.Entry("t", values["t"])], direct=True)
    _check_file(again.path, filewriter.write_file(again), values)


def test_a_process_forked_while_another_thread_takes_a_block_can_take_blocks():
    """A data loader's worker forked while a background save's thread holds the pool's lock: the
    child has no such thread, so with the parent's lock it would wait for ever on its first block;
    and the parent's idle blocks are not the child's to hand out."""
    direct._give_block(direct._take_block())  # one idle block in the pool
    with direct._pool_lock:  # as the writing thread holds it at the fork
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status, never return into pytest
            signal.alarm(10)  # a wait for ever ends the child, and the test with it
            ok = not direct._pool
            block = direct._take_block()
            direct._give_block(block)
            os._exit(0 if ok and direct._pool == [block] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
