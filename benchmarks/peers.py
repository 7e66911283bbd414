"""torch_checkpointing (the `bench` extra), configured once for every benchmark that compares with it.

It is set up as its docs say for a CPU-only host (no pinned memory, no non-blocking copies),
with direct I/O off (ext4 refuses its `O_DIRECT` writes with EINVAL), and made durable through
its callbacks, since it never fsyncs: the pre-finalize callback fsyncs every file and folder it
wrote, the finalize callback the folder holding the renamed step. Its default barrier reopens the
process group's FileStore, which the `file://` rendezvous of the benchmarks' gloo ranks has
removed by then: it gets a TCP store instead. A save's payload is the model's and the optimizer's
own `state_dict()`s; a load fills them in place, then hands the optimizer its settings.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist


def have_torch_checkpointing() -> bool:
    try:
        import torch_checkpointing  # noqa: F401
    except ImportError:
        return False
    return True


def _fsync_tree(args) -> None:
    """Pre-finalize callback: make the written files durable."""
    for root, _dirs, files in os.walk(args.path):
        for name in [*files, "."]:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _fsync_parent(args) -> None:
    """Finalize callback: the rename of the step into place is durable."""
    fd = os.open(os.path.dirname(os.path.abspath(args.path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _free_port() -> int:
    """A port free on rank 0's host, the same on every rank (a collective)."""
    port = [0]
    if dist.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    return port[0]


def torch_checkpointing_manager(asynchronous: bool) -> Any:
    """Its `CheckpointManager`, durable, with its async saver (staging in the background, files
    written by its process) or its synchronous one. A collective: every rank calls it."""
    from torch_checkpointing import AsyncCheckpointSaverConfig, CheckpointManager, CheckpointWriterConfig
    from torch_checkpointing import SyncCheckpointSaverConfig, TCPStoreBarrierConfig
    from torch_checkpointing.staging import CheckpointStagerConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    writer = CheckpointWriterConfig(barrier_config=TCPStoreBarrierConfig(
        use_checkpoint_barrier_tcpstore_libuv=True, tcpstore_port=_free_port(), master_address="127.0.0.1",
        timeout_barrier_init_sec=300))
    gpu = torch.accelerator.is_available()
    save = (AsyncCheckpointSaverConfig(writer_config=writer, staging_config=CheckpointStagerConfig(
                use_pinned_memory=gpu, use_non_blocking_copy=gpu))
            if asynchronous else SyncCheckpointSaverConfig(writer_config=writer))
    return CheckpointManager.Config(save=save, storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
                                    pre_finalize_callback=_fsync_tree, finalize_callback=_fsync_parent).build()


def payload(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What torch_checkpointing saves of a job, and loads into."""
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def load_into(manager: Any, path: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """A resume: the tensors are filled in place, the optimizer's settings applied."""
    loaded = manager.load(path, into=payload(model, opt))
    opt.load_state_dict(loaded["optimizer"])
