"""What a save or a load asks of the tensors it is given before it touches a folder: memory to
write from and to fill in place, a dense layout and a dtype DCP can write."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from .dtypes import storable


def check_materialised(state: dict[str, Any], call: str, whose: str = "the model's", export: bool = False) -> None:
    """A `CheckpointError` unless every tensor of `state` (a model's `state_dict()`, or a
    state's) has memory: one on the meta device (a model built there, not yet `to_empty`-ed and
    initialised) or a lazy module's parameter (not yet shaped by a forward pass) would make
    `load()` fill nothing and report success, or `save()` fail after making the step folder.
    Nor may one repeat an element (an `expand()` view): its step would be saved, and every
    load of it fail once other tensors were filled. Sparse, quantized and nested tensors are
    refused here too, before the step folder is made: DCP's writer fails on each, and on
    tensors of sub-byte dtypes. So are tensor subclasses, which DCP would pickle. An HF export
    (`export`) reads values through a cast into files of its own: subclasses and repeated
    elements are fine there."""
    check_memory(state, call, whose)
    subclassed = [f"{k} ({type(local).__name__})" for k, v in state.items()
                  if not export and isinstance(v, torch.Tensor)
                  and type(local := v._local_tensor if isinstance(v, DTensor) else v)
                  not in (torch.Tensor, nn.Parameter)]
    if subclassed:  # the writers would read the subclass's storage, which holds none of its values
        raise CheckpointError(f"{call}: {subclassed[:3]} are tensor subclasses (a quantized weight's, say), "
                              "which no step of this package holds: DCP saves them as pickles no load may read, "
                              "as reading them would run their code. Save their plain tensors (dequantized, or "
                              "the subclass's inner tensors); a wrapper whose one inner tensor holds its values "
                              "as they are can be declared so (torchtitan_ckpt.register_holding_wrapper)")
    unusual = [k for k, v in state.items() if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
               and (v.layout != torch.strided or v.is_quantized or v.is_nested)]
    if unusual:
        raise CheckpointError(f"{call}: {unusual[:3]} are not dense tensors (sparse, MKL-DNN, quantized or "
                              "nested), which DCP can neither write nor fill in place: store them dense "
                              "(.to_dense(), .dequantize()), or register them with persistent=False if they "
                              "are derived")
    odd = [f"{k} ({v.dtype})" for k, v in state.items() if isinstance(v, torch.Tensor) and not storable(v.dtype)]
    if odd:
        raise CheckpointError(f"{call}: {odd[:3]} are of dtypes DCP cannot write (sub-byte and bit dtypes): "
                              "store them packed in uint8 (.view(torch.uint8) where the layout allows), or "
                              "register them with persistent=False if they are derived")
    # a load fills each tensor in place, which one whose elements share memory cannot take
    shared = [k for k, v in state.items() if not export and isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
              and v.layout == torch.strided
              and any(stride == 0 and size > 1 for stride, size in zip(v.stride(), v.shape))]
    if shared:
        raise CheckpointError(f"{call}: {shared[:3]} repeat one element along a dimension (an expand() "
                              "view, stride 0): no load can fill such a tensor in place; register it with "
                              "persistent=False if it is derived, or store it as .contiguous()")


def check_memory(state: Any, call: str, whose: str) -> None:
    """The first of `check_materialised`'s checks, alone: every tensor of `state` (a flat dict,
    or dicts and lists nested) has memory. What an optimizer built over a model still on the
    meta device holds (state made eagerly, as some optimizers do) is one the save would fail on
    after making its step folder."""
    empty = list(_without_memory(state, ""))
    if empty:
        raise CheckpointError(f"{call}: {len(empty)} of {whose} tensors have no memory yet, e.g. {empty[:3]} "
                              "(on the meta device, or a lazy module's before its first forward pass): "
                              "materialise them first (model.to_empty(device=...), then its init)")


def _without_memory(state: Any, path: str):
    """The dotted paths of the tensors of `state` that have no memory yet."""
    if isinstance(state, torch.Tensor):
        if state.is_meta or nn.parameter.is_lazy(state):
            yield path
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _without_memory(v, f"{path}.{k}" if path else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from _without_memory(v, f"{path}.{i}" if path else str(i))


def check_tensor_dict(state: Any, call: str, threads: Any = 1) -> None:
    """A `TypeError` naming `call`'s argument unless `state` is a dict of tensors (a model's
    `state_dict()`: a module given instead, or a value of another kind, failed deep inside the
    call, naming nothing) and `threads` a count of 1 or more."""
    if not isinstance(state, dict):
        raise TypeError(f"{call} takes a state dict of tensors (model.state_dict()), not a {type(state).__name__}")
    if other := [f"{k} ({type(v).__name__})" for k, v in state.items() if not isinstance(v, torch.Tensor)]:
        raise TypeError(f"{call}: the state dict holds values that are not tensors, e.g. {other[:3]}; give it the "
                        "model's tensors only")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{call}: num_threads = {threads!r}; expected an integer of 1 or more")
