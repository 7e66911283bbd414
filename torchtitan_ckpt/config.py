"""The `[checkpoint]` config section, and a TOML + `--section.key` loader for any dataclass tree.

`Checkpoint` is a plain dataclass: a trainer embeds it in its own config dataclass (a field of
type `Checkpoint`, under any name) and `load_config()` builds, converts and validates the whole
tree; `validate()` converts and checks a section built in Python alike. Every field is declared
once, with its type, default and a docstring right under it; `docs/config.md` is generated from
those docstrings (`docgen.py`). Validation raises one `ConfigError` naming the dotted key.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import logging
import math
import numbers
import os
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

from .errors import ConfigError
from .group import COLLECTIVE_TIMEOUT_S
from .io import IO_THREADS
from .io.safe_open import NAME_MAX
from .storage import check_location, scheme_of, under

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

logger = logging.getLogger(__name__)

AsyncMode = Literal["disabled", "async", "async_with_pinned_mem"]
ExportDtype = Literal["float16", "bfloat16", "float32"]
DedupPolicy = Literal["balanced", "lowest_rank", "replica_slices"]
Consolidation = Literal["one_pass", "all_ranks", "rank0"]
IoEngine = Literal["fast", "torch"]

_ANY_CASE = (AsyncMode,)
"""Choices matched in any case, as TorchTitan matches them (it lower-cases `async_mode`)."""

BUILTIN_STATES = ("model", "optimizer", "lr_scheduler", "dataloader")
"""States the manager itself owns; `states={...}` passed by the caller add to these."""

MAX_THREADS = 256
"""Upper bound of every thread-count key: more threads than this only exhaust memory."""

MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Upper bound of `collective_timeout_s` (a week): larger values overflow the process group's timer."""

MIN_TIMEOUT_S = 1.0
"""Lower bound of `collective_timeout_s` and `storage_timeout_s`: a shorter wait fails healthy
collectives and requests (a peer still planning its save, a connection still being made)."""

MAX_STORAGE_TIMEOUT_S = 3600.0
"""Upper bound of `storage_timeout_s`: a store silent for longer has failed."""

PATH_MAX = 4096
"""The bytes of a path a file system takes where `os.pathconf` does not say (of a file name:
`NAME_MAX`)."""

FOLDER_ROOM, STAGING_ROOM = 128, 512
"""Bytes a local folder's path leaves below PATH_MAX for the names this package makes in it: in
the step folders' folder, a step's files (`hf/step-N/model-00001-of-00009.safetensors.tmp`); in a
`staging_folder`, a URL's folder (at most 200 bytes), `rank-N` and those."""

MIN_PART, MAX_PART = 5 << 20, 5 << 30
"""The part sizes S3's multipart upload accepts (every part but the last)."""
T = TypeVar("T")


@dataclass
class Checkpoint:
    """The `[checkpoint]` section of a job's config: what `CheckpointManager` saves, when,
    where and how, and what `load()` resumes from. Built by `load_config` from the job's TOML
    and `--checkpoint.key value` overrides, from TorchTitan's section (`from_torchtitan`), or in
    Python (checked by the manager with `validate`). docs/config.md describes every key."""

    enable: bool = False
    """Save checkpoints and resume from them. When false, `save()` and `load()` do nothing."""

    folder: str = "checkpoint"
    """Folder of the step folders (`step-N`), relative to the manager's `base_folder` (a TorchTitan
    job's `job.dump_folder`, a path or a URL) unless absolute, and a relative path is taken in the
    working directory the manager is made in; every rank must see the same folder (checked at
    start-up), and one job saves into it at a time (docs/reliability.md). Or object storage:
    `s3://bucket/prefix` (docs/storage.md)."""

    interval: int = 500
    """Save every this many steps (step % interval == 0)."""

    initial_load_path: str | None = None
    """Checkpoint (a `step-N` folder or any DCP folder, a path or `s3://bucket/prefix`) loaded
    when `folder` holds no loadable step (a complete step of ours, or in a folder on a file
    system another program's finished one: docs/torchtitan.md)."""

    initial_load_model_only: bool = True
    """Load only the model from `initial_load_path` (optimizer, schedulers and data start fresh).
    False: the job's other states too; a checkpoint holding only the model is then refused."""

    initial_load_in_hf: bool = False
    """`initial_load_path` (or, when unset, the adapter's `hf_assets_path`: a TorchTitan job's
    `model.hf_assets_path`) is a Hugging Face safetensors folder (needs `initial_load_model_only`);
    another format there is refused, and an HF step of ours is checked as any initial load
    (finished, and verified with `verify_on_load`)."""

    last_save_model_only: bool = True
    """At the last step save only the model, cast to `export_dtype` (the optimizer, schedulers,
    dataloader and the job's own states, an EMA's weights among them, are not in that step: a
    resume goes back to the last full one); otherwise a full checkpoint."""

    last_save_in_hf: bool = False
    """Write the last step in Hugging Face safetensors format, loadable by `transformers` as it
    is (needs `last_save_model_only`); `export_dtype` applies."""

    export_dtype: ExportDtype = "float32"
    """Dtype of floating tensors in a model-only last-step save and in the `hf_export_interval`
    copies, float32 included (TorchTitan casts only to another)."""

    async_mode: AsyncMode = "disabled"
    """How saves overlap training: `disabled`, `async` or `async_with_pinned_mem`, in any case (as
    TorchTitan reads it). Both async modes return from `save()` before the state is copied: the
    copy runs while the next step's forward and backward do, and the optimizer's step waits for
    it (docs/async.md)."""

    verify_staging: bool = False
    """Debug setting for the async modes: copy the state inside `save()`, and at the next
    optimizer step (or the next `save()`, `wait()`, `load()` or `close()`, whichever comes first)
    check that no parameter or optimizer state changed since, raising `StagingMismatchError`
    naming the tensor (a loop that changes them outside the optimizer needs
    `maybe_wait_for_staging()` first). Costs the copy's time in every `save()`."""

    save_threads: int = 1
    """Data files each rank writes in parallel, one thread each (tensors spread over them by
    size). 1 suits a disk that one stream saturates; raise it for fast parallel storage."""

    direct_io: bool = True
    """Write DCP data files around the page cache (`O_DIRECT`, through aligned buffers of this
    package) where the file system accepts it, sparing the kernel's per-page copy and writeback,
    CPU that training shares (`docs/performance.md`, "Direct writes"). Turn it off to keep a step
    just written in the page cache (a load right after the save), or on a network file system
    whose direct writes go out one request at a time."""

    keep_latest_k: int = 10
    """Keep this many newest complete steps and delete older ones in the background, after each
    save but the job's last (as TorchTitan: the k steps before the last save stay, and the
    newest full one is where a run that goes on resumes), and at `load()` in a job that saves
    (a lower k for a restart applies before its first save); 0 keeps all. Only steps this
    package wrote are counted or deleted; another program's, and a step folder that is a link,
    never are."""

    load_step: int = -1
    """Step to load (a complete step of ours or, in a folder on a file system, another program's
    finished one); -1 loads the newest such step. A step holding only the model (a finished
    run's last save) is refused to a job that restores other states too (not `load_only`, not
    all of them in `exclude_from_loading`), as TorchTitan's load fails on it."""

    load_threads: int = IO_THREADS
    """I/O threads per rank reading a step on load, DCP or HF (each reads its own stretch of the
    files' bytes, in order, straight into the state's tensors)."""

    exclude_from_loading: list[str] = field(default_factory=list)
    """States not restored on load, e.g. `["dataloader", "lr_scheduler"]`. `model` cannot be excluded.
    With `optimizer` excluded and the schedulers loaded, the optimizers' learning rates are set
    to those the loaded schedule reached."""

    enable_first_step_checkpoint: bool = False
    """Also save at step 1, to catch save problems early."""

    create_seed_checkpoint: bool = False
    """`save(0)` writes a model-only `step-0`, from a single process (the trainer exits after it);
    any number of ranks can load it."""

    load_only: bool = False
    """Load checkpoints but never save any. Such a job takes the newest step even when it holds
    only the model (a finished run's last save), which a job that trains on passes over."""

    verify_on_load: bool = False
    """Before loading a step of ours (from `folder` or `initial_load_path`), check its files
    against the sizes and CRC-32s recorded when they were written (each rank checks a share of
    the files; ranks that read a copy on their own node's disk share out that copy's). Another
    program's step has none to check."""

    verify_fallback: bool = True
    """With `load_step = -1`: a newest step that fails the check is reported and the newest intact
    step is loaded instead. False raises `CorruptCheckpointError`. Without `verify_on_load` the
    check is that every file its manifest names is there at its size (a listing: a copy cut
    short, one taken while retention deleted the step)."""

    hf_max_shard_size: str | int = "5GB"
    """Largest Hugging Face file of an export when the adapter's `hf_assets_path` gives no file split
    (e.g. "5GB", "500MB", or a number of bytes); a layer's tensors stay in one file."""

    hf_export_interval: int = 0
    """Also export a Hugging Face copy of the model every this many steps, to
    `{folder}/hf/step-N` (0: never). `export_dtype` and `keep_latest_k` apply."""

    consolidation: Consolidation = "one_pass"
    """How Hugging Face exports write their files: `one_pass` (every rank writes its bytes at
    their final offsets, no intermediate files), `all_ranks` (DCP writes per-rank shards, then
    every rank consolidates a share of the bytes) or `rank0` (rank 0 consolidates alone). On
    object storage, `one_pass` only (docs/storage.md). The two-phase modes hold about a rank's
    share of the model again while writing, and gather sharded expert weights whole on every
    rank (a warning says how many bytes)."""

    consolidation_threads: int = IO_THREADS
    """I/O threads per rank writing Hugging Face files."""

    keep_hf_shards: bool = False
    """Keep the per-rank shard files after a two-phase consolidation (`all_ranks`, `rank0`)."""

    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    """Timeout of every collective on the checkpoint process group the manager creates (over the
    whole job, given as `process_group` or not): a rank
    whose peer died raises instead of waiting forever. At least 1 s: ranks wait on each other's
    ordinary work (a save's planning, a rank's upload), which a shorter timeout fails."""

    dedup_policy: DedupPolicy = "balanced"
    """Which rank writes a tensor replicated on several ranks: `balanced` (fewest bytes in the end),
    `lowest_rank` (a loader opens fewest files) or `replica_slices` (each replica writes a slice)."""

    dedup_min_slice_bytes: int = 1 << 20
    """With `replica_slices`, a replicated tensor smaller than this times the replica count is
    written whole by one rank instead of in slices."""

    io_engine: IoEngine = "fast"
    """How DCP-format steps' bytes are written and read: `fast` (this package's engine: writes
    beside DCP's planning, vectored reads straight into the tensors) or `torch` (PyTorch's own
    `FileSystemWriter` / `FileSystemReader`, an escape hatch should a torch release change a
    detail the fast engine relies on). The commit protocol, dedup policy and checksums are the
    same with both, and each reads what the other wrote."""

    staging_folder: str = ""
    """With an object-storage `folder` or `initial_load_path`: the local folder (not a URL) where
    each rank writes its files of a save before uploading them, and downloads a step to load it
    (`{staging_folder}/{url, percent-encoded}/rank-N`). Needs room for a rank's share of a step (two with async
    saves). Empty: `torchtitan_ckpt-<uid>` in the system's temporary folder, made readable by this
    user alone (refused when it is a link, another user's, or open to others)."""

    upload_part_size: str | int = "64MB"
    """Object storage: the size of each part of a multipart upload and of each ranged download
    (e.g. "64MB", "16MiB", or a number of bytes).
    A rank's upload holds `upload_part_size` x `upload_parallel_parts` bytes of part buffers,
    reused from part to part, and under 1 MiB besides (the rank assembling a Hugging Face file:
    one part more)."""

    upload_parallel_parts: int = 8
    """Object storage: parts each rank uploads (or downloads) at once."""

    storage_retries: int = 5
    """Object storage: how many times a request that failed transiently (throttling, 5xx, a
    reset connection, a timeout) is retried, with exponential backoff, before the save or load
    fails."""

    storage_timeout_s: float = 20.0
    """Object storage: the seconds a request waits to connect, and then for each next piece of
    the answer, before it counts as failed (and is retried): a request to a stalled endpoint
    fails after about `storage_retries + 1` times this, not after botocore's 60 s per try. A limit on
    silence, not on a transfer's length. 1 to 3600 s: a shorter one fails a healthy endpoint's
    requests (connecting alone may take longer), which then reads as a bad bucket."""

    @classmethod
    def from_torchtitan(cls, section: Any, **overrides: Any) -> Checkpoint:
        """Ours, from TorchTitan's `[checkpoint]` section (0.2's `job_config.checkpoint`, 0.3's
        checkpointer `Config`): every field the two share is copied, the rest of ours keep their
        defaults, `overrides` set any of ours; validated. TorchTitan settings with no equivalent
        here are refused when they would change what is saved or loaded
        (`initial_load_in_hf_quantized`), and otherwise left out with a log line
        (`enable_ft_dataloader_checkpoints`: TorchFT's, which this package does not run)."""
        if isinstance(section, type) or not (dataclasses.is_dataclass(section) or hasattr(section, "__dict__")):
            raise TypeError(f"section is of type {type(section).__name__}, not TorchTitan's [checkpoint] section (a "
                            "dataclass, or an object holding its settings as attributes): pass job_config.checkpoint")
        theirs = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)} \
            if dataclasses.is_dataclass(section) else dict(vars(section))
        ours = {f.name for f in dataclasses.fields(cls)}
        if theirs.get("initial_load_in_hf_quantized"):
            key = "initial_load_in_hf_quantized"
            raise ConfigError("checkpoint." + key, True, _their_key(key, "checkpoint.").removeprefix(": "))
        dropped = sorted(set(theirs) - ours - {"initial_load_in_hf_quantized"})
        if dropped:
            logger.info("TorchTitan checkpoint settings with no equivalent here, left out: %s", ", ".join(dropped))
        unknown = sorted(set(overrides) - ours)
        if unknown:
            raise ConfigError("checkpoint." + unknown[0], overrides[unknown[0]], "unknown key" + _suggest(unknown[0], ours))
        return cls(**{**{k: v for k, v in theirs.items() if k in ours}, **overrides}).validate()

    def validate(self, prefix: str = "checkpoint.") -> Checkpoint:
        """Check every field's type as `load_config` converts a TOML value (a `Literal` key among
        its choices, a number, a flag, text, a list), then ranges and contradictions; raise the
        first `ConfigError` found, its key `prefix + name` (the section's place in the caller's
        config tree). Returns the section as `load_config` builds it, leaving this one as it is:
        a section built in Python may give a path as `os.PathLike` and `async_mode` in any case
        (type checkers, reading the fields' types, want `str` and lower case)."""
        hints = typing.get_type_hints(type(self))
        ck = dataclasses.replace(self, **{f.name: _convert(prefix + f.name, getattr(self, f.name), hints[f.name])
                                          for f in dataclasses.fields(self)})
        _check_ranges(ck, prefix)
        _check_paths(ck, prefix)
        _check_combinations(ck, prefix)
        return ck

    def notes(self, prefix: str = "checkpoint.") -> list[tuple[int, str]]:
        """The settings of this section that another makes void (a debug run's `--checkpoint.no_enable`
        over a production TOML, say), each with its log level: said by the manager, on one rank,
        rather than refused."""
        return _notes(self, prefix)

    def folder_under(self, base_folder: str | os.PathLike[str], base_key: str = "base_folder") -> str:
        """Where the step folders of this validated section are for a job whose outputs go under
        `base_folder` (a TorchTitan job's `job.dump_folder`, named `base_key` in errors): `folder`
        joined onto it (`storage.under`), or `folder` itself when it is a URL or absolute. The
        joined folder gets the checks `validate` gives `folder` (a URL in the base folder makes
        the step folders object storage), and a bad base folder is a `ConfigError` naming
        `base_key`: "s3://" joined with "checkpoint" would be the bucket `checkpoint`."""
        base = _convert(base_key, base_folder, str)
        folder = under(base, self.folder)
        if folder != self.folder:  # the base folder is used
            _check_folder(self, "checkpoint.", folder, base_key, base)
        return folder


def at_least(key: str, value: int | float, low: int | float, high: int | float | None = None) -> None:
    """A `ConfigError` naming `key` unless `low` <= `value` (<= `high`)."""
    if value < low or (high is not None and value > high):
        raise ConfigError(key, value, f"expected >= {low}" + (f" and <= {high}" if high is not None else ""))


def _check_ranges(ck: Checkpoint, p: str) -> None:
    from .hf.planner import parse_size  # noqa: PLC0415 - keeps config import-light

    for name, low in (("interval", 1), ("keep_latest_k", 0), ("load_step", -1), ("hf_export_interval", 0),
                      ("dedup_min_slice_bytes", 1)):
        at_least(p + name, getattr(ck, name), low)
    for name in ("load_threads", "save_threads", "consolidation_threads", "upload_parallel_parts"):
        at_least(p + name, getattr(ck, name), 1, MAX_THREADS)
    at_least(p + "collective_timeout_s", ck.collective_timeout_s, MIN_TIMEOUT_S, MAX_TIMEOUT_S)
    at_least(p + "storage_retries", ck.storage_retries, 0, 100)
    at_least(p + "storage_timeout_s", ck.storage_timeout_s, MIN_TIMEOUT_S, MAX_STORAGE_TIMEOUT_S)
    for name in ("hf_max_shard_size", "upload_part_size"):
        try:
            parse_size(getattr(ck, name))
        except ValueError as e:
            raise ConfigError(p + name, getattr(ck, name), str(e)) from None
    if not MIN_PART <= parse_size(ck.upload_part_size) <= MAX_PART:
        raise ConfigError(p + "upload_part_size", ck.upload_part_size,
                          "S3 takes multipart parts of 5MiB to 5GiB")
    buffers, memory = parse_size(ck.upload_part_size) * ck.upload_parallel_parts, _physical_memory()
    remote = any(scheme_of(where) for where in (ck.folder, ck.initial_load_path or ""))
    if remote and memory and buffers > memory // 2:
        raise ConfigError(p + "upload_parallel_parts", ck.upload_parallel_parts, (
            f"with {p}upload_part_size = {ck.upload_part_size!r} a rank's object-storage transfers hold "
            f"{buffers / 2**30:.1f} GiB of part buffers, more than half of this machine's {memory / 2**30:.1f} GiB: "
            "lower one of them"))
    _check_exclusions(p + "exclude_from_loading", ck.exclude_from_loading)


def _physical_memory() -> int:
    """This machine's memory in bytes, or 0 where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _check_paths(ck: Checkpoint, p: str) -> None:
    if not ck.folder:
        raise ConfigError(p + "folder", ck.folder, "expected a non-empty folder name")
    _check_folder(ck, p, ck.folder, p + "folder", ck.folder)
    if ck.initial_load_path is not None:
        check_location(p + "initial_load_path", ck.initial_load_path)
    if ck.staging_folder:
        check_location(p + "staging_folder", ck.staging_folder, local=True)
        _check_local(p + "staging_folder", ck.staging_folder, ck.staging_folder, STAGING_ROOM)


def _check_folder(ck: Checkpoint, p: str, folder: str, key: str, value: str) -> None:
    """What depends on where the step folders are, `folder`: `folder` itself, or it under a base
    folder (`Checkpoint.folder_under`), `key = value` being the setting that makes it a URL or a
    local path. A URL of a store there is and a Hugging Face export that object storage can take,
    or a local path a file system takes (`_check_local`); never a mistyped URL."""
    check_location(key, value)
    if scheme_of(folder) is None:
        joined = f" (with {p}folder = {ck.folder!r} under it)" if folder != value else ""
        _check_local(key, value, folder, FOLDER_ROOM, joined)
        return
    hf = [k for k in ("last_save_in_hf", "hf_export_interval") if getattr(ck, k)]
    if hf and ck.consolidation != "one_pass":
        raise ConfigError(p + "consolidation", ck.consolidation, f"a Hugging Face export ({p}{hf[0]}) to "
                          f"object storage ({key} = {value!r}) is written in one pass; set {p}consolidation "
                          "= \"one_pass\"")


def _check_local(key: str, value: str, folder: str, room: int, joined: str = "") -> None:
    """The local folder `folder` (named by `key = value`, `joined` saying what else made it) can
    be made, with `room` bytes for what this package writes in it: each name in `value` within
    the file system's NAME_MAX bytes, and `folder`'s absolute path (what the kernel walks,
    however it is spelt) within its PATH_MAX less `room`. Checked now because making a folder
    whose path is too long fails only once the levels above the name too long are made."""
    try:
        length = len(os.fsencode(os.path.abspath(folder)))
        name = max(map(len, os.fsencode(value).split(b"/")))
    except UnicodeEncodeError as e:
        raise ConfigError(key, value, f"is not a path this system can encode: {e.reason}") from None
    if os.path.dirname(os.path.abspath(folder)) == os.path.abspath(folder):
        raise ConfigError(key, value, f"is the root folder{joined}: this package's files would be made there; name "
                          "a folder of their own")
    name_max, path_max = _path_limits(folder)
    if name > name_max:
        raise ConfigError(key, value, f"holds a name of {name} bytes; the file system takes at most {name_max}")
    if length > path_max - room:
        raise ConfigError(key, value, f"gives a folder path of {length} bytes{joined}; at most {path_max - room} "
                          f"leave room for the files made in it (the file system takes paths of {path_max})")


def _path_limits(folder: str) -> tuple[int, int]:
    """NAME_MAX and PATH_MAX of the file system holding `folder`'s nearest existing folder
    (`os.pathconf`), or `NAME_MAX` and `PATH_MAX` where it does not say."""
    existing = os.path.abspath(folder)
    while not os.path.isdir(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    limits = []
    for name, default in (("PC_NAME_MAX", NAME_MAX), ("PC_PATH_MAX", PATH_MAX)):
        try:
            limit = os.pathconf(existing, name)
        except (OSError, ValueError, AttributeError):  # no such setting here, or no pathconf at all
            limit = default
        limits.append(limit if limit > 0 else sys.maxsize)  # -1: no limit
    return limits[0], limits[1]


def _check_combinations(ck: Checkpoint, p: str) -> None:
    if ck.load_only and (key := next((k for k in ("last_save_in_hf", "hf_export_interval") if getattr(ck, k)), None)):
        raise ConfigError(p + key, getattr(ck, key), f"a Hugging Face export is a save, and {p}load_only = true "
                          "never saves: drop one of them")
    if ck.initial_load_in_hf and not ck.initial_load_model_only:
        raise ConfigError(p + "initial_load_in_hf", True,
                          f"an HF checkpoint holds only the model; set {p}initial_load_model_only = true")
    if ck.last_save_in_hf and not ck.last_save_model_only:
        raise ConfigError(p + "last_save_in_hf", True,
                          f"an HF export holds only the model; set {p}last_save_model_only = true")
    if ck.create_seed_checkpoint and ck.load_only:
        raise ConfigError(p + "create_seed_checkpoint", True, f"writing a seed checkpoint contradicts {p}load_only = true")
    if ck.create_seed_checkpoint and not ck.enable:
        raise ConfigError(p + "create_seed_checkpoint", True, f"needs {p}enable = true")
    if ck.verify_staging and ck.async_mode == "disabled":
        raise ConfigError(p + "verify_staging", True, f"checks the async modes' staging; set {p}async_mode "
                                                      '= "async" or "async_with_pinned_mem", or drop it')


def _notes(ck: Checkpoint, p: str) -> list[tuple[int, str]]:
    """`Checkpoint.notes`: settings of `ck` that a combination makes void, each with its log level."""
    notes = []
    asked = {"initial_load_path": ck.initial_load_path is not None, "load_only": ck.load_only,
             "load_step": ck.load_step != -1}
    if not ck.enable and (key := next((k for k, v in asked.items() if v), None)):  # a debug run's override, often
        notes.append((logging.WARNING, f"{p}{key} = {getattr(ck, key)!r} does not apply: with {p}enable = false "
                                       "nothing is loaded, and the job starts from its initial weights"))
    if ck.load_only and ck.enable_first_step_checkpoint:
        notes.append((logging.WARNING, f"{p}enable_first_step_checkpoint = true does not apply: {p}load_only = true "
                                       "never saves"))
    if ck.export_dtype != "float32" and not ck.last_save_model_only and not ck.hf_export_interval:
        notes.append((logging.INFO, f"{p}export_dtype = {ck.export_dtype!r} does not apply: nothing is exported (the "
                                    f"last save is a full checkpoint in the training dtype, {p}last_save_model_only = "
                                    f"false, and {p}hf_export_interval = 0)"))
    return notes


def _check_exclusions(key: str, names: list[str]) -> None:
    if "model" in names:
        raise ConfigError(key, names, "the model is always loaded; remove 'model'")
    for name in names:
        if not name.isidentifier():
            raise ConfigError(key, names, f"'{name}' is not a state name")
    if len(set(names)) != len(names):
        raise ConfigError(key, names, "names a state twice")


# ----------------------------------------------------------------------------- any dataclass tree


def sections(root: type) -> dict[str, type]:
    """Every table of the config tree `root` (a dataclass type), by dotted name, parents first."""
    out: dict[str, type] = {}
    hints = typing.get_type_hints(root)
    for f in dataclasses.fields(root):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out[f.name] = tp
            out.update({f"{f.name}.{k}": v for k, v in sections(tp).items()})
    return out


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body, on one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {name: " ".join(doc.split()) for name, (_, doc) in attribute_docs(tree.body[0].body).items()}


def attribute_docs(body: list[ast.stmt]) -> dict[str, tuple[ast.expr | None, str]]:
    """Name -> the value assigned to it in `body` (a class's or a module's statements; None for
    an annotation alone) and the docstring written under that assignment, as written."""
    docs: dict[str, tuple[ast.expr | None, str]] = {}
    for node, nxt in zip(body, body[1:]):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if (
            len(targets) == 1
            and isinstance(targets[0], ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[targets[0].id] = (node.value, nxt.value.value)  # type: ignore[union-attr]
    return docs


def load_config(root: type[T], path: str | os.PathLike[str] | None = None,
                argv: list[str] | tuple[str, ...] | None = None) -> T:
    """Build the config tree `root` (a dataclass whose dataclass-typed fields are TOML tables)
    from a TOML file (defaults when `path` is None) and `--section.key value` overrides in
    `argv`; convert every value to its field's type and validate every table that has a
    `validate(prefix)` method, children before parents. Raises `ConfigError`."""
    raw: dict[str, Any] = _read_toml(os.fspath(path)) if path is not None else {}
    overrides = _parse_overrides(_strings(argv))
    for key, value in overrides:
        _set_dotted(raw, key, value)
    config = _build(root, raw, "", frozenset(key for key, value in overrides if value is True))
    validate_tree(config)
    return config


def validate_tree(config: Any, prefix: str = "") -> None:
    """Run every table's `validate(prefix)` in the tree `config`, children first."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            validate_tree(value, f"{prefix}{f.name}.")
    check = getattr(config, "validate", None)
    if check is not None:
        check(prefix)


def _read_toml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError("--config", path, "expected an existing TOML file")
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except ValueError as e:  # TOMLDecodeError, UnicodeDecodeError, an int of over 4300 digits
            raise ConfigError("--config", path, f"is not valid TOML: {e}") from e
        except RecursionError:
            raise ConfigError("--config", path, "is nested too deeply to be a job config") from None


def _strings(argv: Any) -> list[str]:
    """`argv` (None: none) as a list of strings, or a `TypeError` saying what was passed instead:
    a string (its letters would be read as arguments), or a list holding something else."""
    if argv is None:
        return []
    if isinstance(argv, (str, bytes)) or not isinstance(argv, Iterable):
        raise TypeError(f"argv is of type {type(argv).__name__}; pass a list of strings, as sys.argv[1:]")
    args = list(argv)
    for i, arg in enumerate(args):
        if not isinstance(arg, str):
            raise TypeError(f"argv[{i}] is of type {type(arg).__name__}; argv holds strings, as sys.argv[1:] does: "
                            "pass str(value)")
    return args


class _CliText(str):
    """A value typed on the command line: text that `_convert` may parse. TOML strings may not."""


def _parse_overrides(argv: list[str]) -> list[tuple[str, Any]]:
    """`--a.b value`, `--a.b=value` and bare `--a.b` (a boolean flag) -> [(key, value)], a
    key's `-` read as `_` (`--checkpoint.keep-latest-k`, as TorchTitan's parser takes it).
    Values stay text (or True for a bare flag); `_convert` types them."""
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(arg, arg, "expected an override of the form --section.key value (the TOML file "
                              "is load_config's path, and argv holds no program name: sys.argv[1:])")
        key, eq, value = arg[2:].partition("=")
        if eq:
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 2
        else:
            value = True
            i += 1
        out.append((key.replace("-", "_"), value if value is True else _CliText(value)))
    return out


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    *tables, name = key.split(".")
    node = raw
    for depth, table in enumerate(tables, 1):
        node = node.setdefault(table, {})
        if not isinstance(node, dict):
            dotted = ".".join(tables[:depth])
            raise ConfigError(dotted, node, f"expected a TOML table [{dotted}]")
    # the last of `flag` and a bare `no_flag` wins: each is set after the other's removal
    twin = name[3:] if name.startswith("no_") else "no_" + name
    if value is True and name.startswith("no_") or node.get(twin) is True:
        node.pop(twin, None)
    node.pop(name, None)
    node[name] = value


def _build(cls: type[T], table: dict[str, Any], prefix: str, bare: frozenset[str] = frozenset()) -> T:
    """The `cls` of `table`'s values, converted and checked; `bare`: the keys given on the command
    line without a value (`true`)."""
    hints = typing.get_type_hints(cls)
    values = {}
    theirs = cls is Checkpoint  # TorchTitan's keys, wherever the section is in the tree
    for key, value in table.items():
        flag = key.startswith("no_") and (hints.get(key[3:]) is bool or theirs and key[3:] in _LEFT_OUT)
        if key not in hints and flag and value is True:
            key, value = key[3:], False  # a bare `--section.no_flag`, as TorchTitan's parser takes it
        dotted = prefix + key
        if key not in hints and theirs and key in _LEFT_OUT and _LEFT_OUT[key](dotted, value):
            logger.info("%s = %r: TorchTitan's setting, with no effect here; left out", dotted, value)
            continue
        if key not in hints:
            what = "unknown section" if isinstance(value, dict) else "unknown key"
            raise ConfigError(dotted, value, what + (theirs and _their_key(key, prefix) or _suggest(key, hints)))
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(dotted, value, f"expected a TOML table [{dotted}]")
            values[key] = _build(hints[key], value, dotted + ".", bare)
        else:
            try:
                values[key] = _convert(dotted, value, hints[key])
            except ConfigError as e:  # `--a.b` alone before another option: a value forgotten, not `true` meant
                if dotted not in bare:
                    raise
                raise ConfigError(dotted, value, f"{e.expected}; --{dotted} was given without a value (alone, an "
                                                 "option sets a boolean key to true)") from None
    return cls(**values)


_THEIR_KEYS = {
    "enable_checkpoint": ": TorchTitan's earlier name of {p}enable",
    "model_weights_only": ": TorchTitan's earlier name of {p}last_save_model_only",
    "initial_load_in_hf_quantized": (": quantized Hugging Face checkpoints are not read by torchtitan_ckpt; "
                                     "load a dequantized copy with {p}initial_load_in_hf"),
}
"""TorchTitan's `[checkpoint]` keys this section does not have -> what to do instead (the
closest name by spelling would point to a key of another meaning), `{p}` the section's place."""


def _their_key(key: str, prefix: str) -> str:
    """What `_THEIR_KEYS` says of `key` in the section at `prefix`, or ""."""
    return _THEIR_KEYS.get(key, "").replace("{p}", prefix)


_LEFT_OUT: dict[str, Callable[[str, Any], bool]] = {
    "enable_ft_dataloader_checkpoints": lambda key, value: _convert_bool(key, value) in (True, False),
    "initial_load_in_hf_quantized": lambda key, value: not _convert_bool(key, value),
}
"""TorchTitan's `[checkpoint]` keys this section does not have -> whether a value changes
nothing here (TorchFT's setting, which this package does not run; a quantized import turned
off): such a key is left out with a log line, as `Checkpoint.from_torchtitan` leaves it out."""


def _suggest(name: str, valid) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ";"
    return f"{hint} valid: {', '.join(sorted(valid))}"


def _convert(key: str, value: Any, tp: Any) -> Any:
    """Convert a TOML value or a command-line string to the field type `tp`, or raise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if value is None or value == "" or (isinstance(value, _CliText) and value.lower() == "none"):
            return None  # "" too: TorchTitan's "unset" for a path
        inner = [a for a in args if a is not type(None)]
        return _convert(key, value, inner[0] if len(inner) == 1 else typing.Union[tuple(inner)])
    if origin in (typing.Union, types.UnionType):  # `str | int`: the first type the value is one of
        refused = []
        for arm in args:
            try:
                return _convert(key, value, arm)
            except ConfigError as e:
                refused.append(e.expected)
        raise ConfigError(key, value, refused[0] + "".join(", or " + r.removeprefix("expected ") for r in refused[1:]))
    if origin is Literal:
        if tp in _ANY_CASE and isinstance(value, str):
            value = value.lower()
        if value not in args:
            raise ConfigError(key, value, "expected one of " + ", ".join(repr(a) for a in args))
        return str(value) if isinstance(value, str) else value
    if origin is list:
        return _convert_list(key, value, args[0])
    if tp is bool:
        return _convert_bool(key, value)
    if tp is str:
        if isinstance(value, os.PathLike):  # a path built in Python (pathlib)
            value = os.fspath(value)
        if not isinstance(value, str) or "\x00" in value:
            raise ConfigError(key, value, "expected a string (without NUL characters)")
        return str(value)
    if tp in (int, float):
        return _convert_number(key, value, tp)
    raise TypeError(f"config field {key} has unsupported type {tp}")  # a bug in the config class


def _convert_list(key: str, value: Any, inner: Any) -> list:
    if isinstance(value, _CliText):
        value = [_CliText(v.strip()) for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(key, value, "expected a list (a TOML array; on the command line, a comma-separated string)")
    return [_convert(key, v, inner) for v in value]


def _convert_bool(key: str, value: Any) -> bool:
    if isinstance(value, _CliText) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if not isinstance(value, bool):
        raise ConfigError(key, value, "expected a boolean (true or false)")
    return value


_CLI_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_CLI_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)
"""A number on the command line, as TOML writes one (ASCII digits, no `_`); ints without a point."""


def _convert_number(key: str, value: Any, kind: type) -> int | float:
    """An int within 64 bits, or a finite float (a TOML int is a valid float)."""
    what = "an integer within 64 bits" if kind is int else "a finite number"
    if isinstance(value, _CliText):
        if not (_CLI_INT if kind is int else _CLI_NUMBER).fullmatch(value):  # int() takes other digits and `_`
            raise ConfigError(key, value, f"expected {what}")
        try:
            value = kind(value)
        except ValueError:  # an int of over 4300 digits
            raise ConfigError(key, value, f"expected {what}") from None
    if not isinstance(value, (bool, str)) and isinstance(value, numbers.Real):  # NumPy's too, as a trainer may give
        value = int(value) if isinstance(value, numbers.Integral) else float(value) if kind is float else value
    ok = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok):
        raise ConfigError(key, value, f"expected {what}")
    if kind is int and not -(2**63) <= value < 2**63:
        raise ConfigError(key, value, f"expected {what}")
    if kind is float and not _finite(value):
        raise ConfigError(key, value, f"expected {what}")
    return kind(value)


def _finite(value: int | float) -> bool:
    """Whether `value` is a finite float, or an int a float holds."""
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the floats
        return False
