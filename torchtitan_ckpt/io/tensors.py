"""What the package asks of a tensor whatever its kind: a plain tensor, a DTensor, or a wrapper
subclass known to hold its values in one plain tensor."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # DCP's keys, as its planner makes them
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

_HOLDING_WRAPPERS: dict[str, str | None] = {"torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor": "_tensor"}
"""Wrapper subclasses (module.qualname) whose inner tensor holds their values as they are, cast
only when used, and the attribute holding it (None: the one name of `__tensor_flatten__`):
torchao's float8 training weights (beside a precomputed scale, after
`precompute_float8_dynamic_scale_for_fsdp`), and those given to `register_holding_wrapper`. By
name, not by layout: a wrapper of one inner tensor may mean other values (scaled by its
context, say), which saving the inner tensor would lose."""


def register_holding_wrapper(cls: type, inner: str | None = None) -> type:
    """Declare the tensor wrapper subclass `cls` one whose inner tensor holds its values as they
    are, of its shape, dtype and strides: the package then saves, loads in place and exports
    that tensor (other subclasses are refused by `save()`). `inner`: the attribute holding it,
    where `__tensor_flatten__` may list other tensors beside it (a precomputed scale); None: its
    one name. Returns `cls`, to be used as a class decorator."""
    if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
        raise TypeError(f"register_holding_wrapper takes a subclass of torch.Tensor, not {cls!r}")
    _HOLDING_WRAPPERS[_qualified(cls)] = inner
    return cls


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def held(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor a holding wrapper keeps its values in (`register_holding_wrapper`), where
    it is of the wrapper's own shape, dtype, strides and device: saved, loaded in place and
    exported as that tensor, whose memory is the wrapper's. `t` itself otherwise."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not is_traceable_wrapper_subclass(t) \
            or (qualified := _qualified(type(t))) not in _HOLDING_WRAPPERS:
        return t
    names, _ = t.__tensor_flatten__()
    name = _HOLDING_WRAPPERS[qualified] or (names[0] if len(names) == 1 else None)
    values = getattr(t, name, None) if name in names else None
    if type(values) not in (torch.Tensor, torch.nn.Parameter):
        return t
    alike = (values.shape, values.dtype, values.stride(), values.device) == (t.shape, t.dtype, t.stride(), t.device)
    return values.detach() if alike else t


def unwrapped_values(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a tensor of the same memory without the wrapper subclass `held` sees through (a
    DTensor of such a local tensor: a DTensor of its inner one, of the same placements, on the
    inner one's device, as FSDP2's CPU offload keeps it)."""
    if isinstance(t, DTensor):
        local = t._local_tensor  # not `to_local()`, which makes a view: asked of every tensor at every save
        inner = held(local)
        return t if inner is local else DTensor(inner, t._spec, requires_grad=False)
    return held(t)


def local_values(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of `t`: a DTensor's local tensor, or `t` itself (`held`'s inner tensor
    of either)."""
    return held(t.to_local() if isinstance(t, DTensor) else t)


def local_bytes(state: dict[str, Any]) -> int:
    """The bytes of this rank's values of the tensors in `state`, nested as DCP nests them."""
    return sum(local_values(t).nbytes for t in flatten_state_dict(state)[0].values() if isinstance(t, torch.Tensor))


def memory_of(t: torch.Tensor) -> tuple:
    """Where `t`'s (local) values live: two tensors with equal `memory_of` hold the same values, as
    tied weights do while being two objects."""
    values = held(t._local_tensor if isinstance(t, DTensor) else t)  # no view made: asked of every tensor at loads
    return values.device, values.dtype, values.data_ptr(), tuple(values.shape), values.stride()
