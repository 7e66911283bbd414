"""Qwen3-MoE in Hugging Face format with expert parallelism (EP = 2 on 2 gloo ranks), in
adjacent pairs so a noisy disk moves both sides of a ratio alike:

- export: `save_hf` (one pass, each expert written by the rank holding it) against a plain DCP
  save of the same state, both durable (every data file fsynced) and on the same process group
  (target <= 1.15x);
- cold import: `load_hf` against a raw read of exactly the byte ranges it read (target <= 1.3x),
  and the bytes each rank read against the bytes of the experts and shards it holds (<= 1.1x).

    python -m benchmarks.moe_hf [--experts 8] [--layers 4] [--rounds 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from benchmarks.common import run_ranks
from benchmarks.suite import clear, drop_cache, measure, read_ranges
from torchtitan_ckpt.dcp import storage
from torchtitan_ckpt.example.model import ModelArgs, MoEArgs, Transformer, hf_adapter
from torchtitan_ckpt.hf import load_hf, save_hf, shards


def model_args(experts: int, layers: int) -> ModelArgs:
    return ModelArgs(dim=512, n_layers=layers, n_heads=8, n_kv_heads=4, vocab_size=8192, ffn_hidden=1024,
                     head_size=64, qk_norm=True, moe=MoEArgs(num_experts=experts, top_k=2, hidden=1024))


def _recorded_load(sd: dict, folder: str, adapter) -> list[tuple[str, int, int]]:
    reads, real = [], shards.read_exact

    def recording(fd, bufs, offset, path):
        reads.append((path, offset, sum(len(b) for b in bufs)))
        real(fd, bufs, offset, path)

    shards.read_exact = recording
    try:
        load_hf(sd, folder, adapter)
    finally:
        shards.read_exact = real
    return reads


def _durable_dcp_save(sd: dict, folder: str) -> None:
    """A DCP save that returns once its data files are fsynced, as the HF export's are."""
    writer = storage.make_storage_writer(folder)
    dcp.save(sd, storage_writer=writer)
    writer.durable()


def _bench(rank: int, world: int, args: argparse.Namespace, results: dict) -> None:
    margs = model_args(args.experts, args.layers)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in Transformer(margs).state_dict().items()}
    adapter = hf_adapter(margs)
    hf_dir, dcp_dir = os.path.join(args.dir, "hf"), os.path.join(args.dir, "dcp")
    held = sum(v.to_local().nbytes for v in sd.values())
    save_hf(sd, hf_dir, adapter)  # warm-up, and the folder the loads read
    ranges = _recorded_load(sd, hf_dir, adapter)
    ratios = {"export": [], "import": []}
    for _ in range(args.rounds):
        clear(dcp_dir, rank)
        t_dcp, _ = measure(lambda: _durable_dcp_save(sd, dcp_dir))
        clear(hf_dir, rank)  # as for DCP: no earlier export to remove inside the timing
        t_hf, _ = measure(lambda: save_hf(sd, hf_dir, adapter))
        ratios["export"].append(t_hf / t_dcp)
        drop_cache(hf_dir)
        t_raw, _ = measure(lambda: read_ranges(ranges))
        drop_cache(hf_dir)
        t_load, _ = measure(lambda: load_hf(sd, hf_dir, adapter))
        ratios["import"].append(t_load / t_raw)
        if rank == 0:
            print(f"export {t_hf:.3f} s vs DCP {t_dcp:.3f} s; cold import {t_load:.3f} s vs raw {t_raw:.3f} s",
                  flush=True)
    read = sum(n for _, _, n in ranges)
    gathered = [None] * world
    dist.all_gather_object(gathered, (read, held))
    if rank == 0:
        results.update(export=statistics.median(ratios["export"]), load=statistics.median(ratios["import"]),
                       bytes=gathered)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        args.dir = tmp
        res = run_ranks(2, _bench, args, tmp)
    total = sum(r for r, _ in res["bytes"])
    print(f"Qwen3-MoE, {args.experts} experts x {args.layers} layers, EP = 2, {total / 1e9:.3f} GB read in all")
    print("| measure | median ratio | target |\n|---|---|---|")
    print(f"| HF export (one pass) / plain DCP save | {res['export']:.2f}x | <= 1.15x |")
    print(f"| cold HF import / raw read of the same bytes | {res['load']:.2f}x | <= 1.3x |")
    for rank, (read, held) in enumerate(res["bytes"]):
        print(f"| rank {rank}: bytes read / bytes held ({read / 1e6:.1f} MB / {held / 1e6:.1f} MB) "
              f"| {read / held:.3f}x | <= 1.1x |")


if __name__ == "__main__":
    main()
