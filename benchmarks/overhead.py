"""The checkpoint's cost to training: the same training run with no checkpointing and with a save
every `--every` steps through each path, side by side.

    python -m benchmarks.overhead [--ranks 2] [--flavor bench] [--saves 3] [--every 4] [--dir /tmp/bench]
                                  [--paths none,disabled,async,async_with_pinned_mem,torch_checkpointing,dcp]

The example model (flavor `bench`: ~128M parameters, ~1.5 GB with AdamW state), FSDP-sharded over
gloo ranks on the CPU, trains `(saves + 1) * every` steps after a warm-up save (writer processes
and buffers are made once per job); the run with no checkpointing is timed
before and after the others and its mean is the baseline. Paths:

- ours: `async_mode` `disabled`, `async`, `async_with_pinned_mem` (the optimizer's step waits for
  staging through the manager's step pre-hook: the loop calls nothing extra);
- `torch_checkpointing` (the `bench` extra; skipped when it is not installed): its async manager
  configured as its docs say for a CPU-only host (no pinned memory, no non-blocking copies),
  direct I/O off (ext4 refuses it), made durable by its pre-finalize callback (fsync of every
  file and folder: it never fsyncs) and the finalize callback (the folder holding the renamed
  step); the optimizer's step runs under `manager.lock()` as its docs say;
- `dcp`: PyTorch's `dcp.async_save` in its process mode with its `DefaultStager` (shared memory,
  staging in the background, pinned only where there is a GPU); the optimizer's step waits for
  `staging_completion`.

Per path it prints, per save: the training time lost (the run's time over the baseline's,
divided by the saves, and as % of the baseline run), how long `save()` blocked, the time from
`save()` until the step is durable (ours: the commit marker's time; the peers: their write
future), each against a synchronous save of the same state (ours, `disabled`: `save()` returns
once durable), and the most resident memory a rank held beyond the baseline. Absolute times on a
shared machine are noise; read the ratios, from one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import run_ranks
from torchtitan_ckpt import CheckpointManager, commit, layout
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.example.train import build_model, shard_model

OURS = ["disabled", "async", "async_with_pinned_mem"]
PATHS = ["none", *OURS, "torch_checkpointing", "dcp"]


@dataclass
class Run:
    """One path's training run, as rank 0 saw it (times of every rank's slowest, by barriers)."""

    seconds: float = 0.0
    blocks: list[float] = field(default_factory=list)
    durable: list[float] = field(default_factory=list)
    extra_rss: int = 0


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _timed(step: int, args) -> bool:
    """Whether `step` is one of the run's timed saves (step `every` is each path's warm-up save:
    writer processes, buffers and plans are made once per job)."""
    return step % args.every == 0 and args.every < step <= args.every * (args.saves + 1)


def _train(model, opt, tokens, args, save: Callable[[int, float], bool], step_guard) -> Run:
    """The timed steps (after the warm-up save's), `save(step)` after each; the optimizer's step runs under
    `step_guard()` (what a path asks a loop to do before changing the state it stages);
    `save(step, wall-clock time)` says whether it saved."""
    run, start_rss = Run(), _rss()
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(args.every + 1, args.every * (args.saves + 2) + 1):
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        with step_guard():
            opt.step()
        opt.zero_grad()
        before = time.perf_counter()
        wall = time.time()
        if save(step, wall):
            run.blocks.append(time.perf_counter() - before)
        run.extra_rss = max(run.extra_rss, _rss() - start_rss)
    dist.barrier()
    run.seconds = time.perf_counter() - t0
    return run


class _NoGuard:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _ours(model, opt, tokens, args, mode: str) -> Run:
    config = load_job_config(None, ["--checkpoint.enable", "true", "--checkpoint.interval", str(args.every),
                                    "--checkpoint.keep_latest_k", "0", "--checkpoint.async_mode", mode])
    folder = os.path.join(args.dir, mode)
    started: dict[int, float] = {}

    def save(step: int, wall: float) -> bool:
        if _timed(step, args) and manager.save(step):
            started[step] = wall
            return True
        return False

    with CheckpointManager(config.checkpoint, [model], optimizers=opt, base_folder=folder) as manager:
        manager.save(args.every)
        manager.wait()
        run = _train(model, opt, tokens, args, save, _NoGuard)
    marker = os.path.join(folder, "checkpoint")
    run.durable = [os.path.getmtime(os.path.join(layout.step_dir(marker, s), commit.MARKER)) - t
                   for s, t in started.items()]
    dist.barrier()  # every rank has read the markers
    shutil.rmtree(folder, ignore_errors=True)
    return run


def _fsync_tree(args) -> None:
    """torch_checkpointing's pre-finalize callback: make the written files durable."""
    for root, _dirs, files in os.walk(args.path):
        for name in [*files, "."]:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _fsync_parent(args) -> None:
    """Its finalize callback: the rename of the step into place is durable."""
    fd = os.open(os.path.dirname(os.path.abspath(args.path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _free_port() -> int:
    """A port free on rank 0's host, the same on every rank."""
    port = [0]
    if dist.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    return port[0]


def _torch_checkpointing(model, opt, tokens, args) -> Run:
    from torch_checkpointing import AsyncCheckpointSaverConfig, CheckpointManager as TCManager
    from torch_checkpointing import CheckpointWriterConfig, TCPStoreBarrierConfig
    from torch_checkpointing.staging import CheckpointStagerConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    gpu = torch.accelerator.is_available()
    config = TCManager.Config(
        save=AsyncCheckpointSaverConfig(
            staging_config=CheckpointStagerConfig(use_pinned_memory=gpu, use_non_blocking_copy=gpu),
            # its default barrier reopens the process group's FileStore, which the gloo
            # rendezvous of these ranks has removed by then: a TCP store instead
            writer_config=CheckpointWriterConfig(barrier_config=TCPStoreBarrierConfig(
                use_checkpoint_barrier_tcpstore_libuv=True, tcpstore_port=_free_port(),
                master_address="127.0.0.1", timeout_barrier_init_sec=300))),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        pre_finalize_callback=_fsync_tree, finalize_callback=_fsync_parent)
    manager = config.build()
    return _peer(model, opt, tokens, args, "torch_checkpointing",
                 lambda path: manager.save(path, {"model": model.state_dict(), "optimizer": opt.state_dict()}),
                 manager.lock, manager.close)


def _dcp(model, opt, tokens, args) -> Run:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    gpu = torch.accelerator.is_available()
    stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_non_blocking_copy=gpu))
    staging: list = []

    def save(path: str):
        msd, osd = get_state_dict(model, opt)
        response = dcp.async_save({"model": msd, "optimizer": osd}, checkpoint_id=path,
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)
        staging[:] = [response.staging_completion]
        return response.upload_completion

    class WaitForStaging(_NoGuard):
        def __enter__(self):
            for future in staging:
                future.result()

    return _peer(model, opt, tokens, args, "dcp", save, WaitForStaging, stager.close)


def _peer(model, opt, tokens, args, name: str, submit, guard, close) -> Run:
    """A peer's run: `submit(path)` returns the future of the step's write."""
    folder = os.path.join(args.dir, name)
    os.makedirs(folder, exist_ok=True)
    done: dict[int, float] = {}
    started: dict[int, float] = {}
    pending: list = []

    def save(step: int, wall: float) -> bool:
        if not _timed(step, args):
            return False
        for future in pending:  # one save in flight, as every path here
            future.result()
        future = submit(os.path.join(folder, f"step-{step}"))
        future.add_done_callback(lambda _f, step=step: done.__setitem__(step, time.time()))
        started[step], pending[:] = wall, [future]
        return True

    try:
        submit(os.path.join(folder, f"step-{args.every}")).result()  # warm-up
        run = _train(model, opt, tokens, args, save, guard)
        for future in pending:
            future.result()
    finally:
        close()
    run.durable = [done[s] - t for s, t in started.items()]
    dist.barrier()
    shutil.rmtree(folder, ignore_errors=True)
    return run


def _bench(rank: int, world: int, args, results: dict) -> None:
    config = load_job_config(None, ["--model.flavor", args.flavor])
    model = build_model(config)
    shard_model(model, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    tokens = torch.randint(0, model.args.vocab_size, (1, args.seq))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()  # optimizer state exists
    opt.step()
    opt.zero_grad()
    runs: dict[str, list[Run]] = {}
    order = [p for p in args.paths.split(",") if p != "none"]
    for path in ["none", *order, "none"]:
        if path == "none":
            run = _train(model, opt, tokens, args, lambda step, wall: False, _NoGuard)
        elif path in OURS:
            run = _ours(model, opt, tokens, args, path)
        else:
            run = (_torch_checkpointing if path == "torch_checkpointing" else _dcp)(model, opt, tokens, args)
        runs.setdefault(path, []).append(run)
    if rank == 0:
        results.update({path: [vars(r) for r in rs] for path, rs in runs.items()})


def print_table(results: dict, args) -> None:
    base = statistics.mean(r["seconds"] for r in results["none"])
    sync = statistics.median(results["disabled"][0]["blocks"])
    print(f"\ncheckpoint cost to training: {args.flavor} on {args.ranks} ranks, a save every {args.every} steps, "
          f"{args.saves} saves; baseline run {base:.1f} s (two runs: "
          f"{', '.join(format(r['seconds'], '.1f') for r in results['none'])} s); synchronous save {sync:.2f} s\n")
    print("| path | training lost / save | x sync save | % of run | save() returns in | x sync save | "
          "durable after | x sync save | extra memory / rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in [p for p in PATHS if p in results and p != "none"]:
        run = results[path][0]
        lost = (run["seconds"] - base) / args.saves
        block = statistics.median(run["blocks"])
        durable = statistics.median(run["durable"])
        print(f"| {path} | {lost:.2f} s | {lost / sync:.2f} | {100 * lost * args.saves / base:.1f}% | "
              f"{1000 * block:.1f} ms | {block / sync:.4f} | {durable:.2f} s | {durable / sync:.2f} | "
              f"{run['extra_rss'] / 1e9:.2f} GB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--flavor", default="bench")
    parser.add_argument("--seq", type=int, default=64, help="tokens per step (sets a step's compute)")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--every", type=int, default=4, help="steps between saves")
    parser.add_argument("--paths", default=",".join(PATHS[1:]), help=f"of {','.join(PATHS[1:])}")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = parser.parse_args()
    try:
        import torch_checkpointing  # noqa: F401
    except ImportError:
        args.paths = ",".join(p for p in args.paths.split(",") if p != "torch_checkpointing")
        print("torch_checkpointing is not installed (pip install -e .[bench]): its row is skipped")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        args.dir = tmp
        print_table(dict(run_ranks(args.ranks, _bench, args, tmp)), args)


if __name__ == "__main__":
    main()
