"""The example job's config: its own sections (job, model, training, ...) beside the library's
`[checkpoint]`, loaded by the library's generic `load_config`."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..config import Checkpoint, at_least, load_config
from ..errors import ConfigError
from ..hf.files import INDEX_FILE, SINGLE_FILE
from .data import SAMPLES
from .model import FLAVORS


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Root folder of the run's outputs; checkpoints go under `{dump_folder}/{checkpoint.folder}`."""

    description: str = "torchtitan_ckpt example job"
    """Free text, logged at start."""


@dataclass
class Model:
    name: str = "llama3"
    """Name of the example model, logged at start beside the flavor; only `llama3` is accepted. The
    model family follows `flavor` (`qwen3_debug` trains a Qwen3 model), whatever this name says."""

    flavor: str = "debugmodel"
    """Size preset of the example model, one of `torchtitan_ckpt.example.model.FLAVORS`."""

    hf_assets_path: str | None = None
    """A Hugging Face folder for this model: its `config.json` and index file split are used for
    exports, and its weights are the initial load with `checkpoint.initial_load_in_hf`."""


@dataclass
class Training:
    steps: int = 10
    """Number of optimizer steps of the whole run (the last one is the `last_step` save). A run is
    at most one pass over the synthetic dataset (65536 samples): each data-parallel rank gets an
    equal share of it, so at most share / `local_batch_size` steps."""

    seed: int = 0
    """Seed of the model initialisation, the synthetic data and the RNG state; any 64-bit integer."""

    local_batch_size: int = 8
    """Sequences per rank per step; at most a data-parallel rank's share of the synthetic dataset
    (65536 samples / the data-parallel degree). Memory grows with `local_batch_size x seq_len`
    tokens (the logits alone take 4 bytes x vocabulary size per token, kept for the backward
    pass); the config does not bound it further, as what fits depends on the machine."""

    seq_len: int = 64
    """Tokens per sequence: from 2 to the flavor's `max_seq_len` (2048 in every flavor), the
    positions its rotary embedding covers."""

    max_norm: float = 1.0
    """Gradient-norm clipping threshold; 0 disables clipping."""

    stop_at_step: int = 0
    """Stop this process after this step, as a preemption would (0 runs to `steps`). The step is
    not the last step: it is saved only if the schedule says so, and a later run resumes from it."""

    device: str = "auto"
    """Where the model trains: `auto` (CUDA with NCCL where a GPU is present, else the CPU with
    gloo), `cuda` or `cpu`. Checkpoint collectives run on a gloo group either way."""


@dataclass
class Optimizer:
    name: str = "AdamW"
    """Optimizer class. Only `AdamW` exists in the example job."""

    lr: float = 8e-4
    """Peak learning rate, reached at the end of warm-up; > 0."""

    eps: float = 1e-8
    """AdamW epsilon; >= 0."""

    weight_decay: float = 0.1
    """AdamW decoupled weight decay; >= 0."""


@dataclass
class LRScheduler:
    warmup_steps: int = 2
    """Steps of linear warm-up from 0 to `optimizer.lr`; then linear decay to `min_lr_factor * lr`."""

    min_lr_factor: float = 0.1
    """Learning rate at the last step, as a fraction of `optimizer.lr`."""


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = -1
    """FSDP shard degree; -1 takes the ranks the pipeline, replicate and tensor-parallel degrees leave."""

    data_parallel_replicate_degree: int = 1
    """HSDP replicate degree: the job's ranks form a (replicate x shard) mesh and each replica
    holds a full copy of the sharded state, so its tensors are replicated across replicas."""

    tensor_parallel_degree: int = 1
    """Tensor parallel degree (the innermost mesh dimension, `tp`): `wq`/`wk`/`wv`/`w1`/`w3`
    colwise (`Shard(0)`), `wo`/`w2` rowwise (`Shard(1)`), embeddings, norms and the output
    replicated. Must divide the flavor's heads, KV heads and FFN width; not with q/k norms
    (Qwen3 flavors) or expert parallelism."""

    pipeline_parallel_degree: int = 1
    """Pipeline parallel degree (the outermost mesh dimension, `pp`): the layers are split into
    stages, each a model part with its own optimizer and LR scheduler."""

    pipeline_parallel_schedule: str = "1F1B"
    """`torch.distributed.pipelining` schedule: `GPipe` or `1F1B` (one stage per rank), or
    `Interleaved1F1B` (two stages per rank, so two model parts on each rank)."""

    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline microbatch; must divide `training.local_batch_size`, into a multiple
    of `pipeline_parallel_degree` microbatches for the 1F1B schedules."""

    expert_parallel_degree: int = 1
    """Expert parallel degree for MoE flavors: the experts (`moe.experts.w1/w2/w3`) are
    `Shard(0)` on an `ep` dimension carved out of the data-parallel shard ranks (TorchTitan's
    layout), FSDP shards them over the rest; must divide `data_parallel_shard_degree` and the
    number of experts."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)

    @property
    def checkpoint_folder(self) -> str:
        """Where the step folders are: `{job.dump_folder}/{checkpoint.folder}` (absolute or
        relative), or `checkpoint.folder` itself when it is a URL (`s3://bucket/prefix`); a
        `ConfigError` naming `job.dump_folder` when the joined folder is not one to use."""
        return self.checkpoint.folder_under(self.job.dump_folder, "job.dump_folder")

    def validate(self, prefix: str = "") -> None:
        """The example job's own ranges, and what its sections say about each other."""
        _validate_sections(self)
        self.checkpoint.folder_under(self.job.dump_folder, "job.dump_folder")  # as the manager checks it
        _validate_training(self)
        _validate_parallelism(self)
        if self.checkpoint.initial_load_in_hf:
            _validate_hf_source(self)
        if self.model.hf_assets_path is not None and not os.path.isdir(self.model.hf_assets_path):
            raise ConfigError("model.hf_assets_path", self.model.hf_assets_path, "expected an existing folder")


def load_job_config(path: str | os.PathLike | None = None, argv: list[str] | None = None) -> JobConfig:
    """The example job's config from a TOML file and `--section.key value` overrides."""
    return load_config(JobConfig, path, argv)


def _validate_sections(c: JobConfig) -> None:
    if c.model.name != "llama3":
        raise ConfigError("model.name", c.model.name, "expected 'llama3'")
    if c.model.flavor not in FLAVORS:
        raise ConfigError("model.flavor", c.model.flavor, "expected one of " + ", ".join(FLAVORS))
    if c.optimizer.name != "AdamW":
        raise ConfigError("optimizer.name", c.optimizer.name, "expected 'AdamW'")
    for key, value, low in (("training.steps", c.training.steps, 1),
                            ("training.local_batch_size", c.training.local_batch_size, 1),
                            ("training.seq_len", c.training.seq_len, 2), ("training.max_norm", c.training.max_norm, 0),
                            ("training.stop_at_step", c.training.stop_at_step, 0),
                            ("lr_scheduler.warmup_steps", c.lr_scheduler.warmup_steps, 0),
                            ("parallelism.data_parallel_replicate_degree", c.parallelism.data_parallel_replicate_degree, 1)):
        at_least(key, value, low)
    if not 0 <= c.lr_scheduler.min_lr_factor <= 1:
        raise ConfigError("lr_scheduler.min_lr_factor", c.lr_scheduler.min_lr_factor, "expected 0..1")
    o = c.optimizer
    if not (math.isfinite(o.lr) and o.lr > 0):
        raise ConfigError("optimizer.lr", o.lr, "expected > 0 and finite")
    for key, value in (("optimizer.eps", o.eps), ("optimizer.weight_decay", o.weight_decay)):
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(key, value, "expected >= 0 and finite")
    dp = c.parallelism.data_parallel_shard_degree
    if dp == 0 or dp < -1:
        raise ConfigError("parallelism.data_parallel_shard_degree", dp, "expected -1 (all ranks) or >= 1")
    if not c.job.dump_folder:
        raise ConfigError("job.dump_folder", c.job.dump_folder, "expected a non-empty path")


def _validate_training(c: JobConfig) -> None:
    """What the model and the dataset can take; the data-parallel degree is its least here
    (`data_parallel_shard_degree` -1 takes 1), and checked again at start (`check_data`)."""
    max_seq_len = FLAVORS[c.model.flavor].max_seq_len
    if c.training.seq_len > max_seq_len:
        raise ConfigError("training.seq_len", c.training.seq_len, f"flavor {c.model.flavor} takes at most "
                          f"max_seq_len ({max_seq_len}) tokens per sequence")
    p = c.parallelism
    check_data(c, p.data_parallel_replicate_degree * max(1, p.data_parallel_shard_degree))


def check_data(c: JobConfig, dp: int) -> None:
    """`ConfigError` unless each of `dp` data-parallel ranks can draw `training.steps` batches from
    one pass over the synthetic dataset (its loader starts no second epoch, and would stop the
    run with a `StopIteration` mid-way)."""
    tc = c.training
    share = -(-SAMPLES // dp)  # the sampler pads the ranks' shares to the same length
    batches = share // tc.local_batch_size
    if not batches:
        raise ConfigError("training.local_batch_size", tc.local_batch_size, f"expected at most {share}: a "
                          f"data-parallel rank's share of the synthetic dataset ({SAMPLES} samples over {dp} "
                          "rank(s))")
    if tc.steps > batches:
        raise ConfigError("training.steps", tc.steps, f"the synthetic dataset ({SAMPLES} samples over {dp} "
                          f"data-parallel rank(s)) makes {batches} batches of training.local_batch_size "
                          f"({tc.local_batch_size}) per rank; use at most {batches} steps or a smaller batch")


PIPELINE_SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2}
"""Each pipeline schedule the example job runs, and how many stages (model parts) it puts on a rank."""

DEVICES = ("auto", "cpu", "cuda")


def _validate_parallelism(c: JobConfig) -> None:
    """What the parallelism degrees ask of the model; how they multiply to the number of ranks
    is checked at start (`parallel.ParallelDims`), when that number is known."""
    p, args, flavor = c.parallelism, FLAVORS[c.model.flavor], c.model.flavor
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "expert_parallel_degree",
                "pipeline_parallel_microbatch_size"):
        at_least(f"parallelism.{key}", getattr(p, key), 1)
    if c.training.device not in DEVICES:
        raise ConfigError("training.device", c.training.device, "expected one of " + ", ".join(DEVICES))
    if p.pipeline_parallel_schedule not in PIPELINE_SCHEDULES:
        raise ConfigError("parallelism.pipeline_parallel_schedule", p.pipeline_parallel_schedule,
                          "expected one of " + ", ".join(PIPELINE_SCHEDULES))
    tp = p.tensor_parallel_degree
    widths = (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads), ("FFN width", args.ffn_dim))
    for what, n in widths if tp > 1 else ():
        if n % tp:
            raise ConfigError("parallelism.tensor_parallel_degree", tp, f"must divide the {what} of flavor "
                              f"{flavor} ({n})")
    if tp > 1 and args.qk_norm:
        raise ConfigError("parallelism.tensor_parallel_degree", tp, f"flavor {flavor} has per-head q/k norms, "
                          "whose gradients tensor parallelism would split over heads; use 1 for it")
    if p.pipeline_parallel_degree > 1:
        _validate_pipeline(c)
    if p.expert_parallel_degree > 1:
        _validate_experts(c)


def _validate_pipeline(c: JobConfig) -> None:
    p, args = c.parallelism, FLAVORS[c.model.flavor]
    stages = p.pipeline_parallel_degree * PIPELINE_SCHEDULES[p.pipeline_parallel_schedule]
    if stages > args.n_layers:
        raise ConfigError("parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree,
                          f"{p.pipeline_parallel_schedule} makes {stages} stages and flavor {c.model.flavor} "
                          f"has {args.n_layers} layers; every stage needs one")
    if args.tie_embeddings:
        raise ConfigError("parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree,
                          f"flavor {c.model.flavor} ties its embedding to its output, which would be on "
                          "two stages; use 1 for it")
    if c.training.local_batch_size % p.pipeline_parallel_microbatch_size:
        raise ConfigError("parallelism.pipeline_parallel_microbatch_size", p.pipeline_parallel_microbatch_size,
                          f"must divide training.local_batch_size ({c.training.local_batch_size})")
    microbatches = c.training.local_batch_size // p.pipeline_parallel_microbatch_size
    if microbatches % p.pipeline_parallel_degree and p.pipeline_parallel_schedule != "GPipe":
        raise ConfigError("parallelism.pipeline_parallel_microbatch_size", p.pipeline_parallel_microbatch_size,
                          f"makes {microbatches} microbatches of training.local_batch_size "
                          f"({c.training.local_batch_size}); {p.pipeline_parallel_schedule} needs a multiple of "
                          f"pipeline_parallel_degree ({p.pipeline_parallel_degree})")


def _validate_experts(c: JobConfig) -> None:
    p, args = c.parallelism, FLAVORS[c.model.flavor]
    ep = p.expert_parallel_degree
    if args.moe is None:
        raise ConfigError("parallelism.expert_parallel_degree", ep, f"flavor {c.model.flavor} has no experts; "
                          "use a MoE flavor (qwen3_moe_debug) or 1")
    if args.moe.num_experts % ep:
        raise ConfigError("parallelism.expert_parallel_degree", ep,
                          f"must divide the number of experts of flavor {c.model.flavor} ({args.moe.num_experts})")
    if p.tensor_parallel_degree > 1:
        raise ConfigError("parallelism.expert_parallel_degree", ep, "experts sharded over tensor parallel ranks "
                          "too (TorchTitan's ETP) are not built by the example job; set "
                          "parallelism.tensor_parallel_degree = 1")
    if p.pipeline_parallel_degree > 1:
        # the stages' shape inference runs a backward pass in which the two ep ranks of a stage
        # issue their expert collectives out of step with the pipeline's sends: a deadlock
        raise ConfigError("parallelism.expert_parallel_degree", ep, "expert parallelism inside pipeline stages is "
                          "not built by the example job (it would hang in the first step); set "
                          "parallelism.pipeline_parallel_degree = 1, or expert_parallel_degree = 1")


def _validate_hf_source(c: JobConfig) -> None:
    """With `initial_load_in_hf`, the HF folder to load: initial_load_path (checked when it is
    used, as a restart that resumes from a step of its own never reads it), else
    model.hf_assets_path, which must hold safetensors weights."""
    ck, path = c.checkpoint, c.model.hf_assets_path
    if ck.initial_load_path:
        return
    if not path:
        raise ConfigError("checkpoint.initial_load_in_hf", True,
                          "needs checkpoint.initial_load_path or model.hf_assets_path: the HF folder to load")
    if not any(os.path.isfile(os.path.join(path, f)) for f in (INDEX_FILE, SINGLE_FILE)):
        raise ConfigError("model.hf_assets_path", path,
                          f"expected a Hugging Face folder with {SINGLE_FILE} or {INDEX_FILE}")
