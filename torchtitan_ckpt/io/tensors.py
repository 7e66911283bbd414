"""What the package asks of a tensor whatever its kind (a plain tensor or a DTensor)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_values(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of `t`: a DTensor's local tensor, or `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def memory_of(t: torch.Tensor) -> tuple:
    """Where `t`'s (local) values live: two tensors with equal `memory_of` hold the same values, as
    tied weights do while being two objects."""
    values = local_values(t)
    return values.device, values.dtype, values.data_ptr(), tuple(values.shape), values.stride()
