"""Durable save and cold resume on every mesh the example job builds, as ratios to the raw floor.

    python -m benchmarks.meshes [--flavor bench] [--moe-flavor bench_moe] [--only PP,EP] [--repeats 4] [--dir /tmp/bench]

On 4 gloo ranks on the CPU, for each layout (FSDP 4, HSDP 2x2, TP 2 x FSDP 2, TP 4, PP 2 x FSDP 2
with two stages per rank, EP 2 x FSDP 2 on the MoE flavor, of about the dense flavor's size) the
example job's model parts and AdamW state (after one step) are saved with
`CheckpointManager.save` (sync, committed, fsynced) and loaded back with `CheckpointManager.load`
after the step folder's page cache was dropped. Each time runs from a barrier to the barrier
after it (the slowest rank counts); the job's first save (planned from scratch) and first load
are timed apart, as in `benchmarks.paired`; each repeat times ours and its floor, in an order
that turns every repeat, and the table gives the median time of each and the median of the
repeats' ratios (steadier than a ratio of medians while the disk's speed drifts). Before each
cold read, ours and the floor's, every file it reads is read once and dropped from the page
cache (`suite.read_once`, then `suite.drop_cache`): both then read what the virtual disk's host
holds in the same state, rather than one fresh and one cached there.

The floor is the same bytes with plain Python:
- save: each rank writes as many bytes as its data files of our step hold, into a new file as
  our save does (`suite.raw_write`, from memory already touched), then fsyncs;
- load: each rank reads cold every value it holds (replicas included: a rank loads all it holds)
  with plain `preadv`s. Each distinct piece of the state is in one file (its lowest holder's), so
  replicas read the same bytes of the same file, as they do from our step, where the dedup
  policy wrote one copy. These files are written once, before the repeats.
A layout whose ratio grows shows a regression in that layout's path.
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from benchmarks.common import run_ranks
from benchmarks.suite import clear, drop_cache, measure, raw_write, read_once, read_ranges
from torchtitan_ckpt import CheckpointManager, layout
from torchtitan_ckpt.dcp.storage import dtensor_chunk
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


def _held(run: Run) -> list[tuple[tuple, torch.Tensor]]:
    """Every tensor this rank holds of the state (local shards, replicas included), keyed by
    (name, parameter or moment, offsets of the shard): replicas have equal keys."""
    names = {id(p): name for part in run.parts for name, p in part.named_parameters()}
    out = []
    for opt in run.optimizers:
        for p in (p for group in opt.param_groups for p in group["params"]):
            for kind in ("param", "exp_avg", "exp_avg_sq"):
                t = p.detach() if kind == "param" else opt.state[p][kind]
                offsets = dtensor_chunk(tuple(t.shape), t.device_mesh, tuple(t.placements))[0] \
                    if isinstance(t, DTensor) else ()
                out.append(((names[id(p)], kind, offsets), t.to_local() if isinstance(t, DTensor) else t))
    return out


def _write_load_floor(held: list[tuple[tuple, torch.Tensor]], folder: str, rank: int) -> list[tuple[str, int, int]]:
    """Write each distinct piece of the state once, its lowest holder's file holding it (pieces
    in key order); return the byte ranges (file, offset, length) of the pieces this rank holds."""
    mine = sorted((key, t.nbytes) for key, t in held)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    owner: dict[tuple, tuple[int, int]] = {}
    for r, pieces in enumerate(every):
        for key, n in pieces:
            owner.setdefault(key, (r, n))
    places, ends = {}, [0] * len(every)
    for key in sorted(owner):
        r, n = owner[key]
        places[key] = (os.path.join(folder, f"rank{r}"), ends[r], n)
        ends[r] += n
    raw_write([t for key, t in sorted(held, key=lambda kt: kt[0]) if owner[key][0] == rank],
              os.path.join(folder, f"rank{rank}"))
    return [places[key] for key, _ in mine]


def _cold(folder: str, files: list[str], rank: int) -> None:
    """`files` (this rank's share of those in `folder`) read once, then every file of `folder`
    dropped from the page cache on every rank, before a timed cold read."""
    read_once(files)
    dist.barrier()
    drop_cache(folder)


def _bench_layout(rank: int, folder: str, flavor: str, name: str, repeats: int) -> dict[str, float]:
    run, config = _run(folder, flavor, name, rank)
    step = layout.step_dir(os.path.join(folder, "checkpoint"), 1)
    raw = os.path.join(folder, "raw", f"rank{rank}")
    held = _held(run)
    times: dict[str, list[float]] = {"save": [], "load": [], "raw_write": [], "raw_read": []}
    with CheckpointManager(config.checkpoint, run.parts, optimizers=run.optimizers,
                           base_folder=folder) as manager:
        # a job's first save plans from scratch and its first load sets up its readers; timed
        # apart, as a job pays them once, not per step
        first_save = measure(lambda: manager.save(1, last_step=True))[0]
        drop_cache(step)
        first_load = measure(lambda: manager.load(1))[0]
        written = sum(os.path.getsize(f) for f in glob.glob(os.path.join(step, f"__{rank}_*.distcp")))
        floor_folder = os.path.join(folder, "raw_load")
        floor_ranges = _write_load_floor(held, floor_folder, rank)

        def save() -> float:
            clear(step, rank)
            return measure(lambda: manager.save(1, last_step=True))[0]

        def write() -> float:
            block = [torch.ones(written, dtype=torch.uint8)]
            clear(os.path.dirname(raw), rank)  # a new file, as our save's
            return measure(functools.partial(raw_write, block, raw))[0]

        def load() -> float:
            _cold(step, sorted(filter(os.path.isfile, glob.glob(os.path.join(step, "*"))))[rank::RANKS], rank)
            return measure(lambda: manager.load(1))[0]

        def read() -> float:
            _cold(floor_folder, [os.path.join(floor_folder, f"rank{rank}")], rank)
            return measure(lambda: read_ranges(floor_ranges))[0]

        for i in range(repeats):
            for pair in ((("save", save), ("raw_write", write)), (("load", load), ("raw_read", read))):
                for key, fn in pair if i % 2 == 0 else reversed(pair):
                    times[key].append(fn())
    gb = torch.tensor(float(sum(t.nbytes for _, t in held)))
    dist.all_reduce(gb)
    ratios = {"save_x": [s / w for s, w in zip(times["save"], times["raw_write"])],
              "load_x": [lo / r for lo, r in zip(times["load"], times["raw_read"])]}
    return {**{k: statistics.median(v) for k, v in {**times, **ratios}.items()}, "gb_held": gb.item() / 1e9,
            "first_save": first_save, "first_load": first_load}


def _bench(rank: int, world: int, args, results: dict) -> None:
    for name in (n for n in LAYOUTS if not args.only or any(word in n for word in args.only.split(","))):
        flavor = args.moe_flavor if name.startswith("EP") else args.flavor
        row = _bench_layout(rank, os.path.join(args.dir, name.replace(" ", "")), flavor, name, args.repeats)
        if rank == 0:
            results[name] = {**row, "flavor": flavor}


def print_table(results: dict) -> None:
    print(f"\nsave and cold load per layout, {RANKS} gloo ranks, median; (x) = median of each repeat's ratio "
          "to the raw floor of the same bytes, measured beside it\n")
    print("| layout | flavor | GB held (all ranks) | durable save | raw write + fsync | cold load | raw cold read "
          "| first save / first cold load |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['flavor']} | {r['gb_held']:.3f} | {r['save']:.3f} s ({r['save_x']:.2f}x)"
              f" | {r['raw_write']:.3f} s | {r['load']:.3f} s ({r['load_x']:.2f}x) | "
              f"{r['raw_read']:.3f} s | {r['first_save']:.3f} s / {r['first_load']:.3f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flavor", default="bench", help="dense flavor (KV heads divisible by 4, layers by 4)")
    parser.add_argument("--moe-flavor", default="bench_moe", help="MoE flavor (experts divisible by 2)")
    parser.add_argument("--only", default="", help="layouts whose name holds one of these comma-separated words")
    parser.add_argument("--repeats", type=int, default=4, help="an even count: each side goes first as often")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        args.dir = tmp
        results = run_ranks(RANKS, _bench, args, tmp)
    print_table(dict(results))


if __name__ == "__main__":
    main()
