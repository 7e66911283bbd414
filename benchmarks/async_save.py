"""How long `save()` blocks training in each `async_mode`, against the synchronous save of the same
state, PyTorch's own `dcp.async_save`, and the raw disk.

    python -m benchmarks.async_save [--ranks 2] [--flavor bench] [--repeats 3] [--dir /tmp/bench]

The state is the example model's (flavor `bench`: ~128M parameters, ~1.5 GB with AdamW state),
FSDP-sharded over gloo ranks on the CPU. Per path it prints the median over `--repeats` saves of:
the time `save()` blocks, the time until the step is complete, the extra memory held, and the
slowdown of training steps run while the save is in flight; ratios are against the synchronous
save. Absolute times on a shared machine are noise; read the ratios. `--modes` must include
`disabled` (the ratios' denominator). The `dcp.async_save` row uses PyTorch's own
`FileSystemWriter` (its default `sync_files=True`: the data files are fsynced before the future
completes), not this project's storage writer.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemWriter

from benchmarks.common import run_ranks
from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.example.train import build_model, shard_model

MODES = ["disabled", "async", "async_with_pinned_mem"]


def _train_step(model, opt, tokens) -> None:
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()


def _step_time_during(model, opt, tokens, busy) -> float:
    """Mean time of training steps run while `busy()` is true on any rank (at least one step;
    every rank runs the same number, as a real job does)."""
    times = []
    while True:
        t0 = time.perf_counter()
        _train_step(model, opt, tokens)
        times.append(time.perf_counter() - t0)
        flag = torch.tensor([1.0 if busy() else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return statistics.mean(times)


def _raw_write(state_bytes: int, folder: str, rank: int) -> float:
    """Write and fsync `state_bytes` from one buffer: the disk's floor for this rank's share."""
    buf = bytearray(os.urandom(1 << 20))
    path = os.path.join(folder, f"raw-{rank}")
    dist.barrier()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = state_bytes
        while left > 0:
            n = min(left, len(buf))
            f.write(memoryview(buf)[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    dist.barrier()
    secs = time.perf_counter() - t0
    os.remove(path)
    return secs


def _rank_bytes(model, opt) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size() * 3  # weight + two AdamW moments
    return total


def _bench(rank: int, world: int, args, results: dict) -> None:
    config = load_job_config(None, ["--model.flavor", args.flavor, "--checkpoint.enable", "true",
                                    "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "1"])
    model = build_model(config)
    shard_model(model, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    tokens = torch.randint(0, model.args.vocab_size, (1, 32))
    _train_step(model, opt, tokens)  # optimizer state exists
    baseline = statistics.median(_step_time_during(model, opt, tokens, lambda: False) for _ in range(3))
    nbytes = _rank_bytes(model, opt)
    rows = {"raw disk": {"block": _raw_write(nbytes, args.dir, rank)}}
    rows["raw disk"]["total"] = rows["raw disk"]["block"]
    rows["raw disk"]["extra"] = None
    for mode in [m for m in args.modes.split(",") if m]:
        config.checkpoint.async_mode = mode
        folder = os.path.join(args.dir, mode)
        with CheckpointManager(config.checkpoint, [model], optimizers=opt, base_folder=folder) as manager:
            manager.save(1)  # warm-up: the pinned buffer is allocated here
            manager.wait()
            blocks, totals, slows = [], [], []
            for step in range(2, 2 + 2 * args.repeats, 2):
                dist.barrier()
                t0 = time.perf_counter()
                manager.save(step)  # alone: how long it blocks, and until it is complete
                blocks.append(time.perf_counter() - t0)
                manager.wait()
                totals.append(time.perf_counter() - t0)
                dist.barrier()
                manager.save(step + 1)  # with training running beside it
                slows.append(_step_time_during(model, opt, tokens, lambda: manager.save_in_flight) / baseline)
                manager.wait()
            stager = getattr(manager._saves, "stager", None)  # noqa: SLF001
            extra = nbytes if mode == "async" else (stager.nbytes if stager else 0)
        rows[mode] = {"block": statistics.median(blocks), "total": statistics.median(totals),
                      "extra": extra, "slow": statistics.median(slows)}
        shutil.rmtree(folder, ignore_errors=True)
    rows["dcp.async_save"] = _pytorch_async(model, opt, tokens, baseline, args)
    if rank == 0:
        results.update(rows)
        results["bytes"] = nbytes * world


def _pytorch_async(model, opt, tokens, baseline, args) -> dict:
    """PyTorch's own async path on the same state: dcp.async_save with its default stager and
    PyTorch's own `FileSystemWriter` (which fsyncs every data file before the future completes)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    blocks, totals, slows = [], [], []
    group = dist.new_group(backend="gloo")  # its own group: training keeps using the default one
    for i in range(args.repeats + 1):  # the first round warms up
        for during_training in (False, True):
            msd, osd = get_state_dict(model, opt)
            path = os.path.join(args.dir, f"pt-async-{i}-{during_training}")
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save({"model": msd, "optimizer": osd}, storage_writer=FileSystemWriter(path),
                                 process_group=group)
            block = time.perf_counter() - t0
            if during_training:
                slow = _step_time_during(model, opt, tokens, lambda: not fut.done()) / baseline
            fut.result()
            if i and during_training:
                slows.append(slow)
            elif i:
                blocks.append(block), totals.append(time.perf_counter() - t0)
            shutil.rmtree(path, ignore_errors=True)
    return {"block": statistics.median(blocks), "total": statistics.median(totals),
            "extra": None, "slow": statistics.median(slows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--flavor", default="bench")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), help="async_mode values to measure")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if "disabled" not in modes or set(modes) - set(MODES):
        parser.error(f"--modes: include disabled (the ratios are against it); choose from {','.join(MODES)}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        args.dir = tmp
        print_table(dict(run_ranks(args.ranks, _bench, args, tmp)), args.ranks)


def print_table(r: dict, ranks: int) -> None:
    sync = r["disabled"]
    print(f"\nasync checkpointing, {r['bytes'] / 1e9:.2f} GB state on {ranks} ranks (median of repeats)\n")
    print("| path | save() blocks | x sync save | until complete | x sync save | extra memory / rank | "
          "train step while saving |")
    print("|---|---|---|---|---|---|---|")
    names = {"raw disk": "raw disk (write+fsync, same bytes)", "disabled": "ours, disabled (sync)",
             "async": "ours, async", "async_with_pinned_mem": "ours, async_with_pinned_mem (warm)",
             "dcp.async_save": "PyTorch dcp.async_save"}
    for key, name in names.items():
        row = r.get(key)
        if row is None:  # a mode not measured (--modes)
            continue
        extra = "-" if row.get("extra") is None else f"{row['extra'] / 1e9:.2f} GB"
        slow = f"{row['slow']:.2f}x" if "slow" in row else "-"
        print(f"| {name} | {row['block']:.2f} s | {row['block'] / sync['block']:.2f} | {row['total']:.2f} s | "
              f"{row['total'] / sync['total']:.2f} | {extra} | {slow} |")


if __name__ == "__main__":
    main()
