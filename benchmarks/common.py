"""What every benchmark needs: real ranks (gloo on the CPU; on CUDA one GPU per rank, NCCL beside
gloo), and a dict their rank 0 fills in."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Bench = Callable[[int, int, Any, dict], None]


def _rank_main(rank: int, world: int, init: str, bench: Bench, args: Any, results: dict, device: str) -> None:
    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        bench(rank, world, args, results)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, bench: Bench, args: Any, rdzv_dir: str, results: dict | None = None,
              device: str = "cpu") -> dict:
    """Run `bench(rank, world, args, results)` on `world` processes joined by gloo (`device` "cpu")
    or, with `device` "cuda", each on GPU `rank` with NCCL for CUDA tensors; return `results` (a
    shared dict the ranks write into), created when not given."""
    results = mp.Manager().dict() if results is None else results
    init = os.path.join(rdzv_dir, f"rdzv-{world}")
    mp.spawn(_rank_main, args=(world, init, bench, args, results, device), nprocs=world)
    return results
