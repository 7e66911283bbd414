"""`Stateful` wrappers that turn a job's parts into DCP state dicts and back.

Model parts are flattened into one dict of fully-qualified names (non-persistent buffers are not
part of it), optimizer state is keyed by parameter name so it reshards, and the dataloader's
per-rank position is stored as an opaque byte tensor per rank, read back with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import itertools
import logging
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

logger = logging.getLogger(__name__)

_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelState(Stateful):
    """All model parts as one flat state dict (DTensors stay sharded)."""

    def __init__(self, parts: Sequence[nn.Module]):
        self.parts = list(parts)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update(get_model_state_dict(part))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each part takes its own keys out of the merged dict (DCP already checked that every
        requested key was in the checkpoint). Values that already are a parameter's or buffer's
        own memory (DCP loads a `state_dict()` in place) are not copied onto themselves: that
        copy would be a second pass over every weight of a cold load."""
        for part in self.parts:
            live = {_memory(t) for t in itertools.chain(part.parameters(), part.buffers())}
            rest = {k: v for k, v in state_dict.items() if not (isinstance(v, torch.Tensor) and _memory(v) in live)}
            if rest:
                set_model_state_dict(part, rest, options=StateDictOptions(strict=False))


def _memory(t: torch.Tensor) -> tuple:
    """Where a tensor's values live: two tensors with equal `_memory` hold the same values."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.device, local.dtype, local.data_ptr(), tuple(local.shape), local.stride()


class OptimizerState(Stateful):
    """One optimizer per model part, keyed by parameter FQN so the state reshards on load.

    Tensors are stored as `flatten_optimizer_state_dict` lays them out (`state.{fqn}.{name}`,
    TorchTitan's layout). A parameter's hyperparameters (`lr`, `betas`, ...) are stored as one
    value, `param_groups.{fqn}`, instead of one value per setting (`param_groups.{fqn}.lr`, ...):
    with a dozen settings per parameter, those made 3 of every 4 items of an AdamW state, and
    each item costs planning, pickling and metadata on every save. Keys still name the
    parameter, so ranks holding different parameters (pipeline stages) never collide, and
    `state_dict_to_load` reads either layout: TorchTitan's checkpoints load here (TorchTitan
    itself, asking for one value per setting, cannot load these)."""

    def __init__(self, parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]):
        self.pairs = list(zip(parts, optimizers, strict=True))

    def _flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part, opt in self.pairs:
            out.update(get_optimizer_state_dict(part, opt, options=_OPTIM_OPTIONS))
        return out

    def state_dict(self) -> dict[str, Any]:
        return settings_per_parameter(self._flat())

    def state_dict_to_load(self, saved_keys: Collection[str]) -> dict[str, Any]:
        """What to load from a checkpoint holding `saved_keys` (relative to this state): this
        layout, or one value per setting when the checkpoint has that (TorchTitan's)."""
        ours = self.state_dict()
        if any(k.startswith(_GROUPS) and k in saved_keys for k in ours):
            return ours
        return self._flat()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # which keys are one value per setting (a setting's value may itself be a tuple: betas)
        per_setting = self._flat()
        flat: dict[str, Any] = {}
        for key, value in state_dict.items():
            if key.startswith(_GROUPS) and key not in per_setting:
                flat.update({f"{key}.{name}": v for name, v in value})
            else:
                flat[key] = value
        for part, opt in self.pairs:
            set_optimizer_state_dict(part, opt, flat, options=_OPTIM_OPTIONS)


_GROUPS = "param_groups."


def settings_per_parameter(flat: dict[str, Any]) -> dict[str, Any]:
    """A flattened optimizer state dict (`flatten_optimizer_state_dict`) with each parameter's
    settings gathered into one value `param_groups.{fqn}`: a tuple of (name, value) pairs, which
    DCP stores as one item (a dict would be flattened into one item per setting again)."""
    out = {k: v for k, v in flat.items() if not k.startswith(_GROUPS)}
    settings: dict[str, list[tuple[str, Any]]] = {}
    for key, value in flat.items():
        if key.startswith(_GROUPS):
            fqn, name = key[len(_GROUPS):].rsplit(".", 1)
            settings.setdefault(fqn, []).append((name, value))
    out.update({_GROUPS + fqn: tuple(sorted(pairs)) for fqn, pairs in settings.items()})
    return out


class LRSchedulerState(Stateful):
    """Learning-rate schedulers, one entry per scheduler in the order given."""

    def __init__(self, schedulers: Sequence[Any]):
        self.schedulers = list(schedulers)

    def state_dict(self) -> dict[str, Any]:
        return {str(i): s.state_dict() for i, s in enumerate(self.schedulers)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for i, s in enumerate(self.schedulers):
            s.load_state_dict(state_dict[str(i)])


class DataLoaderState(Stateful):
    """A `StatefulDataLoader`'s position, one entry per rank of the checkpoint group.

    The state is serialised with `torch.save` into a uint8 tensor, so DCP stores it as one item
    per rank rather than flattening its nested structure, and loading it runs no code.
    """

    def __init__(self, dataloader: Any, rank: int):
        self.dataloader = dataloader
        self.rank = rank
        self._loaded_size: int | None = None

    @property
    def key(self) -> str:
        return f"rank_{self.rank}"

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self._loaded_size is not None:  # DCP asks for a destination to load into
            return {self.key: torch.empty(self._loaded_size, dtype=torch.uint8)}
        buf = io.BytesIO()
        torch.save(self.dataloader.state_dict(), buf)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        return {self.key: data}

    def expect_load(self, nbytes: int) -> None:
        """Prepare `state_dict()` to hand DCP an empty buffer of the saved size."""
        self._loaded_size = nbytes

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self._loaded_size = None
        data = state_dict[self.key]
        obj = torch.load(io.BytesIO(bytes(data.tolist())), weights_only=True)  # small; no numpy needed
        self.dataloader.load_state_dict(obj)
