"""torchtitan_ckpt: a checkpoint manager for large-model training over torch.distributed.checkpoint."""

from .config import Checkpoint, load_config
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    ConfigError,
    CorruptCheckpointError,
    NewerVersionError,
    PartialLoadError,
    StagingMismatchError,
)
from .manager import CheckpointManager

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "ConfigError",
    "CorruptCheckpointError",
    "NewerVersionError",
    "PartialLoadError",
    "StagingMismatchError",
    "load_config",
]
