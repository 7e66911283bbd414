"""Steps written by other Pythons and PyTorches load here with the values they hold.

Each folder of tests/data/ named `dcp-python<X>-torch<Y>` holds a step that Python X with
PyTorch Y wrote with `dcp.save` (TorchTitan's way of saving), from a fresh process:

    state = {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
                       "b": torch.arange(3, dtype=torch.bfloat16)},
             "train_state": {"step": 7}}
    dcp.save(state, checkpoint_id="<folder>/step-7")

What differs between them is how Python pickles DCP's `.metadata`: Debian 12's Python 3.11.2
pickles an enum member (a tensor's memory format) as `getattr(its class, its name)`, Python
3.13 a `PosixPath` (the checkpoint's path) from `pathlib._local`. Both were refused as code.
PyTorch 2.9.1 (of TorchTitan 0.2's time) stands for the steps of an older PyTorch.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan_ckpt import cli
from torchtitan_ckpt.dcp import storage

from .helpers import ROOT

DATA = os.path.join(ROOT, "tests", "data")
WRITTEN_BY = sorted(name for name in os.listdir(DATA) if name.startswith("dcp-python"))


def test_there_are_steps_of_other_versions():
    assert WRITTEN_BY == ["dcp-python3.11.2-torch2.12.1", "dcp-python3.11.7-torch2.9.1", "dcp-python3.13.0-torch2.13.0"]


@pytest.mark.parametrize("written_by", WRITTEN_BY)
def test_a_step_of_another_python_and_pytorch_loads(written_by, capsys, caplog):
    """Loaded by the fast engine: no tensor item falls back to `torch.load`."""
    step = os.path.join(DATA, written_by, "step-7")
    state = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(3, dtype=torch.bfloat16)}, "train_state": {"step": 0}}
    with caplog.at_level(logging.DEBUG, logger="torchtitan_ckpt.io.reader"):
        dcp.load(state, storage_reader=storage.SafeFileSystemReader(step))
    assert "read with torch.load" not in caplog.text
    assert torch.equal(state["model"]["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(state["model"]["b"], torch.arange(3, dtype=torch.bfloat16))
    assert state["train_state"] == {"step": 7}
    assert cli.main(["inspect", step]) == 0
    assert "model.w" in capsys.readouterr().out
