"""The save/load suite: ours beside PyTorch's own path beside the raw disk, over state sizes.

For each state size (a Llama-like model with AdamW state, FSDP over 2 gloo ranks on the CPU) and
each of `--repeats` rounds, every rank times (between barriers, so the slowest rank counts):

- raw floor: writing its share of the state's bytes with plain Python + fsync (around the page
  cache where the file system allows: `raw_write`), and reading them back cold; the same for the model weights alone (the floor of the Hugging Face rows);
- a durable save: `CheckpointManager.save` (sync) against `dcp.save` with PyTorch's defaults and
  against `torch_checkpointing`'s synchronous save (the `bench` extra, configured and made durable
  as `benchmarks/peers.py` says; its rows are left out when it is not installed);
- a cold resume: `CheckpointManager.load` into a fresh model + optimizer against `dcp.load` and
  `torch_checkpointing`'s load;
- the Hugging Face format: `save_hf` / `load_hf` (our Llama adapter) against `dcp.save` with
  `HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)` / `dcp.load` with
  `HuggingFaceStorageReader`;
- the peak extra memory of each operation: VmHWM growth over the RSS before it (VmHWM is reset
  through /proc/self/clear_refs), the larger of the two ranks.

"Cold" means the page cache of every file read was dropped just before (fsync, then
`posix_fadvise(POSIX_FADV_DONTNEED)`, which needs no root; /proc/sys/vm/drop_caches is not
writable here).
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from benchmarks import peers
from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.example.model import ModelArgs, Transformer, hf_adapter
from torchtitan_ckpt.hf import load_hf, save_hf
from torchtitan_ckpt.states import ModelState
from torchtitan_ckpt.example.train import shard_model

SIZES_GB = (0.4, 0.8, 1.6, 3.2)
# a Llama-like shape whose size grows by about 0.135 GB (with AdamW state) per layer
_BASE = ModelArgs(dim=1024, n_layers=1, n_heads=16, n_kv_heads=4, vocab_size=4096, multiple_of=256)
_CHUNK = 8 << 20
_ALIGN = 4096

# (row key, what it is, floor it is divided by)
ROWS = [
    ("raw_write", "raw write + fsync (floor)", "raw_write"),
    ("ours_save", "ours: CheckpointManager.save", "raw_write"),
    ("pt_save", "PyTorch: dcp.save (FileSystemWriter defaults)", "raw_write"),
    ("tc_save", "torch_checkpointing: sync save, made durable", "raw_write"),
    ("raw_read", "raw cold read (floor)", "raw_read"),
    ("ours_load", "ours: CheckpointManager.load, cold", "raw_read"),
    ("pt_load", "PyTorch: dcp.load + set_state_dict, cold", "raw_read"),
    ("tc_load", "torch_checkpointing: load, cold", "raw_read"),
    ("raw_write_model", "raw write + fsync, weights only (HF floor)", "raw_write_model"),
    ("ours_hf_save", "ours: save_hf (LlamaAdapter)", "raw_write_model"),
    ("pt_hf_save", "PyTorch: HuggingFaceStorageWriter + consolidation", "raw_write_model"),
    ("raw_read_model", "raw cold read, weights only (HF floor)", "raw_read_model"),
    ("ours_hf_load", "ours: load_hf, cold", "raw_read_model"),
    ("pt_hf_load", "PyTorch: HuggingFaceStorageReader, cold", "raw_read_model"),
]


def model_args(gb: float) -> ModelArgs:
    """The shape whose fp32 weights + two AdamW moments come closest to `gb` GB."""
    b = _BASE
    kv_dim = b.dim // b.n_heads * b.n_kv_heads
    per_layer = 2 * b.dim * b.dim + 2 * b.dim * kv_dim + 3 * b.dim * b.ffn_dim + 2 * b.dim
    rest = 2 * b.vocab_size * b.dim + b.dim
    return replace(b, n_layers=max(1, round((gb * 1e9 / 12 - rest) / per_layer)))


# ---------------------------------------------------------------- measuring


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def drop_cache(folder: str) -> None:
    """Make every file under `folder` cold: fsync (fadvise only drops clean pages), then drop."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_once(paths: list[str]) -> None:
    """Read each file once, through this machine's page cache (the caller drops it after). On a
    virtual disk the host may cache what was read before and not what was written with
    `O_DIRECT`, so a first read can run at a quarter of a later one's speed
    (`docs/performance.md`, "Direct writes"); after this, every cold read of the file finds the
    host's cache in the same state."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(_CHUNK):
                pass


def measure(fn: Callable[[], Any]) -> tuple[float, int]:
    """Seconds from a barrier to the barrier after `fn` (the slowest rank), and this rank's
    peak RSS growth during `fn`."""
    dist.barrier()
    before = _status_bytes("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    secs = time.perf_counter() - t0
    return secs, max(0, _status_bytes("VmHWM") - before)


def clear(path: str, rank: int) -> None:
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


# ---------------------------------------------------------------- the state


def build_state(args: ModelArgs, world: int) -> tuple[Transformer, torch.optim.Optimizer]:
    """A sharded model with AdamW moments (one step on zero gradients: no forward pass needed).
    Built on the meta device and filled shard by shard: 3x faster than a full init on each rank."""
    torch.manual_seed(dist.get_rank())
    with torch.device("meta"):
        model = Transformer(args)
    shard_model(model, world)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            _local(p).uniform_(-0.02, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_tensors(model, opt, weights_only: bool = False) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        out.append(_local(p.detach()))
        if not weights_only:
            st = opt.state[p]
            out += [_local(st["exp_avg"]), _local(st["exp_avg_sq"])]
    return out


# ---------------------------------------------------------------- the raw floor


def raw_write(tensors: list[torch.Tensor], path: str) -> None:
    """Write the tensors' bytes as they lie in memory, fsync: what any save must at least do.
    Around the page cache (`O_DIRECT`: plain Python copies each 8 MiB into one page-aligned
    block and writes it) where the file system allows, as the buffered path costs the kernel
    more CPU than the disk takes time on these machines (`docs/performance.md`); else through it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | os.O_DIRECT)
    except OSError:  # refused by this file system
        with open(path, "wb", buffering=0) as f:
            for t in tensors:
                f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
            os.fsync(f.fileno())
        return
    block = mmap.mmap(-1, _CHUNK)
    view, fill, at = memoryview(block), 0, 0
    try:
        for t in tensors:
            src = memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")
            while len(src):
                n = min(len(src), _CHUNK - fill)
                view[fill : fill + n], src, fill = src[:n], src[n:], fill + n
                if fill == _CHUNK:
                    at, fill = at + os.pwrite(fd, view, at), 0
        if fill:
            padded = -(-fill // _ALIGN) * _ALIGN
            view[fill:padded] = bytes(padded - fill)
            os.pwrite(fd, view[:padded], at)
            os.ftruncate(fd, at + fill)
        os.fsync(fd)
    finally:
        view.release()
        block.close()
        os.close(fd)


def raw_read(path: str) -> None:
    buf = bytearray(_CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def read_ranges(ranges: list[tuple[str, int, int]]) -> None:
    """Read the byte ranges (path, offset, length) with plain `preadv`s into one buffer: each
    file opened once, its ranges in offset order, adjacent ones read as one."""
    buf = memoryview(bytearray(_CHUNK))
    by_file: dict[str, list[tuple[int, int]]] = {}
    for path, offset, n in ranges:
        by_file.setdefault(path, []).append((offset, n))
    for path, spans in sorted(by_file.items()):
        merged: list[list[int]] = []
        for offset, n in sorted(spans):
            if merged and merged[-1][1] == offset:
                merged[-1][1] += n
            else:
                merged.append([offset, offset + n])
        with open(path, "rb", buffering=0) as f:
            for offset, end in merged:
                while offset < end:
                    got = os.preadv(f.fileno(), [buf[:min(_CHUNK, end - offset)]], offset)
                    if not got:
                        raise EOFError(f"{path} ends before byte {end}")
                    offset += got


# ---------------------------------------------------------------- one size, on every rank


class _Paths:
    """Every timed operation of one size, keyed as in ROWS; `pairs` lists
    (save key, load key, folder written, save, load)."""

    def __init__(self, rank: int, world: int, root: str, margs: ModelArgs):
        self.rank, self.root = rank, root
        self.model, self.opt = build_state(margs, world)
        self.fresh_model, self.fresh_opt = build_state(margs, world)
        self.adapter = hf_adapter(margs)
        self.all = local_tensors(self.model, self.opt)
        self.weights = local_tensors(self.model, self.opt, weights_only=True)
        config = load_job_config(None, ["--checkpoint.enable", "true", "--checkpoint.interval", "1",
                                        "--checkpoint.keep_latest_k", "0"])
        base = os.path.join(root, "ours")
        self.saver = CheckpointManager(config.checkpoint, [self.model], optimizers=self.opt, base_folder=base)
        self.loader = CheckpointManager(config.checkpoint, [self.fresh_model], optimizers=self.fresh_opt,
                                        base_folder=base)
        self.step = 0
        raw = os.path.join(root, "raw")
        self.pairs = [
            ("raw_write", "raw_read", raw, lambda: raw_write(self.all, self._raw_file()),
             lambda: raw_read(self._raw_file())),
            ("raw_write_model", "raw_read_model", raw, lambda: raw_write(self.weights, self._raw_file()),
             lambda: raw_read(self._raw_file())),
            ("ours_save", "ours_load", self.saver.folder, self.ours_save, self.loader.load),
            ("pt_save", "pt_load", os.path.join(root, "pt"), self.pt_save, self.pt_load),
            ("ours_hf_save", "ours_hf_load", os.path.join(root, "hf"), self.ours_hf_save, self.ours_hf_load),
            ("pt_hf_save", "pt_hf_load", os.path.join(root, "pt_hf"), self.pt_hf_save, self.pt_hf_load),
        ]
        self.tc = peers.torch_checkpointing_manager(asynchronous=False) if peers.have_torch_checkpointing() else None
        if self.tc is not None:
            self.pairs.append(("tc_save", "tc_load", os.path.join(root, "tc"), self.tc_save, self.tc_load))

    def _raw_file(self) -> str:
        return os.path.join(self.root, "raw", f"rank-{self.rank}")

    def ours_save(self) -> None:
        self.step += 1
        self.saver.save(self.step)

    def pt_save(self) -> None:
        msd, osd = get_state_dict(self.model, self.opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=os.path.join(self.root, "pt"))

    def pt_load(self) -> None:
        msd, osd = get_state_dict(self.fresh_model, self.fresh_opt)
        dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=os.path.join(self.root, "pt"))
        set_state_dict(self.fresh_model, self.fresh_opt, model_state_dict=msd, optim_state_dict=osd)

    def tc_save(self) -> None:
        self.tc.save(os.path.join(self.root, "tc", "step"), peers.payload(self.model, self.opt))

    def tc_load(self) -> None:
        peers.load_into(self.tc, os.path.join(self.root, "tc", "step"), self.fresh_model, self.fresh_opt)

    def ours_hf_save(self) -> None:
        save_hf(get_model_state_dict(self.model), os.path.join(self.root, "hf"), self.adapter)

    def ours_hf_load(self) -> None:
        state = get_model_state_dict(self.fresh_model)
        load_hf(state, os.path.join(self.root, "hf"), self.adapter)
        ModelState([self.fresh_model]).load_state_dict(state)

    def pt_hf_save(self) -> None:
        writer = HuggingFaceStorageWriter(os.path.join(self.root, "pt_hf"), save_distributed=True,
                                          enable_consolidation=True)
        dcp.save(get_model_state_dict(self.model), storage_writer=writer)

    def pt_hf_load(self) -> None:
        state = get_model_state_dict(self.fresh_model)
        dcp.load(state, storage_reader=HuggingFaceStorageReader(os.path.join(self.root, "pt_hf")))
        ModelState([self.fresh_model]).load_state_dict(state)

    def close(self) -> None:
        self.saver.close()
        self.loader.close()
        if self.tc is not None:
            self.tc.close()


def bench_size(rank: int, world: int, args: Any, results: dict) -> None:
    """Every row of ROWS for one state size, `args.repeats` times; rank 0 stores the medians."""
    margs, root, repeats, only = args
    paths = _Paths(rank, world, root, margs)
    samples: dict[str, list[tuple[float, int]]] = {}
    try:
        for r in range(repeats):
            # each round starts with another path, so drift on a shared machine hits every path
            order = paths.pairs[r % len(paths.pairs):] + paths.pairs[:r % len(paths.pairs)]
            for save_key, load_key, folder, save, load in order:
                if only and save_key not in only:
                    continue
                samples.setdefault(save_key, []).append(measure(save))
                dist.barrier()
                drop_cache(folder)
                samples.setdefault(load_key, []).append(measure(load))
                clear(folder, rank)
    finally:
        paths.close()
    state_bytes = sum(t.numel() * t.element_size() for t in paths.all)
    weight_bytes = sum(t.numel() * t.element_size() for t in paths.weights)
    totals = [None] * world
    dist.all_gather_object(totals, (state_bytes, weight_bytes, {k: [m for _, m in v] for k, v in samples.items()}))
    if rank == 0:
        results.update(summarize(samples, totals, margs))


def summarize(samples: dict, totals: list, margs: ModelArgs) -> dict:
    out = {"state_bytes": sum(t[0] for t in totals), "weight_bytes": sum(t[1] for t in totals),
           "n_layers": margs.n_layers, "rows": {}}
    for key, vals in samples.items():
        secs = [s for s, _ in vals]
        peak = max(max(t[2][key]) for t in totals)  # the larger rank's, over repeats
        out["rows"][key] = {"median_s": statistics.median(secs), "min_s": min(secs), "max_s": max(secs),
                            "samples_s": secs, "peak_extra_bytes_per_rank": peak}
    return out
