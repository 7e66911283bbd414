"""Typed job config: TOML sections as dataclasses, command-line overrides, validation.

Every field is declared once, with its type, default and a docstring right under it. The docs'
config reference (`docs/config.md`) is generated from those docstrings by `field_docs()`.
`load_job_config()` is the only entry point: it parses, applies `--section.key value`
overrides, converts types and validates everything before any work starts, raising one
`ConfigError` that names the dotted key.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import os
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

AsyncMode = Literal["disabled", "async", "async_with_pinned_mem"]
ExportDtype = Literal["float16", "bfloat16", "float32"]
DedupPolicy = Literal["balanced", "lowest_rank", "replica_slices"]
Consolidation = Literal["one_pass", "all_ranks", "rank0"]

# States the manager itself owns; `states={...}` passed by the caller add to these.
BUILTIN_STATES = ("model", "optimizer", "lr_scheduler", "dataloader")


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Root folder of the run's outputs; checkpoints go under `{dump_folder}/{checkpoint.folder}`."""

    description: str = "torchtitan_ckpt example job"
    """Free text, logged at start."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family of the example job. Only `llama3` exists."""

    flavor: str = "debugmodel"
    """Size preset of the example model, one of `torchtitan_ckpt.example.model.FLAVORS`."""

    hf_assets_path: str | None = None
    """A Hugging Face folder for this model: its `config.json` and index file split are used for
    exports, and its weights are the initial load with `checkpoint.initial_load_in_hf`."""


@dataclass
class Training:
    steps: int = 10
    """Number of optimizer steps of the whole run (the last one is the `last_step` save)."""

    seed: int = 0
    """Seed of the model initialisation, the synthetic data and the RNG state."""

    local_batch_size: int = 8
    """Sequences per rank per step."""

    seq_len: int = 64
    """Tokens per sequence."""

    max_norm: float = 1.0
    """Gradient-norm clipping threshold; 0 disables clipping."""

    stop_at_step: int = 0
    """Stop this process after this step, as a preemption would (0 runs to `steps`). The step is
    not the last step: it is saved only if the schedule says so, and a later run resumes from it."""


@dataclass
class Optimizer:
    name: str = "AdamW"
    """Optimizer class. Only `AdamW` exists in the example job."""

    lr: float = 8e-4
    """Peak learning rate, reached at the end of warm-up."""

    eps: float = 1e-8
    """AdamW epsilon."""

    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""


@dataclass
class LRScheduler:
    warmup_steps: int = 2
    """Steps of linear warm-up from 0 to `optimizer.lr`; then linear decay to `min_lr_factor * lr`."""

    min_lr_factor: float = 0.1
    """Learning rate at the last step, as a fraction of `optimizer.lr`."""


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = -1
    """FSDP shard degree; -1 means every rank not used by the replicate degree."""

    data_parallel_replicate_degree: int = 1
    """HSDP replicate degree: the job's ranks form a (replicate x shard) mesh and each replica
    holds a full copy of the sharded state, so its tensors are replicated across replicas."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints and resume from them. When false, `save()` and `load()` do nothing."""

    folder: str = "checkpoint"
    """Folder of the step folders (`step-N`), relative to `job.dump_folder` unless absolute."""

    interval: int = 500
    """Save every this many steps (step % interval == 0)."""

    initial_load_path: str | None = None
    """Checkpoint (a `step-N` folder or any DCP folder) loaded when `folder` holds no complete step."""

    initial_load_model_only: bool = True
    """Load only the model from `initial_load_path` (optimizer, schedulers and data start fresh)."""

    initial_load_in_hf: bool = False
    """`initial_load_path` (or `model.hf_assets_path` when unset) is a Hugging Face safetensors
    folder (needs `initial_load_model_only`)."""

    last_save_model_only: bool = True
    """At the last step save only the model, cast to `export_dtype`; otherwise a full checkpoint."""

    last_save_in_hf: bool = False
    """Write the last step in Hugging Face safetensors format, loadable by `transformers` as it
    is (needs `last_save_model_only`); `export_dtype` applies."""

    export_dtype: ExportDtype = "float32"
    """Dtype of floating tensors in a model-only last-step save."""

    async_mode: AsyncMode = "disabled"
    """How saves overlap training: `disabled`, `async` or `async_with_pinned_mem`."""

    save_threads: int = 1
    """Data files each rank writes in parallel, one thread each (tensors spread over them by
    size). 1 suits a disk that one stream saturates; raise it for fast parallel storage."""

    keep_latest_k: int = 10
    """Keep this many newest complete steps and delete older ones in the background; 0 keeps all."""

    load_step: int = -1
    """Step to load; -1 loads the newest complete step."""

    load_threads: int = 4
    """I/O threads per rank reading a step on load, DCP or HF (each reads its own stretch of the
    files' bytes, in order, straight into the state's tensors)."""

    exclude_from_loading: list[str] = field(default_factory=list)
    """States not restored on load, e.g. `["dataloader", "lr_scheduler"]`. `model` cannot be excluded."""

    enable_first_step_checkpoint: bool = False
    """Also save at step 1, to catch save problems early."""

    create_seed_checkpoint: bool = False
    """Write a model-only `step-0` from a single process and exit; any number of ranks can load it."""

    load_only: bool = False
    """Load checkpoints but never save any."""

    verify_on_load: bool = False
    """Before loading a step, check its files against the sizes and CRC-32s recorded when they
    were written (each rank checks a share of the files)."""

    verify_fallback: bool = True
    """With `verify_on_load` and `load_step = -1`: a newest step that fails the check is reported
    and the newest intact step is loaded instead. False raises `CorruptCheckpointError`."""

    hf_max_shard_size: str = "5GB"
    """Largest Hugging Face file of an export when `model.hf_assets_path` gives no file split
    (e.g. "5GB", "500MB"); a layer's tensors stay in one file."""

    hf_export_interval: int = 0
    """Also export a Hugging Face copy of the model every this many steps, to
    `{folder}/hf/step-N` (0: never). `export_dtype` and `keep_latest_k` apply."""

    consolidation: Consolidation = "one_pass"
    """How Hugging Face exports write their files: `one_pass` (every rank writes its bytes at
    their final offsets, no intermediate files), `all_ranks` (DCP writes per-rank shards, then
    every rank consolidates a share of the bytes) or `rank0` (rank 0 consolidates alone)."""

    consolidation_threads: int = 4
    """I/O threads per rank writing Hugging Face files."""

    keep_hf_shards: bool = False
    """Keep the per-rank shard files after a two-phase consolidation (`all_ranks`, `rank0`)."""

    collective_timeout_s: float = 600.0
    """Timeout of every collective on the checkpoint process group the manager creates: a rank
    whose peer died raises instead of waiting forever."""

    dedup_policy: DedupPolicy = "balanced"
    """Which rank writes a tensor replicated on several ranks: `balanced` (fewest bytes in the end),
    `lowest_rank` (a loader opens fewest files) or `replica_slices` (each replica writes a slice)."""

    dedup_min_slice_bytes: int = 1 << 20
    """With `replica_slices`, a replicated tensor smaller than this times the replica count is
    written whole by one rank instead of in slices."""


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
        """Absolute-or-relative path of the step folders: `{job.dump_folder}/{checkpoint.folder}`."""
        return os.path.join(self.job.dump_folder, self.checkpoint.folder)


def sections() -> dict[str, type]:
    """TOML section name -> dataclass, in declaration order."""
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


# ----------------------------------------------------------------------------- parsing


def load_job_config(path: str | os.PathLike | None = None, argv: list[str] | None = None) -> JobConfig:
    """Read a job TOML file (or defaults when `path` is None), apply `--section.key value`
    overrides from `argv`, convert and validate everything. Raises `ConfigError`."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_toml(os.fspath(path))
    for key, value in _parse_overrides(argv or []):
        section, name = key.split(".", 1)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(section, raw[section], "expected a TOML table [" + section + "]")
        raw[section][name] = value
    config = _build(raw)
    validate(config)
    return config


def _read_toml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError("--config", path, "expected an existing TOML file")
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError("--config", path, f"is not valid TOML: {e}") from e


class _CliText(str):
    """A value typed on the command line: text that `_convert` may parse. TOML strings may not."""


def _parse_overrides(argv: list[str]) -> list[tuple[str, Any]]:
    """`--a.b value`, `--a.b=value` and bare `--a.b` (a boolean flag) -> [(key, value)].
    Values stay text (or True for a bare flag); `_convert` types them."""
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(arg, arg, "expected an override of the form --section.key value")
        key, eq, value = arg[2:].partition("=")
        if eq:
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 2
        else:
            value = True
            i += 1
        out.append((key, value if value is True else _CliText(value)))
    return out


def _build(raw: dict[str, Any]) -> JobConfig:
    secs = sections()
    kwargs = {}
    for name, table in raw.items():
        if name not in secs:
            raise ConfigError(name, table, "unknown section" + _suggest(name, secs))
        if not isinstance(table, dict):
            raise ConfigError(name, table, f"expected a TOML table [{name}]")
        kwargs[name] = _build_section(name, secs[name], table)
    return JobConfig(**kwargs)


def _build_section(section: str, cls: type, table: dict[str, Any]):
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in table.items():
        dotted = f"{section}.{key}"
        if key not in hints:
            raise ConfigError(dotted, value, "unknown key" + _suggest(key, hints))
        values[key] = _convert(dotted, value, hints[key])
    return cls(**values)


def _suggest(name: str, valid) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"{hint} Valid: {', '.join(sorted(valid))}"


def _convert(key: str, value: Any, tp: Any) -> Any:
    """Convert a TOML value or a command-line string to the field type `tp`, or raise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if value is None or (isinstance(value, _CliText) and value.lower() in ("", "none")):
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(key, value, inner)
    if origin is Literal:
        if value not in args:
            raise ConfigError(key, value, "expected one of " + ", ".join(repr(a) for a in args))
        return str(value) if isinstance(value, str) else value
    if origin is list:
        (inner,) = args
        if isinstance(value, _CliText):
            value = [_CliText(v.strip()) for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(key, value, "expected a list (TOML array or comma-separated string)")
        return [_convert(key, v, inner) for v in value]
    if tp is bool:
        if isinstance(value, _CliText) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if not isinstance(value, bool):
            raise ConfigError(key, value, "expected a boolean (true or false)")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, value, "expected a string")
        return str(value)
    if tp is int:
        return _convert_number(key, value, int, "an integer")
    if tp is float:
        return float(_convert_number(key, value, float, "a number"))
    raise TypeError(f"config field {key} has unsupported type {tp}")  # a bug in this module


def _convert_number(key: str, value: Any, kind: type, what: str):
    if isinstance(value, _CliText):
        try:
            return kind(value)
        except ValueError:
            raise ConfigError(key, value, f"expected {what}") from None
    ok = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok):
        raise ConfigError(key, value, f"expected {what}")
    return value


# ----------------------------------------------------------------------------- validation


def validate(config: JobConfig) -> None:
    """Check ranges and contradictions across fields; raise the first `ConfigError` found."""
    _validate_job(config)
    _validate_checkpoint(config.checkpoint)
    if config.checkpoint.initial_load_in_hf:
        _validate_hf_source(config)
    if config.model.hf_assets_path is not None and not os.path.isdir(config.model.hf_assets_path):
        raise ConfigError("model.hf_assets_path", config.model.hf_assets_path, "expected an existing folder")


def _at_least(key: str, value: int | float, low: int | float) -> None:
    if value < low:
        raise ConfigError(key, value, f"expected >= {low}")


def _validate_job(c: JobConfig) -> None:
    from .example.model import FLAVORS  # the example job's presets

    if c.model.name != "llama3":
        raise ConfigError("model.name", c.model.name, "expected 'llama3'")
    if c.model.flavor not in FLAVORS:
        raise ConfigError("model.flavor", c.model.flavor, "expected one of " + ", ".join(FLAVORS))
    if c.optimizer.name != "AdamW":
        raise ConfigError("optimizer.name", c.optimizer.name, "expected 'AdamW'")
    _at_least("training.steps", c.training.steps, 1)
    _at_least("training.local_batch_size", c.training.local_batch_size, 1)
    _at_least("training.seq_len", c.training.seq_len, 2)
    _at_least("training.max_norm", c.training.max_norm, 0)
    _at_least("training.stop_at_step", c.training.stop_at_step, 0)
    _at_least("lr_scheduler.warmup_steps", c.lr_scheduler.warmup_steps, 0)
    if not 0 <= c.lr_scheduler.min_lr_factor <= 1:
        raise ConfigError("lr_scheduler.min_lr_factor", c.lr_scheduler.min_lr_factor, "expected 0..1")
    if c.optimizer.lr <= 0:
        raise ConfigError("optimizer.lr", c.optimizer.lr, "expected > 0")
    dp = c.parallelism.data_parallel_shard_degree
    if dp == 0 or dp < -1:
        raise ConfigError("parallelism.data_parallel_shard_degree", dp, "expected -1 (all ranks) or >= 1")
    _at_least("parallelism.data_parallel_replicate_degree", c.parallelism.data_parallel_replicate_degree, 1)
    if not c.job.dump_folder:
        raise ConfigError("job.dump_folder", c.job.dump_folder, "expected a non-empty path")


def _validate_checkpoint(ck: Checkpoint) -> None:
    _at_least("checkpoint.interval", ck.interval, 1)
    _at_least("checkpoint.keep_latest_k", ck.keep_latest_k, 0)
    _at_least("checkpoint.load_step", ck.load_step, -1)
    _at_least("checkpoint.load_threads", ck.load_threads, 1)
    _at_least("checkpoint.dedup_min_slice_bytes", ck.dedup_min_slice_bytes, 1)
    _at_least("checkpoint.save_threads", ck.save_threads, 1)
    if not ck.collective_timeout_s > 0:
        raise ConfigError("checkpoint.collective_timeout_s", ck.collective_timeout_s, "expected > 0 seconds")
    if not ck.folder:
        raise ConfigError("checkpoint.folder", ck.folder, "expected a non-empty folder name")
    _validate_exclusions(ck.exclude_from_loading)
    if ck.initial_load_in_hf and not ck.initial_load_model_only:
        raise ConfigError(
            "checkpoint.initial_load_in_hf", True,
            "an HF checkpoint holds only the model; set checkpoint.initial_load_model_only = true",
        )
    if ck.last_save_in_hf and not ck.last_save_model_only:
        raise ConfigError(
            "checkpoint.last_save_in_hf", True,
            "an HF export holds only the model; set checkpoint.last_save_model_only = true",
        )
    if ck.export_dtype != "float32" and not ck.last_save_model_only:
        raise ConfigError(
            "checkpoint.export_dtype", ck.export_dtype,
            "applies only to a model-only last save; set checkpoint.last_save_model_only = true "
            "or leave export_dtype = 'float32'",
        )
    if ck.create_seed_checkpoint and ck.load_only:
        raise ConfigError(
            "checkpoint.create_seed_checkpoint", True,
            "writing a seed checkpoint contradicts checkpoint.load_only = true",
        )
    if ck.create_seed_checkpoint and not ck.enable:
        raise ConfigError("checkpoint.create_seed_checkpoint", True, "needs checkpoint.enable = true")
    _validate_hf(ck)
    if ck.initial_load_path is not None and not ck.initial_load_in_hf:
        _validate_initial_load_path(ck)


def _validate_hf(ck: Checkpoint) -> None:
    from .hf.planner import parse_size  # noqa: PLC0415 - keeps config import-light

    try:
        parse_size(ck.hf_max_shard_size)
    except ValueError as e:
        raise ConfigError("checkpoint.hf_max_shard_size", ck.hf_max_shard_size, str(e)) from None
    _at_least("checkpoint.hf_export_interval", ck.hf_export_interval, 0)
    _at_least("checkpoint.consolidation_threads", ck.consolidation_threads, 1)


def _validate_exclusions(names: list[str]) -> None:
    key = "checkpoint.exclude_from_loading"
    if "model" in names:
        raise ConfigError(key, names, "the model is always loaded; remove 'model'")
    for name in names:
        if not name.isidentifier():
            raise ConfigError(key, names, f"'{name}' is not a state name")
    if len(set(names)) != len(names):
        raise ConfigError(key, names, "names a state twice")


def _validate_hf_source(c: JobConfig) -> None:
    """With `initial_load_in_hf`, the HF folder (initial_load_path, else model.hf_assets_path)
    must hold safetensors weights."""
    ck = c.checkpoint
    key, path = ("checkpoint.initial_load_path", ck.initial_load_path) if ck.initial_load_path else (
        "model.hf_assets_path", c.model.hf_assets_path)
    if not path:
        raise ConfigError("checkpoint.initial_load_in_hf", True,
                          "needs checkpoint.initial_load_path or model.hf_assets_path: the HF folder to load")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors.index.json", "model.safetensors")):
        raise ConfigError(key, path, "expected a Hugging Face folder with model.safetensors or "
                                     "model.safetensors.index.json")


def _validate_initial_load_path(ck: Checkpoint) -> None:
    key, path = "checkpoint.initial_load_path", ck.initial_load_path
    if not path or "\x00" in path:
        raise ConfigError(key, path, "expected a path to a checkpoint folder")
    if not os.path.isdir(path):
        raise ConfigError(key, path, "expected an existing checkpoint folder")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ConfigError(key, path, "expected a DCP checkpoint folder (it has no .metadata file)")
