"""The example job and the manager on each device the machine has: the CPU always, CUDA where a GPU
is visible (the device check of docs/async.md runs this file there). The same assertions hold on
both, so what CI runs on the CPU is what a GPU machine checks of its own paths: staging from GPU
memory (side stream, pinned buffers), loads into GPU tensors, an HF export of a GPU model."""

from __future__ import annotations

import filecmp
import os
import re

import pytest
import torch

from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.example.model import hf_adapter
from torchtitan_ckpt.example.train import build_model

from .helpers import assert_same, losses, perturbed, run_job

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                  reason="needs a CUDA GPU"))]
JOB = ("--training.steps", "8", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0",
       "--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "float32")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [("disabled",), ("async",), ("async_with_pinned_mem",),
                                  ("async", "--checkpoint.verify_staging", "true")], ids=lambda m: "-".join(m))
def test_the_job_resumes_bit_identically_and_exports_the_same_bytes(tmp_path, device, mode):
    """A run stopped at step 4 and resumed logs the losses of a straight run, bit for bit, and its
    last step's HF export (float32, from the device's tensors) is the same bytes."""
    job = (*JOB, "--training.device", device, "--checkpoint.async_mode", mode[0], *mode[1:])
    straight = run_job(str(tmp_path / "straight"), *job)
    run_job(str(tmp_path / "resumed"), *job, "--training.stop_at_step", "4")
    resumed = run_job(str(tmp_path / "resumed"), *job)
    assert f"({device}" in straight and "step-4" in re.search(r"loaded step 4 from (\S+)", resumed)[1], resumed[-2000:]
    expected = {s: loss for s, loss in losses(straight).items() if s > 4}
    assert losses(resumed) == expected and len(expected) == 4
    a, b = (tmp_path / run / "checkpoint" / "step-8" for run in ("straight", "resumed"))
    files = sorted(f for f in os.listdir(a) if f.endswith(".safetensors"))
    assert files and sorted(f for f in os.listdir(b) if f.endswith(".safetensors")) == files
    assert filecmp.cmpfiles(a, b, files, shallow=False)[0] == files


@pytest.mark.parametrize("saved_on", DEVICES)
@pytest.mark.parametrize("loaded_on", DEVICES)
@pytest.mark.parametrize("hf", [False, True], ids=["dcp", "hf"])
def test_a_step_saved_from_one_device_loads_into_another(tmp_path, saved_on, loaded_on, hf):
    """DCP's step and the HF export of a model on `saved_on` load into a model on `loaded_on`
    (the tensors stay on their device) with the saved values."""
    config = load_job_config(None, [])
    model = build_model(config).to(saved_on)
    adapter = hf_adapter(model.args)
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    ck = Checkpoint(enable=True, interval=1, keep_latest_k=0, last_save_in_hf=hf)
    with CheckpointManager(ck, [model], base_folder=str(tmp_path), state_dict_adapter=adapter) as manager:
        manager.save(1, last_step=hf)
    other = perturbed(build_model(config)).to(loaded_on)
    ck = Checkpoint(enable=True, load_only=True)
    with CheckpointManager(ck, [other], base_folder=str(tmp_path), state_dict_adapter=adapter) as manager:
        assert manager.load() == 1
    state = other.state_dict()
    assert {v.device.type for v in state.values()} == {loaded_on}
    assert_same({k: v.cpu() for k, v in state.items()}, expected)
