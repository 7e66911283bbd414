"""What a job's model and states may hold, told at `save()` (or `load()`) where a step of it
would never load back, and dtypes an export keeps as they are."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch import nn
from torch.utils import _pytree as pytree

from torchtitan_ckpt import CheckpointManager, register_holding_wrapper
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.errors import CheckpointError, CheckpointSaveError
from torchtitan_ckpt.io.tensors import memory_of
from torchtitan_ckpt.states import ModelState

from .helpers import Holder, spawn


class _Tagged(torch.Tensor):  # as torchao's quantized weights are: a subclass of torch.Tensor
    pass


_KEPT = {torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor,
         torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
         torch.ops.aten._to_copy.default, torch.ops.aten.split.Tensor, torch.ops.aten.clone.default,
         torch.ops.aten.detach.default}
"""The ops whose results stay wrapped, as torchao's weights keep them for FSDP2 to shard them."""


@register_holding_wrapper
class _CastOnUse(torch.Tensor):
    """A weight whose values stay in one high-precision tensor, cast only when used, as torchao's
    float8 training weights are (`WeightWithDynamicFloat8CastTensor`, known to the package): a
    wrapper subclass, whose own storage holds none of its values."""

    @staticmethod
    def __new__(cls, values: torch.Tensor, *more: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, values.shape, strides=values.stride(), dtype=values.dtype,
                                                   device=values.device, requires_grad=values.requires_grad)

    def __init__(self, values: torch.Tensor, *more: torch.Tensor):
        self._values = values

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def inner(tree):
            return pytree.tree_map_only(_CastOnUse, lambda t: t._values, tree)
        out = func(*inner(args), **inner(kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out) if func in _KEPT else out

    def __tensor_flatten__(self):
        return ["_values"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(*inner.values())

    __torch_function__ = torch._C._disabled_torch_function_impl


@register_holding_wrapper
class _Scaled(_CastOnUse):
    """Values and a scale: no one tensor holds its values, registered or not."""

    def __init__(self, values: torch.Tensor, *more: torch.Tensor):
        super().__init__(values)
        self._scale = more[0] if more else torch.ones(())

    def __tensor_flatten__(self):
        return ["_values", "_scale"], None


class _ScaleBeside(_Scaled):
    """Values and a precomputed scale beside them, as torchao's float8 weights hold after
    `precompute_float8_dynamic_scale_for_fsdp`: registered with the attribute of its values."""


register_holding_wrapper(_ScaleBeside, inner="_values")


class _Unregistered(_CastOnUse):
    """One inner tensor, as `_CastOnUse`, but not said to hold its values: its context might
    change what they mean (a scale), so it is refused like any subclass."""


def _wrapped(seed: int, kind: type = _CastOnUse) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 4))
    for linear in model:
        linear.weight = nn.Parameter(kind(linear.weight.detach().clone()))
    return model


def _save(tmp_path, model, **kwargs):
    with CheckpointManager(Checkpoint(enable=True, interval=1), [model], base_folder=str(tmp_path), **kwargs) as m:
        m.save(1)


def test_a_tensor_subclass_is_refused_at_save_not_saved_as_a_step_no_load_takes(tmp_path):
    """It was saved, and every load refused the step as damaged ("not a plain tensor and loading
    it could run code"), passing on torch's advice to turn weights_only off."""
    model = nn.Linear(2, 2, bias=False)
    model.weight = nn.Parameter(torch.Tensor._make_subclass(_Tagged, torch.ones(2, 2)))
    with pytest.raises(CheckpointSaveError, match=r"\['weight \(_Tagged\)'\] are tensor subclasses .* Save their "
                                                  r"plain tensors"):
        _save(tmp_path, model)
    assert not list((tmp_path / "checkpoint").glob("step-*"))


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def _plain(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v._values if isinstance(v, _CastOnUse) else v for k, v in values.items()}


def _round_trip_of_wrapped_weights(rank: int, world_size: int, folder: str, mode: str) -> None:
    """Save a (sharded, with 2 ranks) model of `_CastOnUse` weights after an optimizer step, load
    it into another; both equal what was saved and what PyTorch's own reader reads."""
    def built(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _wrapped(seed)
        if world_size > 1:
            fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    model, optimizer = built(0)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    saved = _plain(_full(model))
    config = Checkpoint(enable=True, folder=folder, interval=1, async_mode=mode)
    with CheckpointManager(config, [model], optimizer) as manager:
        manager.save(1)
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()  # after save() returns: what the step holds is the state at save()
    other, other_optimizer = built(1)
    with CheckpointManager(config, [other], other_optimizer) as manager:
        assert manager.load()
    assert isinstance(other[0].weight.to_local() if world_size > 1 else other[0].weight, _CastOnUse)
    for key, value in _plain(_full(other)).items():
        assert torch.equal(value, saved[key]), key
    if rank == 0:
        theirs = {k: torch.empty_like(v) for k, v in saved.items()}
        dcp.load(theirs, storage_reader=dcp.FileSystemReader(os.path.join(folder, "step-1")), no_dist=True)
        for key, value in theirs.items():
            assert torch.equal(value, saved[key]), key


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_weights_wrapped_to_be_cast_on_use_are_saved_and_loaded_as_their_values(tmp_path, mode):
    """torchao's float8 training weights: refused as subclasses without FSDP; under FSDP2 (a
    DTensor of such a local tensor) saved as the bytes of the wrapper's empty storage, and
    loaded back as those (values of 1e34), without a word."""
    spawn(2, _round_trip_of_wrapped_weights, str(tmp_path / "sharded"), mode)
    _round_trip_of_wrapped_weights(0, 1, str(tmp_path / "whole"), mode)


def test_weights_wrapped_to_be_cast_on_use_are_read_in_place_by_load_hf(tmp_path):
    """`load_hf` into a model whose weights are registered holding wrappers (torchao's float8
    training weights): read into the tensors holding their values, as `save_hf` exports those."""
    from torchtitan_ckpt.example.model import FLAVORS, Transformer, hf_adapter
    from torchtitan_ckpt.hf import load_hf, save_hf

    torch.manual_seed(0)
    source, adapter = Transformer(FLAVORS["debugmodel"]), hf_adapter(FLAVORS["debugmodel"])
    save_hf(source.state_dict(), str(tmp_path), adapter)
    model = Transformer(FLAVORS["debugmodel"])
    values = torch.zeros_like(model.norm.weight)
    model.norm.weight = nn.Parameter(_CastOnUse(values), requires_grad=False)
    load_hf(model.state_dict(), str(tmp_path), adapter)
    assert torch.equal(values, source.norm.weight.detach())
    assert torch.equal(model.layers["0"].attention.wq.weight, source.layers["0"].attention.wq.weight)


def _refuse_scaled_shard(rank: int, world_size: int, folder: str) -> None:
    model = _wrapped(0, _Scaled)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    with CheckpointManager(Checkpoint(enable=True, folder=folder, interval=1), [model]) as manager:
        with pytest.raises(CheckpointSaveError, match=r"\['0.weight \(_Scaled\)', '1.weight \(_Scaled\)'\] are "
                                                      r"tensor subclasses"):
            manager.save(1)
    assert not os.path.exists(os.path.join(folder, "step-1"))


def test_a_shard_of_a_subclass_no_one_tensor_holds_is_refused_at_save(tmp_path):
    """A DTensor's local tensor was never checked: its storage was written, not its values."""
    spawn(2, _refuse_scaled_shard, str(tmp_path))


def test_a_wrapper_registered_with_the_attribute_of_its_values_is_saved_and_loaded_in_place(tmp_path):
    """Beside other inner tensors (a precomputed scale): the values' tensor is the state's, the
    same memory as the model's (a load copied each weight onto itself)."""
    saved = _wrapped(0, _ScaleBeside)
    _save(tmp_path, saved)
    loaded = _wrapped(1, _ScaleBeside)
    state = ModelState([loaded]).state_dict()
    assert all(memory_of(state[f"{i}.weight"]) == memory_of(loaded[i].weight) for i in (0, 1))
    with CheckpointManager(Checkpoint(enable=True), [loaded], base_folder=str(tmp_path)) as manager:
        assert manager.load()
    for i in (0, 1):
        assert isinstance(loaded[i].weight, _ScaleBeside)
        assert torch.equal(loaded[i].weight._values, saved[i].weight._values)


def test_a_wrapper_of_one_tensor_not_registered_is_refused_at_save(tmp_path):
    with pytest.raises(CheckpointSaveError, match=r"\['0.weight \(_Unregistered\)', '1.weight \(_Unregistered\)'\] "
                                                  r"are tensor subclasses"):
        _save(tmp_path, _wrapped(0, _Unregistered))
    assert not list((tmp_path / "checkpoint").glob("step-*"))


@pytest.mark.parametrize("value, said", [
    (7, "states\\['extra'\\].state_dict\\(\\) returned a int, which DCP keeps as one value where a load needs "
        "entries to fill"),
    (torch.ones(3), "states\\['extra'\\].state_dict\\(\\) returned a Tensor, which DCP keeps as one value"),
    ([1, 2], "states\\['extra'\\].state_dict\\(\\) returned a list, which DCP keeps as one value"),
    ((torch.ones(1), torch.ones(2)), "states\\['extra'\\].state_dict\\(\\) returned a tuple, which DCP keeps"),
    ({"shadow": torch.ones(1).expand(4)}, "\\['extra.shadow'\\] repeat one element along a dimension"),
    ({"shadow": torch.empty(4, device="meta")},
     "1 of states\\['extra'\\]'s tensors have no memory yet, e.g. \\['extra.shadow'\\]"),
])
def test_a_state_no_load_could_fill_is_refused_at_save(tmp_path, value, said):
    """A state's `state_dict()` that is not a container, or holds an expand() view, was saved, and
    every load of the step failed (an expand() view once the model was filled, leaving save()
    refused until a load succeeded); a state on the meta device failed with torch's error."""
    with pytest.raises(CheckpointSaveError, match=said):
        _save(tmp_path, nn.Linear(2, 2), states={"extra": Holder(value)})
    assert not list((tmp_path / "checkpoint").glob("step-*"))


def test_a_state_on_the_meta_device_is_refused_at_load_not_left_there(tmp_path):
    """An EMA module built on the meta device and not yet materialised: load() returned True
    and left it there (with a process group; without one, torch's unrelated error)."""
    _save(tmp_path, nn.Linear(2, 2), states={"ema": nn.Linear(2, 2)})
    with torch.device("meta"):
        ema = nn.Linear(2, 2)
    with CheckpointManager(Checkpoint(enable=True, load_only=True), [nn.Linear(2, 2)], states={"ema": ema},
                           base_folder=str(tmp_path)) as manager:
        with pytest.raises(CheckpointError, match=r"load\(\): 2 of states\['ema'\]'s tensors have no memory yet, "
                                                  r"e\.g\. \['ema\.weight', 'ema\.bias'\] \(on the meta device"):
            manager.load()


@pytest.mark.parametrize("dtype", ["float8_e8m0fnu", "float4_e2m1fn_x2", "float8_e4m3fn"])
def test_the_last_model_only_save_keeps_low_bit_dtypes_as_they_are(tmp_path, dtype):
    """The last save casts the model to export_dtype: float4 failed it ("copy_kernel" not
    implemented), and MX scales (e8m0) above float16's range came back as NaN."""
    raw = torch.tensor([127, 148, 107, 227], dtype=torch.uint8)

    def model(values):
        m = nn.Linear(2, 2)
        m.register_buffer("scales", values.view(getattr(torch, dtype)))
        return m

    saved = model(raw)
    with CheckpointManager(Checkpoint(enable=True, interval=10, export_dtype="float16"), [saved],
                           base_folder=str(tmp_path)) as manager:
        manager.save(1, last_step=True)
    step = tmp_path / "checkpoint" / "step-1"
    saved_as = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata["scales"].properties.dtype
    assert saved_as == getattr(torch, dtype)  # not widened: four times the bytes in float32
    loaded = model(torch.zeros(4, dtype=torch.uint8))
    with CheckpointManager(Checkpoint(enable=True, load_only=True), [loaded], base_folder=str(tmp_path)) as manager:
        assert manager.load()
    assert torch.equal(loaded.scales.view(torch.uint8), raw)
    assert torch.equal(loaded.weight, saved.weight.half().float())  # float32 is cast, there and back


class _Runs:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize("saved, said", [
    ({"weight": torch.Tensor._make_subclass(_Tagged, torch.ones(2, 2)), "bias": torch.ones(2)},
     r"item 'weight' .* is not a plain tensor and loading it could run code; refused \(it needs "
     r"tests\.test_state_contents\._Tagged\)"),
    ({"weight": torch.ones(2, 2), "bias": torch.ones(2), "extra": {"v": _Runs()}},
     r"checkpoint value 'extra.v' is not plain data and loading it could run code; refused \(it needs "
     r"(posix|nt)\.system\)"),
])
def test_a_foreign_step_whose_items_would_run_code_names_the_code_not_torch_s_advice(tmp_path, saved, said):
    """torch's refusal is a page of advice to load with weights_only=False, which would run the
    code; the refusal named what it needed only for some of torch's wordings."""
    step = tmp_path / "checkpoint" / "step-5"
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(step)), no_dist=True)
    extra = {"extra": Holder({"v": 0})} if "extra" in saved else {}
    with CheckpointManager(Checkpoint(enable=True), [nn.Linear(2, 2)], states=extra,
                           base_folder=str(tmp_path)) as manager:
        with pytest.raises(CheckpointError, match=said) as refused:
            manager.load()
    assert "weights_only" not in str(refused.value)


def test_a_state_holding_a_name_of_the_model_is_refused_one_beside_it_saves(tmp_path):
    """states={"ema": ...} holding `weight` beside a model's `ema` submodule failed the save with
    DCP's bare "duplicated flatten key ema.weight"."""
    model = nn.ModuleDict({"ema": nn.Linear(2, 2), "head": nn.Linear(2, 2)})
    with pytest.raises(CheckpointSaveError, match=r"save\(\): states\['ema'\] holds \['ema.weight'\], which are names "
                                                  "of the model too: a step keeps one value per name"):
        _save(tmp_path / "a", model, states={"ema": Holder({"weight": torch.ones(2, 2), "decay": 0.9})})
    _save(tmp_path / "b", model, states={"ema": Holder({"decay": 0.9})})  # no name of the model's: as before


def test_a_state_named_as_a_parameter_of_the_model_is_refused_not_put_in_its_place(tmp_path):
    """states={"scale": ...} beside a model's top-level parameter `scale` replaced it in the
    step: save() succeeded and every load failed on the missing parameter."""
    model = nn.Module()
    model.scale = nn.Parameter(torch.ones(2))
    with pytest.raises(CheckpointSaveError, match=r"save\(\): states\['scale'\] has the name of the model's "
                                                  r"'scale' \(a parameter or buffer of its top level\)"):
        _save(tmp_path, model, states={"scale": Holder({"factor": torch.ones(1)})})
    assert not list((tmp_path / "checkpoint").glob("step-*"))


def test_a_state_of_a_list_of_tensors_saves_and_loads(tmp_path):
    _save(tmp_path, nn.Linear(2, 2), states={"extra": Holder([torch.full((2,), 3.0), torch.full((3,), 4.0)])})
    loaded = Holder([torch.zeros(2), torch.zeros(3)])
    with CheckpointManager(Checkpoint(enable=True, load_only=True), [nn.Linear(2, 2)], states={"extra": loaded},
                           base_folder=str(tmp_path)) as manager:
        assert manager.load()
    assert [t.tolist() for t in loaded.value] == [[3.0, 3.0], [4.0, 4.0, 4.0]]


def test_values_of_the_same_bytes_load_as_their_own_objects_where_they_can_change(tmp_path):
    """A load keeps each small plain value it read by its bytes (the same optimizer setting of
    every parameter): a number or a tuple of them is one object for all; a list or a set is
    each entry's own, or changing one would change the other."""
    saved = {"lists": [1, 2], "again": [1, 2], "tuple": (0.9, 0.999), "same": (0.9, 0.999), "rate": 0.5,
             "rates": 0.5, "sets": {1}, "more": {1}}
    config = Checkpoint(enable=True, folder=str(tmp_path / "ck"), interval=1)
    with CheckpointManager(config, [nn.Linear(2, 2)], states={"extra": Holder({"v": dict(saved)})}) as manager:
        manager.save(1)
    extra = Holder({"v": {k: None for k in saved}})
    with CheckpointManager(config, [nn.Linear(2, 2)], states={"extra": extra}) as manager:
        assert manager.load()
    got = extra.value["v"]
    assert got == saved
    assert got["tuple"] is got["same"]  # one object: it cannot change
    for a, b in (("lists", "again"), ("sets", "more")):
        assert got[a] is not got[b]
        got[a].clear()
        assert got[b]


def test_wrapped_weights_in_a_state_of_the_jobs_own_are_saved_and_loaded_as_their_values(tmp_path):
    """An EMA's (or a teacher's) copy of a model of float8 training weights, given in states=:
    refused as tensor subclasses (with the advice to register the wrapper, which was), where the
    model itself saved them as their values."""
    model, ema = _wrapped(0), _wrapped(1)
    with CheckpointManager(Checkpoint(enable=True, interval=1), [model], states={"ema": ema},
                           base_folder=str(tmp_path)) as manager:
        manager.save(1)
    saved = _plain(ema.state_dict())
    again = _wrapped(2)
    with CheckpointManager(Checkpoint(enable=True), [_wrapped(3)], states={"ema": again},
                           base_folder=str(tmp_path)) as manager:
        assert manager.load()
    assert isinstance(again[0].weight, _CastOnUse)
    theirs = {f"ema.{k}": torch.empty_like(v) for k, v in saved.items()}
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(str(tmp_path / "checkpoint" / "step-1")), no_dist=True)
    for key, value in _plain(again.state_dict()).items():
        assert torch.equal(value, saved[key]) and torch.equal(theirs[f"ema.{key}"], saved[key]), key
