"""What a save and a load of a small state cost beyond its bytes: jobs that checkpoint tiny states
often (fine-tuning adapters, RL policies, small models) pay it at every save.

    python -m benchmarks.fixed_cost [--ranks 1 2] [--kb 10 1000] [--repeats 20] [--dir /tmp]

Per rank count and state size (two `Linear` layers and their AdamW moments, every rank the same
state, as data parallelism holds it): the median time of a durable synchronous `save(step)` by
the manager (`keep_latest_k = 10`, so retention runs) and of `load()` with the page cache warm,
each beside PyTorch's `dcp.save` / `dcp.load` of the same state in a folder beside it and the
floor, rank 0's `torch.save` of the state into one file, fsynced and renamed in a fsynced folder
(and its `torch.load`). The three are interleaved in every repeat. Absolute times on a shared
machine are noise; read the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from benchmarks.common import run_ranks
from torchtitan_ckpt import Checkpoint, CheckpointManager
from torchtitan_ckpt.io import durable


def _job(kb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Two square layers whose weights, biases and AdamW moments hold about `kb` KB."""
    width = max(2, round((kb * 1000 / 4 / 3 / 2) ** 0.5))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _bench(rank: int, world: int, args, results: dict) -> None:
    for kb in args.kb:
        model, opt = _job(kb)
        root = os.path.join(args.dir, f"{world}-{kb}")
        ours = CheckpointManager(Checkpoint(enable=True, folder=os.path.join(root, "ours"), interval=1,
                                            keep_latest_k=10), [model], optimizers=opt)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        floor_file = os.path.join(root, "floor.pt")

        def floor_save() -> None:
            if rank == 0:
                with open(floor_file + ".tmp", "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(floor_file + ".tmp", floor_file)
                durable.fsync_path(root)

        times: dict[str, list[float]] = {k: [] for k in ("save", "dcp_save", "floor_save", "load", "dcp_load",
                                                          "floor_load")}
        for step in range(1, args.repeats + 2):
            dcp_dir = os.path.join(root, "dcp", f"step-{step % 10}")
            measured = {"save": _timed(lambda: ours.save(step)),
                        "dcp_save": _timed(lambda: dcp.save(state, checkpoint_id=dcp_dir)),
                        "floor_save": _timed(floor_save),
                        "load": _timed(lambda: ours.load(step)),
                        "dcp_load": _timed(lambda: dcp.load(state, checkpoint_id=dcp_dir)),
                        "floor_load": _timed(lambda: rank == 0 and torch.load(floor_file, weights_only=True))}
            if step > 1:  # the first saves plan and open what later ones reuse
                for key, secs in measured.items():
                    times[key].append(secs)
        ours.close()
        if rank == 0:
            results[(world, kb)] = {key: statistics.median(v) for key, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--kb", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        args.dir = tmp
        results = {}
        for world in args.ranks:
            results.update(run_ranks(world, _bench, args, tmp))
    print(f"\nfixed cost, median of {args.repeats}; (x) = ratio to dcp.save / dcp.load, [x] = ratio to the floor\n")
    print("| ranks | state | save | dcp.save | floor save | load (warm) | dcp.load | floor load |")
    print("|---|---|---|---|---|---|---|---|")
    for (world, kb), r in sorted(results.items()):
        print(f"| {world} | {kb} KB | {r['save'] * 1e3:.1f} ms ({r['save'] / r['dcp_save']:.2f}x) "
              f"[{r['save'] / r['floor_save']:.1f}x] | {r['dcp_save'] * 1e3:.1f} ms | {r['floor_save'] * 1e3:.1f} ms | "
              f"{r['load'] * 1e3:.1f} ms ({r['load'] / r['dcp_load']:.2f}x) [{r['load'] / r['floor_load']:.1f}x] | "
              f"{r['dcp_load'] * 1e3:.1f} ms | {r['floor_load'] * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
