"""Storage settings tried on one state size, to see which would close the gap to the raw floor.

The writers and readers are built here, not in `torchtitan_ckpt.dcp.storage` (nothing in the library
changes): PyTorch's `FileSystemWriter` with other `thread_count`s, with and without fsync; our
checksumming writer with more threads; PyTorch's `FileSystemReader` (which has no thread knob in
torch 2.13) split over a thread pool; `HuggingFaceStorageReader(thread_count=N)`. Each variant is
a save then a cold load of the same full state (model + AdamW), median of `--repeats`.

    python -m benchmarks --experiments --sizes 0.8 --repeats 3
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    FileSystemReader,
    FileSystemWriter,
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
from torch.futures import Future

from benchmarks.common import run_ranks
from benchmarks.suite import build_state, clear, drop_cache, local_tensors, measure, model_args, raw_read, raw_write
from torchtitan_ckpt.dcp.storage import ChecksummingFileSystem, make_load_planner, make_storage_reader

EXPERIMENT_GB = 0.8


class ThreadedReader(FileSystemReader):
    """PyTorch's reader, with a plan's items split into `threads` contiguous runs of about equal
    bytes, each read by its own thread through its own file handle."""

    def __init__(self, path: str, threads: int):
        super().__init__(path)
        self.threads = threads

    def read_data(self, plan, planner) -> Future:
        info = self.storage_data
        items = sorted(plan.items, key=lambda r: (info[r.storage_index].relative_path, info[r.storage_index].offset))
        total = sum(info[r.storage_index].length for r in items) or 1
        groups: list[list] = [[] for _ in range(self.threads)]
        done = 0
        for r in items:
            groups[min(self.threads - 1, done * self.threads // total)].append(r)
            done += info[r.storage_index].length
        read = super().read_data
        with ThreadPoolExecutor(self.threads) as pool:
            for fut in [pool.submit(read, dataclasses.replace(plan, items=g), planner) for g in groups if g]:
                fut.result().wait()
        fut: Future = Future()
        fut.set_result(None)
        return fut


def _ours_writer(path: str, threads: int) -> FileSystemWriter:
    writer = FileSystemWriter(path, sync_files=True, single_file_per_rank=True, thread_count=threads)
    writer.fs = ChecksummingFileSystem(path)
    return writer


# name -> (storage writer factory, storage reader factory, load planner factory)
SAVE_VARIANTS = {
    "FileSystemWriter defaults (thread_count=1, fsync)": lambda p: FileSystemWriter(p),
    "FileSystemWriter thread_count=2": lambda p: FileSystemWriter(p, thread_count=2),
    "FileSystemWriter thread_count=4": lambda p: FileSystemWriter(p, thread_count=4),
    "FileSystemWriter sync_files=False (not durable)": lambda p: FileSystemWriter(p, sync_files=False),
    "ours: make_storage_writer (CRC-32, thread_count=1)": lambda p: _ours_writer(p, 1),
    "ours + thread_count=2": lambda p: _ours_writer(p, 2),
}
LOAD_VARIANTS = {
    "FileSystemReader + DefaultLoadPlanner": (lambda p: FileSystemReader(p), DefaultLoadPlanner),
    "ours: make_storage_reader + make_load_planner": (make_storage_reader, make_load_planner),
    "FileSystemReader split over 2 threads": (lambda p: ThreadedReader(p, 2), DefaultLoadPlanner),
    "FileSystemReader split over 4 threads": (lambda p: ThreadedReader(p, 4), DefaultLoadPlanner),
}
HF_THREADS = (1, 2, 4)


def _bench(rank: int, world: int, args: Any, results: dict) -> None:
    margs, root, repeats = args
    model, opt = build_state(margs, world)
    fresh_model, fresh_opt = build_state(margs, world)
    times: dict[str, list[float]] = {}

    def record(name: str, fn) -> None:
        times.setdefault(name, []).append(measure(fn)[0])

    raw = os.path.join(root, "raw", f"rank-{rank}")
    for _ in range(repeats):
        record("raw write + fsync (floor)", lambda: raw_write(local_tensors(model, opt), raw))
        drop_cache(os.path.dirname(raw))
        record("raw cold read (floor)", lambda: raw_read(raw))
        raw_write(local_tensors(model, opt, weights_only=True), raw)
        drop_cache(os.path.dirname(raw))
        record("raw cold read, weights only (HF floor)", lambda: raw_read(raw))
        path = os.path.join(root, "dcp")
        for name, make_writer in SAVE_VARIANTS.items():
            state = dict(zip(("model", "optimizer"), get_state_dict(model, opt)))
            record("save: " + name, lambda: dcp.save(state, storage_writer=make_writer(path)))
            clear(path, rank)
        state = dict(zip(("model", "optimizer"), get_state_dict(model, opt)))
        dcp.save(state, storage_writer=_ours_writer(path, 1))
        for name, (make_reader, make_planner) in LOAD_VARIANTS.items():
            target = dict(zip(("model", "optimizer"), get_state_dict(fresh_model, fresh_opt)))
            drop_cache(path)
            record("cold load: " + name, lambda: dcp.load(target, storage_reader=make_reader(path),
                                                          planner=make_planner()))
        clear(path, rank)
        _hf(rank, model, fresh_model, os.path.join(root, "hf"), record)
    if rank == 0:
        results["_state_gb"] = round(world * sum(t.numel() * t.element_size() for t in local_tensors(model, opt)) / 1e9, 2)
        results.update({k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)}
                        for k, v in times.items()})


def _hf(rank, model, fresh_model, path, record) -> None:
    dcp.save(get_model_state_dict(model), storage_writer=HuggingFaceStorageWriter(path, save_distributed=True,
                                                                                  enable_consolidation=True))
    for n in HF_THREADS:
        target = get_model_state_dict(fresh_model)
        drop_cache(path)
        record(f"cold HF load: HuggingFaceStorageReader(thread_count={n})",
               lambda: dcp.load(target, storage_reader=HuggingFaceStorageReader(path, thread_count=n)))
    clear(path, rank)


def run_experiments(args) -> dict:
    margs = model_args(EXPERIMENT_GB)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        out = dict(run_ranks(2, _bench, (margs, tmp, args.repeats), tmp))
    print(experiments_table(out), flush=True)
    return out


def experiments_table(r: dict) -> str:
    save_floor = r["raw write + fsync (floor)"]["median_s"]
    read_floor = r["raw cold read (floor)"]["median_s"]
    hf_floor = r["raw cold read, weights only (HF floor)"]["median_s"]
    lines = [f"State: about {r['_state_gb']} GB (model + AdamW, as `get_state_dict` gives it: every variant "
             "writes and reads the same items), 2 ranks; median (min-max) of the repeats.\n",
             "| variant | median | min-max | x raw floor |", "|---|---|---|---|"]
    for name, row in r.items():
        if name.startswith("_"):
            continue
        floor = save_floor if ("save" in name or "write" in name) else read_floor
        floor = hf_floor if "HF" in name else floor
        lines.append(f"| {name} | {row['median_s']:.2f} s | {row['min_s']:.2f}-{row['max_s']:.2f} s | "
                     f"{row['median_s'] / floor:.2f}x |")
    return "\n".join(lines)
