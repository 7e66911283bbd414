"""The torchtitan-ckpt command as scripts and people use it: `--json` documents checked against
the checkpoint, exit codes, a stdout closed early, progress on a terminal and off it, Ctrl-C.

The subprocess tests run the real command (`python -m torchtitan_ckpt.cli`) through real pipes and
a real pseudo-terminal."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tqdm import tqdm

from torchtitan_ckpt import cli, commit, layout
from torchtitan_ckpt.example.model import FLAVORS, Transformer, hf_config
from torchtitan_ckpt.hf.convert import RECORDED_CONFIG

from .helpers import ROOT

CMD = [sys.executable, "-m", "torchtitan_ckpt.cli"]
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def _state() -> dict:
    torch.manual_seed(0)
    return {"model.w": torch.randn(8, 4), "model.b": torch.arange(6, dtype=torch.int64),
            "optimizer.state.w.exp_avg": torch.zeros(8, 4, dtype=torch.bfloat16), "train_state": {"step": 3}}


def _save_step(folder: str, step: int, state: dict, states: list[str]) -> str:
    path = layout.step_dir(folder, step)
    dcp.save(state, checkpoint_id=path)
    commit.write_marker(path, commit.CommitInfo(step=step, states=states))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """step-2 (model, optimizer, train_state), step-3 partial (ours, no marker), step-4 (model only)."""
    folder = str(tmp_path_factory.mktemp("ckpt"))
    _save_step(folder, 2, _state(), ["model", "optimizer", "train_state"])
    shutil.copytree(layout.step_dir(folder, 2), layout.step_dir(folder, 3))
    os.remove(os.path.join(layout.step_dir(folder, 3), commit.MARKER))
    commit.mark_in_progress(layout.step_dir(folder, 3))  # a save of ours that did not finish
    _save_step(folder, 4, {"model.w": _state()["model.w"]}, ["model"])
    return folder


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def _run_json(capsys, *argv: str) -> tuple[int, dict]:
    code = cli.main([*argv, "--json", "--quiet"])
    out = capsys.readouterr()
    assert out.err == ""
    return code, json.loads(out.out)


# ------------------------------------------------------------------------------- --json


def test_list_json(folder, capsys):
    code, doc = _run_json(capsys, "list", folder)
    assert code == 0
    assert doc["folder"] == folder and doc["latest_complete"] == 4
    assert [(s["step"], s["status"], s["format"], s["states"], s["world_size"]) for s in doc["steps"]] == [
        (2, "complete", "dcp", ["model", "optimizer", "train_state"], 1),
        (3, "partial", None, None, None),
        (4, "complete", "dcp", ["model"], 1)]
    for s in doc["steps"]:
        assert s["path"] == layout.step_dir(folder, s["step"]) and s["bytes"] == _du(s["path"])


def test_list_json_exit_codes(tmp_path, capsys):
    os.makedirs(layout.step_dir(str(tmp_path), 7))
    commit.mark_in_progress(layout.step_dir(str(tmp_path), 7))  # a save of ours that crashed
    assert _run_json(capsys, "list", str(tmp_path)) == (1, {"folder": str(tmp_path), "latest_complete": None,
                                                            "steps": [{"step": 7, "path": layout.step_dir(str(tmp_path), 7),
                                                                       "status": "partial", "bytes": _du(layout.step_dir(str(tmp_path), 7)), "format": None,
                                                                       "states": None, "world_size": None}]})
    assert cli.main(["list", str(tmp_path / "nope"), "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "nope is not a folder" in out.err


def test_inspect_json(folder, capsys):
    code, doc = _run_json(capsys, "inspect", layout.step_dir(folder, 2))
    assert code == 0
    assert {k: doc[k] for k in ("status", "step", "format", "world_size", "states")} == {
        "status": "complete", "step": 2, "format": "dcp", "world_size": 1,
        "states": ["model", "optimizer", "train_state"]}
    state = _state()
    assert doc["tensors"] == [
        {"key": k, "state": k.split(".")[0], "dtype": str(state[k].dtype).removeprefix("torch."),
         "shape": list(state[k].shape), "bytes": state[k].numel() * state[k].element_size()}
        for k in sorted(k for k, v in state.items() if isinstance(v, torch.Tensor))]
    assert doc["tensor_bytes"] == 8 * 4 * 4 + 6 * 8 + 8 * 4 * 2
    assert doc["objects"] == [{"key": "train_state.step", "state": "train_state"}]  # DCP flattens dicts
    code, doc = _run_json(capsys, "inspect", layout.step_dir(folder, 3))
    assert (code, doc["status"], doc["step"]) == (0, "partial", None)


def test_verify_json(folder, tmp_path, capsys):
    step = shutil.copytree(layout.step_dir(folder, 2), str(tmp_path / "step-2"))
    info = commit.read_marker(step)
    code, doc = _run_json(capsys, "verify", step)
    assert (code, doc["ok"], doc["failed"], doc["step"], doc["bytes"]) == (0, True, 0, 2, info.total_bytes)
    assert [(f["file"], f["bytes"], f["crc32"], f["ok"], f["problem"]) for f in doc["files"]] == [
        (rel, os.path.getsize(os.path.join(step, rel)), e["crc32"], True, None) for rel, e in sorted(info.files.items())]

    data = next(rel for rel in info.files if rel.endswith(".distcp"))
    with open(os.path.join(step, data), "r+b") as f:
        f.write(bytes([f.read(1)[0] ^ 0xFF]))
    code, doc = _run_json(capsys, "verify", step)
    assert (code, doc["ok"], doc["failed"]) == (1, False, 1)
    bad = [f for f in doc["files"] if not f["ok"]]
    assert [f["file"] for f in bad] == [data] and "CRC-32" in bad[0]["problem"]

    assert cli.main(["verify", layout.step_dir(folder, 3), "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "has no COMMITTED.json" in out.err


def test_clean_reports_bytes_removed(folder, tmp_path, capsys):
    work = shutil.copytree(folder, str(tmp_path / "c"))
    partial = _du(layout.step_dir(work, 3))
    assert cli.main(["clean", work, "--quiet"]) == 0
    assert f"1 partial step folder(s) removed, {cli.fmt_bytes(partial)}" in capsys.readouterr().out
    assert layout.committed_steps(work) == [2, 4] and len(layout.scan(work)) == 2


# ------------------------------------------------------------------------- Unix manners


def _closed_early(args: list[str]) -> subprocess.CompletedProcess:
    """Run the command with its stdout a pipe whose reader closes before anything is read."""
    proc = subprocess.Popen([*CMD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, cwd=ROOT)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    return subprocess.CompletedProcess(args, proc.wait(), "", err)


@pytest.mark.parametrize("argv", [["list", "{f}"], ["inspect", "{f}/step-2", "--json"], ["verify", "{f}/step-4"]])
def test_a_closed_stdout_ends_the_command_quietly(folder, argv):
    done = _closed_early([a.format(f=folder) for a in argv])
    assert done.returncode == cli.EXIT_PIPE and "Traceback" not in done.stderr, done.stderr


def test_piped_into_head(folder, tmp_path):
    """More output than a pipe holds, read by `head -n 1` in a real shell pipeline."""
    work = shutil.copytree(folder, str(tmp_path / "many"))
    for step in range(100, 5100):
        os.mkdir(layout.step_dir(work, step))
    script = f"{' '.join(CMD)} list {work} | head -n 1; echo status=${{PIPESTATUS[0]}}"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert done.stdout.split() == ["step", "status", "size", "contents", "status=141"]
    assert "Traceback" not in done.stderr, done.stderr


def test_progress_bar_on_a_terminal(folder):
    """stderr a pseudo-terminal: tqdm draws a bar; stdout, a pipe, holds the result alone."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([*CMD, "verify", layout.step_dir(folder, 2)], stdout=subprocess.PIPE,
                            stderr=follower, env=ENV, cwd=ROOT)
    os.close(follower)
    screen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the command exited and closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    os.close(leader)
    out = proc.stdout.read().decode()
    assert proc.wait() == 0
    text = screen.decode()
    info = commit.read_marker(layout.step_dir(folder, 2))
    size = tqdm.format_sizeof(info.total_bytes, divisor=1000)
    assert "verify: verifying: 100%|" in text and f"| {size}/{size} [" in text and "B/s]" in text, text
    assert out == f"{layout.step_dir(folder, 2)}: {len(info.files)} files, {cli.fmt_bytes(info.total_bytes)}, all intact\n"


# ---------------------------------------------------------------------------- convert


@pytest.fixture(scope="module")
def small_step(tmp_path_factory) -> str:
    """A DCP folder of the `small` flavor (16 MB in 39 tensors) with the HF config it records,
    as `convert --to dcp` writes it."""
    path = str(tmp_path_factory.mktemp("small") / "step-1")
    torch.manual_seed(0)
    dcp.save(Transformer(FLAVORS["small"]).state_dict(), checkpoint_id=path)
    with open(os.path.join(path, RECORDED_CONFIG), "w") as f:
        json.dump(hf_config(FLAVORS["small"]), f)
    return path


def test_progress_lines_off_a_terminal(small_step, tmp_path):
    """stderr a pipe: no bar, but log lines with bytes done, rate and time left (one per update
    with --progress-every 0), then the phase's time and throughput."""
    out = str(tmp_path / "hf")
    done = subprocess.run([*CMD, "convert", "--to", "hf", small_step, out, "--threads", "1",
                           "--progress-every", "0"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"converted {small_step} -> {out} (hf)\n"
    total = sum(t.numel() * 4 for t in Transformer(FLAVORS["small"]).state_dict().values())
    lines = re.findall(r"convert: writing ([\d.]+ [KMG]?B) of ([\d.]+ MB) \(\d+%\), [\d.]+ [KMG]?B/s, \d:\d\d:\d\d left",
                       done.stderr)
    assert len(lines) >= 10 and {of for _, of in lines} == {cli.fmt_bytes(total)}, done.stderr
    assert re.search(rf"convert: writing {cli.fmt_bytes(total)} in [\d.]+ s \([\d.]+ [KMG]?B/s\)", done.stderr)
    assert "\r" not in done.stderr and "%|" not in done.stderr
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    assert not os.path.exists(out + cli.PARTIAL_SUFFIX)


def _read_until(fd: int, text: bytes, timeout: float = 120) -> bytes:
    seen, deadline = b"", time.monotonic() + timeout
    while text not in seen:
        assert time.monotonic() < deadline, seen.decode()
        chunk = os.read(fd, 256)
        assert chunk, seen.decode()
        seen += chunk
    return seen


def _fill(pipe_w: int) -> None:
    """Fill a pipe through a second, non-blocking open file description of its write end (the
    command's own stderr stays blocking): its next line to stderr then waits."""
    filler = os.open(f"/proc/self/fd/{pipe_w}", os.O_WRONLY | os.O_NONBLOCK)
    try:
        for size in (4096, 256, 1):
            with contextlib.suppress(BlockingIOError):
                while True:
                    os.write(filler, b"." * size)
    finally:
        os.close(filler)


def _sigint_default() -> None:
    """In the command's process before it starts: SIGINT as a terminal delivers it, whatever the
    test inherited (a shell ignores SIGINT in the commands it starts in the background, and the
    command, as any Python program, then keeps ignoring it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupted_convert_leaves_nothing_that_looks_complete(small_step, tmp_path):
    """SIGINT while the HF files are half written (the command is held there by a full stderr
    pipe, so the moment is certain): exit 130, no output folder, no .partial one, nothing `list`
    takes for a step."""
    out = str(tmp_path / "step-7")
    partial = out + cli.PARTIAL_SUFFIX
    r, w = os.pipe()
    # No warnings: the first line after "reading" is then the one that starts the writing, once
    # the HF files exist, and it waits for the full pipe.
    proc = subprocess.Popen([*CMD, "convert", "--to", "hf", small_step, out, "--threads", "1",
                             "--progress-every", "0"], stdout=subprocess.PIPE, stderr=w,
                            env={**ENV, "PYTHONWARNINGS": "ignore"}, cwd=ROOT, preexec_fn=_sigint_default)
    try:
        _read_until(r, b"convert: reading")
        _fill(w)
        os.close(w)
        deadline = time.monotonic() + 60
        while not (os.path.isdir(partial) and any(n.endswith(".safetensors") for n in os.listdir(partial))):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        err = b"".join(iter(lambda: os.read(r, 65536), b"")).decode()
        assert proc.wait(timeout=120) == cli.EXIT_INTERRUPTED, err
    finally:
        proc.kill()
        os.close(r)
    assert "torchtitan-ckpt convert: interrupted" in err and "Traceback" not in err, err
    assert proc.stdout.read() == b""
    assert not os.path.exists(out) and not os.path.exists(partial)
    assert layout.scan(str(tmp_path)) == []


def test_convert_never_removes_a_partial_folder_it_did_not_make(small_step, tmp_path):
    """`OUT.partial` is where convert writes before renaming to OUT: a folder of that name the
    command did not make (a user's) is refused and kept; one an interrupted run left (marked)
    is replaced."""
    out = str(tmp_path / "hf")
    theirs = tmp_path / "hf.partial"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    done = subprocess.run([*CMD, "convert", "--to", "hf", small_step, out, "--threads", "1", "--progress-every", "0"],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert done.returncode != 0 and "hf.partial exists and was not left by an interrupted run" in done.stderr
    assert (theirs / "notes.txt").read_text() == "mine" and not os.path.exists(out)

    shutil.rmtree(theirs)
    theirs.mkdir()
    commit.mark_in_progress(str(theirs))  # what an interrupted run leaves
    (theirs / "model-00001-of-00002.safetensors").write_bytes(b"half")
    done = subprocess.run([*CMD, "convert", "--to", "hf", small_step, out, "--threads", "1", "--progress-every", "0"],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not os.path.exists(theirs) and commit.IN_PROGRESS not in os.listdir(out)
    assert "model-00001-of-00002.safetensors" not in os.listdir(out)
    back = str(tmp_path / "dcp")  # a DCP output's commit marker lists exactly the files it has
    done = subprocess.run([*CMD, "convert", "--to", "dcp", out, back, "--threads", "1", "--progress-every", "0"],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert commit.verify(back) == [] and commit.IN_PROGRESS not in os.listdir(back)
