"""The benchmark suite: save, cold resume and HF rows beside PyTorch's own path and the raw disk,
over state sizes, with a JSON of results, a markdown page and plots.

    python -m benchmarks [--sizes 0.4,0.8,1.6,3.2] [--repeats 5] [--quick] [--with async,paired,dedup,consolidation]
                         [--out benchmarks/results.json] [--doc docs/performance_suite.md] [--dir /tmp]

`--quick`: 0.4 and 0.8 GB, one repeat. `--with` also runs the other benchmarks of this folder
(each prints its own table, copied into the page); `--with paired` checks the three speed targets
at 1.6 GB in adjacent pairs over many rounds, which medians of 5 on a noisy disk cannot resolve.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import run_ranks
from benchmarks.suite import SIZES_GB, bench_size, model_args

RANKS = 2
# the other benchmarks, as the suite runs them: arguments sized so that the suite stays short
PLUGINS = {
    "async": ["benchmarks.async_save", "--repeats", "1"],
    "paired": ["benchmarks.paired", "--rounds", "12"],
    "dedup": ["benchmarks.dedup", "--ranks", "2", "--repeats", "1"],
    "consolidation": ["benchmarks.consolidation", "--layers", "3"],
}
TAKES_DIR = {"async", "dedup", "paired", "consolidation"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES_GB)), help="state sizes in GB")
    parser.add_argument("--repeats", type=int, default=5, help="runs per path and size; 5 because single runs on a shared disk spread 2x")
    parser.add_argument("--quick", action="store_true", help="0.4 and 0.8 GB, 1 repeat")
    parser.add_argument("--with", dest="plugins", default="", help=f"also run: {','.join(PLUGINS)}")
    parser.add_argument("--only", default="", help="only these save rows (and their loads), e.g. ours_save")
    parser.add_argument("--out", default="benchmarks/results.json")
    parser.add_argument("--from-json", default=None, help="measure nothing: rewrite the page from this JSON")
    parser.add_argument("--doc", default="docs/performance_suite.md")
    parser.add_argument("--img", default="docs/img")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats = "0.4,0.8", 1
    unknown = [p for p in args.plugins.split(",") if p and p not in PLUGINS]
    if unknown:
        parser.error(f"--with: unknown {unknown}; choose from {','.join(PLUGINS)}")
    return args


def run_sizes(args: argparse.Namespace) -> list[dict]:
    out = []
    only = {k for k in args.only.split(",") if k}
    for gb in (float(s) for s in args.sizes.split(",") if s):
        margs = model_args(gb)
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            t0 = time.perf_counter()
            result = dict(run_ranks(RANKS, bench_size, (margs, tmp, args.repeats, only), tmp))
        result["target_gb"] = gb
        result["wall_s"] = time.perf_counter() - t0
        print(f"[suite] {result['state_bytes'] / 1e9:.2f} GB ({margs.n_layers} layers): "
              f"{result['wall_s']:.0f} s", flush=True)
        out.append(result)
    return out


def run_plugins(names: list[str], folder: str | None) -> dict[str, str]:
    """Each plugin's printed table, run as its own `python -m` (as a user would run it), writing
    under `folder` (the suite's `--dir`) when given and the plugin takes a `--dir`."""
    tables = {}
    for name in names:
        t0 = time.perf_counter()
        where = ["--dir", folder] if folder and name in TAKES_DIR else []
        proc = subprocess.run([sys.executable, "-m", *PLUGINS[name], *where], capture_output=True, text=True)
        tables[name] = proc.stdout.strip() if proc.returncode == 0 else f"failed ({proc.returncode}):\n{proc.stderr[-2000:]}"
        print(f"[suite] --with {name}: {time.perf_counter() - t0:.0f} s\n{tables[name]}", flush=True)
    return tables


def _write_json(results: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    from benchmarks.suite_report import print_tables, write_doc

    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
        print_tables(results)
        write_doc(results, args.doc, args.img)
        return
    t0 = time.perf_counter()
    results = {"ranks": RANKS, "repeats": args.repeats, "cold": "posix_fadvise(POSIX_FADV_DONTNEED) after fsync",
               "loadavg_before": os.getloadavg(), "sizes": run_sizes(args)}
    results["loadavg_after"] = os.getloadavg()
    _write_json(results, args.out)  # before anything formats them: a formatting failure loses nothing
    print_tables(results)
    results["plugins"] = run_plugins([p for p in args.plugins.split(",") if p], args.dir)
    results["wall_s"] = time.perf_counter() - t0
    _write_json(results, args.out)
    write_doc(results, args.doc, args.img)
    print(f"[suite] {results['wall_s']:.0f} s in all; wrote {args.out}, {args.doc}, {args.img}/suite_*.png")


if __name__ == "__main__":
    main()
