"""Shared test helpers: read a checkpoint back, spawn real gloo ranks, run the example job."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pathlib
import re
import signal
import subprocess
import sys
import shutil
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan_ckpt import commit
from torchtitan_ckpt.dcp import storage
from torchtitan_ckpt.dcp.metadata import METADATA_FILE, read_metadata
from torchtitan_ckpt.hf import shards
from torchtitan_ckpt.hf.load import read_hf_layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_CONFIG = os.path.join(ROOT, "configs", "debug_model.toml")


@contextlib.contextmanager
def within(seconds: int):
    """Fail instead of hanging: a blocked `open()` or a runaway loop is interrupted (SIGALRM, so
    in the main thread) and the test fails."""
    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def read_checkpoint(path: str) -> dict[str, Any]:
    """Every tensor and object of a DCP folder, read in this (non-distributed) process."""
    metadata = read_metadata(os.path.join(path, METADATA_FILE))
    state: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        state[key] = torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
    dcp.load(state, storage_reader=storage.make_storage_reader(path), planner=storage.make_load_planner())
    return state


def data_file_use(path: str) -> dict[str, tuple[int, int]]:
    """Each data file of a DCP step: (bytes its items take by the metadata, bytes on disk)."""
    used = {f: 0 for f in os.listdir(path) if f.endswith(".distcp")}
    for info in dcp.FileSystemReader(path).read_metadata().storage_data.values():
        used[info.relative_path] += info.length
    return {f: (n, os.path.getsize(os.path.join(path, f))) for f, n in sorted(used.items())}


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Exactly equal: same keys, tensors equal bit for bit (dtype included), objects equal."""
    assert sorted(a) == sorted(b)
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, key
            assert torch.equal(x, y), f"{key} differs"
        else:
            assert x == y, f"{key}: {x!r} != {y!r}"


# The functions ATen hands to oneMKL's vector math (aten/src/ATen/cpu/vml.h), each in float32 and
# float64. oneMKL 2024.2 (torch 2.13's wheel) picks each one's kernel at its first call, and a first
# call made by several threads at once may run one thread's share with a low-accuracy kernel
# (pytorch/pytorch#188792): two processes of one test could then train to other bits.
_VECTOR_MATH = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10",
                "log2", "sin", "sqrt", "tan", "tanh", "trunc")


def settle_vector_math() -> None:
    """Make each vector-math function's first call in this process, on one element (one thread),
    so that no later call can be a first call made on several threads: the warm-up of the fix
    proposed upstream (pytorch/pytorch#188791). Called at the start of every test process."""
    for dtype in (torch.float32, torch.float64):
        one = torch.full((1,), 0.5, dtype=dtype)
        for name in _VECTOR_MATH:
            getattr(torch, name)(one)


def _rank_main(rank: int, world_size: int, init_file: str, fn, args) -> None:
    faulthandler.enable()  # a crash in C++ (gloo) prints where Python was
    settle_vector_math()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    # A rank that fails leaves its group to its process's exit, which comes after `spawn` has
    # its error: destroyed at once, it failed the other ranks' barrier first, and `spawn` could
    # report theirs ("Connection closed by peer") in its place.
    fn(rank, world_size, *args)
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()
    # The rank's work is done and checked: leave without the interpreter's teardown. Now and
    # then (2 of about 20 full runs) a rank aborted with "terminate called without an active
    # exception" and no Python error; gloo's C++ threads releasing Python-owned tensors during
    # interpreter finalization abort that way (pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class TensorState:
    """A user state of one tensor (`value`), loaded in place."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.value.copy_(sd["value"])


def fail_reads_after_fill() -> None:
    """Make this rank process's checkpoint reads fail as a disk does (EIO), once the rank's
    tensors are filled: a load that fails after it began writing them in place."""
    import errno

    from torchtitan_ckpt.io import reader

    real = reader.ItemReader.fill

    def failing(self, planner):
        real(self, planner)
        raise OSError(errno.EIO, "Input/output error")

    reader.ItemReader.fill = failing


def syscalls(monkeypatch) -> list[tuple[str, str]]:
    """The file system calls of this process, in order, as (call, path; a rename's new path): the
    calls go through to the file system; fsync's descriptor is named by the path it has open."""
    calls: list[tuple[str, str]] = []

    def recorded(name: str, real):
        def call(*args, **kwargs):
            if name == "fsync":
                fd = args[0] if isinstance(args[0], int) else args[0].fileno()
                calls.append((name, os.readlink(f"/proc/self/fd/{fd}")))
            else:
                calls.append((name, os.fspath(args[1] if name in ("rename", "replace") else args[0])))
            return real(*args, **kwargs)
        return call

    for name in ("fsync", "mkdir", "replace", "rename", "remove", "unlink"):
        monkeypatch.setattr(os, name, recorded(name, getattr(os, name)))
    return calls


def stay_until(path: str, limit_s: float = 120) -> None:
    """Keep this rank (and its groups) alive until another rank creates `path`: a rank that
    never joins a collective must not leave before the others time out, or they fail on its
    closed connections instead."""
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} was never created"
        time.sleep(0.05)


@contextlib.contextmanager
def then_release(path: str):
    """Create `path` when the block ends, however it ends (for `stay_until`)."""
    try:
        yield
    finally:
        open(path, "w").close()


def forged_whole(step: str) -> None:
    """Write the commit marker of the step folder `step` again over its files as they are now:
    a crafted step whose manifest agrees with its files, which nothing short of reading them
    tells from a whole one."""
    commit.write_marker(step, commit.read_marker(step))


def spawn(world_size: int, fn, *args) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` real processes joined by gloo.
    An exception on any rank fails the caller with that rank's traceback."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(world_size, os.path.join(tmp, "rdzv"), fn, args),
                 nprocs=world_size, join=True)


def run_job(dump_folder: str, *overrides: str, nproc: int = 1, config: str = DEBUG_CONFIG,
            env: dict[str, str] | None = None, expect_ok: bool = True) -> str:
    """Run the example job (under torchrun when nproc > 1); return its log. Fails unless it exits
    0 (or, with `expect_ok=False`, unless it fails)."""
    job = ["-m", "torchtitan_ckpt.example.train", "--config", config, "--job.dump_folder", dump_folder, *overrides]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    proc = subprocess.run([sys.executable, *launcher, *job], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    log = proc.stdout + proc.stderr
    crash = log.find("Fatal Python error")  # a rank's crash in C++, which the ranks' tracebacks bury
    shown = (log[crash:crash + 3000] + "\n[...]\n" if crash >= 0 else "") + log[-4000:]
    assert (proc.returncode == 0) == expect_ok, shown
    return log


def losses(log: str) -> dict[int, str]:
    """Step -> the exact loss the job logged (repr of the float)."""
    return {int(s): loss for s, loss in re.findall(r"step (\d+) loss (\S+)", log)}


class RecordedReads:
    """The (file, offset, bytes) of every read `load_hf` makes on this rank."""

    def __init__(self):
        self.reads: list[tuple[str, int, int]] = []
        self.real = shards.read_exact

    def __enter__(self):
        def recording(fd, bufs, offset, path):
            self.reads.append((path, offset, sum(len(b) for b in bufs)))
            self.real(fd, bufs, offset, path)

        shards.read_exact = recording
        return self

    def __exit__(self, *exc):
        shards.read_exact = self.real

    def tensors(self, src: str) -> set[str]:
        """The HF tensors whose bytes the reads touched."""
        return {name for name, e in read_hf_layout(src).items() for path, offset, n in self.reads
                if path == e.path and offset < e.offset + e.nbytes and e.offset < offset + n}


def perturbed(model: torch.nn.Module, scale: float = 0.05) -> torch.nn.Module:
    """`model` with random noise added to every parameter (so norms and routers are not their
    constant init, and a mix-up of two tensors shows in the logits)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of ours (a tensor) or of a `transformers` model (an output with `.logits`)."""
    with torch.no_grad():
        out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def hub_snapshot(src: str, repo: pathlib.Path) -> pathlib.Path:
    """The files of the folder `src` as the Hugging Face hub's cache holds a download of them:
    `<repo>/snapshots/<revision>/<name>`, each a relative link to a copy in `<repo>/blobs`."""
    snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for name in os.listdir(src):
        shutil.copyfile(os.path.join(src, name), blobs / f"blob-{name}")
        (snapshot / name).symlink_to(os.path.join("..", "..", "blobs", f"blob-{name}"))
    return snapshot


class Holder:
    """A state whose `state_dict()` is the value it holds, whatever that is."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return self.value

    def load_state_dict(self, state_dict):
        self.value = state_dict
