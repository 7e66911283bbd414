"""When to save, and what: a pure policy over the step number and the `[checkpoint]` config."""

from __future__ import annotations

import enum

from ..config import Checkpoint


class SaveKind(enum.Enum):
    FULL = "full"
    """Model, optimizers, schedulers, dataloader and extra states: everything a resume needs."""
    MODEL_ONLY = "model_only"
    """The model alone, floating tensors cast to `export_dtype` (the last step's export)."""
    SEED = "seed"
    """The freshly initialised model alone, as step 0, in its own dtype."""


def save_kind(step: int, last_step: bool, config: Checkpoint, force: bool = False) -> SaveKind | None:
    """What `save(step, last_step, force)` writes, or None when this step is not saved."""
    if not config.enable or config.load_only:
        return None
    if step == 0:
        return SaveKind.SEED if config.create_seed_checkpoint else None
    if last_step:
        return SaveKind.MODEL_ONLY if config.last_save_model_only else SaveKind.FULL
    if force:
        return SaveKind.FULL
    if step == 1 and config.enable_first_step_checkpoint:
        return SaveKind.FULL
    return SaveKind.FULL if step % config.interval == 0 else None


def hf_copy_due(step: int, config: Checkpoint) -> bool:
    """Whether step `step` also exports a Hugging Face copy (`hf_export_interval`)."""
    every = config.hf_export_interval
    return config.enable and not config.load_only and every > 0 and step > 0 and step % every == 0


def save_format(kind: SaveKind | None, config: Checkpoint) -> str:
    """The format a save of `kind` is written in: Hugging Face for the last step's model-only
    save with `last_save_in_hf`, else DCP."""
    return "hf" if kind is SaveKind.MODEL_ONLY and config.last_save_in_hf else "dcp"
