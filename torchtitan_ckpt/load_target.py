"""Which checkpoint a load reads, checked before any of it is read.

The step asked for, else the newest loadable step of the folder (passing over a finished run's
model-only save for a job that trains on, and, with `verify_fallback`, a corrupt step), else
`initial_load_path` or the Hugging Face assets; each one verified, its commit marker and index
read, and its RoPE layout checked into a `LoadTarget`. The manager runs the load; this module
decides what it reads and refuses what it must not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import zipfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from . import commit, layout, storage
from .config import Checkpoint
from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, MisnamedStepError, RankFailed, \
    counted, different_copies, few, printable
from .formats import FORMATS, StepFormat, StepIndex
from .group import CheckpointGroup
from .hf import StateDictAdapter
from .hf.files import RECORDED_LAYOUT
from .io import safe_open
from .policy.schedule import save_kind
from .storage.base import Store

logger = logging.getLogger(__name__)


@dataclass
class LoadTarget:
    """A checkpoint a load reads: its folder, its step (None for `initial_load_path` and the
    Hugging Face assets), whether only its model is read, its format, index and store."""

    path: str
    step: int | None
    model_only: bool
    format: StepFormat
    index: StepIndex
    store: Store
    listed: frozenset[str] = frozenset()
    """The states the step's commit marker lists (none for another program's step)."""
    world_size: int | None = None
    """How many ranks saved the step, where its commit marker says."""

    def resized(self, world_size: int) -> str:
        """A note that the step was saved by another number of ranks than `world_size`, or ""."""
        if self.world_size is None or self.world_size == world_size:
            return ""
        return f" (saved by {counted(self.world_size, 'rank')}, this job has {world_size})"


class TargetFinder:
    """Finds and checks what a load of one manager reads, on every rank alike (each decision
    made over rank 0's view, or agreed by the ranks)."""

    def __init__(self, config: Checkpoint, folder: str, store: Store, initial: Store | None,
                 group: CheckpointGroup, formats: Mapping[str, StepFormat], adapter: Any,
                 states: Collection[str]):
        self.config = config
        self.folder = folder
        self._store = store
        self._initial = initial
        self._group = group
        self._formats = formats
        self._adapter = adapter
        self._states = tuple(states)
        """The names of the job's states besides the model."""
        self.passed: set[int] = set()
        """The steps loads passed over (holding only the model, or failing verification with
        `verify_fallback`): a load passes them over again, so saves before them are not warned
        of them as of steps a load would pick instead. The manager empties it as a load begins."""

    def find(self, folders: list[layout.StepFolder], step: int, asked: bool = False) -> LoadTarget | None:
        """What a load of `step` (when >= 0; `asked`: by `load(step)`, else by `load_step`) reads,
        among `folders` (rank 0's listing): that step, else the newest loadable one, else
        `initial_load_path` or, with `initial_load_in_hf`, the adapter's Hugging Face assets;
        None when there is nothing."""
        if step >= 0:
            return self._explicit_step(folders, step, f"load({step})" if asked else f"checkpoint.load_step = {step}")
        loadable = [f for f in folders if f.loadable]
        newest_step = loadable[-1].step if loadable else -1
        ignored: dict[tuple[str, bool], list[str]] = {}  # a line per reason: a crashed job may leave a thousand
        for f in folders:
            if f.status == layout.DENIED and f.step > newest_step:  # it may be the newest step: never passed over
                raise CheckpointError(f"{self._store.describe(f.path)}, newer than every step this job may read, "
                                      f"{_not_loadable(f)}")
            if not f.loadable and f.step > newest_step:
                empty = self._store.empty(f)  # a save stopped or starting there, whether this job may write or not
                begun = f.status == layout.PARTIAL or empty
                ignored.setdefault((_not_loadable(f, empty), begun), []).append(self._store.describe(f.path))
        for (why, begun), paths in ignored.items() if self._group.is_coordinator else ():
            # a job that only loads (an evaluation beside the training) meets the training's save in flight at each load
            level = logging.INFO if begun and self.config.load_only else logging.WARNING
            logger.log(level, "ignoring %s: %s", few(paths, 3), why)
        if loadable:
            if self.config.initial_load_path and self._group.is_coordinator:
                logger.info("%s has loadable steps; ignoring initial_load_path", self._store.describe(self.folder))
            return self._newest_target(loadable)
        if self._initial:
            named, store = f"checkpoint.initial_load_path = {self.config.initial_load_path}", self._initial
            instead = "set it to false (the format of initial_load_path is found from its files)"
        elif self.config.initial_load_in_hf:
            named = f"the adapter's hf_assets_path = {self._adapter.hf_assets_path}"
            store = storage.open_store(self._adapter.hf_assets_path, "hf_assets_path", self._group.rank, self.config)
            instead = (f"to start from it, set checkpoint.initial_load_path = {self._adapter.hf_assets_path} and "
                       "checkpoint.initial_load_in_hf = false")
        else:
            return None
        path = self._group.each(lambda: store.fetch(store.root, layout.TELLING), f"fetching {named}")
        return self._initial_target(path, store, named, instead if self.config.initial_load_in_hf else None)

    def steps_ahead_problem(self, folders: list[layout.StepFolder], target: LoadTarget | None) -> str | None:
        """Why the job cannot train on from `target`, or None. A save never replaces a step
        folder this package did not write (`Store.prepare`). Another program's folder ahead of
        the step this job starts from, at a step its schedule saves (TorchTitan's last save,
        which a resume passes over; on object storage any step without our markers), or a link
        to a step elsewhere, would fail that save after all the training up to it: refused now,
        before any. One off the schedule is a warning: the job's last step, which the manager
        does not know, may be there. (An empty folder, which a save killed before its first file
        leaves, is replaced: `Store.replaceable`.) Run on rank 0 alone, whose answer every rank
        takes: ranks looking on their own could see a user's file arrive at different times."""
        if self.config.load_only:
            return None
        start = target.step if target is not None and target.step is not None else 0
        kept = [f for f in folders if f.step > start and not self._store.replaceable(f)]
        ahead = [f for f in kept if save_kind(f.step, False, self.config) is not None]
        if off := [f.step for f in kept if f not in ahead]:
            logger.warning("%s: step(s) %s, ahead of step %d this job starts from, were not written by "
                           "torchtitan_ckpt (or are links, hold a user's files, or this user may not remove them) and "
                           "are never replaced: a last save at one of them (a run ending there) would be refused after "
                           "the training. Move them out of the folder if so",
                           self._store.describe(self.folder), few(off), start)
        if not ahead:
            return None
        steps = few([f.step for f in ahead])
        denied = next(filter(None, (self._store.unremovable(f) for f in ahead
                                    if not f.linked and (f.ours or f.status == layout.DENIED))), None)
        added = next(filter(None, (self._store.unlisted(f) for f in ahead if f.committed and not f.linked)), None)
        whose = (f"include steps this user may not remove ({denied}; ask their owner, or save with umask 002 in a "
                 "folder without the sticky bit)" if denied else
                 f"hold files their {commit.MARKER} does not list ({few(added, 3)}: a user's?)" if added else
                 "are links to folders elsewhere (a run linked in is never changed) or were not written by "
                 "torchtitan_ckpt" if any(f.linked for f in ahead) else
                 "were not written by torchtitan_ckpt (another program's, such as TorchTitan's last save)")
        restart = (f" (checkpoint.initial_load_path = {self._store.describe(target.path)!r} with "
                   "checkpoint.initial_load_model_only = false starts it from the same step there)"
                   if target is not None and target.step is not None else "")
        never = "a folder it may not remove" if denied else "files it did not write" if added else \
            "a folder it did not write"
        return (
            f"{self._store.describe(self.folder)}: step(s) {steps} {whose} and this job, starting from step "
            f"{start}, saves step {ahead[0].step} (checkpoint.interval = {self.config.interval}); a save never "
            f"replaces {never}, so that save would "
            "fail after the training up to it. Before "
            f"training, move "
            f"{self._store.describe(ahead[0].path)}{' and the others' if len(ahead) > 1 else ''} out of the folder, "
            f"or save into another checkpoint.folder{restart}")

    def _newest_target(self, loadable: list[layout.StepFolder]) -> LoadTarget:
        """The newest loadable step; with `verify_fallback`, an older one if it is corrupt. A
        model-only step after step 0 is a finished run's last save: a job that would go on
        training from it passes it over for an older full step (`_resume_point`), before
        verifying it."""
        passed: list[layout.StepFolder] = []  # model-only steps passed over, newest first
        corrupt: list[int] = []
        for newest in reversed(loadable):
            if self._only_the_model(newest):
                passed.append(newest)
                self.passed.add(newest.step)
                continue
            if newest.status == layout.FOREIGN:
                target = self._foreign_target(newest.path, newest.step, self._store)
                if target.model_only and target.step and self._resumes():
                    passed.append(newest)
                    self.passed.add(newest.step)
                    continue
                return self._resume_point(target, passed, corrupt)
            problems = self._verify(newest.path, self._store)
            if problems and self.config.verify_fallback:
                if self._group.is_coordinator:
                    logger.error("step %d is corrupt, trying the previous complete step: %s",
                                 newest.step, printable("; ".join(problems)))
                corrupt.append(newest.step)
                self.passed.add(newest.step)
                continue
            if problems:
                raise CorruptCheckpointError(f"step {newest.step} failed verification: {'; '.join(problems)}")
            try:
                target = self._committed_target(newest.path, newest.step, self._store)
            except MisnamedStepError as e:
                if self._group.is_coordinator:
                    logger.warning("passing over %s", e)
                self.passed.add(newest.step)
                continue
            return self._resume_point(target, passed, corrupt)
        if passed:
            return self._resume_point(None, passed, corrupt)
        raise CorruptCheckpointError(f"every complete step in {self._store.describe(self.folder)} failed verification "
                                     "or holds another step than its folder's name (each is named above)")

    def _resumes(self) -> bool:
        """Whether this job goes on training from what it loads: it saves, and it restores
        states besides the model."""
        return not self.config.load_only and bool(self._loaded_states())

    def _only_the_model(self, folder: layout.StepFolder) -> bool:
        """Whether `folder` is a step after step 0 that holds only the model, for a job that
        `_resumes`, told without reading its index: ours by its marker (a damaged one is not:
        verifying or loading the step reports it), another program's by its format (a Hugging
        Face step holds nothing else, and reading its index needs a state-dict adapter)."""
        if not folder.step or not self._resumes():
            return False
        if folder.status == layout.FOREIGN:
            return not self._foreign_format(folder.path).holds_states
        if folder.status != layout.COMPLETE:
            return False

        def model_only() -> bool:
            try:
                return self._store.read_marker(folder.path).model_only
            except CorruptCheckpointError:
                return False

        try:  # every rank decides alike, and a store failing on one rank fails them all
            return self._group.run(model_only)[0]
        except RankFailed as failed:
            failed.reraise(f"reading the marker of {self._store.describe(folder.path)}")

    def _resume_point(self, full: LoadTarget | None, passed: list[layout.StepFolder],
                      corrupt: list[int]) -> LoadTarget:
        """`full`, the newest step holding the job's whole state, when newer steps hold only the
        model (`passed`, newest first: a finished run's last save, which a run that goes on must
        not restart from: its optimizer, schedule and data would start over, and its saves would
        replace the earlier run's). Without a full step, such a step is refused."""
        if full is not None and not passed:
            return full
        newer = few([f.step for f in passed])
        if full is not None and not full.model_only:  # a seed step 0 holds only the model too
            if self._group.is_coordinator:
                logger.warning("step(s) %s hold only the model (a finished run's last save): resuming from step %s, "
                               "the newest step holding the optimizer and the other states; this run's saves will "
                               "replace them, or retention (keep_latest_k > 0) delete them once it saves past them. "
                               "To keep them, copy them elsewhere first; to start a new run from step %s's model, set "
                               "checkpoint.initial_load_path to it and use another folder",
                               newer, full.step, passed[0].step)
            return full
        held = (f"the steps holding it ({few(corrupt)}) failed verification" if corrupt else
                "no step after step 0 holds it")
        raise CheckpointError(
            f"{self._store.describe(self.folder)}: its newest step {passed[0].step} holds only the model (a finished "
            f"run's last save) and this job restores its {', '.join(self._loaded_states())} state too, but {held}: "
            f"resuming would restart training over it. {self._model_only_advice(passed[0].path)}")

    def _model_only_advice(self, path: str) -> str:
        """What a job that restores more than the model can do with the model-only step at `path`."""
        return (f"To train on from its model, set checkpoint.initial_load_path = {self._store.describe(path)!r} and "
                f"use another checkpoint.folder; to read the model alone, set checkpoint.load_only = true")

    def _loaded_states(self) -> list[str]:
        """The states besides the model that a load restores."""
        return [name for name in self._states if name not in self.config.exclude_from_loading]

    def _initial_target(self, path: str, store: Store, named: str, hf_or: str | None = None) -> LoadTarget:
        """The checkpoint a job without steps starts from, at `path` in `store` (`named`: the
        setting that names it, for messages): one of ours (verified) or another program's; a
        folder holding none, a file, or a save that did not finish are refused. With `hf_or`
        (`initial_load_in_hf`: what to do instead), a checkpoint of another format than Hugging
        Face's is refused before anything of it is read."""
        status = self._group.broadcast(self._group.each(  # one decision (`_agreed_steps`)
            lambda: layout.status_of(path), f"looking at {named}"))
        if status == layout.UNKNOWN:
            found = ("holds no finished checkpoint of a known format" if os.path.isdir(path) else
                     _a_file(path) if os.path.exists(path) else "does not exist")
            if steps := [f.step for f in store.scan(path) if f.loadable]:
                found += f" (it holds the steps {steps}: name one of their folders)"
            raise CheckpointNotFoundError(
                f"{named} {found}, and {self._store.describe(self.folder)} has no loadable step to resume from; "
                f"formats: {', '.join(FORMATS)}")
        if status == layout.PARTIAL:
            raise CheckpointNotFoundError(f"{named}: its save did not finish (no {commit.MARKER}); it is never loaded")
        ours = status == layout.COMPLETE
        if hf_or is not None:
            found = self._group.broadcast(self._group.each(
                lambda: store.read_marker(path).format if ours else layout.foreign_format(path), f"looking at {named}"))
            if found != "hf":
                title = self._formats[found].title if found in self._formats else repr(found)
                raise CheckpointError(f"{named} is a {title} checkpoint, and checkpoint.initial_load_in_hf = true asks "
                                      f"for a Hugging Face safetensors folder: {hf_or}")
        if ours and (problems := self._verify(path, store)):
            raise CorruptCheckpointError(f"{named} failed verification: {'; '.join(problems)}")
        target = (self._committed_target if ours else self._foreign_target)(
            path, None, store, self.config.initial_load_model_only)
        if target.model_only and not self.config.initial_load_model_only and self._resumes():
            what, besides = (("a model-only save of torchtitan_ckpt: a run's last save, or a seed", "") if ours else
                             (f"a {target.format.name} checkpoint of another program",
                              " (another framework's optimizer files beside it, a Trainer's optimizer.pt say, are "
                              "never read)"))
            raise CheckpointError(
                f"{named} holds only the model ({what}) and "
                f"checkpoint.initial_load_model_only = false asks for this job's {', '.join(self._loaded_states())} "
                f"state too: set it to true to start from its model{besides}")
        return target

    def _foreign_format(self, path: str) -> StepFormat:
        """The format of another program's checkpoint at `path` (`layout.foreign_format`)."""
        return self._formats[layout.foreign_format(path) or "dcp"]

    def _foreign_target(self, path: str, step: int | None, store: Store, model_only: bool = False) -> LoadTarget:
        """A checkpoint another program wrote (TorchTitan's own manager, a Hugging Face export):
        loaded as its format's files say, without a manifest to verify them against. Its step 0
        is a seed: its model alone is read, as TorchTitan reads it (a seed saved with every
        state holds the optimizer of the zero-learning-rate step that built it, whose step
        count would change the first real update's bias correction)."""
        fmt = self._foreign_format(path).name
        if self._group.is_coordinator:
            whose = (f"written by another program over a save of ours: its {commit.IN_PROGRESS} names another save"
                     if commit.is_in_progress(path) else f"no {commit.MARKER}: not written by torchtitan_ckpt")
            asked = self.config.verify_on_load  # no manifest to verify against: said louder when asked for
            logger.log(logging.WARNING if asked else logging.INFO, "loading %s: a foreign %s checkpoint (%s), "
                       "unverified%s%s", store.describe(path), fmt, whose,
                       " (checkpoint.verify_on_load needs the manifest a save of ours writes)" if asked else "",
                       "; step 0, a seed: its model alone" if step == 0 else "")
        model_only = model_only or step == 0
        target = self._target(path, step, model_only, store, fmt)
        if not target.model_only:  # a model-only save has none of the other states
            saved = {k.split(".", 1)[0] for k in target.index.keys()}
            target.model_only = not saved & set(self._states)
        return target

    def _explicit_step(self, folders: list[layout.StepFolder], step: int, named: str) -> LoadTarget:
        """The step a load names (`named`: how, for messages): refused when it is missing, not
        loadable, or holds only the model for a job that `_resumes`."""
        path = layout.step_dir(self.folder, step)
        where = self._store.describe(path)
        match = [f for f in folders if f.step == step]
        loadable = [f.step for f in folders if f.loadable]
        if not match:
            there = (f"loadable steps: {loadable}" if folders else
                     f"{self._store.describe(self.folder)} holds no step: is it the folder the run saved into?")
            raise CheckpointNotFoundError(f"{named}: {where} does not exist; {there}")
        if not match[0].loadable:
            raise CheckpointNotFoundError(
                f"{named}: {where} is not loadable ({_not_loadable(match[0])}); "
                f"loadable steps: {loadable}")
        if self._only_the_model(match[0]):
            raise self._refused_model_only(named, path)
        if match[0].status == layout.FOREIGN:
            target = self._foreign_target(path, step, self._store)
            if target.model_only and step and self._resumes():
                raise self._refused_model_only(named, path)
            return target
        if problems := self._verify(path, self._store):
            raise CorruptCheckpointError(f"step {step} failed verification: {'; '.join(problems)}")
        return self._committed_target(path, step, self._store)

    def _refused_model_only(self, named: str, path: str) -> CheckpointError:
        """A step named to load that holds only the model, for a job that `_resumes`: its other
        states would start over while the model goes on (TorchTitan's load fails on the missing
        keys), and its saves would replace the steps of the run that wrote it."""
        return CheckpointError(
            f"{named}: {self._store.describe(path)} holds only the model (a finished run's last "
            f"save) and this job restores its {', '.join(self._loaded_states())} state too, which the step lacks. "
            f"{self._model_only_advice(path)}, or add those states to checkpoint.exclude_from_loading")

    def _verify(self, path: str, store: Store) -> list[str]:
        """With `verify_on_load`: every rank checks its share of the files of the copy of the
        step of ours at `path` in `store` that it reads (`Store.copy_of`: ranks reading one copy
        share its files out); every rank gets every problem found. Without it, rank 0 checks
        that its copy holds every file at the size recorded, from a listing (`_listed_whole`)."""
        if not self.config.verify_on_load:
            return self._listed_whole(path, store)
        try:
            copies = self._group.run(lambda: store.copy_of(path))
        except RankFailed as failed:
            failed.reraise(f"verifying {store.describe(path)}")
        readers = [rank for rank, copy in enumerate(copies) if copy == copies[self._group.rank]]
        if len(readers) < self._group.world_size and self._group.is_coordinator:
            logger.info("%s: the ranks read %d copies of it (a copy on each node's disk); each copy is verified "
                        "whole", store.describe(path), len(set(copies)))

        def mine() -> list[str]:
            try:
                names = sorted(store.read_marker(path).files)
            except CorruptCheckpointError as e:  # a problem like any other: `verify_fallback` applies
                return [str(e)]
            share = names[readers.index(self._group.rank) :: len(readers)]
            try:
                store.fetch(path, share)
            except CorruptCheckpointError as e:  # objects that cannot be its files
                return [str(e)]
            return [store.in_user_terms(problem) for problem in commit.verify(path, share, self.config.load_threads)]

        try:  # a rank that cannot check its share (the store failing) fails every rank
            found = self._group.run(mine)
        except RankFailed as failed:
            failed.reraise(f"verifying {store.describe(path)}")
        return list(dict.fromkeys(p for problems in found for p in problems))

    def _listed_whole(self, path: str, store: Store) -> list[str]:
        """`commit.cut_short` of the step of ours at `path` in `store`, as rank 0 finds it (one
        listing of a bucket, not one a rank; a copy on each node's disk is `verify_on_load`'s)."""
        def mine() -> list[str]:
            try:
                info = store.read_marker(path)
            except CheckpointError:  # the load names it, as it reads the marker
                return []
            cut = commit.cut_short(path, info, store.sizes(path, info.files))
            return [store.in_user_terms(problem) for problem in cut]

        try:
            found = self._group.run(mine, coordinator_only=True)
        except RankFailed as failed:
            failed.reraise(f"listing the files of {store.describe(path)}")
        return found[0]

    def _target(self, path: str, step: int | None, model_only: bool, store: Store,
                fmt_name: str = "dcp", listed: frozenset[str] = frozenset(),
                world_size: int | None = None) -> LoadTarget:
        fmt = self._formats.get(fmt_name)
        if fmt is None:
            raise CorruptCheckpointError(f"{path}: format {fmt_name!r} is not one of {', '.join(self._formats)}")
        index = fmt.index(path, store)
        self._check_rope_layout(path, index, store)
        return LoadTarget(path, step, model_only or not index.keys(), fmt, index, store, listed, world_size)

    def _check_rope_layout(self, path: str, index: StepIndex, store: Store) -> None:
        """A folder `convert --to dcp` wrote records the RoPE layout its q/k rows are in
        (`RECORDED_LAYOUT`, in `index`); the model's is its adapter's, when one of ours. Another
        one would load a model whose attention is wrong, silently: refused before any tensor is
        read."""
        recorded = index.rope_layout
        if recorded is None or not isinstance(self._adapter, StateDictAdapter):
            return
        ours = self._adapter.rope_layout
        if recorded != ours:
            raise CheckpointError(
                f"{store.describe(path)}: its q/k rows are in the {recorded} RoPE layout (its {RECORDED_LAYOUT}, "
                f"written by `torchtitan-ckpt convert --to dcp`), and this job's model's is {ours} (its "
                "state-dict adapter's rope_layout): it would load with its attention scrambled. Convert the "
                f"Hugging Face folder again with `torchtitan-ckpt convert --to dcp --rope-layout {ours} HF_DIR "
                "OUT_DIR`")

    def _committed_target(self, path: str, step: int | None, store: Store, model_only: bool = False) -> LoadTarget:
        """A step of ours, in the format and with the states its commit marker records. One in a
        folder named for another `step` than the marker's is `MisnamedStepError`."""
        info = self._group.each(lambda: store.read_marker(path),
                                f"reading the marker of {store.describe(path)}")
        if differ := self._group.differing(info.digest):
            raise CorruptCheckpointError(different_copies(store.describe(os.path.join(path, commit.MARKER)), differ))
        if step is not None and (wrong := info.misnamed(store.describe(path), step)):
            raise MisnamedStepError(f"{wrong}: renamed, or copied in under another step's name. Loaded as step {step}, the "
                            f"job would go on from another step than it counts (and its saves replace the steps "
                            f"between); name it {layout.step_name(info.step)}, or move it out")
        return self._target(path, step, model_only or info.model_only, store, info.format, frozenset(info.states),
                            info.world_size)



_LEGACY_TORCH_SAVE = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"
"""How a `torch.save` file of the format before torch 1.6 starts: a pickle of its magic number."""


def _torch_save_file(path: str) -> bool:
    """Whether `path` is a `torch.save` file: a zip archive holding a `data.pkl`, told from its
    listing (nothing is unpickled), or the older format's magic number. Only a regular file is
    opened (`safe_open`: a FIFO there would block the open)."""
    try:
        with safe_open.open_path(path, "checkpoint.initial_load_path") as f:
            if f.read(len(_LEGACY_TORCH_SAVE)) == _LEGACY_TORCH_SAVE:
                return True
            f.seek(0)
            with zipfile.ZipFile(f) as archive:
                return any(name == "data.pkl" or name.endswith("/data.pkl") for name in archive.namelist())
    except (CheckpointError, OSError, zipfile.BadZipFile, ValueError):
        return False


def _a_file(path: str) -> str:
    """What to say of `initial_load_path` naming the file `path`: one of a checkpoint folder's
    files, or a `torch.save` file (a `.pt`, `pytorch_model.bin`, a Lightning `.ckpt`), a pickle,
    which this package never loads."""
    if not os.path.dirname(path) or layout.status_of(os.path.dirname(path)) == layout.UNKNOWN:
        if _torch_save_file(path):
            return ("is a torch.save file (a pickle), which torchtitan_ckpt never loads (unpickling runs code from "
                    "the file): save its tensors again as safetensors (safetensors.torch.save_file, or "
                    "transformers' save_pretrained) and load that folder with checkpoint.initial_load_in_hf and a "
                    "state-dict adapter, or as a DCP folder (torch.distributed.checkpoint.save)")
    return "is a file, not a step folder: name the folder holding it"


def _not_loadable(folder: layout.StepFolder, empty: bool = False) -> str:
    """Why `folder` is not loaded; `empty`: one a save stopped in (or is starting in) before its
    first file (`Store.empty`)."""
    if os.path.islink(folder.path) and not os.path.exists(folder.path):
        with contextlib.suppress(OSError):  # gone since the scan: told as any other entry of no checkpoint
            return (f"a link to {os.readlink(folder.path)!r}, which leads nowhere (a copy of the folder that kept "
                    "a relative link?)")
    if folder.status == layout.PARTIAL:
        return f"its save did not finish (no {commit.MARKER})"
    if folder.status == layout.DENIED:
        return (f"cannot be read: {safe_open.denied(folder.path, 'Permission denied')}; ask its owner to make it "
                "readable to you, or move it out of the folder")
    if empty and folder.status == layout.UNKNOWN:
        return "empty: a save that stopped (or is starting) before its first file; the save of its step replaces it"
    return ("not written by torchtitan_ckpt, and holding no finished checkpoint of a known format "
            f"({', '.join(FORMATS)}): its save did not finish, or it is not a checkpoint")
