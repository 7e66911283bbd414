"""Object storage: a save to and a load from a local S3-compatible server (moto's standalone
server, started here in its own process) beside boto3's own multipart upload and download of
the same bytes with the same part size and parallelism, and the upload's peak buffered bytes.

    python -m benchmarks.s3 [--mb 256] [--part-size 8MiB] [--parallel 8] [--repeats 3] [--dir DIR]

Each repeat runs ours and boto3's back to back (which goes first alternates), and the ratios
are the medians of each repeat's own ratio, so that a change in the machine's load between
repeats does not land on one side only. The peak is measured in one more save, untimed
(tracemalloc slows every allocation). `--dir` holds the staged files and the raw upload's
source file: a real disk for large sizes.
Targets (docs/storage.md): save >= 0.8x the raw upload, load >= 0.8x the raw download.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc

import boto3
import torch
from boto3.s3.transfer import TransferConfig

from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.hf.planner import parse_size

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}


def _start_server() -> subprocess.Popen:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto's server did not start")


def _model(mb: int) -> torch.nn.Module:
    return torch.nn.ParameterList([torch.nn.Parameter(torch.randn(mb, 1 << 18))])  # mb MiB of float32


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _config(args, staging: str) -> Checkpoint:
    return Checkpoint(enable=True, folder="s3://bench/ckpt", interval=1, keep_latest_k=1, staging_folder=staging,
                      upload_part_size=args.part_size, upload_parallel_parts=args.parallel)


def _ours(config: Checkpoint, model) -> tuple[float, float]:
    with CheckpointManager(config, [model]) as manager:
        save = _timed(lambda: manager.save(1))
    with CheckpointManager(config, [model]) as manager:
        load = _timed(manager.load)
    return save, load


def _peak(config: Checkpoint, model) -> int:
    """The most bytes Python allocated at once during a save (the step's buffers; not the model)."""
    with CheckpointManager(config, [model]) as manager:
        tracemalloc.start()
        manager.save(1)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def _raw(args, path: str) -> tuple[float, float]:
    client = boto3.client("s3")
    part = parse_size(args.part_size)
    transfer = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=args.parallel)
    up = _timed(lambda: client.upload_file(path, "bench", "raw/blob", Config=transfer))
    down = _timed(lambda: client.download_file("bench", "raw/blob", path + ".back", Config=transfer))
    return up, down


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.s3", description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="state size in MiB")
    parser.add_argument("--part-size", default="8MiB")
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the staged and source files go (default: TMPDIR)")
    args = parser.parse_args(argv)
    server = _start_server()
    try:
        boto3.client("s3").create_bucket(Bucket="bench")
        model = _model(args.mb)
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            blob, config = os.path.join(tmp, "blob"), _config(args, os.path.join(tmp, "stage"))
            with open(blob, "wb") as f:
                f.write(model[0].detach().numpy().tobytes())
            pairs = []
            for i in range(args.repeats):  # ours first on even repeats, boto3's first on odd ones
                raw = _raw(args, blob) if i % 2 else None
                ours = _ours(config, model)
                pairs.append((ours, raw or _raw(args, blob)))
            peak = _peak(config, model)
    finally:
        server.terminate()
        server.wait()
    _report(args, pairs, peak)


def _report(args, pairs, peak: int) -> None:
    gb = args.mb * (1 << 20) / 1e9

    def median(fn) -> float:
        return statistics.median(fn(ours, raw) for ours, raw in pairs)

    print(f"| {args.mb} MiB, part {args.part_size} x {args.parallel}, {len(pairs)} pairs | GB/s "
          "| ratio, median of the pairs' (target >= 0.8) |")
    print("|---|---|---|")
    print(f"| save (ours) | {median(lambda o, r: gb / o[0]):.3f} | {median(lambda o, r: r[0] / o[0]):.2f} |")
    print(f"| upload (boto3 upload_file) | {median(lambda o, r: gb / r[0]):.3f} | |")
    print(f"| load (ours) | {median(lambda o, r: gb / o[1]):.3f} | {median(lambda o, r: r[1] / o[1]):.2f} |")
    print(f"| download (boto3 download_file) | {median(lambda o, r: gb / r[1]):.3f} | |")
    bound = parse_size(args.part_size) * args.parallel
    print(f"peak Python allocations during a save: {peak / 2**20:.1f} MiB "
          f"(bound: part size x parallel parts = {bound / 2**20:.0f} MiB); load average now "
          f"{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
