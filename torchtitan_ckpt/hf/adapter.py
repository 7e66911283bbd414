"""The contract between a model's own state-dict names and Hugging Face's, and its shared pieces.

A `StateDictAdapter` renames (and where a layout differs, rearranges) tensors in both directions:
`to_hf` converts whole tensors for an export; `hf_sources` tells an import where each of our
tensors comes from, so that each rank reads only the rows of its own shard (of a grouped expert
weight: the experts it holds). An adapter is built from an HF model config alone (`config.json`);
it never needs the model. It never drops or invents a tensor silently: a name it does not know,
or one it expects and does not find, raises `AdapterMismatchError` listing both sets.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from ..errors import AdapterMismatchError, CheckpointError, CorruptCheckpointError
from ..io import safe_open
from ..io.dtypes import same_bytes
from ..io.tensors import local_values
from .files import CONFIG_FILE, INDEX_FILE, MAX_INDEX_BYTES, file_number
from .model_config import HFModelConfig, config_object, read_config_json

logger = logging.getLogger(__name__)

QUANTIZATION_KEYS = ("quantization_config", "compression_config")
"""Keys of a `config.json` saying its tensors are quantized (an FP8 checkpoint's: every DeepSeek-V3
on the Hub, Qwen3-*-FP8), left out of an export of plain floating-point tensors: `transformers`
would build quantized layers, cast the tensors to them and make up the scales the export lacks."""


def check_names(where: str, found: Any, expected: Any, **hint: str) -> None:
    """Raise `AdapterMismatchError` unless the two name collections are the same set."""
    found, expected = set(found), set(expected)
    if found != expected:
        raise AdapterMismatchError(where, list(found - expected), list(expected - found), **hint)


@dataclass(frozen=True)
class HFSource:
    """Where one tensor of our state dict comes from in an HF checkpoint: the HF tensor `name`, of
    the same shape. An adapter that reorders rows within consecutive blocks of rows (an attention
    head) gives `row_order`, one entry per row of a block: our row k of each block is the HF row
    `row_order[k]` of the same block. A rank then reads the blocks its rows fall in, nothing else.
    A grouped tensor (experts stored as one 3-D weight) gives `stack`: index e of our dim 0 is the
    HF tensor `stack[e]`, and `name` describes them all in messages."""

    name: str
    row_order: tuple[int, ...] = ()
    stack: tuple[str, ...] = ()

    @property
    def block_rows(self) -> int:
        return len(self.row_order) or 1

    @property
    def hf_names(self) -> tuple[str, ...]:
        return self.stack or (self.name,)


LOCAL_PLACEMENTS = (Shard, _StridedShard, Replicate)
"""DTensor placements whose local tensor is one block of the whole: FSDP's and tensor
parallelism's `Shard`, FSDP's `_StridedShard` over a tensor-parallel `Shard` on the same dim
(rows [r*n/2, (r+1)*n/2) of a TP rank's rows are still one block), `Replicate`. A rank reads and
writes its block in place; `Partial` values would need a reduction first."""


class _ExportView:
    """What the export reads of a view of `self.tensor` that is not a tensor itself: its dtype is
    the tensor's, its bytes follow from the `shape` the subclass gives."""

    tensor: Any

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class RowOf(_ExportView):
    """Index `index` along dim 0 of `tensor` (a tensor or a DTensor): one expert of a grouped
    weight, exported as an HF tensor of its own by the rank that holds it (no rank gathers)."""

    tensor: Any
    index: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape[1:])


@dataclass(frozen=True)
class PermutedRows(_ExportView):
    """A DTensor whose rows the export permutes within blocks of `len(row_order)` rows (our row
    k of a block is the HF row `row_order[k]`) while some shard cuts a block: each rank writes
    its own rows at their HF places, so no rank gathers the tensor. `full()` builds the HF
    tensor (a collective) where a whole one is needed."""

    tensor: Any
    row_order: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def full(self) -> torch.Tensor:
        return _permute_rows(self.tensor.full_tensor(), self.row_order)


TIED_HEAD = "output.weight"
EMBEDDING = "tok_embeddings.weight"

ROPE_LAYOUTS = ("interleaved", "halves")
"""Which channels of a head the model's RoPE rotates together: `interleaved`, pairs (2i, 2i+1)
(TorchTitan's Llama 3, Meta's reference code: complex numbers), or `halves`, channel i with
i + head_dim/2 (`transformers`' `rotate_half`, TorchTitan's Qwen3). HF checkpoints hold q/k in
`halves` order; a model of the other layout needs their rows permuted (`rope_row_order`)."""


class StateDictAdapter:
    """Converts a model's state dict (TorchTitan's names) to Hugging Face names and layout, and
    back, for the shapes of an HF model config. A family subclasses it and fills `_build`.

    `hf_assets_path` is the HF folder the adapter was built from (its `config.json` and
    `model.safetensors.index.json`), or None; exports copy that config and that file split.
    `rope_layout` is the model's (`ROPE_LAYOUTS`); None takes the family's `ROPE_LAYOUT`, that
    of TorchTitan's model of the family.
    """

    ROPE_LAYOUT = "interleaved"

    def __init__(self, config: HFModelConfig, hf_assets_path: str | None = None, rope_layout: str | None = None):
        if rope_layout not in (None, *ROPE_LAYOUTS):
            raise ValueError(f"rope_layout = {rope_layout!r}; expected one of {', '.join(ROPE_LAYOUTS)}")
        self.config = config
        self.hf_assets_path = hf_assets_path
        self.rope_layout = rope_layout or self.ROPE_LAYOUT
        self.sources: dict[str, HFSource] = {}  # ours -> HF, every tensor but a tied head
        self.shapes: dict[str, tuple[int, ...]] = {}  # ours -> shape, from the config
        # HF tensors that a tied checkpoint may hold as copies of the embedding (a tied model's
        # head: Qwen3-0.6B's on the Hub): an import of a folder whose config ties too leaves them
        # unread, and an export leaves them out of its assets' file split
        self.tied_copies: set[str] = set()
        self.unmapped: set[str] = set()
        """Tensors a TorchTitan model of the family may hold that the Hub's format has no place
        for: the load-balancing `expert_bias` of TorchTitan's Qwen3-MoE, a routing bias that the
        Hub's model does without, as a zero bias does. An export leaves them out (the manager
        names them when it is built); an import sets them to zero."""
        self._build()

    def _build(self) -> None:
        """Fill `sources` and `shapes` with `add`, from `self.config`."""
        raise NotImplementedError

    def add(self, ours: str, hf: str, shape: tuple[int, ...], row_order: tuple[int, ...] = ()) -> None:
        """Our tensor `ours` of `shape` <- the HF tensor `hf`, its rows within each head in
        `row_order` (`rope_rows`; empty: as they are)."""
        self.sources[ours] = HFSource(hf, row_order)
        self.shapes[ours] = shape

    def rope_rows(self) -> tuple[int, ...]:
        """The `row_order` of a head of a tensor RoPE rotates (q and k, and what scales their
        channels): none when the model's layout is HF's."""
        return rope_row_order(self.config.head_dim) if self.rope_layout == "interleaved" else ()

    def add_stack(self, ours: str, hf: str, count: int, shape: tuple[int, ...]) -> None:
        """Our grouped tensor `ours` of `count` x `shape` <- HF tensors `hf` with `{}` = 0 .. count-1."""
        self.sources[ours] = HFSource(hf.format("*"), stack=tuple(hf.format(e) for e in range(count)))
        self.shapes[ours] = (count, *shape)

    @property
    def tied(self) -> bool:
        """Whether the model's output head is its token embedding (`tie_word_embeddings`)."""
        return self.config.tie_word_embeddings

    def state_dict_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the model's state dict and its shape (a tied head included)."""
        return {**self.shapes, TIED_HEAD: self.shapes[EMBEDDING]} if self.tied else dict(self.shapes)

    @property
    def hf_names(self) -> tuple[str, ...]:
        """Every HF tensor name, in the model's order (the order an export's file split follows)."""
        return tuple(n for source in self.sources.values() for n in source.hf_names)

    def check_model_names(self, names: Iterable[str], complete: bool = True, export: bool = False) -> None:
        """Raise `AdapterMismatchError` unless `names` are the model's (the tied head may be
        there or not); with `complete=False`, unless they are some of them (a pipeline stage's).
        `export`: the names are a model's to export, not to import into."""
        ours = (set(names) - {TIED_HEAD} if self.tied else set(names)) - self.unmapped
        if ours and not ours & set(self.sources) and ours <= {*self.hf_names, *self.tied_copies}:
            raise AdapterMismatchError(  # a transformers model, say, trained as it is
                "state dict -> HF", sorted(ours), sorted(self.sources),
                "the model's names are already the Hugging Face folder's, which this adapter maps from TorchTitan's: "
                "give the manager an adapter that renames nothing (docs/hf.md, 'SameNames')")
        hint = {"hint": "is the adapter's model config the model's? A tensor it maps to none of Hugging Face's (a "
                        "LoRA adapter's, a parametrization's original0, a module's _extra_state) has no place in "
                        "its files: merge or drop it before the export, or give an adapter that maps it"} \
            if export else {}
        check_names("state dict -> HF", ours, self.sources if complete else ours & set(self.sources), **hint)

    def check_model_shapes(self, state_dict: dict[str, Any]) -> None:
        """Raise `CheckpointError` unless each tensor of `state_dict` that the adapter maps has
        the shape its config gives it (a DTensor's whole shape): an export would write the
        model's tensors under a `config.json` of other sizes, which `transformers` refuses (a
        vocabulary padded or cut), or fail inside the RoPE permutation (another `head_dim`)."""
        expected = self.state_dict_shapes()
        wrong = [f"{name} is {list(value.shape)} where it gives {list(expected[name])}"
                 for name, value in state_dict.items()
                 if name in expected and isinstance(value, torch.Tensor) and tuple(value.shape) != expected[name]]
        if wrong:
            raise CheckpointError(f"the model is not of the sizes of the adapter's Hugging Face config "
                                  f"({self.config.where}): {len(wrong)} tensor(s) of other shapes, e.g. "
                                  f"{'; '.join(wrong[:3])}. Build the model from that config, or give the adapter "
                                  "the model's (its hf_assets_path)")

    def left_out(self, state_dict: dict[str, Any]) -> list[str]:
        """The tensors of `state_dict` (the model's, or a pipeline stage's) that an export leaves
        out: its `unmapped` ones; a tensor the adapter does not know is an `AdapterMismatchError`
        (`check_model_names`), one of another shape than its config's a `CheckpointError`
        (`check_model_shapes`)."""
        self.check_model_names(state_dict, complete=False, export=True)
        self.check_model_shapes(state_dict)
        return sorted(self.unmapped & set(state_dict))

    def to_hf(self, state_dict: dict[str, Any], complete: bool = True) -> dict[str, Any]:
        """Our names -> HF names. Values may be tensors or DTensors; one expert of a grouped
        tensor is a `RowOf` it, a q/k projection whose shards cut a head `PermutedRows`.
        `complete=False` takes part of the model (a pipeline stage's: the caller checks that
        the ranks' parts make the whole, against `hf_names`)."""
        self.check_model_names(state_dict, complete, export=True)
        self.check_model_shapes(state_dict)
        out: dict[str, Any] = {}
        for name, value in state_dict.items():
            if name in self.unmapped:
                continue
            if self.tied and name == TIED_HEAD:
                _check_tied(value, state_dict.get(EMBEDDING))
                continue  # the same tensor as the embedding
            source = self.sources[name]
            if source.stack:
                out.update((hf, RowOf(value, e)) for e, hf in enumerate(source.stack))
            elif source.row_order:
                out[source.name] = reorder_rows(value, source.row_order)
            else:
                out[source.name] = value
        return out

    def hf_sources(self, names: Iterable[str]) -> dict[str, HFSource]:
        """Our names -> where each comes from in an HF checkpoint; the inverse of `to_hf`. Its
        `unmapped` tensors come from none (an import sets them to zero)."""
        given = set(names)
        self.check_model_names(given)
        given -= self.unmapped
        out = {name: self.sources[name] for name in (given - {TIED_HEAD} if self.tied else given)}
        if self.tied and TIED_HEAD in given:
            out[TIED_HEAD] = self.sources[EMBEDDING]
        return out

    @property
    def fqn_to_index_mapping(self) -> dict[str, int] | None:
        """HF tensor name -> 1-based output file index, from the assets' index; None without one."""
        if self.hf_assets_path is None:
            return None
        return read_file_split(self.hf_assets_path)

    def export_config(self, dtype: torch.dtype) -> dict[str, Any]:
        """The assets' `config.json` when there is one, else the adapter's, its dtype set to
        `dtype` (the one of the exported tensors). The assets' must describe the adapter's
        model (its shapes are checked): `transformers` builds the model from it. One without a
        `model_type` (an adapter named for it) is given the adapter's, which `transformers` needs."""
        path = _assets_config_path(self.hf_assets_path)
        if path is None:
            return _for_export(dict(self.config.raw), dtype, self.config.where)
        raw = config_object(read_config_json(path), path)
        if raw.get("model_type") is None:
            raw = {**raw, "model_type": self.config.model_type}
        assets = HFModelConfig.parse(raw, path)
        _check_describes(assets, self.config)
        return _for_export(dict(assets.raw), dtype, path)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, a NaN equal to itself (a tied weight holding one is still tied):
    `torch.equal`, which a NaN fails, and for that case the bytes."""
    return a.shape == b.shape and a.dtype == b.dtype and (torch.equal(a, b) or same_bytes(a, b))


def _check_tied(head: Any, embedding: Any) -> None:
    """Raise unless the model's head holds its embedding's values (on this rank's block): an HF
    config that ties them makes an export write the embedding alone, and a head trained apart
    from it (a model that does not tie them, started from a tied checkpoint) would be lost."""
    if embedding is None:
        problem = (f"this part of the model (a pipeline stage) holds {TIED_HEAD} without {EMBEDDING}, so the "
                   "two cannot be tied")
    elif (getattr(head, "placements", None) == getattr(embedding, "placements", None)
          and _same_values(local_values(head), local_values(embedding))):
        return
    else:
        problem = f"{TIED_HEAD} is not {EMBEDDING}"
    raise CheckpointError(
        f"{problem}: the Hugging Face config ties them (tie_word_embeddings = true), and an export would keep "
        "the embedding alone and drop the model's own head. Export with a config.json saying "
        "tie_word_embeddings = false (the adapter's hf_assets_path), or tie the model's head to its embedding")


def _check_describes(assets: HFModelConfig, ours: HFModelConfig) -> None:
    """Raise `CheckpointError` unless the assets' config gives the adapter's family, shapes,
    experts and tying (its `model_type` may differ where one adapter maps both: Mistral's and
    Llama's tensors are alike). An export writes the adapter's tensors beside the assets'
    config, and `transformers` builds the model from that config: a head it ties or initialises
    at random, other shapes, another family's layers (a Qwen3's q/k norms dropped by a Llama),
    silently."""
    from .registry import ADAPTERS  # which imports this module

    def family(model_type: str) -> Any:
        return ADAPTERS.get(model_type, model_type)

    differ = [f"{f.name} = {_json(getattr(assets, f.name))} there, {_json(getattr(ours, f.name))} in the "
              "adapter's" for f in dataclasses.fields(HFModelConfig)
              if f.compare and f.name != "model_type" and getattr(assets, f.name) != getattr(ours, f.name)]
    if family(assets.model_type) != family(ours.model_type):
        differ.insert(0, f"model_type = {_json(assets.model_type)} there, {_json(ours.model_type)} in the adapter's")
    if differ:
        raise CheckpointError(
            f"{assets.where} does not describe the model the adapter converts ({'; '.join(differ)}): an export "
            "would write its tensors under that config, and transformers would build another model from them. "
            "Build the adapter from that config.json (adapter_for_hf_dir), or give it an hf_assets_path whose "
            "config.json is its model's")


def _json(value: Any) -> str:
    """A config value as `config.json` spells it (true, [1, 3])."""
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def _assets_config_path(hf_assets_path: str | None) -> str | None:
    """The path of an assets folder's `config.json`, or None without one."""
    path = os.path.join(hf_assets_path or "", CONFIG_FILE)
    return path if hf_assets_path is not None and os.path.isfile(path) else None


def _assets_config(hf_assets_path: str | None) -> dict[str, Any] | None:
    """The `config.json` of an assets folder (a JSON object, its keys unchecked), or None without one."""
    path = _assets_config_path(hf_assets_path)
    return None if path is None else config_object(read_config_json(path), path)


def _for_export(config: dict[str, Any], dtype: torch.dtype, where: str) -> dict[str, Any]:
    """`config` (read from `where`) naming `dtype` as the model's (transformers 4 writes
    `torch_dtype`, 5 `dtype`), without its `QUANTIZATION_KEYS` when `dtype` is a plain floating
    point one (16 bits or more), as every export's is."""
    for key in [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]:
        config[key] = str(dtype).removeprefix("torch.")
    if dtype.is_floating_point and dtype.itemsize >= 2:
        for key in [k for k in QUANTIZATION_KEYS if k in config]:
            del config[key]
            logger.info("%s: leaving %s out of the exported config.json: the export writes %s tensors, which "
                        "transformers would otherwise quantize", where, key, str(dtype).removeprefix("torch."))
    return config


class ForeignAdapter:
    """Any adapter with TorchTitan's `BaseStateDictAdapter` surface (`to_hf`, `from_hf`,
    `fqn_to_index_mapping`, `hf_assets_path`), e.g. TorchTitan's own llama3 / qwen3 /
    deepseek_v3 adapters. Exports go through its `to_hf`; imports read whole tensors and go
    through its `from_hf` (`hf_sources` is None: it cannot say which rows a shard needs, so the
    sharded import of our own adapters does not apply). TorchTitan's adapters write no
    `config.json`: an export copies the one in `hf_assets_path`, if any."""

    def __init__(self, adapter: Any):
        missing = [name for name in ("to_hf", "from_hf") if not callable(getattr(adapter, name, None))]
        if missing:
            raise TypeError(f"{type(adapter).__name__} is not a state-dict adapter: it has no "
                            f"{' or '.join(missing)}()")
        self.adapter = adapter
        self.hf_assets_path = getattr(adapter, "hf_assets_path", None)

    hf_names = None
    """Unknown: an export's file split follows the ranks' state dicts, in rank order."""
    tied = False
    """Unknown too: such an adapter's `to_hf` decides what a tied head becomes."""

    def to_hf(self, state_dict: dict[str, Any], complete: bool = True) -> dict[str, Any]:
        return self.adapter.to_hf(state_dict)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return self.adapter.from_hf(hf_state_dict)

    def hf_sources(self, names: Iterable[str]) -> None:
        return None

    def left_out(self, state_dict: dict[str, Any]) -> list[str] | None:
        """The tensors of `state_dict` that an export through this adapter leaves out (TorchTitan's
        Qwen3-MoE adapter: each MoE layer's `expert_bias`, for which the Hub's format has no
        place), found by a round trip through `to_hf` and `from_hf` of empty tensors (`_of_empty`);
        None where the adapter cannot take such tensors."""
        mapped = self._of_empty(state_dict, lambda empty: self.adapter.from_hf(self.adapter.to_hf(empty)))
        tensors = {k for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
        return None if mapped is None else sorted(tensors - set(mapped))

    def exported_names(self, state_dict: dict[str, Any]) -> list[str] | None:
        """The Hugging Face names `to_hf` gives the tensors of `state_dict` (`_of_empty`), or None
        where the adapter cannot take empty tensors."""
        mapped = self._of_empty(state_dict, self.adapter.to_hf)
        return None if mapped is None else sorted(mapped)

    def _of_empty(self, state_dict: dict[str, Any], fn: Callable[[dict[str, torch.Tensor]], Any]) -> Any:
        """`fn` of empty (meta) tensors of the whole shapes of `state_dict`'s tensors; None
        where it fails."""
        try:  # a tensor of no shape of its own (a nested tensor) too
            return fn({k: torch.empty(v.shape, dtype=v.dtype, device="meta")
                       for k, v in state_dict.items() if isinstance(v, torch.Tensor)})
        except Exception as e:  # its own code, on tensors it was not written for: unknown then
            logger.debug("%s cannot map empty tensors (%s: %s): what its export holds is not known before it",
                         type(self.adapter).__name__, type(e).__name__, e)
            return None

    def export_config(self, dtype: torch.dtype) -> dict[str, Any]:
        config = _assets_config(self.hf_assets_path)
        if config is None:
            raise CheckpointError(f"{type(self.adapter).__name__} has no hf_assets_path holding a {CONFIG_FILE}, "
                                  "and it cannot write one: give it the model's Hugging Face assets folder")
        return _for_export(config, dtype, os.path.join(self.hf_assets_path, CONFIG_FILE))

    @property
    def fqn_to_index_mapping(self) -> dict[str, int] | None:
        return getattr(self.adapter, "fqn_to_index_mapping", None)


def as_adapter(adapter: Any) -> StateDictAdapter | ForeignAdapter | None:
    """Ours as it is; any other (TorchTitan's) behind `ForeignAdapter`."""
    if adapter is None or isinstance(adapter, StateDictAdapter):
        return adapter
    return ForeignAdapter(adapter)


def read_file_split(hf_dir: str) -> dict[str, int] | None:
    """HF name -> file index from `hf_dir`'s index file (None when it has none). Files named
    `*-0000X-of-0000N.safetensors` keep their number; other names are numbered in sorted order."""
    path = os.path.join(hf_dir, INDEX_FILE)
    if not os.path.isfile(path):
        return None
    weight_map = read_index(path)
    files = sorted(set(weight_map.values()))
    numbered = {f: n for f in files if (n := file_number(f)) is not None}
    if len(numbered) != len(files) or sorted(numbered.values()) != list(range(1, len(files) + 1)):
        numbered = {f: i for i, f in enumerate(files, start=1)}
    return {name: numbered[f] for name, f in weight_map.items()}


def read_index(path: str) -> dict[str, str]:
    """The `weight_map` of a `model.safetensors.index.json`."""
    try:
        weight_map = json.loads(safe_open.read_bounded(path, "the safetensors index", MAX_INDEX_BYTES))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path} is not a safetensors index with a weight_map: {e!r}") from e
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(f"{path}: weight_map is a {type(weight_map).__name__}, expected an object")
    for name, file in weight_map.items():
        # a file name that leaves the folder would make a load read (or probe) anything
        if not isinstance(file, str) or os.path.isabs(file) or os.sep in file or file in ("", ".", ".."):
            raise CorruptCheckpointError(f"{path} puts {name} in {file!r}, which is not a file of "
                                         "this folder")
    return weight_map


def reorder_rows(w: Any, row_order: tuple[int, ...]) -> Any:
    """Our rows -> HF's: in each block of `len(row_order)` rows, our row k becomes HF row
    `row_order[k]` (the inverse of what `HFSource.row_order` reads).

    A DTensor whose every shard holds whole blocks (a head is never cut) is permuted where it
    lies, shard by shard, and stays a DTensor; otherwise rows of one block live on several ranks,
    and the export writes each rank's rows at their places (`PermutedRows`)."""
    if isinstance(w, DTensor):
        if not whole_row_blocks(tuple(w.shape), tuple(w.device_mesh.shape), tuple(w.placements), len(row_order)):
            return PermutedRows(w, row_order)
        return DTensor.from_local(_permute_rows(w.to_local(), row_order), w.device_mesh, w.placements,
                                  shape=w.shape, stride=w.stride())
    return _permute_rows(w, row_order)


def _permute_rows(w: torch.Tensor, row_order: tuple[int, ...]) -> torch.Tensor:
    inverse = torch.empty(len(row_order), dtype=torch.long, device=w.device)
    inverse[torch.tensor(row_order, device=w.device)] = torch.arange(len(row_order), device=w.device)
    blocks = w.reshape(-1, len(row_order), *w.shape[1:])
    return blocks[:, inverse].reshape(w.shape)


@functools.lru_cache(maxsize=256)
def whole_row_blocks(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Any, ...],
                     rows: int) -> bool:
    """Whether every rank's shard of a DTensor of `shape` laid out as `placements` on a mesh of
    `mesh_shape` starts and ends on a multiple of `rows` rows. The same answer on every rank
    (each shard is looked at, not only this rank's), so ranks agree on whether to gather."""
    on_rows = [i for i, p in enumerate(placements) if getattr(p, "dim", None) == 0]
    for coords in itertools.product(*(range(mesh_shape[i]) for i in on_rows)):
        coordinate = [0] * len(mesh_shape)
        for i, c in zip(on_rows, coords):
            coordinate[i] = c
        sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh_shape, coordinate, placements)
        if sizes[0] % rows or offsets[0] % rows:
            return False
    return True


def rope_row_order(head_dim: int) -> tuple[int, ...]:
    """`HFSource.row_order` of a q/k projection: our RoPE rotates interleaved channel pairs
    (2i, 2i+1) of a head, HF's rotates channel i with i + head_dim/2, so our row 2i+j of a head
    is the HF row j*head_dim/2+i."""
    return tuple(j * (head_dim // 2) + i for i in range(head_dim // 2) for j in range(2))
