"""The torchtitan-ckpt command as scripts and people use it: `--json` documents checked against
the checkpoint, exit codes, a stdout closed early, progress on a terminal and off it, Ctrl-C.

The subprocess tests run the real command (`python -m torchtitan_ckpt.cli`) through real pipes and
a real pseudo-terminal."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
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
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from tqdm import tqdm

from torchtitan_ckpt import Checkpoint, CheckpointError, CheckpointManager, cli, commit, layout
from torchtitan_ckpt.dcp import storage
from torchtitan_ckpt.example.model import FLAVORS, Transformer, hf_adapter, hf_config
from torchtitan_ckpt.hf import save_hf
from torchtitan_ckpt.hf.files import RECORDED_CONFIG

from .helpers import ROOT, run_job, syscalls

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
    partial = layout.step_dir(folder, 3)  # a save of ours that did not finish: marked, written, not committed
    os.makedirs(partial)
    commit.mark_in_progress(partial)
    dcp.save(_state(), storage_writer=storage.make_storage_writer(partial))
    _save_step(folder, 4, {"model.w": _state()["model.w"]}, ["model"])
    return folder


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def test_a_rank_variable_that_is_no_number_is_a_plain_process(tmp_path):
    """`RANK` set by something else than a launcher: the command runs as a plain process (it
    raised a ValueError traceback while setting up its log)."""
    done = subprocess.run([sys.executable, "-m", "torchtitan_ckpt.cli", "list", str(tmp_path)], env={**ENV, "RANK": "abc"},
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (1, "") and "no step folders" in done.stdout  # 1: none loadable


def _run_json(capsys, *argv: str) -> tuple[int, dict]:
    code = cli.main([*argv, "--json", "--quiet"])
    out = capsys.readouterr()
    assert out.err == ""
    return code, json.loads(out.out)


# ------------------------------------------------------------------------------- --json


def test_the_package_runs_as_the_command(folder):
    """`python -m torchtitan_ckpt` (a venv's scripts folder off the PATH) is the same command."""
    ran = [subprocess.run([sys.executable, "-m", module, "list", "--json", folder], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=120) for module in ("torchtitan_ckpt", "torchtitan_ckpt.cli")]
    assert ran[0].returncode == ran[1].returncode == 0, ran[0].stderr
    assert ran[0].stdout == ran[1].stdout and json.loads(ran[0].stdout)
    usage = subprocess.run([sys.executable, "-m", "torchtitan_ckpt", "--help"], capture_output=True, text=True,
                           env=ENV, cwd=ROOT, timeout=120)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: torchtitan-ckpt ")
    imported = subprocess.run([sys.executable, "-c", "import torchtitan_ckpt.__main__"], capture_output=True,
                              text=True, env=ENV, cwd=ROOT, timeout=120)  # a tool importing every module
    assert (imported.returncode, imported.stdout, imported.stderr) == (0, "", "")


def test_list_json(folder, capsys):
    code, doc = _run_json(capsys, "list", folder)
    assert code == 0
    assert doc["folder"] == folder and (doc["latest_complete"], doc["latest_loadable"]) == (4, 4)
    assert [(s["step"], s["status"], s["format"], s["states"], s["world_size"], s["problem"]) for s in doc["steps"]] == [
        (2, "complete", "dcp", ["model", "optimizer", "train_state"], 1, None),
        (3, "partial", None, None, None, None),
        (4, "complete", "dcp", ["model"], 1, None)]
    for s in doc["steps"]:
        assert s["path"] == layout.step_dir(folder, s["step"]) and s["bytes"] == _du(s["path"])


def test_list_json_exit_codes(tmp_path, capsys):
    os.makedirs(layout.step_dir(str(tmp_path), 7))
    commit.mark_in_progress(layout.step_dir(str(tmp_path), 7))  # a save of ours that crashed
    assert _run_json(capsys, "list", str(tmp_path)) == (1, {"folder": str(tmp_path), "latest_complete": None,
                                                            "latest_loadable": None,
                                                            "steps": [{"step": 7, "path": layout.step_dir(str(tmp_path), 7),
                                                                       "status": "partial", "bytes": _du(layout.step_dir(str(tmp_path), 7)), "format": None,
                                                                       "states": None, "world_size": None,
                                                                       "linked": False, "problem": None}]})
    assert cli.main(["list", str(tmp_path / "nope"), "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "nope does not exist" in out.err


def test_list_reports_a_corrupt_marker_and_goes_on(folder, tmp_path, capsys):
    """A truncated COMMITTED.json is one `corrupt` step, its reason in `problem`; the other
    steps are listed, and it counts neither as complete nor as loadable."""
    work = shutil.copytree(folder, str(tmp_path / "c"))
    marker = os.path.join(layout.step_dir(work, 4), commit.MARKER)
    with open(marker, "w") as f:
        f.write('{"step": 4')
    code, doc = _run_json(capsys, "list", work)
    assert (code, doc["latest_complete"], doc["latest_loadable"]) == (0, 2, 2)
    assert [(s["step"], s["status"], s["format"], s["states"]) for s in doc["steps"]] == [
        (2, "complete", "dcp", ["model", "optimizer", "train_state"]), (3, "partial", None, None),
        (4, "corrupt", None, None)]
    assert doc["steps"][2]["problem"] == (f"{marker} is not a valid commit marker: JSONDecodeError: Expecting ',' "
                                          "delimiter: line 1 column 11 (char 10)")
    assert cli.main(["list", work]) == 0
    row = capsys.readouterr().out.splitlines()[3]
    assert row.split()[:2] == ["4", "corrupt"]
    assert row.endswith("COMMITTED.json unreadable (list --json: problem): not loadable, a load() of it fails")

    shutil.rmtree(layout.step_dir(work, 2))  # no loadable step left: exit status 1
    code, doc = _run_json(capsys, "list", work)
    assert (code, doc["latest_complete"], doc["latest_loadable"]) == (1, None, None)


def test_an_empty_step_folder_is_listed_as_one_a_save_replaces(folder, tmp_path, capsys):
    """A save killed between creating its step folder and marking it leaves the folder empty,
    which the manager tells as a stopped save and replaces; `list` said "not ours ... never
    deleted" of it. `clean` keeps it: another program's save makes its folder before its files,
    and the folder lock holds only our jobs off."""
    work = shutil.copytree(folder, str(tmp_path / "c"))
    empty, theirs = layout.step_dir(work, 5), layout.step_dir(work, 6)
    os.makedirs(empty)
    os.makedirs(theirs)
    with open(os.path.join(theirs, "notes.txt"), "w") as f:
        f.write("theirs")
    code, doc = _run_json(capsys, "list", work)
    assert (code, doc["latest_loadable"]) == (0, 4)
    assert [(s["step"], s["status"]) for s in doc["steps"]][3:] == [(5, "empty"), (6, "unknown")]
    assert cli.main(["list", work]) == 0
    row = capsys.readouterr().out.splitlines()[4]
    assert row.split()[:2] == ["5", "empty"]
    assert row.endswith("a save that stopped (or is starting) before its first file, ours or another program's: "
                        "never loaded; a save of its step replaces it, clean keeps it")
    assert cli.main(["clean", work, "-q"]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == [f"kept {empty} (empty: not removed by clean)",
                                                        f"kept {theirs} (unknown: not removed by clean)"]
    assert [s.step for s in layout.scan(work)] == [2, 4, 5, 6]
    with open(os.path.join(layout.step_dir(work, 4), commit.MARKER), "w") as f:  # a step of ours kept: named
        f.write("{")
    assert cli.main(["clean", work, "-q"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"kept {layout.step_dir(work, 4)} (corrupt: not removed by clean)"


def test_list_counts_foreign_steps_as_loadable(folder, tmp_path, capsys):
    """`latest_loadable` is the newest step `load()` starts from, a foreign one included;
    `latest_complete` the newest of ours. A folder of foreign steps alone exits 0."""
    dcp.save(_state(), checkpoint_id=layout.step_dir(str(tmp_path / "theirs"), 5))  # TorchTitan's way: no marker
    code, doc = _run_json(capsys, "list", str(tmp_path / "theirs"))
    assert (code, doc["latest_complete"], doc["latest_loadable"]) == (0, None, 5)
    assert [(s["step"], s["status"], s["format"], s["problem"]) for s in doc["steps"]] == [(5, "foreign", "dcp", None)]

    work = shutil.copytree(folder, str(tmp_path / "mixed"))
    shutil.copytree(layout.step_dir(str(tmp_path / "theirs"), 5), layout.step_dir(work, 5))
    code, doc = _run_json(capsys, "list", work)
    assert (code, doc["latest_complete"], doc["latest_loadable"]) == (0, 4, 5)


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


def test_inspect_of_a_step_copied_in_under_another_name_says_misnamed_as_list_does(folder, tmp_path, capsys):
    """It said `complete` where `list` says `misnamed` (and `load()` passes it over)."""
    work = shutil.copytree(folder, str(tmp_path / "work"))
    shutil.copytree(layout.step_dir(work, 2), layout.step_dir(work, 14))
    _, listed = _run_json(capsys, "list", work)
    assert [s["status"] for s in listed["steps"] if s["step"] == 14] == ["misnamed"]
    code, doc = _run_json(capsys, "inspect", layout.step_dir(work, 14))
    assert (code, doc["status"], doc["step"]) == (0, "misnamed", 2)
    assert cli.main(["inspect", layout.step_dir(work, 14), "-q"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (f"{layout.step_dir(work, 14)}: misnamed: it holds step 2, "
                                                       "saved by 1 rank (dcp)")


def test_inspect_a_step_without_our_marker(tmp_path, capsys):
    """TorchTitan's layout, no commit marker: the model's keys are at the top level; only the
    known state names (the manager's and TorchTitan's train_state) are states."""
    torch.manual_seed(0)
    state = {"tok_embeddings.weight": torch.randn(16, 4), "layers.0.attention.wq.weight": torch.randn(4, 4),
             "norm.weight": torch.ones(4), "output.weight": torch.randn(16, 4),
             "optimizer.state.norm.weight.exp_avg": torch.zeros(4), "lr_scheduler": {"last_epoch": 3},
             "train_state": {"step": 3}}
    step = layout.step_dir(str(tmp_path), 3)
    dcp.save(state, checkpoint_id=step)
    code, doc = _run_json(capsys, "inspect", step)
    assert (code, doc["status"], doc["step"], doc["format"], doc["world_size"]) == (0, "foreign", None, "dcp", None)
    assert doc["states"] == ["model", "optimizer", "lr_scheduler", "train_state"]
    assert [(t["key"], t["state"], t["shape"]) for t in doc["tensors"]] == [
        ("layers.0.attention.wq.weight", "model", [4, 4]), ("norm.weight", "model", [4]),
        ("optimizer.state.norm.weight.exp_avg", "optimizer", [4]), ("output.weight", "model", [16, 4]),
        ("tok_embeddings.weight", "model", [16, 4])]
    assert doc["objects"] == [{"key": "lr_scheduler.last_epoch", "state": "lr_scheduler"},
                              {"key": "train_state.step", "state": "train_state"}]
    assert cli.main(["inspect", step]) == 0
    sections = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert sections == ["[model]", "[optimizer]", "[lr_scheduler]", "[train_state]"]


def test_inspect_shows_names_a_terminal_would_act_on_escaped(tmp_path, capsys):
    """Tensor names are the checkpoint's: an escape code reached the terminal, a newline faked a
    row, and a lone surrogate stopped the listing with an encoding error (exit 2)."""
    names = ["\x1b[2Jwq", "nl\nfake   float32 [1] 4 B", "\ud800", "plain.weight"]
    step = layout.step_dir(str(tmp_path), 1)
    dcp.save({name: torch.ones(1) for name in names}, checkpoint_id=step)
    out = subprocess.run([sys.executable, "-m", "torchtitan_ckpt.cli", "inspect", step], capture_output=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout.decode()
    rows = [line.split()[0] for line in text.splitlines() if line.startswith("  ") and "total" not in line]
    assert rows == ["'\\x1b[2Jwq'", "'nl\\nfake", "plain.weight", "'\\ud800'"]
    assert "\x1b" not in text


def test_inspect_hf_steps(tmp_path, capsys):
    """An HF step of ours (`last_save_in_hf`) and the same folder without our marker (a foreign
    HF export): the tensors are the safetensors files' own, all of the model."""
    args = FLAVORS["debugmodel"]
    torch.manual_seed(0)
    model = Transformer(args)
    config = Checkpoint(enable=True, folder=str(tmp_path / "ckpt"), last_save_in_hf=True, export_dtype="bfloat16")
    with CheckpointManager(config, [model], state_dict_adapter=hf_adapter(args)) as manager:
        manager.save(1, last_step=True)
    ours = layout.step_dir(config.folder, 1)
    files = sorted(n for n in os.listdir(ours) if n.endswith(".safetensors"))
    expected = []
    for name in files:
        with safe_open(os.path.join(ours, name), "pt") as f:
            expected += [(k, "model", "bfloat16", list(f.get_slice(k).get_shape())) for k in f.keys()]
    code, doc = _run_json(capsys, "inspect", ours)
    assert (code, doc["status"], doc["step"], doc["format"], doc["world_size"], doc["states"], doc["objects"]) == (
        0, "complete", 1, "hf", 1, ["model"], [])
    assert [(t["key"], t["state"], t["dtype"], t["shape"]) for t in doc["tensors"]] == sorted(expected)
    assert doc["tensor_bytes"] == sum(t["bytes"] for t in doc["tensors"]) == \
        sum(v.numel() * 2 for v in model.state_dict().values())

    foreign = shutil.copytree(ours, str(tmp_path / "export" / "step-1"))
    os.remove(os.path.join(foreign, commit.MARKER))
    os.remove(os.path.join(foreign, commit.IN_PROGRESS))
    code, theirs = _run_json(capsys, "inspect", foreign)
    assert (code, theirs["status"], theirs["step"], theirs["format"], theirs["states"]) == (0, "foreign", None, "hf", ["model"])
    assert theirs["tensors"] == doc["tensors"]
    assert cli.main(["inspect", foreign]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"{foreign}: foreign, no commit marker (hf)"


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

    with open(os.path.join(step, commit.MARKER), "r+b") as f:  # a damaged marker: a damaged step (it exited 2)
        f.truncate(10)
    code, doc = _run_json(capsys, "verify", step)
    assert (code, doc["ok"], doc["failed"], doc["step"], doc["bytes"]) == (1, False, 1, None, None)
    assert [(f["file"], f["ok"]) for f in doc["files"]] == [(commit.MARKER, False)]
    assert "is not a valid commit marker" in doc["files"][0]["problem"]


def test_verify_reports_files_the_manifest_does_not_list(folder, tmp_path, capsys):
    """A file added after the commit was not reported, nor was a step whose manifest lists none
    ("0 files, all intact" while its data was damaged); a failed check ends with a summary."""
    step = shutil.copytree(layout.step_dir(folder, 2), str(tmp_path / "step-2"))
    with open(os.path.join(step, "extra.bin"), "wb") as f:
        f.write(b"x")
    assert cli.main(["verify", step, "-q"]) == 1
    n = len(commit.read_marker(step).files) + 1
    assert capsys.readouterr().out == (f"CORRUPT {step}/extra.bin: not in the manifest of COMMITTED.json (added "
                                       f"after the commit?)\n{step}: 1 of {n} files failed the check\n")
    code, doc = _run_json(capsys, "verify", step)
    assert (code, doc["failed"], doc["files"][-1]["file"], doc["files"][-1]["bytes"]) == (1, 1, "extra.bin", None)


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_missing_step_folder_is_named_as_missing(tmp_path, capsys, command):
    assert cli.main([command, str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nope'} does not exist\n"
    (tmp_path / "a_file").write_text("")
    assert cli.main([command, str(tmp_path / "a_file")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'a_file'} is a file, not a folder\n"
    os.symlink(tmp_path / "gone", tmp_path / "a_link")
    assert cli.main([command, str(tmp_path / "a_link")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'a_link'} does not exist (a link to a missing path)\n"


def test_a_folder_above_the_steps_is_named_with_where_they_are(tmp_path, capsys):
    """`list` of a job's dump folder, `verify` of a checkpoint folder or a dump folder."""
    folder = str(tmp_path / "checkpoint")
    _save_step(folder, 2, _state(), ["model"])
    _save_step(folder, 10, _state(), ["model"])
    assert cli.main(["list", str(tmp_path)]) == 1
    hint = f"; its subfolder {folder} holds step folders: name that one\n"
    assert capsys.readouterr().out == f"{tmp_path}: no step folders{hint}"
    assert cli.main(["verify", folder]) == 2
    assert capsys.readouterr().err == (f"error: {folder} has no {commit.MARKER}: not a complete step: it holds the "
                                       "step folders step-2 to step-10; name one of them\n")
    assert cli.main(["verify", str(tmp_path)]) == 2
    assert capsys.readouterr().err.endswith(f"not a complete step{hint}")
    os.mkdir(tmp_path / "elsewhere")
    os.rename(folder, tmp_path / "elsewhere" / "checkpoint")
    os.symlink(tmp_path / "elsewhere" / "checkpoint", folder)  # a dump folder's checkpoint on other storage
    assert cli.main(["list", str(tmp_path)]) == 1
    assert capsys.readouterr().out == f"{tmp_path}: no step folders{hint}"
    step, real = str(tmp_path / "checkpoint" / "step-2"), str(tmp_path / "elsewhere" / "checkpoint")
    assert cli.main(["list", step]) == 1  # no hint said that it is a step (named where it is, past the link)
    assert capsys.readouterr().out == (f"{step}: no step folders; it is the step folder {real}/step-2: list {real}, "
                                       "the folder holding the step-N folders\n")


def test_termination_is_raised_as_an_interruption_and_the_handler_put_back():
    """SIGTERM and SIGHUP (`timeout`, a scheduler) ended the command where it stood, leaving a
    downloaded step or a half-written output; they now unwind it as Ctrl-C does."""
    before = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)]  # SIGHUP ignored under nohup: kept
    assert before[0] is signal.SIG_DFL
    with pytest.raises(KeyboardInterrupt) as raised, cli._on_termination():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert raised.value.signum == signal.SIGTERM
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)] == before
    # as DCP hands a rank's failure to the others: pickled, it comes back the same
    assert pickle.loads(pickle.dumps(raised.value)).signum == signal.SIGTERM


@pytest.mark.parametrize("argv, message", [
    (["--max-shard-size", "banana"], "argument --max-shard-size: size 'banana' is not a byte count"),
    (["--progress-every", "nan"], "argument --progress-every: 'nan': expected a number of seconds, 0 or more"),
    (["--progress-every", "-5"], "argument --progress-every: '-5': expected a number of seconds, 0 or more"),
])
def test_bad_option_values_are_refused_naming_the_option(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        cli.main(["convert", "--to", "hf", str(tmp_path), str(tmp_path / "out"), *argv])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_clean_reports_bytes_removed(folder, tmp_path, capsys):
    work = shutil.copytree(folder, str(tmp_path / "c"))
    partial = _du(layout.step_dir(work, 3))
    assert cli.main(["clean", work, "--quiet"]) == 0
    assert f"1 partial step folder removed, {cli.fmt_bytes(partial)}" in capsys.readouterr().out
    assert layout.committed_steps(work) == [2, 4] and len(layout.scan(work)) == 2


def test_clean_goes_on_past_a_step_it_cannot_remove_and_exits_1(folder, tmp_path, capsys, monkeypatch):
    """docs/cli.md: 1 when a partial step could not be removed, whatever the reason (files
    appearing in it exited 2, a usage error's status)."""
    work = shutil.copytree(folder, str(tmp_path / "c"))
    os.makedirs(layout.step_dir(work, 5))
    commit.mark_in_progress(layout.step_dir(work, 5))
    real = commit.remove_step

    def files_appear_in_3(path, removed=None):
        if path == layout.step_dir(work, 3):
            raise CheckpointError(f"{path}: files appeared in it while it was removed")
        real(path, removed)

    monkeypatch.setattr(commit, "remove_step", files_appear_in_3)
    assert cli.main(["clean", work, "-q"]) == cli.EXIT_FAILED
    out, err = capsys.readouterr()
    assert f"error: {layout.step_dir(work, 3)}: files appeared" in err
    assert f"removed {layout.step_dir(work, 5)} (partial)" in out and not os.path.exists(layout.step_dir(work, 5))


def test_clean_of_object_storage_says_what_removes_partial_steps_there(capsys):
    """It said "is not a folder"; retention removes them (tests/test_s3.py)."""
    assert cli.main(["clean", "s3://bucket/run"]) == 2
    assert "s3://bucket/run: clean works on a local folder; on object storage the next save's retention" in \
        capsys.readouterr().err


@pytest.mark.parametrize("ours", [False, True])
@pytest.mark.parametrize("fifo", [False, True])
def test_clean_keeps_a_step_whose_marker_is_a_folder(tmp_path, capsys, ours, fifo):
    """A `COMMITTED.json` that is a folder (or a fifo: read as partial, it was removed with the
    other program's files) is nothing this package writes (in a step it started too): the step
    is unknown, never loaded; clean keeps it and what is in it, and goes on."""
    folder = str(tmp_path)
    theirs, partial = layout.step_dir(folder, 11), layout.step_dir(folder, 3)
    if fifo:
        os.makedirs(theirs)
        os.mkfifo(os.path.join(theirs, commit.MARKER))
        os.makedirs(os.path.join(theirs, "keep"))
    else:
        os.makedirs(os.path.join(theirs, commit.MARKER))
    with open(os.path.join(theirs, "keep" if fifo else commit.MARKER, "notes.txt"), "w") as f:
        f.write("theirs")
    if ours:
        commit.mark_in_progress(theirs)
    os.makedirs(partial)
    commit.mark_in_progress(partial)
    size = _du(partial)
    assert [(s.step, s.status) for s in layout.scan(folder)] == [(3, layout.PARTIAL), (11, layout.UNKNOWN)]
    assert cli.main(["clean", folder, "-q"]) == 0
    assert capsys.readouterr().out == (f"kept {theirs} (unknown: not removed by clean)\n"
                                       f"removed {partial} (partial)\n"
                                       f"1 partial step folder removed, {cli.fmt_bytes(size)}\n")
    with open(os.path.join(theirs, "keep" if fifo else commit.MARKER, "notes.txt")) as f:
        assert f.read() == "theirs"
    assert [s.step for s in layout.scan(folder)] == [11]


@pytest.mark.parametrize("argv, message", [
    (["list", "gs://bucket/run"], "folder = 'gs://bucket/run': gs:// is not a supported storage"),
    (["verify", "https://host/x/step-1"], "step_dir = 'https://host/x/step-1': https:// is not a supported storage"),
    (["inspect", "hdfs://x/step-1"], "step_dir = 'hdfs://x/step-1': hdfs:// is not a supported storage"),
    (["list", "s3://"], "folder = 's3://': expected s3://bucket/prefix (no bucket given)"),
])
def test_an_unsupported_url_is_an_input_error_naming_what_is_supported(argv, message, capsys):
    """Exit status 2 with our message, not a traceback and 1 (which means "verify failed")."""
    assert cli.main([*argv, "-q"]) == cli.EXIT_INPUT
    supported = ("" if "no bucket" in message else
                 "; expected a path on a file system every rank shares, or one of s3://bucket/prefix")
    assert capsys.readouterr() == ("", f"error: {message}{supported}\n")


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


def test_a_descriptor_closed_from_the_start_ends_the_command_quietly(folder):
    """`cmd >&-` crashed with AttributeError (stdout is None) and status 1; with stderr closed,
    the error went to stdout, which `--json` keeps empty on an error."""
    closed_out = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", *CMD, "list", folder], capture_output=False,
                                stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert closed_out.returncode == cli.EXIT_PIPE and closed_out.stderr == ""
    closed_err = subprocess.run(["sh", "-c", 'exec "$@" 2>&-', "sh", *CMD, "list", "--json", folder + "/nothing"],
                                stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert closed_err.returncode == cli.EXIT_INPUT and closed_err.stdout == ""


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_a_stdout_that_cannot_be_written_has_a_status_of_its_own(folder, hf_folder, tmp_path, unbuffered):
    """`> /dev/full` (a full disk under `> file`): convert, its output finished, said the output's
    file system was full (exit 1, "the unfinished output is removed"); list exited 2, an input
    error, or 120 with Python's "Exception ignored" on stderr."""
    out = str(tmp_path / "out")
    env = {**ENV, "PYTHONUNBUFFERED": unbuffered}
    with open("/dev/full", "w") as full:
        for argv in (["list", folder], ["verify", layout.step_dir(folder, 2)], ["convert", "--to", "dcp", hf_folder, out]):
            done = subprocess.run([*CMD, *argv, "-q"], stdout=full, stderr=subprocess.PIPE, text=True, env=env,
                                  cwd=ROOT, timeout=300)
            assert (done.returncode, done.stderr) == (cli.EXIT_STDOUT, f"error: stdout could not be written (No space "
                                                                       f"left on device): {argv[0]} stopped there\n")
    assert os.path.isfile(os.path.join(out, ".metadata"))  # the work was done


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


def test_convert_to_dcp_of_a_dcp_step_says_which_way_it_goes(small_step, tmp_path, capsys):
    """A DCP step given to `convert --to dcp` (the direction mistaken): said so, where it said the
    folder holds no Hugging Face model config."""
    os.makedirs(tmp_path / "step")
    shutil.copy(os.path.join(small_step, ".metadata"), tmp_path / "step")
    assert cli.main(["convert", "--to", "dcp", str(tmp_path / "step"), str(tmp_path / "out"), "-q"]) == cli.EXIT_INPUT
    assert capsys.readouterr().err.endswith(f"error: {tmp_path / 'step'} is a DCP checkpoint (it holds .metadata), "
                                            "not a Hugging Face folder: convert --to hf exports it\n")
    assert not os.path.exists(tmp_path / "out")


def test_convert_to_dcp_refuses_the_options_of_an_hf_export(small_step, tmp_path, capsys):
    """`--to dcp --dtype bfloat16` wrote float32 tensors and exited 0: the options of an HF
    export were dropped without a word (`--threads` now sets the reads' threads)."""
    out = str(tmp_path / "out")
    for given, named in ((["--dtype", "bfloat16"], "--dtype"),
                         (["--threads", "2", "--max-shard-size", "1MB"], "--max-shard-size"),
                         (["--consolidation", "rank0"], "--consolidation")):
        assert cli.main(["convert", "--to", "dcp", small_step, out, "-q", *given]) == cli.EXIT_INPUT
        assert capsys.readouterr().err == (f"error: {named}: an option of an HF export (--to hf); --to dcp writes the "
                                           "tensors as the HF folder holds them\n")
        assert not os.path.exists(out) and not os.path.exists(out + cli.PARTIAL_SUFFIX)


def test_verify_reports_progress_inside_a_file(tmp_path):
    """A file is checksummed chunk by chunk, and so reported: a rank's data file of several GB
    showed nothing until it was done."""
    with CheckpointManager(Checkpoint(enable=True), [torch.nn.Linear(2048, 2048)], base_folder=str(tmp_path)) as m:
        m.save(1, last_step=True)  # one 16 MB data file
    step = layout.step_dir(str(tmp_path / "checkpoint"), 1)
    done = subprocess.run([*CMD, "verify", step, "--threads", "1", "--progress-every", "0"], capture_output=True,
                          text=True, env=ENV, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = re.findall(r"verify: verifying ([\d.]+) MB of ([\d.]+) MB \(\d+%\)", done.stderr)
    assert any(1 < float(done) < float(total) - 1 for done, total in lines), done.stderr  # inside the 16 MB file


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


@pytest.mark.parametrize("signals", [(signal.SIGINT,), (signal.SIGINT, signal.SIGTERM)], ids=["ctrl-c", "torchrun"])
def test_interrupted_convert_leaves_nothing_that_looks_complete(small_step, tmp_path, signals):
    """SIGINT while the HF files are half written (the command is held there by a full stderr
    pipe, so the moment is certain): exit 130, no output folder, no .partial one, nothing `list`
    takes for a step. torchrun passes a Ctrl-C on as SIGINT and SIGTERM at once: the second
    stopped the removal of the .partial folder part-way, or came as a RuntimeError of
    `Condition.wait` (a traceback, exit 1)."""
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
            if proc.poll() == 0 and os.path.isdir(out):  # it had written its lines before the fill
                pytest.skip("the command ended before the pipe was full (the test was held up)")
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        for sig in signals:
            proc.send_signal(sig)
        err = b"".join(iter(lambda: os.read(r, 65536), b"")).decode()
        assert proc.wait(timeout=120) in (cli.EXIT_INTERRUPTED, 128 + signal.SIGTERM), err
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


def test_convert_refuses_a_step_no_load_would_take(folder, tmp_path, capsys):
    """A partial step (a save killed midway), a damaged or a newer commit marker: each was
    exported without a word (exit 0)."""
    out = str(tmp_path / "out")
    assert cli.main(["convert", "--to", "hf", layout.step_dir(folder, 3), out, "-q"]) == cli.EXIT_INPUT
    assert f"{layout.step_dir(folder, 3)} is a partial step (its save did not finish" in capsys.readouterr().err
    for marker, problem in [("{", "is not a valid commit marker"), (None, "newer")]:
        step = shutil.copytree(layout.step_dir(folder, 4), str(tmp_path / f"step-{len(problem)}"))
        raw = json.loads(open(os.path.join(step, commit.MARKER)).read())
        raw["version"] += 1
        with open(os.path.join(step, commit.MARKER), "w") as f:
            f.write(marker or json.dumps(raw))
        assert cli.main(["convert", "--to", "hf", step, out, "-q"]) == cli.EXIT_INPUT
        assert problem in capsys.readouterr().err
    assert not os.path.lexists(out) and not os.path.lexists(out + cli.PARTIAL_SUFFIX)


@pytest.mark.parametrize("command", ["convert", "consolidate"])
def test_an_output_inside_a_step_folder_is_refused(folder, hf_folder, shards, tmp_path, capsys, command):
    """A folder written into a committed step fails its `verify` (files not in the manifest)."""
    step = shutil.copytree(layout.step_dir(folder, 4), str(tmp_path / "step-4"))
    for out, where in ((os.path.join(step, "hf", "out"), "is inside"), (step, "is")):  # the step itself was taken
        assert cli.main([*_writing(command, hf_folder, shards), out, "-q"]) == cli.EXIT_INPUT
        assert capsys.readouterr().err == f"error: {out} {where} the step folder {step}; name a folder outside it\n"
    assert commit.verify(step) == []


def test_a_second_run_into_an_output_being_written_is_refused(hf_folder, tmp_path):
    """Two converts into one OUT_DIR at once: the second removed the first's `OUT.partial` as an
    interrupted run's, and the first failed at its end ("Directory not empty")."""
    out = str(tmp_path / "out")
    tmp = out + cli.PARTIAL_SUFFIX
    fd = cli._new_partial(tmp)  # a run writing it now: made, and held
    try:
        run = subprocess.run([*CMD, "convert", "--to", "dcp", hf_folder, out, "-q"], capture_output=True, text=True,
                             env=ENV, timeout=300)
        assert (run.returncode, run.stderr) == (2, f"error: {tmp} is being written by another run of this command "
                                                   "now; wait for it to end, or name another output folder\n")
        assert commit.is_in_progress(tmp)
    finally:
        os.close(fd)
    run = subprocess.run([*CMD, "convert", "--to", "dcp", hf_folder, out, "-q"], capture_output=True, text=True,
                         env=ENV, timeout=300)  # that run gone (killed): its leftover is replaced
    assert run.returncode == 0 and not os.path.lexists(tmp) and os.path.isfile(os.path.join(out, ".metadata")), \
        run.stderr


def test_an_empty_mount_point_as_output_is_refused_before_the_work(hf_folder, tmp_path):
    """A fresh volume mounted for the export: the output was written beside it on the parent's
    disk under a temporary name, then failed to be renamed over the mount point ("Device or
    resource busy") after all the work."""
    out = tmp_path / "volume"
    out.mkdir()
    script = (f"mount -t tmpfs none {out} && PYTHONPATH={ROOT} {sys.executable} -m torchtitan_ckpt convert --to dcp "
              f"{hf_folder} {out} -q")
    proc = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    if "mount:" in proc.stderr or "unshare:" in proc.stderr:
        pytest.skip(f"no mount can be made here: {proc.stderr.strip()}")
    assert (proc.returncode, proc.stderr) == (2, f"error: {out} is an empty mount point: a new output is written "
                                                 "beside it under a temporary name, then renamed over it, which a "
                                                 "mount point cannot be; name a folder inside it\n")
    assert sorted(os.listdir(tmp_path)) == ["volume"]


@pytest.mark.parametrize("left", ["empty", "marking"])
def test_a_partial_output_a_signal_left_while_it_was_made_is_replaced(hf_folder, tmp_path, capsys, left):
    """A Ctrl-C or SIGTERM in the first milliseconds left `OUT.partial` empty or holding the
    in-progress marker's temporary file; the next run refused it as not its own."""
    out = str(tmp_path / "out")
    os.makedirs(out + cli.PARTIAL_SUFFIX)
    if left == "marking":
        with open(os.path.join(out + cli.PARTIAL_SUFFIX, commit.IN_PROGRESS + ".tmp"), "w") as f:
            f.write("{")
    assert cli.main(["convert", "--to", "dcp", hf_folder, out, "-q"]) == cli.EXIT_OK, capsys.readouterr().err
    assert commit.verify(out) == [] and not os.path.lexists(out + cli.PARTIAL_SUFFIX)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    """The debug model as a Hugging Face folder: config.json, its safetensors file and index."""
    path = str(tmp_path_factory.mktemp("hf") / "hf")
    torch.manual_seed(0)
    model = Transformer(FLAVORS["debugmodel"])
    save_hf(model.state_dict(), path, hf_adapter(model.args))
    return path


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    """The per-rank shard files DCP's HuggingFaceStorageWriter writes with save_distributed=True."""
    path = str(tmp_path_factory.mktemp("shards") / "shards")
    dcp.save({"w": torch.arange(32.0).reshape(4, 8)}, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))
    return path


def test_consolidate_with_a_mapping_missing_a_tensor_names_the_option(tmp_path, capsys):
    """It named `fqn_to_index_mapping` alone, the API's name for what the command calls --mapping."""
    shards = str(tmp_path / "shards")
    dcp.save({"w": torch.zeros(2), "x": torch.ones(3)},
             storage_writer=HuggingFaceStorageWriter(shards, save_distributed=True))
    mapping = tmp_path / "mapping.json"
    mapping.write_text(json.dumps({"w": 1}))
    assert cli.main(["consolidate", shards, str(tmp_path / "out"), "--mapping", str(mapping), "-q"]) != cli.EXIT_OK
    assert ("the file split given (fqn_to_index_mapping; consolidate's --mapping) has no file index for 1 tensor(s) "
            "the shards hold, e.g. ['x']") in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


def _writing(command: str, hf_folder: str, shards: str) -> list[str]:
    """The arguments of `command` before its OUT_DIR."""
    return ["convert", "--to", "dcp", hf_folder] if command == "convert" else ["consolidate", shards]


@pytest.mark.parametrize("command", ["convert", "consolidate"])
def test_an_object_store_output_is_refused_before_any_work(hf_folder, shards, tmp_path, monkeypatch, capsys, command):
    """convert and consolidate write local files: an s3:// OUT_DIR is an input error, and nothing
    is written (no folder `./s3:/bkt/out`)."""
    monkeypatch.chdir(tmp_path)
    assert cli.main([*_writing(command, hf_folder, shards), "s3://bkt/out", "-q"]) == cli.EXIT_INPUT
    assert capsys.readouterr() == ("", "error: s3://bkt/out: OUT_DIR must be a local folder (this command uploads "
                                       "nothing); write a local folder, then upload it with your own tool\n")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("command", ["convert", "consolidate"])
def test_an_output_that_is_a_file_is_refused_before_any_work(hf_folder, shards, tmp_path, capsys, command):
    out = tmp_path / "out"
    out.write_text("mine")
    assert cli.main([*_writing(command, hf_folder, shards), str(out), "-q"]) == cli.EXIT_INPUT
    assert capsys.readouterr() == ("", f"error: {out} exists and is not a folder; remove it or name a new folder\n")
    assert os.listdir(tmp_path) == ["out"] and out.read_text() == "mine"


@pytest.mark.parametrize("command", ["convert", "consolidate"])
def test_an_output_that_is_a_link_is_refused_before_any_work(hf_folder, shards, tmp_path, capsys, command):
    """A link to an empty folder: the work was done, then renaming it in failed."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "out")
    assert cli.main([*_writing(command, hf_folder, shards), str(tmp_path / "out"), "-q"]) == cli.EXIT_INPUT
    assert capsys.readouterr() == ("", f"error: {tmp_path / 'out'} is a link; name the folder itself "
                                       f"({tmp_path / 'real'})\n")
    assert sorted(os.listdir(tmp_path)) == ["out", "real"] and os.listdir(tmp_path / "real") == []


def test_an_output_that_cannot_take_its_name_leaves_no_partial_folder(hf_folder, tmp_path, monkeypatch, capsys):
    """Another program makes a file named OUT_DIR while the command works: the final rename
    fails (exit 2) and OUT_DIR.partial is removed, so a retry is not refused for it."""
    out = str(tmp_path / "out")
    real = cli.convert

    def convert_then_clash(*args, **kwargs):
        real(*args, **kwargs)
        with open(out, "w") as f:
            f.write("theirs")

    monkeypatch.setattr(cli, "convert", convert_then_clash)
    assert cli.main(["convert", "--to", "dcp", hf_folder, out, "-q"]) == cli.EXIT_INPUT
    assert "error: [Errno 20] Not a directory" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["out"]


def test_convert_names_the_config_it_did_not_find(small_step, tmp_path, capsys):
    """--hf-assets without a config.json is named as such; a source that is not a DCP folder is
    named before any config is looked for."""
    (tmp_path / "assets").mkdir()
    out = str(tmp_path / "hf")
    assert cli.main(["convert", "--to", "hf", small_step, out, "--hf-assets", str(tmp_path / "assets"), "-q"]) == 2
    assert capsys.readouterr() == ("", f"error: {tmp_path / 'assets' / 'config.json'} not found: --hf-assets must "
                                       "name an HF folder holding the model's config.json\n")
    assert cli.main(["convert", "--to", "hf", str(tmp_path / "nothing"), out, "-q"]) == 2
    assert capsys.readouterr() == ("", f"error: {tmp_path / 'nothing'} does not exist\n")
    assert sorted(os.listdir(tmp_path)) == ["assets"]


def test_quiet_means_nothing_on_stderr(hf_folder, tmp_path):
    """-q: the result on stdout, and no warning of DCP's about saving outside torchrun."""
    out = str(tmp_path / "out")
    done = subprocess.run([*CMD, "convert", "--to", "dcp", hf_folder, out, "-q"], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=300)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"converted {hf_folder} -> {out} (dcp)\n", "")


def test_the_example_job_has_a_help(capsys):
    """`--help` was taken for an override and refused as a config error."""
    from torchtitan_ckpt.example import train  # noqa: PLC0415

    assert train.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m torchtitan_ckpt.example.train [--config FILE.toml]")


def test_the_example_job_reports_a_checkpoint_error_without_a_traceback(tmp_path):
    """A step to load that is not there: the job's message, exit status 2 (run_job: not 0)."""
    log = run_job(str(tmp_path), "--checkpoint.load_step", "99", expect_ok=False)
    assert "Traceback" not in log, log
    assert log.endswith(f"checkpoint error: checkpoint.load_step = 99: {tmp_path}/checkpoint/step-99 does not "
                        f"exist; {tmp_path}/checkpoint holds no step: is it the folder the run saved into?\n"), log


def test_convert_of_a_dtype_safetensors_cannot_hold_is_an_input_error(tmp_path, capsys):
    """complex128 weights: a traceback and exit 1 (a TypeError the CLI did not catch)."""
    path = str(tmp_path / "step-1")
    dcp.save({k: v.to(torch.complex128) for k, v in Transformer(FLAVORS["debugmodel"]).state_dict().items()},
             checkpoint_id=path)
    with open(os.path.join(path, RECORDED_CONFIG), "w") as f:
        json.dump(hf_config(FLAVORS["debugmodel"]), f)
    out = str(tmp_path / "hf")
    assert cli.main(["convert", "--to", "hf", path, out, "-q"]) == cli.EXIT_INPUT
    assert "has dtype torch.complex128, which safetensors cannot hold" in capsys.readouterr().err
    assert not os.path.exists(out)


def _two_saved_steps(tmp_path) -> str:
    """A run folder holding steps 1 and 2 of a small model."""
    model = torch.nn.Linear(8, 8)
    with CheckpointManager(Checkpoint(enable=True, interval=1, keep_latest_k=0), [model],
                           base_folder=str(tmp_path)) as manager:
        manager.save(1)
        manager.save(2)
    return str(tmp_path / "checkpoint")


def test_a_step_removed_after_the_listing_is_not_listed(tmp_path):
    """A job saving into the folder removes a step between `list`'s listing and its read of the
    step's marker (retention removes the marker first): not a `corrupt` step, which the docs
    tell an operator to remove by hand, but one gone."""
    folder = _two_saved_steps(tmp_path)
    with cli._opened(folder, "folder") as (store, local):
        listed = store.scan(local)
        os.remove(os.path.join(layout.step_dir(folder, 1), commit.MARKER))
        records = [cli._step_record(s, store) for s in listed]
    assert records[0] is None and records[1]["status"] == layout.COMPLETE


def test_a_step_removed_while_verified_is_said_removed(tmp_path, monkeypatch, capsys):
    """Retention removing the step `verify` checks: exit status 2 saying so, not 1 and
    `CORRUPT` lines for files that are only gone."""
    step = layout.step_dir(_two_saved_steps(tmp_path), 1)
    checks = commit.check_files

    def removed_meanwhile(path, *args, **kwargs):  # the other job's retention, at this moment
        shutil.rmtree(step)
        return checks(path, *args, **kwargs)

    monkeypatch.setattr(commit, "check_files", removed_meanwhile)
    assert cli.main(["verify", step]) == 2
    out = capsys.readouterr()
    assert "was removed while it was verified" in out.err and "CORRUPT" not in out.out


def test_convert_makes_its_output_s_name_durable(small_step, tmp_path, monkeypatch):
    """OUT.partial was made and renamed to OUT with no fsync of their folder: after a power loss
    the command's output could be gone though it had said "converted"."""
    calls = syscalls(monkeypatch)
    out = str(tmp_path / "hf")
    assert cli.main(["convert", "--to", "hf", small_step, out, "-q"]) == 0
    renamed = calls.index(("rename", out))
    assert ("fsync", str(tmp_path)) in calls[renamed:], calls[renamed:]
