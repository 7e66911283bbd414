"""What a job's states ask of the step a load reads, before any of it is read.

The state dict each rank fills in place: the model's tensors, and each state's entries as the
step's index holds them (the optimizer's and LR scheduler's told by themselves, the job's own
as their `state_dict()` lays them out), with the dataloader's passed over when another
data-parallel degree saved it. A state the step lacks is refused, naming the key that starts it
fresh. What the step holds and no rank asks for is told once, on rank 0.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from .config import BUILTIN_STATES, Checkpoint
from .errors import CheckpointError, counted
from .group import CheckpointGroup
from .io.materialised import check_materialised
from .io.untrusted import brief
from .load_target import LoadTarget
from .states import (DP_RANK_PREFIX, DataLoaderState, LRSchedulerState, ModelState, OptimizerState, StateLike,
                     own_state_dict, saved_dp_degree)

logger = logging.getLogger(__name__)


class LoadRequest:
    """The state dict one rank's load fills (`state`), and what no rank loads (`warn_unloaded`)."""

    def __init__(self, model: ModelState, states: Mapping[str, StateLike], config: Checkpoint,
                 group: CheckpointGroup):
        self._model = model
        self._states = states
        self.config = config
        self._group = group

    def state(self, target: LoadTarget) -> dict[str, Any]:
        """The model's state dict and each loaded state's entries, as `target` holds them, to be
        filled in place (refused when a state the job restores is not there)."""
        state: dict[str, Any] = self._model.state_dict()
        check_materialised(state, "load()")
        self._model.split_ties(state, target.index.tensors if target.format.named_as_state else ())
        if target.model_only:
            return state
        # named before the optimizer misses the new parameters' state
        target.index.require(target.path, state, spare=lambda: [k for k in self._model_names(target) if k not in state])
        keys = target.index.keys()
        for name, stateful in self._states.items():
            if name in self.config.exclude_from_loading:
                continue
            prefix = name + "."
            saved = [k for k in keys if k.startswith(prefix)]
            if not saved and name not in target.listed:
                raise CheckpointError(f"{target.path} has no state '{name}'; add '{name}' to "
                                      "checkpoint.exclude_from_loading to start it fresh")
            checked = isinstance(stateful, (OptimizerState, LRSchedulerState))  # they say what they lack
            if not saved and not checked:
                # saved with no values (an EMA before it starts, `{"shadow": {}}`), which DCP keeps no
                # trace of: the job's own empty containers, if they are that, else nothing
                template = own_state_dict(name, stateful, "load()", state)
                state[name] = template if not flatten_state_dict(template)[0] else {}
                continue
            relative = {k[len(prefix):] for k in saved}
            if isinstance(stateful, DataLoaderState) and not self._dataloader_fits(stateful, relative, target.path):
                continue
            if checked:
                try:
                    tensors = {k[len(prefix):]: v for k, v in target.index.tensors.items() if k.startswith(prefix)}
                    state[name] = stateful.state_dict_to_load(relative, tensors)
                except CheckpointError as e:
                    raise CheckpointError(f"{target.path}: {e}") from None
                target.index.require(target.path, {name: state[name]}, (
                    f"was it saved by another kind of {name.replace('_', ' ')}? add '{name}' to "
                    "checkpoint.exclude_from_loading to start it fresh"))
            else:
                state[name] = own_state_dict(name, stateful, "load()", state)  # filled in place; applied once read
                asked = flatten_state_dict({name: state[name]})[0]
                if lacking := [k for k in asked if k not in keys]:
                    if target.world_size is not None and target.world_size < self._group.world_size:
                        why = f"{target.resized(self._group.world_size)}: a state keyed by rank has none for the " \
                              "ranks added"
                    elif others := [k for k in saved if k not in asked]:  # named otherwise (a wrapper's prefix)?
                        why = f", where it holds {others[:3]}"
                    else:
                        why = " (entries added to the state since the save?)"
                    raise CheckpointError(
                        f"{target.path} lacks {counted(len(lacking), 'entry', 'entries')} of the state '{name}' this "
                        f"job has, e.g. {lacking[:3]}{why}; add '{name}' to checkpoint.exclude_from_loading to start "
                        "it fresh")
        return state

    def warn_unloaded(self, target: LoadTarget, state: dict[str, Any]) -> None:
        """What the step holds and no rank loads, which DCP leaves unread, said once on rank 0:
        model tensors that no rank's model parts have (a layer removed since the save), the
        optimizer state of parameters that no rank's optimizer holds (frozen since, or an
        optimizer built over fewer parameters by mistake), whose moments are then lost, the
        parameters an optimizer holds that the step has nothing of (trainable since), and
        entries of the job's own states none asks for (those of ranks gone, keyed by rank); and, to
        a job that goes on training, the states its marker lists that the job has none of. Each rank
        marks what it holds (a pipeline stage has its own layers) in bitmaps over the step's
        names, the same on every rank, and one gather joins them, with the names the step lacks."""
        names = self._model_names(target)
        keys = target.index.keys()
        params = sorted({_param_of(k) for k in keys if k.startswith(_SETTINGS)}) if "optimizer" in state else []
        optimizer = self._states.get("optimizer")
        mine = {n for _, named in optimizer.named for n in named} if isinstance(optimizer, OptimizerState) else set()
        own = [n for n in self._states if n not in BUILTIN_STATES and n in state]  # the job's own, loaded
        entries = sorted(k for k in keys if k.partition(".")[0] in own)
        asked = flatten_state_dict({n: state[n] for n in own})[0]
        nested = {k: v for k, v in state.items() if k not in self._states and isinstance(v, (dict, list))}
        model = set(state).union(flatten_state_dict(nested)[0])  # a module's `_extra_state` of tensors: by entry
        fresh = sorted(mine.difference(params)) if params else []  # trainable since the save
        gathered = self._group.all_gather((
            _bitmap(names, model.__contains__), _bitmap(params, mine.__contains__),
            _bitmap(entries, asked.__contains__), fresh))
        held_model, held_params, held_entries = map(_joined, zip(*(bitmaps for *bitmaps, _ in gathered)))
        if not self._group.is_coordinator:
            return
        if new := sorted({name for *_, names in gathered for name in names}):
            logger.warning("%s holds no optimizer state or settings for %d parameters this job's optimizer holds, "
                           "e.g. %s: they start without state, with their param group's settings (trainable since "
                           "the save? or tied to another parameter then, and no longer: to_empty() on a model built "
                           "on the meta device unties; tie them again)", target.path, len(new), new[:3])
        if not self.config.load_only and not target.model_only and (
                gone := sorted(set(target.listed) - {"model", *self._states})):
            logger.warning("%s holds the state(s) %s, which this job has none of: not loaded, they start anew if "
                           "the job makes them again (removed from the job since the save?)", target.path, gone)
        # none of the model's names among the step's (nested under a prefix?): the load's refusal says why
        if held_model and (unloaded := _unmarked(names, held_model)):
            logger.warning("%s holds %s this job's model does not have, e.g. %s: they are not loaded (a layer "
                           "removed since the save?)", target.path, counted(len(unloaded), "model tensor"),
                           unloaded[:3])
        if unasked := _unmarked(entries, held_entries):
            resized = target.resized(self._group.world_size)
            why = f"{resized}: a state keyed by rank keeps the entries of the ranks a job has" if resized else ""
            logger.warning("%s holds %s of the job's own states that no rank loads, e.g. %s%s; they are not loaded",
                           target.path, counted(len(unasked), "entry", "entries"), unasked[:3], why)
        if unheld := _unmarked(params, held_params):
            logger.warning("%s holds optimizer state for %s no optimizer of this job holds, e.g. %s: it "
                           "is not loaded, and their optimizer state starts anew if they are trained again (frozen "
                           "since the save, or left out of the optimizer by mistake?)",
                           target.path, counted(len(unheld), "parameter"), unheld[:3])

    def _model_names(self, target: LoadTarget) -> list[str]:
        """The step's model tensors, in order."""
        return target.index.model_names({*BUILTIN_STATES, *self._states, *target.listed} - {"model"})

    def _dataloader_fits(self, loader: DataLoaderState, saved: set[str], path: str) -> bool:
        """TorchTitan refuses a dataloader state saved by another data-parallel degree; here the
        dataloader starts from the beginning instead, and says so once. A state of another
        layout than TorchTitan's (an older torchtitan_ckpt's `rank_0`) is refused: it is no
        other degree, and starting over would go unnoticed."""
        degree = saved_dp_degree(saved)
        if not degree:
            raise CheckpointError(
                f"{path}: its dataloader state ({', '.join(brief(f'dataloader.{k}') for k in sorted(saved)[:3])}) "
                f"is not in TorchTitan's layout (dataloader.{DP_RANK_PREFIX}<rank>): saved by an older torchtitan_ckpt "
                "or another program? Add 'dataloader' to checkpoint.exclude_from_loading to start it from the "
                "beginning")
        if degree == loader.dp_world_size and loader.key in saved:
            return True
        if self._group.is_coordinator:
            logger.warning("the dataloader state was saved by %s and this job has %d; the dataloader starts "
                           "from the beginning", counted(degree, "data-parallel rank"), loader.dp_world_size)
        return False


_SETTINGS = "optimizer.param_groups."
"""Where a step keeps each parameter's optimizer settings (`OptimizerState`): one key per
parameter and setting, `optimizer.param_groups.<fqn>.<setting>`."""


def _param_of(setting: str) -> str:
    """The parameter name of a `_SETTINGS` key."""
    return setting[len(_SETTINGS):].rpartition(".")[0]


def _bitmap(names: list[str], marked: Callable[[str], bool]) -> int:
    """The names that are `marked`, as the bits of an int (bit i: `names[i]`)."""
    # made from a string of digits: a shift per name would be quadratic
    return int("".join("1" if marked(name) else "0" for name in reversed(names)) or "0", 2)


def _joined(bitmaps: Sequence[int]) -> int:
    return functools.reduce(operator.or_, bitmaps)


def _unmarked(names: list[str], bitmap: int) -> list[str]:
    """The names whose bit in `bitmap` is not set."""
    return [name for name, bit in zip(names, reversed(f"{bitmap:0{len(names)}b}")) if bit == "0"]
