"""Checkpoints on object storage, against a real S3-compatible server on 127.0.0.1 (moto's), on
2 gloo ranks: bit-identical resume in every async mode, the marker written last, kills at each
phase, injected 5xx / throttling / resets, start-up checks; and a folder ranks do not share."""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import subprocess
import uuid

import boto3
import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessExitedException

from torchtitan_ckpt import CheckpointManager, commit, faults
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.errors import CheckpointSaveError, ConfigError

from .helpers import spawn
from .s3server import CREDENTIALS, FaultProxy, start_moto

pytestmark = pytest.mark.multirank


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
    model(torch.ones(2, 1200)).sum().backward()
    opt.step()
    opt.zero_grad()


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


def _crash(rank, world_size, url, staging, failpoint):
    """Saves step 1, then dies at `failpoint` while saving step 2."""
    os.environ["RANK"] = str(rank)  # which rank a fail point names
    os.environ[faults.ENV] = failpoint
    model, opt = _job()
    _train(model, opt)
    with CheckpointManager(_config(url, staging), [model], opt) as manager:
        manager.save(1)
        _train(model, opt)
        manager.save(2)


def _resume_step_1(rank, world_size, url, staging):
    model, opt = _job()
    _train(model, opt)
    expected = _snapshot(model, opt)
    fresh, fresh_opt = _job(seed=1)
    with CheckpointManager(_config(url, staging, verify_on_load=True), [fresh], fresh_opt) as manager:
        assert manager.load()
        _assert_equal(_snapshot(fresh, fresh_opt), expected)
        manager.save(2)  # the leftover of the killed save is replaced


@pytest.mark.parametrize("failpoint", ["prepare@2", "write@2:1", "upload@2:1", "commit@2"])
def test_a_kill_during_a_save_leaves_the_previous_step_loadable(bucket, tmp_path, failpoint):
    url = f"s3://{bucket}/run"
    with pytest.raises(ProcessExitedException):
        spawn(2, _crash, url, str(tmp_path / "a"), failpoint)
    names = _objects(bucket)
    assert "run/step-1/COMMITTED.json" in names
    assert "run/step-2/COMMITTED.json" not in names and "run/step-2/IN_PROGRESS.json" in names
    if failpoint.startswith("upload"):
        assert "run/step-2/__1_0.distcp" in names  # rank 1's data is up, the step is still invisible
    spawn(2, _resume_step_1, url, str(tmp_path / "b"))
    assert {k for k in _objects(bucket) if k.endswith(".json")} == {"run/step-2/COMMITTED.json"}


def test_a_kill_while_deleting_an_old_step_leaves_it_partial(bucket, tmp_path):
    url = f"s3://{bucket}/run"
    with pytest.raises(ProcessExitedException):
        spawn(2, _crash, url, str(tmp_path / "a"), "purge@1")
    names = _objects(bucket)
    assert "run/step-2/COMMITTED.json" in names and "run/step-1/COMMITTED.json" not in names
    assert "run/step-1/.metadata" in names  # its marker went first


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


def test_throttling_5xx_and_resets_are_retried(bucket, tmp_path, monkeypatch, moto_url):
    proxy = FaultProxy(moto_url, _flaky())
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        spawn(2, _save_then_resume, f"s3://{bucket}/run", str(tmp_path), "disabled")
    finally:
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)
    assert min(proxy.injected[k] for k in ("slowdown", "internal", "reset")) >= 3, proxy.injected
    assert "run/step-2/COMMITTED.json" in _objects(bucket)


def _save_fails(rank, world_size, url, staging):
    model, opt = _job()
    with CheckpointManager(_config(url, staging, storage_retries=1), [model], opt) as manager:
        with pytest.raises(CheckpointSaveError, match=rf"saving step 1 to {url}/step-1 failed: .*SlowDown"):
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


def test_hugging_face_exports_to_object_storage_are_refused_at_start_up():
    config = Checkpoint(folder="s3://b/run", last_save_in_hf=True)
    with pytest.raises(ConfigError, match="checkpoint.folder = 's3://b/run': the Hugging Face format"):
        config.validate()


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
    assert os.listdir(os.path.join(tmp, "ckpt")) == []  # the probes are gone


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
