"""Checkpoints on object storage, against a real S3-compatible server on 127.0.0.1 (moto's), on
2 gloo ranks: bit-identical resume in every async mode, the marker written last, kills at each
phase, injected 5xx / throttling / resets, start-up checks; and a folder ranks do not share."""

from __future__ import annotations

import base64
import ctypes
import glob
import itertools
import json
import logging
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import tracemalloc
import uuid
import zlib
from urllib.parse import quote

import boto3
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.multiprocessing.spawn import ProcessException  # a rank killed, or one that failed on its loss first

from torchtitan_ckpt import CheckpointManager, cli, commit, faults, layout
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.errors import (CheckpointError, CheckpointNotFoundError, CheckpointSaveError, ConfigError,
                                    CorruptCheckpointError, NewerVersionError, StorageError)
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.example.model import hf_adapter
from torchtitan_ckpt.example.train import build_model, shard_model
from torchtitan_ckpt.group import CheckpointGroup
from torchtitan_ckpt.hf import save_hf
from torchtitan_ckpt.storage.local import LOCK_FILE
from torchtitan_ckpt.storage.s3 import S3Store, split_url

from .helpers import DEBUG_CONFIG, assert_same, data_file_use, logits, perturbed, run_job, spawn
from .s3server import CREDENTIALS, FaultProxy, start_moto

pytestmark = pytest.mark.multirank

TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def moto_url():
    server, url = start_moto()
    yield url
    server.stop()


@pytest.fixture
def bucket(moto_url, monkeypatch):
    """A fresh bucket; the standard AWS variables point every rank at the local server."""
    for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": moto_url}.items():
        monkeypatch.setenv(key, value)
    name = "t-" + uuid.uuid4().hex
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def _objects(bucket: str) -> dict[str, int]:
    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def _config(url: str, staging: str, **over) -> Checkpoint:
    config = Checkpoint(enable=True, folder=url, interval=1, keep_latest_k=1, last_save_model_only=False,
                        staging_folder=staging, upload_part_size="5MiB", upload_parallel_parts=2,
                        storage_retries=3, collective_timeout_s=60)
    for key, value in over.items():
        setattr(config, key, value)
    config.validate()
    return config


def _job(seed: int = 0):
    """A model with a tensor above the part size (a multipart upload) and small ones."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1200, 1200), torch.nn.Linear(1200, 8))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train(model, opt) -> None:
    """One step. On the ranks of a process group, every rank then holds rank 0's result, as data
    parallelism keeps replicas alike: a rank loads bytes another rank wrote, and two processes'
    arithmetic is not always bit for bit the same (seen now and then under load, with plain torch
    too: one process's `sqrt` of a large tensor, and so its Adam step on half of a weight's rows,
    2e-4 apart from the others')."""
    model(torch.ones(2, 1200)).sum().backward()
    opt.step()
    opt.zero_grad()
    if dist.is_initialized():
        for t in [*model.state_dict().values(), *(v for s in opt.state.values() for v in s.values())]:
            dist.broadcast(t, src=0)


def _snapshot(model, opt) -> dict:
    sd = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        sd.update({f"o.{i}.{k}": v.clone() for k, v in s.items()})
    return sd


def _assert_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _save_then_resume(rank, world_size, url, staging, mode):
    model, opt = _job()
    _train(model, opt)
    with CheckpointManager(_config(url, staging, async_mode=mode), [model], opt) as manager:
        manager.save(1)
        _train(model, opt)  # changes the tensors right after save() returned
        manager.save(2)
        expected = _snapshot(model, opt)
        _train(model, opt)
        manager.wait()
    fresh, fresh_opt = _job(seed=1)
    with CheckpointManager(_config(url, staging, verify_on_load=True), [fresh], fresh_opt) as manager:
        assert manager.load()
    _assert_equal(_snapshot(fresh, fresh_opt), expected)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ckpt-s3")]  # close() let them go


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_save_and_resume_are_bit_identical(bucket, tmp_path, mode):
    spawn(2, _save_then_resume, f"s3://{bucket}/run", str(tmp_path), mode)
    objects = _objects(bucket)
    assert {k.split("/")[1] for k in objects} == {"step-2"}  # retention deleted step 1, marker first
    marker = json.loads(boto3.client("s3").get_object(Bucket=bucket, Key="run/step-2/COMMITTED.json")["Body"].read())
    assert marker["world_size"] == 2 and marker["states"] == ["model", "optimizer"]
    data = {k.split("/", 2)[2]: n for k, n in objects.items() if not k.endswith(commit.MARKER)}
    assert {rel: e["size"] for rel, e in marker["files"].items()} == data
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(data)  # both ranks uploaded
    assert max(data.values()) > 5 << 20  # one file went up in several parts


def _crash(rank, world_size, url, staging, failpoint, expected=None):
    """Saves step 1 (its state written to the file `expected` too, when given), then dies at
    `failpoint` while saving step 2."""
    os.environ["RANK"] = str(rank)  # which rank a fail point names
    os.environ[faults.ENV] = failpoint
    model, opt = _job()
    _train(model, opt)
    if expected and rank == 0:  # the ranks resuming compare with it, not with a step of their own arithmetic
        torch.save(_snapshot(model, opt), expected)
    with CheckpointManager(_config(url, staging), [model], opt) as manager:
        manager.save(1)
        _train(model, opt)
        manager.save(2)


def _resume_step_1(rank, world_size, url, staging, expected):
    expected = torch.load(expected, weights_only=True)
    fresh, fresh_opt = _job(seed=1)
    with CheckpointManager(_config(url, staging, verify_on_load=True), [fresh], fresh_opt) as manager:
        assert manager.load()
        _assert_equal(_snapshot(fresh, fresh_opt), expected)
        manager.save(2)  # the leftover of the killed save is replaced


def test_a_load_keeps_a_partial_step_newer_than_the_one_it_loaded(bucket, tmp_path):
    """No lock tells that no other job is saving into a URL: a job that saves deletes at
    `load()` what retention would after a save of the step it loaded (the older partial step),
    but not a partial step newer than it, which a file system's locked folder would lose."""
    url = f"s3://{bucket}/run"
    s3 = boto3.client("s3")
    model, opt = _job()
    for step in (1, 3):
        s3.put_object(Bucket=bucket, Key=f"run/step-{step + 1}/IN_PROGRESS.json", Body=b"{}")
    with CheckpointManager(_config(url, str(tmp_path / "a"), keep_latest_k=2), [model], opt) as manager:
        manager.save(3)
    assert {k for k in _objects(bucket) if k.endswith(".json")} == {"run/step-3/COMMITTED.json",
                                                                  "run/step-4/IN_PROGRESS.json"}
    s3.put_object(Bucket=bucket, Key="run/step-2/IN_PROGRESS.json", Body=b"{}")
    with CheckpointManager(_config(url, str(tmp_path / "b"), keep_latest_k=2), [model], opt) as manager:
        assert manager.load()
    assert {k for k in _objects(bucket) if k.endswith(".json")} == {"run/step-3/COMMITTED.json",
                                                                  "run/step-4/IN_PROGRESS.json"}


@pytest.mark.parametrize("failpoint", ["prepare@2", "write@2:1", "upload@2:1", "commit@2"])
def test_a_kill_during_a_save_leaves_the_previous_step_loadable(bucket, tmp_path, failpoint):
    url = f"s3://{bucket}/run"
    with pytest.raises(ProcessException):
        spawn(2, _crash, url, str(tmp_path / "a"), failpoint, str(tmp_path / "step-1.pt"))
    names = _objects(bucket)
    assert "run/step-1/COMMITTED.json" in names
    assert "run/step-2/COMMITTED.json" not in names and "run/step-2/IN_PROGRESS.json" in names
    if failpoint.startswith("upload"):
        assert "run/step-2/__1_0.distcp" in names  # rank 1's data is up, the step is still invisible
    if failpoint.startswith("commit"):  # its .metadata is up and names the save the mark names: ours, partial
        s3 = boto3.client("s3")
        mark = s3.get_object(Bucket=bucket, Key="run/step-2/IN_PROGRESS.json")["Body"].read()
        metadata = s3.get_object(Bucket=bucket, Key="run/step-2/.metadata")["Body"].read()
        assert pickle.loads(metadata).storage_meta.save_id == commit.mark_id(mark)  # our own bytes: trusted
        initial = _config(str(tmp_path / "c"), str(tmp_path / "d"), initial_load_path=f"{url}/step-2")
        with pytest.raises(CheckpointNotFoundError, match="its save did not finish"), \
                CheckpointManager(initial, [torch.nn.Linear(2, 2)]) as manager:
            manager.load()
    spawn(2, _resume_step_1, url, str(tmp_path / "b"), str(tmp_path / "step-1.pt"))
    assert {k for k in _objects(bucket) if k.endswith(".json")} == {"run/step-2/COMMITTED.json"}


def test_a_kill_while_deleting_an_old_step_leaves_it_partial(bucket, tmp_path):
    url = f"s3://{bucket}/run"
    with pytest.raises(ProcessException):
        spawn(2, _crash, url, str(tmp_path / "a"), "purge@1")
    names = _objects(bucket)
    assert "run/step-2/COMMITTED.json" in names and "run/step-1/COMMITTED.json" not in names
    assert "run/step-1/.metadata" in names  # its marker went first
    assert "run/step-1/IN_PROGRESS.json" in names  # after it was marked in progress: partial, not unknown


def _flaky():
    """Every other new request fails its first try: throttled, a 500 or a reset connection in
    turn (its retry goes through, so the test does not depend on how the ranks interleave)."""
    seen: set = set()
    kinds = itertools.cycle(["slowdown", None, "internal", None, "reset", None])

    def plan(n: int, method: str, path: str) -> str | None:
        if (method, path) in seen:
            return None
        seen.add((method, path))
        return next(kinds)

    return plan


def _save_then_resume_through(plan, bucket, tmp_path, monkeypatch, moto_url) -> FaultProxy:
    """`_save_then_resume` on 2 ranks through a `FaultProxy` following `plan`; the proxy, closed."""
    proxy = FaultProxy(moto_url, plan)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        spawn(2, _save_then_resume, f"s3://{bucket}/run", str(tmp_path), "disabled")
    finally:
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)
    return proxy


def test_throttling_5xx_and_resets_are_retried(bucket, tmp_path, monkeypatch, moto_url):
    proxy = _save_then_resume_through(_flaky(), bucket, tmp_path, monkeypatch, moto_url)
    assert min(proxy.injected[k] for k in ("slowdown", "internal", "reset")) >= 3, proxy.injected
    assert "run/step-2/COMMITTED.json" in _objects(bucket)


def test_a_download_cut_short_is_retried(bucket, tmp_path, monkeypatch, moto_url):
    """The first answer to each ranged GET closes the connection half-way through its body (a clean
    close: botocore's `read(n)` returns what came): it was reported as a short object, not retried."""
    seen: set = set()

    def plan(n: int, method: str, path: str) -> str | None:
        if method != "GET" or "?" in path or path in seen:  # object reads, not listings
            return None
        seen.add(path)
        return "cut"

    proxy = _save_then_resume_through(plan, bucket, tmp_path, monkeypatch, moto_url)
    assert proxy.injected["cut"] >= 4, proxy.injected


def _save_fails(rank, world_size, url, staging):
    model, opt = _job()
    with CheckpointManager(_config(url, staging, storage_retries=1), [model], opt) as manager:
        with pytest.raises(CheckpointSaveError, match=rf"saving step 1 to {url}/step-1 failed( on rank 1)?: .*SlowDown"):
            manager.save(1)


def test_a_store_that_keeps_failing_fails_the_save_on_every_rank(bucket, tmp_path, monkeypatch, moto_url):
    """Rank 1's data uploads are always throttled: after its retries, both ranks raise, and the
    step has no marker."""
    proxy = FaultProxy(moto_url, lambda n, method, path: "slowdown" if "__1_0" in path else None)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        spawn(2, _save_fails, f"s3://{bucket}/run", str(tmp_path))
    finally:
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)
    assert proxy.injected["slowdown"] == 2, [s for s in proxy.seen if s[2]]  # the first try and one retry
    assert "run/step-1/COMMITTED.json" not in _objects(bucket)
    assert not glob.glob(os.path.join(tmp_path, "*", "rank-*", "step-1"))  # no staged copy left behind


def test_a_step_whose_in_progress_marker_cannot_be_deleted_is_saved(bucket, tmp_path, monkeypatch, moto_url, caplog):
    """The commit marker is stored, then deleting the in-progress one keeps failing: the step is
    committed (its marker decides), so the save succeeds and says what is left over; it was a
    failed save of a step that every load then took."""
    url = f"s3://{bucket}/run"
    committed = []

    def plan(n: int, method: str, path: str) -> str | None:  # every delete after the marker's upload fails
        if method == "PUT" and path.split("?")[0].endswith("/step-1/COMMITTED.json"):
            committed.append(n)
        return "internal" if committed and method == "POST" and "delete" in path else None

    proxy = FaultProxy(moto_url, plan)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    model, opt = _job()
    try:
        with CheckpointManager(_config(url, str(tmp_path / "a"), storage_retries=0, keep_latest_k=0), [model],
                               opt) as manager:
            manager.save(1)
    finally:
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)
    assert proxy.injected["internal"] >= 1
    assert {"run/step-1/COMMITTED.json", "run/step-1/IN_PROGRESS.json"} <= set(_objects(bucket))
    assert "step-1 is committed, but its in-progress marker is left over" in caplog.text
    fresh, fresh_opt = _job(seed=1)
    with CheckpointManager(_config(url, str(tmp_path / "b"), load_only=True), [fresh], fresh_opt) as manager:
        assert manager.load()
    _assert_equal(_snapshot(fresh, fresh_opt), _snapshot(model, opt))


def _load_fails_on_one_rank(rank, world_size, url, staging, proxy_url, what):
    if rank == 1:  # this node's endpoint fails; rank 0's answers
        os.environ["AWS_ENDPOINT_URL"] = proxy_url
    model, opt = _job(seed=1)
    start = time.monotonic()
    # load_only: no read of the marker to tell a model-only step first (that one is agreed on already)
    config = _config(url, staging, storage_retries=0, collective_timeout_s=60, verify_on_load=False, load_only=True)
    with CheckpointManager(config, [model], opt) as manager:
        with pytest.raises(CheckpointError, match=f"{what}.*InternalError" if rank == 1 else f"on rank 1: .*{what}"):
            manager.load()
    assert time.monotonic() - start < 45  # not the collective's timeout


@pytest.mark.parametrize("what, failing", [
    ("listing", lambda method, path: method == "GET" and "list-type=2" in path),
    ("COMMITTED.json", lambda method, path: method == "GET" and path.split("?")[0].endswith("/step-1/COMMITTED.json")),
    (".metadata", lambda method, path: method == "GET" and path.split("?")[0].endswith("/step-1/.metadata")),
])
def test_a_store_failing_on_one_rank_fails_the_load_on_every_rank_at_once(bucket, tmp_path, moto_url, what,
                                                                           failing):
    """Each of a load's reads before its first collective (the listing, the marker, DCP's
    `.metadata`) failing on rank 1 alone: rank 0 hears of it at once, not after
    collective_timeout_s of waiting with a timeout error that does not say why."""
    url = f"s3://{bucket}/run"
    model, opt = _job()
    _train(model, opt)
    with CheckpointManager(_config(url, str(tmp_path / "a")), [model], opt) as manager:
        manager.save(1)
    proxy = FaultProxy(moto_url, lambda n, method, path: "internal" if failing(method, path) else None)
    try:
        spawn(2, _load_fails_on_one_rank, url, str(tmp_path / "b"), proxy.url, re.escape(what))
    finally:
        proxy.close()
    assert proxy.injected["internal"] >= 1


@pytest.mark.parametrize("folder, env, message", [
    ("s3://no-such-bucket/run", {}, "404"),
    ("s3://{bucket}/run", {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None,
                           "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
                           "AWS_EC2_METADATA_DISABLED": "true"}, "NoCredentialsError"),
])
def test_an_unusable_bucket_fails_at_start_up_naming_the_url(bucket, tmp_path, monkeypatch, folder, env, message):
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    url = folder.format(bucket=bucket)
    model, opt = _job()
    with pytest.raises(ConfigError, match=rf"checkpoint.folder = '{url}': the bucket cannot be used: .*{message}"):
        CheckpointManager(_config(url, str(tmp_path), storage_retries=0), [model], opt)


def test_an_endpoint_failing_with_server_errors_at_start_up_is_told_apart_from_a_bad_bucket(bucket, tmp_path,
                                                                                            proxied):
    """Every request answered 500: the ConfigError told the user to check the bucket's name, the
    endpoint and the credentials, which were right."""
    url = f"s3://{bucket}/run"
    proxied(lambda n, method, path: "internal")
    model, opt = _job()
    with pytest.raises(ConfigError, match=rf"checkpoint.folder = '{url}': the bucket cannot be used: .*\(500\).*"
                                          r"The endpoint answered HTTP 500, a server error, through "
                                          r"checkpoint.storage_retries = 1 retries: it is reached, and failing"):
        CheckpointManager(_config(url, str(tmp_path), storage_retries=1), [model], opt)


def test_an_endpoint_that_never_answers_fails_after_storage_timeout_s_per_try(bucket, tmp_path, monkeypatch):
    """A proxy or load balancer that takes the connection and stays silent: each try gives up
    after `storage_timeout_s` (botocore's own default waits 60 s a try)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:%d" % silent.getsockname()[1])
    model, opt = _job()
    start = time.monotonic()
    try:
        with pytest.raises(ConfigError, match=r"the bucket cannot be used: .*timeout"):
            CheckpointManager(_config(f"s3://{bucket}/run", str(tmp_path), storage_retries=1, storage_timeout_s=1),
                              [model], opt)
    finally:
        silent.close()
    assert time.monotonic() - start < 40  # 2 tries of 1 s, with backoff; botocore's default: 120 s


@pytest.mark.parametrize("endpoint", ["http://ckptuser:s3cr3t@127.0.0.1:{closed}", "http://ckptuser:s3cr3t@127.0.0.1:{silent}",
                                      "ckptuser:s3cr3t@127.0.0.1"], ids=["refused", "silent", "no-scheme"])
def test_a_password_in_the_endpoint_url_is_in_no_message_traceback_or_log(bucket, tmp_path, monkeypatch, caplog,
                                                                          endpoint):
    """botocore writes the endpoint URL as given into its connection errors, which ours quoted
    (and chained): `user:password@` reached the ConfigError, its traceback, its pickle (sent to
    every rank) and the log of a background save."""
    closed, silent = socket.socket(), socket.socket()
    for s in (closed, silent):
        s.bind(("127.0.0.1", 0))
    silent.listen(16)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint.format(closed=closed.getsockname()[1],
                                                           silent=silent.getsockname()[1]))
    model, opt = _job()
    caplog.set_level(logging.DEBUG, logger="torchtitan_ckpt")
    try:
        with pytest.raises(ConfigError, match=r"\*\*\*@127\.0\.0\.1") as failed:
            CheckpointManager(_config(f"s3://{bucket}/run", str(tmp_path), storage_retries=0, storage_timeout_s=1),
                              [model], opt)
    finally:
        closed.close()
        silent.close()
    told = ["".join(traceback.format_exception(failed.value)), caplog.text,
            pickle.dumps(failed.value).decode("latin-1")]
    assert not [t for t in told if "s3cr3t" in t or "ckptuser" in t], told


@pytest.mark.parametrize("key, value, message", [
    ("folder", "gs://bucket/run", "gs:// is not a supported storage"),
    ("folder", "s3:///run", "no bucket given"),
    ("initial_load_path", "hdfs://x/y", "hdfs:// is not a supported storage"),
    ("upload_part_size", "1MB", "parts of 5MiB to 5GiB"),
])
def test_config_refuses_what_storage_cannot_do(key, value, message):
    config = Checkpoint(**{key: value})
    with pytest.raises(ConfigError, match=message):
        config.validate()


def test_a_two_phase_hugging_face_export_to_object_storage_is_refused_at_start_up():
    config = Checkpoint(folder="s3://b/run", last_save_in_hf=True, consolidation="rank0")
    with pytest.raises(ConfigError, match="checkpoint.consolidation = 'rank0': .* set checkpoint.consolidation"):
        config.validate()


def _hf_model(seed: int, world_size: int):
    model = build_model(load_job_config(DEBUG_CONFIG, []))
    if seed:
        torch.manual_seed(seed)  # the same noise on every rank
        perturbed(model)
    shard_model(model, world_size)
    return model


def _export_hf(rank, world_size, url, staging, expected, failpoint):
    if failpoint:
        os.environ["RANK"] = str(rank)
        os.environ[faults.ENV] = failpoint
    model = _hf_model(3, world_size)
    config = _config(url, staging, last_save_in_hf=True, last_save_model_only=True, hf_max_shard_size="200KB")
    with CheckpointManager(config, [model], state_dict_adapter=hf_adapter(model.args)) as manager:
        manager.save(1, last_step=True)
    out = logits(model, TOKENS)
    if rank == 0:
        torch.save(out, expected)


def _load_hf_step(rank, world_size, url, staging, expected):
    model = _hf_model(0, world_size)
    with CheckpointManager(_config(url, staging), [model], state_dict_adapter=hf_adapter(model.args)) as manager:
        assert manager.load()
    assert (logits(model, TOKENS) - torch.load(expected)).abs().max() < 1e-5


def _download(bucket: str, prefix: str, to) -> None:
    client = boto3.client("s3")
    for key in _objects(bucket):
        if key.startswith(prefix + "/"):
            client.download_file(bucket, key, str(to / key[len(prefix) + 1:]))


def test_a_hugging_face_export_to_object_storage_loads_in_transformers(bucket, tmp_path):
    """Files written jointly by 2 ranks, each assembled on one rank and uploaded from there;
    read back by safetensors and transformers after a download, and by the manager from the
    store."""
    from safetensors.torch import load_file

    transformers = pytest.importorskip("transformers")
    url, expected = f"s3://{bucket}/run", str(tmp_path / "logits.pt")
    spawn(2, _export_hf, url, str(tmp_path / "a"), expected, "")
    names = {k.split("/", 2)[2] for k in _objects(bucket)}
    files = sorted(n for n in names if n.endswith(".safetensors"))
    assert len(files) >= 2 and {"COMMITTED.json", "config.json", "model.safetensors.index.json"} < names
    marker = json.loads(boto3.client("s3").get_object(Bucket=bucket, Key="run/step-1/COMMITTED.json")["Body"].read())
    assert marker["format"] == "hf" and set(marker["files"]) == names - {"COMMITTED.json"}
    (tmp_path / "hf").mkdir()
    _download(bucket, "run/step-1", tmp_path / "hf")
    assert commit.verify(str(tmp_path / "hf")) == []  # sizes and CRC-32s of what each owner uploaded
    with open(tmp_path / "hf" / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    loaded = {k: v for name in files for k, v in load_file(str(tmp_path / "hf" / name)).items()}
    assert sorted(loaded) == sorted(weight_map) and not any(torch.count_nonzero(v) == 0 for v in loaded.values())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert (logits(hf, TOKENS) - torch.load(expected)).abs().max() < 1e-5
    spawn(2, _load_hf_step, url, str(tmp_path / "b"), expected)


def test_a_kill_during_a_hugging_face_upload_leaves_no_index_and_no_marker(bucket, tmp_path):
    with pytest.raises(ProcessException):
        spawn(2, _export_hf, f"s3://{bucket}/run", str(tmp_path), str(tmp_path / "logits.pt"), "upload@1:0")
    names = {k.split("/", 2)[2] for k in _objects(bucket)}
    assert any(n.startswith("model-00001-of-") for n in names)  # rank 0 died right after uploading it
    assert names.isdisjoint({"model.safetensors.index.json", "COMMITTED.json"}) and "IN_PROGRESS.json" in names


def _publish_joint(rank, world_size, url, staging, sparse):
    """A 11 MiB file, each rank writing every other MiB of it shifted by 100 bytes (so that the
    ranks' stretches share blocks), into a copy with holes (`sparse`, as the HF export leaves)
    or zeros elsewhere. Rank 0 assembles it: the bytes rank 1 sends it are checked."""
    sent = []
    logger = logging.getLogger("torchtitan_ckpt.storage.s3")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler := logging.Handler())
    handler.emit = lambda record: sent.extend(re.findall(r"^rank \d+ sent (\d+) bytes", record.getMessage()))
    store = S3Store(url, "checkpoint.folder", rank, _config(url, staging))
    path = os.path.join(store.root, "step-1")
    store.prepare_rank(path)
    data = torch.arange(11 << 20, dtype=torch.int64).remainder(251).to(torch.uint8).numpy()
    fd = os.open(os.path.join(path, "joint.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.ftruncate(fd, 11 << 20)
    if not sparse:
        os.pwrite(fd, bytes(11 << 20), 0)
    for mib in range(rank, 11, world_size):
        start, end = (mib << 20) + 100 if mib else 0, min(11 << 20, ((mib + 1) << 20) + 100)
        os.pwrite(fd, data[start:end].tobytes(), start)
    os.close(fd)
    uploaded = store.publish(path, {}, CheckpointGroup(), joint=["joint.bin"])
    assert uploaded == ({"joint.bin": (11 << 20, f"{zlib.crc32(data):08x}")} if rank == 0 else {})
    if rank == 0:
        assert sent == ["0"]
    elif sparse:  # its own 5 MiB, in whole blocks
        assert (5 << 20) <= int(sent[0]) <= (5 << 20) + 5 * 65536, sent
    else:  # a copy with no holes: all of it
        assert sent == [str(11 << 20)]


@pytest.mark.parametrize("sparse", [True, False])
def test_a_joint_file_is_assembled_across_ranks_in_several_parts(bucket, tmp_path, sparse):
    spawn(2, _publish_joint, f"s3://{bucket}/run", str(tmp_path), sparse)
    body = boto3.client("s3").get_object(Bucket=bucket, Key="run/step-1/joint.bin")["Body"].read()
    assert body == bytes(torch.arange(11 << 20, dtype=torch.int64).remainder(251).to(torch.uint8).numpy())


def _upload_measured(rank, world_size, url, staging):
    """A 32 MiB file uploaded in 5 MiB parts, 2 at a time, with the Python allocations traced
    (in a process of its own: the server's are not counted)."""
    store = S3Store(url, "checkpoint.folder", rank, _config(url, staging))
    path = os.path.join(store.root, "step-1")
    store.prepare_rank(path)
    data = torch.arange(32 << 20, dtype=torch.int64).remainder(253).to(torch.uint8).numpy()
    data.tofile(os.path.join(path, "big.bin"))
    completed: list[list[dict]] = []  # what the completion request names, as botocore sends it
    store.client.meta.events.register("before-parameter-build.s3.CompleteMultipartUpload",
                                      lambda params, **_: completed.append(params["MultipartUpload"]["Parts"]))
    tracemalloc.start()
    try:
        uploaded = store.publish(path, {}, CheckpointGroup())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert uploaded == {"big.bin": (32 << 20, f"{zlib.crc32(data):08x}")}
    assert peak <= 2 * (5 << 20) + (1 << 20), peak  # part size x parallel parts + the documented slack
    # S3 refuses a completion that omits a part's checksum once the upload declared an algorithm
    body = data.tobytes()
    assert [(p["PartNumber"], p["ChecksumCRC32"]) for p in completed[0]] == [
        (n + 1, base64.b64encode(zlib.crc32(body[i:i + (5 << 20)]).to_bytes(4, "big")).decode())
        for n, i in enumerate(range(0, len(body), 5 << 20))]


def test_an_upload_holds_at_most_part_size_times_parallel_parts_and_each_part_is_checked(bucket, tmp_path):
    spawn(1, _upload_measured, f"s3://{bucket}/run", str(tmp_path))
    client = boto3.client("s3")
    body = client.get_object(Bucket=bucket, Key="run/step-1/big.bin")["Body"].read()
    assert body == bytes(torch.arange(32 << 20, dtype=torch.int64).remainder(253).to(torch.uint8).numpy())
    # every part went up with its CRC-32, which the server checked and combined (S3's composite checksum)
    parts = [zlib.crc32(body[i:i + (5 << 20)]).to_bytes(4, "big") for i in range(0, len(body), 5 << 20)]
    composite = base64.b64encode(zlib.crc32(b"".join(parts)).to_bytes(4, "big")).decode()
    head = client.head_object(Bucket=bucket, Key="run/step-1/big.bin", ChecksumMode="ENABLED")
    assert head["ChecksumCRC32"].partition("-")[0] == composite  # AWS adds "-{parts}"


def _own_disk(rank, world_size, tmp):
    """Each rank mounts its own folder at the same path, as a node-local disk would be."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS: this rank's own mount table
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    own = os.path.join(tmp, f"disk-{rank}")
    os.makedirs(own)
    subprocess.run(["mount", "--bind", own, os.path.join(tmp, "local")], check=True)
    model, opt = _job()
    config = Checkpoint(enable=True, folder=os.path.join(tmp, "local", "ckpt"))
    with pytest.raises(ConfigError, match=r"rank 0 does not see the files rank\(s\) \[1\] wrote there: the "
                                          r"folder is not shared by every rank .*s3://bucket/prefix"):
        CheckpointManager(config, [model], opt)


def _shared_disk(rank, world_size, tmp):
    model, opt = _job()
    CheckpointManager(Checkpoint(enable=True, folder=os.path.join(tmp, "ckpt")), [model], opt).close()
    dist.barrier()
    assert os.listdir(os.path.join(tmp, "ckpt")) == [LOCK_FILE]  # the probes are gone


def test_a_folder_the_ranks_do_not_share_is_refused_at_start_up(tmp_path):
    os.makedirs(tmp_path / "local")
    spawn(2, _own_disk, str(tmp_path))
    spawn(2, _shared_disk, str(tmp_path))


def test_initial_load_path_on_object_storage(bucket, tmp_path):
    model, opt = _job()
    _train(model, opt)
    with CheckpointManager(_config(f"s3://{bucket}/a", str(tmp_path / "a")), [model], opt) as manager:
        manager.save(1)
    fresh, fresh_opt = _job(seed=1)
    config = _config(str(tmp_path / "local"), str(tmp_path / "b"), initial_load_path=f"s3://{bucket}/a/step-1",
                     initial_load_model_only=False)
    with CheckpointManager(config, [fresh], fresh_opt) as manager:
        assert manager.load()
    _assert_equal(_snapshot(fresh, fresh_opt), _snapshot(model, opt))


def _save_sharded(rank, world_size, url, staging):
    with CheckpointManager(_config(url, staging), [_hf_model(3, world_size)]) as manager:
        manager.save(1)


def _load_sharded(rank, world_size, url, staging):
    model = _hf_model(0, world_size)
    with CheckpointManager(_config(url, staging), [model]) as manager:
        assert manager.load()
        here = os.listdir(os.path.join(staging, quote(url, safe=""), f"rank-{rank}", "step-1"))  # until close()
    assert sorted(here) == sorted([".metadata", "COMMITTED.json", f"__{rank}_0.distcp"])  # not the other rank's
    saved = _hf_model(3, world_size).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value.to_local(), saved[key].to_local()), key


def test_each_rank_downloads_only_the_bytes_its_load_plan_reads(bucket, tmp_path, monkeypatch, moto_url):
    """An FSDP model resumed on the same 2 ranks: each rank's shards are in its own data file,
    and that file's item bytes are all that is fetched of it (the whole step on each rank was
    twice the step)."""
    url = f"s3://{bucket}/run"
    spawn(2, _save_sharded, url, str(tmp_path / "a"))
    proxy = FaultProxy(moto_url, lambda n, method, path: None)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        spawn(2, _load_sharded, url, str(tmp_path / "b"))
    finally:
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)
    (tmp_path / "c").mkdir()
    _download(bucket, "run/step-1", tmp_path / "c")
    used = data_file_use(str(tmp_path / "c"))
    small = {n: os.path.getsize(tmp_path / "c" / n) for n in (".metadata", "COMMITTED.json")}
    assert {path: n for path, n in proxy.served.items() if "/step-1/" in path} == {
        **{f"/{bucket}/run/step-1/{n}": 2 * size for n, size in small.items()},  # every rank reads these
        f"/{bucket}/run/step-1/COMMITTED.json": 3 * small["COMMITTED.json"],  # rank 0 lists what it names, too
        **{f"/{bucket}/run/step-1/{n}": item_bytes for n, (item_bytes, _) in used.items()}}


def _cli_json(capsys, *argv: str) -> tuple[int, dict]:
    code = cli.main([*argv, "--json", "--quiet"])
    out = capsys.readouterr()
    return code, json.loads(out.out) if out.out else out.err


def test_the_cli_lists_inspects_and_verifies_steps_on_object_storage(bucket, tmp_path, capsys):
    url, client = f"s3://{bucket}/run", boto3.client("s3")
    model, opt = _job()
    _train(model, opt)
    with CheckpointManager(_config(url, str(tmp_path), keep_latest_k=2), [model], opt) as manager:
        manager.save(1)
        manager.save(2)
    client.delete_object(Bucket=bucket, Key="run/step-2/COMMITTED.json")  # as a save that died
    client.put_object(Bucket=bucket, Key="run/step-2/IN_PROGRESS.json", Body=b"{}")
    sizes = {step: sum(n for k, n in _objects(bucket).items() if k.startswith(f"run/step-{step}/")) for step in (1, 2)}

    code, doc = _cli_json(capsys, "list", url)
    assert (code, doc["latest_complete"]) == (0, 1)
    assert [(s["step"], s["path"], s["status"], s["bytes"], s["format"], s["states"]) for s in doc["steps"]] == [
        (1, f"{url}/step-1", "complete", sizes[1], "dcp", ["model", "optimizer"]),
        (2, f"{url}/step-2", "partial", sizes[2], None, None)]

    code, doc = _cli_json(capsys, "inspect", f"{url}/step-1")
    assert (code, doc["path"], doc["status"], doc["step"]) == (0, f"{url}/step-1", "complete", 1)
    assert {t["key"]: t["shape"] for t in doc["tensors"]}["0.weight"] == [1200, 1200]
    assert _cli_json(capsys, "inspect", f"{url}/step-2")[1]["status"] == "partial"

    code, doc = _cli_json(capsys, "verify", f"{url}/step-1")
    names = sorted(k.split("/")[-1] for k in _objects(bucket) if k.startswith("run/step-1/") and "COMMITTED" not in k)
    assert (code, doc["ok"], [f["file"] for f in doc["files"]]) == (0, True, names)
    data = "run/step-1/__0_0.distcp"
    body = bytearray(client.get_object(Bucket=bucket, Key=data)["Body"].read())
    body[-1] ^= 0xFF
    client.put_object(Bucket=bucket, Key=data, Body=bytes(body))
    code, doc = _cli_json(capsys, "verify", f"{url}/step-1")
    assert (code, [f["file"] for f in doc["files"] if not f["ok"]]) == (1, ["__0_0.distcp"])
    problems = [f["problem"] for f in doc["files"] if not f["ok"]]
    assert len(problems) == 1 and problems[0].startswith(f"s3://{bucket}/{data}: "), problems

    code, err = _cli_json(capsys, "list", "s3://no-such-bucket/run")
    assert code == 2 and "folder = 's3://no-such-bucket/run': the bucket cannot be used" in err


def test_the_cli_converts_from_object_storage(bucket, tmp_path):
    """An HF folder in the bucket -> DCP (local) -> HF (local): the same tensors as the source."""
    from safetensors.torch import load_file

    model = perturbed(build_model(load_job_config(DEBUG_CONFIG, [])))
    save_hf(model.state_dict(), str(tmp_path / "hf"), hf_adapter(model.args))
    client = boto3.client("s3")
    for name in os.listdir(tmp_path / "hf"):
        client.upload_file(str(tmp_path / "hf" / name), bucket, f"hf/{name}")
    assert cli.main(["convert", "--to", "dcp", f"s3://{bucket}/hf", str(tmp_path / "dcp"), "--quiet"]) == 0
    assert cli.main(["convert", "--to", "hf", str(tmp_path / "dcp"), str(tmp_path / "back"), "--quiet"]) == 0
    name = "model-00001-of-00001.safetensors"
    assert_same(load_file(str(tmp_path / "back" / name)), load_file(str(tmp_path / "hf" / name)))


def _upload(bucket: str, folder, prefix: str) -> None:
    for name in os.listdir(folder):
        boto3.client("s3").upload_file(os.path.join(folder, name), bucket, f"{prefix}/{name}")


def test_the_cli_inspects_a_run_folder_without_downloading_its_steps(bucket, tmp_path, proxied, capsys):
    """`inspect s3://bucket/run` (a run's folder, not a step's): only the files that would tell
    a step are asked for (none is there), then an error naming the URL; nothing under a step is
    downloaded."""
    model, opt = _job()
    with CheckpointManager(_config(f"s3://{bucket}/run", str(tmp_path)), [model], opt) as manager:
        manager.save(1)
    proxy = proxied(lambda n, method, path: None)
    code, err = _cli_json(capsys, "inspect", f"s3://{bucket}/run")
    assert (code, err) == (2, f"error: s3://{bucket}/run holds no checkpoint: no .metadata (DCP), no "
                              "model.safetensors.index.json or model.safetensors (Hugging Face); name a step folder\n")
    assert [path for path in proxy.served if "/step-1/" in path] == []


def test_the_cli_inspects_another_programs_steps_with_the_status_list_gives_them(bucket, tmp_path, capsys):
    """Object storage tells a step by its markers alone (docs/storage.md): another program's DCP
    step and Hugging Face export, without our markers, are `unknown` to `list` and `inspect`
    alike; inspect still shows what they hold."""
    from safetensors import safe_open

    dcp.save({"w": torch.ones(2, 3)}, checkpoint_id=str(tmp_path / "dcp"))
    _upload(bucket, tmp_path / "dcp", "run/step-5")
    model = build_model(load_job_config(DEBUG_CONFIG, []))
    save_hf(model.state_dict(), str(tmp_path / "hf"), hf_adapter(model.args))
    _upload(bucket, tmp_path / "hf", "run/step-7")
    code, doc = _cli_json(capsys, "list", f"s3://{bucket}/run")
    assert (code, [(s["step"], s["status"]) for s in doc["steps"]]) == (1, [(5, "unknown"), (7, "unknown")])

    code, doc = _cli_json(capsys, "inspect", f"s3://{bucket}/run/step-5")
    assert (code, doc["status"], doc["format"], [t["key"] for t in doc["tensors"]]) == (0, "unknown", "dcp", ["w"])
    code, doc = _cli_json(capsys, "inspect", f"s3://{bucket}/run/step-7/")
    with safe_open(str(tmp_path / "hf" / "model-00001-of-00001.safetensors"), "pt") as f:
        names = sorted(f.keys())
    assert (code, doc["path"], doc["status"], doc["format"]) == (0, f"s3://{bucket}/run/step-7/", "unknown", "hf")
    assert [t["key"] for t in doc["tensors"]] == names


@pytest.mark.parametrize("url", ["s3://", "s3:///run"])
def test_a_url_without_a_bucket_is_refused(url):
    with pytest.raises(ConfigError, match=re.escape(f"url = {url!r}: expected s3://bucket/prefix (no bucket given)")):
        split_url(url)


def test_the_example_job_names_its_object_storage_folder_as_a_url(bucket, tmp_path):
    log = run_job(str(tmp_path / "job"), "--training.steps", "2", "--checkpoint.interval", "2",
                  "--checkpoint.folder", f"s3://{bucket}/ex1", "--checkpoint.staging_folder", str(tmp_path / "stage"))
    assert f"done at step 2; checkpoints in s3://{bucket}/ex1\n" in log, log


# ---------------------------------------------------------------------------- one store, a hostile server

def _store(bucket: str, staging, **over) -> tuple[S3Store, str]:
    """Rank 0's store of `s3://bucket/run` (in this process), and its local folder of step 1."""
    url = f"s3://{bucket}/run"
    store = S3Store(url, "checkpoint.folder", 0, _config(url, str(staging), **over))
    return store, os.path.join(store.root, "step-1")


@pytest.fixture
def proxied(moto_url, monkeypatch):
    """`proxied(plan, edit)`: a `FaultProxy` in front of the server, which the stores made
    after it reach."""
    proxies = []

    def make(plan, edit=None) -> FaultProxy:
        proxies.append(FaultProxy(moto_url, plan, edit))
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxies[-1].url)
        return proxies[-1]

    yield make
    for proxy in proxies:
        proxy.close()


@pytest.mark.parametrize("wanted, message", [
    ({"data": [(2**62, 2**62)]}, r"data: the step's metadata reads 4611686018427387904 bytes at 4611686018427387904, "
                                 r"outside its 100 bytes"),
    ({"data": [(1 << 30, 10)]}, r"data: .* reads 10 bytes at 1073741824, outside its 100 bytes"),
    ({"data": [(0, 10), (60, 41)]}, r"data: .* reads 41 bytes at 60, outside its 100 bytes"),
    ({"data": [(-1, 10)]}, r"data: .* reads 10 bytes at -1, outside"),
    ({"data": [(0, 1.5)]}, r"data: .* reads 1.5 bytes at 0, outside"),
    ({"data": [(0, 10)], "other": [(0, 1)]}, r"other: the step's metadata reads this object, which the store does "
                                             r"not hold"),
], ids=["huge", "past", "across", "negative", "float", "missing"])
def test_a_range_outside_its_object_is_refused_before_anything_is_downloaded(bucket, tmp_path, wanted, message):
    """Ranges come from the step's `.metadata`: a crafted one (2**62 bytes at 2**62) must not
    make the store cut 2**40 pieces or ask the server for bytes that are not there."""
    boto3.client("s3").put_object(Bucket=bucket, Key="run/step-1/data", Body=bytes(100))
    store, path = _store(bucket, tmp_path)
    with pytest.raises(CorruptCheckpointError, match=rf"^s3://{bucket}/run/step-1/{message}"):
        store.fetch_ranges(path, wanted)
    assert not os.path.exists(os.path.join(path, "data"))


def test_a_server_that_ignores_the_range_is_read_no_further_than_it(bucket, tmp_path, proxied):
    boto3.client("s3").put_object(Bucket=bucket, Key="run/step-1/data", Body=bytes(1 << 20))
    proxied(lambda n, method, path: "whole" if method == "GET" and path.endswith("/step-1/data") else None)
    store, path = _store(bucket, tmp_path)
    bodies = []
    store.client.meta.events.register("after-call.s3.GetObject", lambda parsed, **_: bodies.append(parsed["Body"]))
    with pytest.raises(StorageError, match=rf"s3://{bucket}/run/step-1/data: asked for 10 bytes at 100, got more"):
        store.fetch_ranges(path, {"data": [(100, 10)]})
    assert [body.tell() for body in bodies] == [11]  # not the whole MiB the server sent


def test_a_download_cut_short_every_time_fails_after_its_retries(bucket, tmp_path, proxied):
    """Only a download retried into success was tested: one cut every time ends, after
    `storage_retries`, in our error naming the object, not in a hang or a short read."""
    boto3.client("s3").put_object(Bucket=bucket, Key="run/step-1/data", Body=bytes(1 << 20))
    proxy = proxied(lambda n, method, path: "cut" if method == "GET" and path.endswith("/step-1/data") else None)
    store, path = _store(bucket, tmp_path, storage_retries=1)
    with pytest.raises(StorageError, match=rf"^downloading s3://{bucket}/run/step-1/data failed after 1 retries: "):
        store.fetch_ranges(path, {"data": [(0, 1 << 20)]})
    assert proxy.injected["cut"] == 2


def _listing_with(pattern: str, replacement: str):
    """An `edit` rewriting the server's listings."""
    return lambda path, body: re.sub(pattern.encode(), replacement.encode(), body) if "list-type=2" in path else body


@pytest.mark.parametrize("pattern, replacement, message", [
    ("<Size>100</Size>", "<Size>-1</Size>", r"gives s3://{bucket}/run/step-1/data a size of -1 bytes"),
    ("<Size>100</Size>", f"<Size>{2**62}</Size>", r"gives s3://{bucket}/run/step-1/data a size of 4611686018427387904"),
    ("<IsTruncated>false</IsTruncated>", "<IsTruncated>true</IsTruncated><NextContinuationToken>{token}"
                                         "</NextContinuationToken>", "(gives a token it gave before|twice)"),
    ("<IsTruncated>false</IsTruncated>", "<IsTruncated>true</IsTruncated>", r"gives no token \(None\)"),
    ("<Key>run/step-1/data</Key>", "<Key>elsewhere/data</Key>", r"the object 'elsewhere/data', which is not under it"),
], ids=["negative-size", "huge-size", "token-again", "no-token", "outside"])
def test_a_listing_that_is_nonsense_is_refused_naming_the_folder(bucket, tmp_path, proxied, pattern, replacement,
                                                                 message):
    """A listing that would never end, a size no object has (which would size the local file and
    cut the download), an object outside the folder: a `StorageError`, before any download. The
    token given again is one the server gave (it refuses others) for a listing in 2 pages."""
    client = boto3.client("s3")
    client.put_object(Bucket=bucket, Key="run/step-1/data", Body=bytes(100))
    client.put_object(Bucket=bucket, Key="run/step-1/more", Body=bytes(7))
    token = client.list_objects_v2(Bucket=bucket, Prefix="run/step-1/", MaxKeys=1)["NextContinuationToken"]
    listings = itertools.count()  # a listing that never ends is cut short, then fails the test
    proxy = proxied(lambda n, method, path: "internal" if "list-type=2" in path and next(listings) >= 5 else None,
                    _listing_with(pattern, replacement.format(token=token)))
    store, path = _store(bucket, tmp_path, storage_retries=0)
    with pytest.raises(StorageError, match=rf"^listing s3://{bucket}/run/step-1/: .*" + message.format(bucket=bucket)):
        store.fetch(path)
    assert not proxy.injected and not os.path.exists(os.path.join(path, "data"))


@pytest.mark.parametrize("failing, left, status", [
    (1, {"IN_PROGRESS.json", "COMMITTED.json", ".metadata", "__0_0.distcp"}, layout.COMPLETE),
    (2, {"IN_PROGRESS.json", ".metadata", "__0_0.distcp"}, layout.PARTIAL),
    (3, {"IN_PROGRESS.json"}, layout.PARTIAL),
    (None, set(), None),
])
def test_a_deletion_stopped_at_any_request_leaves_the_step_ours(bucket, tmp_path, proxied, failing, left, status):
    """A step being deleted is marked in progress first and loses that mark last, in a request
    of its own: stopped after any request, it reads as complete or partial (deleted by the
    next retention), never as another program's folder, which is never deleted."""
    for name in ("COMMITTED.json", ".metadata", "__0_0.distcp"):
        boto3.client("s3").put_object(Bucket=bucket, Key=f"run/step-1/{name}", Body=b"{}")
    deletes = itertools.count(1)
    proxied(lambda n, method, path: "internal" if method == "POST" and path.endswith("?delete")
            and next(deletes) == failing else None)
    store, path = _store(bucket, tmp_path, storage_retries=0)
    step = layout.StepFolder(1, path, layout.COMPLETE)
    if failing:
        with pytest.raises(StorageError, match=rf"deleting s3://{bucket}/run/step-1/.* failed: .*InternalError"):
            store.remove(step)
    else:
        store.remove(step)
    assert {k.split("/", 2)[2] for k in _objects(bucket)} == left
    assert [s.status for s in store.scan(store.root)] == ([status] if status else [])


def test_a_step_holding_keys_xml_cannot_carry_is_deleted_whole(bucket, tmp_path):
    """S3 keys may hold control characters, which DeleteObjects' XML body cannot: such a key
    failed the whole batch, and the step was never deleted. Neighbours sharing the prefix's
    spelling are left alone."""
    client = boto3.client("s3")
    names = [commit.IN_PROGRESS, "a b", "ü", "a+b", "a%2Fb", "x&y<z>", "tab\tx", "ctl\x01x", "cr\rx"]
    for name in names:
        client.put_object(Bucket=bucket, Key=f"run/step-1/{name}", Body=b"1")
    client.put_object(Bucket=bucket, Key=f"run/step-1x/{commit.IN_PROGRESS}", Body=b"{}")
    client.put_object(Bucket=bucket, Key=f"run10/step-1/{commit.IN_PROGRESS}", Body=b"{}")
    store, path = _store(bucket, tmp_path, storage_retries=0)
    assert sorted(_objects(bucket)) == sorted([f"run/step-1/{n}" for n in names] +
                                              [f"run/step-1x/{commit.IN_PROGRESS}", f"run10/step-1/{commit.IN_PROGRESS}"])
    store.remove(layout.StepFolder(1, path, layout.PARTIAL))
    assert sorted(_objects(bucket)) == [f"run/step-1x/{commit.IN_PROGRESS}", f"run10/step-1/{commit.IN_PROGRESS}"]


@pytest.mark.parametrize("names, message", [
    (["x", "x/y"], r"'x' is an object and also a folder holding 'x/y'"),
    (["a/b", "a//b"], r"the objects 'a//b' and 'a/b' would be one file"),
    (["/x"], r"the object '/x' names no file inside the folder"),  # run/step-1//x: it looped forever
    (["a/../../x"], r"the object 'a/../../x' names no file inside the folder"),
])
def test_objects_that_cannot_be_files_are_refused_naming_them_before_any_download(bucket, tmp_path, names, message):
    for name in (commit.MARKER, *names):
        boto3.client("s3").put_object(Bucket=bucket, Key=f"run/step-1/{name}", Body=b"1")
    store, path = _store(bucket, tmp_path)
    with pytest.raises(CorruptCheckpointError, match=rf"^s3://{bucket}/run/step-1: {message}"):
        store.fetch(path)
    assert not os.path.exists(path)


def test_a_step_an_earlier_run_left_staged_is_removed_at_start_up(bucket, tmp_path):
    """A job killed during an upload leaves its rank's share of the step in the staging folder,
    which only a save of that same step again would have removed."""
    url = f"s3://{bucket}/run"
    model, opt = _job()
    CheckpointManager(_config(url, str(tmp_path)), [model], opt).close()
    rank0 = glob.glob(os.path.join(tmp_path, "*", "rank-0"))
    assert len(rank0) == 1
    assert [os.stat(p).st_mode & 0o777 for p in (os.path.dirname(rank0[0]), rank0[0])] == [0o700, 0o700]
    os.makedirs(os.path.join(rank0[0], "step-2"))
    with open(os.path.join(rank0[0], "step-2", "__0_0.distcp"), "wb") as f:
        f.write(b"x" * 1000)
    os.symlink(str(tmp_path), os.path.join(rank0[0], "step-3"))  # not a folder we make: kept
    CheckpointManager(_config(url, str(tmp_path)), [model], opt).close()
    assert sorted(os.listdir(rank0[0])) == ["step-3"]


def test_the_step_a_load_fetched_goes_with_the_manager(bucket, tmp_path):
    """It stayed in the staging folder until the next process of the URL started."""
    url = f"s3://{bucket}/run"
    model, opt = _job()
    with CheckpointManager(_config(url, str(tmp_path / "a")), [model], opt) as manager:
        manager.save(1)
    with CheckpointManager(_config(url, str(tmp_path / "b"), load_only=True), *_job(seed=1)) as manager:
        assert manager.load()
        staged = glob.glob(os.path.join(tmp_path, "b", "*", "rank-0"))[0]
        assert os.listdir(staged) == ["step-1"]
    assert os.listdir(staged) == []


_SECOND_JOB = """
import sys
from torch import nn, optim
from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.errors import ConfigError
model = nn.Linear(2, 2)
refused = 0
for load_only in (False, True):
    config = Checkpoint(enable=True, folder=sys.argv[1], staging_folder=sys.argv[2], load_only=load_only)
    try:
        CheckpointManager(config, [model], optim.SGD(model.parameters(), lr=0.1)).close()
    except ConfigError as e:
        print(e)
        refused += 1
sys.exit(refused)
"""


def test_a_second_job_of_one_url_on_one_node_is_refused_while_the_first_runs(bucket, tmp_path):
    """Its start would remove the first job's staged step in the middle of its upload, and their
    saves and fetches would meet in one staging folder: a second process is refused at start,
    naming the first (an evaluation job that only loads, too), with what to do. Once the first
    closes, the same folder serves the next job. Within one process, managers of one URL do not
    lock each other out."""
    url = f"s3://{bucket}/run"
    model, opt = _job()
    first = CheckpointManager(_config(url, str(tmp_path)), [model], opt)
    first.save(1)
    staged = glob.glob(os.path.join(tmp_path, "*", "rank-0"))[0]
    os.makedirs(os.path.join(staged, "step-2"))  # as an upload in flight holds it
    CheckpointManager(_config(url, str(tmp_path), load_only=True), [model], opt).close()  # the same process
    assert os.path.isdir(os.path.join(staged, "step-2"))

    def second() -> subprocess.CompletedProcess:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run([sys.executable, "-c", _SECOND_JOB, url, str(tmp_path)], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": root})

    refused = second()
    assert refused.returncode == 2, refused.stderr
    assert refused.stdout.count(
        f"checkpoint.staging_folder = {str(tmp_path)!r}: files cannot be staged there: rank 0: CheckpointError: "
        f"another process (pid {os.getpid()} on {os.uname().nodename}) uses {staged}, where this node stages {url} "
        "for rank 0: one job per URL and node; give this job a checkpoint.staging_folder of its own\n") == 2
    assert os.path.isdir(os.path.join(staged, "step-2"))
    first.close()
    ran = second()
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert not os.path.exists(os.path.join(staged, "step-2"))


def test_a_manager_that_fails_to_start_lets_go_of_its_staging_folder(bucket, tmp_path):
    """Its staging folder was taken, then the start failed (initial_load_path's staging folder is
    taken before the folder's, here one that cannot be made): no manager to close, and the
    folder stayed locked to every later job."""
    import fcntl  # noqa: PLC0415

    url = f"s3://{bucket}/run"
    (tmp_path / quote(url, safe="")).write_text("")  # where the folder's staging folder would go
    model, opt = _job()
    with pytest.raises(ConfigError, match="checkpoint.staging_folder"):
        CheckpointManager(_config(url, str(tmp_path), initial_load_path=f"s3://{bucket}/x"), [model], opt)
    (lock,) = glob.glob(os.path.join(tmp_path, "*", "rank-0.lock"))  # initial_load_path's
    with open(lock) as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raised BlockingIOError while held


def test_a_bucket_that_cannot_be_used_is_refused_before_anything_is_made(bucket, tmp_path):
    """Every store is reached before any makes anything: the folder's staging folder and lock
    file were made before its bucket was tried, and the local checkpoint folder before
    initial_load_path's bucket was."""
    model, opt = _job()
    stage = str(tmp_path / "stage")
    with pytest.raises(ConfigError, match=rf"^checkpoint.folder = 's3://no-{bucket}/run': the bucket cannot be used"):
        CheckpointManager(_config(f"s3://no-{bucket}/run", stage, storage_retries=0), [model], opt)
    assert os.listdir(tmp_path) == []
    config = _config(str(tmp_path / "ck"), stage, initial_load_path=f"s3://no-{bucket}/x", storage_retries=0)
    with pytest.raises(ConfigError, match=rf"^checkpoint.initial_load_path = 's3://no-{bucket}/x': the bucket cannot"):
        CheckpointManager(config, [model], opt)
    assert os.listdir(tmp_path) == []


def test_a_url_in_the_base_folder_is_checked_as_the_folder_is(bucket, tmp_path):
    """The manager's base folder (a TorchTitan job's `job.dump_folder`) may put the step folders
    on object storage; that URL was not checked: "s3://" made the folder `checkpoint` a bucket,
    and a two-phase Hugging Face export, refused for an s3:// folder at start-up, failed the
    first export."""
    model = build_model(load_job_config(DEBUG_CONFIG, []))
    stage = str(tmp_path / "stage")
    config = _config("checkpoint", stage, hf_export_interval=1, consolidation="rank0")
    with pytest.raises(ConfigError, match=re.escape(f"checkpoint.consolidation = 'rank0': a Hugging Face export "
                                                    f"(checkpoint.hf_export_interval) to object storage (base_folder = "
                                                    f"'s3://{bucket}/run') is written in one pass")):
        CheckpointManager(config, [model], base_folder=f"s3://{bucket}/run", state_dict_adapter=hf_adapter(model.args))
    with pytest.raises(ConfigError, match=re.escape("base_folder = 's3://': expected s3://bucket/prefix (no bucket")):
        CheckpointManager(_config("checkpoint", stage), [model], base_folder="s3://")
    assert os.listdir(tmp_path) == [] and _objects(bucket) == {}
    with CheckpointManager(_config("checkpoint", stage), [model], base_folder=f"s3://{bucket}/run") as manager:
        manager.save(1)
    assert "run/checkpoint/step-1/COMMITTED.json" in _objects(bucket)


_DIES_LEAVING_A_WORKER = """
import os, signal, sys, time
from torch import nn, optim
from torchtitan_ckpt import CheckpointManager
from torchtitan_ckpt.config import Checkpoint
model = nn.Linear(2, 2)
config = Checkpoint(enable=True, folder=sys.argv[1], staging_folder=sys.argv[2])
manager = CheckpointManager(config, [model], optim.SGD(model.parameters(), lr=0.1))
worker = os.fork()  # a data loader's worker, which outlives its killed parent
if worker == 0:
    time.sleep(120)
    os._exit(0)
print(worker, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_forked_by_a_killed_job_does_not_hold_its_staging_folder(bucket, tmp_path):
    """A forked child gets copies of the lock files' descriptors; had it kept them, the lock
    would outlive the killed job for as long as the child lives, and refuse the next job."""
    url = f"s3://{bucket}/run"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    killed = subprocess.Popen([sys.executable, "-c", _DIES_LEAVING_A_WORKER, url, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, env=env)  # the worker keeps the pipe open
    worker = int(killed.stdout.readline())
    try:
        assert killed.wait(timeout=120) == -9
        os.kill(worker, 0)  # still alive
        ran = subprocess.run([sys.executable, "-c", _SECOND_JOB, url, str(tmp_path)], capture_output=True,
                             text=True, timeout=120, env=env)
        assert ran.returncode == 0, ran.stdout + ran.stderr
    finally:
        os.kill(worker, 9)


def test_another_programs_step_a_save_would_meet_is_refused_before_training(bucket, tmp_path):
    """TorchTitan's own save under the prefix (no marker of ours) at a step this job saves:
    its save would be refused there after the training up to it; the load refuses now."""
    for name in (".metadata", "__0_0.distcp"):
        boto3.client("s3").put_object(Bucket=bucket, Key=f"run/step-3/{name}", Body=b"x")
    model, opt = _job()
    with CheckpointManager(_config(f"s3://{bucket}/run", str(tmp_path)), [model], opt) as manager:
        with pytest.raises(CheckpointError, match=r"step\(s\) 3 were not written by torchtitan_ckpt .* saves step 3"):
            manager.load()
    assert sorted(_objects(bucket)) == ["run/step-3/.metadata", "run/step-3/__0_0.distcp"]


def test_a_damaged_marker_is_named_by_its_url_not_its_downloaded_copy(bucket, tmp_path, capsys):
    model, opt = _job()
    with CheckpointManager(_config(f"s3://{bucket}/run", str(tmp_path / "a")), [model], opt) as manager:
        manager.save(1)
    boto3.client("s3").put_object(Bucket=bucket, Key="run/step-1/COMMITTED.json", Body=b'{"step": 1, "states": 5}')
    with CheckpointManager(_config(f"s3://{bucket}/run", str(tmp_path / "b")), [model], opt) as manager:
        with pytest.raises(CorruptCheckpointError, match=rf"^s3://{bucket}/run/step-1/COMMITTED.json is not a valid"):
            manager.load()
    boto3.client("s3").put_object(Bucket=bucket, Key="run/step-1/COMMITTED.json", Body=b'{"version": 99}')
    with CheckpointManager(_config(f"s3://{bucket}/run", str(tmp_path / "c")), [model], opt) as manager:
        with pytest.raises(NewerVersionError, match=rf"^s3://{bucket}/run/step-1/COMMITTED.json is of version 99"):
            manager.load()
    for version, which in ((99, "a newer"), (1, "an older")):  # the command names the step's URL too
        boto3.client("s3").put_object(Bucket=bucket, Key="run/step-1/COMMITTED.json",
                                      Body=json.dumps({"version": version}).encode())
        assert cli.main(["inspect", f"s3://{bucket}/run/step-1"]) == 2
        assert capsys.readouterr().err.startswith(
            f"error: s3://{bucket}/run/step-1/COMMITTED.json is of version {version}, written by {which}")


def test_a_bucket_without_a_prefix_holds_steps_as_any_folder(bucket, tmp_path):
    """`s3://bucket`: its steps are found (the listing asked for keys under "/", which no key
    is), so retention deletes old ones and a restart resumes instead of saving over them."""
    model, opt = _job()
    with CheckpointManager(_config(f"s3://{bucket}", str(tmp_path / "a")), [model], opt) as manager:
        for step in (1, 2, 3):
            _train(model, opt)
            manager.save(step)
    assert {k.split("/")[0] for k in _objects(bucket)} == {"step-3"}
    fresh, fresh_opt = _job(seed=1)
    with CheckpointManager(_config(f"s3://{bucket}/", str(tmp_path / "b")), [fresh], fresh_opt) as manager:
        assert manager.load()
    _assert_equal(_snapshot(fresh, fresh_opt), _snapshot(model, opt))


def test_initial_load_path_on_object_storage_is_told_by_its_markers(bucket, tmp_path):
    """A step whose save did not finish is refused (a whole download left its in-progress
    marker behind, and the copy read as another program's finished checkpoint); a run folder
    is refused naming its steps, before any data file is downloaded."""
    model, opt = _job()
    with CheckpointManager(_config(f"s3://{bucket}/a", str(tmp_path / "a"), keep_latest_k=0), [model], opt) as manager:
        manager.save(1)
        manager.save(2)
    client = boto3.client("s3")
    client.put_object(Bucket=bucket, Key="a/step-2/IN_PROGRESS.json", Body=b"{}")
    client.delete_object(Bucket=bucket, Key="a/step-2/COMMITTED.json")
    for source, message in ((f"s3://{bucket}/a/step-2", "its save did not finish"),
                            (f"s3://{bucket}/a", r"holds no finished checkpoint .* \(it holds the steps \[1\]")):
        staging = tmp_path / "b"
        config = _config(str(tmp_path / "local"), str(staging), initial_load_path=source)
        with CheckpointManager(config, [_job(seed=1)[0]]) as manager:
            with pytest.raises(CheckpointNotFoundError, match=message):
                manager.load()
        assert not glob.glob(os.path.join(staging, "**", "*.distcp"), recursive=True), source


def test_folder_placeholders_are_not_objects(bucket, tmp_path):
    """Empty objects named like folders (the S3 console's) are passed over, and so is one that
    holds bytes (another program's: it failed every listing of the run, so every load and
    save)."""
    model, opt = _job()
    client = boto3.client("s3")
    for key in ("run/", "run/step-1/", "run/other/"):
        client.put_object(Bucket=bucket, Key=key, Body=b"")
    with CheckpointManager(_config(f"s3://{bucket}/run", str(tmp_path / "a")), [model], opt) as manager:
        manager.save(2)
    with CheckpointManager(_config(f"s3://{bucket}/run", str(tmp_path / "b")), [_job(seed=1)[0]]) as manager:
        assert manager.load()
    client.put_object(Bucket=bucket, Key="run/step-2/x/", Body=b"data")
    client.put_object(Bucket=bucket, Key="run/notes/", Body=b"theirs")
    with CheckpointManager(_config(f"s3://{bucket}/run", str(tmp_path / "c")), [_job(seed=1)[0]]) as manager:
        assert manager.load()


def test_a_listing_that_repeats_a_key_or_does_not_parse_is_refused_naming_the_folder(bucket, tmp_path, proxied):
    """A key listed twice (a server that pages on with fresh tokens over the same keys would
    never end) is refused; a size that is no integer is a `StorageError`."""
    client = boto3.client("s3")
    client.put_object(Bucket=bucket, Key="run/step-1/data", Body=bytes(100))
    client.put_object(Bucket=bucket, Key="run/step-1/more", Body=bytes(7))
    for pattern, replacement, message in (
            ("<Key>run/step-1/more</Key>", "<Key>run/step-1/data</Key>", r"^listing s3://{b}/run/step-1/: the server "
             r"lists s3://{b}/run/step-1/data twice"),
            ("<Size>100</Size>", "<Size>1e2</Size>", r"^listing s3://{b}/run/step-1/ failed: ValueError")):
        proxied(lambda n, method, path: None, _listing_with(pattern, replacement))
        store, path = _store(bucket, tmp_path, storage_retries=0)
        with pytest.raises(StorageError, match=message.format(b=bucket)):
            store.fetch(path)


def test_a_file_of_more_parts_than_s3_takes_is_uploaded_in_larger_parts(bucket, tmp_path, monkeypatch):
    """S3 takes 10,000 parts at most: a larger file is cut into fewer, larger parts (whole MiB)."""
    from torchtitan_ckpt.storage import s3

    monkeypatch.setattr(s3, "MAX_PARTS", 3)
    store, path = _store(bucket, tmp_path)
    os.makedirs(path)
    data = torch.randint(0, 256, (20 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with open(os.path.join(path, "big"), "wb") as f:
        f.write(data.numpy().tobytes())
    parts = []
    store.client.meta.events.register("provide-client-params.s3.UploadPart",
                                     lambda params, **_: parts.append((params["PartNumber"], len(params["Body"]))))
    assert store._upload(os.path.join(path, "big"), "run/step-1/big")[0] == 20 << 20  # noqa: SLF001
    assert sorted(parts) == [(1, 7 << 20), (2, 7 << 20), (3, 6 << 20)]
    body = boto3.client("s3").get_object(Bucket=bucket, Key="run/step-1/big")["Body"].read()
    assert body == data.numpy().tobytes()


def test_retention_failing_after_the_commit_does_not_fail_the_save(bucket, tmp_path, proxied, caplog):
    """Once the commit marker is in the store the step is saved: a listing that fails after it
    (retention's) is a warning, not a failed save on rank 0 alone."""
    committed, failing = [], [True]
    def plan(n, method, path):
        if method == "PUT" and "COMMITTED.json" in path:
            committed.append(n)
        return "internal" if committed and failing and "list-type=2" in path else None
    proxied(plan)
    model, opt = _job()
    with caplog.at_level(logging.WARNING, logger="torchtitan_ckpt"):
        with CheckpointManager(_config(f"s3://{bucket}/run", str(tmp_path), storage_retries=0), [model], opt) as m:
            assert m.save(1)
    failing.clear()
    assert "run/step-1/COMMITTED.json" in _objects(bucket)
    assert "step 1 is saved, but retention could not look at" in caplog.text


def test_a_server_error_without_the_fields_it_names_is_our_error(bucket, tmp_path, proxied):
    """A delete answer naming a failed key without its `Key` field: a `StorageError` naming
    the object deleted, not a `KeyError`."""
    client = boto3.client("s3")
    client.put_object(Bucket=bucket, Key="run/step-1/COMMITTED.json", Body=b"{}")
    proxied(lambda n, method, path: None,
            lambda path, body: body.replace(b"</DeleteResult>", b"<Error><Message>nope</Message></Error></DeleteResult>")
            if path.endswith("?delete") else body)
    store, path = _store(bucket, tmp_path, storage_retries=0)
    with pytest.raises(StorageError, match=rf"deleting s3://{bucket}/run/step-1/\S+ failed: 'nope'"):
        store.remove(layout.StepFolder(1, path, layout.COMPLETE))


def test_the_staging_folder_is_checked_at_start_up_and_named_within_a_file_name(bucket, tmp_path):
    """A staging folder that cannot be written fails at start-up naming the setting (it failed
    the first save); a long URL stages under a name a file system takes (one folder named by
    the whole encoded URL was more than 255 bytes)."""
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="checkpoint.staging_folder.*files cannot be staged there"):
        CheckpointManager(_config(f"s3://{bucket}/run", str(tmp_path / "file" / "staging")), [_job()[0]])
    url = f"s3://{bucket}/" + "/".join(["p" * 60] * 5)
    model, opt = _job()
    with CheckpointManager(_config(url, str(tmp_path / "s")), [model], opt) as manager:
        manager.save(1)
    assert all(len(name) <= 255 for name in os.listdir(tmp_path / "s"))
    assert any(k.endswith("/step-1/COMMITTED.json") for k in _objects(bucket))


def test_the_default_staging_folder_is_the_users_own_and_never_a_link(bucket, tmp_path, monkeypatch):
    """The system's temporary folder is every user's: the default staging folder is made
    readable by its user alone, and one another user made first (here a link into a folder of
    theirs, or a folder open to others) is refused before a file is staged there."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model, opt = _job()
    with CheckpointManager(_config(f"s3://{bucket}/run", ""), [model], opt) as manager:
        manager.save(1)
    own = tmp_path / f"torchtitan_ckpt-{os.getuid()}"
    assert os.stat(own).st_mode & 0o777 == 0o700
    shutil.rmtree(own)
    (tmp_path / "theirs").mkdir()
    own.symlink_to(tmp_path / "theirs")
    with pytest.raises(ConfigError, match=re.escape(f"the default staging folder {own} is not a folder of this "
                                                    "user's that only this user can read")):
        CheckpointManager(_config(f"s3://{bucket}/run", ""), [model], opt)
    own.unlink()
    own.mkdir(mode=0o755)
    os.chmod(own, 0o755)
    with pytest.raises(ConfigError, match="checkpoint.staging_folder"):
        CheckpointManager(_config(f"s3://{bucket}/run", ""), [model], opt)
    assert os.listdir(tmp_path / "theirs") == [] and os.listdir(own) == []


def test_the_folders_made_in_a_staging_folder_set_are_refused_when_not_the_users_alone(bucket, tmp_path):
    """A `staging_folder` of the user's choosing may be open to others (a shared scratch disk):
    the folder for the URL and each rank's under it, which another user could have made first
    (to read the staged shards, or add files to a step before its upload), were taken as they
    were."""
    model, opt = _job()
    stage = tmp_path / "stage"
    with CheckpointManager(_config(f"s3://{bucket}/run", str(stage)), [model], opt) as manager:
        manager.save(1)
    (url_folder,) = [p for p in stage.iterdir() if p.is_dir()]
    url_folder.chmod(0o777)  # as another user's, made first for everyone to write to
    with pytest.raises(ConfigError, match=rf"checkpoint.staging_folder.*{re.escape(str(url_folder))} is not this "
                                          r"user's alone \(open to others, mode 777\)"):
        CheckpointManager(_config(f"s3://{bucket}/run", str(stage)), [model], opt)
    url_folder.chmod(0o700)
    rank = url_folder / "rank-0"
    shutil.rmtree(rank)
    (tmp_path / "theirs").mkdir()
    rank.symlink_to(tmp_path / "theirs")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(rank))} is not this user's alone \(a link or a file\)"):
        CheckpointManager(_config(f"s3://{bucket}/run", str(stage)), [model], opt)
    assert os.listdir(tmp_path / "theirs") == []


def test_a_marker_larger_than_any_is_refused_before_it_is_downloaded(bucket, tmp_path, proxied):
    """The listing gives an object's size before its GET: a `COMMITTED.json` past the marker
    reader's limit is refused naming its URL, and none of it is downloaded (it was, whole,
    twice, before its reader refused it)."""
    model, opt = _job()
    with CheckpointManager(_config(f"s3://{bucket}/run", str(tmp_path / "a")), [model], opt) as manager:
        manager.save(1)
    boto3.client("s3").put_object(Bucket=bucket, Key="run/step-1/COMMITTED.json",
                                  Body=b" " * (commit.MAX_MARKER_BYTES + 1))
    gets = []
    proxied(lambda n, method, path: gets.append(path) if method == "GET" else None)
    fresh, fresh_opt = _job(seed=1)
    with pytest.raises(CorruptCheckpointError, match=re.escape(
            f"s3://{bucket}/run/step-1/COMMITTED.json is {commit.MAX_MARKER_BYTES + 1} bytes, more than the "
            f"{commit.MAX_MARKER_BYTES} its reader takes: refusing to download it")):
        with CheckpointManager(_config(f"s3://{bucket}/run", str(tmp_path / "b")), [fresh], fresh_opt) as manager:
            manager.load()
    assert not [path for path in gets if "COMMITTED.json" in path]


@pytest.mark.parametrize("damage, verify, message", [
    (lambda body: b"g" * len(body), False, r"^{url}/step-1/.metadata is not a DCP metadata file"),
    (lambda body: bytes(len(body)), False, r"^{url}/step-1/__0_0.distcp: item .* is not a readable torch.save"),
    (lambda body: bytes(len(body)), True, r"step 1 failed verification: {url}/step-1/__0_0.distcp: CRC-32"),
    (lambda body: body[:len(body) // 2], False,
     r"step 1 failed verification: {url}/step-1/__0_0.distcp: \d+ bytes, the manifest says \d+"),
], ids=["metadata", "data", "verified", "cut_short"])
def test_a_damaged_step_on_object_storage_is_named_by_its_url(bucket, tmp_path, capsys, damage, verify, message):
    """Readers name the files they read, which on object storage are the rank's staged copies:
    the errors named a folder under the staging folder instead of the step's URL."""
    url, client = f"s3://{bucket}/run", boto3.client("s3")
    model, opt = _job()
    with CheckpointManager(_config(url, str(tmp_path)), [model], opt) as manager:
        manager.save(1)
    key = "run/step-1/.metadata" if "metadata" in message else "run/step-1/__0_0.distcp"
    client.put_object(Bucket=bucket, Key=key, Body=damage(client.get_object(Bucket=bucket, Key=key)["Body"].read()))
    with CheckpointManager(_config(url, str(tmp_path), verify_on_load=verify, verify_fallback=False),
                           *_job(seed=1)) as manager:
        with pytest.raises(CorruptCheckpointError, match=message.format(url=url)) as refused:
            manager.load()
    assert str(tmp_path) not in str(refused.value)
    if "metadata" in message:
        code, err = _cli_json(capsys, "inspect", f"{url}/step-1")
        assert code == 2 and err.startswith(f"error: {url}/step-1/.metadata is not a DCP metadata file"), err


def test_verify_on_load_reads_the_files_it_verified_without_downloading_them_again(bucket, tmp_path, proxied):
    """`verify_on_load` downloads a rank's share of the files whole to check them: the load then
    reads those copies (it fetched their byte ranges again, twice the traffic, and loaded bytes
    other than the ones verified)."""
    model, opt = _job()
    _train(model, opt)
    with CheckpointManager(_config(f"s3://{bucket}/run", str(tmp_path / "a")), [model], opt) as manager:
        manager.save(1)
    sizes = {k: v for k, v in _objects(bucket).items() if k.endswith(".distcp")}
    proxy = proxied(lambda n, method, path: None)
    fresh, fresh_opt = _job(seed=1)
    with CheckpointManager(_config(f"s3://{bucket}/run", str(tmp_path / "b"), verify_on_load=True),
                           [fresh], fresh_opt) as manager:
        assert manager.load()
    _assert_equal(_snapshot(fresh, fresh_opt), _snapshot(model, opt))
    assert {k: proxy.served[f"/{bucket}/{k}"] for k in sizes} == sizes


def test_a_step_removed_after_the_listing_is_not_listed_on_object_storage(bucket, tmp_path):
    """As on a local folder (tests/test_cli.py): a step whose marker the job's retention deleted
    between `list`'s listing and its read of the marker is left out, not called `corrupt`."""
    url, client = f"s3://{bucket}/run", boto3.client("s3")
    model, opt = _job()
    with CheckpointManager(_config(url, str(tmp_path / "stage"), keep_latest_k=2), [model], opt) as manager:
        manager.save(1)
        manager.save(2)
    with cli._opened(url, "folder") as (store, local):
        listed = store.scan(local)
        client.delete_object(Bucket=bucket, Key="run/step-1/COMMITTED.json")
        records = [cli._step_record(s, store) for s in listed]
    assert records[0] is None and records[1]["status"] == "complete"


def test_a_save_whose_step_another_job_marked_since_is_not_committed(bucket, tmp_path, proxied, moto_url):
    """Two jobs saving one step into one URL (a restarted job's old copy still alive): the
    second's start of the step replaced the first's files, and the first's commit marker then
    went on top of the second's: both said saved, and the step mixed the two. The first now
    finds the step marked by another save at its commit, and commits nothing."""
    url = f"s3://{bucket}/run"
    direct = boto3.client("s3", endpoint_url=moto_url)
    other = json.dumps({"started": time.time(), "save": "another job's"}).encode()

    def another_job_starts_step_2(n, method, path):
        if method == "PUT" and path.startswith(f"/{bucket}/run/step-2/__0_0.distcp"):
            direct.put_object(Bucket=bucket, Key=f"run/step-2/{commit.IN_PROGRESS}", Body=other)
        return None

    model, opt = _job()
    proxied(another_job_starts_step_2)
    with CheckpointManager(_config(url, str(tmp_path)), [model], opt) as manager:
        manager.save(1)
        with pytest.raises(CheckpointSaveError, match=rf"s3://{bucket}/run/step-2 was marked by another save after "
                                                      r"this one began .* this step is not committed"):
            manager.save(2)
    assert f"run/step-2/{commit.MARKER}" not in _objects(bucket)
    assert f"run/step-1/{commit.MARKER}" in _objects(bucket)


def _uploads(bucket: str) -> list[str]:
    return sorted(u["Key"] for u in boto3.client("s3").list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def test_unfinished_uploads_under_a_step_folder_go_with_it_and_nothing_else(bucket, tmp_path):
    """A save killed mid-upload left its multipart upload (parts billed, shown by no listing of
    objects) through the next save of that step and retention: each aborts those under the step
    folder it replaces or removes. Uploads elsewhere under the prefix are another program's."""
    url = f"s3://{bucket}/run"
    client = boto3.client("s3")
    for key in ("run/step-2/__0_0.distcp", "run/step-1/__1_0.distcp", "run/notes/big.bin", "run/step-1-eval/x"):
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 1024)
    model, opt = _job()
    with CheckpointManager(_config(url, str(tmp_path)), [model], opt) as manager:
        manager.save(2)  # its step folder's upload, a leftover
        assert _uploads(bucket) == ["run/notes/big.bin", "run/step-1-eval/x", "run/step-1/__1_0.distcp"]
        manager.save(3)  # retention (keep_latest_k = 1) removes step 2; step 1 is no step of ours
    assert _uploads(bucket) == ["run/notes/big.bin", "run/step-1-eval/x", "run/step-1/__1_0.distcp"]
    client.put_object(Bucket=bucket, Key=f"run/step-1/{commit.IN_PROGRESS}", Body=b"{}")  # a partial step of ours
    with CheckpointManager(_config(url, str(tmp_path)), [model], opt) as manager:
        assert manager.load()
        manager.save(4)  # retention removes the partial step 1, and its upload
    assert _uploads(bucket) == ["run/notes/big.bin", "run/step-1-eval/x"]


def test_listing_the_steps_lists_no_other_objects_under_the_prefix(bucket, tmp_path, proxied):
    """The steps' listing paged through every object under the prefix: 1,500 of another
    program's beside the steps made each scan two requests more (a thousand per page)."""
    url = f"s3://{bucket}/run"
    client = boto3.client("s3")
    for i in range(1500):
        client.put_object(Bucket=bucket, Key=f"run/eval/{i}.json", Body=b"{}")
    model, opt = _job()
    with CheckpointManager(_config(url, str(tmp_path)), [model], opt) as manager:
        manager.save(1)
    proxy = proxied(lambda n, method, path: None)
    with CheckpointManager(_config(url, str(tmp_path)), [model], opt) as manager:
        assert manager.load()
    listings = [path for method, path, _ in proxy.seen if method == "GET" and "list-type=2" in path]
    assert listings and all("prefix=run%2Fstep-" in path for path in listings), listings


def test_a_step_saved_again_replaces_the_complete_one_and_a_prefix_of_another_program_is_refused(bucket, tmp_path,
                                                                                                 caplog):
    """A job that went back to step 1 saves step 2 again: the complete step 2 is replaced (its
    commit marker deleted first, so a crash leaves it partial, never a mix), said so, and the
    newest load reads the new values. Objects another program put under a step's prefix are
    never replaced: that save is refused and they stay."""
    url, stage = f"s3://{bucket}/run", str(tmp_path / "stage")
    model, opt = _job()
    with CheckpointManager(_config(url, stage, keep_latest_k=0), [model], optimizers=opt) as manager:
        manager.save(1)
        manager.save(2)
    again, opt = _job(seed=1)
    with CheckpointManager(_config(url, stage, keep_latest_k=0, load_step=1), [again], optimizers=opt) as manager:
        assert manager.load()
        with torch.no_grad():
            again[1].bias.add_(1.0)
        expected = {k: v.clone() for k, v in again.state_dict().items()}
        assert manager.save(2)
    assert f"replacing {url}/step-2, a complete step saved before" in caplog.text
    newest, opt = _job(seed=2)
    with CheckpointManager(_config(url, stage, keep_latest_k=0), [newest], optimizers=opt) as manager:
        assert manager.load()
        assert_same(newest.state_dict(), expected)
        # put there after the load (which refuses a folder holding them where the job will save)
        boto3.client("s3").put_object(Bucket=bucket, Key="run/step-3/notes.txt", Body=b"mine")
        with pytest.raises(CheckpointError, match=rf"{re.escape(url)}/step-3 exists and was not written by "
                                                  r"torchtitan_ckpt; it is never replaced"):
            manager.save(3)
    body = boto3.client("s3").get_object(Bucket=bucket, Key="run/step-3/notes.txt")["Body"].read()
    assert body == b"mine"


def test_a_step_holding_a_users_objects_is_never_removed(bucket, tmp_path, caplog):
    """Objects a user put under a step (evaluation results) went with the step, by retention,
    by a save of the same step, and with no word before: a step ahead holding them is refused
    at the load, as in a folder."""
    url, stage = f"s3://{bucket}/run", str(tmp_path / "stage")
    client = boto3.client("s3")
    model, opt = _job()
    with CheckpointManager(_config(url, stage, keep_latest_k=0), [model], opt) as manager:
        manager.save(1)
        manager.save(2)
    for step in (1, 2):
        client.put_object(Bucket=bucket, Key=f"run/step-{step}/eval_results.json", Body=b"mine")
    with CheckpointManager(_config(url, stage, load_step=1), [model], opt) as manager:
        with pytest.raises(CheckpointError, match=r"step\(s\) 2 hold files their COMMITTED.json does not list "
                                                  r"\(eval_results.json: a user's\?\) and this job, starting from step "
                                                  r"1, saves step 2"):
            manager.load()
    client.delete_object(Bucket=bucket, Key="run/step-2/eval_results.json")
    with CheckpointManager(_config(url, stage, keep_latest_k=0, load_step=1), [model], opt) as manager:
        assert manager.load()
        client.put_object(Bucket=bucket, Key="run/step-2/eval_results.json", Body=b"mine")  # after the load
        with pytest.raises(CheckpointSaveError, match=rf"{re.escape(url)}/step-2 holds 1 file\(s\) or folder\(s\) "
                                                      r"its COMMITTED.json does not list, not written by "
                                                      r"torchtitan_ckpt \(eval_results.json\)"):
            manager.save(2)  # saved again
    with CheckpointManager(_config(url, stage), [model], opt) as manager:
        assert manager.load()
        manager.save(3)  # retention: steps 1 and 2 go, but for the user's objects
    kept = {k for k in _objects(bucket) if k.startswith(("run/step-1/", "run/step-2/"))}
    assert {f"run/step-{step}/{name}" for step in (1, 2)
            for name in ("eval_results.json", "COMMITTED.json", ".metadata")} <= kept
    assert re.search(r"could not delete .*step-1: CheckpointError: .*step-1 holds 1 file\(s\) or folder\(s\) its "
                     r"COMMITTED.json does not list, not written by torchtitan_ckpt \(eval_results.json\)", caplog.text)
    client.delete_object(Bucket=bucket, Key="run/step-1/eval_results.json")
    with CheckpointManager(_config(url, stage), [model], opt) as manager:
        assert manager.load()
        manager.save(4)
    assert not any(k.startswith("run/step-1/") for k in _objects(bucket))


def test_a_prefix_inside_a_step_is_refused_as_a_folder_inside_one_is(bucket, tmp_path):
    """A job saving under another's step (s3://b/run/step-2/eval) was accepted on S3, where a
    folder inside a step is refused: the other job's retention then deleted its steps with the
    step they were under."""
    url, stage = f"s3://{bucket}/run", str(tmp_path / "stage")
    model, opt = _job()
    with CheckpointManager(_config(url, stage, keep_latest_k=0), [model], opt) as manager:
        manager.save(2)
    before = sorted(_objects(bucket))
    for inside in ("step-2", "step-2/eval", "step-2//eval/"):
        with pytest.raises(ConfigError, match=rf"checkpoint.folder = '{re.escape(url)}/step-2.*': "
                                              rf"is{' inside' if 'eval' in inside else ''} the step folder "
                                              rf"{re.escape(url)}/step-2, not a folder of steps .*resume from "
                                              rf"{re.escape(url)}, "):
            CheckpointManager(_config(f"{url}/{inside}", stage), [model], opt)
    assert sorted(_objects(bucket)) == before
    CheckpointManager(_config(f"{url}/step-3/eval", stage), [model], opt).close()  # no step there


def test_copies_into_another_jobs_prefix_are_refused_before_training(bucket, tmp_path):
    """A job with hf_export_interval under s3://b/run, beside another job saving under
    s3://b/run/hf: the copies' retention deleted that job's steps."""
    from .jobs import make_job

    stage = str(tmp_path / "stage")
    other = make_job(str(tmp_path), steps=2, interval=2, keep_latest_k=0, folder=f"s3://{bucket}/run/hf",
                     staging_folder=stage)
    other.run_to(2, steps=2)
    other.manager.close()
    with pytest.raises(ConfigError, match=rf"checkpoint.hf_export_interval = 2: the copies go into s3://{bucket}/run/hf, "
                                          rf"which holds s3://{bucket}/run/hf/step-2 in DCP's format, no copy"):
        make_job(str(tmp_path), steps=4, interval=2, hf_export_interval=2, keep_latest_k=1,
                 folder=f"s3://{bucket}/run", staging_folder=stage)
    assert any(k.startswith("run/hf/step-2/") for k in _objects(bucket))


def test_verify_of_a_marker_too_big_to_read_is_a_damaged_step_as_in_a_folder(bucket, tmp_path, capsys):
    """A COMMITTED.json larger than its reader takes: exit 1 with one COMMITTED.json entry in a
    folder, but exit 2 (an input error) on S3, where the store refuses to download it."""
    url = f"s3://{bucket}/run"
    with CheckpointManager(_config(url, str(tmp_path / "stage")), [torch.nn.Linear(2, 2)]) as manager:
        manager.save(1)
    boto3.client("s3").put_object(Bucket=bucket, Key="run/step-1/COMMITTED.json",
                                  Body=b" " * (commit.MAX_MARKER_BYTES + 1))
    assert cli.main(["verify", "--json", f"{url}/step-1", "-q"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [(f["file"], f["ok"]) for f in doc["files"]] == [("COMMITTED.json", False)]
    assert f"{url}/step-1/COMMITTED.json is {commit.MAX_MARKER_BYTES + 1} bytes, more than" in doc["files"][0]["problem"]
