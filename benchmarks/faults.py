"""The long fault-injection run: kill a 2-rank job again and again during saves, and check it loses
nothing and ends exactly where an uninterrupted run ends.

    python -m benchmarks.faults [--kills 30] [--seed 0] [--steps 80]

One uninterrupted run of the example job is the reference. Then the same job is started over and
over in one folder, each time with a fail point (`torchtitan_ckpt.faults`) that SIGKILLs one rank
or every rank at a random phase of a random upcoming save (or of the purge of an old step); the
`staging` phase runs the job with `async_mode = "async"`; the job also exports a Hugging Face copy
every 4 steps, which the `consolidate` phase interrupts. After every kill it checks that the
newest `keep_latest_k` complete steps are still complete and intact (`verify`), and that the next
run loads the newest complete step and never a partial one. The last run goes to the end; its
final checkpoint and losses must equal the reference bit for bit. Prints one line per kill and a
summary.

Only the phases that can fire on a local folder are drawn (`LOCAL_PHASES`: not `upload`, which
only object storage reaches). A fail point that was not reached (its run trained to the end) is
retried with another one, the folder first put back as it was before that run. Exits non-zero
when fewer kills fired than `--kills` asked, or when the final run trained no step (its losses
would then be identical vacuously).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from torchtitan_ckpt import commit, faults, layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "debug_model.toml")
INTERVAL, KEEP, HF_EVERY = 2, 3, 4
# phases a save to a local folder reaches: `upload` is object storage's alone (storage/s3.py)
S3_ONLY_PHASES = ("upload",)
LOCAL_PHASES = tuple(p for p in faults.PHASES if p not in S3_ONLY_PHASES)


@dataclass
class Kill:
    number: int
    failpoint: str
    fired: bool
    crashed: str = ""
    """Set when the run failed without the fail point's SIGKILL: the reason, from its log."""
    resumed_from: int | None = None
    lost: list[int] | None = None
    loaded_partial: bool = False


def run(dump: str, steps: int, failpoint: str | None = None, async_mode: str = "disabled") -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "torchtitan_ckpt.example.train", "--config", CONFIG, "--job.dump_folder", dump,
           "--training.steps", str(steps), "--checkpoint.interval", str(INTERVAL),
           "--checkpoint.keep_latest_k", str(KEEP), "--checkpoint.last_save_model_only", "false",
           "--checkpoint.export_dtype", "float32", "--checkpoint.async_mode", async_mode,
           "--checkpoint.hf_export_interval", str(HF_EVERY)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(faults.ENV, None)
    if failpoint:
        env[faults.ENV] = failpoint
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def complete_steps(folder: str) -> list[int]:
    return layout.committed_steps(folder)


def choose_failpoint(rng: random.Random, resume: int, steps: int) -> tuple[str, str]:
    """A random phase (of `LOCAL_PHASES`) of a random upcoming save (or purge), on one rank or
    all, at a step before `steps` so that the final run always has steps left to train."""
    phase = rng.choice(LOCAL_PHASES)
    while phase == "purge" and max(INTERVAL, min(steps - 1, resume + INTERVAL) - INTERVAL * KEEP) \
            + INTERVAL * KEEP >= steps:  # no purge before the last step: another phase
        phase = rng.choice([p for p in LOCAL_PHASES if p != "purge"])
    step = min(steps - 1, resume + INTERVAL * rng.randint(1, 3))
    step -= step % INTERVAL
    if phase == "purge":  # the step deleted when `step` commits (a step before the last)
        step = max(INTERVAL, step - INTERVAL * KEEP)
        while step > INTERVAL and step + INTERVAL * KEEP >= steps:
            step -= INTERVAL
    if phase == "consolidate":  # an HF copy (hf_export_interval) being written
        step = min((steps - 1) - (steps - 1) % HF_EVERY, resume + HF_EVERY - resume % HF_EVERY)
    # prepare, commit and purge run on rank 0 alone; the others on every rank
    rank = rng.choice(["", ":0", ":1"]) if phase in ("staging", "write", "written", "consolidate") \
        else rng.choice(["", ":0"])
    return f"{phase}@{step}{rank}", "async" if phase == "staging" else "disabled"


def losses(log: str) -> dict[int, str]:
    return {int(s): v for s, v in re.findall(r"step (\d+) loss (\S+)", log)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        ref_dump, dump = os.path.join(tmp, "reference"), os.path.join(tmp, "faulty")
        code, ref_log = run(ref_dump, args.steps)
        if code:
            raise SystemExit(f"the reference run failed:\n{ref_log[-3000:]}")
        folder = os.path.join(dump, "checkpoint")
        snapshot = os.path.join(tmp, "before")
        kills: list[Kill] = []
        attempts = 0
        while len([k for k in kills if k.fired]) < args.kills and attempts < 3 * args.kills + 10:
            before = complete_steps(folder)
            resume = before[-1] if before else 0
            if resume >= args.steps - INTERVAL:
                break
            attempts += 1
            shutil.rmtree(snapshot, ignore_errors=True)
            if os.path.isdir(dump):
                shutil.copytree(dump, snapshot, symlinks=True)
            failpoint, mode = choose_failpoint(rng, resume, args.steps)
            code, log = run(dump, args.steps, failpoint, mode)
            kill = Kill(len(kills) + 1, failpoint, fired=code != 0 and "(SIGKILL)" in log)
            if code != 0 and not kill.fired:
                errors = [line for line in log.splitlines() if "Error" in line]
                kill.crashed = errors[-1][:300] if errors else log[-300:]
            kill.resumed_from = _loaded_step(log)
            kill.loaded_partial = kill.resumed_from is not None and kill.resumed_from not in before
            after = complete_steps(folder)
            # a step retention may delete is one no longer among the newest KEEP complete steps
            oldest_kept = after[-KEEP:][0] if after else 0
            kill.lost = [s for s in before[-KEEP:] if s not in after and s >= oldest_kept]
            kill.lost += [s for s in after if commit.verify(layout.step_dir(folder, s))]
            kills.append(kill)
            status = "killed" if kill.fired else (f"CRASHED: {kill.crashed}" if kill.crashed else "not reached")
            print(f"kill {kill.number:2d}: {failpoint:<14} {status}; "
                  f"resumed from {kill.resumed_from}; lost {kill.lost or 'none'}; "
                  f"{'LOADED A PARTIAL STEP' if kill.loaded_partial else 'loaded a complete step'}", flush=True)
            if code == 0:  # not reached: the run trained to the end; put the folder back and draw again
                shutil.rmtree(dump, ignore_errors=True)
                if os.path.isdir(snapshot):
                    shutil.copytree(snapshot, dump, symlinks=True)
        code, final_log = run(dump, args.steps)
        if code:
            raise SystemExit(f"the final run failed:\n{final_log[-3000:]}")
        return _summary(kills, ref_log, final_log, ref_dump, dump, args.steps, args.kills)


def _loaded_step(log: str) -> int | None:
    m = re.search(r"loaded step (\d+) from ", log)
    return int(m.group(1)) if m else None


def _summary(kills, ref_log, final_log, ref_dump, dump, steps, asked: int = 0) -> int:
    from tests.helpers import read_checkpoint  # the same exact reader the tests use

    ref = read_checkpoint(layout.step_dir(os.path.join(ref_dump, "checkpoint"), steps))
    got = read_checkpoint(layout.step_dir(os.path.join(dump, "checkpoint"), steps))
    identical = sorted(ref) == sorted(got) and all(
        (ref[k] == got[k]).all() if hasattr(ref[k], "shape") else ref[k] == got[k] for k in ref)
    ref_losses, final_losses = losses(ref_log), losses(final_log)
    same_losses = bool(final_losses) and all(ref_losses.get(s) == v for s, v in final_losses.items())
    fired = [k for k in kills if k.fired]
    by_phase: dict[str, int] = {}
    for k in fired:
        phase = k.failpoint.split("@")[0]
        by_phase[phase] = by_phase.get(phase, 0) + 1
    lost = sum(len(k.lost) for k in kills)
    partial = sum(k.loaded_partial for k in kills)
    crashed = [k for k in kills if k.crashed]
    print(f"\n{len(fired)} kills ({', '.join(f'{p}: {n}' for p, n in sorted(by_phase.items()))}); "
          f"{sum(1 for k in fired if k.failpoint.endswith((':0', ':1')))} of one rank, the rest of both")
    print(f"runs that failed without a kill: {len(crashed)}; fail points not reached (retried): "
          f"{sum(1 for k in kills if not k.fired and not k.crashed)}")
    if len(fired) < asked:
        print(f"FEWER KILLS THAN ASKED: {len(fired)} of {asked}")
    if not final_losses:
        print("THE FINAL RUN TRAINED NO STEP: nothing to compare the losses of")
    print(f"lost complete steps: {lost}; loads of a partial step: {partial}; final checkpoint "
          f"{'bit-identical' if identical else 'DIFFERENT'}; losses after the last resume "
          f"{'identical' if same_losses else ('DIFFERENT' if final_losses else 'NOT COMPARED')}")
    return 0 if (lost == 0 and partial == 0 and not crashed and identical and same_losses
                 and len(fired) >= asked) else 1


if __name__ == "__main__":
    sys.exit(main())
