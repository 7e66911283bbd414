"""What the package asks of a tensor whatever its kind: a plain tensor, a DTensor, or a wrapper
subclass that only holds its values in one plain tensor."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def held(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor a wrapper subclass keeps its values in, where it wraps exactly one, of its
    own shape, dtype, strides and device (torchao's float8 training weights: the values stay in
    high precision, cast only when used): saved, loaded in place and exported as that tensor,
    whose memory is the wrapper's. `t` itself otherwise (a plain tensor, or a subclass whose
    values are not one such tensor: a quantized weight's data and scales)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not is_traceable_wrapper_subclass(t):
        return t
    names, _ = t.__tensor_flatten__()
    inner = getattr(t, names[0]) if len(names) == 1 else None
    if type(inner) in (torch.Tensor, torch.nn.Parameter) and (inner.shape, inner.dtype, inner.stride(),
                                                               inner.device) == (t.shape, t.dtype, t.stride(), t.device):
        return inner.detach()
    return t


def unwrapped_values(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a tensor of the same memory without the wrapper subclass `held` sees through (a
    DTensor of such a local tensor: a DTensor of its inner one, of the same placements)."""
    if isinstance(t, DTensor):
        local = t._local_tensor  # not `to_local()`, which makes a view: asked of every tensor at every save
        inner = held(local)
        return t if inner is local else DTensor.from_local(inner, t.device_mesh, t.placements, run_check=False,
                                                           shape=t.shape, stride=t.stride())
    return held(t)


def local_values(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of `t`: a DTensor's local tensor, or `t` itself (`held`'s inner tensor
    of either)."""
    return held(t.to_local() if isinstance(t, DTensor) else t)


def memory_of(t: torch.Tensor) -> tuple:
    """Where `t`'s (local) values live: two tensors with equal `memory_of` hold the same values, as
    tied weights do while being two objects."""
    values = held(t._local_tensor if isinstance(t, DTensor) else t)  # no view made: asked of every tensor at loads
    return values.device, values.dtype, values.data_ptr(), tuple(values.shape), values.stride()
