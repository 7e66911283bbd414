"""This package as a checkpointer of TorchTitan 0.3's trainer, chosen by its config as TorchTitan's
own two are: `checkpoint=TorchtitanCkptManager.Config(...)` in a job's `config_registry` function.

TorchTitan 0.3 builds its checkpointer from the class of `Trainer.Config.checkpoint` (its
`Configurable` pattern) and its command line takes the keys of that class: this `Config` is the
`Config` of TorchTitan's DCP checkpointer (a subclass of it, so that configs typing their field as
that class take it too) with this package's own keys added (`--checkpoint.dedup_policy`,
`--checkpoint.verify_on_load`, ...), each declared as `Checkpoint` declares it. Importing this
module imports TorchTitan (0.3 or later); nothing else in the package does.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any

try:
    import tyro
    from torchtitan.components.checkpointer import BaseCheckpointManager
    from torchtitan.components.checkpointer import CheckpointManager as DcpManager
except ImportError as e:
    raise ImportError(f"torchtitan_ckpt.torchtitan_backend plugs into TorchTitan 0.3 or later ({e}); with "
                      "TorchTitan 0.2, build CheckpointManager where its trainer builds its own "
                      "(docs/torchtitan.md, Switching)") from e

from .config import Checkpoint, field_docs
from .manager import CheckpointManager


def _config_class() -> type:
    """TorchTitan's DCP checkpointer `Config` plus every `Checkpoint` field it lacks, with its
    type, default and docstring (the command line's help)."""
    theirs = {f.name for f in dataclasses.fields(DcpManager.Config)}
    hints, docs = typing.get_type_hints(Checkpoint), field_docs(Checkpoint)
    ours = []
    for f in dataclasses.fields(Checkpoint):
        if f.name in theirs:
            continue
        default = dataclasses.field(default=f.default) if f.default_factory is dataclasses.MISSING \
            else dataclasses.field(default_factory=f.default_factory)
        ours.append((f.name, Annotated[hints[f.name], tyro.conf.arg(help=docs[f.name])], default))
    namespace = {"__module__": __name__, "__qualname__": "TorchtitanCkptManager.Config",
                 "__doc__": "TorchTitan's checkpointer settings and torchtitan_ckpt's own (docs/config.md)."}
    return dataclasses.make_dataclass("Config", ours, bases=(DcpManager.Config,), namespace=namespace,
                                      kw_only=True, slots=True)


class TorchtitanCkptManager(BaseCheckpointManager):
    """TorchTitan's checkpointer surface over a `CheckpointManager`: TorchTitan's trainer calls
    `load`, `save`, `maybe_wait_for_staging` and `close` as with its own managers."""

    Config = _config_class()

    def __init__(self, config: Any, *, dataloader: Any, model_parts: list[Any], optimizers: Any,
                 lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any, base_folder: str = "",
                 ft_manager: Any = None) -> None:
        self.manager = CheckpointManager(config, model_parts=model_parts, optimizers=optimizers,
                                         lr_schedulers=lr_schedulers, dataloader=dataloader, states=states,
                                         sd_adapter=sd_adapter, base_folder=base_folder, ft_manager=ft_manager)
        """The manager doing the work, its config converted from this one (`Checkpoint.from_torchtitan`)."""
        self.save_future = None
        """Always None: a save in flight is the manager's, not a future (`maybe_wait_for_saving`)."""

    @property
    def enable(self) -> bool:
        """`checkpoint.enable`, which TorchTitan's base and trainers read."""
        return self.manager.config.enable

    def maybe_wait_for_saving(self) -> None:
        """Until the last save is durable, as TorchTitan's managers wait for their save's future;
        asked of the manager, which holds no future (TorchTitan's base waits on `save_future`)."""
        if self.enable and self.manager.save_in_flight:
            self._wait_for_saving()

    def _wait_for_saving(self) -> None:
        """Until the save in flight is durable."""
        self.manager.wait()

    def _load(self, step: int = -1) -> bool:
        """`CheckpointManager.load`."""
        return self.manager.load(step)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """`CheckpointManager.save`."""
        return self.manager.save(curr_step, last_step=last_step)

    def _maybe_wait_for_staging(self) -> None:
        """`CheckpointManager.maybe_wait_for_staging`."""
        self.manager.maybe_wait_for_staging()

    def _close(self) -> None:
        """`CheckpointManager.close`."""
        self.manager.close()
