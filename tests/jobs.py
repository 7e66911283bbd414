"""A small in-process job (the example model, unsharded) for single-process manager tests."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import validate_tree
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.example.data import build_dataloader
from torchtitan_ckpt.example.model import hf_adapter
from torchtitan_ckpt.example.train import TrainState, build_model, lr_lambda


@dataclass
class Job:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    loader: object
    train_state: TrainState
    manager: CheckpointManager
    batches: object = None

    def step(self) -> float:
        """One training step, then `manager.save` as the job would call it."""
        if self.batches is None:
            self.batches = iter(self.loader)
        inputs, labels = next(self.batches)
        loss = F.cross_entropy(self.model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        self.train_state.step += 1
        self.train_state.ntokens_seen += labels.numel()
        return loss.item()

    def run_to(self, last: int, steps: int) -> None:
        while self.train_state.step < last:
            self.step()
            self.manager.save(self.train_state.step, last_step=self.train_state.step == steps)


def make_job(dump_folder: str, steps: int = 8, init_seed: int = 0, extra_states: dict | None = None,
             **checkpoint) -> Job:
    """A job whose model is initialised from `init_seed`; its data is the same for every seed.
    `extra_states` are given to the manager besides `train_state`."""
    config = load_job_config(None, ["--checkpoint.enable", "true", "--training.steps", str(steps)])
    config.checkpoint = replace(config.checkpoint, **checkpoint)
    config.training.seed = init_seed
    validate_tree(config)
    ck = config.checkpoint
    model = build_model(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(2, steps, 0.1))
    loader = build_dataloader(model.args.vocab_size, 16, 4, 0, 0, 1)
    ts = TrainState()
    manager = CheckpointManager(ck, [model], optimizers=opt, lr_schedulers=sched, dataloader=loader,
                                states={"train_state": ts, **(extra_states or {})}, base_folder=dump_folder,
                                state_dict_adapter=hf_adapter(model.args))
    return Job(model, opt, sched, loader, ts, manager)
