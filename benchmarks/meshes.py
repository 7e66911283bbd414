"""Durable save and cold resume on every mesh the example job builds, as ratios to the raw floor.

    python -m benchmarks.meshes [--flavor small] [--moe-flavor small_moe] [--repeats 3] [--dir /tmp/bench]

On 4 gloo ranks on the CPU, for each layout (FSDP 4, HSDP 2x2, TP 2 x FSDP 2, TP 4, PP 2 x FSDP 2
with two stages per rank, EP 2 x FSDP 2 on the MoE flavor) the example job's model parts and AdamW
state (after one step) are saved with `CheckpointManager.save` (sync, committed, fsynced) and
loaded back with `CheckpointManager.load` after the step folder's page cache was dropped. Each
time runs from a barrier to the barrier after it (the slowest rank counts), median of `--repeats`.

The floor is the same bytes with plain Python: each rank writes as many bytes as its data files
of our step hold, then fsyncs (save floor), and reads back cold a file of the bytes it holds in
memory, replicas included (load floor: a rank loads every value it holds). A layout whose
ratio grows shows a regression in that layout's path.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from benchmarks.common import run_ranks
from benchmarks.suite import clear, drop_cache, measure, raw_read, raw_write
from torchtitan_ckpt import CheckpointManager, layout
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.example.train import Run, build_run

LAYOUTS = {
    "FSDP 4": (),
    "HSDP 2x2": ("--parallelism.data_parallel_replicate_degree", "2"),
    "TP 2 x FSDP 2": ("--parallelism.tensor_parallel_degree", "2"),
    "TP 4": ("--parallelism.tensor_parallel_degree", "4"),
    "PP 2 x FSDP 2": ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                      "Interleaved1F1B"),
    "EP 2 x FSDP 2": ("--parallelism.expert_parallel_degree", "2"),
}
RANKS = 4


def _run(folder: str, flavor: str, name: str, rank: int) -> tuple[Run, object]:
    config = load_job_config(None, ["--job.dump_folder", folder, "--model.flavor", flavor, "--checkpoint.enable",
                                    "true", "--checkpoint.keep_latest_k", "0", "--checkpoint.last_save_model_only",
                                    "false", *LAYOUTS[name]])
    run = build_run(config, RANKS, rank, torch.device("cpu"))
    for part in run.parts:  # AdamW moments exist: one step on zero gradients
        for p in part.parameters():
            p.grad = torch.zeros_like(p)
    for opt in run.optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run, config


def _held(run: Run) -> list[torch.Tensor]:
    """Every tensor this rank holds of the state (local shards; replicas included)."""
    out = []
    for opt in run.optimizers:
        for p in (p for group in opt.param_groups for p in group["params"]):
            for t in (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]):
                out.append(t.to_local() if isinstance(t, DTensor) else t)
    return out


def _bench_layout(rank: int, folder: str, flavor: str, name: str, repeats: int) -> dict[str, float]:
    run, config = _run(folder, flavor, name, rank)
    step = layout.step_dir(os.path.join(folder, "checkpoint"), 1)
    raw = os.path.join(folder, "raw", f"rank{rank}")
    times: dict[str, list[float]] = {"save": [], "load": [], "raw_write": [], "raw_read": []}
    with CheckpointManager(config.checkpoint, run.parts, optimizers=run.optimizers,
                           base_folder=folder) as manager:
        for _ in range(repeats):
            clear(step, rank)
            times["save"].append(measure(lambda: manager.save(1, last_step=True))[0])
            written = sum(os.path.getsize(f) for f in glob.glob(os.path.join(step, f"__{rank}_*.distcp")))
            block = [torch.empty(written, dtype=torch.uint8)]
            times["raw_write"].append(measure(lambda: raw_write(block, raw))[0])
            drop_cache(step)
            times["load"].append(measure(lambda: manager.load(1))[0])
            raw_write(_held(run), raw)
            drop_cache(os.path.dirname(raw))
            times["raw_read"].append(measure(lambda: raw_read(raw))[0])
    gb = torch.tensor(float(sum(t.nbytes for t in _held(run))))
    dist.all_reduce(gb)
    return {**{k: statistics.median(v) for k, v in times.items()}, "gb_held": gb.item() / 1e9}


def _bench(rank: int, world: int, args, results: dict) -> None:
    for name in LAYOUTS:
        flavor = args.moe_flavor if name.startswith("EP") else args.flavor
        row = _bench_layout(rank, os.path.join(args.dir, name.replace(" ", "")), flavor, name, args.repeats)
        if rank == 0:
            results[name] = {**row, "flavor": flavor}


def print_table(results: dict) -> None:
    print(f"\nsave and cold load per layout, {RANKS} gloo ranks, median; (x) = ratio to the raw floor "
          "of the same bytes\n")
    print("| layout | flavor | GB held (all ranks) | durable save | raw write + fsync | cold load | raw cold read |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['flavor']} | {r['gb_held']:.3f} | {r['save']:.3f} s ({r['save'] / r['raw_write']:.2f}x)"
              f" | {r['raw_write']:.3f} s | {r['load']:.3f} s ({r['load'] / r['raw_read']:.2f}x) | "
              f"{r['raw_read']:.3f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flavor", default="small", help="dense flavor (4 layers, KV heads divisible by 4)")
    parser.add_argument("--moe-flavor", default="small_moe")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        args.dir = tmp
        results = run_ranks(RANKS, _bench, args, tmp)
    print_table(dict(results))


if __name__ == "__main__":
    main()
