"""What the load's checks of a hostile or damaged checkpoint cost (docs/reliability.md).

    python -m benchmarks.load_checks [--tensors 5000] [--chunks 8] [--files 8] [--items 4000] [--item-kb 64]

Two parts. `.metadata` of `--tensors` tensors of `--chunks` chunks each (one storage entry per
chunk, spread over `--files` data files, as a 2-D sharding of `--chunks` ranks writes them): the
time of unpickling it with the allow-list, of `validate.check_metadata` (fields, bounds, chunk
coverage, file names) and of opening each data file by the `safe_open` rule. Then a real DCP
step of `--items` tensors of `--item-kb` KB each: the time of the reader's first pass (every item
checked, nothing written) against its second (the bytes read into the tensors), and of
`verify_on_load`'s pass (the CRC-32 of every file, before the read), warm page cache, one
thread. Absolute times on a shared machine are noise; read the ratios.
"""

from __future__ import annotations

import argparse
import os
import pickle
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from torchtitan_ckpt import commit
from torchtitan_ckpt.dcp import storage
from torchtitan_ckpt.dcp.metadata import METADATA_FILE, read_metadata
from torchtitan_ckpt.dcp.validate import check_metadata
from torchtitan_ckpt.io import reader, safe_open


def _metadata(tensors: int, chunks: int, files: int, root: str) -> Metadata:
    """Tensors of 4096 x 1024 cut into `chunks` row blocks, chunk k in file k % files."""
    rows, cols, entries, places, ends = 4096, 1024, {}, {}, [0] * files
    for t in range(tensors):
        key, block = f"layers.{t // 16}.w{t % 16}", rows // chunks
        parts = [ChunkStorageMetadata(torch.Size([k * block, 0]), torch.Size([block, cols])) for k in range(chunks)]
        entries[key] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([rows, cols]), parts)
        for k, part in enumerate(parts):
            f, length = k % files, block * cols * 2 + 1024
            places[MetadataIndex(key, part.offsets)] = _StorageInfo(f"__{f}_0.distcp", ends[f], length)
            ends[f] += length
    for f, end in enumerate(ends):  # sparse files of the sizes the entries claim
        with open(os.path.join(root, f"__{f}_0.distcp"), "wb") as out:
            out.truncate(end)
    return Metadata(state_dict_metadata=entries, storage_data=places)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def metadata_checks(args: argparse.Namespace, root: str) -> None:
    md = _metadata(args.tensors, args.chunks, args.files, root)
    path = os.path.join(root, METADATA_FILE)
    with open(path, "wb") as f:
        pickle.dump(md, f)
    names = sorted({info.relative_path for info in md.storage_data.values()})
    n = len(md.storage_data)
    print(f".metadata: {args.tensors} tensors x {args.chunks} chunks = {n} entries, "
          f"{os.path.getsize(path) / 1e6:.1f} MB, {len(names)} data files")
    def unpickle() -> None:
        with open(path, "rb") as f:
            pickle.load(f)

    plain = _timed(unpickle)
    checked = _timed(lambda: read_metadata(path))
    fields = _timed(lambda: check_metadata(md, root, path))
    opened = _timed(lambda: [os.close(safe_open.open_fd(root, name, "a data file")) for name in names])
    print(f"  plain pickle.load                {plain:7.3f} s")
    print(f"  read_metadata (allow-list+checks){checked:7.3f} s   {checked / plain:5.2f}x plain")
    print(f"  of which check_metadata          {fields:7.3f} s   {fields / n * 1e6:6.1f} us per entry")
    print(f"  safe_open of every data file     {opened:7.4f} s   {opened / len(names) * 1e6:6.1f} us per file")


def _passes(passes: reader.ItemReader, items: list, planner) -> tuple[float, float]:
    """Seconds of the reader's first pass over `items`, then of its second."""
    try:
        return _timed(lambda: passes.check(items, planner)), _timed(lambda: passes.fill(planner))
    finally:
        passes.close()


def reader_passes(args: argparse.Namespace, root: str) -> None:
    numel = args.item_kb * 1024 // 4
    state = {f"t{i}": torch.randn(numel) for i in range(args.items)}
    dcp.save(state, storage_writer=storage.make_storage_writer(root))
    md = read_metadata(os.path.join(root, METADATA_FILE))
    planner = storage.make_load_planner()
    planner.set_up_planner({k: torch.empty_like(v) for k, v in state.items()}, md, True)
    items = planner.create_local_plan().items
    runs = [_passes(reader.ItemReader(root, md.storage_data, 1), items, planner) for _ in range(3)]
    best = {"check": min(r[0] for r in runs), "fill": min(r[1] for r in runs)}  # the first warms the cache
    commit.write_marker(root, commit.CommitInfo(step=0, states=["model"]))
    verify = min(_timed(lambda: commit.verify(root, threads=1)) for _ in range(3))
    total = args.items * args.item_kb / 1e6
    print(f"reader: {args.items} tensors of {args.item_kb} KB ({total:.2f} GB), one thread, best of 3")
    print(f"  first pass (check every item)   {best['check']:7.3f} s   {best['check'] / args.items * 1e6:6.1f} us per item")
    print(f"  second pass (read the bytes)    {best['fill']:7.3f} s   {total / best['fill']:.2f} GB/s")
    print(f"  checks / whole read             {best['check'] / (best['check'] + best['fill']):7.1%}")
    print(f"  verify_on_load's CRC-32 pass    {verify:7.3f} s   {verify / (best['check'] + best['fill']):5.2f}x the read")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=5000)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--items", type=int, default=4000)
    parser.add_argument("--item-kb", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        metadata_checks(args, root)
    with tempfile.TemporaryDirectory() as root:
        reader_passes(args, root)


if __name__ == "__main__":
    main()
