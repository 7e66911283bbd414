"""Which rank writes a replicated tensor: each `checkpoint.dedup_policy` against PyTorch's default.

    python -m benchmarks.dedup [--ranks 2 4] [--flavor bench] [--repeats 2] [--dir /tmp/bench]

The state is the example model's with AdamW moments, HSDP over gloo ranks on the CPU with replicate
degree 2 (a 2x1 mesh on 2 ranks, 2x2 on 4), so every tensor is held by two ranks. Per planner it
prints: the max/mean of the bytes each rank's file holds (the busiest rank sets the save time), how
many files hold replicated values and how many one rank opens to reload its own replicated
values (tensors, and the optimizer's settings and steps every rank reads), and the median time
of `dcp.save` over `--repeats`. Ratios are against PyTorch's default planner on the same state.
Absolute times on a shared machine are noise; read the ratios. Here all ranks share one disk, so a
rank's extra bytes barely show in the time; where each rank writes with its own bandwidth, the
time follows the busiest rank's bytes.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from benchmarks.common import run_ranks
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.dcp.planner import layout_of, writers_of
from torchtitan_ckpt.policy.dedup import POLICIES, summarize
from torchtitan_ckpt.states import ModelState, OptimizerState
from torchtitan_ckpt.dcp.storage import make_save_planner, make_storage_writer
from torchtitan_ckpt.example.train import build_model, shard_model

REFERENCE = "PyTorch default"
REPLICATE = 2


class _DefaultPlanner(DefaultSavePlanner):
    """PyTorch's default planner, with the summary ours keeps, computed from its own plans."""

    def create_global_plan(self, all_plans):
        global_plan, metadata = super().create_global_plan(all_plans)
        self.summary = summarize(layout_of(all_plans), writers_of(global_plan), REFERENCE)
        return global_plan, metadata


def _planner(name: str):
    return _DefaultPlanner() if name == REFERENCE else make_save_planner(name)


def _state(world: int, flavor: str) -> dict:
    model = build_model(load_job_config(None, ["--model.flavor", flavor]))
    shard_model(model, world, REPLICATE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    tokens = torch.randint(0, model.args.vocab_size, (1, 32))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    opt.step()  # optimizer moments exist
    return {**ModelState([model]).state_dict(), "optimizer": OptimizerState([model], [opt])}


def _file_bytes(path: str, world: int) -> list[int]:
    return [sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, f"__{r}_*.distcp")))
            for r in range(world)]


def _save(state: dict, path: str, planner) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=make_storage_writer(path), planner=planner)
    dist.barrier()
    return time.perf_counter() - t0


def _bench(rank: int, world: int, args, results: dict) -> None:
    state = _state(world, args.flavor)
    _save(state, os.path.join(args.dir, f"{world}-warm-up"), _planner(REFERENCE))
    names = [REFERENCE, *POLICIES]
    times: dict[str, list[float]] = {name: [] for name in names}
    rows = {}
    for _ in range(args.repeats):
        for name in names:  # interleaved, so that drifting machine load hits every planner alike
            path = os.path.join(args.dir, f"{world}-{name}")
            planner = _planner(name)
            times[name].append(_save(state, path, planner))
            if rank == 0:
                s = planner.summary
                rows[name] = {"bytes": _file_bytes(path, world), "files": s.replicated_files,
                              "load_files": s.max_files_to_load}
                shutil.rmtree(path)
    if rank == 0:
        for name in names:
            rows[name]["secs"] = statistics.median(times[name])
        results[world] = rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--flavor", default="bench")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = parser.parse_args()
    results = None
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        args.dir = tmp
        for world in args.ranks:
            results = run_ranks(world, _bench, args, tmp, results)
    print_table(dict(results), args.flavor)


def _imbalance(loads: list[int]) -> float:
    return max(loads) * len(loads) / sum(loads)


def print_table(results: dict, flavor: str) -> None:
    print(f"\ndedup policies, model flavor {flavor!r} + AdamW, HSDP replicate degree {REPLICATE}, "
          f"median of repeats; (x) = ratio to {REFERENCE}\n")
    print("| ranks | planner | GB written | bytes/rank max/mean | files with replicated values | "
          "files one rank opens to reload its replicated values | save time |")
    print("|---|---|---|---|---|---|---|")
    for world, rows in sorted(results.items()):
        ref = rows[REFERENCE]
        for name, row in rows.items():
            imb, ref_imb = _imbalance(row["bytes"]), _imbalance(ref["bytes"])
            print(f"| {world} | {name} | {sum(row['bytes']) / 1e9:.3f} | {imb:.3f} ({imb / ref_imb:.2f}x) | "
                  f"{row['files']} ({row['files'] / ref['files']:.2f}x) | "
                  f"{row['load_files']} ({row['load_files'] / ref['load_files']:.2f}x) | "
                  f"{row['secs']:.2f} s ({row['secs'] / ref['secs']:.2f}x) |")


if __name__ == "__main__":
    main()
