"""Against the real torchtitan package, each version in its own folder (`make test` installs them
under .venv/torchtitan/, see the Makefile): TorchTitan's `CheckpointManager` and ours resume each
other's steps bit for bit, and ours never deletes TorchTitan's steps (tests/torchtitan_interop.py
holds the job and the checks)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .helpers import ROOT

TORCHTITAN_DIR = os.path.join(ROOT, ".venv", "torchtitan")
"""`<version>/` holds that torchtitan release, `common/` what importing it needs (Makefile)."""

CHECKS = [
    "ours loads TorchTitan's step from checkpoint.folder",
    "TorchTitan's steps all kept with keep_latest_k = 1",
    "ours loads TorchTitan's step as initial_load_path",
    "TorchTitan loads our step with load(step=5)",
    "TorchTitan's adapter exports an HF folder through ours that transformers loads",
    "our convert writes TorchTitan's step as TorchTitan's adapter does",
    "TorchTitan's adapter imports the HF folder back through ours",
]

pytestmark = pytest.mark.multirank


def torchtitan_path(version: str) -> str:
    """The PYTHONPATH that imports torchtitan `version` next to this package."""
    folders = [os.path.join(TORCHTITAN_DIR, version), os.path.join(TORCHTITAN_DIR, "common")]
    missing = [f for f in folders if not os.path.isdir(f)]
    if missing and sys.version_info < (3, 11):
        pytest.skip("the torchtitan interop tests need Python 3.11 "
                    "(torchtitan 0.3.0, tests/requirements-torchtitan.txt)")
    if missing:
        pytest.skip(f"{', '.join(missing)} missing: `make test` installs torchtitan {version} there")
    return os.pathsep.join([ROOT, *folders])


@pytest.mark.parametrize("version", ["0.2.2", "0.3.0"])
def test_torchtitan_and_ours_resume_each_others_steps(version, tmp_path):
    env = {**os.environ, "PYTHONPATH": torchtitan_path(version), "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "tests", "torchtitan_interop.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           script, str(tmp_path)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    chosen = [] if version.startswith("0.2") else ["TorchTitan 0.3's config chooses ours, our keys on its command line"]
    assert [line[3:] for line in proc.stdout.splitlines() if line.startswith("OK ")] == CHECKS + chosen


def test_torchtitans_qwen3_model_goes_through_our_qwen3_adapter(tmp_path):
    """TorchTitan's Qwen3 rotates halves of a head as transformers does: the adapter's default
    for the family leaves q and k as they are (tests/torchtitan_qwen3.py)."""
    env = {**os.environ, "PYTHONPATH": torchtitan_path("0.2.2"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "torchtitan_qwen3.py"), str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert [line[3:] for line in proc.stdout.splitlines() if line.startswith("OK ")] == [
        "TorchTitan's Qwen3 imports the transformers checkpoint through our adapter",
        "transformers loads TorchTitan's Qwen3 exported through our adapter",
        "TorchTitan's Qwen3-MoE imports the transformers checkpoint through our adapter",
        "transformers loads TorchTitan's Qwen3-MoE exported through our adapter"]
