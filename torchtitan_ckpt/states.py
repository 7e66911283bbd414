"""`Stateful` wrappers that turn a job's parts into DCP state dicts and back, in TorchTitan's
layout, so that a step folder is one format for both: TorchTitan's `CheckpointManager` resumes
from ours and we resume from its (docs/torchtitan.md).

Model parts are flattened into one dict of their `state_dict()` keys (non-persistent buffers are
not part of it), optimizer state is keyed by parameter name so it reshards, the schedulers are
one scheduler's state, and the dataloader's position is a pickle per data-parallel rank, read
back without running code.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import hashlib
import itertools
import logging
import math
import pickle
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torchdata.stateful_dataloader import StatefulDataLoader

try:  # FSDP1, deprecated: refused (`_refuse_fsdp1`) where this torch still has it
    from torch.distributed.fsdp import FullyShardedDataParallel as _FSDP1
except ImportError:
    _FSDP1 = None

from .errors import CheckpointError, CorruptCheckpointError, counted
from .io.dtypes import same_bytes
from .io.materialised import check_materialised
from .io.posio import byte_view
from .io.tensors import memory_of, unwrapped_values
from .io.torch_archive import load_plain_pickle, refusal
from .io.untrusted import brief

logger = logging.getLogger(__name__)


class StateLike(Protocol):
    """What `CheckpointManager(states=...)` takes as a value: torch's `Stateful`, an `nn.Module`
    (an EMA copy), or any object with these two methods, whatever `load_state_dict` returns."""

    def state_dict(self) -> dict[str, Any]:
        """The object's state: tensors and plain data, in dicts and lists."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> object:
        """Take back a state `state_dict()` gave (read from the checkpoint)."""
        ...


ModelPart = Union[nn.Module, FSDPModule, Callable[..., Any]]
"""A model part as users hold one: a module, the same module after `fully_shard` (typed
`FSDPModule`), or what `torch.compile(module)` returns (typed as a callable)."""


_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})
"""Name segments that activation checkpointing and `torch.compile` insert in a module's names; a
key in a checkpoint never carries one (TorchTitan's `ModelWrapper` guarantees the same)."""


def canonical_name(name: str) -> str:
    """`layers.0._checkpoint_wrapped_module.attention.wq.weight` -> `layers.0.attention.wq.weight`."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def unwrapped(part: nn.Module) -> nn.Module:
    """The module that `DistributedDataParallel`, `DataParallel` and `torch.compile` wrappers
    around a model part hold: their `module.` and `_orig_mod.` prefixes are no part of its keys
    (PyTorch's `get_model_state_dict` leaves DDP's out too), so a step saved under DDP loads into
    the bare model, on one rank or under FSDP, and the Hugging Face adapters see the model's names."""
    compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", ())  # not imported: none
    while True:
        if isinstance(part, (DistributedDataParallel, nn.DataParallel)):
            part = part.module
        elif isinstance(part, compiled):
            part = part._orig_mod
        else:
            return part


class CheckedState(Stateful):
    """One of this package's states: it can tell whether what a load read for it is something
    its `load_state_dict` takes, before the load changes anything (`check_loaded`)."""

    def check_loaded(self, state_dict: dict[str, Any]) -> None:
        """Raise unless `load_state_dict(state_dict)` would take the values just read."""


class ModelState(CheckedState):
    """All model parts as one flat state dict: what each part's own `state_dict()` holds (its
    state-dict hooks included, so a model that fuses `wq`/`wk`/`wv` into one parameter still
    saves them apart), keys without wrapper segments; DTensors stay sharded."""

    def __init__(self, parts: Sequence[nn.Module]):
        self.parts = list(parts)
        _refuse_fsdp1(self.parts)
        self._scratch: dict[str, str] = {}
        """The load in progress' names read into scratch (`split_ties`) -> the name read in place."""
        owner: dict[str, int] = {}
        for index, part in enumerate(self.parts):
            for key in map(canonical_name, part.state_dict()):
                if owner.setdefault(key, index) != index:  # the flat dict would keep one part's value
                    raise ValueError(f"model parts {owner[key]} and {index} both have a state named {key!r}; "
                                     "the parts' names must differ (pipeline stages keep the whole model's "
                                     "names: layers.0, layers.1, ...). Models of their own (a GAN's generator "
                                     "and discriminator) go in as one part naming each: nn.ModuleDict("
                                     "{'generator': g, 'discriminator': d}), each one's optimizer and scheduler "
                                     "in the lists")

    def state_dict(self) -> dict[str, Any]:
        """Wrapper subclasses that keep their values in one plain tensor as that tensor (`held`)."""
        return {canonical_name(k): unwrapped_values(v) if isinstance(v, torch.Tensor) else v
                for part in self.parts for k, v in part.state_dict().items()}

    def split_ties(self, state: dict[str, Any], saved: Collection[str]) -> None:
        """In `state` (this model's `state_dict()`, for a load of a step holding the tensors
        `saved`): where one tensor is the model's under several names (tied weights) and the
        step holds each name, the first is read in place and the others into scratch tensors of
        its layout, for `join_ties`. Read into the one tensor, a step that holds them apart (saved
        by a model that did not tie them) left the last name's values in place of the first's.
        Called for every load (with no `saved` where names are not the step's), so that
        `join_ties` never sees another load's names."""
        first: dict[tuple, str] = {}
        self._scratch = {}
        for name, value in list(state.items()):
            if isinstance(value, torch.Tensor) and name in saved:
                if (tied := first.setdefault(memory_of(value), name)) != name:
                    state[name] = torch.empty_like(value)
                    self._scratch[name] = tied

    def join_ties(self, state: dict[str, Any]) -> None:
        """Once `split_ties`'s scratch tensors are read: a `CheckpointError` naming both names
        unless each holds its first name's values (on this rank), else each name is the model's
        tensor again (the first name's, read in place)."""
        for name, tied in self._scratch.items():
            if not same_bytes(state[name], state[tied]):  # a NaN equal to itself
                raise CheckpointError(
                    f"the model ties {name} to {tied} (one tensor), and the step holds different values for them "
                    "(saved by a model that did not tie them): load it into a model built without the tie")
            state[name] = state[tied]

    def one_parameter(self, name: str, other: str) -> bool | None:
        """Whether the parameter `name` of this rank's parts is the parameter `other` too (tied);
        None when no part holds `name`."""
        params = {canonical_name(n): p for part in self.parts for n, p in part.named_parameters(remove_duplicate=False)}
        return None if name not in params else params.get(other) is params[name]

    def buffer_names(self) -> set[str]:
        """The keys of `state_dict()` that may be buffers (running statistics, counters)."""
        return {canonical_name(n) for part in self.parts for n, _ in part.named_buffers(remove_duplicate=False)}

    def parameter_names(self, optimizers: Sequence[torch.optim.Optimizer]) -> set[str]:
        """The keys of `state_dict()` that are parameters `optimizers` hold (both names of a
        tied one)."""
        held = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
        return {canonical_name(n) for part in self.parts for n, p in part.named_parameters(remove_duplicate=False)
                if id(p) in held}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each part takes its own keys out of the merged dict (DCP already checked that every
        requested key was in the checkpoint), under the names its `load_state_dict` expects.
        Values that already are a parameter's or buffer's own memory (DCP loads a
        `state_dict()` in place) are not copied onto themselves: that copy would be a second
        pass over every weight of a cold load. A module with load hooks of its own (a
        `load_state_dict` pre- or post-hook, a `_load_from_state_dict` of the user's, e.g. one
        that recomputes a derived buffer) is given every value under it, so its hooks see the
        load."""
        for part in self.parts:
            live = {memory_of(t) for t in itertools.chain(part.parameters(), part.buffers())}
            hooked = _hooked_prefixes(part)
            mine = {k: state_dict[canonical_name(k)] for k in part.state_dict() if canonical_name(k) in state_dict}
            rest = {k: v for k, v in mine.items() if not (isinstance(v, torch.Tensor) and memory_of(v) in live)
                    or any(canonical_name(k).startswith(prefix) for prefix in hooked)}
            if rest:
                part.load_state_dict(rest, strict=False)


def own_state_dict(name: str, stateful: Stateful, call: str, model: Collection[str]) -> Any:
    """`stateful.state_dict()` of a job's own `states[name]`: a container DCP saves entry by entry
    (a dict, a list of tensors), whose names (its own too) are not the `model`'s, and whose
    tensors have memory and can be filled in place (`check_materialised`: wrappers
    that keep their values in one plain tensor as that tensor): a step saved otherwise never
    loads."""
    if name in model:  # `{**model, **states}` would put the state in its place
        raise CheckpointError(f"{call}: states[{name!r}] has the name of the model's {name!r} (a parameter or "
                              "buffer of its top level): a step keeps one value per name; name the state otherwise")
    state = stateful.state_dict()
    flat = flatten_state_dict({name: state})[0]
    if any(isinstance(v, torch.Tensor) and unwrapped_values(v) is not v for v in flat.values()):
        state = _unwrapped_tree(state)  # a model's copy (an EMA's, a teacher's) of wrapped weights
        flat = flatten_state_dict({name: state})[0]
    if name in flat:  # kept whole: no entries for a load to fill
        raise CheckpointError(f"{call}: states[{name!r}].state_dict() returned a {type(state).__name__}, which DCP "
                              "keeps as one value where a load needs entries to fill: return a dict")
    if clash := sorted(k for k in flat if k in model):
        raise CheckpointError(f"{call}: states[{name!r}] holds {clash[:3]}, which are names of the model too: a step "
                              "keeps one value per name; name the state otherwise")
    check_materialised(flat, call, f"states[{name!r}]'s")
    return state


def _unwrapped_tree(state: Any) -> Any:
    """`state` (dicts and lists, as DCP nests them) with each wrapper that keeps its values in one
    plain tensor as that tensor (`unwrapped_values`, as `ModelState.state_dict` gives them)."""
    if isinstance(state, torch.Tensor):
        return unwrapped_values(state)
    if isinstance(state, Mapping):
        return {k: _unwrapped_tree(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_unwrapped_tree(v) for v in state]
    return state


def _hooked_prefixes(part: nn.Module) -> list[str]:
    """The key prefixes, without wrapper segments ("" for the whole part), of the modules of
    `part` that run code of their own when loaded: a load hook or a `_load_from_state_dict` that
    is not PyTorch's (PyTorch's rename keys, as activation checkpointing's wrapper does, or
    convert old versions' keys, and need no values)."""
    return [f"{name}." if name else "" for name, m in ((canonical_name(n), m) for n, m in part.named_modules())
            if any(not _pytorchs(hook) for hook in (*m._load_state_dict_pre_hooks.values(),
                                                    *m._load_state_dict_post_hooks.values()))
            or not _pytorchs(type(m)._load_from_state_dict)]


def _pytorchs(fn: Any) -> bool:
    """Whether a hook or method is PyTorch's own code (through the wrappers hooks are kept in)."""
    for attribute in ("hook", "func", "__func__"):  # a registered hook's wrapper, a partial, a bound method
        fn = getattr(fn, attribute, fn)
    return getattr(fn, "__module__", None) is not None and fn.__module__.split(".")[0] == "torch"


def _refuse_fsdp1(parts: list[nn.Module]) -> None:
    """A `TypeError` naming the first `FullyShardedDataParallel` (FSDP1) module of `parts`: its
    parameters are flat, per-rank shards that no name tells apart (each rank's optimizer state
    would be saved under one key and loaded into the wrong rank), and its `state_dict()` is a
    collective. Checked before anything calls it."""
    if _FSDP1 is None:
        return
    for index, part in enumerate(parts):
        for name, module in part.named_modules():
            if isinstance(module, _FSDP1):
                where = f"model part {index}" + (f" at {canonical_name(name)!r}" if name else "")
                raise TypeError(f"{where} is wrapped in FullyShardedDataParallel (FSDP1), whose flat per-rank "
                                "parameter and optimizer shards cannot be saved by name; shard it with "
                                "torch.distributed.fsdp.fully_shard (FSDP2), as TorchTitan does")


class OptimizerState(CheckedState):
    """Optimizers keyed by parameter name, in TorchTitan's layout, so the state reshards on load
    and TorchTitan's `CheckpointManager` reads it: `state.{fqn}.{name}` for each state tensor
    and `param_groups.{fqn}.{setting}` for each setting of the parameter's group (what
    `get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)` produces, without the
    `param_names` list). The state dict is nested (`state` -> fqn -> name); DCP's flattening
    joins the keys with dots into those names.

    Any number of optimizers per model part (TorchTitan's `OptimizersContainer` may build
    several); each optimizer's parameters must belong to one of the parts."""

    def __init__(self, parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]):
        self.parts = list(parts)
        self.optimizers = list(optimizers)
        if lbfgs := [i for i, opt in enumerate(self.optimizers) if isinstance(opt, torch.optim.LBFGS)]:
            raise TypeError(f"optimizers[{lbfgs[0]}] is an LBFGS, whose state is its history of directions and "
                            "steps, lists that grow from step to step: a load fills the job's own state in place, "
                            "and a resumed LBFGS holds lists of other lengths (or none), so no step of it would "
                            "load. Not supported: leave it out of optimizers= (its history starts afresh on resume)")
        self.named  # every optimizer's parameters are in the parts, checked now
        self._made_kinds: dict[str, dict[str, tuple[torch.dtype, torch.device]]] = {}
        """The dtype and device of each state tensor `state_dict_to_load` made (`_made_state`),
        by parameter name and state key, as the optimizer holds them (`_held_as_made`)."""

    @property
    def named(self) -> list[tuple[torch.optim.Optimizer, list[str]]]:
        """Each optimizer with the canonical names of its parameters, by their index in its state
        dict: named at each use, as its parameters may change (`add_param_group`)."""
        names = {id(p): canonical_name(n) for part in self.parts for n, p in part.named_parameters()}
        named = [(opt, _parameter_names(names, opt)) for opt in self.optimizers]
        first: dict[str, int] = {}
        for i, (_, held) in enumerate(named):
            for name in held:
                if (other := first.setdefault(name, i)) != i:
                    raise ValueError(f"the parameter {name} is in optimizers {other} and {i}: the state is kept by "
                                     "parameter name (TorchTitan's layout), so one optimizer's state and settings "
                                     "would stand for both's and neither loads as saved; give each parameter to "
                                     "one optimizer")
        return named

    def state_dict(self) -> dict[str, Any]:
        """The optimizers' state as it is: a parameter without state (its optimizer took no step
        yet, or it had no gradient) is saved without, and the optimizer is left untouched. Made
        for the save by a step at learning rate 0 (as DCP's `get_optimizer_state_dict` makes it),
        it changed training: Adam counted one step more from then on, Rprop's step sizes started
        from 0."""
        state: dict[str, Any] = {}
        groups: dict[str, Any] = {}
        for opt, names in self.named:
            saved = opt.state_dict()  # a parameter without state yet (no step taken) is saved without
            for index, values in saved["state"].items():
                state[names[index]] = values
            for group in saved["param_groups"]:
                settings = {k: v for k, v in group.items() if k not in _NOT_SETTINGS}
                groups.update({names[index]: dict(settings) for index in group["params"]})
        _refuse_subclassed(state)
        return {"state": state, "param_groups": groups}

    def state_dict_to_load(self, saved_keys: Collection[str], saved_tensors: Mapping[str, tuple[int, ...]]
                           ) -> dict[str, Any]:
        """What to load from a checkpoint holding `saved_keys` (relative to this state), of which
        `saved_tensors` are tensors (their shapes): the state tensors of every parameter the
        checkpoint has state for, and the settings it has, in the kinds it holds them
        (`in_saved_kinds`: a float or a tensor `lr`); a setting a newer PyTorch added keeps its
        present value. A parameter the step holds nothing of (frozen when saved, trainable now)
        starts without state, in its group with the settings of the group's others (its own
        group's, if none was saved), as `warn_unloaded` says; when no parameter has settings in
        the step, the load is refused. An optimizer that has no state yet is left without one (its
        state is made here to be read into and is given to it when the load is applied), so a
        load refused before then leaves it as it was; one that has state for some parameters
        only (others had no gradient yet) gets state made for the rest that the checkpoint has."""
        sd, self._made_kinds = self.state_dict(), {}
        # a parameter that had no state when saved (no gradient yet) has none after the load; one
        # that had state of other names (another optimizer) is still asked for its own, and refused
        held = {key[len("state."):] for key in saved_keys if key.startswith("state.")}
        prefixes = _prefixes(held)  # every `fqn` of `fqn.name...`
        for opt, names in self.named:
            lacking = {name for name in names if name in prefixes and name not in sd["state"]}
            if lacking:
                made = _made_state(opt, names, lacking, self._made_kinds)
                _refuse_subclassed(made)  # a fresh low-bit optimizer's: read into, then requantized
                sd["state"].update(made)
        sd["state"] = {fqn: values for fqn, values in sd["state"].items() if fqn in prefixes}
        sd["param_groups"] = in_saved_kinds(
            {fqn: {k: v for k, v in settings.items() if f"param_groups.{fqn}.{k}" in saved_keys}
             for fqn, settings in sd["param_groups"].items()},
            saved_tensors, set(saved_keys) - set(saved_tensors), "param_groups")
        if bare := [fqn for fqn, settings in sd["param_groups"].items() if not settings]:
            named = _prefixes(saved_keys) | set(saved_keys)
            odd = [fqn for fqn in bare if {f"param_groups.{fqn}", f"state.{fqn}"} & named] or (
                bare if len(bare) == len(sd["param_groups"]) else [])
            if odd:  # saved otherwise (a crafted value), or nothing of the optimizer's is in the step
                raise CheckpointError(f"the checkpoint has no optimizer settings (optimizer.param_groups.<fqn>.lr, "
                                      f"...) for {len(odd)} parameters, e.g. {odd[:3]}; add 'optimizer' to "
                                      "checkpoint.exclude_from_loading to start it fresh")
            sd["param_groups"] = {fqn: settings for fqn, settings in sd["param_groups"].items() if settings}
        return sd

    def check_loaded(self, state_dict: dict[str, Any]) -> None:
        """Each setting read is of the kind the job's optimizer has for it (a number, a flag, a
        pair of numbers, ...): one of another kind would load, then fail the next step. A param
        group takes one parameter's settings: parameters saved with others (in groups of their
        own then) are refused, as `Optimizer.load_state_dict` refuses groups that differ."""
        live, saved = {}, state_dict.get("param_groups", {})
        for opt, names in self.named:
            at = 0
            for group in opt.param_groups:
                members = names[at:at + len(group["params"])]
                for name in members:
                    live[name] = group
                at += len(group["params"])
                held = [name for name in members if name in saved]
                first = saved[held[0]] if held else {}
                unlike = {n: _differing_settings(first, saved[n]) for n in held[1:]}
                if other := next((n for n, keys in unlike.items() if keys), None):
                    differ = [f"{k} {brief(first.get(k))} and {brief(saved[other].get(k))}" for k in unlike[other]]
                    raise CheckpointError(
                        f"this job's optimizer has {held[0]} and {other} in one param group, and the step saved them "
                        f"with other settings ({', '.join(sorted(differ))}): the group would take {held[0]}'s for "
                        "both. Build the param groups as saved, or add 'optimizer' to checkpoint.exclude_from_loading")
        for fqn, settings in state_dict.get("param_groups", {}).items():
            for key, value in settings.items():
                if fqn in live and key in live[fqn] and not _same_kind(value, live[fqn][key]):
                    raise CorruptCheckpointError(f"optimizer.param_groups.{fqn}.{key} is {brief(value)}, where this "
                                                 f"job's optimizer has {brief(live[fqn][key])}")

    def scheduled(self) -> list[list[dict[str, Any]]]:
        """Each param group's settings an LR scheduler sets: its learning rate, and those its
        optimizer was not made with (`initial_lr`, OneCycleLR's `max_lr`, ...); a tensor's value
        copied (a load writes a tensor rate in place)."""
        return [[{k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in group.items()
                  if k == "lr" or (k != "params" and k not in opt.defaults)}
                 for group in opt.param_groups] for opt in self.optimizers]

    def reschedule(self, settings: list[list[dict[str, Any]]]) -> None:
        """Give each param group back the settings `scheduled` gave (after a load of the
        optimizer without its schedulers: the job's fresh schedule starts from its own rates),
        a tensor rate in place."""
        for opt, groups in zip(self.optimizers, settings):
            for group, own in zip(opt.param_groups, groups):
                for key, value in own.items():
                    live = group.get(key)
                    if isinstance(live, torch.Tensor) and isinstance(value, torch.Tensor) and live.shape == value.shape:
                        live.copy_(value)
                    else:
                        group[key] = value

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for opt, names in self.named:
            current = opt.state_dict()
            state = {index: state_dict["state"][name] for index, name in enumerate(names) if name in state_dict["state"]}
            saved = state_dict["param_groups"]
            groups = [{**group, **{k: as_live(v, group.get(k)) for k, v in next(
                (saved[names[i]] for i in group["params"] if names[i] in saved), {}).items()}}
                for group in current["param_groups"]]
            for group in groups:
                group["params"] = _Indices(group["params"])
            params = [p for group in opt.param_groups for p in group["params"]]
            kinds = {index: {**self._made_kinds.get(names[index], {}), **_kinds(opt.state.get(params[index], {}))}
                     for index in state}  # before the load: the optimizer's own, or made by it
            opt.load_state_dict({"state": state, "param_groups": groups})
            _held_as_made(opt, params, state, kinds)
        self._made_kinds = {}


def _kinds(values: Mapping[str, Any]) -> dict[str, tuple[torch.dtype, torch.device]]:
    return {key: (v.dtype, v.device) for key, v in values.items() if isinstance(v, torch.Tensor)}


def _held_as_made(opt: torch.optim.Optimizer, params: list[torch.Tensor], given: Mapping[int, Mapping[str, Any]],
                  kinds: Mapping[int, Mapping[str, tuple[torch.dtype, torch.device]]]) -> None:
    """Put back, in the dtype and on the device the optimizer made it (`kinds`), each state
    tensor `Optimizer.load_state_dict` cast to its parameter's: fp32 master weights or moments of
    bf16 parameters came back as bf16, state kept on the CPU moved to the GPU. Put back from the
    tensor read (`given`), not from the cast, which lost its precision."""
    for index, values in given.items():
        held = opt.state[params[index]]
        for key, value in values.items():
            kind, now = kinds[index].get(key), held.get(key)
            if kind is not None and isinstance(value, torch.Tensor) and isinstance(now, torch.Tensor) and (
                    now.dtype, now.device) != kind:
                held[key] = value.to(dtype=kind[0], device=kind[1])


class _Indices(list):
    """A param group's parameter indices, for `Optimizer.load_state_dict`, whose `in` is a set
    lookup: it asks, for each state tensor, whether its parameter's index is `in` each group's
    list, which was quadratic in the parameters (docs/performance.md)."""

    def __init__(self, indices: Iterable[int]):
        super().__init__(indices)
        self._set = frozenset(self)

    def __contains__(self, index: object) -> bool:
        return index in self._set


_NOT_SETTINGS = ("params", "param_names")


def _prefixes(keys: Iterable[str]) -> set[str]:
    """Every part of each of `keys` before one of its dots (`a` and `a.b` of `a.b.c`)."""
    return {key[:i] for key in keys for i, ch in enumerate(key) if ch == "."}


def _refuse_subclassed(state: dict[str, Any]) -> None:
    """A `CheckpointError` naming the tensors of optimizer `state` (parameter name -> its state)
    that are subclasses: the writers would write their storage, not their values (torchao's
    low-bit moments: garbage, a failure deep in torch, or a step no load reads back), and
    DCP's own writer pickles them, which no load of this package runs."""
    subclassed = [f"optimizer.state.{name}.{key} ({type(local).__name__})" for name, values in state.items()
                  if isinstance(values, dict) for key, v in values.items() if isinstance(v, torch.Tensor)
                  and type(local := v._local_tensor if isinstance(v, DTensor) else v)
                  not in (torch.Tensor, nn.Parameter)]
    if subclassed:
        raise CheckpointError(f"{subclassed[:3]} are tensor subclasses (a low-bit optimizer's quantized moments, "
                              "say), which no step of this package holds, as reading them would run their code: use "
                              "an optimizer whose state is plain tensors (torch.optim's)")


def _made_state(opt: torch.optim.Optimizer, names: list[str], wanted: Collection[str],
                kinds: dict[str, dict[str, tuple[torch.dtype, torch.device]]]) -> dict[str, Any]:
    """State for `opt`'s parameters named in `wanted`, to read a checkpoint's into, made as an
    optimizer's first state is (a step at learning rate 0 on zero gradients, which leaves the
    parameters as they are) for those parameters alone, on a state of its own and with the
    optimizer's step hooks set aside (a hook keeping an EMA or a count would take it for a
    step): `opt`'s state, groups, hooks and its parameters' gradients are left as they were.
    The dtype and device of each tensor it made go into `kinds` (the state returned is what its
    `state_dict()` gives, through any hook of its)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    name_of = {id(p): name for p, name in zip(params, names)}
    mine = [p for p in params if name_of[id(p)] in wanted]
    held = opt.state, opt.param_groups, [p.grad for p in mine]
    opt.state = collections.defaultdict(dict)
    opt.param_groups = [{**g, "params": [p for p in g["params"] if name_of[id(p)] in wanted]} for g in held[1]]
    try:
        for p in mine:
            p.grad = None
        _make_state(opt)
        kinds.update({name_of[id(p)]: _kinds(values) for p, values in opt.state.items()})
        made = opt.state_dict()["state"]
    finally:
        opt.state, opt.param_groups = held[0], held[1]
        for p, grad in zip(mine, held[2]):
            p.grad = grad
    return {name_of[id(mine[index])]: values for index, values in made.items()}


def _make_state(opt: torch.optim.Optimizer) -> None:
    """`opt`'s first state made by a step at learning rate 0 on zero gradients, unless it has
    state, its step hooks set aside (state made to read a load into is no step to an EMA or a
    step count). An optimizer whose step cannot be taken so (one that needs a closure, as
    sharpness-aware minimisation's does) is named, with what to do."""
    try:
        with _hooks_aside(opt):
            if isinstance(opt, torch.optim.SparseAdam):  # its step takes sparse gradients only
                _sparse_first_state(opt)
            else:
                _init_optim_state(opt)
    except Exception as e:
        raise CheckpointError(
            f"{type(opt).__name__} has no state yet, and a step at learning rate 0 on zero gradients, which "
            f"makes it, failed ({type(e).__name__}: {e}): its state is loaded once it has taken a step of its "
            "own; to load the rest without it, add 'optimizer' to checkpoint.exclude_from_loading") from e


def _sparse_first_state(opt: torch.optim.Optimizer) -> None:
    """`_init_optim_state` for an optimizer of sparse gradients: a step at learning rate 0 on
    gradients of no elements, made for the parameters that have none and let go after it."""
    if opt.state:
        return
    rates = [group["lr"] for group in opt.param_groups]
    given = [p for group in opt.param_groups for p in group["params"] if p.grad is None]
    for p in given:
        p.grad = torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.long, device=p.device),
                                         p.new_empty((0, *p.shape[1:])), p.shape, check_invariants=True,
                                         device=p.device)
    try:
        for group in opt.param_groups:
            group["lr"] = 0.0
        opt.step()
    finally:
        for group, rate in zip(opt.param_groups, rates):
            group["lr"] = rate
        for p in given:
            p.grad = None


@contextlib.contextmanager
def _hooks_aside(opt: torch.optim.Optimizer) -> Iterator[None]:
    """`opt` without its step hooks for the block: a step made to create state (at learning rate
    0 on zero gradients) is no training step to a hook keeping an EMA or a count, nor to the
    manager's own (`CheckpointManager._before_optimizer_step`)."""
    hooks = {k: getattr(opt, k) for k in _STEP_HOOKS if hasattr(opt, k)}
    for k in hooks:
        setattr(opt, k, collections.OrderedDict())
    try:
        yield
    finally:
        for k, v in hooks.items():
            setattr(opt, k, v)


_STEP_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
"""Where an optimizer keeps the step hooks registered on it."""


def _same_kind(saved: Any, live: Any) -> bool:
    """Whether an optimizer setting read from a checkpoint can stand where the job has `live`:
    None (an option left to its default) anywhere and anything where the job has None, a flag
    for a flag, a number (or a tensor holding one) for a number, a sequence of as many such for
    a sequence, text for text, a table whose shared keys are such for a table."""
    if saved is None or live is None:
        return True
    if isinstance(live, bool):
        return isinstance(saved, bool)
    if _number(live):
        return _number(saved)
    if isinstance(live, (tuple, list)):
        return (isinstance(saved, (tuple, list)) and len(saved) == len(live)
                and all(_same_kind(s, v) for s, v in zip(saved, live)))
    if isinstance(live, str):
        return isinstance(saved, str)
    if isinstance(live, dict):
        return isinstance(saved, dict) and all(_same_kind(saved[k], live[k]) for k in saved.keys() & live.keys())
    return True


def in_saved_kinds(state: Any, saved_tensors: Mapping[str, tuple[int, ...]], saved_values: Collection[str],
                   key: str = "") -> Any:
    """`state` (a checked state's entries to load, `key` its flattened name) with each number
    that the step holds as a one-element tensor made a tensor of that shape to read it into,
    and each one-element tensor it holds as a value made a number, in lists too (which DCP
    keeps whole when they hold no tensor, entry by entry when they do: a scheduler's
    `base_lrs`): learning rates saved as floats and resumed as tensors (an optimizer step
    compiled since) or the other way round. `as_live` gives what is read the job's kinds back."""
    if isinstance(state, dict):
        return {k: in_saved_kinds(v, saved_tensors, saved_values, f"{key}.{k}" if key else str(k))
                for k, v in state.items()}
    if isinstance(state, list):
        if key in saved_values:  # kept whole: no tensor in it
            return _numbers(state)
        return [in_saved_kinds(v, saved_tensors, saved_values, f"{key}.{i}") for i, v in enumerate(state)]
    if _scalar_tensor(state) and key in saved_values:
        return state.item()
    if _plain_number(state) and key in saved_tensors:
        return torch.zeros(saved_tensors[key], dtype=torch.float64, device="cpu")
    return state


def _numbers(value: Any) -> Any:
    """`value` with each one-element tensor in it (in lists too) made its number."""
    if isinstance(value, list):
        return list(map(_numbers, value))
    return value.item() if _scalar_tensor(value) else value


def as_live(loaded: Any, live: Any) -> Any:
    """`loaded` (a value read for an entry `in_saved_kinds` may have changed) in the kind of the
    job's `live` one: a number where the job has a one-element tensor (on its device, of its
    dtype), a tensor's number where the job has a number, entry by entry in lists and dicts."""
    if _scalar_tensor(live) and _plain_number(loaded):
        return torch.full_like(live, loaded)
    if _plain_number(live) and _scalar_tensor(loaded):
        return type(live)(loaded.item())
    if isinstance(live, list) and isinstance(loaded, list) and len(live) == len(loaded):
        return [as_live(a, b) for a, b in zip(loaded, live)]
    if isinstance(live, dict) and isinstance(loaded, dict):
        return {k: as_live(v, live.get(k)) for k, v in loaded.items()}
    return loaded


def _scalar_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.numel() == 1


def _plain_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            or isinstance(value, torch.Tensor) and value.numel() == 1)


def _differing_settings(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The settings two parameters were saved with that differ (or that one of them lacks)."""
    return sorted(k for k in {*a, *b} if k not in a or k not in b or not _equal_setting(a[k], b[k]))


def _equal_setting(a: Any, b: Any) -> bool:
    """Whether two saved optimizer settings (or groups of them) are one: numbers by value (SGD's
    default weight decay is the int 0, a group's own the float 0.0), containers item by item."""
    if _number(a) and _number(b):
        return float(a) == float(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal_setting(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_equal_setting, a, b))
    return _same_settings(a, b, False)


def _parameter_names(names: dict[int, str], opt: torch.optim.Optimizer) -> list[str]:
    """The canonical name of each of `opt`'s parameters, by their index in its state dict, from
    the names of the model parts' parameters by their id (made once for every optimizer: an
    optimizer per parameter, as with TorchTitan's optimizer in backward, made it quadratic)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    unknown = [i for i, p in enumerate(params) if id(p) not in names]
    if unknown:
        raise ValueError(f"{type(opt).__name__} optimizes {counted(len(unknown), 'parameter')} of none of the "
                         f"model parts (indices {unknown[:5]}); pass every part its parameters are in (an optimizer "
                         "built before fully_shard, or before to_empty on a model built on the meta device, holds "
                         "the parameters these replaced: build it after)")
    return [names[id(p)] for p in params]


class LRSchedulerState(CheckedState):
    """Learning-rate schedulers as TorchTitan's `LRSchedulersContainer` keeps them: they step
    together, so the first one's `state_dict()` is saved (`last_epoch`, `base_lrs`, ... at the
    top of the state: TorchTitan 0.2.2's layout, whose `last_epoch` is all 0.3.0 reads).

    Loading takes whichever of those keys the checkpoint has (0.3.0 saves `last_epoch` alone)
    over each scheduler's own state; when there are several and the step holds the first one's
    `base_lrs`, each one's are its optimizer's `initial_lr`s as loaded (`_initial_rates`); its
    last learning rates are its optimizer's, which load before it.

    TorchTitan's layout assumes the schedulers alike (built from one config). Where a later one's
    state differs from the first's in more than those (another kind, other settings), every
    scheduler's own state is saved besides, under `per_scheduler.<i>`, and each loads its own:
    the first one's settings would otherwise overwrite theirs. Readers of TorchTitan's layout
    ignore that entry."""

    def __init__(self, schedulers: Sequence[Any], sets_rates: bool = False, tells: bool = True):
        self.schedulers = list(schedulers)
        self.sets_rates = sets_rates
        """The optimizers' states are not loaded (`exclude_from_loading`): a loaded schedule sets
        its optimizer's learning rates (`_set_rates`)."""
        self.tells = tells
        """This rank logs what a load replaces of the job's own settings (one rank of a job)."""

    def state_dict(self) -> dict[str, Any]:
        first = self.schedulers[0].state_dict()
        states = [first, *(s.state_dict() for s in self.schedulers[1:])]
        if any(not _same_settings(first, other) for other in states[1:]):
            return {**first, _EACH: {str(i): state for i, state in enumerate(states)}}
        return first

    def state_dict_to_load(self, saved_keys: Collection[str], saved_tensors: Mapping[str, tuple[int, ...]]
                           ) -> dict[str, Any]:
        """The entries of this state the checkpoint holds (`saved_keys` relative to it, of which
        `saved_tensors` are tensors), in the kinds it holds them (`in_saved_kinds`). It must
        hold `last_epoch`, or, for a scheduler without one (`ChainedScheduler`, whose state is
        its schedulers'), every entry of the scheduler's own state but its last rates."""
        live = self.state_dict()
        needed = ["last_epoch"] if "last_epoch" in live else [k for k in live if k not in (*_PER_SCHEDULER, _EACH)]
        held = [k for k in live if _held(k, saved_keys)]
        missing = [k for k in needed if k not in held]
        if missing:
            has = f"it has lr_scheduler.{min(saved_keys)}, ..." if saved_keys else "it has no lr_scheduler entry"
            raise CheckpointError(f"the checkpoint has no lr_scheduler.{missing[0]} ({has}); add 'lr_scheduler' to "
                                  "checkpoint.exclude_from_loading to start it fresh")
        wanted = {k: live[k] for k in held}
        if _EACH in wanted:  # the entries the checkpoint has of each scheduler (a resume may have more or fewer)
            each = {i: {k: v for k, v in state.items() if _held(f"{_EACH}.{i}.{k}", saved_keys)}
                    for i, state in wanted[_EACH].items()}
            wanted[_EACH] = {i: state for i, state in each.items() if state}
        return in_saved_kinds(_unshared(wanted, set()), saved_tensors, set(saved_keys) - set(saved_tensors))

    def check_loaded(self, state_dict: dict[str, Any]) -> None:
        """Step counts are ints, and every entry read is of the kind (and length) the job's
        scheduler has for it: a rate list of another length, or text for one, would load and
        then fail the next step, or fail the load after the model was filled."""
        each = state_dict.get(_EACH, {})
        for where, state in [("", state_dict), *((f"{_EACH}.{i}.", s) for i, s in each.items())]:
            for key in ("last_epoch", "_step_count"):
                if key in state and type(state[key]) is not int:
                    raise CorruptCheckpointError(f"lr_scheduler.{where}{key} is {state[key]!r}, not a step count")
        for i, scheduler in enumerate(self.schedulers):
            own = scheduler.state_dict()
            where, shared = self._shared(state_dict, i)
            for key in sorted(shared.keys() & own.keys()):  # the same key named by every rank
                saved, live = shared[key], own[key]
                if _same_kind(saved, live):
                    continue
                groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", ())
                if isinstance(saved, (list, tuple)) and isinstance(live, (list, tuple)) and \
                        len(saved) != len(live) == len(groups):
                    raise CheckpointError(
                        f"lr_scheduler.{where}{key} holds {len(saved)} value(s), one per param group of the "
                        f"saved optimizer, where this job's optimizer has {len(live)} param groups: the saved "
                        "schedule does not fit them. Add 'lr_scheduler' to checkpoint.exclude_from_loading to "
                        "start it afresh (the optimizer's state loads by parameter name), or build the param "
                        "groups as saved")
                raise CorruptCheckpointError(f"lr_scheduler.{where}{key} is {brief(saved)}, where this "
                                             f"job's scheduler has {brief(live)}")

    def _shared(self, state_dict: dict[str, Any], i: int) -> tuple[str, dict[str, Any]]:
        """Where in `state_dict` the `i`-th scheduler's state is, and that state."""
        if own := state_dict.get(_EACH, {}).get(str(i)):
            return f"{_EACH}.{i}.", own
        return "", {k: v for k, v in state_dict.items() if k != _EACH and (
            len(self.schedulers) == 1 or k not in _PER_SCHEDULER)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for i, scheduler in enumerate(self.schedulers):
            own = scheduler.state_dict()
            shared = {k: as_live(v, own.get(k)) for k, v in self._shared(state_dict, i)[1].items()}
            if "base_lrs" in own and "base_lrs" in state_dict and "base_lrs" not in shared and not self.sets_rates:
                shared["base_lrs"] = _initial_rates(scheduler, own["base_lrs"])  # one of several, the first's saved
            rates, built = _base_rates(shared), _base_rates(own)
            if self.tells and rates is not None and built is not None and (len(rates) != len(built) or not all(
                    math.isclose(a, b, rel_tol=1e-6) for a, b in zip(rates, built))):  # a float32 tensor's rate too
                logger.warning("lr_scheduler %d: the step's base learning rates %s replace the %s this job's optimizer "
                               "was built with, and its schedule goes on from them: a learning rate changed since the "
                               "save takes effect only with 'lr_scheduler' in checkpoint.exclude_from_loading (its "
                               "schedule then starts afresh)", i, rates, built)
            scheduler.load_state_dict(copy.deepcopy({**own, **shared}))
            if "_step_count" not in state_dict and "_step_count" in own and hasattr(scheduler, "last_epoch"):
                scheduler._step_count = scheduler.last_epoch + 1  # what step() would have counted (ReduceLROnPlateau
                # counts none)
            if self.sets_rates:  # the first scheduler's last rates are its own where base rates are too
                alike = state_dict.get("base_lrs") == scheduler.state_dict().get("base_lrs")
                _set_rates(i, scheduler, shared.get("_last_lr", state_dict.get("_last_lr") if alike else None))
            elif "_last_lr" not in shared and hasattr(scheduler, "optimizer"):
                scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def _initial_rates(scheduler: Any, own: list[Any]) -> list[Any]:
    """The base rates of one of several schedulers saved in TorchTitan 0.2.2's layout (the first
    one's state alone): its optimizer's `initial_lr`s, as the step's optimizer settings gave them,
    where the optimizer loaded them; else `own`. A learning rate changed since the save is then
    the step's, as under one scheduler, not the job's one step later."""
    groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", [])
    rates = [group.get("initial_lr") for group in groups]
    if len(rates) != len(own) or not all(isinstance(r, (float, torch.Tensor)) for r in rates):
        return own
    return [r.detach().clone() if isinstance(r, torch.Tensor) else r for r in rates]


_DIGESTED_BYTES = 1 << 20
"""CPU tensors of up to this many bytes are digested whole by `replicated_digest`; larger
contiguous ones (an EMA's replicated weights) by as many bytes of elements taken at an even
stride through them (copies that drifted apart differ throughout); others (a tensor on a GPU: no
copy on the training thread) by their dtype and shape alone."""


def replicated_digest(state: Any) -> tuple[bytes, bytes]:
    """Digests of the keys, and of the keys and values, of what a save keeps one copy of for
    every rank in `state` (a state dict): its values and its tensors that are not DTensors. Ranks
    with the same keys and other values hold a state whose values differ by rank; ranks with
    other keys (a state keyed by rank) are saved apart."""
    keys, values = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16)
    for key, value in sorted(flatten_state_dict(state)[0].items()):
        if isinstance(value, DTensor):
            continue
        keys.update(f"{key}\0".encode())
        values.update(f"{key}\0".encode())
        if not isinstance(value, torch.Tensor):
            values.update(repr(_canonical(value)).encode())
            continue
        values.update(f"{value.dtype}{list(value.shape)}".encode())
        whole = value.numel() * value.element_size() <= _DIGESTED_BYTES
        if value.device.type == "cpu" and (whole or value.is_contiguous()):
            try:
                flat = value.detach().reshape(-1)
                if not whole:
                    flat = flat[:: -(-flat.numel() * value.element_size() // _DIGESTED_BYTES)]
                values.update(byte_view(flat.contiguous()).numpy().tobytes())
            except (RuntimeError, TypeError):  # no bytes to read (sparse, quantized)
                pass
    return keys.digest(), values.digest()


def _canonical(value: Any) -> Any:
    """`value` with its sets sorted (by their items' `repr`), which each process prints in an order
    of its own (its string hashes' seed), and its dicts' items by their keys' `repr` (ranks may
    fill one dict in other orders)."""
    if isinstance(value, (set, frozenset)):
        return sorted(map(repr, map(_canonical, value)))
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return sorted(((repr(k), _canonical(v)) for k, v in value.items()), key=lambda item: item[0])
    return value


def _set_rates(i: int, scheduler: Any, saved: Any) -> None:
    """Set the learning rates of the optimizer of the loaded `scheduler` (the `i`-th) to those
    its schedule reached: its last ones as `saved` (the first scheduler's, where several alike
    of the same base rates are saved as one), else those of its step as `LambdaLR` (or a closed
    form) computes them. The optimizer's own are those it was built with, from which a chained
    schedule (`StepLR`, `SequentialLR`'s warm-up and cosine) would go on for the rest of the run."""
    groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", None)
    if groups is None:  # a scheduler of the job's own making, without an optimizer
        return
    rates = (list(saved) if isinstance(saved, (list, tuple)) and len(saved) == len(groups) else
             [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
             if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) else
             scheduler._get_closed_form_lr() if hasattr(scheduler, "_get_closed_form_lr") else None)
    if rates is None or len(rates) != len(groups):
        logger.warning("the optimizer is not loaded (checkpoint.exclude_from_loading), and the rates lr_scheduler %d "
                       "reached are not in the step for its %d param group(s): its optimizer's learning rates stay "
                       "those it was built with", i, len(groups))
        return
    for group, rate in zip(groups, rates):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(rate)
        else:
            group["lr"] = float(rate)
    scheduler._last_lr = [float(rate) for rate in rates]


def _rates(value: Any) -> list[float] | None:
    """A scheduler's rate list (floats or one-element tensors) as floats; None for anything else."""
    if not isinstance(value, (list, tuple)):
        return None
    try:
        return [float(rate) for rate in value]
    except (TypeError, ValueError, RuntimeError):
        return None


def _base_rates(state: dict[str, Any]) -> list[float] | None:
    """A scheduler state's base rates (`_rates`); a scheduler of schedulers (SequentialLR,
    ChainedScheduler) keeps them in its first one's state alone."""
    inner = state.get("_schedulers")
    if "base_lrs" not in state and isinstance(inner, list) and inner and isinstance(inner[0], dict):
        return _rates(inner[0].get("base_lrs"))
    return _rates(state.get("base_lrs"))


_PER_SCHEDULER = ("base_lrs", "_last_lr")
_EACH = "per_scheduler"
"""The entry holding every scheduler's own state, where they differ (`LRSchedulerState`)."""


def _held(key: str, saved_keys: Collection[str]) -> bool:
    """Whether the checkpoint's `saved_keys` hold the entry `key` (or entries under it)."""
    return any(s == key or s.startswith(key + ".") for s in saved_keys)


def _same_settings(a: Any, b: Any, top: bool = True) -> bool:
    """Whether two schedulers' states agree on everything but their own rates (`_PER_SCHEDULER`)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = [k for k in {*a, *b} if not (top and k in _PER_SCHEDULER)]
        return all(k in a and k in b and _same_settings(a[k], b[k], False) for k in keys)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_settings(x, y, False) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            bool(torch.equal(a, b))
    return type(a) is type(b) and a == b


def _unshared(value: Any, seen: set[int]) -> Any:
    """`value` with every tensor met before (in `seen`, by id) cloned: a load reads each entry into
    its tensor in place, and one tensor behind two entries (a new `SequentialLR` shares its last
    rates with its first scheduler's; a tensor learning rate makes them tensors) would end up
    holding whichever entry was read last."""
    if isinstance(value, torch.Tensor):
        if id(value) in seen:
            return value.clone()
        seen.add(id(value))
        return value
    if isinstance(value, dict):
        return {k: _unshared(v, seen) for k, v in value.items()}
    if isinstance(value, list):
        return [_unshared(v, seen) for v in value]
    return value


class DataLoaderState(CheckedState):
    """A `StatefulDataLoader`'s position per data-parallel rank, as TorchTitan's
    `ParallelAwareDataloader` saves it: `dp_rank_{r}` holds the pickled `state_dict()` of rank
    r's loader and `world_size` the data-parallel degree. Ranks that share a data-parallel rank
    (tensor parallel) save the same entry once. The pickle is read back without running code.

    A loader is at the data-parallel rank and degree its `dp_rank` and `dp_world_size`
    attributes say, else at the checkpoint group's rank, of its size. A `StatefulDataLoader` of
    its own `state_dict()` with those attributes (TorchTitan's `ParallelAwareDataloader`) saves
    this layout itself: its state passes through as it is (one not in the layout is refused at
    the save). Set them on any other loader whose ranks share a data-parallel rank (tensor or
    pipeline parallelism)."""

    def __init__(self, dataloader: Any, rank: int, world_size: int):
        self.dataloader = dataloader
        declared = hasattr(dataloader, "dp_rank") and hasattr(dataloader, "dp_world_size")
        self.dp_rank = dataloader.dp_rank if declared else rank
        self.dp_world_size = dataloader.dp_world_size if declared else world_size
        # told by its class, not by a state_dict() call: a StatefulDataLoader's starts its workers
        self.own_layout = declared and isinstance(dataloader, StatefulDataLoader) and \
            type(dataloader).state_dict is not StatefulDataLoader.state_dict
        self.yielded: int | None = None
        """The batches yielded as of the last `state_dict()`, where its state says (`compared`)."""

    @property
    def key(self) -> str:
        return f"{DP_RANK_PREFIX}{self.dp_rank}"

    def state_dict(self) -> dict[str, Any]:
        """Checked as a load reads it (`_position`): a position holding a value that no load
        reads without running code (a NumPy RNG state) is refused now, not at the resume."""
        sd = self.dataloader.state_dict() if self.own_layout else {
            self.key: pickle.dumps(self.dataloader.state_dict()), "world_size": self.dp_world_size}
        if self.own_layout and not (isinstance(sd, dict) and self.key in sd):
            raise CheckpointError(
                f"the dataloader, a {type(self.dataloader).__name__} with dp_rank and dp_world_size and a "
                f"state_dict() of its own, is taken to save TorchTitan's layout ({self.key!r} and 'world_size', as "
                f"its ParallelAwareDataloader does), and its state is not in it ({brief(sorted(sd)[:4] if isinstance(sd, dict) else sd)}): "
                "no load would read it, so it is not saved. Return that layout from its state_dict() (and read it "
                "in load_state_dict()), or remove the attributes")
        try:
            position = self._position(sd) if self.key in sd else None  # else left to the loader's own load
        except CorruptCheckpointError as e:
            raise CheckpointError(f"{e}: a load would refuse this data loader's state, so it is not saved; "
                                  "keep plain data in its state_dict() (a NumPy RNG state as lists and ints, "
                                  "say)") from None
        yielded = position.get("_num_yielded") if isinstance(position, dict) else None
        self.yielded = yielded if isinstance(yielded, int) else None
        return sd

    def compared(self) -> tuple[bytes, bytes] | None:
        """What a save compares among the ranks sharing this loader's entry (for `_warn_per_rank`,
        in `replicated_digest`'s form): the entry's name, and the batches the loader had yielded
        at the last `state_dict()` (a `StatefulDataLoader`'s `_num_yielded`, its position; its
        other values, such as a base seed each pipeline stage draws apart, may differ at one
        position); None where its state does not say."""
        return None if self.yielded is None else replicated_digest({self.key: self.yielded})

    def check_loaded(self, state_dict: dict[str, Any]) -> None:
        """The position reads as plain data, and was saved by a loader of as many worker
        processes as this job's (a `StatefulDataLoader` takes no other: it loaded, and failed
        the first batch with an `AssertionError` naming a key of its state)."""
        saved = _workers(self._position(state_dict))
        live = getattr(self.dataloader, "num_workers", None) if isinstance(self.dataloader, StatefulDataLoader) else None
        if saved is not None and isinstance(live, int) and saved != live:
            raise CheckpointError(
                f"dataloader.{self.key} was saved by a loader of num_workers = {saved}, and this job's has "
                f"num_workers = {live}: a StatefulDataLoader resumes its position with as many workers alone. Set "
                "num_workers as saved, or add 'dataloader' to checkpoint.exclude_from_loading to start it afresh")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        position = self._position(state_dict)
        # TorchTitan's loader unpickles its entry itself, with `pickle.loads`: it gets the value
        # read here pickled again, never the checkpoint's bytes
        self.dataloader.load_state_dict({**state_dict, self.key: pickle.dumps(position)} if self.own_layout
                                        else position)

    def _position(self, state_dict: dict[str, Any]) -> Any:
        """This rank's loader state, unpickled without running code."""
        data = state_dict[self.key]
        if not isinstance(data, bytes):
            raise CorruptCheckpointError(f"dataloader.{self.key} is a {type(data).__name__}, not a pickle")
        try:
            return load_plain_pickle(data)
        except pickle.UnpicklingError as e:
            raise CorruptCheckpointError(f"dataloader.{self.key} is not plain data and loading it could "
                                         f"run code; refused ({refusal(e)})") from None


def _workers(position: Any) -> int | None:
    """The worker processes of the `StatefulDataLoader` whose state is `position`: 0 for one
    without (its state holds `_num_yielded`), the count its snapshot records for one with;
    None for a state of another shape (another loader's)."""
    if not isinstance(position, dict):
        return None
    if "_num_yielded" in position:
        return 0
    snapshot = position.get("_snapshot")
    main = snapshot.get("_main_snapshot") if isinstance(snapshot, dict) else None
    workers = main.get("_num_workers") if isinstance(main, dict) else None
    return workers if type(workers) is int else None


DP_RANK_PREFIX = "dp_rank_"


def saved_dp_degree(saved_keys: Collection[str]) -> int:
    """How many data-parallel ranks saved a dataloader state (`saved_keys` relative to it)."""
    return sum(1 for k in saved_keys if k.startswith(DP_RANK_PREFIX))
