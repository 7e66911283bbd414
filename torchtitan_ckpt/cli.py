"""`torchtitan-ckpt`: look at checkpoints from the shell.

    torchtitan-ckpt list DIR          every step folder, complete or not, its size and contents
    torchtitan-ckpt inspect STEP_DIR  the states, tensors, dtypes, shapes and bytes of one step
    torchtitan-ckpt verify STEP_DIR   check every file against the sizes and CRC-32s of its commit
    torchtitan-ckpt clean DIR         remove the partial step folders crashed saves of ours left behind
    torchtitan-ckpt convert --to hf STEP_DIR OUT_DIR | --to dcp HF_DIR OUT_DIR
    torchtitan-ckpt consolidate IN_DIR OUT_DIR   per-rank HF shard files -> final safetensors files
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections import defaultdict

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import commit, layout
from .dcp import storage
from .hf.consolidate import add_consolidate_parser, run_consolidate
from .errors import CheckpointError
from .hf.convert import add_convert_parser, run_convert


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def cmd_list(folder: str) -> int:
    if not os.path.isdir(folder):
        print(f"error: {folder} is not a folder", file=sys.stderr)
        return 2
    steps = layout.scan(folder)
    if not steps:
        print(f"{folder}: no step folders")
        return 0
    print(f"{'step':>8}  {'status':<10}  {'size':>10}  contents")
    for s in steps:
        print(f"{s.step:>8}  {s.status:<10}  {_fmt_bytes(layout.folder_bytes(s.path)):>10}  {_contents(s)}")
    return 0


def _contents(s: layout.StepFolder) -> str:
    if s.status == layout.COMPLETE:
        info = commit.read_marker(s.path)
        return f"{info.format}: {', '.join(info.states)}"
    if s.status == layout.PARTIAL:
        return f"no {commit.MARKER}: a save that did not finish; never loaded"
    if s.status == layout.FOREIGN:
        return f"{layout.foreign_format(s.path)}: not written here; loadable, unverified, never deleted"
    return "not written here, not a finished checkpoint: never loaded, never deleted"


def _state_of(key: str, states: list[str]) -> str:
    head = key.split(".", 1)[0]
    return head if head in states else "model"


def cmd_inspect(path: str) -> int:
    md_path = os.path.join(path, storage.METADATA_FILE)
    if not os.path.isfile(md_path):
        print(f"error: {path} is not a DCP checkpoint folder (no {storage.METADATA_FILE})", file=sys.stderr)
        return 2
    info = commit.read_marker(path) if commit.is_committed(path) else None
    metadata = storage.read_metadata(md_path)
    states = info.states if info else sorted({k.split(".", 1)[0] for k in metadata.state_dict_metadata})
    status = f"complete, step {info.step}, saved by {info.world_size} rank(s)" if info else "no commit marker"
    print(f"{path}: {status}")
    by_state: dict[str, list[tuple[str, object]]] = defaultdict(list)
    for key, md in sorted(metadata.state_dict_metadata.items()):
        by_state[_state_of(key, states)].append((key, md))
    for state, items in by_state.items():
        total = 0
        print(f"\n[{state}]")
        for key, md in items:
            if isinstance(md, TensorStorageMetadata):
                nbytes = md.size.numel() * md.properties.dtype.itemsize
                total += nbytes
                dtype = str(md.properties.dtype).removeprefix("torch.")
                print(f"  {key:<60} {dtype:<9} {str(list(md.size)):<16} {_fmt_bytes(nbytes):>10}")
            else:
                print(f"  {key:<60} {'object':<9}")
        print(f"  {'total tensor bytes':<60} {'':<9} {'':<16} {_fmt_bytes(total):>10}")
    return 0


def cmd_verify(path: str, threads: int) -> int:
    if not commit.is_committed(path):
        print(f"error: {path} has no {commit.MARKER}: not a complete step", file=sys.stderr)
        return 2
    info = commit.read_marker(path)
    problems = commit.verify(path, threads=threads)
    for problem in problems:
        print(f"CORRUPT {problem}")
    if problems:
        return 1
    print(f"{path}: {len(info.files)} files, {_fmt_bytes(info.total_bytes)}, all intact")
    return 0


def cmd_clean(folder: str) -> int:
    """Run it while no job writes to `folder`: a save in flight looks partial too. Only folders
    this package started writing are removed; another program's are listed and kept."""
    if not os.path.isdir(folder):
        print(f"error: {folder} is not a folder", file=sys.stderr)
        return 2
    steps = layout.scan(folder)
    for s in steps:
        if not s.ours:
            print(f"kept {s.path} ({s.status}: not written by torchtitan_ckpt)")
    partial = [s for s in steps if s.status == layout.PARTIAL]
    for s in partial:
        shutil.rmtree(s.path)
        print(f"removed {s.path} (partial)")
    print(f"{len(partial)} partial step folder(s) removed")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchtitan-ckpt", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="list the step folders of a checkpoint folder")
    p.add_argument("folder")
    p = sub.add_parser("inspect", help="show what one step folder holds")
    p.add_argument("step_dir")
    p = sub.add_parser("verify", help="check a step's files against its commit manifest")
    p.add_argument("step_dir")
    p.add_argument("--threads", type=int, default=4, help="files checked at once")
    p = sub.add_parser("clean", help="remove partial step folders (run while no job is saving)")
    p.add_argument("folder")
    add_convert_parser(sub)
    add_consolidate_parser(sub)
    args = parser.parse_args(argv)
    commands = {
        "list": lambda: cmd_list(args.folder),
        "inspect": lambda: cmd_inspect(args.step_dir),
        "verify": lambda: cmd_verify(args.step_dir, args.threads),
        "clean": lambda: cmd_clean(args.folder),
        "convert": lambda: run_convert(args),
        "consolidate": lambda: run_consolidate(args),
    }
    try:
        return commands[args.command]()
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
