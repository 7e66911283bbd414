"""The package as a typed dependency (`py.typed`): mypy, a real client, checks a user's script
against our annotations. The uses the docs show pass; wrong calls of the manager's methods are
caught (their signatures survive the one-call-at-a-time wrapper)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("mypy")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DOCUMENTED = '''
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from torchtitan_ckpt import (Checkpoint, CheckpointError, CheckpointManager, CollectiveError, StateLike,
                             load_config)
from torchtitan_ckpt.hf import adapter_for_hf_dir, load_hf, save_hf


@dataclass
class JobConfig:
    checkpoint: Checkpoint = field(default_factory=Checkpoint)


class TrainState:
    def __init__(self) -> None:
        self.step = 0
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}
    def load_state_dict(self, sd: dict[str, Any]) -> None:  # any parameter name, any return
        self.step = sd["step"]


class SameNames:  # docs/hf.md's adapter of TorchTitan's surface, untyped as users write it
    def __init__(self, hf_assets_path: str, tied: bool):
        self.hf_assets_path = hf_assets_path
        self.fqn_to_index_mapping = None
        self.tied = tied
    def to_hf(self, state_dict):
        return state_dict
    def from_hf(self, hf_state_dict):
        return hf_state_dict


config = load_config(JobConfig, Path("job.toml"), sys.argv[1:])
load_config(JobConfig, None, ("--checkpoint.enable",))
model = nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters())
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
ts = TrainState()
states = {"train_state": ts}                              # built beforehand
extra: dict[str, StateLike] = {"train_state": ts, "ema": nn.Linear(4, 4)}
manager = CheckpointManager(config.checkpoint, model_parts=[model], optimizers=opt, lr_schedulers=sched,
                            states=states, base_folder=Path("outputs"))
CheckpointManager(config.checkpoint, torch.compile(model), states=extra)
CheckpointManager(config.checkpoint, [fully_shard(nn.Linear(4, 4))], optimizers=(opt,))
CheckpointManager(config.checkpoint, (model, model), state_dict_adapter=SameNames("hf", tied=False))
CheckpointManager(config.checkpoint, [model], state_dict_adapter=adapter_for_hf_dir("hf"))
resumed: bool = manager.load()
manager.load(step=10)
try:
    written: bool = manager.save(10, last_step=True)
except (CollectiveError, CheckpointError):
    pass
manager.save(11, force=True)
manager.wait()
manager.maybe_wait_for_staging()
manager.close()
with CheckpointManager(Checkpoint(enable=True, folder="ckpt"), model) as m:
    m.save(1)
sd = model.state_dict()
load_hf(sd, Path("hf"), SameNames("hf", tied=False))
save_hf(sd, Path("out"), adapter_for_hf_dir("hf"), dtype=torch.bfloat16)
'''

WRONG = '''
from torch import nn
from torchtitan_ckpt import Checkpoint, CheckpointManager

manager = CheckpointManager(Checkpoint(), [nn.Linear(2, 2)])
manager.save("10")
manager.load(step="latest")
manager.save(10, last=True)
done: str = manager.load()
manager.close(1)
'''


def _mypy(tmp_path, name: str, source: str) -> subprocess.CompletedProcess:
    script = tmp_path / f"{name}.py"
    script.write_text(source)
    # MYPYPATH: an editable install's import hook is not something mypy follows
    env = {**os.environ, "MYPYPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"),
                           "--follow-imports=silent", "--ignore-missing-imports", "--no-error-summary",
                           "--check-untyped-defs", str(script)],
                          env=env, capture_output=True, text=True, timeout=600)


def test_the_documented_uses_type_check_and_wrong_calls_do_not(tmp_path):
    assert os.path.isfile(os.path.join(ROOT, "torchtitan_ckpt", "py.typed"))  # installed type checkers read ours
    good = _mypy(tmp_path, "documented", DOCUMENTED)
    assert good.returncode == 0, good.stdout + good.stderr
    bad = _mypy(tmp_path, "wrong", WRONG)
    lines = {int(m.group(1)) for m in re.finditer(r"wrong\.py:(\d+): error", bad.stdout)}
    assert lines == {6, 7, 8, 9, 10}, bad.stdout + bad.stderr
