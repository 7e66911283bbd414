"""CheckpointManager: decides when to save, runs saves and loads, and orchestrates the pieces.

Formats live in `formats`, storage backends in `storage`, the commit protocol in `commit`, step
naming in `layout`, which checkpoint a load reads in `load_target` and what the states ask of
it in `load_request`, retention in `policy.retention`, the save schedule in `policy.schedule`,
and how saves overlap training in `staging`.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import itertools
import logging
import os
import resource
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from . import commit, gc_pause, layout, step_hooks, storage
from .storage import lock
from .deleter import BackgroundDeleter
from .policy.retention import newer_steps, steps_to_delete
from .storage.local import LOCK_FILE
from .storage.users import FolderUser
from .config import BUILTIN_STATES, Checkpoint
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CollectiveError,
    ConfigError,
    CorruptCheckpointError,
    PartialLoadError,
    RankFailed,
    few,
    in_chain,
    no_thread,
    restate,
)
from .group import CheckpointGroup, refuse_unjoined_launch
from .formats import FORMATS, Context, StepFormat, Written
from .hf import StateDictAdapter
from .hf.adapter import EMBEDDING, TIED_HEAD, ForeignAdapter, as_adapter
from .hf.files import CONFIG_FILE
from .hf.registry import known_hf_names
from .hf.save import assets_file_split, read_assets
from .io.dtypes import EXPORT_DTYPES, exported_state
from .io import direct, durable, safe_open
from .io.filewriter import Sink
from .io.materialised import check_materialised, check_memory
from .io.tensors import local_bytes
from .load_request import LoadRequest
from .load_target import LoadTarget, TargetFinder
from .progress import fmt_bytes, gb_per_s
from .policy.schedule import SaveKind, hf_copy_due, save_format, save_kind
from .io.stagers import Deferred, nothing_deferred
from .staging import BackgroundSaves, SaveJob, Staged, make_strategy
from .states import (CheckedState, DataLoaderState, LRSchedulerState, ModelPart, ModelState, OptimizerState,
                     StateLike, own_state_dict, replicated_digest, unwrapped)

logger = logging.getLogger(__name__)

_Call = TypeVar("_Call", bound=Callable[..., Any])

_WAIT_TOLD_S = 0.01
"""A wait of `save()` for the save before it that the saved line tells (shorter: scheduling noise)."""

_REMOVED_RETRIES = 3
"""How many times `load()` looks for the newest step again when the one it read was removed."""


@dataclass
class _TrainingWait:
    """The training thread's seconds spent on one background save: in `save()` (the state
    gathered, its copy started) and in optimizer steps waiting for the copy to finish."""

    seconds: float = 0.0


def _one(name: str, value: Any, alias: str, other: Any) -> Any:
    """An argument given under our name or TorchTitan's (`alias`), not both."""
    if value is not None and other is not None:
        raise TypeError(f"pass {name}= or {alias}= (TorchTitan's name for it), not both")
    return value if value is not None else other


def _members(x: Any, name: str, expected: str, fits: Callable[[Any], bool], many: bool = True) -> list:
    """Model parts, optimizers or LR schedulers as a list: one, a list or tuple, or (`many`)
    TorchTitan's `OptimizersContainer` / `LRSchedulersContainer` (iterables of the real ones; a
    torch optimizer or scheduler is not iterable); each one `fits`, else a `TypeError` naming
    `name` and the `expected` kind (a dict of them, say, would otherwise be taken for its keys)."""
    if x is None:
        return []
    if isinstance(x, Mapping):
        raise TypeError(f"{name} is a {type(x).__name__}; expected {expected}, or a list of them")
    several = isinstance(x, (list, tuple)) or many and hasattr(type(x), "__iter__")
    members = list(x) if several else [x]
    for i, member in enumerate(members):
        if not fits(member):
            raise TypeError(f"{name}{f'[{i}]' if several else ''} is a {type(member).__name__}; expected {expected}")
    return members


class CheckpointManager:
    """Saves and restores a training job's state through DCP, as the `[checkpoint]` config says.

    Call `load()` once before training and `save(step, last_step=...)` after every step; the
    manager decides which steps are written. Model parts are stored flat (their parameter
    names at the top level, as TorchTitan does), other states under their own names.
    """

    def __init__(
        self,
        config: Checkpoint | None = None,
        model_parts: Sequence[ModelPart] | ModelPart | None = None,
        optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer | None = None,
        lr_schedulers: Sequence[Any] | Any | None = None,
        dataloader: Any | None = None,
        states: Mapping[str, StateLike] | None = None,
        base_folder: str | os.PathLike[str] = "",
        process_group: Any | None = None,
        state_dict_adapter: StateDictAdapter | Any | None = None,
        *,
        checkpoint_config: Any | None = None,
        sd_adapter: StateDictAdapter | Any | None = None,
        ft_manager: Any | None = None,
    ):
        """TorchTitan's keyword arguments are taken as its trainer passes them: `checkpoint_config`
        for `config` (TorchTitan's own `[checkpoint]` section is converted with
        `Checkpoint.from_torchtitan`), `sd_adapter` for `state_dict_adapter` (one of ours, or any
        with TorchTitan's `BaseStateDictAdapter` surface), and `ft_manager` only as None (TorchFT
        is not run here)."""
        config = _one("config", config, "checkpoint_config", checkpoint_config)
        state_dict_adapter = _one("state_dict_adapter", state_dict_adapter, "sd_adapter", sd_adapter)
        if config is None or model_parts is None:
            raise TypeError("CheckpointManager needs the [checkpoint] section (config= or checkpoint_config=) "
                            "and model_parts=")
        if ft_manager is not None:
            raise TypeError("ft_manager: TorchFT's fault-tolerant training is not run by torchtitan_ckpt; pass None")
        if not isinstance(config, Checkpoint):  # TorchTitan's own section, as its trainer passes it
            if not hasattr(config, "folder") or not hasattr(config, "enable"):
                raise TypeError(f"config is a {type(config).__name__}, not a [checkpoint] section: pass "
                                "torchtitan_ckpt's Checkpoint, or TorchTitan's job_config.checkpoint")
            config = Checkpoint.from_torchtitan(config)
        config = config.validate()  # a section built in Python never went through `load_config`
        if config.enable:
            _refuse_after_main_thread("CheckpointManager()")
        self.config = config
        self._adapter = as_adapter(state_dict_adapter)
        self.folder = config.folder_under(base_folder)
        given = _members(model_parts, "model_parts", "an nn.Module (the model, or a pipeline stage)",
                         lambda m: isinstance(m, nn.Module), many=False)
        parts = [unwrapped(part) for part in given]
        if not parts:
            raise ValueError("model_parts is empty; pass the model (or its pipeline stages)")
        self._model = ModelState(parts)
        self._closed = False
        self._pid = os.getpid()
        """The process that made the manager: a forked child's copy owns none of its threads."""
        self._half_loaded: PartialLoadError | None = None
        """Set by a load that failed once it had begun changing the job's state; saves refuse."""
        self._left: set[int] = set()
        """The complete steps of the folder newer than the one loaded: a run this job went back
        from, whose steps retention neither counts nor keeps once this job's pass them."""
        self._told_newer: set[tuple[str, int]] = set()
        """The newer steps (folder, step) saves warned of since the load: a save warns again only of
        a step not told before (the steps a job that went back passes go one by one, told once)."""
        self._told_summary = ""
        """The dedup summary of the last save, logged at INFO again only when it changes."""
        self._told_per_rank: set[str] = set()
        """The states whose values differ by rank, warned of (`_warn_per_rank`)."""
        self._load_called = False
        """Whether `load()` was called: a job saving beside a run's newer steps without it is told."""
        self._committed: tuple[int, SaveKind, str] | None = None
        """The step, kind and format in `folder` that holds this job's state as it is: its last
        save committed there, or the step of ours a load read from there since. A save of the
        same again is skipped (`_saved_already`)."""
        self._ended_at: int | None = None
        """The step of the first `save(last_step=True)`: the run's end (`_warn_ended`)."""
        self._calls = threading.RLock()
        """Held by `save()`, `load()`, `close()` and `wait()`: a call from another thread waits
        for the one in progress (two threads' saves interleaved their steps' files)."""
        self._in_call: str | None = None
        """The call in progress, seen by a call re-entering it on its own thread (`_one_call`)."""
        self._close_pending = False
        """`close()` was called from inside another call on its thread; that call closes as it ends."""
        self._stepped: list[torch.optim.Optimizer] = []
        """The optimizers whose steps wait for this manager's staging (`step_hooks`), until `close()`."""
        self._user: FolderUser | None = None
        """This manager's saves into its folder, beside other managers of the process (`FolderUser`)."""
        self._unclosed: weakref.finalize | None = None
        """Lets go of what a manager collected without `close()` holds (`_collected_unclosed`)."""
        self._waiting: _TrainingWait | None = None
        """What the training thread spent on the last background save, counted on by the
        optimizer's step pre-hook while the save's copy is in flight."""
        if config.enable:
            refuse_unjoined_launch()
        self._group = CheckpointGroup(process_group, config.collective_timeout_s,
                                      f"the CheckpointManager of {self.folder}") if config.enable else None
        rank, world_size = (self._group.rank, self._group.world_size) if self._group else (0, 1)
        try:
            self._states = self._build_states(parts, optimizers, lr_schedulers, dataloader, states or {}, rank,
                                              world_size)
            lead = rank == 0 if self._group else not (dist.is_available() and dist.is_initialized()) \
                or dist.get_rank() == 0
            for level, note in config.notes() if lead else ():
                logger.log(level, "%s", note)
            if lead and self._group is not None and self._group.global_ranks is not None:
                logger.info("the checkpoint's ranks are those of the process_group given, the job's ranks %s: its "
                            "messages and files number them 0 to %d in that order", few(self._group.global_ranks),
                            world_size - 1)
            if self._group is not None:
                self._start(rank)
            elif lead:
                logger.info("checkpointing is disabled (checkpoint.enable = false): save() and load() do nothing")
        except BaseException:  # no manager to close: the group made for it goes
            if self._group is not None:
                self._group.close()
            raise

    def _start(self, rank: int) -> None:
        """Open the storage, check the job against the config, and start the strategies."""
        config = self.config
        self._store = storage.open_store(self.folder, "checkpoint.folder", rank, config)
        self._copies_lock: str | None = None  # rank 0's hold of the copies' folder (`_check_copies`)
        self._user = FolderUser(self._store.url, saves=not config.load_only)
        self._user.settle_earlier()  # before this manager's collectives and reads
        self.folder = self._store.root  # where the formats write and read: the folder, or a local stage
        initial = config.initial_load_path
        self._initial = storage.open_store(initial, "checkpoint.initial_load_path", rank, config) if initial else None
        try:
            self._check_job()
            self._saves = make_strategy(config.async_mode, config.verify_staging, saves=not config.load_only)
            self._user.settle = self._saves.settle
        except BaseException:  # no manager to close: let go of what the stores took (the folder's hold)
            self._close_stores()
            raise
        self._deleter: BackgroundDeleter | None = None
        try:
            if optimizer := self._states.get("optimizer"):
                for opt in optimizer.optimizers:
                    step_hooks.attach(opt, self._before_optimizer_step)
                    self._stepped.append(opt)
            if self._group.is_coordinator:
                self._deleter = BackgroundDeleter(self._store.remove, self._store.describe)
            context = Context(config, self._group, self._adapter, self._store.staged)
            self._formats = {name: cls(context) for name, cls in FORMATS.items()}
            self._targets = TargetFinder(config, self.folder, self._store, self._initial, self._group, self._formats,
                                         self._adapter, self._states)
            self._request = LoadRequest(self._model, self._states, config, self._group)
        except BaseException:
            self.close()
            raise
        self._unclosed = weakref.finalize(self, _collected_unclosed, self._saves.abandoner(), self._deleter,
                                          self._pid, self._store.describe(self.folder))
        self._unclosed.atexit = False  # the exit waits for a save in flight its own way (`staging`)

    def _check_job(self) -> None:
        """What the config asks of this job: an adapter for the Hugging Face format (and what an
        export writes beside its tensors: `_check_export`), one process for a seed checkpoint,
        and the same folder and settings on every rank (`_check_alike`, first); then the stores
        (`_check_stores`)."""
        self._check_alike()
        config = self.config
        for key in ("initial_load_in_hf", "last_save_in_hf", "hf_export_interval"):
            if getattr(config, key) and self._adapter is None:
                raise ConfigError(f"checkpoint.{key}", getattr(config, key),
                                  "the Hugging Face format needs a state-dict adapter: pass "
                                  "state_dict_adapter= to CheckpointManager")
        if config.initial_load_in_hf and not config.initial_load_path and not self._adapter.hf_assets_path:
            raise ConfigError("checkpoint.initial_load_path", None,
                              "checkpoint.initial_load_in_hf needs the Hugging Face folder to start from: set "
                              "initial_load_path, or give the adapter an hf_assets_path")
        if export := next((k for k in ("last_save_in_hf", "hf_export_interval") if getattr(config, k)), None):
            try:  # what rank 0 writes beside the files, known now, not at the export after the training
                self._group.run(self._check_export, coordinator_only=True)
                left_out = self._group.run(self._check_exported_names)
            except RankFailed as failed:
                raise ConfigError(f"checkpoint.{export}", getattr(config, export), str(failed.error or failed)) from None
            if problem := self._untied():
                raise ConfigError(f"checkpoint.{export}", getattr(config, export), problem)
            if self._group.is_coordinator:
                _tell_left_out(export, left_out)
        if config.create_seed_checkpoint and self._group.world_size != 1:
            raise ConfigError("checkpoint.create_seed_checkpoint", True,
                              f"a seed checkpoint is written by a single process; this job has "
                              f"{self._group.world_size} ranks")
        self._check_stores()
        if config.hf_export_interval and not config.load_only:
            try:
                self._group.run(self._check_copies, coordinator_only=True)
            except RankFailed as failed:
                raise ConfigError("checkpoint.hf_export_interval", config.hf_export_interval,
                                  str(failed.error or failed)) from None

    def _check_alike(self) -> None:
        """Every rank has the same folder, settings (but `_PER_RANK`) and kinds of state, before
        any check of the job whose round only ranks of some settings enter (`_check_export`);
        every rank fails, not only those that differ."""
        if self._group.world_size == 1:
            return
        agreed = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)
                  if f.name not in _PER_RANK}
        digest = hashlib.blake2b(repr(sorted(agreed.items())).encode(), digest_size=16).digest()
        folders, digests, kinds = zip(*self._group.all_gather((self._store.url, digest, sorted(self._states))))
        if other := next((r for r, url in enumerate(folders) if url != folders[0]), None):
            raise ConfigError("checkpoint.folder", self._store.url,
                              f"every rank must use the same folder; rank 0 uses {folders[0]}, rank {other} "
                              f"{folders[other]} (a relative folder resolved in another working directory? or "
                              "managers made in another order on each rank: every rank makes them in one order)")
        if other := next((r for r, names in enumerate(kinds) if names != kinds[0]), None):
            raise CheckpointError(
                f"every rank must pass the manager the same kinds of state besides the model; rank 0 passes "
                f"{kinds[0] or 'none'}, rank {other} {kinds[other] or 'none'}: a step records one list of states, "
                "and no load could restore them alike. A rank whose model part has no parameters has no optimizer: "
                "give every pipeline stage parameters, or keep a state out of the checkpoint on every rank")
        if len(set(digests)) > 1:  # rare: every rank's settings, to name those that differ
            _refuse_differing(agreed, self._group.all_gather(agreed))

    def _check_stores(self) -> None:
        """Every store reached before any makes anything (a staging folder, the checkpoint
        folder): a bucket that cannot be used leaves nothing behind. The checkpoint folder's
        check, which on a file system makes the folder, goes last."""
        if (staging := self.config.staging_folder) and (step := layout.step_folder_around(staging)):
            raise ConfigError("checkpoint.staging_folder", staging, f"{layout.in_step(staging, step)}: the files "
                              "staged there would be in that step, which retention then cannot remove; stage "
                              "outside the checkpoint's steps")
        stores = [(self._store, not self.config.load_only)] + ([(self._initial, False)] if self._initial else [])
        for store, write in stores:
            store.reach(self._group, write)
        try:  # rank 0 looks, every rank takes its answer
            step = self._group.run(self._store.step_around, coordinator_only=True)[0]
        except RankFailed as failed:
            failed.reraise(f"looking above {self._store.url}")
        if step:
            url = self._store.url
            raise ConfigError("checkpoint.folder", url, (
                f"{'is' if storage.below(url, step) == [] else 'is inside'} the step folder {step}, not a folder of "
                f"steps (a save would write into that step): resume from {step.rsplit('/', 1)[0]}, the folder holding the "
                "step-N folders, or start from that step with checkpoint.initial_load_path"))
        for store, write in reversed(stores):
            store.check(self._group, write)  # a probe written: shared by every rank?

    def _check_export(self) -> None:
        """The adapter's `config.json` and its assets' other files to write; and, where the
        adapter knows the tensors it exports (one of ours), that its assets' file split, if any,
        names each of them. The folder of the `hf_export_interval` copies, where it exists, is
        one this user may write into (another user's, in a team's folder, failed the first copy
        after the training up to it)."""
        self._adapter.export_config(EXPORT_DTYPES[self.config.export_dtype])
        read_assets(self._adapter.hf_assets_path)
        if self._adapter.hf_names is not None:
            assets_file_split(self._adapter, self._adapter.hf_names, log=False)

    def _check_copies(self) -> None:
        """The folder of the `hf_export_interval` copies (`layout.HF_COPIES`), found fit now
        rather than at the first copy, after the training up to it: a folder (or none yet) this
        user may write into (another user's, in a team's folder); not another job's checkpoint
        folder, which the copies' retention would delete steps of (steps in DCP's format there;
        on a file system, held by this job as a job holds its folder, so that neither starts
        while the other saves there); holding neither the initial checkpoint nor the adapter's
        assets in a step folder, which a copy of that step replaces and retention deletes."""
        copies = os.path.join(self.folder, layout.HF_COPIES)
        where = self._store.describe(copies)
        for key, path in (("checkpoint.initial_load_path", self.config.initial_load_path),
                          ("the adapter's hf_assets_path", self._adapter.hf_assets_path)):
            if path and (names := storage.below(path, where)) and layout.parse_step(names[0]) is not None:
                raise CheckpointError(f"{key} = {path} is in {where}, where this job's copies go: a copy of its step "
                                      "would replace it and their retention delete it; move it out of there")
        if not self._store.staged:
            if os.path.lexists(copies) and not os.path.isdir(copies):
                raise CheckpointError(f"the copies go into {copies}, which is not a folder; move it away, or save "
                                      "into another checkpoint.folder")
            if os.path.isdir(copies) and not os.access(copies, os.W_OK | os.X_OK):
                raise CheckpointError(f"the copies go into {safe_open.denied(copies, 'not writable')}; ask its owner "
                                      "to make it writable to you, or save into another checkpoint.folder")
            durable.make_dir(copies, exist_ok=True)
            self._copies_lock, _ = lock.claim(  # shared with another manager of this process, as its folder is
                os.path.join(copies, LOCK_FILE), f"{copies} (this job's hf_export_interval copies go there)",
                "it is another job's checkpoint folder, whose steps the copies' retention would delete; save one of "
                "the jobs into another checkpoint.folder")
        index = FORMATS["dcp"].index_files
        if dcp := next((f for f in self._store.scan(copies) if f.committed and not f.linked
                        and any(size is not None for size in self._store.sizes(f.path, index).values())), None):
            raise CheckpointError(f"the copies go into {where}, which holds {self._store.describe(dcp.path)} in DCP's "
                                  "format, no copy: another job's checkpoint folder? The copies' retention would "
                                  "delete its steps; save one of the jobs into another checkpoint.folder")

    def _check_exported_names(self) -> list[str] | None:
        """Where the adapter knows the tensors it exports (one of ours): that it maps each of this
        rank's model tensors (a LoRA adapter's, a parametrization's `original0`, a module's
        `_extra_state` are none of them), known now rather than at the export after the training,
        which the job's last save would have been. Another's (TorchTitan's, the user's) may leave
        some out by design: those of this rank, to be told (None: not known before the export);
        some of the names its `to_hf` gives must be the model's of its assets' `config.json`,
        where that names a family of ours (`known_hf_names`): `transformers` loads an export of
        none of them (a peft model's, under an adapter renaming nothing) as a model started at
        random, with a warning table; others (an extra buffer) are warned of."""
        state = self._model.state_dict()
        adapter = self._adapter
        if isinstance(adapter, ForeignAdapter) and (known := known_hf_names(adapter.hf_assets_path)) is not None:
            names = adapter.exported_names(state) or []
            config = f"{adapter.hf_assets_path}/{CONFIG_FILE}"
            if (unknown := [name for name in names if name not in known]) and len(unknown) == len(names):
                raise CheckpointError(
                    f"none of the {len(names)} tensor names the state-dict adapter's to_hf gives is one of the Hugging "
                    f"Face model of {config}, e.g. {unknown[:3]}: transformers would read none of them and start the "
                    "model at random. Map the model's names to the Hub's in to_hf (a peft model: merge each LoRA pair "
                    "into its base weight, docs/hf.md), or export another way")
            if unknown and self._group.is_coordinator:
                logger.warning("the state-dict adapter's to_hf gives %d tensor name(s) that the Hugging Face model of "
                               "%s does not have, e.g. %s: exported, and left unread by transformers", len(unknown),
                               config, unknown[:3])
        return adapter.left_out(state)

    def _untied(self) -> str | None:
        """Why the model cannot be exported under the adapter's config, which ties the head to
        the embedding, or None: a model whose head is a parameter of its own (built untied, or
        untied by `to_empty()` or a copy) trains it apart, and the export after the training
        would be refused (a pipeline stage holding the head without the embedding, too). Asked
        where an HF export is configured, at construction and at load() (after the model is
        materialised), of every rank's parts."""
        if not self._adapter.tied:
            return None
        held = self._group.run(lambda: self._model.one_parameter(TIED_HEAD, EMBEDDING))  # every rank hears it
        if False not in held:
            return None
        where = f" (on rank {held.index(False)})" if len(held) > 1 else ""
        return (f"the Hugging Face config ties {TIED_HEAD} to {EMBEDDING} (tie_word_embeddings = true), and the "
                f"model's {TIED_HEAD} is a parameter of its own{where}, which training would take apart from the "
                f"embedding: tie them (model.output.weight = model.tok_embeddings.weight, again after to_empty()), "
                "or export with a config.json saying tie_word_embeddings = false (the adapter's hf_assets_path)")

    def _build_states(self, parts, optimizers, lr_schedulers, dataloader, extra, rank,
                      world_size) -> dict[str, Stateful]:
        found: dict[str, Stateful] = {}
        if opts := _members(optimizers, "optimizers", "a torch.optim.Optimizer",
                            lambda o: isinstance(o, torch.optim.Optimizer)):
            found["optimizer"] = OptimizerState(parts, opts)
        if scheds := _members(lr_schedulers, "lr_schedulers", "an LR scheduler (with state_dict() and "
                              "load_state_dict())", lambda s: isinstance(s, Stateful)):
            found["lr_scheduler"] = LRSchedulerState(scheds, "optimizer" in self.config.exclude_from_loading, rank == 0)
        if dataloader is not None:
            if not isinstance(dataloader, Stateful):
                raise TypeError(f"dataloader is a {type(dataloader).__name__}, which has no state_dict()/"
                                "load_state_dict(): pass a stateful one (torchdata's StatefulDataLoader, or "
                                "TorchTitan's), or none")
            found["dataloader"] = DataLoaderState(dataloader, rank, world_size)
        if not isinstance(extra, Mapping):
            raise TypeError(f"states is a {type(extra).__name__}; expected a dict of name -> a state with "
                            "state_dict() and load_state_dict()")
        for name, state in extra.items():
            if not isinstance(name, str) or name in BUILTIN_STATES or not name.isidentifier():
                raise ValueError(f"states key {name!r} is reserved or not an identifier; "
                                 f"reserved: {', '.join(BUILTIN_STATES)}")
            if not isinstance(state, Stateful):
                raise TypeError(f"states[{name!r}] has no state_dict()/load_state_dict()")
            if isinstance(state, torch.optim.Optimizer):  # its state_dict() asks a fresh one's load for nothing
                raise TypeError(f"states[{name!r}] is an optimizer: one with no state yet (a resumed job's) "
                                "would load none of its saved state; pass it in optimizers=, with the module "
                                "of its parameters in model_parts")
            found[name] = state
        unknown = [n for n in self.config.exclude_from_loading if n not in found]
        if unknown:
            raise ConfigError("checkpoint.exclude_from_loading", self.config.exclude_from_loading,
                              f"no state named {', '.join(unknown)}; this job's states are "
                              f"{', '.join(found) or 'none besides the model'}")
        return found

    # ------------------------------------------------------------------ lifecycle

    @staticmethod
    def _one_call(method: _Call) -> _Call:
        """One public call at a time. Another thread's waits; one re-entering the call in
        progress on its own thread (a signal handler, run between two bytecodes of a save) is
        refused before it touches anything: a SIGTERM handler saving the step being saved
        committed that step, which the interrupted save then rewrote in place. `close()` there
        is deferred to the end of the interrupted call instead. A forked child's copy refuses
        every call but `close()` (`_not_forked`)."""
        @functools.wraps(method)
        def call(self, *args: Any, **kwargs: Any) -> Any:
            if self._forked:  # a forked child's copy: its lock may have been held at the fork
                if method.__name__ != "close":
                    self._not_forked(method.__name__)
                return method(self, *args, **kwargs)
            with self._calls:
                if self._in_call is not None:
                    if method.__name__ == "close":
                        self._close_pending = True
                        return None
                    raise CheckpointError(f"{method.__name__}() called while {self._in_call}() is in progress on "
                                          "the same thread (from a signal handler?): set a flag there and call "
                                          f"{method.__name__}() from the training loop")
                self._in_call = method.__name__
                try:
                    return method(self, *args, **kwargs)
                finally:
                    self._in_call = None
                    if self._close_pending and method.__name__ != "close":
                        self._close_pending = False
                        self.close()
        return cast(_Call, call)  # the signature stays the method's, for type checkers too

    @property
    def _forked(self) -> bool:
        """Whether this is a copy of the manager in a process forked from its own."""
        return os.getpid() != self._pid

    def _not_forked(self, call: str) -> None:
        """A `CheckpointError` in a process forked from the manager's (a data loader's worker, a
        pool's): its saves, collectives, writer and background thread are the parent's, and a
        child's save committed a step in the parent's folder, or waited forever for the parent's."""
        if self._forked:
            raise CheckpointError(f"{call}(): this CheckpointManager belongs to process {self._pid}, and this is "
                                  f"process {os.getpid()}, forked from it (a DataLoader worker, a multiprocessing "
                                  "pool?): its saves and collectives are that process's. Save and load from the "
                                  "training process only")

    def __reduce__(self) -> NoReturn:
        raise TypeError("a CheckpointManager cannot be sent to another process (a DataLoader's spawn or forkserver "
                        "workers pickle its dataset, which must not hold the manager): keep it in the training "
                        "process")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @_one_call
    def close(self) -> None:
        """Wait for any save in flight and for pending deletions, then let go of the stores.
        Safe to call twice, and from a signal handler (it then runs as the interrupted call ends).
        Interrupted (Ctrl-C) with a save still in flight, it keeps the folder held and the group
        open for that save, which the process's exit waits for."""
        if self._closed or not self.config.enable:
            self._closed = True
            return
        self._closed = True
        if self._unclosed is not None:
            self._unclosed.detach()
        if self._forked:  # a forked child's copy: the saves, the writer and the deleter are
            self._unhook()  # the parent's (its save in flight was waited for forever; the parent's writer stopped)
            return
        try:
            self._saves.close()
        except BaseException:
            if not self._saves.in_flight():
                self._let_go()
            raise  # interrupted with a save in flight: it goes on (the exit waits for it) with the group,
        self._let_go()  # the folder's hold and the optimizers' waits it needs, which the process's end lets go of

    def _let_go(self) -> None:
        """What `close()` lets go of once no save is in flight."""
        self._unhook()
        self._user.close()
        if self._deleter is not None:
            self._deleter.close()
        self._close_stores()
        self._group.close()
        direct.drop_idle_blocks()  # up to 64 MiB mapped for the next save, which may never come

    def _unhook(self) -> None:
        """The optimizers' steps no longer wait for this manager: once no save of its is copying
        (a step let through before would change what the save holds)."""
        for opt in self._stepped:
            step_hooks.detach(opt, self._before_optimizer_step)

    def _close_stores(self) -> None:
        """Let go of what the stores hold on this node (`Store.close`), and of the copies' folder."""
        for store in (self._store, self._initial):
            if store is not None:
                store.close()
        if self._copies_lock is not None:
            lock.release(self._copies_lock)
            self._copies_lock = None

    @_one_call
    def wait(self) -> None:
        """Block until every save submitted so far is committed (or raise its failure)."""
        if self.config.enable:
            self._saves.wait()

    # ------------------------------------------------------------------ saving

    @_one_call
    @gc_pause.paused()
    def save(self, curr_step: int, last_step: bool = False, force: bool = False) -> bool:
        """Save `curr_step` if the schedule says so; returns True when a save was made (or, with
        `async_mode`, staged and handed to the background writer). The last step's save is
        always waited for. `force`: save the step in full off the schedule, for a resume from
        it (a preemption's save; `last_step` is the run's end, whose save may hold only the
        model). Step 0 is saved only as the seed checkpoint (`create_seed_checkpoint`), forced
        or not: no step has trained yet. A step that holds the job's state already (saved or
        loaded by this manager) is not saved again (False). Raises the failure of an earlier
        background save, if any. The garbage collector is paused during the call (the many
        small objects it builds would otherwise set off full collections of the whole process)."""
        if self._closed:
            raise CheckpointError("save() called after close()")
        step = layout.check_step(curr_step, "save")
        if not self.config.enable:
            return False
        _refuse_after_main_thread(f"save({step})")
        self._user.save(f"save({step})")
        if self._half_loaded is not None:
            raise CheckpointError(f"save({step}) refused: the job's state is not one step's ({self._half_loaded})")
        kind = save_kind(step, last_step, self.config, force)
        if last_step:
            self._warn_ended(step)
        fmt = save_format(kind, self.config)
        hf_copy = hf_copy_due(step, self.config) and not (kind is SaveKind.MODEL_ONLY and fmt == "hf")
        waited = self._wait_for_earlier(step) if kind is not None or hf_copy else 0.0
        if kind is not None and self._saved_already(step, kind, fmt):
            kind = None
        if kind is not None:
            self._submit(step, kind, self.folder, self._formats[fmt], last_step, waited)
        if hf_copy:
            self._submit(step, SaveKind.MODEL_ONLY, os.path.join(self.folder, layout.HF_COPIES), self._formats["hf"],
                         last_step)
        if last_step:
            self._saves.wait()
        return kind is not None or hf_copy

    def _saved_already(self, step: int, kind: SaveKind, fmt: str) -> bool:
        """Whether `step`, of this kind and format, holds the job's state already: this job's
        last save (a preemption handler's forced save after the schedule's), or the step it
        loaded (a loop saving at its first step). A save over a complete step removes it
        first, and its failure (a kill, a state that cannot be written) would lose that step."""
        if self._committed != (step, kind, fmt):
            return False
        if self._group.is_coordinator:
            logger.info("step %d (%s, %s) holds this job's state already (saved or loaded by it): not saved again",
                        step, kind.value, fmt)
        return True

    def _warn_ended(self, step: int) -> None:
        """`last_step` marks the run's last save; passed at every step (`last_step=True`), each
        save held the model alone (`last_save_model_only`) and was kept from retention: a
        resume found no step to train on from, and the folder grew without bound."""
        if self._ended_at is None:
            self._ended_at = step
        elif self._ended_at >= 0 and self._group.is_coordinator:  # said once: -1 once told
            logger.warning("save(%d, last_step=True) after save(%d, last_step=True): last_step says the step is the "
                           "run's last (its save may hold only the model, and retention does not run after it); pass "
                           "it at the final step alone (last_step=(step == total_steps))", step, self._ended_at)
            self._ended_at = -1

    def _wait_for_earlier(self, step: int) -> float:
        """Wait for the background save in flight, before `step`'s save starts (and its clock):
        returns the seconds waited, which training lost to saves coming faster than they are
        written. Its failure is raised saying that `step` is not saved either."""
        start = time.perf_counter()
        try:
            self._saves.wait()
        except CheckpointSaveError as e:
            e.unsaved = step
            raise
        return time.perf_counter() - start

    def _submit(self, step: int, kind: SaveKind, folder: str, fmt: StepFormat, last: bool = False,
                waited: float = 0.0) -> None:
        """Hand one save to the staging strategy, or run it here after the save in flight when
        the format must run on the training thread (the background save's collectives share
        the checkpoint group). `last`: the job's last save, after which retention does not run;
        `waited`: the seconds `save()` waited for the save before it, told in the saved line."""
        start = time.perf_counter()
        try:
            state, failure = self._state_for_save(kind), None
            digests = self._digests(state)
        except Exception as e:  # every rank hears of it in the save's first round, not left waiting there
            state, failure, digests = {}, e, {}
        if fmt.on_training_thread:  # after the save in flight (this step's own, for an HF copy): its clock after
            waited += self._wait_for_earlier(step)
        copied = not fmt.on_training_thread and isinstance(self._saves, BackgroundSaves)  # staged for the thread
        # a save whose time the line tells apart from the training's (not the job's last, which save() waits for)
        held = _TrainingWait() if copied and not last else None
        job = self._save_job(step, kind, folder, fmt, failure, last, waited, digests, held, copied)
        if fmt.on_training_thread:
            staged = Staged(state)
            job.run(lambda: staged)
        else:
            self._saves.submit(state, job, self._deferred())
        if held is not None:
            held.seconds += time.perf_counter() - start
            self._waiting = held

    def _deferred(self) -> Deferred:
        """Which tensors of the state a background save may copy after `save()` returns: the
        parameters this manager's optimizers hold and their state, which only their steps change
        (and those wait: `_before_optimizer_step`). Buffers (a norm's running statistics change
        in the forward pass), a parameter none of them holds (a trunk shared with a model whose
        optimizer is another manager's, an EMA's) and every other state's tensors are copied in
        `save()`; so is every tensor of a manager given no optimizer."""
        if not self._stepped:
            return nothing_deferred
        stepped = self._model.parameter_names(self._states["optimizer"].optimizers)
        return lambda path: path[0] in stepped if len(path) == 1 else path[:2] == ("optimizer", "state")

    def _before_optimizer_step(self, *_: Any) -> None:
        """Called before each step of every optimizer given to the manager (`step_hooks`): the
        step changes what a background save may still be copying. The wait counts as the
        training's time spent on the save (`_TrainingWait`)."""
        if self._forked:  # a forked child steps its own copy of the state
            return
        start = time.perf_counter()
        self._saves.wait_for_staging()
        if self._waiting is not None:
            self._waiting.seconds += time.perf_counter() - start

    @property
    def save_in_flight(self) -> bool:
        """True while a background save is being written (never with `async_mode = "disabled"`, nor
        in a forked child: the save is its parent's)."""
        return self.config.enable and not self._forked and self._saves.in_flight()

    def maybe_wait_for_staging(self) -> None:
        """TorchTitan's: block until the staging of the last `save()` is done, so the training
        step may change the state it copied. The optimizers' steps call it themselves (a step
        pre-hook); call it before changing parameters any other way (an EMA update, a weight
        written by hand) between `save()` and the next optimizer step. Returns at once without
        an async mode."""
        self._not_forked("maybe_wait_for_staging")
        if self.config.enable:
            self._saves.wait_for_staging()

    def _digests(self, state: dict[str, Any]) -> dict[str, tuple[bytes, bytes]]:
        """What a save compares among the ranks of each state in `state` (`_warn_per_rank`): its
        `replicated_digest`, the dataloader's position (`DataLoaderState.compared`), the model's
        buffers' (BatchNorm's statistics, which FSDP does not sync); not the optimizer's or the
        model's parameters (replicated or DTensors by training's own design)."""
        buffers = {k: state[k] for k in self._model.buffer_names() if k in state}
        out = {_BUFFERS: replicated_digest(buffers)} if buffers else {}
        for name, s in self._states.items():
            if name not in state or isinstance(s, OptimizerState):
                continue
            digest = s.compared() if isinstance(s, DataLoaderState) else replicated_digest({name: state[name]})
            if digest is not None:
                out[name] = digest
        return out

    def _warn_per_rank(self, digests: list[Mapping[str, tuple[bytes, bytes]]]) -> None:
        """Rank 0, once per state: warn of a state whose values differ among ranks holding the
        same entries. A save keeps one copy of whatever is not a DTensor, as replicated (DCP's
        rule), and a load gives every rank that copy: a rank's RNG state, or its own counter,
        comes back as another rank's; so does the dataloader's position, which is one entry per
        data-parallel rank, among that rank's tensor or pipeline parallel ranks."""
        if not self._group.is_coordinator:
            return
        for name in dict.fromkeys(name for theirs in digests for name in theirs):
            if name in self._told_per_rank:
                continue
            differ, lower = _differing(digests, name)
            if not differ:
                continue
            self._told_per_rank.add(name)
            if name == _BUFFERS:
                logger.warning("the model's buffers hold other values on rank(s) %s than on rank(s) %s (running "
                               "statistics that FSDP does not sync, say): a step keeps one copy of each tensor that is "
                               "not a DTensor (as replicated), each from any one rank, and a load gives every rank "
                               "that copy. Sync them before a save (SyncBatchNorm, DDP's broadcast_buffers)",
                               few(differ), few(lower))
            elif isinstance(self._states.get(name), DataLoaderState):
                logger.warning("the dataloader's position on rank(s) %s differs from that on rank(s) %s, of the same "
                               "data-parallel rank: a step keeps one position per data-parallel rank, whichever "
                               "rank's, and a load gives it to each of them. Keep the loaders of a data-parallel "
                               "rank at one position (each pipeline stage reading the same batches, as "
                               "TorchTitan's trainer does)", few(differ), few(lower))
            else:
                logger.warning("states[%r] holds other values on rank(s) %s than on rank(s) %s: a step keeps one "
                               "copy of each value that is not a DTensor (as replicated), and a load gives every "
                               "rank that copy. If each rank must get its own back, key its values by rank in the "
                               "state (a dict of {f'rank{rank}': ...})", name, few(differ), few(lower))

    def _prepare(self, path: str, step: int) -> None:
        """Rank 0 makes the step folder ready for a save (`Store.prepare`), once retention's
        pending deletion of it is done (`BackgroundDeleter.settle`). A step of a run left behind
        (`_left`) replaced by it is this job's from then on, whether or not the save succeeds."""
        if self._deleter is not None:
            self._deleter.settle(path)
        if path == layout.step_dir(self.folder, step):
            self._left.discard(step)
        self._store.prepare(path, step)

    def _save_job(self, step: int, kind: SaveKind, folder: str, fmt: StepFormat,
                  failure: Exception | None = None, last: bool = False, waited: float = 0.0,
                  digests: Mapping[str, tuple[bytes, bytes]] | None = None,
                  held: _TrainingWait | None = None, copied: bool = False) -> SaveJob:
        """The phases of one save into `{folder}/step-N` in format `fmt`, which the staging
        strategy runs in order on every rank. `failure`: this rank could not gather its state;
        the first phase fails with it on every rank. `digests`: what `_digests` gives for the
        state as saved. `held`: a background save's time on the training
        thread, told in the saved line; `copied`: the state is copied for a background save."""
        path = layout.step_dir(folder, step)
        where = self._store.describe(path)  # the step as the user names it, in messages
        start = time.perf_counter()

        def prepare() -> None:
            def mine() -> tuple:
                if failure is not None:
                    raise failure
                return (step, kind.value, fmt.name, last), digests or {}
            shared = self._agree(step, path, mine)
            calls = [s[0] if isinstance(s, tuple) and len(s) == 2 else s for s in shared]  # or another round's
            if (other := next((r for r, call in enumerate(calls) if call != calls[0]), None)) is not None:
                raise CheckpointError(f"the ranks called save() otherwise: rank 0 {_described(calls[0])}, rank "
                                      f"{other} {_described(calls[other])}; every rank calls save(step, last_step) "
                                      "with the same arguments")
            self._warn_per_rank([s[1] for s in shared])
            self._agree(step, path, lambda: self._prepare(path, step), coordinator_only=True)

        def write(staged: Staged, sink: Sink) -> Written:
            try:
                self._store.prepare_rank(path)
                return fmt.write(path, step, kind, staged, sink)
            except CheckpointSaveError:
                raise
            except Exception as e:
                raise CheckpointSaveError(step, where, e, _failure_hint(path, self._store.staged, e, copied)) from e

        def commit_step(written: Written) -> None:
            info = self._commit(step, path, kind, fmt, written)
            if folder == self.folder:
                self._committed = (step, kind, fmt.name)
            if self._group.is_coordinator:
                self._log_saved(info, where, kind, time.perf_counter() - start, written.summary, waited, held)
                if last:  # as TorchTitan: the steps before the job's last save stay, its k newest full ones
                    return
                try:  # rank 0 alone, and the step is committed: retention failing fails no save
                    self._retain(folder, step)
                except Exception as e:
                    logger.warning("step %d is saved, but retention could not look at %s: %s; older steps are "
                                   "kept until a later save", step, self._store.describe(folder), e)

        return SaveJob(step=step, path=path, prepare=_save_errors(step, where, prepare),
                       write=_save_errors(step, where, write), commit=_save_errors(step, where, commit_step))

    def _retain(self, folder: str, step: int) -> None:
        """Rank 0, once `step` is committed: hand the steps retention drops to the deleter, and
        warn of steps newer than it."""
        listed_at = self._deleter.mark()  # a step the deleter removes while the folder is listed is not queued again
        folders = self._store.scan(folder)
        left = self._left if folder == self.folder else set()
        self._deleter.submit(steps_to_delete(folders, self.config.keep_latest_k, step, left), listed_at)
        passed = self._targets.passed if folder == self.folder else set()
        newer = [f.step for f in newer_steps(folders, step) if f.step not in passed]
        if not {(folder, s) for s in newer} <= self._told_newer:
            why = ("the job went back to an older step" if self._load_called else
                   "this job never called load(): it started afresh beside a run's steps; call manager.load() "
                   "before training to resume from them")
            logger.warning("%s: steps %s are newer than step %d just saved (%s) and are kept; a load without a step "
                           "would pick step %d over it: remove them if that run is abandoned",
                           self._store.describe(folder), newer, step, why, newer[-1])
        self._told_newer.update((folder, s) for s in newer)

    def _commit(self, step: int, path: str, kind: SaveKind, fmt: StepFormat, written: Written) -> commit.CommitInfo:
        """Wait until every rank's files are durable in the store, then write the marker on rank 0."""
        checksums: dict[str, tuple[int, str]] = {}
        def publish() -> dict[str, tuple[int, str]]:
            return self._store.publish(path, written.durable(), self._group, written.joint, written.last)

        for ranks_files in self._agree(step, path, publish):
            checksums.update(ranks_files)
        states = ["model"] if kind is not SaveKind.FULL else ["model", *self._states]
        info = commit.CommitInfo(step=step, states=states, format=fmt.name, world_size=self._group.world_size)
        self._agree(step, path, lambda: self._store.commit(path, info, checksums), coordinator_only=True)
        return info

    def _log_saved(self, info: commit.CommitInfo, path: str, kind: SaveKind, secs: float, summary: str,
                   waited: float, held: _TrainingWait | None) -> None:
        """The saved line: `secs` from `save()` to the commit; for a background save, what of it
        the training thread spent (the rest overlapped training)."""
        behind = f"; save() first waited {waited:.2f} s for the save before it" if waited >= _WAIT_TOLD_S else ""
        aside = f", in the background (the training thread spent {held.seconds:.3f} s on it)" if held else ""
        logger.info("saved step %d (%s, %s) to %s: %s in %.2f s, %.2f GB/s%s%s", info.step, kind.value, info.format,
                    path, fmt_bytes(info.total_bytes), secs, gb_per_s(info.total_bytes, secs), aside, behind)
        if summary:  # the same for every save of the same state: told when it changes
            logger.log(logging.INFO if summary != self._told_summary else logging.DEBUG, "step %d %s", info.step,
                       summary)
            self._told_summary = summary

    def _state_for_save(self, kind: SaveKind) -> dict[str, Any]:
        """The state as of now: model tensors at the top level, every other state resolved to
        its `state_dict()` (so a background save sees this step's values)."""
        model_sd = self._model.state_dict()
        check_materialised(model_sd, "save()")
        if kind is SaveKind.MODEL_ONLY:
            dtype = EXPORT_DTYPES[self.config.export_dtype]
            return exported_state(model_sd, dtype)
        if kind is SaveKind.SEED:
            return model_sd
        states = {name: s.state_dict() if isinstance(s, CheckedState) else own_state_dict(name, s, "save()", model_sd)
                  for name, s in self._states.items()}  # ours build what a load fills: not checked at each save
        if isinstance(self._states.get("optimizer"), OptimizerState):  # but for state made on meta
            check_memory({"optimizer": states["optimizer"]}, "save()", "the optimizer state's")
        return {**model_sd, **states}

    def _agree(self, step: int, path: str, fn: Callable[[], Any], coordinator_only: bool = False) -> list[Any]:
        """Run `fn` on every rank (or on rank 0) and return every rank's result; any rank's
        failure is every rank's `CheckpointSaveError`."""
        try:
            return self._group.run(fn, coordinator_only)
        except RankFailed as failed:
            raise CheckpointSaveError(step, self._store.describe(path), failed.error or failed,
                                      _failure_hint(path, self._store.staged, failed.error)) from failed.error

    # ------------------------------------------------------------------ loading

    @_one_call
    @gc_pause.paused()
    def load(self, step: int = -1) -> bool:
        """Restore `step` (when >= 0, else `load_step`), or else the newest loadable step, else
        `initial_load_path`, else nothing. Returns True when a checkpoint was loaded. The
        garbage collector is paused during the call, as in `save()`."""
        if self._closed:
            raise CheckpointError("load() called after close()")
        step = layout.check_step(step, "load", low=-1)
        if not self.config.enable:
            return False
        _refuse_after_main_thread("load()")
        self._load_called = True
        self._user.settle_earlier()
        self._saves.wait()
        self._committed = self._ended_at = None  # the job's state is the loaded step's now (`_load`), or undefined
        if (self.config.last_save_in_hf or self.config.hf_export_interval) and (problem := self._untied()):
            raise CheckpointError(f"load(): {problem}")
        try:
            return self._load(step)
        except (CorruptCheckpointError, CheckpointNotFoundError, PartialLoadError) as e:
            for store in filter(None, (self._store, self._initial)):  # a reader names the files it read: staged
                restate(e, store.in_user_terms)  # copies; errors of the local disk (its space, its modes) stay
            raise

    def _load(self, step: int) -> bool:
        """`load` once the job is ready for it. A step that another job's retention removed while
        it was being read, before any tensor was written (an evaluation job beside the training
        job saving into the folder), is passed over for the newest step again, up to
        `_REMOVED_RETRIES` times."""
        # rank 0 deletes what retention chose: every rank scans once those deletions are done
        self._group.run(lambda: self._deleter.drain(), coordinator_only=True)
        self._targets.passed.clear()  # of the step this load picks
        self._told_newer = set()
        start = time.perf_counter()
        wanted = step if step >= 0 else self.config.load_step
        asked = self._group.all_gather(("load", wanted))
        if (other := next((r for r, a in enumerate(asked) if a != asked[0]), None)) is not None:
            raise CheckpointError(f"the ranks called load() otherwise: rank 0 {_loading(asked[0])}, rank {other} "
                                  f"{_loading(asked[other])}; every rank calls load() alike")
        for retry in itertools.count(1):
            folders = self._agreed_steps(self._group.each(
                lambda: self._store.scan(self.folder), f"listing the steps of {self._store.describe(self.folder)}"))
            target = None
            try:
                target = self._targets.find(folders, wanted, wanted != self.config.load_step)  # TorchTitan passes it
                try:
                    ahead = self._group.run(lambda: self._targets.steps_ahead_problem(folders, target),
                                            coordinator_only=True)[0]
                except RankFailed as failed:
                    failed.reraise(f"checking the steps ahead in {self._store.describe(self.folder)}")
                if ahead is not None:
                    raise CheckpointError(ahead)
                if target is None:
                    if self._group.is_coordinator:  # a job that only loads, and loaded nothing: a typo?
                        logger.log(logging.WARNING if self.config.load_only else logging.INFO,
                                   "no checkpoint in %s and no initial_load_path: starting from scratch%s",
                                   self._store.describe(self.folder),
                                   " (load_only: the model keeps the weights it was built with)"
                                   if self.config.load_only else "")
                    return False
                nbytes = self._read(target)
                self._left = self._steps_left(target, folders)
                if self._own_step(target) and target.listed:  # ours, committed: the job's state is on disk there
                    kind = SaveKind.MODEL_ONLY if target.model_only else SaveKind.FULL
                    self._committed = (target.step, kind, target.format.name)
                break
            except CheckpointError as e:
                if target is not None and not isinstance(e, PartialLoadError) and self._initial_removed(target):
                    raise CheckpointNotFoundError(
                        f"checkpoint.initial_load_path = {self.config.initial_load_path} was removed while this job "
                        "read it (by the retention of a job saving there?): name a step that job keeps") from e
                # the step read: the target, or before it was chosen, the one asked for or the newest (read first)
                read = (target.step if target is not None else wanted if wanted >= 0 else
                        max((f.step for f in folders if f.loadable), default=None))
                if isinstance(e, PartialLoadError) or read is None or read not in self._removed(folders):
                    raise
                if retry > _REMOVED_RETRIES:
                    raise CheckpointNotFoundError(
                        f"{self._store.describe(self.folder)}: steps were removed while this job read them, {retry} "
                        f"times (the last: step {read}): a job saving there removes them faster than they are "
                        "read; keep more of them there (checkpoint.keep_latest_k)") from e
                if self._group.is_coordinator:
                    logger.warning("%s: step %d was removed while it was read (by the retention of a job saving "
                                   "there?): looking for the newest step again",
                                   self._store.describe(self.folder), read)
        if self._group.is_coordinator:
            secs = time.perf_counter() - start
            what = "the initial checkpoint" if target.step is None else f"step {target.step} from"
            logger.info("loaded %s %s%s: %s in %.2f s, %.2f GB/s", what, target.store.describe(target.path),
                        " (model only)" if target.model_only else "", fmt_bytes(nbytes), secs, gb_per_s(nbytes, secs))
        self._retain_loaded(target, folders)
        return True

    def _own_step(self, target: LoadTarget) -> bool:
        """Whether `target` is a step of this job's folder."""
        return target.store is self._store and target.step is not None and \
            target.path == layout.step_dir(self.folder, target.step)

    def _steps_left(self, target: LoadTarget, folders: list[layout.StepFolder]) -> set[int]:
        """The complete steps of this job's folder newer than `target` once it is loaded: none
        unless `target` is a step of that folder."""
        return {f.step for f in newer_steps(folders, target.step)} if self._own_step(target) else set()

    def _retain_loaded(self, target: LoadTarget, folders: list[layout.StepFolder]) -> None:
        """A job that saves, once it loaded a step of its folder: delete what retention would
        after a save of that step (complete steps beyond `keep_latest_k`, set lower since, and
        partial folders older than it) and, where the job is the folder's only writer
        (`Store.sole_writer`), the partial folders newer than it (saves that failed or were
        killed), and wait for it (up to half the collective timeout the other ranks wait in),
        before the job's first save. A disk that filled up (failed saves' folders holding the
        space, or more steps kept than it holds beside a new one) is freed by the restart, not
        only by a save that cannot succeed on it."""
        if self.config.load_only or not self._own_step(target):
            return

        def delete() -> None:  # rank 0: it holds the lock, if any
            doomed = steps_to_delete(folders, self.config.keep_latest_k, target.step, self._left)
            if self._store.sole_writer:
                doomed += [f for f in folders if f.status == layout.PARTIAL and f.step > target.step and not f.linked]
            self._deleter.submit(doomed)
            if not self._deleter.drain(self.config.collective_timeout_s / 2):
                logger.info("deleting %d old step folder(s) goes on in the background", len(doomed))
        try:
            self._group.run(delete, coordinator_only=True)
        except RankFailed as failed:  # the step is loaded: retention failing fails no load
            if self._group.is_coordinator:
                logger.warning("step %d is loaded, but retention could not run: %s; older steps are kept until a "
                               "later save", target.step, failed.error or failed)

    def _removed(self, folders: list[layout.StepFolder]) -> list[int]:
        """The steps loadable in `folders` (the listing a load began with) that are no longer
        loadable as rank 0 lists the folder again, on every rank."""
        def gone() -> list[int]:
            now = {f.step for f in self._store.scan(self.folder) if f.loadable}
            return [f.step for f in folders if f.loadable and f.step not in now]
        try:
            found = self._group.run(gone, coordinator_only=True)[0]
        except (RankFailed, CollectiveError):  # the listing failed: the load's own failure is the one to report
            return []
        return found if isinstance(found, list) else []  # a rank that failed alone met another round of rank 0's

    def _initial_removed(self, target: LoadTarget) -> bool:
        """Whether `target`, the local step `initial_load_path` names, is no longer a finished
        checkpoint as rank 0 looks at it again (a job saving there removed it), on every rank."""
        if target.store is not self._initial or self._initial.staged:
            return False
        try:
            status = self._group.run(lambda: layout.status_of(target.path), coordinator_only=True)[0]
        except (RankFailed, CollectiveError):  # the look failed: the load's own failure is the one to report
            return False
        return status in (layout.PARTIAL, layout.UNKNOWN)

    def _agreed_steps(self, mine: list[layout.StepFolder]) -> list[layout.StepFolder]:
        """Rank 0's view of the step folders, on every rank (with this rank's paths): ranks that
        saw them differently (a node whose file system caches an older listing) would each pick
        a step of their own and load different steps without an error."""
        seen = self._group.broadcast([(f.step, f.status, f.linked) for f in mine])
        agreed = [layout.StepFolder(step, layout.step_dir(self.folder, step), status, linked)
                  for step, status, linked in seen]
        if agreed != mine:
            logger.warning("rank %d sees the steps of %s as %s, rank 0 as %s: rank 0's view is used",
                           self._group.rank, self._store.describe(self.folder),
                           [(f.step, f.status) for f in mine], [(f.step, f.status) for f in agreed])
        if not any(f.loadable for f in agreed):  # every rank would start afresh, though some see a step
            seeing = [r for r, some in enumerate(self._group.all_gather(any(f.loadable for f in mine))) if some]
            if seeing:
                raise CheckpointNotFoundError(
                    f"rank 0 sees no loadable step in {self._store.describe(self.folder)}, and rank(s) {few(seeing)} "
                    "see some: the ranks do not share the folder (node-local disks, a mount missing on rank 0's "
                    "node?); every rank would start from scratch. Give every rank the same folder")
        return agreed

    def _read(self, target: LoadTarget) -> int:
        """Each rank checks its share of the step and reads its values, the states check them,
        and every rank agrees before any tensor is written (`StepFormat.read`); then each rank
        fills its tensors in place, one gather makes any rank's failure every rank's, and the
        states take what was read. A failure once tensors are being written leaves the job's
        state undefined: `PartialLoadError` on every rank, and `save()` refuses until a load
        succeeds. Returns the bytes of tensors the ranks read, together (not the step folder's
        size: a model-only load of a full step reads a part of it)."""
        optimizer = self._states.get("optimizer")
        rates = optimizer.scheduled() if optimizer is not None else None  # before the read writes tensor rates
        state = self._group.each(lambda: self._request.state(target), f"loading {target.path}")
        if target.format.named_as_state:
            self._request.warn_unloaded(target, state)
        held = local_bytes(state)  # before `_apply`, which hands the tensors read to the states

        def apply() -> int:
            self._apply(state, target.path, rates)
            return held
        try:
            where = target.store.describe(target.path)
            self._group.run(lambda: target.format.read(target.path, target.index, state, target.store,
                                                       lambda: self._check_loaded(state, where)))
            nbytes = sum(self._group.run(apply))
            self._half_loaded = None  # only a load that succeeded clears it: a refused one changed nothing
        except RankFailed as failed:
            # a rank interrupted mid-read (Ctrl-C, a handler's exit), or stuck past the timeout, may have left
            # any rank's tensors half filled
            interrupted = not {"KeyboardInterrupt", "SystemExit", CollectiveError.__name__}.isdisjoint(failed.kinds)
            if PartialLoadError.__name__ not in failed.kinds and not interrupted:
                failed.reraise(f"loading {target.path}")
            own = failed.error if isinstance(failed.error, PartialLoadError) else None
            self._half_loaded = own or PartialLoadError(target.path, failed)
            raise self._half_loaded from (own.cause if own is not None else failed.error)  # never from itself
        except CollectiveError as e:  # a rank stuck past the timeout, maybe once tensors were being filled
            self._half_loaded = PartialLoadError(target.path, e)
            raise self._half_loaded from e
        except BaseException as e:  # Ctrl-C, or a handler's exit, may land once tensors are being filled
            if not isinstance(e, Exception):
                self._half_loaded = PartialLoadError(target.path, e)
            raise
        return nbytes

    def _check_loaded(self, state: dict[str, Any], where: str) -> None:
        """Whether each state takes the values read for it, before any of the load is applied
        (`where`: the step, as the user knows it)."""
        for name, stateful in self._states.items():
            if name in state and isinstance(stateful, CheckedState):
                try:
                    stateful.check_loaded(state[name])
                except CheckpointError as e:
                    restate(e, lambda message: f"{where}: {message}")
                    raise
                except Exception as e:
                    raise _cannot_apply(where, name, e) from e

    def _apply(self, state: dict[str, Any], path: str, rates: list[list[dict[str, Any]]] | None) -> None:
        """Hand what was read to the states (checked by `_check_loaded`). A state that still
        cannot take it (a job's own state, or a dataloader, refusing its values) is a
        `PartialLoadError`: the model's tensors are loaded by now. With the optimizer read and
        its schedulers not, the param groups get back the `rates` they had before the load
        (`OptimizerState.scheduled`): the job's schedule starts afresh from its own."""
        name = "model"
        fresh = "optimizer" in state and "lr_scheduler" in self._states and "lr_scheduler" not in state
        try:
            self._model.join_ties(state)
            self._model.load_state_dict({k: v for k, v in state.items() if k not in self._states})
            for name in sorted(self._states, key=lambda n: not isinstance(self._states[n], DataLoaderState)):
                if name in state:
                    self._states[name].load_state_dict(state[name])
            if fresh and rates is not None:
                name = "optimizer"
                self._states["optimizer"].reschedule(rates)
        except Exception as e:
            raise PartialLoadError(path, e if isinstance(e, CheckpointError) else _not_taken(path, name, e)) from e


def _not_taken(path: str, name: str, error: Exception) -> CheckpointError:
    """The `load_state_dict` of the job's state `name` (the model's, with its hooks) raised
    `error` on what the step holds: the state's own code failed (the job's: the model's, a
    dataloader's, its own states'), or the step was saved by another job; the model cannot be
    left out of a load."""
    what = f"raised {type(error).__name__}: {error}"
    if name == "model":
        advice = f"its load_state_dict (or a hook of it) {what}. Fix that code if the fault is its own, or load " \
                 "another step (the model cannot be left out of a load)"
    elif name in ("optimizer", "lr_scheduler"):
        advice = f"its load {what} (saved by another kind of {name.replace('_', ' ')}?). Load another step, or add " \
                 f"'{name}' to checkpoint.exclude_from_loading to start it fresh"
    else:
        advice = f"its load_state_dict {what}. Fix that code if the fault is its own, load another step, or add " \
                 f"'{name}' to checkpoint.exclude_from_loading to start it fresh"
    return CheckpointError(f"{path}: this job's '{name}' state did not take what the step holds: {advice}")


def _cannot_apply(path: str, name: str, error: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path}: its '{name}' state cannot be applied to this job ({type(error).__name__}: {error}); "
        f"load another step, or add '{name}' to checkpoint.exclude_from_loading")


def _failure_hint(path: str, staged: bool, error: BaseException | None, copied: bool = False) -> str:
    """A full disk often surfaces as an odd error from deep inside a writer; say so plainly, and
    the way out: old steps go only once a newer one is saved, or at a job's `load()` (in the
    checkpoint folder; a `staged` one holds one step of this job's at a time). So do a limit of
    this process's (file size, threads) that `error` hit, naming it, and memory the copy of the
    state for a background save (`copied`) found none of."""
    if copied and in_chain(error, lambda e: isinstance(e, MemoryError) or "can't allocate memory" in str(e)):
        return (" (a background save holds a copy of the rank's state in host memory until it is written, and "
                "found no room for it: free memory, or save with checkpoint.async_mode = 'disabled', which holds "
                "none)")
    if in_chain(error, lambda e: isinstance(e, OSError) and e.errno == errno.EFBIG or "File too large" in str(e)):
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            return (f" (a file reached this process's limit of file size, {limit} bytes: raise it, `ulimit -f`, "
                    "or the batch system's file-size limit)")
    if no_thread(error):
        return (" (this process may start no more threads: its limit of processes, `ulimit -u` or a container's "
                "pids limit, or of memory for their stacks, `ulimit -v`, is reached; raise it, or lower "
                "checkpoint.save_threads)")
    try:
        stat = os.statvfs(path if os.path.exists(path) else os.path.dirname(path))
    except OSError:
        return ""
    free = stat.f_bavail * stat.f_frsize
    if free < (1 << 20):
        full = f"is full: {free} bytes free"
    elif stat.f_files and not stat.f_favail:
        full = "has no free inode left"
    else:
        return ""
    if staged:
        return (f" (the file system of its local staging folder {full}; free space there, or set "
                "checkpoint.staging_folder)")
    return (f" (the file system holding it {full}; free space there, or lower checkpoint.keep_latest_k and "
            "restart: a job's load() deletes the steps beyond it, and the folders of failed saves)")


_PER_RANK = frozenset({"save_threads", "load_threads", "consolidation_threads", "direct_io", "staging_folder",
                       "folder"})
"""Settings each rank may have of its own (how it uses its node: threads, its disk), and `folder`,
compared as it resolves (the store's URL); every other setting of `[checkpoint]` must be the
same on every rank (`_refuse_differing`)."""


def _differing(digests: list[Mapping[str, tuple[bytes, bytes]]], name: str) -> tuple[list[int], list[int]]:
    """The ranks whose state `name` (digests of its entries and of its values, per rank) holds
    other values than the lowest rank holding the same entries, and those lower ranks."""
    first: dict[bytes, tuple[int, bytes]] = {}
    differ, lower = [], set()
    for rank, theirs in enumerate(digests):
        if name not in theirs:
            continue
        entries, values = theirs[name]
        low, held = first.setdefault(entries, (rank, values))
        if held != values:
            differ.append(rank)
            lower.add(low)
    return differ, sorted(lower)


def _refuse_differing(mine: dict[str, Any], every: list[dict[str, Any]]) -> NoReturn:
    """Every rank: a `ConfigError` naming the settings (but `_PER_RANK`) that differ among the
    ranks' `every`: ranks of one job deciding otherwise (to save a step, to restore a state)
    would wait on each other until the collective timeout, or save a mix."""
    keys = [k for k in mine if any(theirs.get(k) != every[0].get(k) for theirs in every)]
    other = next(r for r, theirs in enumerate(every) if theirs.get(keys[0]) != every[0].get(keys[0]))
    more = f" (and {', '.join('checkpoint.' + k for k in keys[1:])})" if len(keys) > 1 else ""
    raise ConfigError(f"checkpoint.{keys[0]}", mine[keys[0]],
                      f"every rank must have the same setting; rank 0 has {every[0][keys[0]]!r}, rank {other} "
                      f"{every[other][keys[0]]!r}{more}: give every rank the same config and overrides")


def _described(call: Any) -> str:
    """A save as `prepare` shares it among the ranks, in words; anything else is what a rank
    sent from another round (it is in `load()`, or at another point of a save)."""
    if not (isinstance(call, tuple) and len(call) == 4):
        return "is not saving (it is in another call of the manager, load() say)"
    step, kind, fmt, last = call
    return f"saves step {step} ({kind}, {fmt}{', last_step' if last else ''})"


_BUFFERS = "\0buffers"
"""The key of the model's buffers among `_digests`' (no state's: their names are identifiers)."""


def _refuse_after_main_thread(call: str) -> None:
    """Refuse `call` from a thread still training once the main thread has ended (a script
    that starts the training loop in a thread and returns): Python then takes no new work in
    thread pools, which saves and loads use, and has stopped this package's background work
    (its exit hooks run when the main thread ends). Known by `threading`'s flag of that, set
    before those hooks run, where this Python has it (an embedded interpreter's first thread
    may end while the process goes on); else by the main thread's end."""
    shutting_down = getattr(threading, "_SHUTTING_DOWN", None)
    if shutting_down if shutting_down is not None else not threading.main_thread().is_alive():
        raise CheckpointError(f"{call} called after the main thread ended: Python takes no new work in thread pools "
                              "then (saves and loads use them) and has stopped the checkpoint's background work; "
                              "have the main thread wait for the training thread (thread.join()) before it ends")


def _tell_left_out(export: str, left_out: list[list[str] | None]) -> None:
    """Log the model tensors that the HF export's adapter leaves out (each rank's, `left_out`), and
    that it could not be asked where a rank's adapter could not say."""
    names = sorted({name for found in left_out if found for name in found})
    if names:
        logger.warning("the Hugging Face export (checkpoint.%s) leaves out %d model tensor(s) that the state-dict "
                       "adapter maps to no Hugging Face tensor, e.g. %s: the exported model lacks them", export,
                       len(names), names[:5])
    if None in left_out:
        logger.info("the Hugging Face export (checkpoint.%s): which model tensors it leaves out is not known before "
                    "it (on %d rank(s) the state-dict adapter's to_hf and from_hf do not take empty tensors of the "
                    "model's shapes)", export, left_out.count(None))


def _loading(call: Any) -> str:
    """A load as `_load` shares it among the ranks, in words (or a rank in another round)."""
    if not (isinstance(call, tuple) and len(call) == 2 and call[0] == "load"):
        return "is not loading (it is in another call of the manager, save() say)"
    return f"loads step {call[1]}" if call[1] >= 0 else "loads the newest step"


def _save_errors(step: int, path: str, fn):
    """`fn`, with any failure (a collective timing out included) raised as CheckpointSaveError."""

    def run(*args):
        try:
            return fn(*args)
        except CheckpointSaveError:
            raise
        except Exception as e:
            raise CheckpointSaveError(step, path, e) from e

    return run


def _collected_unclosed(abandon: Callable[[], None], deleter: BackgroundDeleter | None, pid: int,
                        where: str) -> None:
    """A manager collected without `close()` (no save of its is in flight: a save holds it): its
    threads and its writer process end, its staging buffers go (`abandon`), and the deletions
    queued finish; it runs inside a garbage collection on any thread, so nothing is waited for.
    Its hold of the folder and a group it made stay until the process ends. Nothing in a forked
    child's copy: they are the parent's."""
    if os.getpid() != pid:
        return
    logger.warning("the CheckpointManager of %s was collected without close(): its threads and buffers are let go "
                   "of now, its hold of the folder when the process ends; close() a manager when done with it "
                   "(or make it in a `with` block)", where)
    abandon()
    if deleter is not None:
        deleter.stop()
