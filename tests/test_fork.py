"""A training process that forks (a DataLoader's fork workers, a multiprocessing pool, `os.fork`)
or pickles what it holds (spawn and forkserver workers): the child's copy of the manager is not a
manager of its own. Each script runs in a process of its own: forking the test process would fork
pytest's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD_USES_THE_MANAGER = """
import os, pickle, select, sys, threading, torch
from torchtitan_ckpt import CheckpointError, CheckpointManager, layout
from torchtitan_ckpt.config import Checkpoint
folder, mode = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)  # torch's compute in a forked child hangs on the parent's thread pool otherwise
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
opt = torch.optim.AdamW(model.parameters())
manager = CheckpointManager(Checkpoint(enable=True, folder=folder, interval=1, async_mode=mode), [model],
                            optimizers=opt)
model(torch.randn(2, 64)).sum().backward()
opt.step()
manager.save(1)
manager.wait()
gate = threading.Event()
if mode != "disabled":  # the background threads held: the next save's copy waits behind them
    held = [manager._saves._pool.submit(gate.wait) for _ in range(2)]
manager.save(2)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    out = []
    opt.step()  # the child's own copy of the state: it waited forever for the parent's copy
    out.append("stepped")
    for name, call in [("save", lambda: manager.save(3)), ("load", manager.load), ("wait", manager.wait),
                       ("maybe_wait_for_staging", manager.maybe_wait_for_staging)]:
        try:
            call()
            out.append(name + " ran")
        except CheckpointError as e:
            out.append(str(e).split(" process")[0])
    out.append(f"in flight: {manager.save_in_flight}")
    os.write(w, "|".join(out).encode())
    os._exit(0)
os.close(w)
ready = select.select([r], [], [], 30)[0]
print(os.read(r, 65536).decode() if ready else "the child hung")
gate.set()
if not ready:
    os.kill(pid, 9)
os.waitpid(pid, 0)
manager.wait()
try:
    pickle.dumps(manager)
except TypeError as e:
    print(str(e).split(" (")[0])
manager.close()
print(layout.committed_steps(folder))
"""


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_a_forked_child_steps_its_own_state_and_its_copy_of_the_manager_refuses_calls(tmp_path, mode):
    """A child's save() committed a step in the parent's folder (sync) or waited forever for the
    parent's background thread (async); its optimizer step waited forever for the parent's copy."""
    run = subprocess.run([sys.executable, "-c", _CHILD_USES_THE_MANAGER, str(tmp_path / "ckpt"), mode],
                         capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr
    child, pickled, steps = run.stdout.splitlines()
    belongs = "(): this CheckpointManager belongs to"
    assert child.split("|") == ["stepped", f"save{belongs}", f"load{belongs}", f"wait{belongs}",
                                f"maybe_wait_for_staging{belongs}", "in flight: False"], child
    assert pickled == "a CheckpointManager cannot be sent to another process"
    assert steps == "[1, 2]"


_CHILD_EXITS = """
import os, sys, torch
from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import Checkpoint
manager = CheckpointManager(Checkpoint(enable=True, folder=sys.argv[1], interval=1,
                                       async_mode="async_with_pinned_mem"), [torch.nn.Linear(8, 8)])
manager.save(1)
manager.wait()
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the interpreter's exit hooks run in the child
print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
manager.close()
"""


def test_a_child_forked_beside_a_writer_process_exits_cleanly(tmp_path):
    """`multiprocessing`'s exit hook in a child made by `os.fork` tried to join the parent's writer
    process ("AssertionError: can only join a child process"), and the hooks after it (a
    `multiprocessing.Queue`'s flush) never ran."""
    run = subprocess.run([sys.executable, "-c", _CHILD_EXITS, str(tmp_path / "ckpt")], capture_output=True,
                         text=True, timeout=240, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0 and run.stdout.split() == ["child", "0"], run.stdout + run.stderr
    assert "Traceback" not in run.stderr and "AssertionError" not in run.stderr, run.stderr


_FILE_SYSTEM_SHARING = """
import os, sys, logging, torch, torch.multiprocessing
torch.multiprocessing.set_sharing_strategy("file_system")  # a usual cure of a data loader's "too many open files"
from torchtitan_ckpt import CheckpointManager, layout
from torchtitan_ckpt.config import Checkpoint
logging.basicConfig(level=logging.CRITICAL)
torch.set_num_threads(1)

def train():
    model = torch.nn.Linear(64, 64)
    config = Checkpoint(enable=True, folder=sys.argv[1], interval=1, async_mode="async_with_pinned_mem")
    with CheckpointManager(config, [model]) as manager:
        for step in range(1, 4):
            if step == 2 and os.fork() == 0:  # a helper that exits through the frames holding the manager
                sys.exit(0)
            if step == 2:
                os.wait()
            try:
                manager.save(step)
                manager.wait()
            except Exception as e:
                print("step", step, type(e).__name__)

train()
print("committed", layout.committed_steps(sys.argv[1]))
"""


def test_a_child_that_exits_frees_nothing_the_writer_process_maps_under_file_system_sharing(tmp_path):
    """With torch's `file_system` sharing strategy the staging memory was shared by name, counted
    by the processes using it: a forked child exiting (its copy of the manager freed) unlinked
    it, and every later save's writer failed to open it ("the checkpoint writer process exited
    (exit code -9)") until the process restarted."""
    run = subprocess.run([sys.executable, "-c", _FILE_SYSTEM_SHARING, str(tmp_path / "ckpt")], capture_output=True,
                         text=True, timeout=240, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == ["committed [1, 2, 3]"], run.stdout + run.stderr[-3000:]


_ENDS_AT_ONCE = """
import os, sys, torch
from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import Checkpoint
config = Checkpoint(enable=True, folder=sys.argv[1], interval=1, async_mode="async_with_pinned_mem")
with CheckpointManager(config, [torch.nn.Linear(64, 64)]) as manager:
    manager.save(1)
sys.stdout.flush()
os._exit(0)  # as a torchrun rank ends (`group.leave`), or one killed: no exit hook runs
"""


def test_handing_the_staged_state_to_the_writer_leaves_no_socket_folder_behind(tmp_path):
    """The staged memory was handed over through `multiprocessing`'s fd server, which makes a
    `pymp-*` folder holding a socket in the temporary folder that only an exit hook removes: each
    rank of each torchrun run (which ends without them), and each killed one, left one."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run = subprocess.run([sys.executable, "-c", _ENDS_AT_ONCE, str(tmp_path / "ckpt")], capture_output=True,
                         text=True, timeout=240, env={**os.environ, "PYTHONPATH": ROOT, "TMPDIR": str(tmp)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert os.listdir(tmp_path / "ckpt") and os.listdir(tmp) == []


_FORKS_WHILE_THE_WRITER_STARTS = """
import multiprocessing.spawn, os, signal, sys, tempfile, time, torch
from torchtitan_ckpt.io.filewriter import Entry, FileJob
from torchtitan_ckpt.io.writer_process import WriterProcess
kids, before = [], multiprocessing.spawn.get_preparation_data
def forking(name):  # another thread's fork (a data loader's worker) while the writer starts
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    kids.append(pid)
    return before(name)
multiprocessing.spawn.get_preparation_data = forking
writer = WriterProcess()
multiprocessing.spawn.get_preparation_data = before
writer([FileJob(os.path.join(sys.argv[1], "a"), [Entry("k", torch.zeros(4), None)])])
start = time.monotonic()
writer.close()
print("closed in", "under 10 s" if time.monotonic() - start < 10 else f"{time.monotonic() - start:.0f} s")
for pid in kids:
    os.kill(pid, signal.SIGKILL)
"""


def test_a_process_forked_while_the_writer_starts_does_not_hold_its_close(tmp_path):
    """A process forked on another thread while the writer process started inherited the
    writer's end of its pipe: the writer's exit was never seen, and `close()` (the job's exit
    too) waited for as long as that process lived."""
    run = subprocess.run([sys.executable, "-c", _FORKS_WHILE_THE_WRITER_STARTS, str(tmp_path)], capture_output=True,
                         text=True, timeout=240, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == ["closed in under 10 s"], run.stdout + run.stderr[-3000:]
