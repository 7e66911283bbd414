"""Where the time of one save and one cold load goes: cProfile on rank 0, by own time.

    python -m benchmarks.suite_profile [--gb 0.8] [--top 15] [--load-threads 1]

Threads are not profiled: DCP's writer starts none with `thread_count=1` on the CPU, and the
load runs with `checkpoint.load_threads = --load-threads` (1 by default, so its reads show).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import tempfile
from dataclasses import replace

import torch.distributed as dist

from benchmarks.common import run_ranks
from benchmarks.suite import _Paths, drop_cache, measure, model_args


def _profiled(rank: int, fn, top: int) -> str:
    prof = cProfile.Profile()
    secs, _ = measure(lambda: prof.runcall(fn))
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return f"{secs:.2f} s\n" + out.getvalue()


def _bench(rank: int, world: int, args, results: dict) -> None:
    margs, root, top, which, load_threads = args
    paths = _Paths(rank, world, root, margs)
    paths.loader.config = replace(paths.loader.config, load_threads=load_threads)
    try:
        for save_key, load_key, folder, save, load in paths.pairs:
            if save_key not in which:
                continue
            report = _profiled(rank, save, top)
            dist.barrier()
            drop_cache(folder)
            report_load = _profiled(rank, load, top)
            if rank == 0:
                results[save_key], results[load_key] = report, report_load
    finally:
        paths.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=0.8)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--paths", default="ours_save,pt_save,ours_hf_save")
    parser.add_argument("--load-threads", type=int, default=1, help="checkpoint.load_threads of our load")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        res = run_ranks(2, _bench, (model_args(args.gb), tmp, args.top, args.paths.split(","), args.load_threads), tmp)
        for key, text in dict(res).items():
            print(f"==== {key}: {text}")


if __name__ == "__main__":
    main()
