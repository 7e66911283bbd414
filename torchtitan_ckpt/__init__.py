"""torchtitan_ckpt: a checkpoint manager for large-model training over torch.distributed.checkpoint."""

from .config import Checkpoint, load_config
from .errors import (
    AdapterMismatchError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CollectiveError,
    ConfigError,
    ConsolidationError,
    CorruptCheckpointError,
    InvalidShardsError,
    MisnamedStepError,
    NewerVersionError,
    OlderVersionError,
    PartialLoadError,
    StagingMismatchError,
    StorageError,
)
from .io.tensors import register_holding_wrapper
from .manager import CheckpointManager
from .rng_state import RngState
from .states import ModelPart, StateLike

__all__ = [
    "AdapterMismatchError",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CollectiveError",
    "ConfigError",
    "ConsolidationError",
    "CorruptCheckpointError",
    "InvalidShardsError",
    "MisnamedStepError",
    "ModelPart",
    "NewerVersionError",
    "OlderVersionError",
    "PartialLoadError",
    "RngState",
    "StagingMismatchError",
    "StateLike",
    "StorageError",
    "load_config",
    "register_holding_wrapper",
]
