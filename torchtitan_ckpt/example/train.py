"""The example training job: a small Llama on synthetic data, checkpointed by CheckpointManager.

    python -m torchtitan_ckpt.example.train --config configs/debug_model.toml [--section.key value ...]
    torchrun --nproc_per_node 2 -m torchtitan_ckpt.example.train --config configs/debug_model.toml
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from .config import JobConfig, load_job_config
from ..errors import ConfigError
from .data import build_dataloader
from .model import FLAVORS, Transformer, hf_adapter
from ..group import launched_group
from ..manager import CheckpointManager

logger = logging.getLogger(__name__)


class TrainState(Stateful):
    """The step reached and the tokens trained on: what TorchTitan's trainer saves as
    `train_state`, so either resumes the other's steps. (Training draws no global random
    numbers: the data has its own generator and the model is initialised before a load.)"""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.ntokens_seen = int(state_dict["ntokens_seen"])


def lr_lambda(warmup: int, steps: int, min_factor: float):
    """Linear warm-up to 1, then linear decay to `min_factor` at the last step."""

    def factor(step: int) -> float:  # `step` counts optimizer steps taken, from 0
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, steps - warmup)
        return 1.0 - (1.0 - min_factor) * min(1.0, progress)

    return factor


def _dp_degree(config: JobConfig, world_size: int) -> tuple[int, int]:
    """The (replicate, shard) data-parallel mesh shape; a shard degree of -1 takes the ranks the
    replicate degree leaves. Both must multiply to the number of ranks."""
    replicate = config.parallelism.data_parallel_replicate_degree
    shard = config.parallelism.data_parallel_shard_degree
    if shard == -1:
        if world_size % replicate:
            raise ConfigError("parallelism.data_parallel_replicate_degree", replicate,
                              f"must divide the number of ranks ({world_size})")
        shard = world_size // replicate
    if replicate * shard != world_size:
        raise ConfigError("parallelism.data_parallel_shard_degree", shard,
                          f"times data_parallel_replicate_degree ({replicate}) must equal the number "
                          f"of ranks ({world_size}); or set it to -1")
    return replicate, shard


def build_model(config: JobConfig) -> Transformer:
    torch.manual_seed(config.training.seed)
    return Transformer(FLAVORS[config.model.flavor])


def shard_model(model: Transformer, world_size: int, replicate: int = 1) -> None:
    """FSDP over all ranks, or HSDP when `replicate` > 1: a ("dp_replicate", "dp_shard") mesh of
    `replicate` x `world_size // replicate` ranks, each replica holding a sharded full copy."""
    if replicate == 1:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    else:
        mesh = init_device_mesh("cpu", (replicate, world_size // replicate),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train(config: JobConfig) -> None:
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    replicate, _shard = _dp_degree(config, world_size)
    if rank == 0:
        logger.info("%s: %s/%s on %d rank(s), %d steps", config.job.description, config.model.name,
                    config.model.flavor, world_size, config.training.steps)
    ck = config.checkpoint
    model = build_model(config)
    adapter = hf_adapter(model.args, hf_assets_path=config.model.hf_assets_path)
    if ck.create_seed_checkpoint:
        with CheckpointManager(ck, [model], base_folder=config.job.dump_folder, state_dict_adapter=adapter) as manager:
            manager.save(0)
        logger.info("seed checkpoint written to %s", os.path.join(config.checkpoint_folder, "step-0"))
        return
    if world_size > 1:
        shard_model(model, world_size, replicate)
    opt = torch.optim.AdamW(model.parameters(), lr=config.optimizer.lr, eps=config.optimizer.eps,
                            weight_decay=config.optimizer.weight_decay, foreach=False)
    steps = config.training.steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(config.lr_scheduler.warmup_steps, steps, config.lr_scheduler.min_lr_factor))
    tc = config.training
    # both mesh dimensions are data parallel: every rank reads its own part of the data
    loader = build_dataloader(model.args.vocab_size, tc.seq_len, tc.local_batch_size, tc.seed, rank,
                              world_size)
    train_state = TrainState()
    with CheckpointManager(ck, [model], optimizers=opt, lr_schedulers=sched, dataloader=loader,
                           states={"train_state": train_state}, base_folder=config.job.dump_folder,
                           state_dict_adapter=adapter) as manager:
        manager.load()
        batches = iter(loader)
        last = min(steps, tc.stop_at_step) if tc.stop_at_step else steps
        for step in range(train_state.step + 1, last + 1):
            inputs, labels = next(batches)
            loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
            loss.backward()
            if tc.max_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.max_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            train_state.step = step
            train_state.ntokens_seen += labels.numel()
            _log_step(step, loss.detach(), sched.get_last_lr()[0])
            manager.save(step, last_step=step == steps)
    if rank == 0:
        logger.info("done at step %d; checkpoints in %s", train_state.step,
                    os.path.abspath(config.checkpoint_folder))


def _log_step(step: int, loss: torch.Tensor, lr: float) -> None:
    if dist.is_initialized():
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        loss = loss / dist.get_world_size()
    if not dist.is_initialized() or dist.get_rank() == 0:
        # repr of the float: exact, so runs can be compared bit for bit
        logger.info("step %d loss %r lr %.6g", step, loss.item(), lr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    path = None
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise SystemExit("--config needs a path to a TOML file")
        path = argv[i + 1]
        del argv[i : i + 2]
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        config = load_job_config(path, argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    torch.use_deterministic_algorithms(True)
    with launched_group():
        train(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
