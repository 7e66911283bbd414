"""Names of dtypes as configs and files spell them, the torch dtypes they mean, which dtypes a
checkpoint can hold, and whether two tensors hold the same bytes."""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor

EXPORT_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
"""`checkpoint.export_dtype` (and `convert --dtype`) -> the dtype floating tensors are cast to."""

_CAST_ON_EXPORT = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def exported(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` as an export in `dtype` holds it: cast where it is of the usual floating dtypes;
    float8, float4 and scale dtypes (e8m0) are kept, which a cast would lose (float16 holds no
    e8m0 scale above 2^15) or fail on (float4), and so is every other dtype."""
    return tensor.to(dtype) if dtype is not None and tensor.dtype in _CAST_ON_EXPORT else tensor


_QUANTIZED = frozenset(getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                       if hasattr(torch, n))


@functools.cache
def storable(dtype: torch.dtype) -> bool:
    """Whether DCP can write plain tensors of `dtype`. Quantized dtypes belong to quantized
    tensors, which it cannot write; it sizes each tensor with `torch._utils._element_size`,
    which fails on the sub-byte and bit dtypes (uint1-7, int1-7, bits8 and the like), and only
    after the step folder is made. Asked here so that they are refused first (and a `.metadata`
    naming one is refused as crafted), and so that a later torch that sizes them lets them
    through."""
    if dtype in _QUANTIZED:
        return False
    try:
        torch._utils._element_size(dtype)
    except (TypeError, RuntimeError):
        return False
    return True


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape and dtype (DTensors: their local shards) hold the same
    bytes, a NaN equal to itself, wherever each lives."""
    a, b = ((t.to_local() if isinstance(t, DTensor) else t).detach().cpu().reshape(-1).view(torch.uint8)
            for t in (a, b))
    return torch.equal(a, b)
