"""HF safetensors export on 2 gloo ranks (CPU), side by side, median of 3:

- consolidation of the same DCP HF shard input (`HuggingFaceStorageWriter(save_distributed=True)`):
  PyTorch's `consolidate_safetensors_files_on_every_rank` plus an fsync of its outputs (ours are
  durable, theirs are not), ours (two-phase), and a raw copy of the same bytes;
- the export as a whole: a plain DCP save, the HF sharded save, and our one-pass export;

for an even 4-file layout and an uneven one (one large file, three small), with the peak RSS of
each rank during each method (VmHWM, reset before each method through /proc/self/clear_refs).

    python -m benchmarks.consolidation [--layers 6] [--threads 4] [--dir /tmp]
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
from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from benchmarks.common import run_ranks
from torchtitan_ckpt.hf.consolidate import consolidate_safetensors, write_safetensors_one_pass

REPEATS = 3
DIM, FFN, KV, VOCAB = 2048, 5632, 512, 32000


def llama_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a Llama-like model (fp32: 6 layers is about 1.6 GB)."""
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (VOCAB, DIM)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({p + "attention.wq.weight": (DIM, DIM), p + "attention.wk.weight": (KV, DIM),
                       p + "attention.wv.weight": (KV, DIM), p + "attention.wo.weight": (DIM, DIM),
                       p + "feed_forward.w1.weight": (FFN, DIM), p + "feed_forward.w2.weight": (DIM, FFN),
                       p + "feed_forward.w3.weight": (FFN, DIM), p + "attention_norm.weight": (DIM,),
                       p + "ffn_norm.weight": (DIM,)})
    shapes.update({"norm.weight": (DIM,), "output.weight": (VOCAB, DIM)})
    return shapes


def layouts(shapes: dict[str, tuple[int, ...]]) -> dict[str, dict[str, int]]:
    """even: 4 files balanced by bytes; uneven: every layer in file 1, embeddings, output, norm alone."""
    load, even = [0] * 4, {}
    for name in sorted(shapes, key=lambda n: -torch.Size(shapes[n]).numel()):
        i = load.index(min(load))
        even[name] = i + 1
        load[i] += torch.Size(shapes[name]).numel()
    uneven = {n: 1 if n.startswith("layers.") else {"tok_embeddings.weight": 2, "output.weight": 3}.get(n, 4)
              for n in shapes}
    return {"even 4 files": even, "uneven 1 large + 3 small": uneven}


def fsdp_state(shapes: dict[str, tuple[int, ...]], rank: int, world: int) -> dict[str, DTensor]:
    """Random fp32 DTensors sharded on dim 0 (FSDP-style), each rank making only its own shard."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    state = {}
    for name, shape in shapes.items():
        local = torch.randn((shape[0] // world, *shape[1:]), generator=g)
        state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                         stride=torch.empty(shape, device="meta").stride())
    return state


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_gb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    return kb / 1e6


def timed(rank: int, results: dict, key: str, out: str, fn) -> None:
    """Run `fn` REPEATS times on every rank into a fresh `out`; record the median seconds and every
    rank's peak RSS."""
    times, peak = [], 0.0
    for _ in range(REPEATS):
        if rank == 0:
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
        dist.barrier()
        reset_peak()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        peak = max(peak, peak_gb())
    results[(key, "rss", rank)] = peak
    if rank == 0:
        results[(key, "s")] = statistics.median(times)
        shutil.rmtree(out, ignore_errors=True)


def fsync_files(folder: str, names: list[str]) -> None:
    for n in names:
        fd = os.open(os.path.join(folder, n), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def save_side(rank: int, world: int, args, results: dict) -> None:
    """One-pass export and plain DCP save (timed), then the HF shard input for the other side."""
    root, shapes, threads = args
    state = fsdp_state(shapes, rank, world)
    for label, mapping in layouts(shapes).items():
        timed(rank, results, f"{label}|onepass", os.path.join(root, "onepass"),
              lambda: write_safetensors_one_pass(state, os.path.join(root, "onepass"), mapping,
                                                 process_group=dist.group.WORLD, num_threads=threads))
    timed(rank, results, "dcp", os.path.join(root, "dcp"),
          lambda: dcp.save(state, storage_writer=FileSystemWriter(os.path.join(root, "dcp"))))
    for i, (label, mapping) in enumerate(layouts(shapes).items()):
        folder = os.path.join(root, f"input{i}")
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(folder, fqn_to_index_mapping=mapping,
                                                                save_distributed=True))
        dist.barrier()
        results[(label, "hfsave", "s")] = time.perf_counter() - t0


def consolidate_side(rank: int, world: int, args, results: dict) -> None:
    root, shapes, threads = args
    for i, (label, mapping) in enumerate(layouts(shapes).items()):
        src, out = os.path.join(root, f"input{i}"), os.path.join(root, "out")
        n = max(mapping.values())
        theirs = [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1) if k % world == rank]

        def pytorch() -> None:
            consolidate_safetensors_files_on_every_rank(src, out, mapping, num_threads=threads)
            fsync_files(out, theirs)

        def ours() -> None:
            # the shard files are kept by default (remove_shards=False): the next repeat reads them again
            consolidate_safetensors(src, out, mapping, process_group=dist.group.WORLD, num_threads=threads)

        def raw_copy() -> None:
            mine = [f for f in sorted(os.listdir(src)) if f.startswith(f"shard-{rank + 1:05d}-")]
            for f in mine:
                shutil.copyfile(os.path.join(src, f), os.path.join(out, f))
            fsync_files(out, mine)

        for name, fn in (("pytorch", pytorch), ("ours", ours), ("raw", raw_copy)):
            timed(rank, results, f"{label}|{name}", out, fn)


def report(r: dict, world: int, gb: float) -> None:
    rss = lambda key: " / ".join(f"{r[(key, 'rss', k)]:.2f}" for k in range(world))  # noqa: E731
    print(f"\n{gb:.2f} GB fp32 Llama-like state, FSDP dim-0 DTensors on {world} gloo ranks, median of {REPEATS}\n")
    print("| layout | PyTorch + fsync | ours two-phase | raw copy | PyTorch / ours | ours / raw |")
    print("|---|---|---|---|---|---|")
    labels = [k[0].split("|")[0] for k in r if isinstance(k, tuple) and k[-1] == "s" and k[0].endswith("|ours")]
    for label in labels:
        p, o, c = (r[(f"{label}|{m}", "s")] for m in ("pytorch", "ours", "raw"))
        print(f"| {label} | {p:.2f} s | {o:.2f} s | {c:.2f} s | {p / o:.2f}x | {o / c:.2f}x |")
    dcp_s = r[("dcp", "s")]
    print("\n| layout | plain DCP save | one-pass export | one-pass / DCP | HF sharded save + PyTorch "
          "consolidation + fsync | that / DCP |")
    print("|---|---|---|---|---|---|")
    for label in labels:
        one, two = r[(f"{label}|onepass", "s")], r[(label, "hfsave", "s")] + r[(f"{label}|pytorch", "s")]
        print(f"| {label} | {dcp_s:.2f} s | {one:.2f} s | {one / dcp_s:.2f}x | {two:.2f} s | {two / dcp_s:.2f}x |")
    print("\nPeak RSS per rank (GB; rank 0 / rank 1), during each method:\n")
    print("| layout | PyTorch + fsync | ours two-phase | raw copy | one-pass (state in memory) |")
    print("|---|---|---|---|---|")
    for label in labels:
        print(f"| {label} | {rss(label + '|pytorch')} | {rss(label + '|ours')} | {rss(label + '|raw')} "
              f"| {rss(label + '|onepass')} |")
    print(f"| plain DCP save (state in memory) | {rss('dcp')} | | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--threads", type=int, default=4, help="copy threads per rank, ours and PyTorch's")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dir", default=os.environ.get("BENCH_DIR"),
                        help="where the checkpoints are written (default: $BENCH_DIR, else a temp dir)")
    args = parser.parse_args()
    shapes = llama_shapes(args.layers)
    gb = sum(torch.Size(s).numel() * 4 for s in shapes.values()) / 1e9
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for sub in ("rdzv-save", "rdzv-consolidate"):
            os.makedirs(os.path.join(root, sub))
        results = run_ranks(args.world, save_side, (root, shapes, args.threads), os.path.join(root, "rdzv-save"))
        run_ranks(args.world, consolidate_side, (root, shapes, args.threads), os.path.join(root, "rdzv-consolidate"),
                  results)
        report(dict(results), args.world, gb)


if __name__ == "__main__":
    main()
