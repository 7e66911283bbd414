"""torchtitan_ckpt: a checkpoint manager for large-model training over torch.distributed.checkpoint."""

from .config import JobConfig, load_job_config
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    ConfigError,
    CorruptCheckpointError,
)
from .manager import CheckpointManager

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "ConfigError",
    "CorruptCheckpointError",
    "JobConfig",
    "load_job_config",
]
