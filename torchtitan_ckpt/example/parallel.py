"""The example job's meshes, in TorchTitan's layout and with its config names: pipeline stages as
model parts, HSDP / FSDP, tensor parallelism and expert parallelism for MoE flavors.

The ranks form one mesh `(pp, dp_replicate, dp_shard, tp)`, outermost first. Expert parallelism
carves `ep` out of the innermost `dp_shard` ranks: MoE experts live on a second mesh
`(pp, dp_replicate, efsdp, ep)` over the same ranks (`dp_shard = efsdp x ep`), `Shard(0)` on `ep`
and FSDP-sharded over `(dp_replicate,) efsdp`; every other parameter is FSDP-sharded over all of
`dp_shard`.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..errors import ConfigError
from .config import PIPELINE_SCHEDULES, Parallelism
from .model import Transformer


_OUTER_DEGREES = ("pipeline_parallel_degree", "data_parallel_replicate_degree", "tensor_parallel_degree")
"""The degrees besides the shard degree, outermost first, as `ParallelDims.from_config` multiplies them."""


@dataclass(frozen=True)
class ParallelDims:
    """The degree of each mesh dimension; their product is the number of ranks."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    stages_per_rank: int = 1

    @classmethod
    def from_config(cls, p: Parallelism, world_size: int) -> ParallelDims:
        """The degrees `p` names on `world_size` ranks (a shard degree of -1 takes the ranks the
        others leave); `ConfigError` naming the keys when they do not multiply to the ranks."""
        others = math.prod(getattr(p, key) for key in _OUTER_DEGREES)
        names = " x ".join(f"{key} ({getattr(p, key)})" for key in _OUTER_DEGREES)
        if world_size % others:
            key = _first_misfit(p, world_size)
            raise ConfigError(f"parallelism.{key}", getattr(p, key),
                              f"{names} = {others} must divide the number of ranks ({world_size})")
        shard = world_size // others if p.data_parallel_shard_degree == -1 else p.data_parallel_shard_degree
        if others * shard != world_size:
            raise ConfigError("parallelism.data_parallel_shard_degree", shard,
                              f"{names} x data_parallel_shard_degree = {others * shard} must equal the number "
                              f"of ranks ({world_size}); or set data_parallel_shard_degree to -1")
        if shard % p.expert_parallel_degree:
            raise ConfigError("parallelism.expert_parallel_degree", p.expert_parallel_degree,
                              f"must divide data_parallel_shard_degree ({shard}): experts are sharded over "
                              "part of the data-parallel shard ranks")
        return cls(p.pipeline_parallel_degree, p.data_parallel_replicate_degree, shard, p.tensor_parallel_degree,
                   p.expert_parallel_degree, PIPELINE_SCHEDULES[p.pipeline_parallel_schedule])

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global `rank`: the ranks of one tp group, and of the stages
        of one pipeline, read the same data."""
        return (rank // self.tp) % self.dp

    def pp_rank(self, rank: int) -> int:
        return rank // (self.dp * self.tp)


def _first_misfit(p: Parallelism, world_size: int) -> str:
    """The degree (of those the shard degree does not take) at which their running product stops
    dividing `world_size`: one the user set above 1, named in the error instead of a default."""
    product = 1
    for key in _OUTER_DEGREES:
        product *= getattr(p, key)
        if world_size % product:
            return key
    raise AssertionError("called with degrees that divide world_size")


@dataclass
class Meshes:
    world: DeviceMesh
    experts: DeviceMesh | None

    @property
    def dp(self) -> DeviceMesh:
        """FSDP's mesh: `dp_shard`, or `(dp_replicate, dp_shard)` for HSDP."""
        return self.world["dp_shard"] if self.world["dp_replicate"].size() == 1 else \
            self.world["dp_replicate", "dp_shard"]

    @property
    def expert_dp(self) -> DeviceMesh:
        return self.experts["efsdp"] if self.experts["dp_replicate"].size() == 1 else \
            self.experts["dp_replicate", "efsdp"]


def select_device(name: str) -> tuple[torch.device, str]:
    """The device the model trains on and the process group backend for it: `auto` is CUDA (each
    rank on GPU `LOCAL_RANK` of those it sees, NCCL for its tensors, gloo beside it for CPU objects) where a GPU
    is present, else the CPU with gloo."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("training.device", name, "no CUDA device is visible to this process")
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()  # some launchers show one GPU per process
        torch.cuda.set_device(index)
        # use_deterministic_algorithms needs cuBLAS's fixed workspace on CUDA
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        return torch.device("cuda", index), "cpu:gloo,cuda:nccl"
    return torch.device("cpu"), "gloo"


def build_meshes(dims: ParallelDims, device: torch.device) -> Meshes:
    world = init_device_mesh(device.type, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp),
                             mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    experts = None
    if dims.ep > 1:
        experts = init_device_mesh(device.type, (dims.pp, dims.dp_replicate, dims.dp_shard // dims.ep, dims.ep),
                                   mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    return Meshes(world, experts)


def pipeline_parts(model: Transformer, dims: ParallelDims, pp_rank: int) -> list[tuple[int, Transformer]]:
    """This pipeline rank's stages as (stage index, model part): stage s of S holds layers
    [s*L/S, (s+1)*L/S), the first also the embedding, the last also the norm and output; rank r
    holds stages r, r + pp, ... (the looped order of interleaved schedules). Each part keeps the
    full model's parameter names."""
    stages = dims.pp * dims.stages_per_rank
    n_layers = len(model.layers)
    parts = []
    for stage in range(pp_rank, stages, dims.pp):
        part = copy.deepcopy(model)
        keep = range(stage * n_layers // stages, (stage + 1) * n_layers // stages)
        for name in [n for n in part.layers if int(n) not in keep]:
            del part.layers[name]
        if stage > 0:
            part.tok_embeddings = None
        if stage < stages - 1:
            part.norm, part.output = None, None
        parts.append((stage, part))
    return parts


def parallelize(model: Transformer, dims: ParallelDims, meshes: Meshes) -> None:
    """Tensor parallel, then expert parallel, then FSDP (per block, then the rest), in place."""
    if dims.tp > 1:
        _tensor_parallel(model, meshes.world["tp"])
    if dims.ep > 1:
        _expert_parallel(model, meshes, dims)
    if dims.dp > 1:
        for block in model.layers.values():
            fully_shard(block, mesh=meshes.dp)
        fully_shard(model, mesh=meshes.dp)


_TP_PLAN = {"attention.wq": ColwiseParallel, "attention.wk": ColwiseParallel, "attention.wv": ColwiseParallel,
            "attention.wo": RowwiseParallel, "feed_forward.w1": ColwiseParallel,
            "feed_forward.w2": RowwiseParallel, "feed_forward.w3": ColwiseParallel}
"""Megatron's split: colwise (`Shard(0)`: whole heads, FFN columns) into rowwise (`Shard(1)`,
all-reduced output). The rest (embedding, norms, output, a MoE layer) stays a plain tensor on
every tp rank: its inputs are the same there, so are its gradients."""


def _tensor_parallel(model: Transformer, mesh: DeviceMesh) -> None:
    for block in model.layers.values():
        plan = {name: style() for name, style in _TP_PLAN.items() if hasattr(block, name.split(".")[0])}
        parallelize_module(block, mesh, plan)


def _expert_parallel(model: Transformer, meshes: Meshes, dims: ParallelDims) -> None:
    """Experts `Shard(0)` on `ep`, FSDP over the rest of their data-parallel ranks. Each rank's
    experts see the tokens of the whole ep group, so their gradients are sums over the ep ranks'
    losses: divided by every data-parallel rank, as the other parameters' are."""
    ep = meshes.experts["ep"]
    for block in model.layers.values():
        if not hasattr(block, "moe"):
            continue
        experts = block.moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            setattr(experts, name, nn.Parameter(distribute_tensor(param.data, ep, [Shard(0)])))
        block.moe.ep_group = ep.get_group()
        fully_shard(experts, mesh=meshes.expert_dp)
        experts.set_gradient_divide_factor(float(dims.dp))
        experts.set_force_sum_reduction_for_comms(True)  # a sum, then the division: gloo has no PREMUL_SUM


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None) -> None:
    """Scale the gradients of `params` (this rank's model parts) to a total 2-norm of at most
    `max_norm`: each gradient's norm over its whole mesh (DTensors on several meshes mix here,
    which `torch.nn.utils.clip_grad_norm_` refuses), summed over the pipeline's stages."""
    squares = []
    for p in params:
        if p.grad is not None:
            norm = torch.linalg.vector_norm(p.grad)
            squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum()
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    scale = min(1.0, max_norm / (total.sqrt().item() + 1e-6))
    if scale < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
