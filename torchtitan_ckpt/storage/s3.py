"""Object storage through the S3 API (AWS S3, MinIO, Ceph RGW, any S3-compatible endpoint), with
boto3 (the `s3` extra: `pip install 'torchtitan_ckpt[s3]'`).

An object store has no rename and no fsync, so a step commits by the order of its objects:

1. rank 0 puts `step-N/IN_PROGRESS.json` (the step is ours, and partial);
2. each rank writes its files into its own local staging folder with the usual engine, then
   uploads them (multipart, `upload_parallel_parts` parts of `upload_part_size` in flight at
   most: the bytes held per rank), computing each file's CRC-32 from the bytes it uploads and
   checking it against the writer's;
3. once every rank's uploads are complete, rank 0 puts `step-N/COMMITTED.json` with every
   file's size and CRC-32, then deletes the in-progress marker.

Discovery lists the markers; a step without `COMMITTED.json` is never loaded; retention deletes
the marker first. Endpoint, region and credentials come from boto3's standard chain
(`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_PROFILE`, ...) and are never logged.
Throttling, 5xx and reset connections are retried by botocore's `standard` mode with
exponential backoff, `storage_retries` times, then fail the save on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any
from urllib.parse import quote

from .. import commit, faults, layout
from ..config import Checkpoint
from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError, RankFailed, StorageError
from ..group import CheckpointGroup
from ..hf.planner import parse_size
from ..io import posio, safe_open
from ..io.checksum import crc32
from .base import Store

logger = logging.getLogger(__name__)

_MARKERS = (commit.MARKER, commit.IN_PROGRESS)


def split_url(url: str) -> tuple[str, str]:
    """"s3://bucket/a/b/" -> ("bucket", "a/b")."""
    bucket, _, prefix = url.split("://", 1)[1].partition("/")
    return bucket, prefix.strip("/")


def _client(key: str, url: str, config: Checkpoint) -> Any:
    try:
        import boto3  # noqa: PLC0415 - an optional dependency, needed only for s3:// folders
        from botocore.config import Config  # noqa: PLC0415
    except ImportError:
        raise ConfigError(key, url, "object storage needs boto3: pip install 'torchtitan_ckpt[s3]'") from None
    retry = {"total_max_attempts": config.storage_retries + 1, "mode": "standard"}
    return boto3.session.Session().client(
        "s3", config=Config(retries=retry, max_pool_connections=config.upload_parallel_parts + 2))


class S3Store(Store):
    """A checkpoint folder `s3://bucket/prefix`; each rank stages its files in
    `{staging_folder}/{url}/rank-N`."""

    def __init__(self, url: str, key: str, rank: int, config: Checkpoint):
        self.url = url.rstrip("/")
        self.key = key
        self.bucket, self.prefix = split_url(self.url)
        self.rank = rank
        base = config.staging_folder or os.path.join(tempfile.gettempdir(), "torchtitan_ckpt")
        self.root = os.path.join(base, quote(self.url, safe=""), f"rank-{rank}")
        self.part_size = parse_size(config.upload_part_size)
        self.parallel = config.upload_parallel_parts
        self.retries = config.storage_retries
        self.client = _client(key, url, config)
        self._pool = ThreadPoolExecutor(self.parallel, thread_name_prefix="ckpt-s3")
        self._fetched: set[str] = set()

    # ------------------------------------------------------------------ names and requests

    def _key(self, path: str) -> str:
        """The object key (prefix) of a local path under `root`."""
        rel = os.path.relpath(path, self.root)
        parts = [p for p in (self.prefix, "" if rel == "." else rel.replace(os.sep, "/")) if p]
        return "/".join(parts)

    def describe(self, path: str) -> str:
        return self.where(self._key(path))

    def where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _call(self, what: str, key: str, fn, **kwargs) -> Any:
        """One request, retried by botocore; its final failure a `StorageError` naming the object."""
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except (BotoCoreError, ClientError) as e:
            raise StorageError(f"{what} {self.where(key)} failed: {type(e).__name__}: {e}") from e

    def _list(self, key: str) -> dict[str, int]:
        """Object name (relative to `key/`) -> size, for every object under `key/`."""
        found: dict[str, int] = {}
        token: dict[str, str] = {}
        while True:
            page = self._call("listing", key + "/", self.client.list_objects_v2, Prefix=key + "/", **token)
            found.update({o["Key"][len(key) + 1:]: o["Size"] for o in page.get("Contents", [])})
            if not page.get("IsTruncated"):
                return found
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def _put(self, key: str, body: bytes) -> None:
        self._call("writing", key, self.client.put_object, Key=key, Body=body)

    def _delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True}
            errors = self._call("deleting", keys[i], self.client.delete_objects, Delete=batch).get("Errors")
            if errors:
                raise StorageError(f"deleting {self.where(errors[0]['Key'])} failed: {errors[0].get('Message')}")

    def _remove_step(self, key: str, names: list[str]) -> None:
        """Delete the objects `names` under `key/`: the commit marker first, so a step half
        deleted reads as partial."""
        if commit.MARKER in names:
            self._delete([f"{key}/{commit.MARKER}"])
        self._delete([f"{key}/{n}" for n in names if n != commit.MARKER])

    # ------------------------------------------------------------------ the store

    def check(self, group: CheckpointGroup, write: bool = True) -> None:
        """Every rank reaches the bucket with its credentials (and, with `write`, can write
        under the prefix)."""
        try:
            group.run(lambda: self._probe(write))
        except RankFailed as failed:
            raise ConfigError(self.key, self.url, (
                f"the bucket cannot be used: {failed}. Check the bucket's name, the endpoint "
                "(AWS_ENDPOINT_URL) and the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE): docs/storage.md")) from None

    def _probe(self, write: bool) -> None:
        self._call("reaching the bucket of", self.prefix, self.client.head_bucket)
        if not write:
            return
        probe = "/".join(p for p in (self.prefix, f".probe-rank{self.rank}") if p)
        self._put(probe, b"")
        self._delete([probe])

    def scan(self, folder: str) -> list[layout.StepFolder]:
        """Steps by their markers: complete with `COMMITTED.json`, partial with only
        `IN_PROGRESS.json`, unknown (another program's: never loaded or deleted) with neither."""
        steps: dict[int, set[str]] = {}
        for name in self._list(self._key(folder)):
            step_name, _, rest = name.partition("/")
            step = layout.parse_step(step_name)
            if step is not None and rest:
                steps.setdefault(step, set()).add(rest)
        return [layout.StepFolder(step, layout.step_dir(folder, step), _status(names))
                for step, names in sorted(steps.items())]

    def prepare(self, path: str, step: int) -> None:
        key = self._key(path)
        names = list(self._list(key))
        if names and not set(_MARKERS) & set(names):
            raise CheckpointError(f"{self.where(key)} exists and was not written by torchtitan_ckpt; it is "
                                  "never replaced: move it away or save under another prefix")
        self._put(f"{key}/{commit.IN_PROGRESS}", json.dumps({"started": time.time()}).encode())
        self._remove_step(key, [n for n in names if n != commit.IN_PROGRESS])
        faults.hit("prepare", step)

    def prepare_rank(self, path: str) -> None:
        """An empty local staging folder for this rank's files of the step."""
        self._fetched.discard(path)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)

    def publish(self, path: str, files: dict[str, tuple[int, str]]) -> dict[str, tuple[int, str]]:
        """Upload this rank's staged files (each one's CRC-32 computed from the bytes uploaded
        and checked against its writer's), then free the staging folder."""
        start, key, step = time.perf_counter(), self._key(path), layout.parse_step(os.path.basename(path))
        uploaded = {}
        for rel in commit.manifest(path):
            uploaded[rel] = self._upload(os.path.join(path, rel), f"{key}/{rel}")
            if rel in files and files[rel] != uploaded[rel]:
                raise StorageError(f"{os.path.join(path, rel)} changed between its write {files[rel]} and its "
                                   f"upload {uploaded[rel]} (size, CRC-32): the local staging disk is failing?")
            faults.hit("upload", step)
        shutil.rmtree(path)
        _log_rate("rank %d uploaded %d files to %s" % (self.rank, len(uploaded), self.where(key)),
                  sum(s for s, _ in uploaded.values()), start)
        return uploaded

    def commit(self, path: str, info: commit.CommitInfo, checksums: dict[str, tuple[int, str]]) -> commit.CommitInfo:
        key = self._key(path)
        info.files = {rel: {"size": size, "crc32": crc} for rel, (size, crc) in sorted(checksums.items())}
        info.created = time.time()
        faults.hit("commit", info.step)
        self._put(f"{key}/{commit.MARKER}", json.dumps(asdict(info), indent=1, sort_keys=True).encode())
        self._delete([f"{key}/{commit.IN_PROGRESS}"])
        return info

    def fetch(self, path: str) -> str:
        """Download every object under the step (or checkpoint folder) into `path`, afresh (a
        local copy is never trusted: the same step may have been saved again since). The local
        folder keeps one fetched step: the others are removed first."""
        if path in self._fetched:
            return path
        start, key = time.perf_counter(), self._key(path)
        objects = {n: s for n, s in self._list(key).items() if n != commit.IN_PROGRESS}
        if not objects:
            raise CheckpointNotFoundError(f"{self.where(key)}: no objects there")
        for old in self._fetched:
            shutil.rmtree(old, ignore_errors=True)
        self._fetched.clear()
        shutil.rmtree(path, ignore_errors=True)
        for name, size in objects.items():
            local = safe_open.inside(path, name, f"an object under {self.where(key)}")
            os.makedirs(os.path.dirname(local), exist_ok=True)
            self._download(f"{key}/{name}", size, local)
        self._fetched.add(path)
        _log_rate("rank %d downloaded %s" % (self.rank, self.where(key)), sum(objects.values()), start)
        return path

    def remove(self, folder: layout.StepFolder) -> None:
        key = self._key(folder.path)
        names = list(self._list(key))
        if commit.MARKER in names:
            self._delete([f"{key}/{commit.MARKER}"])
            faults.hit("purge", folder.step)
        self._remove_step(key, [n for n in names if n != commit.MARKER])

    # ------------------------------------------------------------------ bytes

    def _upload(self, local: str, key: str) -> tuple[int, str]:
        """Upload one file; its (size, CRC-32) from the bytes sent. At most `parallel` parts
        are held at once."""
        size = os.path.getsize(local)
        with open(local, "rb") as f:
            if size <= self.part_size:
                data = f.read()
                self._put(key, data)
                return len(data), f"{crc32(data):08x}"
            upload = self._call("starting an upload of", key, self.client.create_multipart_upload, Key=key)
            try:
                crc, parts = self._send_parts(f, key, upload["UploadId"])
                self._call("finishing the upload of", key, self.client.complete_multipart_upload, Key=key,
                           UploadId=upload["UploadId"], MultipartUpload={"Parts": parts})
            except BaseException:
                self._abort(key, upload["UploadId"])
                raise
        return size, f"{crc:08x}"

    def _send_parts(self, f, key: str, upload_id: str) -> tuple[int, list[dict]]:
        crc, parts, pending = 0, [], deque()
        number = 0
        while True:
            if len(pending) >= self.parallel:  # wait before reading: at most `parallel` parts held
                parts.append(pending.popleft().result())
            data = f.read(self.part_size)
            if not data:
                break
            number += 1
            crc = crc32(data, crc)
            pending.append(self._pool.submit(self._send_part, key, upload_id, number, data))
        parts.extend(p.result() for p in pending)
        return crc, parts

    def _send_part(self, key: str, upload_id: str, number: int, data: bytes) -> dict:
        reply = self._call(f"uploading part {number} of", key, self.client.upload_part, Key=key,
                           UploadId=upload_id, PartNumber=number, Body=data)
        return {"PartNumber": number, "ETag": reply["ETag"]}

    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self._call("aborting the upload of", key, self.client.abort_multipart_upload, Key=key, UploadId=upload_id)
        except StorageError as e:  # the save fails anyway; a bucket lifecycle rule reclaims the parts
            logger.warning("%s", e)

    def _download(self, key: str, size: int, local: str) -> None:
        """Ranged GETs of `part_size` bytes, `parallel` at once, each written at its offset."""
        fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            ranges = [(o, min(self.part_size, size - o)) for o in range(0, size, self.part_size)]
            for _ in self._pool.map(lambda r: self._get_range(key, fd, *r), ranges):
                pass
        finally:
            os.close(fd)

    def _get_range(self, key: str, fd: int, offset: int, length: int) -> None:
        from botocore.exceptions import IncompleteReadError, ResponseStreamingError  # noqa: PLC0415

        for attempt in range(self.retries + 1):
            reply = self._call("downloading", key, self.client.get_object, Key=key,
                               Range=f"bytes={offset}-{offset + length - 1}")
            try:
                data = reply["Body"].read()
            except (IncompleteReadError, ResponseStreamingError) as e:  # the body's stream broke
                if attempt == self.retries:
                    raise StorageError(f"downloading {self.where(key)} failed after {attempt} retries: {e}") from e
                time.sleep(min(2 ** attempt * 0.1, 5))
                continue
            if len(data) != length:
                raise StorageError(f"{self.where(key)}: asked for {length} bytes at {offset}, got {len(data)}")
            posio.write_all(fd, memoryview(data), offset)
            return


def _status(names: set[str]) -> str:
    if commit.MARKER in names:
        return layout.COMPLETE
    return layout.PARTIAL if commit.IN_PROGRESS in names else layout.UNKNOWN


def _log_rate(what: str, nbytes: int, start: float) -> None:
    secs = time.perf_counter() - start
    logger.info("%s: %.3f GB in %.2f s, %.2f GB/s", what, nbytes / 1e9, secs, nbytes / 1e9 / max(secs, 1e-9))
