"""The data-file writer: DCP's format byte for byte where it matters, checksums, the writer process."""

from __future__ import annotations

import io
import os
import threading
import time
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from torchtitan_ckpt.io import filewriter
from torchtitan_ckpt.dcp import storage
from torchtitan_ckpt.errors import WriterProcessError
from torchtitan_ckpt.io.writer_process import WriterProcess


def _values() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, generator=g)
    return {
        "plain": torch.randn(1000, 37, generator=g),
        "same_kind": torch.randn(1000, 37, generator=g),  # framed like "plain", other bytes
        "view": base[5:17],                      # a slice of a larger storage
        "transposed": base.t(),                  # dense, not contiguous
        "strided": base[:, ::3],                 # neither
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "ints": torch.arange(-50, 50, dtype=torch.int64),
        "bools": torch.rand(77, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "bytes": b"\x00\x01 not a tensor",
    }


def _check_file(path: str, result: filewriter.WrittenFile, values: dict[str, object]) -> None:
    crc = result.durable()
    data = open(path, "rb").read()
    assert (result.size, crc) == (len(data), f"{zlib.crc32(data):08x}")
    end = 0
    for key, offset, length in result.places:
        assert offset == end  # back to back, nothing unaccounted for
        end = offset + length
        expected, raw = values[key], data[offset : offset + length]
        if isinstance(expected, bytes):
            assert raw == expected
        else:
            got = torch.load(io.BytesIO(raw), weights_only=True)
            assert got.dtype == expected.dtype and torch.equal(got, expected), key
            assert got.untyped_storage().nbytes() == got.numel() * got.element_size()  # no whole base
    assert end == len(data)


@pytest.mark.parametrize("batch", [filewriter.BATCH_BYTES, 4096])
def test_each_item_reads_back_with_torch_load(tmp_path, monkeypatch, batch):
    monkeypatch.setattr(filewriter, "BATCH_BYTES", batch)  # small: a system call per buffer
    values = _values()
    job = filewriter.FileJob(str(tmp_path / "f.distcp"), [filewriter.Entry(k, v) for k, v in values.items()])
    result = filewriter.write_file(job)
    _check_file(job.path, result, values)


def test_the_writer_process_writes_the_same_items(tmp_path):
    values = _values()
    shared = {k: (v.clone().share_memory_() if isinstance(v, torch.Tensor) and k == "plain" else v)
              for k, v in values.items()}
    jobs = [filewriter.FileJob(str(tmp_path / f"{i}.distcp"), [filewriter.Entry(k, v) for k, v in part])
            for i, part in enumerate((list(shared.items())[:5], list(shared.items())[5:]))]
    writer = WriterProcess()
    try:
        results = writer(jobs, None, True)
        shared["plain"].mul_(2)  # the same buffer again, new contents: sent by reference only
        again = writer(jobs[:1], None, True)
    finally:
        writer.close()
    _check_file(jobs[1].path, results[1], shared)
    _check_file(jobs[0].path, again[0], shared)


@pytest.mark.parametrize("use_process", [False, True])
def test_plain_dcp_reads_what_the_manager_writes(tmp_path, use_process):
    state = {k: v for k, v in _values().items() if isinstance(v, torch.Tensor)}
    state["nested"] = {"lr": 0.5, "name": "x"}
    writer_process = WriterProcess() if use_process else None
    sink = writer_process or filewriter.write_files
    try:
        w = storage.make_storage_writer(str(tmp_path), sink, files_per_rank=2)
        dcp.save(state, storage_writer=w, planner=storage.make_save_planner(), no_dist=True)
    finally:
        if writer_process:
            writer_process.close()
    checksums = w.fs.durable()
    assert sorted(checksums) == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    for name, (size, crc) in checksums.items():
        data = open(tmp_path / name, "rb").read()
        assert (size, crc) == (len(data), f"{zlib.crc32(data):08x}")
    back = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    back["nested"] = {"lr": 0.0, "name": ""}
    dcp.load(back, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)  # DCP's own reader
    for k, v in state.items():
        assert torch.equal(back[k], v) if isinstance(v, torch.Tensor) else back[k] == v, k


def test_the_writer_process_starts_each_entry_once_its_staging_count_is_reached(tmp_path):
    """`start` returns at once; the writer waits for an entry's copy (a shared count), writes
    what it was handed in order, and a failed staging (count -1) fails only that write."""
    count = torch.zeros(1, dtype=torch.int64).share_memory_()
    data = torch.arange(1024, dtype=torch.float32).share_memory_()
    early = filewriter.FileJob(str(tmp_path / "early.distcp"),
                               [filewriter.Entry("a", data[:512], filewriter.CountWait(count, 1)),
                                filewriter.Entry("b", data[512:], filewriter.CountWait(count, 2))])
    rest = filewriter.FileJob(str(tmp_path / "rest.distcp"), [filewriter.Entry("v", b"xyz")])
    writer = WriterProcess()
    try:
        started = writer.start([early], None, True)
        count.fill_(1)
        time.sleep(0.3)
        assert not started.done.done()  # "b" waits for the second copy
        assert [key for key, _, _ in started.places[0]] == ["a", "b"]  # known before it is written
        count.fill_(2)
        later = writer([rest], None, True)  # handed after: answered after
        assert started.done.done()
        assert started.places[0] == started.done.result()[0].places  # where the writer put them
        _check_file(early.path, started.done.result()[0], {"a": data[:512], "b": data[512:]})
        _check_file(rest.path, later[0], {"v": b"xyz"})

        count.fill_(0)
        failed = writer.start([early], None, True)
        count.fill_(-1)
        with pytest.raises(RuntimeError, match="staging failed"):
            failed.done.result(timeout=30)
        assert writer.alive
        with pytest.raises(TypeError, match="CountWait"):
            writer.start([filewriter.FileJob(early.path, [filewriter.Entry("a", b"x", lambda: None)])])

        count.fill_(0)
        stuck = writer.start([early], None, True)  # waits on a count that never comes
        writer._proc.kill()
        with pytest.raises(WriterProcessError, match="writer process exited"):
            stuck.done.result(timeout=30)
        assert not writer.alive
    finally:
        writer.close()


def test_a_failing_write_in_the_writer_process_is_raised_here(tmp_path):
    job = filewriter.FileJob(str(tmp_path / "missing-dir" / "f.distcp"), [filewriter.Entry("a", b"x")])
    writer = WriterProcess()
    try:
        with pytest.raises(FileNotFoundError, match="missing-dir"):
            writer([job], None, True)
        assert writer.alive  # one failed save does not end the writer
    finally:
        writer.close()
    assert not os.path.exists(job.path)


def test_closing_while_other_threads_ask_for_the_exit_code_stops_the_writer_cleanly(caplog):
    """The replies thread asks for the exit code (to name it in an error) as `close()` waits for
    the writer; threads that reap one child at once made `close()` take a writer that had just
    exited for one that did not stop, log it and kill its process id. Four writers, each closed
    while eight threads ask for its exit code: every one stops with code 0 and nothing is logged."""
    writers = [WriterProcess() for _ in range(4)]
    codes: list[int | None] = []
    try:
        for writer in writers:
            # up first: one still importing torch when closed is killed after `_IDLE_STOP_S` (10 s),
            # which a loaded machine takes (exit code -9), whatever the threads asking do
            assert writer([]) == []
        for writer in writers:
            askers = [threading.Thread(target=lambda w=writer: codes.append(w.exitcode)) for _ in range(8)]
            with caplog.at_level("WARNING", logger="torchtitan_ckpt.io.writer_process"):
                for t in askers:
                    t.start()
                writer.close()
            for t in askers:
                t.join()
            assert writer.exitcode == 0
    finally:  # a writer left running ignores multiprocessing's SIGTERM: pytest's exit would wait for it forever
        for writer in writers:
            writer.close()
    assert not [r.getMessage() for r in caplog.records], "a writer that stopped was reported as not stopping"
    assert len(codes) == 32


def test_files_that_cannot_be_pickled_fail_that_call_only(tmp_path):
    """A key that cannot be pickled is refused before anything reaches the writer: that call
    fails, the writer stays up, and a shared buffer first named by the failed call is handed
    over again by the next (the writer never got it)."""
    shared = torch.arange(1000.0).share_memory_()
    bad = filewriter.FileJob(str(tmp_path / "bad.distcp"),
                             [filewriter.Entry("t", shared), filewriter.Entry(threading.Lock(), b"x")])
    good = filewriter.FileJob(str(tmp_path / "good.distcp"), [filewriter.Entry("t", shared)])
    writer = WriterProcess()
    try:
        with pytest.raises(WriterProcessError, match="cannot be handed to the writer process"):
            writer([bad], None, True)
        assert writer.alive
        (result,) = writer([good], None, True)
    finally:
        writer.close()
    assert not os.path.exists(bad.path)
    _check_file(good.path, result, {"t": shared})


def test_copies_made_for_writing_are_checksummed_early_and_the_crc_stays_right(tmp_path, monkeypatch):
    monkeypatch.setattr(filewriter._BackgroundCrc, "TEMPORARY_BYTES", 1)  # each copy waits for its checksum
    base = torch.randn(40, 8192, generator=torch.Generator().manual_seed(1))
    values = {f"rows{i}": base[i : i + 3] for i in range(0, 36, 3)}  # views of 96 KiB: each written from a copy
    values["plain"] = torch.randn(50)
    job = filewriter.FileJob(str(tmp_path / "f.distcp"), [filewriter.Entry(k, v) for k, v in values.items()])
    _check_file(job.path, filewriter.write_file(job), values)


def _helper_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in ("ckpt-writeback", "ckpt-crc")]


def test_a_files_helper_threads_end_with_it_also_when_writing_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(filewriter, "BATCH_BYTES", 4096)  # many ranges handed to the writeback thread
    values = _values()
    job = filewriter.FileJob(str(tmp_path / "f.distcp"), [filewriter.Entry(k, v) for k, v in values.items()])
    _check_file(job.path, filewriter.write_file(job), values)
    assert not _helper_threads()
    # a tensor that cannot be copied to the CPU fails the file halfway through
    bad = filewriter.FileJob(str(tmp_path / "bad.distcp"),
                             [*job.entries, filewriter.Entry("meta", torch.empty(8, device="meta")[::2])])
    with pytest.raises((RuntimeError, NotImplementedError)):
        filewriter.write_file(bad)
    assert not _helper_threads()


def test_an_entry_is_read_only_once_it_is_ready_and_its_place_is_known_before(tmp_path):
    """A tensor still being staged: `start_files` knows where it lands at once, and writes (and
    checksums) its bytes only after its `ready()`, here the copy that fills it."""
    first, second = torch.zeros(1000), torch.zeros(10, 30)
    filled = threading.Event()
    values = {"first": torch.full((1000,), 7.0), "second": torch.arange(300.0).reshape(10, 30)}

    def fill() -> None:
        filled.wait()
        first.fill_(7.0)
        second.copy_(values["second"])

    path = str(tmp_path / "f.distcp")
    job = filewriter.FileJob(path, [filewriter.Entry("first", first, fill), filewriter.Entry("second", second)])
    started = filewriter.start_files([job])
    assert started.places[0] is not None and [key for key, _, _ in started.places[0]] == ["first", "second"]
    assert not started.done.done()  # waiting for `fill`
    filled.set()
    (written,) = started.done.result()
    assert written.places == started.places[0]
    _check_file(path, written, values)
