"""`torchtitan-ckpt`: look at, check, convert and tidy checkpoints from the shell.

    torchtitan-ckpt list DIR          every step folder, complete or not, its size and contents
    torchtitan-ckpt inspect STEP_DIR  the states, tensors, dtypes, shapes and bytes of one step
    torchtitan-ckpt verify STEP_DIR   check every file against the sizes and CRC-32s of its commit
    torchtitan-ckpt clean DIR         remove the partial step folders crashed saves of ours left behind
    torchtitan-ckpt convert --to hf STEP_DIR OUT_DIR | --to dcp HF_DIR OUT_DIR
    torchtitan-ckpt consolidate IN_DIR OUT_DIR   per-rank HF shard files -> final safetensors files

list's DIR, inspect's and verify's STEP_DIR and convert's source may be object-store URLs
(`s3://bucket/prefix/step-N`, read with the standard AWS environment: docs/storage.md); what a
command reads of one is downloaded into a temporary folder (verify and convert: the whole step).
What convert and consolidate write, OUT_DIR, is a local folder.

All argparse of the package lives here. `list`, `inspect` and `verify` take `--json` (one JSON
document on stdout; docs/cli.md shows each). Long work shows progress on stderr: a bar on a
terminal, a log line every `--progress-every` seconds otherwise, only on rank 0 under torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
import warnings
from collections.abc import Collection, Iterator
from typing import Any, NoReturn

from torch.distributed.checkpoint.api import CheckpointException

from .io import IO_THREADS, durable
from . import commit, layout
from .dcp import storage
from .dcp.metadata import METADATA_FILE
from .hf.consolidate import consolidate_safetensors, load_mapping
from .hf.files import INDEX_FILE
from .formats import FORMATS
from .config import BUILTIN_STATES, MAX_THREADS, Checkpoint
from .group import CheckpointGroup, launched_group, leave
from .errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, NewerVersionError,
                     OlderVersionError, RankFailed, counted, in_chain, printable, restate)
from .hf.convert import convert
from .hf.adapter import ROPE_LAYOUTS
from .hf.registry import ADAPTERS
from .io import safe_open
from .io.dtypes import EXPORT_DTYPES
from .io.untrusted import shown
from .hf.planner import parse_size
from .hf.save import MODES
from .progress import DEFAULT_INTERVAL, Progress, fmt_bytes, launched_rank, this_rank_draws
from .storage import check_url, open_store, scheme_of
from .storage import lock
from .storage.base import Store
from .storage.local import LOCK_FILE

EXIT_OK, EXIT_FAILED, EXIT_INPUT, EXIT_STDOUT, EXIT_INTERRUPTED, EXIT_PIPE = 0, 1, 2, 74, 130, 141
EXIT_CODES = """exit status:
  0    success
  1    verify: a file is missing, differs from the manifest or is not in it; list: no loadable step;
       clean: a partial step could not be removed (named on stderr); convert, consolidate: the
       output's file system is full (a new output's unfinished folder is removed)
  2    usage error, or input that is not what the command needs (named on stderr)
  74   stdout could not be written (a full disk under `> file`); the command stopped there
  130  interrupted (Ctrl-C); an unfinished convert/consolidate output is removed
  143  ended by SIGTERM (129: SIGHUP), cleaned up as after Ctrl-C
  141  stdout was closed early (e.g. `| head`); the command stops quietly
"""
PARTIAL_SUFFIX = ".partial"
"""convert and consolidate write a new OUT_DIR as OUT_DIR.partial and rename it when done."""


def _print_json(doc: dict[str, Any]) -> None:
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _require_folder(folder: str) -> None:
    try:
        is_folder = stat.S_ISDIR(os.stat(folder).st_mode)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{folder} does not exist" + (" (a link to a missing path)"
                                                                   if os.path.islink(folder) else "")) from None
    except OSError as e:
        raise CheckpointNotFoundError(f"{folder} cannot be looked at: {e.strerror}") from None
    if not is_folder:
        raise CheckpointNotFoundError(f"{folder} is a file, not a folder")
    if not os.access(folder, os.R_OK | os.X_OK):  # else read as a folder holding nothing
        raise CheckpointError(f"{safe_open.denied(folder, 'Permission denied')}; ask its owner to make it readable "
                              "to you")


def _where_steps_are(folder: str) -> str:
    """A hint for a local `folder` that holds no step where one was expected: the step folders
    in it (a checkpoint folder named for a step), or the first of its subfolders holding some
    (a job's dump folder named for its checkpoint folder); "" when neither."""
    def steps_in(path: str) -> list[str]:
        try:
            return sorted((n for n in os.listdir(path) if layout.parse_step(n) is not None), key=layout.parse_step)
        except OSError:  # unreadable: none seen
            return []

    if steps := steps_in(folder):
        return f": it holds the step folders {steps[0]} to {steps[-1]}; name one of them"
    try:
        subfolders = sorted(e.path for e in os.scandir(folder) if e.is_dir())[:64]
    except OSError:
        return ""
    return next((f"; its subfolder {sub} holds step folders: name that one" for sub in subfolders if steps_in(sub)),
                "")


@contextlib.contextmanager
def _opened(where: str, argument: str) -> Iterator[tuple[Store, str]]:
    """The store holding the folder `where` names, and the local folder to read it in: a path
    itself, or for an object-store URL a temporary folder (removed afterwards) that the
    command fetches objects into. An unreachable bucket is an error naming the URL."""
    if scheme_of(where) is None:
        yield open_store(where, argument, 0, Checkpoint()), where
        return
    with tempfile.TemporaryDirectory(prefix="torchtitan-ckpt-") as tmp:
        store = open_store(where, argument, 0, Checkpoint(staging_folder=tmp))
        try:
            group = CheckpointGroup()
            store.reach(group, write=False)
            store.check(group, write=False)
            yield store, store.root
        except (CorruptCheckpointError, CheckpointNotFoundError, NewerVersionError, OlderVersionError) as e:
            restate(e, store.in_user_terms)  # readers name the files they read: the staged copies; errors of the
            raise  # local disk stay as they are
        finally:
            store.close()


# ---------------------------------------------------------------------------------------------
# list


CORRUPT = "corrupt"
NEWER = "newer"
OLDER = "older"
MISNAMED = "misnamed"
CUT_SHORT = "cut_short"
"""`list`'s statuses of a step whose `COMMITTED.json` is there but unreadable (truncated, not
JSON, fields of the wrong shape), written by a newer version or an older one this one does not
read, naming another step than the folder's name, or naming files the folder does not hold at
their size (`commit.cut_short`): never counted as complete or loadable."""
EMPTY = "empty"
"""`list`'s status of an empty step folder (`Store.empty`): one a save left when it stopped
before its first file, which `layout.status_of` tells as unknown (an empty folder has no marker
of ours), whether or not this user may write the folder."""


def _step_record(s: layout.StepFolder, store: Store) -> dict[str, Any] | None:
    """One step of `list --json`; None for one gone since the folder was listed (`_listed`)."""
    if (listed := _listed(s, store)) is None:
        return None
    status, problem, info = listed
    fmt = info.format if info else layout.foreign_format(s.path) if status == layout.FOREIGN else None
    return {"step": s.step, "path": store.describe(s.path), "status": status, "bytes": store.size(s.path),
            "format": fmt, "states": info.states if info else None,
            "world_size": info.world_size if info else None, "linked": s.linked, "problem": problem}


def _listed(s: layout.StepFolder, store: Store) -> tuple[str, str | None, commit.CommitInfo | None] | None:
    """The status `list` gives the step `s`, why (its `problem`) and its commit marker. A marker
    that cannot be read makes the step `corrupt` (`denied` where this user may not read it), its
    reason in `problem` (naming the step as the user does), rather than ending the listing of
    every other step; one gone since the folder was listed is a step removed meanwhile (by the
    retention of a job saving there): None."""
    info, status, problem, where = None, s.status, None, store.describe(s.path)
    if s.committed:
        try:
            info = store.read_marker(s.path)
        except CorruptCheckpointError as e:
            if in_chain(e, lambda cause: isinstance(cause, FileNotFoundError)):  # a store wraps the reader's error
                return None
            status, problem = CORRUPT, str(e)
        except NewerVersionError as e:
            status, problem = NEWER, str(e)
        except OlderVersionError as e:
            status, problem = OLDER, str(e)
        except CheckpointError as e:
            if not in_chain(e, lambda cause: isinstance(cause, PermissionError)):
                raise
            status, problem = layout.DENIED, str(e)
        if info is not None and (wrong := info.misnamed(where, s.step)):
            status, problem = MISNAMED, wrong
        elif info is not None and (cut := commit.cut_short(s.path, info, store.sizes(s.path, info.files))):
            status, problem = CUT_SHORT, store.in_user_terms("; ".join(cut))
    elif status == layout.UNKNOWN and store.empty(s):
        status = EMPTY
    return status, problem, info


def _contents(s: dict[str, Any]) -> str:
    linked = "linked in, never deleted; " if s["linked"] else ""
    return linked + {layout.COMPLETE: f"{s['format']}: {', '.join(s['states'] or ())}",
            layout.PARTIAL: f"no {commit.MARKER}: a save of ours that did not finish; never loaded",
            layout.FOREIGN: f"{s['format']}: not written here; loadable, unverified, never deleted",
            CORRUPT: f"{commit.MARKER} unreadable (list --json: problem): not loadable, a load() of it fails",
            NEWER: "written by a newer torchtitan_ckpt (list --json: problem): a load() of it fails; read it "
                   "with that one",
            OLDER: "written by an older torchtitan_ckpt this one does not read (list --json: problem): a load() of "
                   "it fails; resume from it with that one",
            MISNAMED: f"{commit.MARKER} names another step (list --json: problem): renamed, or copied in under "
                      "another step's name; a load() passes it over",
            CUT_SHORT: f"files {commit.MARKER} names are missing or shorter (list --json: problem): a copy cut "
                       "short; a load() passes it over",
            layout.DENIED: "this user may not look into it: never loaded, replaced or deleted; a load() that "
                           "would pick it fails",
            EMPTY: "a save that stopped (or is starting) before its first file, ours or another program's: never "
                   "loaded; a save of its step replaces it, clean keeps it",
            }.get(s["status"], "not ours (no marker of ours, or one that is no file), not told finished: "
                               "never loaded from the run folder, never deleted")


def _newest(steps: list[dict[str, Any]], *statuses: str) -> int | None:
    return max((s["step"] for s in steps if s["status"] in statuses), default=None)


def cmd_list(args: argparse.Namespace, progress: Progress) -> int:
    """Exit status 1 when no step is loadable (`latest_loadable` is null): a folder of foreign
    steps alone is one `load()` resumes from."""
    if scheme_of(args.folder) is None:
        _require_folder(args.folder)
    with _opened(args.folder, "folder") as (store, folder):
        steps = [r for s in store.scan(folder) if (r := _step_record(s, store)) is not None]
    loadable = _newest(steps, layout.COMPLETE, layout.FOREIGN)
    if args.json:
        _print_json({"folder": args.folder, "latest_complete": _newest(steps, layout.COMPLETE),
                     "latest_loadable": loadable, "steps": steps})
    elif not steps:
        local = scheme_of(args.folder) is None
        step = layout.step_folder_around(args.folder) if local else None
        print(printable(f"{args.folder}: no step folders" + (
            f"; it {layout.in_step(args.folder, step)}: list {os.path.dirname(step)}, the folder holding the "
            "step-N folders" if step else _where_steps_are(args.folder) if local else "")))
    else:
        print(f"{'step':>8}  {'status':<10}  {'size':>10}  contents")
        for s in steps:
            print(f"{s['step']:>8}  {s['status']:<10}  {fmt_bytes(s['bytes']):>10}  {printable(_contents(s))}")
    return EXIT_OK if loadable is not None else EXIT_FAILED


# ---------------------------------------------------------------------------------------------
# inspect


KNOWN_STATES = (*BUILTIN_STATES, "train_state")
"""The states a step without our commit marker is read as holding: the manager's own, and the
`train_state` TorchTitan's trainer registers. A key's first segment names its state only if it
is one of these; the rest is the model's (its keys are at the top level: `layers`, `norm`, ...)."""


def _state_of(key: str, states: Collection[str]) -> str:
    head = key.split(".", 1)[0]
    return head if head in states else "model"


def _describe(store: Store, path: str, where: str, listed: str | None) -> dict[str, Any]:
    """The `inspect --json` document of the step folder `path` of `store` (`where` as the user
    named it), its status `listed` (`_opened_step`) or else `layout.status_of`'s, or the one
    `list` gives a step misnamed or cut short (`_listed`). Its states are the commit
    marker's; without a marker (or with one left in a folder another program has since written
    over: foreign), the `KNOWN_STATES` its keys show."""
    ours = commit.is_committed(path) and (listed or layout.status_of(path)) != layout.FOREIGN
    info = commit.read_marker(path) if ours else None
    fmt = info.format if info else layout.foreign_format(path)
    if fmt is None:
        hint = (_where_steps_are(path) if scheme_of(where) is None else "") or "; name a step folder"
        raise CheckpointNotFoundError(f"{where} holds no checkpoint: " + ", ".join(
            f"no {' or '.join(f.index_files)} ({f.title})" for f in FORMATS.values()) + hint)
    if fmt not in FORMATS:
        raise CorruptCheckpointError(f"{where}: its {commit.MARKER} names the format {fmt!r}; inspect reads "
                                     f"{', '.join(FORMATS)}")
    if not FORMATS[fmt].holds(path):
        raise CheckpointNotFoundError(f"{where} is not a {FORMATS[fmt].title} checkpoint folder (no "
                                      f"{' or '.join(FORMATS[fmt].index_files)})")
    states = info.states if info else KNOWN_STATES
    held, values = FORMATS[fmt].contents(path)
    tensors = [{"key": key, "state": _state_of(key, states), "dtype": str(dtype).removeprefix("torch."),
                "shape": list(shape), "bytes": math.prod(shape) * dtype.itemsize} for key, dtype, shape in held]
    objects = [{"key": key, "state": _state_of(key, states)} for key in values]
    found = {e["state"] for e in tensors + objects}
    status = listed or layout.status_of(path)
    named = layout.parse_step(os.path.basename(where.rstrip("/")))
    if info is not None and named is not None and info.misnamed(where, named):
        status = MISNAMED
    elif info is not None and status == layout.COMPLETE and commit.cut_short(path, info,
                                                                             store.sizes(path, info.files)):
        status = CUT_SHORT
    return {"path": where, "status": status, "step": info.step if info else None,
            "format": fmt, "world_size": info.world_size if info else None,
            "states": info.states if info else [name for name in KNOWN_STATES if name in found],
            "tensor_bytes": sum(t["bytes"] for t in tensors), "tensors": tensors, "objects": objects}


def _print_inspect(doc: dict[str, Any]) -> None:
    status = (f"complete, step {doc['step']}, saved by {counted(doc['world_size'], 'rank')}"
              if doc["status"] == layout.COMPLETE else
              f"misnamed: it holds step {doc['step']}, saved by {counted(doc['world_size'], 'rank')}"
              if doc["status"] == MISNAMED else
              f"cut short: files its {commit.MARKER} names are missing or shorter (verify names them); step "
              f"{doc['step']}, saved by {counted(doc['world_size'], 'rank')}"
              if doc["status"] == CUT_SHORT else f"{doc['status']}, no commit marker")
    print(printable(f"{doc['path']}: {status} ({doc['format']})"))
    for state in dict.fromkeys([*doc["states"], "model"]):
        tensors = [t for t in doc["tensors"] if t["state"] == state]
        objects = [o for o in doc["objects"] if o["state"] == state]
        if not tensors and not objects:
            continue
        print(f"\n[{shown(state)}]")
        for t in tensors:
            print(f"  {shown(t['key']):<60} {t['dtype']:<9} {str(t['shape']):<16} {fmt_bytes(t['bytes']):>10}")
        for o in objects:
            print(f"  {shown(o['key']):<60} {'object':<9}")
        total = sum(t["bytes"] for t in tensors)
        print(f"  {'total tensor bytes':<60} {'':<9} {'':<16} {fmt_bytes(total):>10}")


@contextlib.contextmanager
def _opened_step(where: str) -> Iterator[tuple[Store, str, str | None]]:
    """`_opened` for the one step folder `where` names, and the status `list` gives it. An
    object-store step (`URL/step-N`) is opened through the folder above it, whose store's `scan`
    tells its status as `list` does (by its markers alone); for a path, or a folder not named
    `step-N`, the status is None: `layout.status_of` (the local store's scan) tells it once its
    files are fetched."""
    parent, _, name = where.rstrip("/").rpartition("/")
    step = layout.parse_step(name)
    if step is None or scheme_of(where) is None or scheme_of(parent) is None:
        with _opened(where, "step_dir") as (store, path):
            yield store, path, None
        return
    check_url("step_dir", where)  # a URL it refuses is named as given
    with _opened(parent, "step_dir") as (store, folder):
        listed = [s.status for s in store.scan(folder) if s.step == step]
        yield store, layout.step_dir(folder, step), listed[0] if listed else None


def _fetch_described(store: Store, path: str) -> str:
    """Make what `inspect` reads of the step at `path` readable there: the files that tell its
    status (`layout.TELLING`: markers, DCP's `.metadata`, a Hugging Face `model.safetensors`);
    with a Hugging Face index and no `.metadata`, the whole step, since the names and sizes of
    its tensors are in the headers of the data files the index names. A folder holding none of
    them (a run's folder, not a step's) is not downloaded."""
    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(path, name))

    store.fetch(path, layout.TELLING)
    return store.fetch(path) if has(INDEX_FILE) and not has(METADATA_FILE) else path


def cmd_inspect(args: argparse.Namespace, progress: Progress) -> int:
    if scheme_of(args.step_dir) is None:
        _require_folder(args.step_dir)
    with _opened_step(args.step_dir) as (store, path, listed):
        doc = _describe(store, _fetch_described(store, path), args.step_dir, listed)
    if args.json:
        _print_json(doc)
    else:
        _print_inspect(doc)
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# verify


def _verify_files(path: str, info: commit.CommitInfo, threads: int, progress: Progress) -> list[dict[str, Any]]:
    """One record per manifest file, checked `threads` at a time, reporting bytes as they are
    read; then one per file in the folder the manifest does not list (added after the commit)."""
    names = sorted(info.files)
    found = commit.check_files(path, info, names, threads, lambda n: progress("verifying", n, info.total_bytes))
    listed = [{"file": rel, "bytes": info.files[rel]["size"], "crc32": info.files[rel]["crc32"], "ok": problem is None,
               "problem": problem} for rel, problem in zip(names, found)]
    unlisted = sorted(set(commit.files_in(path)) - set(info.files))
    return listed + [{"file": rel, "bytes": None, "crc32": None, "ok": False,
                      "problem": f"{os.path.join(path, rel)}: not in the manifest of {commit.MARKER} (added after "
                                 "the commit?)"} for rel in unlisted]


def cmd_verify(args: argparse.Namespace, progress: Progress) -> int:
    """An object-store step is downloaded into a temporary folder (under TMPDIR), then checked."""
    if scheme_of(args.step_dir) is None:
        _require_folder(args.step_dir)
    with _opened(args.step_dir, "step_dir") as (store, local):
        path = args.step_dir
        info, damaged = None, None
        try:  # a store refuses to fetch a marker too big for its reader
            fetched = store.fetch(local, [commit.MARKER])
        except CorruptCheckpointError as e:
            fetched, damaged = local, e
        if damaged is None and not commit.is_committed(fetched):
            raise CheckpointNotFoundError(f"{path} has no {commit.MARKER}: not a complete step"
                                          + (_where_steps_are(path) if scheme_of(path) is None else ""))
        if damaged is None and scheme_of(path) is None and layout.status_of(local) == layout.FOREIGN:
            raise CheckpointNotFoundError(f"{path} holds another program's step, written over a step of ours (its "
                                          f".metadata names another save than its {commit.IN_PROGRESS}): its "
                                          f"{commit.MARKER} does not describe its files, which cannot be verified")
        if damaged is None:
            store.fetch(local)
            try:
                info = store.read_marker(local)
            except CorruptCheckpointError as e:
                damaged = e
        if damaged is not None:  # a damaged step, as a damaged file of it is; another version's marker: exit 2
            files = [{"file": commit.MARKER, "bytes": None, "crc32": None, "ok": False,
                      "problem": store.in_user_terms(str(damaged))}]
        if info is not None:
            with progress:
                files = [{**f, "problem": f["problem"] and store.in_user_terms(f["problem"])}
                         for f in _verify_files(local, info, args.threads, progress)]
    failed = [f for f in files if not f["ok"]]
    if failed and scheme_of(path) is None and not commit.is_committed(local):
        raise CheckpointNotFoundError(f"{path} was removed while it was verified (by the retention of a job "
                                      "saving there?): its files were not all there to check")
    if args.json:
        _print_json({"path": path, "step": info and info.step, "ok": not failed, "bytes": info and info.total_bytes,
                     "failed": len(failed), "files": files})
    else:
        for f in files:
            if not f["ok"]:
                print(f"CORRUPT {printable(f['problem'])}")
            elif args.verbose:
                print(f"ok      {printable(os.path.join(path, f['file']))}")
        if info is not None and not failed:
            print(f"{path}: {len(files)} files, {fmt_bytes(info.total_bytes)}, all intact")
        else:
            print(f"{path}: {len(failed)} of {len(files)} files failed the check")
    return EXIT_FAILED if failed else EXIT_OK


# ---------------------------------------------------------------------------------------------
# clean


def cmd_clean(args: argparse.Namespace, progress: Progress) -> int:
    """Refused while a job of this package saves into the folder (it holds it: `_no_job_saving`),
    as its save in flight looks partial too (another program's job is not seen). Only folders
    this package started writing are removed; another program's are listed and kept (an empty
    one too: another program's save makes its folder before its files), and so is a step folder
    that is a symlink. A local folder only: on object storage a save's retention deletes the
    partial steps before it."""
    if scheme_of(args.folder) is not None:
        raise CheckpointError(f"{args.folder}: clean works on a local folder; on object storage the next save's "
                              "retention deletes the partial steps older than it (docs/storage.md)")
    _require_folder(args.folder)
    if step := layout.step_folder_around(args.folder):
        raise CheckpointError(f"{args.folder} {layout.in_step(args.folder, step)}: clean works on the folder holding "
                              f"the step-N folders ({os.path.dirname(step)})")
    if os.statvfs(args.folder).f_flag & os.ST_RDONLY:  # a snapshot, a read-only export: nothing to hold or remove
        partial = [s for s in layout.scan(args.folder) if s.status == layout.PARTIAL and not s.linked]
        raise CheckpointError(f"{args.folder} is on a read-only file system: clean removes nothing there "
                              f"({counted(len(partial), 'partial step folder')}; clean it where it is mounted "
                              "writable)")
    with _no_job_saving(args.folder, args.force):  # a job's hf_export_interval copies: it holds their folder too
        steps, store = layout.scan(args.folder), open_store(args.folder, "folder", 0, Checkpoint())
        for s in steps:  # every folder kept but a healthy step of ours, by its status in `list`
            if (s.status != layout.PARTIAL or s.linked) and (listed := _listed(s, store)) is not None \
                    and (listed[0] != layout.COMPLETE or s.linked):
                print(f"kept {s.path} ({listed[0]}{', linked in' if s.linked else ''}: not removed by clean)")
        sizes = {s.path: layout.folder_bytes(s.path) for s in steps if s.status == layout.PARTIAL and not s.linked}
        total = sum(sizes.values())
        removed, freed, code = 0, 0, EXIT_OK
        with progress:
            for path, size in sizes.items():
                done = [0]  # what a removal that fails midway freed

                def gone(nbytes: int) -> None:
                    done[0] += nbytes
                    progress("removing", nbytes, total)

                if layout.linked_in(path) or layout.status_of(path) != layout.PARTIAL:  # a job finished it since
                    print(f"kept {path} (no longer partial: a job is writing there?)")
                    continue
                try:
                    commit.remove_step(path, gone)
                except (CheckpointError, OSError) as e:  # files appeared, permissions: the others are still cleaned
                    why = safe_open.removal_refused(path, e) if isinstance(e, PermissionError) else e
                    problem = str(e) if isinstance(e, CheckpointError) else f"{path} could not be removed: {why}"
                    print(f"error: {printable(problem)}", file=sys.stderr)
                    code, freed = EXIT_FAILED, freed + done[0]
                    continue
                removed, freed = removed + 1, freed + size
                print(f"removed {path} (partial)")
        print(f"{counted(removed, 'partial step folder')} removed, {fmt_bytes(freed)}")
        return code


@contextlib.contextmanager
def _no_job_saving(folder: str, force: bool) -> Iterator[None]:
    """Hold `folder` as a job saving there does (`storage.local.LOCK_FILE`, where a job of this
    package has saved), for the duration of the block: a job's save in flight is partial too.
    Where the file system cannot lock it, refused unless `force` (where its locks hold only on
    each node, a job on another node is not seen)."""
    held = os.path.join(folder, LOCK_FILE)
    if not os.path.lexists(held):  # no job of ours has saved here
        yield
        return
    key, _ = lock.claim(held, f"{folder} to save into", "clean removes partial steps, and that job's save in flight "
                        "is one: run it once the job has ended", named=False)
    try:
        if not lock.held(key) and not force:
            raise CheckpointError(f"{folder}: its file system did not lock {held}, so a job saving there now (on "
                                  "another node, say) cannot be told from none, and its save in flight would be "
                                  "removed as partial; once no job saves there, run clean --force")
        yield
    finally:
        lock.release(key)


# ---------------------------------------------------------------------------------------------
# convert and consolidate: collective under torchrun, output staged under a temporary name


def _check_output(dst: str) -> None:
    """Refuse, before any work, an output folder the command cannot write: a URL (convert and
    consolidate write local files and upload nothing), a path to something else than a folder
    (the finished output could not be renamed to it), or one inside a step folder."""
    if scheme_of(dst) is not None:
        raise CheckpointError(f"{dst}: OUT_DIR must be a local folder (this command uploads nothing); write "
                              "a local folder, then upload it with your own tool")
    if os.path.islink(dst):
        raise CheckpointError(f"{dst} is a link; name the folder itself ({os.path.realpath(dst)})")
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise CheckpointError(f"{dst} exists and is not a folder; remove it or name a new folder")
    if step := layout.step_folder_around(dst):
        raise CheckpointError(f"{dst} {layout.in_step(dst, step)}; name a folder outside it")
    if os.path.ismount(dst) and not os.listdir(dst):
        raise CheckpointError(f"{dst} is an empty mount point: a new output is written beside it under a temporary "
                              "name, then renamed over it, which a mount point cannot be; name a folder inside it")


@contextlib.contextmanager
def _staged(dst: str) -> Iterator[str]:
    """The folder to write: a `dst` that exists is written in place (its format's last-written
    file marks it complete); a new one is written as `dst.partial`, renamed to `dst` by rank 0
    once the work returned on every rank, and removed on failure (of the rename too) or Ctrl-C."""
    if os.path.isdir(dst) and os.listdir(dst):
        yield dst
        return
    if os.path.isdir(dst) and (why := safe_open.unlink_denied(dst)) is not None:  # refused now, not after the work
        raise CheckpointError(f"{dst} is an empty folder this user may not replace, as the finished output replaces "
                              f"it: {why}; remove it, or name another output folder")
    tmp = dst.rstrip(os.sep) + PARTIAL_SUFFIX
    rank0 = this_rank_draws()
    held: list[int | None] = []  # rank 0's lock of `tmp`, until it is renamed or removed
    try:
        CheckpointGroup().run(lambda: held.append(_new_partial(tmp)), coordinator_only=True)
    except BaseException as e:  # a full disk, Ctrl-C or a signal while it was made
        if rank0 and not held and _left_by_us(tmp) and not _held_elsewhere(tmp):  # not another run's
            _removed(tmp)
        if isinstance(e, RankFailed):
            e.reraise(f"preparing {tmp}")
        raise
    try:
        yield tmp
        if rank0:
            if commit.is_in_progress(tmp):  # a folder of the user's now, not a save of ours
                os.remove(os.path.join(tmp, commit.IN_PROGRESS))
            if os.path.isdir(dst):
                os.rmdir(dst)
            os.rename(tmp, dst)
            durable.fsync_path(os.path.dirname(os.path.abspath(dst)))  # the output's name survives a crash
    except BaseException:
        if rank0:
            _removed(tmp)
        raise
    finally:
        for fd in filter(None, held):
            os.close(fd)


def _removed(tmp: str) -> None:
    """Remove the unfinished output `tmp`, the job's signals held until it is gone: a second
    Ctrl-C, or the SIGTERM torchrun sends right after the SIGINT it passes on, stopped the
    removal part-way and left it. A signal held is raised once it is removed (on the main thread,
    where handlers are set; elsewhere the removal is not held)."""
    got: list[int] = []
    held = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) is not None:  # None: a handler set outside Python, left as it is
                held[signum] = signal.signal(signum, lambda signum, _frame: got.append(signum))
    try:
        shutil.rmtree(tmp, ignore_errors=True)
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)
        if got:
            signal.raise_signal(got[0])


def _new_partial(tmp: str) -> int | None:
    """Make `tmp` afresh, marked in progress as a step folder being written is (so a later run
    knows it for ours, and a DCP output's commit leaves the mark out of its manifest), and locked
    (`flock`) while this run writes it: returns the descriptor holding the lock (None where the
    file system locks no folder). One an interrupted run left (`_left_by_us`) is removed first;
    one a run still writes (its lock held), or anything else by that name (a user's folder, a
    link), is left alone and refused."""
    if os.path.lexists(tmp):
        if not _left_by_us(tmp):
            raise CheckpointError(f"{tmp} exists and was not left by an interrupted run of this command; "
                                  "it is never removed: move it away or name another output")
        if (fd := _locked(tmp)) is None and _held_elsewhere(tmp):
            raise CheckpointError(f"{tmp} is being written by another run of this command now; wait for it to "
                                  "end, or name another output folder")
        if fd is not None:
            os.close(fd)
        shutil.rmtree(tmp)
    durable.make_dir(tmp)
    fd = _locked(tmp)
    try:
        commit.mark_in_progress(tmp)
    except BaseException:  # a full disk, a signal: let go, for the caller to remove it
        if fd is not None:
            os.close(fd)
        raise
    return fd


def _locked(folder: str) -> int | None:
    """A descriptor of `folder` holding an exclusive `flock` on it, or None where another holds
    one or the file system locks no folder (NFS emulates `flock` with locks of files)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _held_elsewhere(folder: str) -> bool:
    """Whether another run holds `folder` locked (`_locked`); False also where the file system
    locks no folder."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def _left_by_us(tmp: str) -> bool:
    """Whether `tmp` is a folder a run of this command made: marked in progress, or stopped while
    marking it (`layout.PARTIAL`), or empty (stopped before)."""
    return not os.path.islink(tmp) and os.path.isdir(tmp) and (
        not os.listdir(tmp) or layout.status_of(tmp) == layout.PARTIAL)


def cmd_convert(args: argparse.Namespace, progress: Progress) -> int:
    export = _export_options(args)
    _check_output(args.dst)
    if os.path.isdir(args.dst) and os.listdir(args.dst):
        raise CheckpointError(f"{args.dst} exists and is not empty; remove it or name a new folder")
    if scheme_of(args.src) is None:
        _require_folder(args.src)
    with launched_group(), _opened(args.src, "src") as (store, src):
        local = store.fetch(src)
        if args.to == "hf":
            _check_exportable(local, args.src)
        with _staged(args.dst) as out, progress:
            convert(args.to, local, out, args.adapter, hf_assets_path=args.hf_assets, progress=progress,
                    rope_layout=args.rope_layout, **export)
    if this_rank_draws():
        print(f"converted {args.src} -> {args.dst} ({args.to})")
    return EXIT_OK


def _export_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options given to `convert` of those of an HF export and `--threads` (the others take
    `convert`'s defaults); an export's with `--to dcp`, which writes the tensors as they are, a
    `ValueError` naming them."""
    given = {option: value for option, value in (("dtype", args.dtype), ("max_shard_size", args.max_shard_size),
                                                  ("consolidation", args.consolidation)) if value is not None}
    if given and args.to == "dcp":
        raise ValueError(f"{', '.join('--' + o.replace('_', '-') for o in given)}: an option of an HF export "
                         "(--to hf); --to dcp writes the tensors as the HF folder holds them")
    return given if args.threads is None else {**given, "threads": args.threads}


def _check_exportable(path: str, shown: str) -> None:
    """Refuse a step no load would take: a partial one (its save did not finish) or one whose
    commit marker is damaged or another version's. Its files are not checksummed here (`verify`
    does that)."""
    status = layout.status_of(path)
    if status == layout.PARTIAL:
        raise CheckpointError(f"{shown} is a partial step (its save did not finish, or is still being written); "
                              "convert a complete one (`torchtitan-ckpt list` shows them)")
    if status == layout.COMPLETE:
        commit.read_marker(path)


def cmd_consolidate(args: argparse.Namespace, progress: Progress) -> int:
    if scheme_of(args.input_dir) is not None:
        raise CheckpointError(f"{args.input_dir}: IN_DIR must be a local folder (consolidate reads local shard files)")
    _check_output(args.output_dir)
    mapping = load_mapping(args.mapping) if args.mapping else None
    same = os.path.abspath(args.input_dir) == os.path.abspath(args.output_dir)
    with launched_group(), (contextlib.nullcontext(args.output_dir) if same else _staged(args.output_dir)) as out, \
            progress:
        consolidate_safetensors(args.input_dir, out, mapping, num_threads=args.num_threads,
                                remove_shards=args.remove_shards, progress=progress.phase("writing"))
    if this_rank_draws():
        print(f"wrote {os.path.join(args.output_dir, INDEX_FILE)}")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# The parser


def _common_options(json_output: bool = False) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    loud = common.add_mutually_exclusive_group()
    loud.add_argument("-q", "--quiet", action="store_true", help="no progress and no log lines; results and errors only")
    loud.add_argument("-v", "--verbose", action="store_true", help="debug log lines (verify: every file checked)")
    common.add_argument("--progress-every", type=_seconds, default=DEFAULT_INTERVAL, metavar="SECONDS",
                        help="seconds between progress lines when stderr is not a terminal (default %(default)s)")
    if json_output:
        common.add_argument("--json", action="store_true", help="print one JSON document on stdout (see docs/cli.md)")
    return common


def _seconds(text: str) -> float:
    """A finite number of seconds, 0 or more, from the command line (0: a line per update)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds, 0 or more")
    return value


def _size(text: str) -> str:
    """A byte count as `hf_max_shard_size` takes it ("5GB", "500MB"), checked now."""
    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _threads(text: str) -> int:
    """A thread count from the command line, within the config's bound."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"threads = {text!r}: expected an integer") from None
    if not 1 <= value <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"threads = {value}: expected 1 to {MAX_THREADS}")
    return value


def _add(sub: Any, name: str, run: Any, help: str, json_output: bool = False) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help, parents=[_common_options(json_output)], epilog=EXIT_CODES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(run=run)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchtitan-ckpt", description=__doc__.split("\n\n")[0],
                                     epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add(sub, "list", cmd_list, "list the step folders of a checkpoint folder", True).add_argument("folder")
    _add(sub, "inspect", cmd_inspect, "show what one step folder holds", True).add_argument("step_dir")
    p = _add(sub, "verify", cmd_verify, "check a step's files against its commit manifest", True)
    p.add_argument("step_dir")
    p.add_argument("--threads", type=_threads, default=IO_THREADS, help="files checked at once")
    p = _add(sub, "clean", cmd_clean, "remove partial step folders (refused while a job saves there)")
    p.add_argument("folder")
    p.add_argument("--force", action="store_true",
                   help="clean where the file system cannot lock the folder (no job may be saving there)")
    _add_convert(sub)
    _add_consolidate(sub)
    return parser


def _add_convert(sub: Any) -> None:
    p = _add(sub, "convert", cmd_convert, "convert a model between DCP and Hugging Face format "
             "(on every rank under torchrun); a new DST is written as DST.partial and renamed when done")
    p.add_argument("--to", required=True, choices=("hf", "dcp"), help="the format to write")
    p.add_argument("src", help="a DCP step folder (--to hf) or an HF folder (--to dcp)")
    p.add_argument("dst", help="the local folder to write (new or empty; not a URL)")
    p.add_argument("--adapter", choices=sorted(ADAPTERS), help="the model family; default: config.json's model_type")
    p.add_argument("--rope-layout", choices=ROPE_LAYOUTS,
                   help="the channels the DCP model's RoPE rotates together: interleaved pairs (TorchTitan's "
                        "Llama 3) or halves (HF's, TorchTitan's Qwen3); default: --to dcp TorchTitan's for the "
                        "family, --to hf the one the step records (a Qwen3 step that records none needs it)")
    p.add_argument("--hf-assets", help="HF folder whose config.json (and file split) gives the model; default: the HF source (--to dcp) or the config the DCP step recorded (--to hf)")
    # None when not given: --to dcp refuses the options of an HF export (`_export_options`)
    p.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), help="cast floating tensors of an HF export")
    p.add_argument("--max-shard-size", type=_size,
                   help=f"largest HF file when there is no assets index (default {Checkpoint.hf_max_shard_size})")
    p.add_argument("--consolidation", choices=MODES,
                   help=f"how the HF files are written (see checkpoint.consolidation; default {Checkpoint.consolidation})")
    p.add_argument("--threads", type=_threads, help=f"I/O threads per rank for the HF files, read (--to dcp) or "
                   f"written (--to hf) (default {IO_THREADS})")


def _add_consolidate(sub: Any) -> None:
    p = _add(sub, "consolidate", cmd_consolidate, "turn the shard files DCP's HuggingFaceStorageWriter wrote "
             "with save_distributed=True into final safetensors files (on every rank under torchrun)")
    p.add_argument("input_dir", metavar="IN_DIR")
    p.add_argument("output_dir", metavar="OUT_DIR")
    p.add_argument("--mapping", help="JSON file: {fqn: file index} or an HF index whose weight_map names the files")
    p.add_argument("--num-threads", type=_threads, default=IO_THREADS, help="copy threads per rank (default %(default)s)")
    p.add_argument("--remove-shards", action="store_true", help="delete the input shard files after success "
                   "(they are kept by default)")


# ---------------------------------------------------------------------------------------------
# Running a command with Unix manners


def _setup_logging(args: argparse.Namespace) -> None:
    """Log lines on stderr (rank 0 only under torchrun), unless the host process set up logging."""
    root = logging.getLogger()
    if root.handlers:
        return
    rank = launched_rank()
    level = logging.WARNING if args.quiet or rank != 0 else logging.INFO
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"[rank{rank}] %(asctime)s %(name)s %(levelname)s: %(message)s")
    if args.verbose:
        logging.getLogger(__package__).setLevel(logging.DEBUG)
    else:  # its INFO lines ("Found credentials in environment variables.") say nothing of the command
        logging.getLogger("botocore").setLevel(logging.WARNING)


class _StdoutFailed(Exception):
    """Writing stdout failed otherwise than by its reader going away (a full disk under
    `> file`, `> /dev/full`): not the command's own failure, which a status of its own tells."""


class _Stdout:
    """`sys.stdout` while a command runs: a failure to write it raised as `_StdoutFailed`, so
    that it is not taken for a failure of the command's output folder (its disk full)."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._guarded(self._stream.write, text)

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    @staticmethod
    def _guarded(call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _StdoutFailed(e.strerror or str(e)) from e

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _stdout_closed() -> int:
    """stdout's reader went away: send what is left to /dev/null so that the flush at exit does
    not raise again, and end with the status a shell gives a command killed by SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_PIPE


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (`timeout`, a scheduler, a closed terminal), raised as Ctrl-C is, so the
    command cleans up as it does after one (a half-written output, a downloaded step)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    def __reduce__(self) -> tuple:  # DCP pickles a rank's failure to hand it to the others
        return _Terminated, (self.signum,)


_STOPPED_BY: list[int] = []
"""The signals that stopped the command run now, in order (`_on_termination`)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    _STOPPED_BY.append(signum)
    raise _Terminated(signum)


def _raise_interrupted(signum: int, frame: Any) -> None:
    _STOPPED_BY.append(signum)
    raise KeyboardInterrupt


def _interruption(signum: int) -> KeyboardInterrupt:
    return KeyboardInterrupt() if signum == signal.SIGINT else _Terminated(signum)


@contextlib.contextmanager
def _on_termination() -> Iterator[None]:
    """Raise `_Terminated` on SIGTERM and SIGHUP while the command runs, unless the host process
    handles them (a caller's own handler, or `main` called off the main thread); SIGINT, left to
    Python's handler, is counted too (`_STOPPED_BY`)."""
    taken = {}
    _STOPPED_BY.clear()
    if threading.current_thread() is threading.main_thread():
        for signum, was, handler in ((signal.SIGTERM, signal.SIG_DFL, _raise_terminated),
                                     (signal.SIGHUP, signal.SIG_DFL, _raise_terminated),
                                     (signal.SIGINT, signal.default_int_handler, _raise_interrupted)):
            if signal.getsignal(signum) is was:
                signal.signal(signum, handler)
                taken[signum] = was
    try:
        yield
    finally:
        for signum, was in taken.items():
            signal.signal(signum, was)


def main(argv: list[str] | None = None) -> int:
    if sys.stdout is None:  # started with it closed (`>&-`): nothing could be said
        return EXIT_PIPE
    if sys.stderr is None:  # errors would go to stdout: they go nowhere, the status says it
        sys.stderr = open(os.devnull, "w")
    args = build_parser().parse_args(argv)
    _setup_logging(args)
    with _on_termination():
        return _run(args)


def entry() -> NoReturn:
    """The `torchtitan-ckpt` command: `main` with `sys.argv`, ended by `group.leave` (under
    torchrun, `convert` and `consolidate` run collectives over gloo)."""
    leave(main())


def _run(args: argparse.Namespace) -> int:
    stdout, sys.stdout = sys.stdout, _Stdout(sys.stdout)
    try:
        return _run_command(args)
    finally:
        sys.stdout = stdout


def _run_command(args: argparse.Namespace) -> int:
    progress = Progress(args.command, enabled=not args.quiet and this_rank_draws(), interval=args.progress_every)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", storage.SINGLE_PROCESS_WARNING, UserWarning)
            code = args.run(args, progress)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except _StdoutFailed as e:
        print(f"error: stdout could not be written ({e}): {args.command} stopped there", file=sys.stderr)
        _stdout_closed()  # the rest goes nowhere: the flush at exit does not fail again
        return EXIT_STDOUT
    except (CheckpointError, OSError, ValueError) as e:
        full = _full(args, e)
        said = str(e)
        if isinstance(e, PermissionError) and isinstance(e.filename, str):  # whom to ask, as the library's own say
            said = f"{safe_open.denied(e.filename, e.strerror)}; ask its owner for access"
        print(f"error: {printable(said)}{full}", file=sys.stderr)
        return EXIT_FAILED if full else EXIT_INPUT
    except (KeyboardInterrupt, CheckpointException, RuntimeError) as e:  # DCP wraps a Ctrl-C in its own exception
        if isinstance(e, RuntimeError) and not _STOPPED_BY:
            raise
        cause = storage.root_cause(e)
        if not isinstance(cause, KeyboardInterrupt) and _STOPPED_BY:  # a signal's interrupt made another error
            cause = _interruption(_STOPPED_BY[0])  # on its way (a second signal in `Condition.wait`: its lock)
        if not isinstance(cause, KeyboardInterrupt):
            full = _full(args, cause)
            print(f"error: {type(cause).__name__}: {printable(str(cause))}{full}", file=sys.stderr)
            return EXIT_FAILED if full else EXIT_INPUT
        print(f"torchtitan-ckpt {args.command}: interrupted", file=sys.stderr)
        return 128 + cause.signum if isinstance(cause, _Terminated) else EXIT_INTERRUPTED


def _full(args: argparse.Namespace, error: BaseException) -> str:
    """What to say of a failure of `convert` or `consolidate` that a full file system caused
    (its errno, or its cause's): a failure of the machine's, not of the input (exit 1), and
    what to do; "" for any other failure, or command (whose exit 1 means a damaged step)."""
    out = getattr(args, "dst", None) or getattr(args, "output_dir", None)
    full = in_chain(error, lambda e: getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT))
    if out is None or full is None:
        return ""
    named = getattr(full, "filename", None)
    where = os.path.dirname(os.path.abspath(named)) if isinstance(named, str) else out
    try:
        fs = os.statvfs(where if os.path.exists(where) else os.path.dirname(os.path.abspath(where)))
    except OSError:
        return " (a file system is full: free space and run it again)"
    return (f" (the file system holding {printable(where)} is full: {fs.f_bavail * fs.f_frsize} bytes free now, "
            "after the failure; free space and run it again)")


if __name__ == "__main__":
    entry()
