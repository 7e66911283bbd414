"""Names of dtypes as configs and files spell them, the torch dtypes they mean, which dtypes a
checkpoint can hold, and whether two tensors hold the same bytes."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .posio import byte_view
from .tensors import local_values

EXPORT_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
"""`checkpoint.export_dtype` (and `convert --dtype`) -> the dtype floating tensors are cast to."""

logger = logging.getLogger(__name__)

CAST_ON_EXPORT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes an export casts to `export_dtype` whatever it loses, and those it may cast to
(transformers loads models in them)."""


def exported(tensor: Any, dtype: torch.dtype | None, widen: bool = False) -> Any:
    """`tensor` as an export in `dtype` holds it: cast where of a dtype of `CAST_ON_EXPORT`; with
    `widen` (a Hugging Face export, which transformers loads in one dtype), also where of a
    narrower floating dtype every value of which `dtype` holds (FP8 weights into bfloat16). Else
    as it is: a model-only step keeps float8, float4 and scale (e8m0) tensors, which a cast would
    make larger, lose (float16 holds no e8m0 scale above 2^15) or fail on (float4), and a value
    that is no tensor (a module's `_extra_state`)."""
    if not isinstance(tensor, torch.Tensor) or dtype is None or not tensor.dtype.is_floating_point \
            or tensor.dtype == dtype:
        return tensor
    cast = tensor.dtype in CAST_ON_EXPORT or widen and _holds(dtype, tensor.dtype)
    return tensor.to(dtype) if cast else tensor


def exported_state(state: Mapping[str, Any], dtype: torch.dtype | None, widen: bool = False) -> dict[str, Any]:
    """Every tensor of `state` as `exported` gives it, each tensor cast once (tied weights are
    one tensor). Finite values a cast made infinite (beyond float16's 65504) are a warning naming
    the tensors: counted on each tensor's device, read once per device (no wait per tensor)."""
    out: dict[str, Any] = {}
    made: dict[int, Any] = {}
    lost: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, value in state.items():
        if id(value) not in made:
            made[id(value)] = cast = exported(value, dtype, widen)
            if cast is not value and torch.finfo(cast.dtype).max < torch.finfo(value.dtype).max:
                count = _overflowed(value, cast)
                lost.setdefault(count.device, []).append((name, count))
        out[name] = made[id(value)]
    for found in lost.values():
        for (name, _), n in zip(found, torch.stack([count for _, count in found]).tolist()):
            if n:
                logger.warning("%s: %d finite value(s) beyond %s's range (+-%g) are exported as inf%s", name, n,
                               str(dtype).removeprefix("torch."), torch.finfo(dtype).max,
                               " (this rank's shard)" if isinstance(state[name], DTensor) else "")
    return out


def _overflowed(source: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
    """How many finite values of `source` are infinite in `cast` (of this rank's shard), as a
    0-dim tensor on their device."""
    if isinstance(source, DTensor):
        source, cast = source.to_local(), cast.to_local()
    return (torch.isinf(cast) & torch.isfinite(source)).sum()


@functools.cache
def _holds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Whether every value of the floating dtype `narrow` is one of `wide`'s."""
    try:
        w, n = torch.finfo(wide), torch.finfo(narrow)
        return w.max >= n.max and w.eps <= n.eps and w.smallest_normal * w.eps <= n.smallest_normal * n.eps
    except (TypeError, RuntimeError):  # no finfo (float4's fields raise NotImplementedError)
        return False


@functools.cache
def lossless(saved: torch.dtype, live: torch.dtype) -> bool:
    """Whether a value of dtype `saved` read into a tensor of dtype `live` comes back as it was."""
    if saved == live:
        return True
    if saved == torch.bool:
        return live != getattr(torch, "float8_e8m0fnu", None)  # a scale's dtype, without 0
    if live.is_complex:  # a real value as the real part
        return lossless(saved.to_real() if saved.is_complex else saved, live.to_real())
    if saved.is_complex:
        return False
    if saved.is_floating_point and live.is_floating_point:
        return _holds(live, saved)
    try:
        s = torch.iinfo(saved)
        if live.is_floating_point:  # every integer up to 2**digits has a float
            digits = 1 - round(math.log2(torch.finfo(live).eps))
            return max(-s.min, s.max) <= min(2**digits, torch.finfo(live).max)
        w = torch.iinfo(live)
        return w.min <= s.min and w.max >= s.max
    except (TypeError, RuntimeError):  # a float read into an integer, or a dtype without limits
        return False


def converts(saved: torch.dtype, live: torch.dtype) -> bool:
    """Whether reading a value of dtype `saved` into a tensor of dtype `live` keeps its meaning:
    a floating-point cast (to the job's precision), or a cast that changes no value (`lossless`).
    An integer that wraps, a complex number made real, a float made an integer do not."""
    return saved.is_floating_point and live.is_floating_point or lossless(saved, live)


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
    bytes, a NaN equal to itself, wherever each lives: the bytes of the values each shows (a
    lazily conjugated or negated view's, not its memory's)."""
    a, b = (byte_view(local_values(t).detach().cpu().resolve_conj().resolve_neg().contiguous()) for t in (a, b))
    return torch.equal(a, b)
