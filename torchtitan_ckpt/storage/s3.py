"""Object storage through the S3 API (AWS S3, MinIO, Ceph RGW, any S3-compatible endpoint), with
boto3 (the `s3` extra: `pip install 'torchtitan_ckpt[s3]'`).

An object store has no rename and no fsync, so a step commits by the order of its objects:

1. rank 0 puts `step-N/IN_PROGRESS.json` (the step is ours, and partial), naming this save, and
   aborts the unfinished uploads a killed save left there;
2. each rank writes its files into its own local staging folder with the usual engine, then
   uploads them (multipart, `upload_parallel_parts` parts of `upload_part_size` in flight at
   most: the bytes held per rank), computing each file's CRC-32 from the bytes it uploads and
   checking it against the writer's; each part carries its own CRC-32, which the server checks
   (an upload declares CRC-32, so the server keeps a composite of the parts' checksums rather
   than computing a whole-object one when the upload completes);
3. once every rank's uploads are complete, rank 0 checks that the in-progress marker is still
   this save's (another job saving into the URL would have replaced it), puts
   `step-N/COMMITTED.json` with every file's size and CRC-32, then deletes the in-progress marker.

A Hugging Face export's safetensors files are written jointly (each rank its own bytes at their
final offsets): each rank's staged copy holds its bytes and holes elsewhere, and file i is
assembled part by part onto rank i % world_size, to which every other rank sends only the
stretches that hold data in its copy, and uploaded from there; the index goes up once every
rank's other files are in the store.

Discovery lists the markers; a step without `COMMITTED.json` is never loaded; retention marks a
step in progress, then deletes its commit marker, its data, and the in-progress marker last.
What a listing or a download answers is checked before it is used (sizes, continuation tokens,
the length of each ranged read), as are the byte ranges a step's metadata asks for.

Endpoint, region and credentials come from boto3's standard chain (`AWS_ENDPOINT_URL`,
`AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_PROFILE`, ...) and are never logged.
Throttling, 5xx, reset connections and silences longer than `storage_timeout_s` are retried by
botocore's `standard` mode with exponential backoff, `storage_retries` times, then fail the save
on every rank.
"""

from __future__ import annotations

import base64
import collections
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict
from typing import Any
from urllib.parse import quote

import torch
import torch.distributed as dist

from .. import commit, faults, layout
from ..config import Checkpoint
from ..dcp.metadata import MAX_METADATA_BYTES, METADATA_FILE
from ..errors import (CheckpointError, CheckpointNotFoundError, ConfigError, CorruptCheckpointError, NewerVersionError,
                      OlderVersionError, RankFailed, StorageError, in_chain)
from ..group import CheckpointGroup
from ..hf.files import INDEX_FILE, MAX_INDEX_BYTES, MAX_RECORDED_LAYOUT_BYTES, RECORDED_LAYOUT
from ..hf.planner import parse_size
from ..io import durable, posio, safe_open
from ..io.checksum import crc32, hex_crc
from ..io.untrusted import brief
from ..progress import fmt_bytes, gb_per_s
from . import lock
from .base import Store, warn_replacing

logger = logging.getLogger(__name__)

_MARKERS = (commit.MARKER, commit.IN_PROGRESS)

MAX_EMPTY_PAGES = 100
"""Listing pages in a row without an object, each saying more follow, taken before the listing
is refused as one that would never end (S3 may answer a few such pages; a server answering
them with fresh tokens forever made a load list without end)."""
MAX_OBJECT_BYTES = 1 << 46
"""64 TiB: above the largest object S3 stores (50 TB). A listing that gives a size beyond it (or
a negative one) is refused before the size reaches a download."""

MAX_PARTS = 10_000
"""Parts of one multipart upload at most (S3's limit)."""

MAX_UPLOAD_PAGES = 100
"""Pages of unfinished uploads (a thousand each) a sweep of a step folder goes through at most:
a server paging on without end is not followed (`S3Store._abort_uploads`)."""

Fill = Callable[[memoryview, int], None]
"""`fill(buffer, offset)`: puts the bytes of a file being uploaded at `offset` into `buffer`."""


def split_url(url: str) -> tuple[str, str]:
    """"s3://bucket/a/b/" -> ("bucket", "a/b"); a `ConfigError` when no bucket is given."""
    bucket, _, prefix = url.partition("://")[2].partition("/")
    if not bucket:
        raise ConfigError("url", url, "expected s3://bucket/prefix (no bucket given)")
    return bucket, prefix.strip("/")


def _folder_name(url: str) -> str:
    """The staging folder's name for `url`: percent-encoded, shortened with a digest where that
    is longer than a file name may be (255 bytes)."""
    name = quote(url, safe="")
    if len(name) <= 200:
        return name
    return f"{name[:150]}-{hashlib.sha256(url.encode()).hexdigest()[:32]}"


_USERINFO = re.compile(r"""(?:(?<=://)|(?<=[\s"'(])|^)[^\s"'()/@]+@""")
"""The `user:password@` of a URL (or of a bare `user:password@host`) in a message."""


def _masked(text: str) -> str:
    """`text` with any URL's user and password replaced by `***`: botocore writes the endpoint,
    as the environment or a profile gave it, into its connection errors, and ours quote them."""
    return _USERINFO.sub("***@", text)


def _failure(message: str, cause: BaseException) -> StorageError:
    """Our error for `message` (which quotes `cause`), its user and password masked; chained to
    `cause` only when nothing was masked, since a chained traceback prints `cause` as it is."""
    error = StorageError(_masked(message))
    if error.args[0] == message:
        error.__cause__ = cause
    else:
        error.__suppress_context__ = True
    return error


def _client(key: str, url: str, config: Checkpoint) -> Any:
    try:
        import boto3  # noqa: PLC0415 - an optional dependency, needed only for s3:// folders
        from botocore.config import Config  # noqa: PLC0415
    except ImportError:
        raise ConfigError(key, url, "object storage needs boto3: pip install 'torchtitan_ckpt[s3]'") from None
    retry = {"total_max_attempts": config.storage_retries + 1, "mode": "standard"}
    try:
        return boto3.session.Session().client(
            "s3", config=Config(retries=retry, max_pool_connections=config.upload_parallel_parts + 2,
                                connect_timeout=config.storage_timeout_s, read_timeout=config.storage_timeout_s))
    except ValueError as e:  # an endpoint that is no URL ("Invalid endpoint: ...")
        raise ConfigError(key, url, f"no S3 client can be made: {_masked(str(e))}. Check the endpoint "
                                    "(AWS_ENDPOINT_URL, or endpoint_url in the AWS profile): docs/storage.md") from None


_NOT_IN_XML = re.compile("[^\t\n\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
"""Characters a key may hold that DeleteObjects' XML body cannot carry as they are (XML 1.0
has no control characters; a carriage return is read back as a line feed)."""

_FETCH_LIMITS = {commit.MARKER: commit.MAX_MARKER_BYTES, METADATA_FILE: MAX_METADATA_BYTES,
                 INDEX_FILE: MAX_INDEX_BYTES, RECORDED_LAYOUT: MAX_RECORDED_LAYOUT_BYTES}
"""Object name -> the most bytes a fetch of it by name downloads: its reader refuses more."""


def private_staging_folder() -> str:
    """The default staging folder, one per user (`torchtitan_ckpt-<uid>`) in the system's
    temporary folder, made if need be. Every user writes to that folder, so the staging folder
    must be this user's own, readable by no one else, and not a link: another user could have
    made it first, to read the staged shards or to put files into a step before its upload."""
    path = os.path.join(tempfile.gettempdir(), f"torchtitan_ckpt-{os.getuid()}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        why = _not_private(path)
    except OSError as e:
        raise ConfigError("checkpoint.staging_folder", "", f"the default staging folder {path} cannot be made: "
                          f"{e}; set checkpoint.staging_folder to a folder of your own") from None
    if why:
        raise ConfigError("checkpoint.staging_folder", "",
                          f"the default staging folder {path} is not a folder of this user's that only this user "
                          f"can read ({why}): remove it, or set checkpoint.staging_folder to a folder of your own")
    return path


def _not_private(path: str) -> str | None:
    """Why the folder `path` is not this user's alone, or None."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        return "a link or a file"
    if st.st_uid != os.getuid():
        return f"another user's, uid {st.st_uid}"
    return f"open to others, mode {stat.S_IMODE(st.st_mode):o}" if st.st_mode & 0o077 else None


class S3Store(Store):
    """A checkpoint folder `s3://bucket/prefix`; each rank stages its files in
    `{staging_folder}/{url}/rank-N`."""

    staged = True

    def __init__(self, url: str, key: str, rank: int, config: Checkpoint):
        self.url = url.rstrip("/")
        self.key = key
        self.bucket, self.prefix = split_url(self.url)
        self.rank = rank
        base = config.staging_folder or private_staging_folder()
        self.root = os.path.abspath(os.path.join(base, _folder_name(self.url), f"rank-{rank}"))  # as `LocalStore`'s
        self.part_size = parse_size(config.upload_part_size)
        self.parallel = config.upload_parallel_parts
        self.retries = config.storage_retries
        self.client = _client(key, url, config)
        self._pool = ThreadPoolExecutor(self.parallel, thread_name_prefix="ckpt-s3")
        self._held: str | None = None  # the step folder fetched here
        self._whole = False  # with every object of it
        self._files: set[str] = set()  # the objects of it fetched whole
        self._lock: str | None = None  # while this store holds `root`: its lock file (`lock.claim`)
        self._told_uploads = False  # that unfinished uploads cannot be listed (`_abort_uploads`)
        self._saving: dict[str, str] = {}  # step key -> the id of this store's save marked there

    # ------------------------------------------------------------------ names and requests

    def _key(self, path: str) -> str:
        """The object key (prefix) of a local path under `root`."""
        rel = os.path.relpath(path, self.root)
        parts = [p for p in (self.prefix, "" if rel == "." else rel.replace(os.sep, "/")) if p]
        return "/".join(parts)

    def describe(self, path: str) -> str:
        return self.where(self._key(path))

    def in_user_terms(self, text: str) -> str:
        staging = re.escape(os.path.dirname(self.root))  # every rank's `root` is a `rank-N` in it
        url = self.where(self.prefix).rstrip("/")
        return re.sub(staging + r"/rank-[0-9]+(?=/|$|[\s'\":,;)\]])", lambda _: url, text)

    def where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _call(self, what: str, key: str, fn, **kwargs) -> Any:
        """One request, retried by botocore; its final failure a `StorageError` naming the object."""
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415
        from botocore.parsers import ResponseParserError  # noqa: PLC0415

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except (BotoCoreError, ClientError, ResponseParserError, ValueError) as e:  # ValueError: a field
            raise _failure(f"{what} {self.where(key)} failed: {type(e).__name__}: {e}", e)  # it parses

    def _field(self, reply: Mapping, name: str, what: str, key: str) -> str:
        """The string field `name` of a server's `reply` to `what`; a `StorageError` naming the
        object when the server left it out."""
        value = reply.get(name) if isinstance(reply, Mapping) else None
        if not isinstance(value, str) or not value:
            raise StorageError(f"{what} {self.where(key)}: the server's answer has no {name} ({brief(value)})")
        return value

    def _list(self, key: str, start: str = "") -> dict[str, int]:
        """Object name (relative to `key/`; the whole bucket for the empty key) -> size, for
        every object under `key/` whose name begins with `start`. An object whose name ends in
        `/` (a folder placeholder, as the S3 console makes, or another program's) is no file of
        a checkpoint: passed over. An answer naming an object outside `key/` (and `start`) or
        one listed before (a listing that repeats
        itself would never end), or of a size outside [0, MAX_OBJECT_BYTES], or one that pages on
        without a continuation token, with one given before, or with `MAX_EMPTY_PAGES` empty
        pages in a row, is a `StorageError`."""
        prefix, found, token, seen, empty = f"{key}/" if key else "", {}, {}, set(), 0
        while True:
            page = self._call("listing", prefix, self.client.list_objects_v2, Prefix=prefix + start, **token)
            empty = 0 if page.get("Contents") else empty + 1
            if empty > MAX_EMPTY_PAGES:
                raise StorageError(f"listing {self.where(prefix)}: the server answered {empty} pages in a row "
                                   "without an object, each saying more follow: the listing would never end")
            for o in page.get("Contents", []):
                name, size = o.get("Key"), o.get("Size")
                if not isinstance(name, str) or not name.startswith(prefix + start):
                    raise StorageError(f"listing {self.where(prefix)}: the server answered the object {brief(name)}, "
                                       "which is not under it")
                if name[len(prefix):] in found:
                    raise StorageError(f"listing {self.where(prefix)}: the server lists {self.where(name)} twice: "
                                       "the listing would never end")
                if type(size) is not int or not 0 <= size <= MAX_OBJECT_BYTES:
                    raise StorageError(f"listing {self.where(prefix)}: the server gives {self.where(name)} a size "
                                       f"of {size!r} bytes, not one in [0, {MAX_OBJECT_BYTES}]")
                if name.endswith("/"):  # no checkpoint file has such a name: another program's, passed over
                    continue
                found[name[len(prefix):]] = size
            if not page.get("IsTruncated"):
                return found
            following = page.get("NextContinuationToken")
            if not isinstance(following, str) or following in seen:
                token_is = "a token it gave before" if following in seen else f"no token ({following!r})"
                raise StorageError(f"listing {self.where(prefix)}: the server says more objects follow, and gives "
                                   f"{token_is} to continue from: the listing would never end")
            seen.add(following)
            token = {"ContinuationToken": following}

    def _put(self, key: str, body: bytes | bytearray) -> None:
        self._call("writing", key, self.client.put_object, Key=key, Body=body, ChecksumCRC32=_crc_header(body))

    def _delete(self, keys: list[str]) -> None:
        """Delete `keys`, a thousand per request; one that XML cannot carry (`_NOT_IN_XML`) in a
        request of its own, which names it in the URL."""
        for key in [k for k in keys if _NOT_IN_XML.search(k)]:
            self._call("deleting", key, self.client.delete_object, Key=key)
        keys = [k for k in keys if not _NOT_IN_XML.search(k)]
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True}
            errors = self._call("deleting", keys[i], self.client.delete_objects, Delete=batch).get("Errors")
            if errors:
                first = errors[0] if isinstance(errors, list) and isinstance(errors[0], dict) else {}
                named = first.get("Key") if isinstance(first.get("Key"), str) else keys[i]
                raise StorageError(f"deleting {self.where(named[:1000])} failed: {brief(first.get('Message'))}")

    def _mark_in_progress(self, key: str) -> str:
        """Mark the step `key` ours and partial; returns the mark's id of this save."""
        mark = commit.new_mark()
        self._put(f"{key}/{commit.IN_PROGRESS}", json.dumps(mark).encode())
        return mark["save"]

    def _started_by(self, key: str) -> str | None:
        """The id of the save whose mark the step `key` holds (`_mark_in_progress`), None where
        it holds no mark of a save (committed since, or marked by an older version)."""
        size = self._list(key, commit.IN_PROGRESS).get(commit.IN_PROGRESS)
        if size is None or size > commit.MARK_BYTES:  # none, or no mark of ours
            return None
        with tempfile.TemporaryFile() as f:  # read as any object is: a body cut short is retried
            if size:
                self._get_range(f"{key}/{commit.IN_PROGRESS}", f.fileno(), 0, size)
            return commit.mark_id(f.read())

    def _remove_step(self, key: str, names: list[str]) -> None:
        """Delete the objects `names` under `key/`, a step the caller has marked in progress,
        but that mark: the commit marker first, so a step half deleted reads as partial."""
        if commit.MARKER in names:
            self._delete([f"{key}/{commit.MARKER}"])
        self._delete([f"{key}/{n}" for n in names if n not in _MARKERS])

    # ------------------------------------------------------------------ the store

    def reach(self, group: CheckpointGroup, write: bool = True) -> None:
        """Every rank reaches the bucket with its credentials (and, with `write`, can write under
        the prefix)."""
        try:
            group.run(lambda: self._probe(write))
        except RankFailed as failed:
            status = _http_status(failed.error)
            advice = (f"The endpoint answered HTTP {status}, a server error, through checkpoint.storage_retries = "
                      f"{self.retries} retries: it is reached, and failing; start again once it recovers" if
                      status is not None and status >= 500 else
                      "Check the bucket's name, the endpoint (AWS_ENDPOINT_URL) and the credentials "
                      "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE)")
            raise ConfigError(self.key, self.url, f"the bucket cannot be used: {failed}. {advice}: "
                                                  "docs/storage.md") from None

    def check(self, group: CheckpointGroup, write: bool = True) -> None:
        """Every rank can write into its staging folder."""
        try:
            group.run(self._probe_staging)
        except RankFailed as failed:
            raise ConfigError("checkpoint.staging_folder", os.path.dirname(os.path.dirname(self.root)),
                              f"files cannot be staged there: {failed}") from None

    def _probe_staging(self) -> None:
        """Every use stages files in `root` (a load too), which this process holds for this
        rank and URL (`lock.claim`) until `close`. The step folders an earlier process left there
        (killed during an upload, or a fetched step) are then removed: this rank's of this URL,
        staged or fetched by this package alone, each a rank's share of a step. The folders
        made for the URL and the rank are this user's alone, in any `staging_folder`."""
        for folder in (os.path.dirname(self.root), self.root):
            os.makedirs(folder, mode=0o700, exist_ok=True)
            if why := _not_private(folder):  # another user's made first: it would read, or add to, the steps
                raise PermissionError(f"{folder} is not this user's alone ({why}): remove it, or stage in a "
                                      "folder of your own")
        with tempfile.TemporaryFile(dir=self.root):
            pass
        if self._lock is not None:
            return
        self._lock, first = lock.claim(f"{self.root}.lock", f"{self.root}, where this node stages {self.url} for "
                                       f"rank {self.rank}", "one job per URL and node; give this job a "
                                       "checkpoint.staging_folder of its own")
        if not first:
            return  # another store of this process uses it: what is there may be in flight
        for entry in os.scandir(self.root):
            if layout.parse_step(entry.name) is not None and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
                logger.info("rank %d removed %s, left in its staging folder by an earlier run", self.rank, entry.path)

    def close(self) -> None:
        """The step fetched for a load is removed from the staging folder while this store still
        holds it (it stayed there until the next process of the URL started), unless another
        store of this process uses the folder."""
        self._pool.shutdown(wait=True)  # idle by now: the job's transfers are done
        if self._lock is not None:
            if self._held is not None and not lock.shared(self._lock):
                shutil.rmtree(self._held, ignore_errors=True)
                self._held = None
            lock.release(self._lock)
            self._lock = None

    def _probe(self, write: bool) -> None:
        self._call("reaching the bucket of", self.prefix, self.client.head_bucket)
        if not write:
            return
        probe = "/".join(p for p in (self.prefix, f".probe-rank{self.rank}") if p)
        self._put(probe, b"")
        self._delete([probe])

    def step_around(self) -> str | None:
        """One listing for each folder of the prefix named as a step (none, mostly)."""
        parts = self.prefix.split("/") if self.prefix else []
        for end in range(len(parts), 0, -1):
            if layout.parse_step(parts[end - 1]) is not None:
                key = "/".join(parts[:end])
                if any(name in self._list(key, name) for name in (*_MARKERS, METADATA_FILE)):
                    return self.where(key)
        return None

    def scan(self, folder: str) -> list[layout.StepFolder]:
        """Steps by their markers: complete with `COMMITTED.json`, partial with only
        `IN_PROGRESS.json`, unknown (another program's: never loaded or deleted) with neither."""
        steps: dict[int, set[str]] = {}
        for name in self._list(self._key(folder), layout.STEP_PREFIX):  # not others' objects beside the steps
            step_name, _, rest = name.partition("/")
            step = layout.parse_step(step_name)
            if step is not None and rest:
                steps.setdefault(step, set()).add(rest)
        return [layout.StepFolder(step, layout.step_dir(folder, step), _status(names))
                for step, names in sorted(steps.items())]

    def prepare(self, path: str, step: int) -> None:
        key = self._key(path)
        listing = self._list(key)
        names = list(listing)
        folder = layout.StepFolder(step, path, _status(set(names)))
        commit.refuse_unlisted(self.describe(path), self._unlisted(key, listing))
        if names and not folder.ours:  # `replaceable`, from the listing made
            raise CheckpointError(f"{self.where(key)} exists and was not written by torchtitan_ckpt; it is "
                                  "never replaced: move it away or save under another prefix")
        if folder.status == layout.COMPLETE:
            warn_replacing(self.where(key))
        self._saving[key] = self._mark_in_progress(key)
        self._remove_step(key, names)
        if names:  # a leftover of ours (a killed save marked it first); an empty prefix's uploads may be another's
            self._abort_uploads(key)
        faults.hit("prepare", step)

    def prepare_rank(self, path: str) -> None:
        """An empty local staging folder for this rank's files of the step; on rank 0, with the
        step's in-progress mark (never uploaded: not a file of the step's), whose save a DCP
        `.metadata` written there records (`commit.started_by`)."""
        if path == self._held:
            self._held, self._whole = None, False
            self._files.clear()
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        if (save := self._saving.get(self._key(path))) is not None:
            with os.fdopen(durable.create_replacing(os.path.join(path, commit.IN_PROGRESS)), "w") as f:
                json.dump({"save": save}, f)

    def publish(self, path: str, files: dict[str, tuple[int, str]], group: CheckpointGroup,
                joint: Sequence[str] = (), last: Sequence[str] = ()) -> dict[str, tuple[int, str]]:
        """Upload this rank's staged files (each one's CRC-32 computed from the bytes uploaded
        and checked against its writer's), then free the staging folder (after a failure too). `joint` files go
        first (`_upload_joint_files`), and `last` ones once every rank's others are in the store."""
        start, key, step = time.perf_counter(), self._key(path), layout.parse_step(os.path.basename(path))
        uploaded: dict[str, tuple[int, str]] = {}
        own: list[str] = []

        def upload(names: list[str]) -> None:
            for rel in names:
                uploaded[rel] = self._upload_checked(path, rel, f"{key}/{rel}", files.get(rel))
                faults.hit("upload", step)

        try:
            if joint or last:  # each phase complete on every rank (or failed on every rank) before the next
                def first() -> None:  # the joint files' collectives first: every rank reaches them
                    self._upload_joint_files(path, key, joint, group, uploaded)
                    own.extend(rel for rel in commit.manifest(path) if rel not in joint)
                group.run(first)
                group.run(lambda: upload([rel for rel in own if rel not in last]))
                upload([rel for rel in own if rel in last])
            else:
                upload([rel for rel in commit.manifest(path)])
        finally:  # uploaded or failed, the staged copy is of no more use
            shutil.rmtree(path, ignore_errors=True)
        _log_rate("rank %d uploaded %d files to %s" % (self.rank, len(uploaded), self.where(key)),
                  sum(s for s, _ in uploaded.values()), start)
        return uploaded

    def _upload_checked(self, path: str, rel: str, key: str, written: tuple[int, str] | None) -> tuple[int, str]:
        uploaded = self._upload(os.path.join(path, rel), key)
        if written is not None and written != uploaded:
            raise StorageError(f"{os.path.join(path, rel)} changed between its write {written} and its "
                               f"upload {uploaded} (size, CRC-32): the local staging disk is failing?")
        return uploaded

    def _upload_joint_files(self, path: str, key: str, joint: Sequence[str], group: CheckpointGroup,
                            uploaded: dict[str, tuple[int, str]]) -> None:
        """File i of `joint` is assembled onto rank i % world_size, which uploads it. The ranks
        first agree on the files and their sizes, and learn which stretches of each file every
        rank holds; then every rank takes part in every file's transfers, even after a failure
        of its own (raised at the end), so that no rank is left waiting in one."""
        step, failure, sent = layout.parse_step(os.path.basename(path)), None, 0
        locals_ = [os.path.join(path, rel) for rel in joint]
        sizes = [_size_or_none(local) for local in locals_]
        every = group.all_gather((list(joint), sizes, [_extents(lc, s or 0) for lc, s in zip(locals_, sizes)]))
        if any(other[:2] != every[0][:2] for other in every) or None in sizes:
            raise StorageError(f"{path}: the ranks' staged copies of the HF files differ or are missing "
                               f"({[list(zip(j, s)) for j, s, _ in every]}); the staging folder is failing?")
        for i, (rel, size) in enumerate(zip(joint, sizes)):
            owner = i % group.world_size
            assembled = _JointFile(locals_[i], size, group, owner, [held[i] for _, _, held in every])
            if owner == group.rank and failure is None:
                try:
                    uploaded[rel] = self._upload_stream(size, f"{key}/{rel}", assembled.fill)
                except Exception as e:
                    failure = e
            try:
                assembled.finish(self._part_size(size))
            except Exception as e:
                failure = failure or e
            sent += assembled.sent
            if owner == group.rank:
                faults.hit("upload", step)
        logger.info("rank %d sent %d bytes of %d joint files to the ranks assembling them",
                    group.rank, sent, len(joint))
        if failure is not None:
            raise failure

    def commit(self, path: str, info: commit.CommitInfo, checksums: dict[str, tuple[int, str]]) -> None:
        key = self._key(path)
        info.files = {rel: {"size": size, "crc32": crc} for rel, (size, crc) in sorted(checksums.items())}
        info.created = time.time()
        faults.hit("commit", info.step)
        if (mine := self._saving.pop(key, None)) is not None and self._started_by(key) != mine:
            raise CheckpointError(
                f"{self.where(key)} was marked by another save after this one began (its {commit.IN_PROGRESS} is not "
                "this save's): another job saves into this URL, and the two replace each other's files; this step "
                "is not committed. Give each job a prefix of its own (object storage has no lock to refuse the "
                "second job at its start)")
        self._put(f"{key}/{commit.MARKER}", json.dumps(asdict(info), indent=1, sort_keys=True).encode())
        try:
            self._delete([f"{key}/{commit.IN_PROGRESS}"])
        except StorageError as e:  # committed all the same: the commit marker decides a step's status
            logger.warning("%s is committed, but its in-progress marker is left over (%s); it is harmless, and goes "
                           "with the step", self.where(key), e)
        self._abort_uploads(key)  # every rank's are finished: any left is an orphan (a start retried)

    def fetch(self, path: str, names: Sequence[str] | None = None) -> str:
        """Download the objects under the step (or checkpoint folder) into `path`: every one,
        or those of `names`. Afresh (the same step may have been saved again since), unless the
        whole step is here already; fetching every object skips those fetched by name just before
        (the files that told the step's status). `path` exists once anything is under it in the
        store."""
        self._hold(path)
        if self._whole:
            return path
        start, key = time.perf_counter(), self._key(path)
        listed = self._list(key)
        wanted = None if names is None else set(names)
        objects = ({n: size for n, size in listed.items() if n not in self._files} if wanted is None else
                   {n: size for n, size in listed.items() if n in wanted})
        if names is None and not listed:
            raise CheckpointNotFoundError(f"{self.where(key)}: no objects there")
        _check_as_files(self.where(key), listed if names is None else objects)
        for name, size in objects.items():
            if wanted is not None and size > _FETCH_LIMITS.get(name, size):
                raise CorruptCheckpointError(f"{self.where(f'{key}/{name}')} is {size} bytes, more than the "
                                             f"{_FETCH_LIMITS[name]} its reader takes: refusing to download it")
        if listed:
            os.makedirs(path, exist_ok=True)
        for name, size in objects.items():
            local = safe_open.inside(path, name, f"an object under {self.where(key)}")
            os.makedirs(os.path.dirname(local), exist_ok=True)
            self._download(f"{key}/{name}", local, [(0, size)], size)
        self._whole = names is None
        self._files.update(objects)
        _log_rate("rank %d downloaded %d objects of %s" % (self.rank, len(objects), self.where(key)),
                  sum(objects.values()), start)
        return path

    def fetch_ranges(self, path: str, ranges: Mapping[str, Sequence[tuple[int, int]]]) -> None:
        """Download only `ranges` of the step's objects (ranged GETs, ranges that touch merged)
        into sparse local files, at their offsets: this rank's share of the step, not all of it.
        An object fetched whole here before (`verify_on_load`'s share) is read as it was
        verified, not downloaded again."""
        self._hold(path)
        if self._whole:
            return
        start, key, total = time.perf_counter(), self._key(path), 0
        spans = self._checked_spans(path, key, {rel: r for rel, r in ranges.items() if rel not in self._files})
        for rel, merged in spans.items():
            local = os.path.join(path, rel)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            self._download(f"{key}/{rel}", local, merged)
            total += sum(n for _, n in merged)
        _log_rate("rank %d downloaded its ranges of %d objects of %s" % (self.rank, len(ranges), self.where(key)),
                  total, start)

    def _checked_spans(self, path: str, key: str, ranges: Mapping[str, Sequence[tuple[int, int]]]
                       ) -> dict[str, list[tuple[int, int]]]:
        """`ranges` merged, each file's, once every range is checked (before anything is
        downloaded): they come from the step's metadata, so a name outside the step, an object
        the store does not hold, or a range that is not whole numbers inside the object (as the
        store lists it) is a `CorruptCheckpointError` naming the object."""
        sizes = self._list(key)
        spans = {}
        for rel, wanted in sorted(ranges.items()):
            safe_open.inside(path, rel, f"an object under {self.where(key)}")
            where = self.where(f"{key}/{rel}")
            if rel not in sizes:
                raise CorruptCheckpointError(f"{where}: the step's metadata reads this object, which the store "
                                             "does not hold")
            for offset, length in wanted:
                if type(offset) is not int or type(length) is not int or min(offset, length) < 0 \
                        or offset + length > sizes[rel]:
                    raise CorruptCheckpointError(
                        f"{where}: the step's metadata reads {length!r} bytes at {offset!r}, outside its "
                        f"{sizes[rel]} bytes: the checkpoint is damaged or was crafted")
            spans[rel] = _merged(wanted)
        return spans

    def _hold(self, path: str) -> None:
        """The local folder keeps one fetched step: another one fetched before is removed."""
        if path != self._held:
            for old in filter(None, (self._held, path)):
                shutil.rmtree(old, ignore_errors=True)
            self._held, self._whole = path, False
            self._files.clear()

    def sizes(self, path: str, names: Collection[str]) -> dict[str, int | None]:
        listed = self._list(self._key(path))
        return {rel: listed.get(rel) for rel in names}

    def size(self, path: str) -> int:
        return sum(self._list(self._key(path)).values())

    def unlisted(self, folder: layout.StepFolder) -> list[str]:
        key = self._key(folder.path)
        return self._unlisted(key, self._list(key))

    def _unlisted(self, key: str, listing: Mapping[str, int]) -> list[str]:
        """`unlisted` of the step `key`, whose objects and sizes are `listing`. Its marker is
        downloaded into a folder of its own, not the local copy of a step held for reading,
        which a fetch on another thread (a save's, the deleter's) may replace meanwhile."""
        size = listing.get(commit.MARKER)
        if size is None or size > commit.MAX_MARKER_BYTES:  # not committed; a marker too big to be one of ours
            return []
        with tempfile.TemporaryDirectory(prefix="torchtitan_ckpt-marker-") as tmp:
            with open(os.path.join(tmp, commit.MARKER), "wb") as f:
                if size:
                    self._get_range(f"{key}/{commit.MARKER}", f.fileno(), 0, size)
            try:
                listed = commit.read_marker(tmp).files
            except (CorruptCheckpointError, NewerVersionError, OlderVersionError):
                return []  # no manifest to tell by
        return sorted(set(listing) - set(listed) - set(_MARKERS))

    def remove(self, folder: layout.StepFolder) -> None:
        """Marked in progress, then the commit marker, the data, and the in-progress marker last
        in a request of its own: a step whose deletion stops anywhere reads as ours and partial
        (deleted by the next retention), never as another program's. A committed step holding
        objects its manifest does not list is left as it is (`unlisted`)."""
        key = self._key(folder.path)
        listing = self._list(key)
        names = list(listing)
        if folder.status == layout.PARTIAL and commit.MARKER in names:
            raise CheckpointError(f"{self.describe(folder.path)} was chosen as a partial step and is committed now: "
                                  "left alone (does another job save into this URL?)")
        commit.refuse_unlisted(self.describe(folder.path), self._unlisted(key, listing))
        self._mark_in_progress(key)
        if commit.MARKER in names:
            self._delete([f"{key}/{commit.MARKER}"])
            faults.hit("purge", folder.step)
        self._remove_step(key, [n for n in names if n != commit.MARKER])
        self._abort_uploads(key)
        self._delete([f"{key}/{commit.IN_PROGRESS}"])

    # ------------------------------------------------------------------ bytes

    def _upload(self, local: str, key: str) -> tuple[int, str]:
        """Upload one file; its (size, CRC-32) from the bytes sent."""
        fd = os.open(local, os.O_RDONLY)
        try:
            return self._upload_stream(os.fstat(fd).st_size, key,
                                       lambda view, offset: _read_part(fd, view, offset, local))
        finally:
            os.close(fd)

    def _upload_stream(self, size: int, key: str, fill: Fill) -> tuple[int, str]:
        """Upload `size` bytes, each part of `part_size` read by `fill` (one put when they fit in
        one part); (size, CRC-32) of the bytes sent."""
        if size <= self.part_size:
            data = bytearray(size)
            if size:
                fill(memoryview(data), 0)
            self._put(key, data)
            return size, hex_crc(crc32(data))
        reply = self._call("starting an upload of", key, self.client.create_multipart_upload, Key=key,
                           ChecksumAlgorithm="CRC32")
        upload_id = self._field(reply, "UploadId", "starting an upload of", key)
        try:
            crc, done = self._send_parts(size, key, upload_id, fill)
            self._call("finishing the upload of", key, self.client.complete_multipart_upload, Key=key,
                       UploadId=upload_id, MultipartUpload={"Parts": done})
        except BaseException:
            self._abort(key, upload_id)
            raise
        return size, hex_crc(crc)

    def _part_size(self, size: int) -> int:
        """The part size of a file of `size` bytes: `part_size`, or a larger one (whole MiB) for
        a file that would take more than `MAX_PARTS` parts of it."""
        if size <= self.part_size * MAX_PARTS:
            return self.part_size
        return -(-size // (MAX_PARTS << 20)) << 20

    def _send_parts(self, size: int, key: str, upload_id: str, fill: Fill) -> tuple[int, list[dict]]:
        """The parts, `parallel` in flight at most, each read into a buffer that the part
        `parallel` places after it reuses once it is sent: the bytes a rank holds, with no
        allocation or copy per part (a bytearray goes to the socket as it is)."""
        crc, done, pending, free = 0, [], collections.deque(), []
        part = self._part_size(size)
        if part != self.part_size:
            logger.warning("%s: %d bytes take more than %d parts of checkpoint.upload_part_size; uploading it in "
                           "parts of %d bytes (%d held at once)", self.where(key), size, MAX_PARTS, part,
                           part * self.parallel)
        for number, offset in enumerate(range(0, size, part), 1):
            if len(pending) >= self.parallel:  # wait before the next part is read
                sent, buf = pending.popleft()
                done.append(sent.result())
                free.append(buf)
            n = min(part, size - offset)
            buf = free.pop() if free else bytearray(n)
            del buf[n:]  # the last part, shorter: shrunk in place
            fill(memoryview(buf), offset)
            crc = crc32(buf, crc)
            pending.append((self._pool.submit(self._send_part, key, upload_id, number, buf), buf))
        done.extend(sent.result() for sent, _ in pending)
        return crc, done

    def _send_part(self, key: str, upload_id: str, number: int, data: bytearray) -> dict:
        checksum = _crc_header(data)
        reply = self._call(f"uploading part {number} of", key, self.client.upload_part, Key=key,
                           UploadId=upload_id, PartNumber=number, Body=data, ChecksumCRC32=checksum)
        return {"PartNumber": number, "ETag": self._field(reply, "ETag", f"uploading part {number} of", key),
                "ChecksumCRC32": checksum}

    def _abort_uploads(self, key: str) -> None:
        """Abort the multipart uploads left under the step folder `key/` (a save killed
        mid-upload; a start retried after its answer was lost): no listing of objects shows
        them, and their parts are billed until a lifecycle rule reclaims them. Only under a
        step folder of ours, where this package alone writes. A listing refused (a policy
        without s3:ListBucketMultipartUploads) is said once; a save never fails on it."""
        prefix, following, left = f"{key}/", {}, 0
        try:
            for _ in range(MAX_UPLOAD_PAGES):
                page = self._call("listing the unfinished uploads under", prefix, self.client.list_multipart_uploads,
                                  Prefix=prefix, **following)
                for upload in page.get("Uploads") or []:
                    name, upload_id = upload.get("Key"), upload.get("UploadId")
                    if isinstance(name, str) and name.startswith(prefix) and isinstance(upload_id, str):
                        left += self._abort(name, upload_id)
                following = {"KeyMarker": page.get("NextKeyMarker"), "UploadIdMarker": page.get("NextUploadIdMarker")}
                if not page.get("IsTruncated") or not all(isinstance(v, str) for v in following.values()):
                    break
        except StorageError as e:
            if not self._told_uploads:
                logger.warning("unfinished uploads under %s cannot be listed, and are left to a lifecycle rule "
                               "(docs/storage.md): %s", self.where(prefix), e)
            self._told_uploads = True
        if left:
            logger.info("aborted %d unfinished upload(s) under %s (a save stopped mid-upload)", left,
                        self.where(prefix))

    def _abort(self, key: str, upload_id: str) -> bool:
        """Abort one unfinished upload; whether it went. One that cannot be aborted is a warning
        (a failed upload's save fails anyway, a sweep's step is saved or removed): a bucket
        lifecycle rule reclaims its parts."""
        try:
            self._call("aborting the upload of", key, self.client.abort_multipart_upload, Key=key, UploadId=upload_id)
            return True
        except StorageError as e:
            logger.warning("%s", e)
            return False

    def _download(self, key: str, local: str, spans: list[tuple[int, int]], size: int | None = None) -> None:
        """Ranged GETs of `spans` ((offset, length), checked by the caller to lie inside the
        object), cut into `part_size` pieces as they go, `parallel` in flight at most, each
        written at its offset into `local`, made `size` bytes long when given. Every piece
        started has ended, even on a failure, before `local` is closed."""
        fd = os.open(local, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if size is not None else 0), 0o644)
        pending: collections.deque[Future] = collections.deque()
        try:
            if size is not None:
                posio.grow(fd, size)
            for offset, length in _pieces(spans, self.part_size):
                if len(pending) >= self.parallel:
                    pending.popleft().result()
                pending.append(self._pool.submit(self._get_range, key, fd, offset, length))
            while pending:
                pending.popleft().result()
        finally:
            wait(pending)
            os.close(fd)

    def _get_range(self, key: str, fd: int, offset: int, length: int) -> None:
        from botocore.exceptions import IncompleteReadError, ReadTimeoutError, ResponseStreamingError  # noqa: PLC0415

        for attempt in range(self.retries + 1):
            reply = self._call("downloading", key, self.client.get_object, Key=key,
                               Range=f"bytes={offset}-{offset + length - 1}")
            try:  # one byte more than asked at most: a server that ignores the range sends all of it
                data = reply["Body"].read(length + 1)
                declared = reply.get("ContentLength")
                if len(data) < length and isinstance(declared, int) and declared > len(data):
                    # the connection closed before the body its answer declared: cut in transit
                    raise IncompleteReadError(actual_bytes=len(data), expected_bytes=declared)
            except (IncompleteReadError, ReadTimeoutError, ResponseStreamingError) as e:  # the body broke or stalled
                if attempt == self.retries:
                    raise _failure(f"downloading {self.where(key)} failed after {attempt} retries: {e}", e)
                time.sleep(min(2 ** attempt * 0.1, 5))
                continue
            finally:
                reply["Body"].close()  # the rest of a longer body is dropped with its connection
            if len(data) != length:
                got = len(data) if len(data) < length else "more"
                raise StorageError(f"{self.where(key)}: asked for {length} bytes at {offset}, got {got}")
            posio.write_all(fd, memoryview(data), offset)
            return


def _http_status(error: BaseException | None) -> int | None:
    """The HTTP status the server answered the request that failed with `error`, if it answered."""
    def answered(e: BaseException) -> bool:
        return isinstance(getattr(e, "response", None), dict)

    found = in_chain(error, answered)
    status = found.response.get("ResponseMetadata", {}).get("HTTPStatusCode") if found is not None else None
    return status if type(status) is int else None


def _check_as_files(where: str, names: Mapping[str, int]) -> None:
    """The objects `names` (relative to the folder `where`) can be laid out as files: none is
    also a folder of another (`x` and `x/y`), no two are one file (`a//b` and `a/b`), which S3
    allows, and no name is longer than a file's. A `CorruptCheckpointError` naming them
    otherwise, before anything is downloaded."""
    files: dict[str, str] = {}
    for name in names:
        local = os.path.normpath(name)
        if os.path.isabs(local) or local == "." or local.split(os.sep)[0] == "..":
            raise CorruptCheckpointError(f"{where}: the object {name!r} names no file inside the folder; the folder "
                                         "is damaged or was not written as a checkpoint")
        if local in files:
            raise CorruptCheckpointError(f"{where}: the objects {files[local]!r} and {name!r} would be one file; "
                                         "the folder is damaged or was not written as a checkpoint")
        if safe_open.too_long(local):
            raise CorruptCheckpointError(f"{where}: the object {name!r} names a file longer than a file name can "
                                         "be; the folder is damaged or was not written as a checkpoint")
        files[local] = name
    if clash := safe_open.file_and_folder(files):
        raise CorruptCheckpointError(f"{where}: {files[clash[0]]!r} is an object and also a folder holding "
                                     f"{files[clash[1]]!r}; the folder is damaged or was not written as a checkpoint")


def _crc_header(data: bytes | bytearray) -> str:
    """The request's CRC-32 as S3 takes it (base64 of 4 big-endian bytes), computed here by
    `io.checksum` instead of by botocore (zlib, a slower pass over every byte)."""
    return base64.b64encode(crc32(data).to_bytes(4, "big")).decode()


def _merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) ranges, sorted, with overlapping or touching ones merged."""
    spans: list[list[int]] = []
    for offset, length in sorted(ranges):
        if spans and offset <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], offset + length)
        else:
            spans.append([offset, offset + length])
    return [(a, z - a) for a, z in spans]


def _pieces(spans: list[tuple[int, int]], part_size: int):
    """The (offset, length) pieces of at most `part_size` bytes that `spans` are cut into, one
    at a time (a span's pieces are never all held at once)."""
    for start, n in spans:
        for offset in range(start, start + n, part_size):
            yield offset, min(part_size, start + n - offset)


def _status(names: set[str]) -> str:
    if commit.MARKER in names:
        return layout.COMPLETE
    return layout.PARTIAL if commit.IN_PROGRESS in names else layout.UNKNOWN


def _log_rate(what: str, nbytes: int, start: float) -> None:
    secs = time.perf_counter() - start
    logger.info("%s: %s in %.2f s, %.2f GB/s", what, fmt_bytes(nbytes), secs, gb_per_s(nbytes, secs))


def _size_or_none(local: str) -> int | None:
    try:
        return os.path.getsize(local)
    except OSError:
        return None


def _read_part(fd: int, view: memoryview, offset: int, local: str) -> None:
    """Fill `view` with the bytes of the file `local` (open as `fd`) at `offset`."""
    n = posio.read_into(fd, [view], offset)
    if n != len(view):
        raise StorageError(f"{local} shrank while being uploaded (at byte {offset + n})")


def _extents(local: str, size: int) -> list[tuple[int, int]]:
    """The (start, end) stretches of `local` that hold data, as the file system tells
    (`SEEK_DATA` / `SEEK_HOLE`, whole blocks): a rank's staged copy of a joint file is created
    at its size and holds holes where other ranks' bytes go. All of it where the file system
    cannot tell, or the file cannot be opened (its reader then fails and sends zeros)."""
    spans: list[tuple[int, int]] = []
    try:
        fd = os.open(local, os.O_RDONLY)
    except OSError:
        return [(0, size)] if size else []
    try:
        while not spans or spans[-1][1] < size:
            start = os.lseek(fd, spans[-1][1] if spans else 0, os.SEEK_DATA)
            spans.append((start, min(os.lseek(fd, start, os.SEEK_HOLE), size)))
    except OSError as e:
        if e.errno != errno.ENXIO:  # ENXIO: no data past the last stretch
            return [(0, size)] if size else []
    finally:
        os.close(fd)
    return [(a, z) for a, z in spans if a < z]


def _clip(spans: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    return [(max(a, start), min(z, end)) for a, z in spans if a < end and z > start]


class _JointFile:
    """A file every rank wrote part of (its own bytes at their offsets, holes or zeros elsewhere
    in its staged copy), assembled part by part onto rank `owner` (`fill`): the owner reads the
    part from its own copy, and every other rank sends it only the stretches of the part that
    hold data in its copy (`extents`: every rank's), which the owner ors in (stretches are
    whole blocks, so two ranks' may overlap, with zeros in each where the other's bytes are).
    Every rank takes part in every part, in order: `finish` does those not done yet. A rank
    that cannot read its copy sends zeros for the rest, and `finish` raises its error."""

    def __init__(self, local: str, size: int, group: CheckpointGroup, owner: int,
                 extents: list[list[tuple[int, int]]]):
        self.local, self.size, self.group, self.owner, self.extents = local, size, group, owner, extents
        self.done = self.sent = 0
        self.failure: Exception | None = None
        self._scratch: bytearray | None = None  # the owner's, for the stretches it receives
        self.fd = -1
        try:
            self.fd = os.open(local, os.O_RDONLY)
        except OSError as e:
            self.failure = e

    def fill(self, view: memoryview, offset: int) -> None:
        """On the owner, `view` gets the file's bytes at `offset`; on another rank, `view` is
        where its stretches of that part are gathered to be sent."""
        end = offset + len(view)
        if self.group.rank == self.owner:
            self._read(view, offset)
            for rank, held in enumerate(self.extents):
                if rank != self.owner:
                    self._receive(view, offset, rank, _clip(held, offset, end))
        else:
            spans, n = _clip(self.extents[self.group.rank], offset, end), 0
            for a, z in spans:
                self._read(view[n:n + z - a], a)
                n += z - a
            if n:
                dist.send(torch.frombuffer(view[:n], dtype=torch.uint8), self._global(self.owner), group=self.group.pg)
                self.sent += n
        self.done = end

    def _read(self, view: memoryview, offset: int) -> None:
        if self.failure is None:
            try:
                _read_part(self.fd, view, offset, self.local)
            except (OSError, StorageError) as e:
                self.failure = e
        if self.failure is not None:
            torch.frombuffer(view, dtype=torch.uint8).zero_()

    def _receive(self, view: memoryview, offset: int, rank: int, spans: list[tuple[int, int]]) -> None:
        n = sum(z - a for a, z in spans)
        if not n:
            return
        if self._scratch is None or len(self._scratch) < n:
            self._scratch = bytearray(len(view))
        got = torch.frombuffer(self._scratch, dtype=torch.uint8)[:n]
        dist.recv(got, self._global(rank), group=self.group.pg)
        part, pos = torch.frombuffer(view, dtype=torch.uint8), 0
        for a, z in spans:
            part[a - offset:z - offset].bitwise_or_(got[pos:pos + z - a])
            pos += z - a

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group.pg, rank)

    def finish(self, part_size: int) -> None:
        """Do the parts not done here yet (through one buffer), then raise this rank's failure."""
        try:
            buf = memoryview(bytearray(min(part_size, self.size - self.done)))
            for offset in range(self.done, self.size, part_size):
                self.fill(buf[:min(part_size, self.size - offset)], offset)
        finally:
            if self.fd >= 0:
                os.close(self.fd)
        if self.failure is not None:
            raise self.failure
