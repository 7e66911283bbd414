"""The checkpoint's cost to training: the same training run with no checkpointing and with a save
every `--every` steps through each path, side by side, in paired rounds.

    python -m benchmarks.overhead [--ranks 2] [--flavor bench] [--saves 3] [--every 4] [--rounds 6]
                                  [--device cpu|cuda] [--batch 1] [--seq 64] [--dir /tmp/bench]
                                  [--paths disabled,async,async_with_pinned_mem,torch_checkpointing,dcp]

The example model (flavor `bench`: ~128M parameters, ~1.5 GB with AdamW state), FSDP-sharded over
gloo ranks on the CPU (or, with `--device cuda`, one GPU per rank with NCCL), trains
`(saves + 1) * every` steps after a warm-up save (writer processes and buffers are made once per
job). Paths:

- ours: `async_mode` `disabled`, `async`, `async_with_pinned_mem` (the optimizer's step waits for
  staging through the manager's step pre-hook: the loop calls nothing extra);
- `torch_checkpointing` (the `bench` extra; skipped when it is not installed): its async manager,
  configured and made durable as `benchmarks/peers.py` says; the optimizer's step runs under
  `manager.lock()` as its docs say;
- `dcp`: PyTorch's `dcp.async_save` in its process mode with its `DefaultStager` (shared memory,
  staging in the background, pinned only where there is a GPU); the optimizer's step waits for
  `staging_completion`.

On a shared machine a run's length drifts by more than a save costs, so each round runs every
path between two runs with no checkpointing (in an order that turns every round) and takes the
path's cost against the mean of the two around it: drift slower than a run cancels. Per path it
prints, per save: the training time lost (seconds, x a synchronous save, % of the run), how long
`save()` blocked, and the time from `save()` until the step is durable (ours: when rank 0's
commit returns, i.e. after the marker's fsync, rename and folder fsync, timed by the manager's
"saved step N" log record that `CheckpointManager` emits right after the commit; not the
marker's mtime, which is set before its fsync, rename and folder fsync and would flatter us; the
peers: when their write future completes), each against the synchronous save (ours, `disabled`) of the
same round; the median over rounds with a distribution-free 95% interval of it
(`paired.median_interval`; 6 rounds or more, else it is the whole range); and the most resident
memory a rank held beyond the run's start.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks import peers
from benchmarks.common import run_ranks
from benchmarks.paired import median_interval
from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.example.train import build_model, shard_model

OURS = ["disabled", "async", "async_with_pinned_mem"]
PATHS = [*OURS, "torch_checkpointing", "dcp"]


@dataclass
class Run:
    """One path's training run, as rank 0 saw it (times of every rank's slowest, by barriers)."""

    seconds: float = 0.0
    blocks: list[float] = field(default_factory=list)
    durable: list[float] = field(default_factory=list)
    extra_rss: int = 0


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _timed(step: int, args) -> bool:
    """Whether `step` is one of the run's timed saves (step `every` is each path's warm-up save:
    writer processes, buffers and plans are made once per job)."""
    return step % args.every == 0 and args.every < step <= args.every * (args.saves + 1)


def _synchronize() -> None:
    """Wait for the GPU's queued work (nothing on a CPU job), as a loop logging its loss does."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _train(model, opt, tokens, args, save: Callable[[int, float], bool], step_guard) -> Run:
    """The timed steps (after the warm-up save's), `save(step)` after each; the optimizer's step runs under
    `step_guard()` (what a path asks a loop to do before changing the state it stages);
    `save(step, wall-clock time)` says whether it saved. On a GPU each step ends with its work done
    (as a loop reading its loss ends), so `save()`'s time is its own."""
    run, start_rss = Run(), _rss()
    _synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(args.every + 1, args.every * (args.saves + 2) + 1):
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        with step_guard():
            opt.step()
        opt.zero_grad()
        _synchronize()
        before = time.perf_counter()
        wall = time.time()
        if save(step, wall):
            run.blocks.append(time.perf_counter() - before)
        run.extra_rss = max(run.extra_rss, _rss() - start_rss)
    _synchronize()
    dist.barrier()
    run.seconds = time.perf_counter() - t0
    return run


class _NoGuard:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class _CommitTimes(logging.Handler):
    """The wall-clock time of each step's "saved step N" record, which the manager logs on rank 0
    once `_commit` has returned: every data file fsynced, the marker fsynced, renamed into place
    and its folder fsynced. The step is durable by then (a little later than the exact moment,
    never earlier)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.times: dict[int, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith("saved step ") and record.args:
            self.times.setdefault(int(record.args[0]), record.created)


def _ours(model, opt, tokens, args, mode: str) -> Run:
    config = load_job_config(None, ["--checkpoint.enable", "true", "--checkpoint.interval", str(args.every),
                                    "--checkpoint.keep_latest_k", "0", "--checkpoint.async_mode", mode])
    folder = os.path.join(args.dir, mode)
    started: dict[int, float] = {}

    def save(step: int, wall: float) -> bool:
        if _timed(step, args) and manager.save(step):
            started[step] = wall
            return True
        return False

    committed = _CommitTimes()
    log = logging.getLogger("torchtitan_ckpt.manager")
    level = log.level
    log.addHandler(committed)
    log.setLevel(logging.INFO)
    try:
        with CheckpointManager(config.checkpoint, [model], optimizers=opt, base_folder=folder) as manager:
            manager.save(args.every)
            manager.wait()
            run = _train(model, opt, tokens, args, save, _NoGuard)
    finally:
        log.removeHandler(committed)
        log.setLevel(level)
    if dist.get_rank() == 0:  # the commit (and its log record) is rank 0's
        if missing := sorted(set(started) - set(committed.times)):
            raise RuntimeError(f"{mode}: no commit seen for steps {missing}")
        run.durable = [committed.times[s] - t for s, t in started.items()]
    dist.barrier()
    shutil.rmtree(folder, ignore_errors=True)
    return run


def _torch_checkpointing(model, opt, tokens, args) -> Run:
    manager = peers.torch_checkpointing_manager(asynchronous=True)
    return _peer(model, opt, tokens, args, "torch_checkpointing",
                 lambda path: manager.save(path, peers.payload(model, opt)), manager.lock, manager.close)


def _dcp(model, opt, tokens, args) -> Run:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    gpu = torch.accelerator.is_available()
    stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_non_blocking_copy=gpu))
    staging: list = []

    def save(path: str):
        msd, osd = get_state_dict(model, opt)
        response = dcp.async_save({"model": msd, "optimizer": osd}, checkpoint_id=path,
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)
        staging[:] = [response.staging_completion]
        return response.upload_completion

    class WaitForStaging(_NoGuard):
        def __enter__(self):
            for future in staging:
                future.result()

    return _peer(model, opt, tokens, args, "dcp", save, WaitForStaging, stager.close)


def _peer(model, opt, tokens, args, name: str, submit, guard, close) -> Run:
    """A peer's run: `submit(path)` returns the future of the step's write."""
    folder = os.path.join(args.dir, name)
    os.makedirs(folder, exist_ok=True)
    done: dict[int, float] = {}
    started: dict[int, float] = {}
    pending: list = []

    def save(step: int, wall: float) -> bool:
        if not _timed(step, args):
            return False
        for future in pending:  # one save in flight, as every path here
            future.result()
        future = submit(os.path.join(folder, f"step-{step}"))
        future.add_done_callback(lambda _f, step=step: done.__setitem__(step, time.time()))
        started[step], pending[:] = wall, [future]
        return True

    try:
        submit(os.path.join(folder, f"step-{args.every}")).result()  # warm-up
        run = _train(model, opt, tokens, args, save, guard)
        for future in pending:
            future.result()
    finally:
        close()
    run.durable = [done[s] - t for s, t in started.items()]
    dist.barrier()
    shutil.rmtree(folder, ignore_errors=True)
    return run


def _run(path: str, model, opt, tokens, args) -> Run:
    if path == "none":
        return _train(model, opt, tokens, args, lambda step, wall: False, _NoGuard)
    if path in OURS:
        return _ours(model, opt, tokens, args, path)
    return (_torch_checkpointing if path == "torch_checkpointing" else _dcp)(model, opt, tokens, args)


def _bench(rank: int, world: int, args, results: dict) -> None:
    config = load_job_config(None, ["--model.flavor", args.flavor])
    model = build_model(config).to(args.device)
    shard_model(model, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    tokens = torch.randint(0, model.args.vocab_size, (args.batch, args.seq), device=args.device)
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()  # optimizer state exists
    opt.step()
    opt.zero_grad()
    paths = args.paths.split(",")
    rounds = []
    for r in range(args.rounds):
        runs = {"none": _run("none", model, opt, tokens, args)}
        for path in paths[r % len(paths):] + paths[:r % len(paths)]:
            runs[path] = _run(path, model, opt, tokens, args)
            runs[f"none after {path}"] = _run("none", model, opt, tokens, args)
        rounds.append({key: vars(run) for key, run in runs.items()})
    if rank == 0:
        results["rounds"] = rounds


def _before(round_: dict, path: str) -> dict:
    """The run with no checkpointing right before `path`'s in its round."""
    keys = list(round_)
    return round_[keys[keys.index(path) - 1]]


def per_round(round_: dict, path: str, saves: int) -> dict[str, float]:
    """One round's figures for `path`, each paired with that round's runs around it."""
    run, sync = round_[path], statistics.median(round_["disabled"]["blocks"])
    base = (_before(round_, path)["seconds"] + round_[f"none after {path}"]["seconds"]) / 2
    lost = (run["seconds"] - base) / saves
    return {"lost": lost, "lost_x": lost / sync, "lost_pct": 100 * lost * saves / base,
            "block": statistics.median(run["blocks"]), "block_x": statistics.median(run["blocks"]) / sync,
            "durable": statistics.median(run["durable"]), "durable_x": statistics.median(run["durable"]) / sync,
            "sync": sync, "base": base, "rss": run["extra_rss"]}


def _cell(values: list[float], fmt: str) -> str:
    """The median over rounds, with its 95% interval."""
    low, high = median_interval(values)
    return f"{format(statistics.median(values), fmt)} ({format(low, fmt)} to {format(high, fmt)})"


_COLUMNS = [("lost", ".2f", 1), ("lost_x", ".2f", 1), ("lost_pct", ".1f", 1), ("block", ".1f", 1000),
            ("block_x", ".4f", 1), ("durable", ".2f", 1), ("durable_x", ".2f", 1)]
"""The table's columns of `per_round` figures: key, format, scale."""


def print_table(results: dict, args) -> None:
    rounds = results["rounds"]
    paths = [p for p in PATHS if p in rounds[0]]
    figures = {p: [per_round(r, p, args.saves) for r in rounds] for p in paths}
    sync = [f["sync"] for f in figures["disabled"]]
    where = f"{args.ranks} GPUs ({torch.cuda.get_device_name()})" if args.device == "cuda" else f"{args.ranks} ranks"
    print(f"\ncheckpoint cost to training: {args.flavor} on {where}, {args.batch} x {args.seq} tokens a step, "
          f"a save every {args.every} steps, "
          f"{args.saves} saves per run, {len(rounds)} rounds; run with no checkpointing "
          f"{_cell([f['base'] for f in figures['disabled']], '.1f')} s, synchronous save {_cell(sync, '.2f')} s "
          "(median over rounds, 95% interval)\n")
    print("| path | training lost / save | x sync save | % of run | save() returns in | x sync save | "
          "durable after | x sync save | extra memory / rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path, f in figures.items():
        cells = [_cell([x[key] * scale for x in f], fmt) for key, fmt, scale in _COLUMNS]
        print(f"| {path} | {cells[0]} s | {cells[1]} | {cells[2]}% | {cells[3]} ms | {cells[4]} | {cells[5]} s | "
              f"{cells[6]} | {max(x['rss'] for x in f) / 1e9:.2f} GB |")
    between = statistics.median(f["base"] for f in figures["disabled"]) / (args.saves + 1)
    if args.saves > 1 and (overlapped := [p for p, f in figures.items()
                                          if statistics.median(x["durable"] for x in f) > between]):
        print(f"\nnote: {', '.join(overlapped)} took longer to be durable than the {between:.2f} s of training "
              f"between saves: a save waited for the one before it (one save in flight on every path), and "
              f"that wait is in its figures; a larger --every shows the overlap alone")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--flavor", default="bench")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (sets a step's compute)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model trains: cuda puts rank r on GPU r (NCCL)")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--every", type=int, default=4, help="steps between saves")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of paired runs (the interval needs 6)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"of {','.join(PATHS)}; needs disabled")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = parser.parse_args()
    paths = args.paths.split(",")
    if "disabled" not in paths or not set(paths) <= set(PATHS):
        parser.error(f"--paths: some of {','.join(PATHS)}, with disabled (each path is compared with it)")
    if "torch_checkpointing" in paths and not peers.have_torch_checkpointing():
        args.paths = ",".join(p for p in paths if p != "torch_checkpointing")
        print("torch_checkpointing is not installed (pip install -e .[bench]): its row is skipped")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        args.dir = tmp
        print_table(dict(run_ranks(args.ranks, _bench, args, tmp, device=args.device)), args)


if __name__ == "__main__":
    main()
