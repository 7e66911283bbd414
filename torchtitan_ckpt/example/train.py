"""The example training job: a small Llama on synthetic data, checkpointed by CheckpointManager.

    python -m torchtitan_ckpt.example.train --config configs/debug_model.toml [--section.key value ...]
    torchrun --nproc_per_node 2 -m torchtitan_ckpt.example.train --config configs/debug_model.toml
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from .. import layout
from ..errors import CheckpointError, ConfigError
from ..group import launched_group, leave
from ..manager import CheckpointManager
from ..storage import scheme_of
from .config import JobConfig, check_data, load_job_config
from .data import build_dataloader
from .model import FLAVORS, Transformer, hf_adapter
from .parallel import ParallelDims, build_meshes, clip_grad_norm_, parallelize, pipeline_parts, select_device

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


def build_model(config: JobConfig) -> Transformer:
    torch.manual_seed(config.training.seed)
    return Transformer(FLAVORS[config.model.flavor])


def shard_model(model: Transformer, world_size: int, replicate: int = 1) -> None:
    """FSDP over all ranks, or HSDP when `replicate` > 1: a ("dp_replicate", "dp_shard") mesh of
    `replicate` x `world_size // replicate` ranks, each replica holding a sharded full copy; a
    CUDA mesh for a model on a GPU, else a CPU one (a model still on the meta device included)."""
    dims = ParallelDims(dp_replicate=replicate, dp_shard=world_size // replicate)
    cuda = next(model.parameters()).is_cuda
    parallelize(model, dims, build_meshes(dims, torch.device("cuda" if cuda else "cpu")))


@dataclass
class Run:
    """What one rank trains: its model parts (one, or its pipeline stages), an optimizer and an
    LR scheduler per part, and the pipeline schedule that drives the stages."""

    dims: ParallelDims
    device: torch.device
    parts: list[Transformer]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[torch.optim.lr_scheduler.LRScheduler]
    schedule: Any = None
    stages: list[PipelineStage] = field(default_factory=list)
    pp_group: dist.ProcessGroup | None = None

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch; the mean loss where this rank computes it."""
        if self.schedule is None:
            loss = _loss(self.parts[0](inputs), labels)
            loss.backward()
            return loss.detach()
        losses: list[torch.Tensor] = []
        first = any(stage.is_first for stage in self.stages)
        last = any(stage.is_last for stage in self.stages)
        self.schedule.step(*([inputs] if first else []), **(dict(target=labels, losses=losses) if last else {}))
        return torch.stack(losses).mean().detach() if last else None


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build_run(config: JobConfig, world_size: int, rank: int, device: torch.device) -> Run:
    """The model parts of `rank` on the meshes `config.parallelism` names, each with its optimizer
    and scheduler (`ConfigError` when the degrees do not fit `world_size`, or their data-parallel
    ranks the dataset)."""
    dims = ParallelDims.from_config(config.parallelism, world_size)
    check_data(config, dims.dp)
    model = build_model(config).to(device)
    staged, schedule, stages, pp_group = [(0, model)], None, [], None
    if world_size > 1:
        meshes = build_meshes(dims, device)
        if dims.pp > 1:
            staged = pipeline_parts(model, dims, dims.pp_rank(rank))
        for _, part in staged:
            parallelize(part, dims, meshes)
        if dims.pp > 1:
            pp_group = meshes.world["pp"].get_group()
            stages = [PipelineStage(part, index, dims.pp * dims.stages_per_rank, device, group=pp_group)
                      for index, part in staged]
            schedule = _schedule(config, dims, stages)
    o, tc = config.optimizer, config.training
    optimizers = [torch.optim.AdamW(part.parameters(), lr=o.lr, eps=o.eps, weight_decay=o.weight_decay, foreach=False)
                  for _, part in staged]
    factor = lr_lambda(config.lr_scheduler.warmup_steps, tc.steps, config.lr_scheduler.min_lr_factor)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, factor) for opt in optimizers]
    return Run(dims, device, [part for _, part in staged], optimizers, schedulers, schedule, stages, pp_group)


_SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}


def _schedule(config: JobConfig, dims: ParallelDims, stages: list[PipelineStage]) -> Any:
    p = config.parallelism
    microbatches = config.training.local_batch_size // p.pipeline_parallel_microbatch_size
    cls = _SCHEDULES[p.pipeline_parallel_schedule]
    return cls(stages if dims.stages_per_rank > 1 else stages[0], microbatches, loss_fn=_loss)


def train(config: JobConfig, device: torch.device | None = None) -> None:
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = device or select_device(config.training.device)[0]
    if rank == 0:
        logger.info("%s: %s/%s on %d rank(s) (%s), %d steps", config.job.description, config.model.name,
                    config.model.flavor, world_size, device, config.training.steps)
    ck = config.checkpoint
    if ck.create_seed_checkpoint:
        model = build_model(config)
        adapter = hf_adapter(model.args, hf_assets_path=config.model.hf_assets_path)
        with CheckpointManager(ck, [model], base_folder=config.job.dump_folder, state_dict_adapter=adapter) as manager:
            manager.save(0)
        logger.info("seed checkpoint written to %s", layout.step_dir(config.checkpoint_folder, 0))
        return
    run = build_run(config, world_size, rank, device)
    adapter = hf_adapter(FLAVORS[config.model.flavor], hf_assets_path=config.model.hf_assets_path)
    tc = config.training
    loader = build_dataloader(FLAVORS[config.model.flavor].vocab_size, tc.seq_len, tc.local_batch_size, tc.seed,
                              run.dims.dp_rank(rank), run.dims.dp)
    train_state = TrainState()
    with CheckpointManager(ck, run.parts, optimizers=run.optimizers, lr_schedulers=run.schedulers,
                           dataloader=loader, states={"train_state": train_state},
                           base_folder=config.job.dump_folder, state_dict_adapter=adapter) as manager:
        manager.load()
        tc = config.training
        train_steps(config, run, iter(loader), train_state, manager,
                    min(tc.steps, tc.stop_at_step) if tc.stop_at_step else tc.steps)
    if rank == 0:
        folder = config.checkpoint_folder
        logger.info("done at step %d; checkpoints in %s", train_state.step,
                    folder if scheme_of(folder) else os.path.abspath(folder))


def train_steps(config: JobConfig, run: Run, batches: Iterator, train_state: TrainState,
                manager: CheckpointManager, last: int) -> dict[int, float | None]:
    """Train from the step after `train_state.step` to `last`, saving as the manager decides;
    returns each step's loss as this rank computed it (None on a pipeline rank without the last
    stage)."""
    tc = config.training
    params = [p for part in run.parts for p in part.parameters()]
    losses = {}
    for step in range(train_state.step + 1, last + 1):
        inputs, labels = (t.to(run.device) for t in next(batches))
        loss = run.step(inputs, labels)
        if tc.max_norm > 0:
            clip_grad_norm_(params, tc.max_norm, run.pp_group)
        for opt, sched in zip(run.optimizers, run.schedulers):
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        train_state.step = step
        train_state.ntokens_seen += labels.numel()
        losses[step] = None if loss is None else loss.item()
        _log_step(step, loss, run.schedulers[0].get_last_lr()[0], run)
        manager.save(step, last_step=step == tc.steps)
    return losses


def _log_step(step: int, loss: torch.Tensor | None, lr: float, run: Run) -> None:
    """Rank 0 logs the mean loss over the ranks that compute one (the last pipeline stage's);
    the others add a zero on the same device (so the same backend)."""
    if dist.is_initialized():
        loss = torch.zeros((), device=run.device) if loss is None else loss
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        loss = loss / (dist.get_world_size() // run.dims.pp)
    if not dist.is_initialized() or dist.get_rank() == 0:
        # repr of the float: exact, so runs can be compared bit for bit
        logger.info("step %d loss %r lr %.6g", step, loss.item(), lr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(f"usage: python -m torchtitan_ckpt.example.train [--config FILE.toml] [--section.key value ...]\n\n"
              f"{__doc__.strip()}\n\nEvery key, its type and default: docs/config.md (checkpoint keys under "
              "[checkpoint], e.g. --checkpoint.interval 5).")
        return 0
    path, argv = _split_config(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        config = load_job_config(path, argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    torch.use_deterministic_algorithms(True)
    try:
        device, backend = select_device(config.training.device)
        with launched_group(backend):
            train(config, device)
    except ConfigError as e:  # the parallelism degrees against the number of ranks, at start
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # a step to load that is missing or damaged, a save that failed
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 2
    return 0


def _split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """The TOML path of `--config FILE` or `--config=FILE` (at most once), and the overrides
    left. An override's value never starts with `--`, so every `--config` here is the option."""
    path, rest, i = None, [], 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if arg != "--config" and not arg.startswith("--config="):
            rest.append(arg)
            continue
        if path is not None:
            raise SystemExit("--config is given twice; pass one TOML file")
        if arg == "--config" and i < len(argv) and not argv[i].startswith("--"):
            arg, i = f"--config={argv[i]}", i + 1
        path = arg.partition("=")[2]
        if not path:
            raise SystemExit("--config needs a path to a TOML file")
    return path, rest


if __name__ == "__main__":
    leave(main())
