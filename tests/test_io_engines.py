"""`checkpoint.io_engine`: PyTorch's own FileSystemWriter / FileSystemReader under the same commit
protocol, dedup policy and checksums, and each engine reading what the other wrote."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan_ckpt import Checkpoint, CheckpointManager, commit, layout
from torchtitan_ckpt.dcp import storage
from torchtitan_ckpt.dcp.metadata import METADATA_FILE, read_metadata

from .helpers import assert_same, data_file_use, losses, read_checkpoint, run_job
from .jobs import make_job

ENGINES = ("fast", "torch")
MODES = ("disabled", "async", "async_with_pinned_mem")


def _step(tmp_path, name: str, step: int) -> str:
    return layout.step_dir(os.path.join(tmp_path, name, "checkpoint"), step)


def _read_with(path: str, engine: str) -> dict:
    """Every value of a step, read by one engine (PyTorch's reader through our safe planner)."""
    metadata = read_metadata(os.path.join(path, METADATA_FILE))
    state = read_checkpoint(path)  # the keys and destinations
    for value in state.values():
        if isinstance(value, torch.Tensor):
            value.zero_()
    reader = storage.make_storage_reader(path, metadata, threads=2, fast=engine == "fast")
    dcp.load(state, storage_reader=reader, planner=storage.make_load_planner(), no_dist=True)
    return state


@pytest.mark.parametrize("mode", MODES)
def test_torch_engine_saves_what_the_fast_engine_saves_and_each_reads_the_other(tmp_path, mode):
    runs = {}
    for engine in ENGINES:
        job = make_job(str(tmp_path / engine), steps=4, interval=2, keep_latest_k=0, last_save_model_only=False,
                       io_engine=engine, async_mode=mode if engine == "torch" else "disabled")
        job.run_to(4, steps=4)
        job.manager.close()
        runs[engine] = _step(tmp_path, engine, 4)
    # PyTorch's writer: one file per rank; ours: the tensors written while DCP plans, then the rest
    assert sorted(data_file_use(runs["torch"])) == ["__0_0.distcp"]
    assert sorted(data_file_use(runs["fast"])) == ["__0_0.distcp", "__0_1.distcp"]
    assert commit.verify(runs["torch"]) == []  # every file's CRC-32 is in the marker and matches
    assert commit.read_marker(runs["torch"]).states == commit.read_marker(runs["fast"]).states
    expected = read_checkpoint(runs["fast"])
    for written in ENGINES:
        for reading in ENGINES:
            assert_same(_read_with(runs[written], reading), expected)


def test_torch_engine_resume_restores_every_state(tmp_path):
    job = make_job(str(tmp_path), steps=8, interval=2, io_engine="torch")
    job.run_to(4, steps=8)
    job.manager.close()
    later = [job.step() for _ in range(2)]
    fresh = make_job(str(tmp_path), steps=8, interval=2, init_seed=123, io_engine="torch")
    assert fresh.manager.load()
    assert (fresh.train_state.step, fresh.sched.last_epoch) == (4, 4)
    assert [fresh.step() for _ in range(2)] == later


@pytest.mark.multirank
def test_two_ranks_switch_engines_mid_run_and_resume_bit_identically(tmp_path):
    """2 ranks (FSDP): the first half saved by PyTorch's engine, the second loaded and saved by
    ours, against an uninterrupted run with PyTorch's engine."""
    full = ("--checkpoint.last_save_model_only", "false", "--checkpoint.keep_latest_k", "0")
    straight = run_job(str(tmp_path / "straight"), *full, "--checkpoint.io_engine", "torch", nproc=2)
    run_job(str(tmp_path / "mixed"), *full, "--checkpoint.io_engine", "torch", "--training.stop_at_step", "10",
            nproc=2)
    second = run_job(str(tmp_path / "mixed"), *full, "--checkpoint.io_engine", "fast", nproc=2)
    assert sorted(losses(second)) == list(range(11, 21))
    assert losses(second) == {s: loss for s, loss in losses(straight).items() if s > 10}
    assert_same(read_checkpoint(_step(tmp_path, "straight", 20)), read_checkpoint(_step(tmp_path, "mixed", 20)))
    assert commit.verify(_step(tmp_path, "mixed", 10)) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_a_step_removed_after_its_check_is_read_as_checked(tmp_path, engine):
    """A job saving into the folder may remove the step another job reads (retention), between
    the check pass and the reads: each engine reads the files the check opened, not their names
    (PyTorch's opened them again and failed half-way, a `PartialLoadError`)."""
    job = make_job(str(tmp_path), steps=2, interval=2, keep_latest_k=0, io_engine=engine)
    job.run_to(2, steps=2)
    job.manager.close()
    path = _step(tmp_path, "", 2)
    expected = read_checkpoint(path)
    state = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in expected.items()}

    def then_removed(checks):
        checks()
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))

    reader = storage.make_storage_reader(path, read_metadata(os.path.join(path, METADATA_FILE)),
                                         fast=engine == "fast", agree=then_removed)
    dcp.load(state, storage_reader=reader, planner=storage.make_load_planner(), no_dist=True)
    assert os.listdir(path) == []
    assert_same(state, expected)


def _one_element_views() -> dict[str, torch.Tensor]:
    """Tensors of one element whose stride is not 1, contiguous as torch counts (a dimension of
    size 1 may have any stride), as slices and columns of larger tensors give them."""
    return {"sliced": torch.zeros(2)[::2], "column": torch.zeros(6).as_strided((1, 1), (5, 3), 1)}


@pytest.mark.parametrize("engine", ENGINES)
def test_one_element_tensors_of_any_stride_save_and_load(tmp_path, engine):
    """The fast engine read into such a tensor through a byte view, which torch refuses for a
    stride that is not 1 ("self.stride(-1) must be 1"): a PartialLoadError, and saves refused
    after it. PyTorch's reader fills them."""
    def part(values: dict[str, torch.Tensor]) -> torch.nn.Module:
        m = torch.nn.Module()
        for name, value in values.items():
            m.register_buffer(name, value)
        return m

    saved = part({name: t.fill_(2.5 + i) for i, (name, t) in enumerate(_one_element_views().items())})
    config = Checkpoint(enable=True, interval=1, io_engine=engine)
    with CheckpointManager(config, [saved], base_folder=str(tmp_path)) as manager:
        manager.save(1)
    loaded = part(_one_element_views())
    with CheckpointManager(config, [loaded], base_folder=str(tmp_path)) as manager:
        assert manager.load()
        assert manager.save(2, force=True)
    assert_same(dict(loaded.named_buffers()), dict(saved.named_buffers()))
    assert loaded.sliced.stride() == (2,) and loaded.column.stride() == (5, 3)  # filled in place
