"""A team's folders: steps another user wrote, which this user may not read or remove. The suite
runs as root, whom file modes do not stop: each check runs in a process that drops to `nobody`
once everything it uses is imported (and, run by another user, as that user, with modes that
stop an owner too)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch

from torchtitan_ckpt import Checkpoint, CheckpointManager, commit, layout

from .helpers import ROOT
from .jobs import make_job

_PRELUDE = """
import os, sys
sys.path.insert(0, {root!r})
import torch
from torchtitan_ckpt import Checkpoint, CheckpointManager, errors
from tests.jobs import make_job

def model():
    torch.manual_seed(1)
    return torch.nn.Linear(4, 4)

def refusal(make, call):
    try:
        call(make())
    except errors.CheckpointError as e:
        return f"{{type(e).__name__}}: {{e}}"
    return "no error"

{warm}
if os.geteuid() == 0:  # as `nobody` from here on: modes stop it
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
"""


def _as_another_user(folder: str, warm: str, code: str) -> str:
    """Run `code` after `warm` (as the suite's user: it imports what `code` uses) as `nobody`;
    its output."""
    script = _PRELUDE.format(root=ROOT, warm=warm) + code
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=folder, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture
def team_folder():
    """A folder anyone may write into, outside pytest's own (which is its user's alone)."""
    folder = tempfile.mkdtemp(prefix="team-", dir="/tmp")
    os.chmod(folder, 0o777)
    yield folder
    for root, dirs, _ in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
    subprocess.run(["rm", "-rf", folder], check=True)


def _save_steps(folder: str, steps: list[int], example: bool = False) -> str:
    """Steps saved by the suite's user (a small `Linear`'s, or the example job's)."""
    if example:
        job = make_job(folder, steps=20, interval=2)
        job.run_to(steps[-1], steps=20)
        job.manager.close()
    else:
        torch.manual_seed(0)
        with CheckpointManager(Checkpoint(enable=True, interval=1), [torch.nn.Linear(4, 4)], base_folder=folder) as m:
            for step in steps:
                m.save(step)
    ckpt = os.path.join(folder, "checkpoint")
    os.chmod(ckpt, 0o777)
    os.remove(os.path.join(ckpt, ".torchtitan_ckpt.lock"))  # the saving job's, of its user's mode
    return ckpt


_LOAD = """
print(refusal(lambda: CheckpointManager(Checkpoint(enable=True, load_only=True, verify_on_load={verify}), [model()],
                                        base_folder={folder!r}), lambda m: m.load()))
"""


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify_on_load"])
def test_a_step_this_user_may_not_read_is_named_with_its_owner_not_passed_over(team_folder, verify):
    """A data file of the newest step unreadable to this user was "damaged": with
    `verify_on_load` passed over (and the job's next save replaced it, failing after the
    training). A step folder it may not enter read as another program's: passed over, or with
    no other step, the load returned False and the job started from scratch."""
    ckpt = _save_steps(team_folder, [1, 2])
    step2 = layout.step_dir(ckpt, 2)
    load = _LOAD.format(folder=team_folder, verify=verify)
    data = sorted(n for n in os.listdir(step2) if n.endswith(".distcp"))
    for name in data:
        os.chmod(os.path.join(step2, name), 0o000)
    out = _as_another_user(team_folder, load, load).splitlines()[-1]
    assert out.startswith("CheckpointError: ") and "cannot be opened: " in out, out
    assert f"{step2}/{data[0]}: Permission denied for user " in out and "mode ----------); ask its owner" in out, out
    os.chmod(step2, 0o000)
    listing = """
import contextlib, io, json
from torchtitan_ckpt import cli
listed = io.StringIO()
with contextlib.redirect_stdout(listed):
    status = cli.main(["list", "--json", {ckpt!r}])
print(status, [(s["step"], s["status"]) for s in json.loads(listed.getvalue())["steps"]])
""".format(ckpt=ckpt)
    out = _as_another_user(team_folder, load, load + listing).splitlines()
    assert out[-2].startswith(f"CheckpointError: {step2}, newer than every step this job may read, cannot be read: "
                              f"{step2}: Permission denied for user ") and \
        f"({step2} is owned by " in out[-2] and "mode d---------); ask its owner" in out[-2], out
    assert out[-1] == "0 [(1, 'complete'), (2, 'denied')]", out


_SAVER = """
print(refusal(lambda: make_job({folder!r}, steps=20, interval=2, **{settings}), lambda job: job.manager.load()))
"""


def test_a_step_ahead_this_user_may_not_remove_is_refused_before_training(team_folder):
    """Another user's unfinished step 4 (killed while saving) in the team's folder: the job
    loaded step 2, trained, and its save of step 4 failed removing the old one."""
    ckpt = _save_steps(team_folder, [2], example=True)
    step4 = layout.step_dir(ckpt, 4)
    os.makedirs(step4)
    commit.mark_in_progress(step4)
    os.chmod(step4, 0o555)
    warm = "make_job({folder!r}, steps=20, load_only=True).manager.load()".format(folder=team_folder)
    out = _as_another_user(team_folder, warm, _SAVER.format(folder=team_folder, settings={})).splitlines()[-1]
    assert out.startswith(f"CheckpointError: {ckpt}: step(s) 4 include steps this user may not remove ({step4}: not "
                          f"removable for user ") and "mode dr-xr-xr-x); ask their owner" in out, out
    assert "a save never replaces a folder it may not remove" in out, out
    assert os.path.isdir(step4) and os.listdir(step4) == [commit.IN_PROGRESS]


def test_a_copies_folder_this_user_may_not_write_is_refused_at_construction(team_folder):
    """`hf_export_interval` with the copies' folder of another user: the first copy failed, after
    the training up to it."""
    ckpt = _save_steps(team_folder, [2], example=True)
    os.makedirs(os.path.join(ckpt, "hf"), mode=0o555)
    os.chmod(os.path.join(ckpt, "hf"), 0o555)
    warm = "make_job({folder!r}, steps=20, load_only=True).manager.load()".format(folder=team_folder)
    code = _SAVER.format(folder=team_folder, settings={"hf_export_interval": 2})
    out = _as_another_user(team_folder, warm, code).splitlines()[-1]
    assert out.startswith(f"ConfigError: checkpoint.hf_export_interval = 2: the copies go into {ckpt}/hf: not "
                          "writable for user ") and "mode dr-xr-xr-x); ask its owner" in out, out


def test_clean_names_the_owner_of_a_step_it_may_not_remove(team_folder):
    """It said "Permission denied: '__0_0.distcp'", a file named relative to a folder unnamed."""
    ckpt = _save_steps(team_folder, [2])
    step4 = layout.step_dir(ckpt, 4)
    os.makedirs(step4)
    commit.mark_in_progress(step4)
    os.chmod(step4, 0o555)
    code = f"""
import contextlib, io
from torchtitan_ckpt import cli
err = io.StringIO()
with contextlib.redirect_stderr(err):
    status = cli.main(["clean", {ckpt!r}, "--quiet"])
print(status, err.getvalue().strip())
"""
    out = _as_another_user(team_folder, "from torchtitan_ckpt import cli", code).splitlines()[-1]
    assert out.startswith(f"1 error: {step4} could not be removed: {step4}: not removable for user ") and \
        "mode dr-xr-xr-x)" in out, out
    assert os.listdir(step4) == [commit.IN_PROGRESS]


def test_a_lock_file_this_user_may_not_open_is_named_with_its_owner(team_folder):
    """It said "[Errno 13] Permission denied: .../.torchtitan_ckpt.lock"."""
    ckpt = _save_steps(team_folder, [2], example=True)
    lock = os.path.join(ckpt, ".torchtitan_ckpt.lock")
    open(lock, "w").close()
    os.chmod(lock, 0o000)
    warm = "make_job({folder!r}, steps=20, load_only=True).manager.load()".format(folder=team_folder)
    out = _as_another_user(team_folder, warm, _SAVER.format(folder=team_folder, settings={})).splitlines()[-1]
    assert out.startswith(f"ConfigError: checkpoint.folder = {ckpt!r}: ") and \
        f"cannot be held by this job: {lock}: Permission denied for user " in out and \
        "mode ----------); ask its owner" in out, out


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's folder needs root to make")
def test_convert_into_another_users_empty_folder_in_a_sticky_folder_is_refused_before_the_work(team_folder):
    """An empty output folder is replaced by the finished output (renamed into its place): another
    user's, in a sticky folder (`/tmp`), cannot be, and convert failed once its work was done
    with a bare "[Errno 1] Operation not permitted"."""
    from torchtitan_ckpt.example.model import FLAVORS, Transformer, hf_adapter
    from torchtitan_ckpt.hf import save_hf

    model = Transformer(FLAVORS["debugmodel"])
    hf = os.path.join(team_folder, "hf")
    save_hf(model.state_dict(), hf, hf_adapter(model.args))
    sticky = os.path.join(team_folder, "sticky")
    os.makedirs(os.path.join(sticky, "out"))
    os.chmod(sticky, 0o1777)
    code = f"""
import contextlib, io
from torchtitan_ckpt import cli
err = io.StringIO()
with contextlib.redirect_stderr(err):
    status = cli.main(["convert", "--to", "dcp", {hf!r}, {os.path.join(sticky, "out")!r}])
print(status, err.getvalue().strip().splitlines()[-1])
"""
    out = _as_another_user(team_folder, "from torchtitan_ckpt import cli", code).splitlines()[-1]
    assert out.startswith(f"2 error: {os.path.join(sticky, 'out')} is an empty folder this user may not replace, as "
                          f"the finished output replaces it: {sticky}: not removable for user nobody") \
        and "mode drwxrwxrwt); remove it, or name another output folder" in out, out
    assert os.listdir(sticky) == ["out"]  # no `out.partial` made, nothing written


def test_a_reader_that_may_not_write_the_folder_lists_and_loads_as_a_writer_does(team_folder):
    """An evaluation job reading a training's folder it may not write: an empty step folder (a
    save starting, or killed before its first file) was "not written by torchtitan_ckpt" at
    WARNING in its load and `unknown` in `list` (to a writer it is `empty`, at INFO); one step
    whose marker it may not read ended `list` with no step listed; a folder it may enter but not
    list, and an HF folder too, gave a bare "[Errno 13] Permission denied"."""
    from torchtitan_ckpt.example.model import FLAVORS, Transformer, hf_adapter
    from torchtitan_ckpt.hf import save_hf

    ckpt = _save_steps(team_folder, [1, 2])
    os.makedirs(layout.step_dir(ckpt, 3))
    os.chmod(os.path.join(layout.step_dir(ckpt, 1), commit.MARKER), 0o600)
    os.chmod(ckpt, 0o755)
    hf = os.path.join(team_folder, "hf")
    save_hf(Transformer(FLAVORS["debugmodel"]).state_dict(), hf, hf_adapter(FLAVORS["debugmodel"]))
    os.chmod(hf, 0o711)
    code = f"""
import contextlib, io, json, logging
from torchtitan_ckpt import cli
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
m = CheckpointManager(Checkpoint(enable=True, load_only=True), [model()], base_folder={team_folder!r})
print("loaded", m.load())
logging.disable()
def cli_run(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(list(argv))
    return status, out.getvalue(), err.getvalue().strip()
status, out, _ = cli_run("list", "--json", {ckpt!r})
print("list", status, [(s["step"], s["status"]) for s in json.loads(out)["steps"]])
print("inspect", cli_run("inspect", {hf!r}))
"""
    out = _as_another_user(team_folder, "from torchtitan_ckpt import cli", code).splitlines()
    ignored = [line for line in out if "step-3" in line]
    assert ignored == [f"INFO ignoring {layout.step_dir(ckpt, 3)}: empty: a save that stopped (or is starting) "
                       "before its first file; the save of its step replaces it"], out
    assert "loaded True" in out, out
    assert "list 0 [(1, 'denied'), (2, 'complete'), (3, 'empty')]" in out, out
    inspected = next(line for line in out if line.startswith("inspect "))
    assert f"'error: {hf}: Permission denied for user " in inspected and "mode drwx--x--x); ask its owner" in inspected
    os.chmod(ckpt, 0o711)
    code = f"""
m = CheckpointManager(Checkpoint(enable=True, load_only=True, load_step=2), [model()], base_folder={team_folder!r})
print(refusal(lambda: m, lambda m: m.load()))
"""
    out = _as_another_user(team_folder, "", code).splitlines()[-1]
    assert out.startswith(f"CheckpointError: the step folders cannot be listed: {ckpt}: Permission denied for user ") \
        and "mode drwx--x--x); ask its owner" in out, out


def test_clean_on_a_read_only_file_system_says_so_before_touching_anything(tmp_path):
    """A snapshot or an export mounted read-only: clean printed a bare "[Errno 30] Read-only
    file system: '.../.torchtitan_ckpt.lock'" (the lock file it opens to write), or without a
    lock file tried every partial step and failed on each."""
    ckpt = _save_steps(str(tmp_path), [1])
    step2 = layout.step_dir(ckpt, 2)
    os.makedirs(step2)
    commit.mark_in_progress(step2)
    for lock in (False, True):
        if lock:
            open(os.path.join(ckpt, ".torchtitan_ckpt.lock"), "w").close()
        script = (f"mount --bind {ckpt} {ckpt} && mount -o remount,bind,ro {ckpt} && "
                  f"PYTHONPATH={ROOT} {sys.executable} -m torchtitan_ckpt clean {ckpt}")
        proc = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, timeout=120)
        if "mount:" in proc.stderr or "unshare:" in proc.stderr:
            pytest.skip(f"no read-only mount can be made here: {proc.stderr.strip()}")
        assert proc.returncode == 2 and proc.stderr.strip() == (
            f"error: {ckpt} is on a read-only file system: clean removes nothing there (1 partial step folder; "
            "clean it where it is mounted writable)"), proc.stderr
        assert sorted(os.listdir(ckpt)) == sorted(["step-1", "step-2"] + [".torchtitan_ckpt.lock"] * lock)


def test_a_step_folder_another_user_closed_is_named_as_such(team_folder):
    """A step folder of mode 000 (another user's) read as holding nothing: inspect said it held
    no checkpoint, verify that it had no commit marker (a partial step?), convert that it held
    no .metadata."""
    ckpt = _save_steps(team_folder, [1])
    step = layout.step_dir(ckpt, 1)
    os.chmod(step, 0o000)
    code = f"""
import contextlib, io
from torchtitan_ckpt import cli
for argv in (["inspect", {step!r}], ["verify", {step!r}], ["convert", "--to", "hf", {step!r}, "out"]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        status = cli.main([*argv, "-q"])
    print(status, err.getvalue().strip())
"""
    try:
        out = _as_another_user(team_folder, "from torchtitan_ckpt import cli", code).splitlines()
    finally:
        os.chmod(step, 0o755)
    assert len(out) == 3, out
    for line in out:
        assert line.startswith(f"2 error: {step}: Permission denied for user nobody") and \
            "mode d---------); ask its owner to make it readable to you" in line, out
