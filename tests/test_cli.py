"""The torchtitan-ckpt command as scripts and people use it: `--json` documents checked against
the checkpoint, exit codes, a stdout closed early, progress on a terminal and off it, Ctrl-C.

The subprocess tests run the real command (`python -m torchtitan_ckpt.cli`) through real pipes and
a real pseudo-terminal."""

from __future__ import annotations

import json
import os
import pty
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tqdm import tqdm

from torchtitan_ckpt import cli, commit, layout
from torchtitan_ckpt.example.model import FLAVORS, Transformer

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
    """step-2 (model, optimizer, train_state), step-3 partial (no marker), step-4 (model only)."""
    folder = str(tmp_path_factory.mktemp("ckpt"))
    _save_step(folder, 2, _state(), ["model", "optimizer", "train_state"])
    shutil.copytree(layout.step_dir(folder, 2), layout.step_dir(folder, 3))
    os.remove(os.path.join(layout.step_dir(folder, 3), commit.MARKER))
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
    assert _run_json(capsys, "list", str(tmp_path)) == (1, {"folder": str(tmp_path), "latest_complete": None,
                                                            "steps": [{"step": 7, "path": layout.step_dir(str(tmp_path), 7),
                                                                       "status": "partial", "bytes": 0, "format": None,
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
    assert f"verify: verifying: 100%|" in text and f"| {size}/{size} [" in text and "B/s]" in text, text
    assert out == f"{layout.step_dir(folder, 2)}: {len(info.files)} files, {cli.fmt_bytes(info.total_bytes)}, all intact\n"
