"""Ranks that do not see the same files: a checkpoint folder on node-local disks, or a copy of a
step on each node's disk that differs. Each rank bind-mounts a disk of its own at one path, in a
mount namespace of its own, as the nodes of a job see one path and their own disks."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from torchtitan_ckpt import CheckpointError, CheckpointManager, commit, layout
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.storage.local import LOCK_FILE

from .helpers import ROOT, spawn

pytestmark = pytest.mark.multirank

_CLONE_NEWNS = 0x00020000


class _SameNames:
    """An adapter of TorchTitan's surface that renames nothing."""

    def __init__(self, hf_assets_path: str):
        self.hf_assets_path, self.fqn_to_index_mapping = hf_assets_path, None

    def to_hf(self, state_dict):
        return dict(state_dict)

    def from_hf(self, hf_state_dict):
        return dict(hf_state_dict)


def _model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 8)


def _save(folder: str, bump: float) -> str:
    """A step 20 of a 1-rank run whose weights are `bump` away from its seed; its folder."""
    model = _model()
    with torch.no_grad():
        model.weight.add_(bump)
    with CheckpointManager(Checkpoint(enable=True, interval=10, keep_latest_k=0), [model],
                           base_folder=folder) as manager:
        manager.save(20)
    return layout.step_dir(os.path.join(folder, "checkpoint"), 20)


# case -> (what rank 0's disk holds there, what rank 1's does): a step of run "a" or "b", committed
# or foreign (DCP's files alone), or an HF folder of run "a" or of "a" with one more tensor
CASES = {
    "same copies": ("a", "a"),
    "flipped on rank 0": ("a flipped", "a"),
    "other run": ("a", "b"),
    "other foreign run": ("a foreign", "b foreign"),
    "foreign on rank 0 only": ("a foreign", None),
    "none on rank 0": (None, "a"),
    "same hf": ("a hf", "a hf"),
    "other hf": ("a hf", "a hf+"),
}


def _disks(tmp) -> None:
    runs = {name: _save(str(tmp / f"run-{name}"), bump) for name, bump in (("a", 1.0), ("b", 100.0))}
    for rank in (0, 1):
        for case, held in CASES.items():
            what = held[rank]
            steps = tmp / f"disk-{rank}" / case / "checkpoint"
            steps.mkdir(parents=True)
            if what is None:
                continue
            step = steps / "step-20"
            if what.endswith(("hf", "hf+")):
                step.mkdir()
                weights = {k: v.clone() for k, v in _model().state_dict().items()}
                if what.endswith("+"):
                    weights["extra"] = torch.zeros(4)
                save_file(weights, str(step / "model.safetensors"))
                continue
            shutil.copytree(runs[what.split()[0]], step)
            if what.endswith("flipped"):  # the data file rank 1 verifies in the copy it reads
                with open(step / "__0_0.distcp", "r+b") as f:
                    f.seek(100)
                    byte = f.read(1)
                    f.seek(100)
                    f.write(bytes([byte[0] ^ 1]))
            if what.endswith("foreign"):
                os.remove(step / commit.MARKER)
                os.remove(step / commit.IN_PROGRESS)
    (tmp / "local").mkdir()


def _own_disk(tmp: str, rank: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["mount", "--bind", os.path.join(tmp, f"disk-{rank}"), os.path.join(tmp, "local")], check=True)


def _load_each(rank: int, world_size: int, tmp: str) -> None:
    _own_disk(tmp, rank)
    found = {}
    for case in CASES:
        model = _model(seed=123)
        hf = "hf" in str(CASES[case][0])
        config = Checkpoint(enable=True, load_only=not hf, collective_timeout_s=60,
                            verify_on_load="flipped" in str(CASES[case][0]),
                            **(dict(folder=os.path.join(tmp, "empty", case), initial_load_in_hf=True,
                                    initial_load_path=os.path.join(tmp, "local", case, "checkpoint", "step-20"))
                               if hf else {}))
        try:
            with CheckpointManager(config, [model], base_folder=os.path.join(tmp, "local", case),
                                   state_dict_adapter=_SameNames(tmp) if hf else None) as manager:
                found[case] = {"loaded": manager.load(), "w": float(model.weight[0, 0])}
        except Exception as e:
            found[case] = {"error": f"{type(e).__name__}: {e}"}
    with open(os.path.join(tmp, f"found-{rank}.json"), "w") as f:
        json.dump(found, f)


def test_ranks_that_see_different_files_are_refused_alike_never_load_different_steps(tmp_path):
    """Each rank read its own copy: a load-only job (or an initial load) with a step of another
    run on rank 1's disk loaded both, rank 0 one run's weights and rank 1 the other's, saying
    nothing; with no step on rank 0's disk every rank started from scratch; a step another
    program wrote, missing on rank 1, failed rank 1 at once and left rank 0 waiting out the
    collective timeout."""
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.strip()[-200:]}")
    _disks(tmp_path)
    spawn(2, _load_each, str(tmp_path))
    found = [json.loads((tmp_path / f"found-{rank}.json").read_text()) for rank in (0, 1)]
    for case in CASES:
        assert found[0][case].keys() == found[1][case].keys(), case  # every rank loads, or every rank fails
    for case in ("same copies", "same hf"):
        assert found[0][case]["loaded"] and found[0][case] == found[1][case], case
    differs = "differs on rank(s) 1 from rank 0's: the ranks would load different checkpoints. Is the folder on "
    assert found[0]["other run"]["error"] == found[1]["other run"]["error"]
    assert found[0]["other run"]["error"].startswith(
        f"CorruptCheckpointError: {tmp_path}/local/other run/checkpoint/step-20/COMMITTED.json {differs}")
    assert found[0]["other foreign run"]["error"].startswith(
        f"CorruptCheckpointError: {tmp_path}/local/other foreign run/checkpoint/step-20/.metadata {differs}")
    assert found[0]["other hf"]["error"].startswith(
        f"CorruptCheckpointError: {tmp_path}/local/other hf/checkpoint/step-20 (its safetensors files) {differs}")
    for rank in (0, 1):  # rank 1 checked the data file in its copy, and no rank the one rank 0 reads
        assert found[rank]["flipped on rank 0"]["error"] == (
            f"CorruptCheckpointError: every complete step in {tmp_path}/local/flipped on rank 0/checkpoint failed "
            "verification or holds another step than its folder's name (each is named above)"), found[rank]
    assert "CorruptCheckpointError: " in found[1]["foreign on rank 0 only"]["error"]
    assert found[0]["foreign on rank 0 only"]["error"].startswith(
        f"CheckpointError: reading {tmp_path}/local/foreign on rank 0 only/checkpoint/step-20/.metadata failed on "
        "rank 1: ")
    for rank in (0, 1):
        assert found[rank]["none on rank 0"]["error"] == (
            f"CheckpointNotFoundError: rank 0 sees no loadable step in {tmp_path}/local/none on rank 0/checkpoint, "
            "and rank(s) 1 see some: the ranks do not share the folder (node-local disks, a mount missing on rank "
            "0's node?); every rank would start from scratch. Give every rank the same folder")


_CLEAN_UNLOCKED = """
import errno, fcntl, sys
def refused(fd, op):  # what NFS without its lock daemon answers
    raise OSError(errno.ENOLCK, "No locks available")
fcntl.flock = refused
from torchtitan_ckpt.cli import main
sys.exit(main(["clean", *sys.argv[1:]]))
"""


def test_clean_where_the_folder_cannot_be_locked_is_refused_unless_forced(tmp_path):
    """A file system that refuses locks (the kernel's answer, ENOLCK, put in its place): `clean`
    went on, and removed the save in flight of a job on another node as partial."""
    folder = tmp_path / "checkpoint"
    partial = folder / "step-30"
    partial.mkdir(parents=True)
    commit.mark_in_progress(str(partial))
    (folder / LOCK_FILE).write_text("pid 1 on another-node")
    env = {**os.environ, "PYTHONPATH": ROOT}

    def clean(*args):
        return subprocess.run([sys.executable, "-c", _CLEAN_UNLOCKED, str(folder), *args], capture_output=True,
                              text=True, env=env, timeout=120)

    refused = clean()
    assert refused.returncode != 0 and partial.is_dir()
    assert f"{folder}: its file system did not lock {folder / LOCK_FILE}, so a job saving there now" in refused.stderr
    assert "run clean --force" in refused.stderr
    forced = clean("--force")
    assert forced.returncode == 0, forced.stderr
    assert not partial.exists() and f"removed {partial} (partial)" in forced.stdout


def _made_with_a_network_gloo_cannot_use(rank: int, world_size: int, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "no-such-if0"  # read by gloo as each group is made
    try:
        CheckpointManager(Checkpoint(enable=True, collective_timeout_s=30), [_model()], base_folder=out)
    except Exception as e:
        with open(os.path.join(out, f"error-{rank}"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")


def test_a_checkpoint_group_gloo_cannot_connect_names_gloo_s_network_setting(tmp_path):
    """A job whose NCCL finds its network while gloo takes an address other nodes cannot reach
    was told that a rank did not join a collective, to call save() and load() alike."""
    spawn(2, _made_with_a_network_gloo_cannot_use, str(tmp_path))
    for rank in (0, 1):
        said = (tmp_path / f"error-{rank}").read_text()
        assert said.startswith(f"CollectiveError: a collective among the checkpoint's 2 ranks failed on rank {rank} ("
                               "[enforce fail at "), said
        assert "Unable to find address for: no-such-if0" in said
        assert said.endswith("Every rank makes its CheckpointManager, with checkpoint.enable = true (a disabled one "
                             "makes no group). Across nodes, gloo connects the ranks at the "
                             "address each host's name resolves to (127.0.1.1 on some hosts, which other nodes cannot "
                             "reach) or on GLOO_SOCKET_IFNAME: set that to the network interface the nodes reach each "
                             "other on")


def test_a_folder_claimed_by_a_job_on_another_node_fails_the_commit_not_the_other_job_s_steps(tmp_path):
    """Where the file system's locks hold only on each node, a second job on another node is
    granted the lock too and writes itself in the lock file (as here, by hand): the first went
    on saving, each job replacing the other's steps in flight."""
    with CheckpointManager(Checkpoint(enable=True, interval=1), [_model()], base_folder=str(tmp_path)) as manager:
        manager.save(1)
        (tmp_path / "checkpoint" / LOCK_FILE).write_text("pid 4242 on node-b")
        with pytest.raises(CheckpointError, match=f"{tmp_path}/checkpoint: pid 4242 on node-b claimed this folder "
                                                  r"after this job did \(its \.torchtitan_ckpt\.lock names it\): this "
                                                  "file system's locks hold only on each node"):
            manager.save(2)
    assert layout.committed_steps(str(tmp_path / "checkpoint")) == [1]


def test_clean_leaves_the_lock_file_naming_the_job_that_saves_there(tmp_path):
    """`clean` wrote itself in the lock file: where locks hold only on each node, the job saving
    there from another node then failed each later commit, naming a `clean` long gone."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / LOCK_FILE).write_text("pid 4242 on node-b")
    done = subprocess.run([sys.executable, "-m", "torchtitan_ckpt.cli", "clean", str(folder)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (folder / LOCK_FILE).read_text() == "pid 4242 on node-b"
