"""Hugging Face format: size planning, the Llama mapping, export to and import from `transformers`."""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import re
import shutil
import struct
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tests.helpers import assert_same, hub_snapshot, logits, perturbed, read_checkpoint
from torchtitan_ckpt import cli
from torchtitan_ckpt.errors import AdapterMismatchError, CheckpointError, ConfigError, CorruptCheckpointError
from torchtitan_ckpt.example.model import FLAVORS, Transformer, args_from_hf_config, hf_adapter, hf_config
from torchtitan_ckpt.hf import HFModelConfig, LlamaAdapter, load_hf, parse_size, plan_files, read_hf_config, save_hf
from torchtitan_ckpt.hf import shards
from torchtitan_ckpt.policy.split import in_order_runs, share
from torchtitan_ckpt.hf.files import MAX_ASSET_BYTES
from torchtitan_ckpt.hf.adapter import HFSource, reorder_rows, rope_row_order, whole_row_blocks
from torchtitan_ckpt.hf.model_config import MAX_CONFIG_BYTES
from torchtitan_ckpt.hf.safetensors_io import read_exact, read_header
from torchtitan_ckpt.hf.shards import row_pieces

transformers = pytest.importorskip("transformers")

ARGS = FLAVORS["debugmodel"]
TOKENS = torch.randint(0, ARGS.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))


def our_model(tie: bool = False, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(replace(ARGS, tie_embeddings=tie))


def hf_model(tie: bool = False, seed: int = 0):
    """A transformers Llama of our debug shapes with random weights (norms included)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**hf_config(replace(ARGS, tie_embeddings=tie)))
    return perturbed(transformers.LlamaForCausalLM(config).eval())


def logits_of(model) -> torch.Tensor:
    return logits(model, TOKENS)


def tensors_by_file(folder: str) -> dict[str, dict[str, torch.Tensor]]:
    return {os.path.basename(f): load_file(f) for f in sorted(glob.glob(os.path.join(folder, "*.safetensors")))}


# ---------------------------------------------------------------------------- pure pieces

@pytest.mark.parametrize("text, expected", [
    ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("1.5KB", 1500), ("512MiB", 512 * 2**20),
    (" 2 gib ", 2 * 2**30), ("100", 100), (4096, 4096),
    ("9007199254740993", 2**53 + 1), ("4611686018427387904B", 2**62), ("0.000000001TB", 1000),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["5 parsecs", "GB", "-1GB", "0", "", 0, True, None, "4611686018427387905",
                                 "9" * 5000 + "TiB"])
def test_parse_size_rejects_with_the_value(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        parse_size(bad)


def test_plan_keeps_layers_whole_and_uses_fewest_files():
    sizes = {"model.embed_tokens.weight": 100}
    for i in range(4):
        sizes[f"model.layers.{i}.q.weight"] = 60
        sizes[f"model.layers.{i}.norm.weight"] = 40
    sizes |= {"model.norm.weight": 1, "lm_head.weight": 100}
    by_file: dict[int, list[str]] = {}
    for name, index in plan_files(sizes, 250).items():
        by_file.setdefault(index, []).append(name)
    assert by_file == {
        1: ["model.embed_tokens.weight", "model.layers.0.q.weight", "model.layers.0.norm.weight"],
        2: ["model.layers.1.q.weight", "model.layers.1.norm.weight",
            "model.layers.2.q.weight", "model.layers.2.norm.weight"],
        3: ["model.layers.3.q.weight", "model.layers.3.norm.weight", "model.norm.weight", "lm_head.weight"],
    }


def test_plan_balances_file_sizes():
    # next-fit under 25 bytes would give files of 25 and 5 bytes; the plan gives 15 and 15
    sizes = {f"t{i}": 5 for i in range(6)}
    assert plan_files(sizes, 25) == {"t0": 1, "t1": 1, "t2": 1, "t3": 2, "t4": 2, "t5": 2}


def test_plan_gives_an_oversized_layer_its_own_file():
    sizes = {"e": 10, "model.layers.0.a": 200, "model.layers.0.b": 200, "n": 10}
    assert plan_files(sizes, 100) == {"e": 1, "model.layers.0.a": 2, "model.layers.0.b": 2, "n": 3}


def test_permutation_moves_rope_pairs_to_halves_and_back():
    w = torch.arange(8.0).reshape(8, 1)  # 2 heads of head_dim 4
    order = rope_row_order(4)
    hf = reorder_rows(w, order)
    assert hf.flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert torch.equal(hf.view(2, 4)[:, list(order)].reshape(8, 1), w)  # HFSource.row_order reads it back


@pytest.mark.parametrize("shape, mesh, placements, rows, whole", [
    ((32, 2), (2,), (Shard(0),), 8, True),  # 2 heads of 8 rows per rank
    ((24, 2), (2,), (Shard(0),), 8, False),  # 12 rows per rank: head 1 is cut
    ((24, 4), (2,), (Shard(1),), 8, True),  # columns: every rank holds every row
    ((32, 2), (2, 2), (_StridedShard(0, split_factor=2), Shard(0)), 8, True),  # FSDP over TP: 8 rows each
    ((32, 2), (2, 2), (_StridedShard(0, split_factor=2), Shard(0)), 16, False),
    ((32, 2), (2, 2), (Replicate(), Shard(0)), 16, True),  # HSDP's replicas hold the same rows
])
def test_ranks_agree_whether_every_shard_holds_whole_heads(shape, mesh, placements, rows, whole):
    assert whole_row_blocks(shape, mesh, placements, rows) is whole


@pytest.mark.parametrize("lo, hi, rows, block, piece_rows, expected", [
    (0, 24, 48, 16, 100, [(0, 32)]),  # rank 0 of 2 splits head 1: heads 0-1
    (24, 48, 48, 16, 100, [(16, 48)]),  # rank 1: heads 1-2
    (8, 16, 16, 16, 100, [(0, 16)]),  # half a head: the whole head
    (0, 48, 48, 16, 40, [(0, 32), (32, 48)]),  # pieces of whole heads
    (0, 40, 48, 16, 10, [(0, 16), (16, 32), (32, 48)]),  # a piece is at least one head
    (5, 13, 20, 1, 3, [(5, 8), (8, 11), (11, 13)]),  # rows kept in place: exactly [lo, hi)
])
def test_row_pieces_read_whole_heads_around_a_shard(lo, hi, rows, block, piece_rows, expected):
    assert row_pieces(lo, hi, rows, block, piece_rows) == expected


@pytest.mark.parametrize("tie", [False, True])
def test_hf_sources_invert_to_hf(tie):
    model = our_model(tie)
    sd, adapter = model.state_dict(), hf_adapter(model.args)
    hf, sources = adapter.to_hf(sd), adapter.hf_sources(sd)
    assert sorted(sources) == sorted(sd)
    for name, source in sources.items():
        rows = torch.arange(sd[name].shape[0])
        order = torch.tensor(source.row_order or (0,))
        back = hf[source.name][rows - rows % source.block_rows + order[rows % source.block_rows]]
        assert torch.equal(back, sd[name]), name
    assert sources["layers.1.attention.wk.weight"].row_order == tuple(r for i in range(8) for r in (i, i + 8))
    assert sources["layers.1.attention.wv.weight"].row_order == ()
    assert (sources["output.weight"] == sources["tok_embeddings.weight"]) is tie


def test_to_hf_names_unknown_and_missing_keys():
    sd = our_model().state_dict()
    del sd["norm.weight"]
    sd["layers.0.attention.bias"] = torch.zeros(1)
    with pytest.raises(AdapterMismatchError) as e:
        hf_adapter(ARGS).to_hf(sd)
    assert e.value.unknown == ["layers.0.attention.bias"] and e.value.missing == ["norm.weight"]
    assert "layers.0.attention.bias" in str(e.value) and "norm.weight" in str(e.value)


def test_a_pipeline_stage_converts_its_part_and_the_ranks_check_the_whole(tmp_path):
    sd, adapter = our_model().state_dict(), hf_adapter(ARGS)
    stage = {k: v for k, v in sd.items() if k.startswith("layers.1.") or k in ("norm.weight", "output.weight")}
    assert sorted(adapter.to_hf(stage, complete=False)) == sorted(
        n for n in adapter.to_hf(sd) if n.startswith("model.layers.1.") or n in ("model.norm.weight", "lm_head.weight"))
    with pytest.raises(AdapterMismatchError) as e:
        adapter.to_hf(stage)
    assert "tok_embeddings.weight" in e.value.missing and e.value.unknown == []
    with pytest.raises(AdapterMismatchError) as e:
        adapter.to_hf({**stage, "layers.1.attention.bias": torch.zeros(1)}, complete=False)
    assert e.value.unknown == ["layers.1.attention.bias"] and e.value.missing == []
    assert adapter.hf_names[0] == "model.embed_tokens.weight" and adapter.hf_names[-1] == "lm_head.weight"
    with pytest.raises(AdapterMismatchError) as e:  # no other rank holds the rest
        save_hf(stage, str(tmp_path), adapter)
    assert "model.embed_tokens.weight" in e.value.missing and e.value.unknown == []
    assert not os.path.exists(tmp_path / "config.json")  # refused before anything is written


def test_a_pipeline_stage_with_a_tied_head_and_no_embedding_is_refused_saying_so():
    """The last stage of a tied model holds `output.weight` but not the embedding it is tied to:
    the refusal says that, not that the two differ."""
    args = replace(ARGS, tie_embeddings=True)
    sd = our_model(tie=True).state_dict()
    last = {k: v for k, v in sd.items() if k.startswith("layers.1.") or k in ("norm.weight", "output.weight")}
    message = ("this part of the model (a pipeline stage) holds output.weight without tok_embeddings.weight, so "
               "the two cannot be tied: the Hugging Face config ties them (tie_word_embeddings = true), and an "
               "export would keep the embedding alone and drop the model's own head. Export with a config.json "
               "saying tie_word_embeddings = false (the adapter's hf_assets_path), or tie the model's head to its "
               "embedding")
    with pytest.raises(CheckpointError, match=f"^{re.escape(message)}$"):
        hf_adapter(args).to_hf(last, complete=False)


def test_a_tied_head_holding_a_nan_is_still_tied_and_an_untied_one_is_refused():
    """A NaN in a tied embedding (a diverged fp16 run) made the head read as not tied, and the
    run's last export failed."""
    args = replace(ARGS, tie_embeddings=True)
    sd = our_model(tie=True).state_dict()
    sd["tok_embeddings.weight"][3, 1] = float("nan")
    assert "lm_head.weight" not in hf_adapter(args).to_hf(sd)
    sd["output.weight"] = sd["output.weight"].clone()  # the same values, held apart: still tied
    hf_adapter(args).to_hf(sd)
    sd["output.weight"][0, 0] += 1
    with pytest.raises(CheckpointError, match="^output.weight is not tok_embeddings.weight: "):
        hf_adapter(args).to_hf(sd)


def test_model_args_from_the_config_we_write():
    for args in [*FLAVORS.values(), replace(ARGS, tie_embeddings=True, rope_theta=5e5)]:
        back = args_from_hf_config(hf_config(args, torch.bfloat16))
        assert replace(back, multiple_of=args.multiple_of, ffn_hidden=args.ffn_hidden, head_size=args.head_size) == args
        assert (back.ffn_dim, back.head_dim) == (args.ffn_dim, args.head_dim)


# ---------------------------------------------------------------------------- export

@pytest.mark.parametrize("tie", [False, True])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, tie):
    model = our_model(tie)
    save_hf(model.state_dict(), str(tmp_path), hf_adapter(model.args), max_shard_size="100KB")
    hf, info = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    assert (logits_of(hf.eval()) - logits_of(model)).abs().max() < 1e-5

    files = tensors_by_file(str(tmp_path))
    assert sorted(files) == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    with open(tmp_path / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert index["weight_map"] == {name: file for file, ts in files.items() for name in ts}
    assert index["metadata"]["total_size"] == sum(t.nbytes for ts in files.values() for t in ts.values())
    assert ("lm_head.weight" in index["weight_map"]) is not tie
    assert len(index["weight_map"]) == 2 + 9 * ARGS.n_layers + (not tie)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_an_export_to_a_dtype_transformers_loads_no_model_in_is_refused_before_writing(tmp_path, dtype):
    """int8 wrote the weights truncated to 0 with torch_dtype "int8", float8 a folder transformers
    failed on (no quantization config): both refused by transformers, after the export."""
    with pytest.raises(ValueError, match=rf"dtype = {dtype}: an export is cast to one of torch.float16, "
                                         r"torch.bfloat16, torch.float32, torch.float64, or keeps the model's "
                                         r"dtypes \(None\)"):
        save_hf(our_model().state_dict(), str(tmp_path / "out"), hf_adapter(ARGS), dtype=dtype)
    assert not (tmp_path / "out").exists()


def test_an_fp8_models_export_in_bfloat16_is_widened_exactly(tmp_path):
    """Float8 weights are cast where the export's dtype holds each of their values: the folder
    then loads in transformers (float8 with no quantization config does not)."""
    state = {k: v.to(torch.float8_e4m3fn) for k, v in our_model().state_dict().items()}
    save_hf(state, str(tmp_path), hf_adapter(ARGS), dtype=torch.bfloat16)
    exported = {k: v for f in glob.glob(str(tmp_path / "*.safetensors")) for k, v in load_file(f).items()}
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    assert_same(exported, hf_adapter(ARGS).to_hf({k: v.to(torch.bfloat16) for k, v in state.items()}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_export_dtype(tmp_path, dtype):
    model = our_model()
    save_hf(model.state_dict(), str(tmp_path), hf_adapter(ARGS), dtype=dtype)
    [file] = glob.glob(str(tmp_path / "*.safetensors"))
    assert os.path.basename(file) == "model-00001-of-00001.safetensors"
    exported = load_file(file)
    assert {t.dtype for t in exported.values()} == {dtype}
    expected = hf_adapter(ARGS).to_hf({k: v.to(dtype) for k, v in model.state_dict().items()})
    assert_same(exported, expected)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["torch_dtype"] == str(dtype).removeprefix("torch.")
    # and an fp32 model imports it (as published bf16 checkpoints are), upcast exactly
    back = our_model(seed=1)
    load_hf(back.state_dict(), str(tmp_path), hf_adapter(ARGS))
    assert_same(back.state_dict(), {k: v.to(dtype).float() for k, v in model.state_dict().items()})


def test_values_beyond_the_export_dtype_are_a_warning_naming_the_tensor(tmp_path, caplog):
    """A float16 export turns values over 65504 into inf: said, naming the tensor (was silent)."""
    model = our_model()
    state = model.state_dict()
    with caplog.at_level(logging.WARNING):
        save_hf(state, str(tmp_path / "fits"), hf_adapter(ARGS), dtype=torch.float16)
    assert not caplog.records
    state["norm.weight"][:3] = torch.tensor([1e5, -7e4, float("inf")])  # the inf was one before
    save_hf(state, str(tmp_path / "over"), hf_adapter(ARGS), dtype=torch.float16)
    assert caplog.messages == ["norm.weight: 2 finite value(s) beyond float16's range (+-65504) are exported as inf"]


def test_an_export_leaves_files_named_like_its_own_but_not_its_own(tmp_path):
    """An earlier export's model files are removed before a new one is written; files whose
    names only begin like them (a user's copy, another tool's temporary file) are not."""
    for name in ("model.safetensors.orig", "model-00001-of-00002.safetensors.tmp"):
        (tmp_path / name).write_bytes(b"the user's")
    save_hf(our_model().state_dict(), str(tmp_path), hf_adapter(ARGS))
    assert (tmp_path / "model.safetensors.orig").read_bytes() == b"the user's"
    assert (tmp_path / "model-00001-of-00002.safetensors.tmp").read_bytes() == b"the user's"


def test_export_replaces_an_earlier_export(tmp_path):
    model = our_model()
    save_hf(model.state_dict(), str(tmp_path), hf_adapter(ARGS), max_shard_size="100KB")
    save_hf(model.state_dict(), str(tmp_path), hf_adapter(ARGS), max_shard_size="5GB")
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model-00001-of-00001.safetensors",
                                            "model.safetensors.index.json"]


@pytest.mark.parametrize("ours, assets, differ", [
    (ARGS, replace(ARGS, tie_embeddings=True), "tie_word_embeddings = true there, false in the adapter's"),
    (replace(ARGS, tie_embeddings=True), ARGS, "tie_word_embeddings = false there, true in the adapter's"),
    (ARGS, replace(ARGS, ffn_hidden=ARGS.ffn_dim + 8, n_layers=3),
     f"num_hidden_layers = 3 there, {ARGS.n_layers} in the adapter's; intermediate_size = {ARGS.ffn_dim + 8} "
     f"there, {ARGS.ffn_dim} in the adapter's"),
])
@pytest.mark.parametrize("mode", ["one_pass", "rank0"])
def test_an_export_refuses_assets_whose_config_is_another_models(tmp_path, ours, assets, differ, mode):
    """The export copies the assets' config.json, and `transformers` builds the model from it:
    a tied model with untied assets would get a head initialised at random, an untied one with
    tied assets its embedding as head, silently. Refused before the folder is touched: an
    earlier export there stays whole."""
    model = Transformer(ours)
    save_hf(model.state_dict(), str(tmp_path / "out"), hf_adapter(ours))
    before = {name: (tmp_path / "out" / name).read_bytes() for name in os.listdir(tmp_path / "out")}
    folder = _assets(tmp_path / "assets", assets)
    with pytest.raises(CheckpointError, match=re.escape(
            f"{folder}/config.json does not describe the model the adapter converts ({differ}): an export would "
            "write its tensors under that config, and transformers would build another model from them. Build "
            "the adapter from that config.json (adapter_for_hf_dir), or give it an hf_assets_path whose "
            "config.json is its model's")):
        save_hf(model.state_dict(), str(tmp_path / "out"), hf_adapter(ours, hf_assets_path=folder), mode=mode)
    assert {name: (tmp_path / "out" / name).read_bytes() for name in os.listdir(tmp_path / "out")} == before


def test_an_export_refuses_assets_of_another_family_of_the_same_shapes(tmp_path):
    """A Qwen3 model exported beside a Llama's config.json of its sizes: transformers built a Llama,
    dropped the q/k norms and gave other logits. Mistral's and Llama's stay interchangeable."""
    from torchtitan_ckpt.hf import adapter_for_config

    folder = _assets(tmp_path / "assets", ARGS)
    qwen3 = adapter_for_config(hf_config(replace(ARGS, qk_norm=True)), hf_assets_path=folder)
    with pytest.raises(CheckpointError, match=r"config.json does not describe the model the adapter converts "
                                              r"\(model_type = \"llama\" there, \"qwen3\" in the adapter's\)"):
        qwen3.export_config(torch.float32)
    mistral = adapter_for_config({**hf_config(ARGS), "model_type": "mistral"}, hf_assets_path=folder)
    assert mistral.export_config(torch.float32)["model_type"] == "llama"


def test_the_example_refuses_assets_of_another_forward_pass(tmp_path):
    """The example model built from a flavor of the right sizes for a Hub model of another RoPE and
    norm epsilon trained with the flavor's, then exported under the Hub's config (logits off)."""
    other = replace(ARGS, rope_theta=500000.0, norm_eps=1e-6)
    with pytest.raises(ConfigError, match=r"model.hf_assets_path = .*: its config.json describes another model than "
                                          r"the flavor \(norm_eps = 1e-06 there, 1e-05 in the flavor; rope_theta = "
                                          r"500000.0 there, 10000.0 in the flavor\)"):
        hf_adapter(ARGS, hf_assets_path=_assets(tmp_path / "assets", other))
    rounded = _assets(tmp_path / "rounded", replace(ARGS, norm_eps=9.999999747378752e-06))  # 1e-5 in float32
    assert hf_adapter(ARGS, hf_assets_path=rounded).hf_assets_path == rounded


@pytest.mark.parametrize("mode", ["one_pass", "all_ranks", "rank0"])
def test_a_transposed_tensor_exports_in_every_mode(tmp_path, mode):
    """A weight held transposed (a view, not contiguous): the two-phase modes' DCP writer failed
    on it with PyTorch's raw error, after the folder was made."""
    model = our_model()
    sd = model.state_dict()
    key = next(k for k in sd if k.endswith("feed_forward.w2.weight"))
    sd[key] = sd[key].t().contiguous().t()
    assert not sd[key].is_contiguous()
    save_hf(sd, str(tmp_path / "out"), hf_adapter(ARGS), mode=mode)
    save_hf(model.state_dict(), str(tmp_path / "expected"), hf_adapter(ARGS), mode=mode)
    got, expected = (tensors_by_file(str(tmp_path / d)) for d in ("out", "expected"))
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert_same(got[name], expected[name])


class _Prefixed:
    """An adapter of TorchTitan's surface that only prefixes the names."""

    def __init__(self, hf_assets_path: str):
        self.hf_assets_path = hf_assets_path

    def to_hf(self, sd: dict) -> dict:
        return {"hf." + k: v for k, v in sd.items()}

    def from_hf(self, sd: dict) -> dict:
        return {k.removeprefix("hf."): v for k, v in sd.items()}


@pytest.mark.parametrize("mode", ["one_pass", "all_ranks", "rank0"])
def test_a_one_element_tensor_of_any_stride_exports_and_loads(tmp_path, mode):
    """One element of strides (5, 3), contiguous as torch counts: `one_pass` read its bytes
    through a byte view that torch refuses for a stride that is not 1 (a bare RuntimeError)."""
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "config.json").write_text("{}")
    adapter = _Prefixed(str(tmp_path / "assets"))
    odd = torch.zeros(6).as_strided((1, 1), (5, 3), 1).fill_(2.5)
    save_hf({"w": odd}, str(tmp_path / "out"), adapter, mode=mode)
    assert_same(tensors_by_file(str(tmp_path / "out"))["model-00001-of-00001.safetensors"],
                {"hf.w": torch.full((1, 1), 2.5)})
    into = {"w": torch.zeros(6).as_strided((1, 1), (5, 3), 1)}
    load_hf(into, str(tmp_path / "out"), adapter)
    assert into["w"].item() == 2.5 and into["w"].stride() == (5, 3)


@pytest.mark.parametrize("mode", ["one_pass", "all_ranks", "rank0"])
def test_lazily_conjugated_and_negated_views_export_and_load_their_values(tmp_path, mode):
    """A rotary table kept as `polar(...).conj()` and a `_neg_view` (what `x.conj().imag` gives):
    `all_ranks` and `rank0` wrote their memory (the values unconjugated, unnegated) in silence,
    `one_pass` failed with torch's bare error after writing a zero-filled file; `load_hf` into
    such a view of the file's dtype failed after writing the other tensors."""
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "config.json").write_text("{}")
    adapter = _Prefixed(str(tmp_path / "assets"))
    freqs = torch.polar(torch.ones(4), torch.arange(4.0)).conj()
    neg = torch._neg_view(torch.tensor([1.0, 2.0]))
    assert freqs.is_conj() and neg.is_neg()
    save_hf({"freqs": freqs, "w": neg}, str(tmp_path / "out"), adapter, mode=mode)
    assert_same(tensors_by_file(str(tmp_path / "out"))["model-00001-of-00001.safetensors"],
                {"hf.freqs": freqs.resolve_conj(), "hf.w": torch.tensor([-1.0, -2.0])})
    into = {"freqs": torch.zeros(4, dtype=torch.complex64).conj(), "w": torch._neg_view(torch.zeros(2))}
    load_hf(into, str(tmp_path / "out"), adapter)
    assert torch.equal(into["freqs"], freqs) and torch.equal(into["w"], torch.tensor([-1.0, -2.0]))


@pytest.mark.parametrize("mode", ["one_pass", "rank0"])
def test_an_export_replaces_a_config_json_link_instead_of_writing_through_it(tmp_path, mode):
    """A folder of the hub cache links its config.json to a blob that other revisions share;
    any link may lead out of the folder."""
    blob = tmp_path / "blob.json"
    blob.write_text('{"precious": true}')
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").symlink_to(blob)
    save_hf(our_model().state_dict(), str(tmp_path / "out"), hf_adapter(ARGS), mode=mode)
    assert blob.read_text() == '{"precious": true}'
    assert not (tmp_path / "out" / "config.json").is_symlink()
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f) == hf_adapter(ARGS).export_config(torch.float32)


@pytest.mark.parametrize("mode", ["one_pass", "rank0"])
def test_an_export_copies_the_assets_generation_and_tokenizer_files(tmp_path, mode):
    """Llama 3.1 Instruct's `generation_config.json` stops `generate` at three tokens, its
    `config.json` names one: without it, the exported model generates past the end of a turn.
    The tokenizer's files make the folder one `AutoTokenizer` reads. Links (a hub cache's) are
    read through; nothing else of the assets (their weights, a README) is copied."""
    (tmp_path / "repo" / "snapshots").mkdir(parents=True)
    assets = _assets(tmp_path / "repo" / "snapshots" / "abc", ARGS)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 8, 9], temperature=0.6,
                                  do_sample=True).save_pretrained(assets)
    (tmp_path / "repo" / "blobs").mkdir()
    (tmp_path / "repo" / "blobs" / "f00d").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    os.symlink(tmp_path / "repo" / "blobs" / "f00d", os.path.join(assets, "tokenizer.json"))
    with open(os.path.join(assets, "tokenizer_config.json"), "w") as f:
        f.write('{"model_max_length": 8192}')
    with open(os.path.join(assets, "README.md"), "w") as f:
        f.write("a model card")
    save_file({"x": torch.ones(2)}, os.path.join(assets, "model.safetensors"))
    save_hf(our_model().state_dict(), str(tmp_path / "out"), hf_adapter(ARGS, hf_assets_path=assets), mode=mode)
    assert sorted(os.listdir(tmp_path / "out")) == [
        "config.json", "generation_config.json", "model-00001-of-00001.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(assets, name), "rb") as f:
            assert (tmp_path / "out" / name).read_bytes() == f.read()
        assert not (tmp_path / "out" / name).is_symlink()
    generation = transformers.GenerationConfig.from_pretrained(str(tmp_path / "out"))
    assert generation.eos_token_id == [2, 8, 9] and generation.temperature == 0.6


def _tokenizer(chat_template) -> "transformers.PreTrainedTokenizerFast":
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(ARGS.vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t2", unk_token="t0")
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.mark.parametrize("mode", ["one_pass", "rank0"])
def test_an_export_copies_the_assets_named_chat_templates(tmp_path, mode, caplog):
    """`transformers` keeps a tokenizer's named chat templates in `additional_chat_templates/`:
    an export without them gave a tokenizer whose tool-use template, asked for by name, was its
    name's text (no error). A file there of no template's name is left out, said."""
    assets = _assets(tmp_path / "assets", ARGS)
    _tokenizer({"default": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
                "tool_use": "TOOLS {{ tools }}"}).save_pretrained(assets)
    (tmp_path / "assets" / "additional_chat_templates" / ".hidden.jinja").write_text("not a template of a name")
    (tmp_path / "assets" / "additional_chat_templates" / "x\nfake log line\x1b[2J").write_text("")
    with caplog.at_level(logging.WARNING, logger="torchtitan_ckpt.hf"):
        save_hf(our_model().state_dict(), str(tmp_path / "out"), hf_adapter(ARGS, hf_assets_path=assets), mode=mode)
    assert os.listdir(tmp_path / "out" / "additional_chat_templates") == ["tool_use.jinja"]
    told = caplog.records[0].getMessage()  # a name that is not printable, escaped (no line of its own, no escape code)
    assert "additional_chat_templates: .hidden.jinja, 'x\\nfake log line\\x1b[2J', not a chat template's file" in told
    assert len(caplog.records) == 1 and told.isprintable()
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    theirs = transformers.AutoTokenizer.from_pretrained(assets).chat_template
    assert exported.chat_template == {name: t for name, t in theirs.items() if name != ".hidden"}
    assert list(exported.chat_template) == ["default", "tool_use"]
    chat = [{"role": "user", "content": "t5"}]
    assert exported.apply_chat_template(chat, chat_template="tool_use", tools=[], tokenize=False) == "TOOLS []"


def test_an_export_into_a_folder_says_which_tokenizer_files_of_before_stay(tmp_path, caplog):
    """Assets whose template is inside `tokenizer_config.json` (many Hub repos), exported where an
    earlier export wrote a `chat_template.jinja`: transformers reads the old file's template over
    the new one's. The files stay (they may be the user's), said by name."""
    first, second = (_assets(tmp_path / name, ARGS) for name in ("first", "second"))
    _tokenizer("TEMPLATE-A").save_pretrained(first)
    _tokenizer({"default": "TEMPLATE-B", "tool_use": "TOOLS"}).save_pretrained(second)
    os.remove(os.path.join(second, "chat_template.jinja"))
    shutil.rmtree(os.path.join(second, "additional_chat_templates"))
    save_hf(our_model().state_dict(), str(tmp_path / "out"), hf_adapter(ARGS, hf_assets_path=second))
    assert not caplog.records
    save_hf(our_model().state_dict(), str(tmp_path / "out"), hf_adapter(ARGS, hf_assets_path=first))
    with caplog.at_level(logging.WARNING, logger="torchtitan_ckpt.hf"):
        save_hf(our_model().state_dict(), str(tmp_path / "out"), hf_adapter(ARGS, hf_assets_path=second))
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'out'}: chat_template.jinja left from before, which the assets of this export do not have: they "
        "stay, and transformers reads them with this export's files; remove them if they belong to an earlier export"]


FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def test_an_export_leaves_out_the_assets_quantization_config(tmp_path, caplog):
    """Assets of an FP8 checkpoint (every DeepSeek-V3 on the Hub, Qwen3-*-FP8) say so in their
    config.json; the export writes plain floating-point tensors, which transformers would cast
    to FP8 layers with made-up scales (on a GPU) or refuse to load (here). The same for an
    adapter of whole tensors (TorchTitan's), which copies its assets' config.json."""
    model = our_model()
    assets = _assets(tmp_path / "assets", ARGS)
    with open(os.path.join(assets, "config.json")) as f:
        config = {**json.load(f), "quantization_config": FP8, "compression_config": {"format": "float-quantized"}}
    with open(os.path.join(assets, "config.json"), "w") as f:
        json.dump(config, f)
    with caplog.at_level(logging.INFO, logger="torchtitan_ckpt.hf.adapter"):
        save_hf(model.state_dict(), str(tmp_path / "out"), hf_adapter(ARGS, hf_assets_path=assets),
                dtype=torch.bfloat16)
    with open(tmp_path / "out" / "config.json") as f:
        exported = json.load(f)
    assert exported == {**{k: v for k, v in config.items() if k not in ("quantization_config", "compression_config")},
                        "torch_dtype": "bfloat16"}
    assert (f"{assets}/config.json: leaving quantization_config out of the exported config.json: the export writes "
            "bfloat16 tensors, which transformers would otherwise quantize") in caplog.messages
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    expected = our_model()
    expected.load_state_dict({k: v.bfloat16().float() for k, v in model.state_dict().items()})
    assert (logits_of(hf) - logits_of(expected)).abs().max() < 1e-5

    _config_file(tmp_path / "tiny", json.dumps({"model_type": "tiny", "quantization_config": FP8}))
    save_hf({"a": torch.ones(2)}, str(tmp_path / "foreign"), _Renamed(str(tmp_path / "tiny")))
    with open(tmp_path / "foreign" / "config.json") as f:
        assert json.load(f) == {"model_type": "tiny", "torch_dtype": "float32"}


def test_an_export_refuses_an_assets_file_too_large_to_be_one_before_touching_the_folder(tmp_path):
    model = our_model()
    save_hf(model.state_dict(), str(tmp_path / "out"), hf_adapter(ARGS))
    before = {name: (tmp_path / "out" / name).read_bytes() for name in os.listdir(tmp_path / "out")}
    assets = _assets(tmp_path / "assets", ARGS)
    with open(os.path.join(assets, "tokenizer.json"), "wb") as f:
        f.truncate(MAX_ASSET_BYTES + 1)
    with pytest.raises(CheckpointError, match=re.escape(
            f"{assets}/tokenizer.json: the assets' tokenizer.json is larger than {MAX_ASSET_BYTES} bytes")):
        save_hf(model.state_dict(), str(tmp_path / "out"), hf_adapter(ARGS, hf_assets_path=assets))
    assert {name: (tmp_path / "out" / name).read_bytes() for name in os.listdir(tmp_path / "out")} == before


@pytest.mark.parametrize("mode", ["all_ranks", "rank0"])
def test_a_two_phase_export_clears_the_shards_an_earlier_one_kept(tmp_path, mode):
    """Shards kept (`keep_shards`) under another file split are not consolidated with the new
    ones; files of the user's in the shards' folder stay, and a `.safetensors` one, which is not
    a shard of DCP's, is not consolidated either."""
    model = our_model()
    save_hf(model.state_dict(), str(tmp_path), hf_adapter(ARGS), mode=mode, keep_shards=True, max_shard_size="100KB")
    assert len(os.listdir(tmp_path / "sharded")) == 4
    (tmp_path / "sharded" / "notes.txt").write_text("mine")
    save_file({"extra": torch.ones(2)}, str(tmp_path / "sharded" / "mine.safetensors"),
              metadata={"DCP_SHARDING_INFO": json.dumps({"extra": {"saved_offsets": [0]}})})
    save_hf(model.state_dict(), str(tmp_path), hf_adapter(ARGS), mode=mode, max_shard_size="5GB")
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model-00001-of-00001.safetensors",
                                            "model.safetensors.index.json", "sharded"]
    assert sorted(os.listdir(tmp_path / "sharded")) == ["mine.safetensors", "notes.txt"]
    back = our_model(seed=1)
    load_hf(back.state_dict(), str(tmp_path), hf_adapter(ARGS))
    assert_same(back.state_dict(), model.state_dict())


@pytest.mark.parametrize("mode", ["one_pass", "all_ranks"])
def test_an_export_never_follows_a_shards_link_out_of_its_folder(tmp_path, mode):
    """`sharded` as a link to another folder holding a file named as a shard: the export
    replaces the link (the two-phase modes write and delete their shards in a folder of their
    own), and the other folder is untouched."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    theirs = elsewhere / "shard-00001-model-00001-of-00001.safetensors"
    theirs.write_bytes(b"not ours")
    out = tmp_path / "out"
    out.mkdir()
    (out / "sharded").symlink_to(elsewhere)
    model = our_model()
    save_hf(model.state_dict(), str(out), hf_adapter(ARGS), mode=mode)
    assert sorted(os.listdir(elsewhere)) == [theirs.name] and theirs.read_bytes() == b"not ours"
    assert not os.path.lexists(out / "sharded")
    back = our_model(seed=1)
    load_hf(back.state_dict(), str(out), hf_adapter(ARGS))
    assert_same(back.state_dict(), model.state_dict())


def test_export_failure_names_the_folder(tmp_path):
    (tmp_path / "taken").write_text("a file, not a folder")
    with pytest.raises(CheckpointError, match=r"preparing .*taken failed on rank 0: FileExistsError"):
        save_hf(our_model().state_dict(), str(tmp_path / "taken"), hf_adapter(ARGS))


# ---------------------------------------------------------------------------- import

@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A transformers checkpoint in several files, and its logits."""
    folder = tmp_path_factory.mktemp("hf_src")
    model = hf_model()
    model.save_pretrained(str(folder), max_shard_size="150KB")
    assert len(glob.glob(str(folder / "*.safetensors"))) >= 3
    return str(folder), logits_of(model)


def test_import_gives_the_transformers_logits_and_exports_bit_identical(hf_checkpoint, tmp_path):
    src, expected = hf_checkpoint
    model = our_model(seed=1)
    load_hf(model.state_dict(), src, hf_adapter(ARGS))
    assert (logits_of(model) - expected).abs().max() < 1e-5

    save_hf(model.state_dict(), str(tmp_path), hf_adapter(ARGS, hf_assets_path=src))
    before, after = tensors_by_file(src), tensors_by_file(str(tmp_path))
    assert sorted(before) == sorted(after)
    for file in before:
        assert_same(before[file], after[file])
    with open(os.path.join(src, "config.json")) as a, open(tmp_path / "config.json") as b:
        assert json.load(a) == json.load(b)
    # the assets' config follows the export's dtype
    save_hf(model.state_dict(), str(tmp_path), hf_adapter(ARGS, hf_assets_path=src), dtype=torch.bfloat16)
    with open(os.path.join(src, "config.json")) as a, open(tmp_path / "config.json") as b:
        assert json.load(b) == {**json.load(a), "dtype": "bfloat16"}


def test_import_from_the_hub_cache_reads_through_its_links_into_blobs_only(hf_checkpoint, tmp_path):
    """A model downloaded to the Hugging Face hub's cache: `<repo>/snapshots/<revision>/` holds
    links to `<repo>/blobs/<hash>`. It loads as its folder would (the links stay inside the
    repository's blobs); a link anywhere else, another repository's blobs included, is refused."""
    src, expected = hf_checkpoint
    snapshot = hub_snapshot(src, tmp_path / "hub" / "models--org--tiny")
    model = our_model(seed=1)
    load_hf(model.state_dict(), str(snapshot), hf_adapter(ARGS))
    assert (logits_of(model) - expected).abs().max() < 1e-5

    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    first = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))[0]
    shutil.copyfile(os.path.join(src, first), other / "stolen")
    (snapshot / first).unlink()
    (snapshot / first).symlink_to(other / "stolen")
    with pytest.raises(CorruptCheckpointError, match="is a link to .*stolen, outside the checkpoint folder"):
        load_hf(our_model(seed=1).state_dict(), str(snapshot), hf_adapter(ARGS))

    # laid out as a repository of the cache, its folder not under `snapshots`: not the cache's
    fake = tmp_path / "fake" / "revisions" / "abc"
    shutil.copytree(src, fake)
    (tmp_path / "fake" / "blobs").mkdir()
    (fake / first).rename(tmp_path / "fake" / "blobs" / "f00d")
    (fake / first).symlink_to(tmp_path / "fake" / "blobs" / "f00d")
    with pytest.raises(CorruptCheckpointError, match="is a link to .*f00d, outside the checkpoint folder"):
        load_hf(our_model(seed=1).state_dict(), str(fake), hf_adapter(ARGS))


def test_an_old_local_dir_download_linking_into_a_hub_cache_is_refused_saying_how_to_load_it(hf_checkpoint,
                                                                                              tmp_path):
    """`huggingface-cli download --local-dir` of huggingface_hub < 0.23 left the big files as
    links to `~/.cache/huggingface/hub/models--<name>/blobs/<hash>`. Followed from any folder,
    such links would let a crafted one read whichever cached model it names: refused, saying
    how to load the folder; its copy with the links followed loads."""
    src, expected = hf_checkpoint
    blobs = tmp_path / "cache" / "hub" / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    local = tmp_path / "local"
    local.mkdir()
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            shutil.copyfile(os.path.join(src, name), blobs / f"hash-{name}")
            (local / name).symlink_to(blobs / f"hash-{name}")
        else:
            shutil.copyfile(os.path.join(src, name), local / name)
    first = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))[0]
    with pytest.raises(CorruptCheckpointError, match=re.escape(
            f"{local / first}: a safetensors file is a link to {blobs / f'hash-{first}'}, outside the checkpoint "
            "folder; refusing to read it (if the link is meant, copy the folder with its links followed: `cp -rL`)")):
        load_hf(our_model(seed=1).state_dict(), str(local), hf_adapter(ARGS))
    shutil.copytree(local, tmp_path / "copy", symlinks=False)  # `cp -rL`
    model = our_model(seed=1)
    load_hf(model.state_dict(), str(tmp_path / "copy"), hf_adapter(ARGS))
    assert (logits_of(model) - expected).abs().max() < 1e-5


@pytest.mark.parametrize("num_threads", [1, 3, 64])
def test_import_on_any_number_of_threads_gives_the_same_state(hf_checkpoint, num_threads):
    """More threads than pieces, or a run ending inside a tensor, change nothing."""
    src, expected = hf_checkpoint
    model = our_model(seed=1)
    load_hf(model.state_dict(), src, hf_adapter(ARGS), num_threads=num_threads)
    assert (logits_of(model) - expected).abs().max() < 1e-5


@pytest.mark.parametrize("sizes, n, expected", [
    ([5, 5, 5, 5], 2, [[5, 5], [5, 5]]),
    ([5, 5, 5, 5], 3, [[5, 5], [5], [5]]),
    ([1, 1, 8, 1, 1], 2, [[1, 1, 8], [1, 1]]),
    ([3], 4, [[3]]),
    ([], 4, []),
    ([5, 5, 0], 2, [[5], [5, 0]]),  # an empty read at the end makes no extra run
])
def test_runs_cut_the_reads_in_order_into_at_most_n_runs_of_about_equal_bytes(sizes, n, expected):
    reads = [argparse.Namespace(nbytes=size) for size in sizes]
    runs = in_order_runs(reads, lambda r: r.nbytes, share(sum(sizes), n), n)
    assert [[r.nbytes for r in run] for run in runs] == expected
    assert [r for run in runs for r in run] == reads


def test_tied_import_fills_the_head_with_the_embedding(tmp_path):
    hf = hf_model(tie=True)
    hf.save_pretrained(str(tmp_path))
    model = our_model(tie=True, seed=1)
    load_hf(model.state_dict(), str(tmp_path), hf_adapter(model.args))
    assert model.output.weight is model.tok_embeddings.weight
    assert (logits_of(model) - logits_of(hf)).abs().max() < 1e-5


@pytest.fixture
def no_data_reads(monkeypatch):
    """Any read of tensor bytes fails the test."""
    def no_reads(*a, **k):
        raise AssertionError("tensor data was read")

    monkeypatch.setattr(shards, "read_exact", no_reads)


@pytest.mark.parametrize("args, unknown, missing", [
    (replace(ARGS, n_layers=3), [], [f"model.layers.2.{n}" for n in (
        "input_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "post_attention_layernorm.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_proj.weight", "self_attn.v_proj.weight")]),
    (replace(ARGS, tie_embeddings=True), ["lm_head.weight"], []),
])
def test_wrong_pairing_fails_before_reading_data(hf_checkpoint, no_data_reads, args, unknown, missing):
    with pytest.raises(AdapterMismatchError) as e:
        load_hf(Transformer(args).state_dict(), hf_checkpoint[0], hf_adapter(args))
    assert (e.value.unknown, e.value.missing) == (unknown, missing)


def test_another_formats_file_is_ignored_and_a_model_file_outside_the_index_refused(tmp_path, caplog):
    """A Mistral repo ships `consolidated.safetensors` (Mistral's own format) beside the HF
    files: `transformers` ignores it, and so do an import and an export into the folder. A model
    file the index does not list is an older copy of the checkpoint: refused."""
    mistral = {"tok_embeddings.weight": torch.arange(6.0).reshape(2, 3)}
    save_file(mistral, str(tmp_path / "consolidated.safetensors"))
    save_file(mistral, str(tmp_path / "model-00002-of-00002.safetensors"))  # an earlier export's
    model = our_model()
    save_hf(model.state_dict(), str(tmp_path), hf_adapter(ARGS))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "consolidated.safetensors",
                                            "model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert_same(load_file(str(tmp_path / "consolidated.safetensors")), mistral)
    back = our_model(seed=1)
    with caplog.at_level(logging.INFO, logger="torchtitan_ckpt.hf.load"):
        load_hf(back.state_dict(), str(tmp_path), hf_adapter(ARGS))
    assert_same(back.state_dict(), model.state_dict())
    assert [m for m in caplog.messages if "ignoring" in m] == [f"{tmp_path}: ignoring ['consolidated.safetensors'], which model.safetensors.index.json "
                               "does not list (not the model files of a Hugging Face export)"]
    for stale in ("model.safetensors", "model-00002-of-00002.safetensors"):
        shutil.copyfile(tmp_path / "model-00001-of-00001.safetensors", tmp_path / stale)
        with pytest.raises(CheckpointError, match=re.escape(
                f"{tmp_path} holds ['{stale}'] besides the checkpoint that model.safetensors.index.json "
                "describes; move them away")):
            load_hf(our_model(seed=1).state_dict(), str(tmp_path), hf_adapter(ARGS))
        os.remove(tmp_path / stale)


def test_llama2_rope_buffers_are_ignored_on_import_and_in_the_assets_file_split(hf_checkpoint, tmp_path, caplog):
    """Llama-2-era folders hold `model.layers.N.self_attn.rotary_emb.inv_freq`, buffers that
    `transformers` recomputes from the config and ignores on load."""
    src, expected = hf_checkpoint
    folder = tmp_path / "llama2"
    shutil.copytree(src, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = index["weight_map"]["model.layers.0.self_attn.q_proj.weight"]
    buffers = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": 1 / 10000 ** (torch.arange(0, 16, 2) / 16)
               for i in range(ARGS.n_layers)}
    save_file({**load_file(str(folder / first)), **buffers}, str(folder / first), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(buffers, first))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    model = our_model(seed=1)
    with caplog.at_level(logging.INFO, logger="torchtitan_ckpt.hf.load"):
        load_hf(model.state_dict(), str(folder), hf_adapter(ARGS))
    assert (logits_of(model) - expected).abs().max() < 1e-5
    assert [m for m in caplog.messages if "ignoring" in m] == [f"{folder}: ignoring 2 tensors like model.layers.0.self_attn.rotary_emb.inv_freq, "
                               "buffers that transformers recomputes from the config"]
    # an export with these assets follows their file split, without the buffers
    save_hf(model.state_dict(), str(tmp_path / "out"), hf_adapter(ARGS, hf_assets_path=str(folder)))
    before, after = tensors_by_file(src), tensors_by_file(str(tmp_path / "out"))
    assert sorted(before) == sorted(after)
    for file in before:
        assert_same(before[file], after[file])


def test_an_export_leaves_out_the_names_of_the_assets_file_split_the_model_does_not_have(hf_checkpoint, tmp_path,
                                                                                          caplog):
    """The index of a Hub folder used as assets may list tensors the model does not export: an
    FP8 checkpoint's `weight_scale_inv` beside each weight, DeepSeek-V3's MTP layer (numbered
    past the last layer) in a file of its own. The export follows the split for the model's
    tensors; a file only the others fill is not written."""
    src, expected = hf_checkpoint
    assets = tmp_path / "assets"
    assets.mkdir()
    shutil.copyfile(os.path.join(src, "config.json"), assets / "config.json")
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    count = len(set(weight_map.values()))
    extra = {name.removesuffix("weight") + "weight_scale_inv": file for name, file in weight_map.items()
             if name.endswith("_proj.weight")}
    extra.update(dict.fromkeys([f"model.layers.{ARGS.n_layers}.eh_proj.weight",
                                f"model.layers.{ARGS.n_layers}.self_attn.q_proj.weight"],
                               f"model-{count + 1:05d}-of-{count + 1:05d}.safetensors"))
    (assets / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {**weight_map, **extra}}))
    model = our_model(seed=1)
    load_hf(model.state_dict(), src, hf_adapter(ARGS))
    with caplog.at_level(logging.INFO, logger="torchtitan_ckpt.hf.save"):
        save_hf(model.state_dict(), str(tmp_path / "out"), hf_adapter(ARGS, hf_assets_path=str(assets)))
    assert (f"{assets}/model.safetensors.index.json: leaving {len(extra)} tensors of the file split out of the "
            "export, which the model does not have, such as model.layers.0.mlp.down_proj.weight_scale_inv, "
            "model.layers.0.mlp.gate_proj.weight_scale_inv, model.layers.0.mlp.up_proj.weight_scale_inv") \
        in caplog.messages
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        assert json.load(f)["weight_map"] == weight_map
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert (logits_of(hf) - expected).abs().max() < 1e-5

    # a tensor the model exports and the split lacks is refused, before the folder is touched
    del weight_map["model.norm.weight"]
    (assets / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(AdapterMismatchError, match=re.escape(
            f"{assets}/model.safetensors.index.json, the file split of the adapter's hf_assets_path, lacks tensors "
            "the model exports (missing): 0 unknown name(s) [] and 1 missing name(s) ['model.norm.weight']")):
        save_hf(model.state_dict(), str(tmp_path / "other"), hf_adapter(ARGS, hf_assets_path=str(assets)))
    assert not os.path.exists(tmp_path / "other")


def test_wrong_shapes_fail_naming_them(hf_checkpoint, no_data_reads):
    args = replace(ARGS, vocab_size=300)
    with pytest.raises(AdapterMismatchError) as e:
        load_hf(Transformer(args).state_dict(), hf_checkpoint[0], hf_adapter(args))
    assert e.value.unknown == ["lm_head.weight [256, 64]", "model.embed_tokens.weight [256, 64]"]
    assert e.value.missing == ["lm_head.weight [300, 64]", "model.embed_tokens.weight [300, 64]"]


def test_a_row_order_that_does_not_tile_the_rows_fails_before_reading_data(hf_checkpoint, no_data_reads):
    class Fives(LlamaAdapter):  # a broken adapter: blocks of 5 rows in wq's 64
        def hf_sources(self, names):
            sources = super().hf_sources(names)
            sources["layers.0.attention.wq.weight"] = HFSource("model.layers.0.self_attn.q_proj.weight", (1, 0, 2, 3, 4))
            return sources

    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.q_proj.weight: \(64, 64\) is not made "
                                              r"of whole blocks of 5 rows, which the adapter reorders"):
        load_hf(our_model(seed=1).state_dict(), hf_checkpoint[0], Fives(HFModelConfig.parse(hf_config(ARGS))))


def test_a_truncated_file_fails_naming_it_before_reading_data(hf_checkpoint, tmp_path, no_data_reads):
    folder = shutil.copytree(hf_checkpoint[0], tmp_path / "hf")
    last = sorted(glob.glob(str(folder / "*.safetensors")))[-1]
    os.truncate(last, os.path.getsize(last) - 100)
    with pytest.raises(CorruptCheckpointError, match=rf"{re.escape(last)} is not a readable safetensors "
                                                     r"file: .*the tensors end at byte \d+ of a data section of "
                                                     r"\d+: the file is truncated"):
        load_hf(our_model(seed=1).state_dict(), str(folder), hf_adapter(ARGS))


def test_a_wrong_dtype_fails_naming_the_file_before_reading_data(hf_checkpoint, tmp_path, no_data_reads):
    folder = shutil.copytree(hf_checkpoint[0], tmp_path / "hf")
    name = "model.layers.1.self_attn.q_proj.weight"
    with open(folder / "model.safetensors.index.json") as f:
        file = json.load(f)["weight_map"][name]
    tensors = load_file(folder / file)
    save_file({**tensors, name: tensors[name].to(torch.int32)}, folder / file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}: torch.int32 in {file}, torch.float32 expected "
                                              r"\(floating-point dtypes are cast; others only into a dtype that "
                                              r"holds each of their values\)"):
        load_hf(our_model(seed=1).state_dict(), str(folder), hf_adapter(ARGS))


def test_an_unknown_dtype_fails_naming_the_file_before_reading_data(hf_checkpoint, tmp_path, no_data_reads):
    folder = shutil.copytree(hf_checkpoint[0], tmp_path / "hf")
    first = sorted(glob.glob(str(folder / "*.safetensors")))[0]
    with open(first, "r+b") as f:
        data = f.read(1 << 16)
        f.seek(data.index(b'"F32"'))
        f.write(b'"Q32"')  # same length: the header stays well-formed
    with pytest.raises(CorruptCheckpointError, match=rf"{re.escape(first)} is not a readable safetensors "
                                                     r"file: .*dtype 'Q32' is not one of \['BF16', "):
        load_hf(our_model(seed=1).state_dict(), str(folder), hf_adapter(ARGS))


def test_a_model_safetensors_holding_no_tensor_is_said_to(tmp_path):
    """It was called a stray model file beside itself ("holds ['model.safetensors'] besides the
    checkpoint that model.safetensors describes; move them away")."""
    save_file({}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CorruptCheckpointError, match=rf"^{re.escape(str(tmp_path / 'model.safetensors'))} holds no "
                                                     r"tensor: no model to read$"):
        load_hf(our_model(seed=1).state_dict(), str(tmp_path), hf_adapter(ARGS))


def test_a_file_cut_after_its_header_was_read_fails_naming_it(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"x" * 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptCheckpointError, match=rf"{re.escape(str(path))} ends at byte 10, inside "
                                                         r"the 8 bytes from byte 4 .*: the file is truncated"):
            read_exact(fd, [memoryview(bytearray(8))], 4, str(path))
        with pytest.raises(CorruptCheckpointError, match=r"ends at byte 10, inside the 12 bytes from byte 0 "):
            read_exact(fd, [memoryview(bytearray(4)) for _ in range(3)], 0, str(path))
    finally:
        os.close(fd)


def test_read_exact_fills_more_buffers_than_one_preadv_takes_in_file_order(tmp_path):
    path = tmp_path / "data"
    data = bytes(range(256)) * 40  # 10240 bytes: 3413 buffers of 3, then one of 1, with the empty ones
    path.write_bytes(data)
    bufs = [memoryview(bytearray(3)) for _ in range(3413)] + [memoryview(bytearray(0)), memoryview(bytearray(1))]
    fd = os.open(path, os.O_RDONLY)
    try:
        read_exact(fd, bufs, 0, str(path))
    finally:
        os.close(fd)
    assert b"".join(bytes(b) for b in bufs) == data


@pytest.mark.parametrize("shape, offsets", [
    ("[Infinity]", "[0, 16]"), ("[-Infinity]", "[0, 16]"), ("[NaN]", "[0, 16]"), ("[4.0]", "[0, 16]"),
    ("[true, 4]", "[0, 16]"), ("[-4]", "[0, 16]"), ('"4"', "[0, 16]"), ("{}", "[0, 16]"),
    ("[4]", "[0, Infinity]"), ("[4]", "[NaN, 16]"), ("[4]", "[0, 1e999]"), ("[4]", "[0.0, 16]"),
    ("[4]", "[false, 16]"), ("[4]", "[0, 16, 16]"), ("[4]", "[0]"), ("[4]", '"0-16"'),
    ("[" + "1, " * 64 + "4]", "[0, 16]"),  # 65 dimensions: no tensor has as many
])
def test_a_header_with_a_shape_or_offset_that_is_not_an_integer_is_refused_naming_the_tensor(tmp_path, shape, offsets):
    """Python's `json` reads Infinity, NaN and 1e999 as floats: each refused as our error (the
    first two as not JSON), as are floats and booleans that `int()` would take, and a shape of
    more dimensions than any tensor's (3 million of them passed, and made a 9 MB error message)."""
    header = f'{{"w": {{"dtype": "F32", "shape": {shape}, "data_offsets": {offsets}}}}}'.encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(CorruptCheckpointError, match=rf"{re.escape(str(path))} is not a readable safetensors "
                                                     r"file: .*([\'\"]w: (shape|data_offsets) .* is not a|the header "
                                                     r"holds -?(Infinity|NaN), which is not JSON)"):
        read_header(str(path))


F32 = '{"dtype": "F32", "shape": [2], "data_offsets": [%d, %d]}'


def test_a_header_longer_than_its_file_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b'{"w": 1}')
    with pytest.raises(CorruptCheckpointError, match=r"header length 1000 exceeds the file \(16 bytes\)"):
        read_header(str(path))


@pytest.mark.parametrize("header, data, problem", [
    ('{"w": %s, "w": %s}' % (F32 % (0, 8), F32 % (8, 16)), 16, "the header names w twice"),
    ('{"w": %s}' % (F32 % (8, 16)), 16, r"w: data_offsets \[8, 16\] leave \[0, 8\) to no tensor"),
    ('{"w": %s}' % (F32 % (0, 8)), 16, r"the tensors end at byte 8 of a data section of 16: the bytes after "
                                      r"them belong to no tensor"),
    ('{"a": %s, "b": %s}' % (F32 % (0, 8), F32 % (4, 12)), 12, r"b: data_offsets \[4, 12\] overlap a's"),
    ('{"w": %s}' % (F32 % (0, 8)), 4, r"the tensors end at byte 8 of a data section of 4: the file is truncated"),
    ('{"__metadata__": [1, 2], "w": %s}' % (F32 % (0, 8)), 8, r"__metadata__ \[1, 2\] is not an object of strings"),
    ('{"__metadata__": {"format": 1}, "w": %s}' % (F32 % (0, 8)), 8, r"__metadata__ \{'format': 1\} is not an"),
    ('{"w": {"dtype": "F32", "shape": [2], "shape": [2], "data_offsets": [0, 8]}}', 8, "names shape twice"),
    ("utf-16", 8, r"the header is not UTF-8 \(byte 0: invalid start byte\)"),
    ('{"w": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}', 8, r"w: dtype \['F32'\] is not one of"),
    ('{"w": {"shape": [2], "data_offsets": [0, 8]}}', 8, r"w: \{.*\} is not an object with dtype, shape and data_"),
    ('{"w": 3}', 8, r"w: 3 is not an object with dtype, shape and data_offsets"),  # a KeyError or TypeError
])
def test_a_header_the_safetensors_library_refuses_is_refused_naming_the_file(tmp_path, header, data, problem):
    """What the `safetensors` library refuses (a header not in UTF-8, tensors that do not tile
    the data section exactly, metadata that is not strings, a field given twice) is refused,
    naming the file and what is wrong."""
    from safetensors import SafetensorError, safe_open

    text = '{"w": %s}' % (F32 % (0, 8)) if header == "utf-16" else header
    raw = text.encode("utf-16" if header == "utf-16" else "utf-8")
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))
    with pytest.raises(CorruptCheckpointError, match=rf"^{re.escape(str(path))} is not a readable safetensors "
                                                     rf"file: .*{problem}"):
        read_header(str(path))
    with pytest.raises(SafetensorError):
        safe_open(str(path), "pt")


def test_a_tensor_named_twice_is_refused_even_where_the_library_reads_the_last_entry(tmp_path):
    """The one header the `safetensors` library reads and this reader refuses: the library,
    like `json`, keeps the last of two entries of a name; a reader that kept the first would
    read another tensor from the same file."""
    from safetensors import safe_open

    text = ('{"w": %s, "w": %s}' % (F32 % (0, 8), F32 % (0, 8))).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(8))
    with safe_open(str(path), "pt") as f:
        assert list(f.keys()) == ["w"]
    with pytest.raises(CorruptCheckpointError, match=r"the header names w twice"):
        read_header(str(path))


@pytest.mark.parametrize("header, data", [
    ('  {"w": %s}  ' % (F32 % (0, 8)), 8),  # white space around the object
    ('{"__metadata__": null, "w": %s}' % (F32 % (0, 8)), 8),
    ('{"b": %s, "a": %s}' % (F32 % (8, 16), F32 % (0, 8)), 16),  # entries out of offset order
    ('{"w": %s, "z": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}, '
     '"y": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}' % (F32 % (0, 8)), 8),  # empty tensors
    ('{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "extra": 1}}', 8),
    ("{}", 0),
])
def test_a_header_the_safetensors_library_reads_is_read(tmp_path, header, data):
    from safetensors import safe_open

    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(data))
    with safe_open(str(path), "pt") as f:
        names = sorted(f.keys())
    assert sorted(read_header(str(path))) == names


def test_a_crafted_tensor_name_of_megabytes_is_not_copied_into_the_message(tmp_path):
    name = "x" * (1 << 20)
    path = tmp_path / "model.safetensors"
    for entry in ({"dtype": "F32", "shape": [4], "data_offsets": [0, 8]},  # fewer bytes than its shape's
                  {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}):  # a hole before it
        text = json.dumps({name: entry}).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(16))
        with pytest.raises(CorruptCheckpointError, match=rf"^{re.escape(str(path))} is not a readable") as e:
            read_header(str(path))
        assert "x" * 200 in str(e.value) and len(str(e.value)) < 600


# ---------------------------------------------------------------------------- convert

def _convert(*argv: str) -> int:
    return cli.main(["convert", *argv])


def _assets(folder, args) -> str:
    """An HF assets folder holding only the `config.json` of `args`."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config(args)))
    return str(folder)


def test_convert_dcp_to_hf_and_back(tmp_path):
    state = our_model().state_dict()
    dcp.save(state, checkpoint_id=str(tmp_path / "step-5"))
    assets = _assets(tmp_path / "assets", ARGS)
    assert _convert("--to", "hf", str(tmp_path / "step-5"), str(tmp_path / "hf"), "--hf-assets", assets,
                    "--max-shard-size", "100KB") == 0
    assert len(glob.glob(str(tmp_path / "hf" / "*.safetensors"))) == 4
    assert _convert("--to", "dcp", str(tmp_path / "hf"), str(tmp_path / "back")) == 0
    assert_same(read_checkpoint(str(tmp_path / "back")), state)
    # the step records its HF config: back to HF with no --hf-assets, the same files
    assert _convert("--to", "hf", str(tmp_path / "back"), str(tmp_path / "again"), "--max-shard-size", "100KB") == 0
    assert tensors_by_file(str(tmp_path / "again")).keys() == tensors_by_file(str(tmp_path / "hf")).keys()
    for file, tensors in tensors_by_file(str(tmp_path / "again")).items():
        assert_same(tensors, tensors_by_file(str(tmp_path / "hf"))[file])


def test_convert_reads_a_step_of_torchtitan_0_3_by_its_names(tmp_path):
    """TorchTitan 0.3 renamed the q, k and v projections (`attention.qkv_linear.wq`) and the head
    (`lm_head`): `convert --to hf` of its step was refused; it writes the files of the same
    model saved under TorchTitan 0.2's names."""
    state = our_model(seed=3).state_dict()
    titan_03 = {k.replace(".attention.w", ".attention.qkv_linear.w").replace("qkv_linear.wo.", "wo.")
                .replace("output.", "lm_head."): v for k, v in state.items()}
    assert "layers.0.attention.qkv_linear.wv.weight" in titan_03 and "lm_head.weight" in titan_03
    dcp.save(state, checkpoint_id=str(tmp_path / "v02"))
    dcp.save(titan_03, checkpoint_id=str(tmp_path / "v03"))
    assets = _assets(tmp_path / "assets", ARGS)
    for name in ("v02", "v03"):
        assert _convert("--to", "hf", str(tmp_path / name), str(tmp_path / f"hf-{name}"), "--hf-assets", assets) == 0
    assert_same(load_file(str(tmp_path / "hf-v03" / "model-00001-of-00001.safetensors")),
                load_file(str(tmp_path / "hf-v02" / "model-00001-of-00001.safetensors")))


def test_convert_reports_a_config_that_is_not_the_checkpoints(tmp_path, capsys):
    dcp.save(our_model().state_dict(), checkpoint_id=str(tmp_path / "step-5"))
    small = _assets(tmp_path / "small", FLAVORS["small"])
    assert _convert("--to", "hf", str(tmp_path / "step-5"), str(tmp_path / "hf"), "--hf-assets", small) == 2
    err = capsys.readouterr().err
    assert "tensors in the checkpoint (unknown) vs the HF config's (missing)" in err
    assert "'layers.2.attention.wq.weight [256, 256]'" in err and "'tok_embeddings.weight [256, 64]'" in err
    assert _convert("--to", "hf", str(tmp_path / "step-5"), str(tmp_path / "hf")) == 2
    assert "step-5 records no HF config (hf_config.json); pass --hf-assets" in capsys.readouterr().err
    # the step's names the adapter does not know are named: before, "0 unknown name(s) []"
    renamed = {k.replace(".wk.", ".key.").replace("output.", "head."): v for k, v in our_model().state_dict().items()}
    dcp.save(renamed, checkpoint_id=str(tmp_path / "step-6"))
    full = _assets(tmp_path / "full", ARGS)
    assert _convert("--to", "hf", str(tmp_path / "step-6"), str(tmp_path / "hf"), "--hf-assets", full) == 2
    err = capsys.readouterr().err
    assert f"'layers.1.attention.key.weight {list(renamed['layers.1.attention.key.weight'].shape)}'" in err
    assert f"'head.weight [{ARGS.vocab_size}, {ARGS.dim}]'" in err and "'output.weight" in err
    # a step of ours: the tensors of a state of the job's own (an EMA) are not the model's
    from tests.helpers import TensorState
    from torchtitan_ckpt import Checkpoint, CheckpointManager

    with CheckpointManager(Checkpoint(enable=True, interval=1), our_model(), base_folder=str(tmp_path / "run"),
                           states={"ema": TensorState(torch.ones(3))}) as manager:
        manager.save(1)
    assert _convert("--to", "hf", str(tmp_path / "run" / "checkpoint" / "step-1"), str(tmp_path / "hf"),
                    "--hf-assets", small) == 2
    err = capsys.readouterr().err
    assert "'tok_embeddings.weight [256, 64]'" in err and "ema." not in err
    assert _convert("--to", "hf", str(tmp_path / "nothing"), str(tmp_path / "hf"), "--hf-assets", small) == 2
    assert f"{tmp_path / 'nothing'} does not exist" in capsys.readouterr().err
    (tmp_path / "nothing").mkdir()
    assert _convert("--to", "hf", str(tmp_path / "nothing"), str(tmp_path / "hf"), "--hf-assets", small) == 2
    assert "nothing is not a DCP checkpoint folder (no .metadata)" in capsys.readouterr().err


def test_export_of_a_model_without_tensors_names_the_folder(tmp_path):
    """An adapter of whole tensors (TorchTitan's) that maps nothing: our error, before any file."""
    from torchtitan_ckpt.hf.adapter import ForeignAdapter

    class NoTensors:
        def to_hf(self, state_dict):
            return {}

        def from_hf(self, hf_state_dict):
            return {}

    with pytest.raises(CheckpointError, match=r"exporting to .*out: the model has no tensors"):
        save_hf({}, str(tmp_path / "out"), ForeignAdapter(NoTensors()))
    assert not (tmp_path / "out").exists()


class _Renamed:
    """An adapter of whole tensors, as TorchTitan's are: our names with an `hf.` prefix."""

    def __init__(self, hf_assets_path: str):
        self.hf_assets_path = hf_assets_path

    def to_hf(self, state_dict):
        return {"hf." + k: v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict):
        return {k.removeprefix("hf."): v for k, v in hf_state_dict.items()}


def test_an_adapter_of_whole_tensors_reads_by_position_and_a_file_cut_short_is_an_error(tmp_path, monkeypatch):
    """The folder is read through our own reader, not safetensors' loader: a file cut short
    after its header was checked raises our error naming it and the bytes missing."""
    from torchtitan_ckpt.hf import load as hf_load
    from torchtitan_ckpt.hf.adapter import ForeignAdapter

    saved = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5, dtype=torch.int64),
             "c": torch.tensor(7.0, dtype=torch.bfloat16)}
    adapter = ForeignAdapter(_Renamed(os.path.dirname(_config_file(tmp_path / "assets", "{}"))))
    save_hf(saved, str(tmp_path / "hf"), adapter)
    back = {k: torch.zeros_like(v) for k, v in saved.items()}
    load_hf(back, str(tmp_path / "hf"), adapter)
    assert_same(back, saved)

    checked = hf_load.read_hf_layout
    def then_cut(hf_dir):
        layout = checked(hf_dir)
        path = layout["hf.a"].path
        os.truncate(path, os.path.getsize(path) - 8)
        return layout
    monkeypatch.setattr(hf_load, "read_hf_layout", then_cut)
    with pytest.raises(CorruptCheckpointError, match=r"hf/model-00001-of-00001.safetensors ends at byte 298, inside "
                                                     r"the 48 bytes from byte 256 that its header describes: the "
                                                     r"file is truncated"):
        load_hf({k: torch.zeros_like(v) for k, v in saved.items()}, str(tmp_path / "hf"), adapter)


class _Dequantizing(_Renamed):
    """`_Renamed` that dequantizes an FP8 checkpoint's tensors with their block scales, as a
    TorchTitan adapter for DeepSeek-V3 does (one scale per tensor here)."""

    def from_hf(self, hf_state_dict):
        scales = {k.removesuffix("_scale_inv"): v for k, v in hf_state_dict.items() if k.endswith("_scale_inv")}
        return super().from_hf({k: v.to(torch.float32) * scales[k] if k in scales else v
                                for k, v in hf_state_dict.items() if not k.endswith("_scale_inv")})


def test_an_fp8_checkpoint_reaches_from_hf_with_its_scales_and_undequantized_is_refused(tmp_path):
    """Weights stored in FP8 beside their `_scale_inv` (every DeepSeek-V3 on the Hub): the
    scales of each tensor read are read with it, for an adapter that dequantizes; one that does
    not gives back FP8 values that a cast would make silently wrong (2.0 for 6.0): refused
    before anything is written. The folder's other tensors stay unread."""
    true = torch.full((4, 4), 6.0)
    scale = torch.tensor(3.0)
    (tmp_path / "fp8").mkdir()
    save_file({"hf.w": (true / scale).to(torch.float8_e4m3fn), "hf.w_scale_inv": scale,
               "hf.mtp.w": torch.ones(2), "hf.b": torch.arange(3.0)}, str(tmp_path / "fp8" / "model.safetensors"))
    state = {"w": torch.zeros(4, 4), "b": torch.zeros(3)}
    load_hf(state, str(tmp_path / "fp8"), _Dequantizing(str(tmp_path / "fp8")))
    assert_same(state, {"w": true, "b": torch.arange(3.0)})

    untouched = {"w": torch.zeros(4, 4), "b": torch.zeros(3)}
    with pytest.raises(CheckpointError, match=r"fp8 stores w in FP8 and the adapter's from_hf gives them back "
                                              r"undequantized"):
        load_hf(untouched, str(tmp_path / "fp8"), _Renamed(str(tmp_path / "fp8")))
    assert_same(untouched, {"w": torch.zeros(4, 4), "b": torch.zeros(3)})


def _config_file(folder, text: str) -> str:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(text)
    return str(folder / "config.json")


def test_a_model_config_is_read_from_a_regular_file_of_its_folder(tmp_path):
    """A FIFO is refused, not waited on; a link out of the folder is not followed; a file over
    MAX_CONFIG_BYTES is not read whole: each our error naming the file."""
    good = json.dumps(hf_config(ARGS))
    assert read_hf_config(_config_file(tmp_path / "ok", good)).hidden_size == ARGS.dim
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / "config.json").symlink_to(tmp_path / "ok" / "config.json")
    with pytest.raises(CorruptCheckpointError, match=r"link/config.json: the model config is a link to .*ok/"
                                                     r"config.json, outside the checkpoint folder"):
        read_hf_config(str(tmp_path / "link" / "config.json"))
    big = _config_file(tmp_path / "big", good + " " * MAX_CONFIG_BYTES)
    with pytest.raises(CorruptCheckpointError, match=rf"{re.escape(big)}: the model config is larger than "
                                                     rf"{MAX_CONFIG_BYTES} bytes"):
        read_hf_config(big)
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(CorruptCheckpointError, match=rf"{re.escape(str(tmp_path))}/config.json: the model config "
                                                     r"is not a regular file"):
        read_hf_config(str(tmp_path / "config.json"))


def test_save_and_load_take_a_torchtitan_adapter_as_it_is(tmp_path):
    """An adapter with TorchTitan's surface (`to_hf(sd)`, `from_hf(sd)`, `hf_assets_path`),
    not wrapped by the caller: the export copies its assets' config.json."""
    assets = os.path.dirname(_config_file(tmp_path / "assets", '{"model_type": "tiny"}'))
    saved = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.arange(4, dtype=torch.int64)}
    save_hf(saved, str(tmp_path / "hf"), _Renamed(assets), dtype=torch.bfloat16)
    assert_same(load_file(str(tmp_path / "hf" / "model-00001-of-00001.safetensors")),
                {"hf.a": saved["a"].bfloat16(), "hf.b": saved["b"]})
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f) == {"model_type": "tiny", "torch_dtype": "bfloat16"}
    back = {k: torch.zeros_like(v) for k, v in saved.items()}
    load_hf(back, str(tmp_path / "hf"), _Renamed(assets))
    assert_same(back, saved)


@pytest.mark.parametrize("mode", ["one_pass", "rank0"])
@pytest.mark.parametrize("how", ["meta", "sparse"])
def test_an_export_of_a_tensor_without_memory_leaves_the_earlier_export_as_it_was(tmp_path, mode, how):
    """A state dict holding a meta tensor (or a sparse one) failed inside the copy (torch's
    NotImplementedError, naming no tensor) after the earlier export in the folder was cleared."""
    out = tmp_path / "out"
    save_hf(our_model().state_dict(), str(out), hf_adapter(ARGS), mode=mode)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    state = our_model().state_dict()
    state["norm.weight"] = torch.empty(ARGS.dim, device="meta") if how == "meta" else state["norm.weight"].to_sparse()
    problem = "have no memory yet" if how == "meta" else "are not dense tensors"
    with pytest.raises(CheckpointError, match=rf"^save_hf: .*{problem}") as raised:
        save_hf(state, str(out), hf_adapter(ARGS), mode=mode)
    assert "['norm.weight']" in str(raised.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_export_takes_a_view_that_repeats_an_element(tmp_path):
    """What no in-place load could fill (an `expand()` view) is still values to export."""
    state = our_model().state_dict()
    state["norm.weight"] = torch.full((1,), 0.5).expand(ARGS.dim)
    save_hf(state, str(tmp_path), hf_adapter(ARGS))
    assert torch.equal(load_file(str(tmp_path / "model-00001-of-00001.safetensors"))["model.norm.weight"],
                       torch.full((ARGS.dim,), 0.5))


def test_a_load_into_tensors_without_memory_is_refused(tmp_path):
    """load_hf into a model built on the meta device read nothing and returned as if it had."""
    save_hf(our_model().state_dict(), str(tmp_path), hf_adapter(ARGS))
    with torch.device("meta"):
        model = Transformer(ARGS)
    with pytest.raises(CheckpointError, match=r"load_hf: \d+ of the state dict's tensors have no memory yet"):
        load_hf(model.state_dict(), str(tmp_path), hf_adapter(ARGS))


@pytest.mark.parametrize("call", [save_hf, load_hf])
def test_the_hf_calls_name_an_argument_of_the_wrong_kind(tmp_path, call):
    """A module for its state dict, a value that is no tensor, no adapter, a thread count as text:
    each named, where each failed deep inside (an AttributeError or a TypeError naming nothing)."""
    name, model, adapter = call.__name__, our_model(), hf_adapter(ARGS)
    save_hf(model.state_dict(), str(tmp_path / "in"), adapter)
    where = str(tmp_path / ("out" if call is save_hf else "in"))
    with pytest.raises(TypeError, match=rf"^{name} takes a state dict of tensors \(model.state_dict\(\)\), not a "
                                        r"Transformer$"):
        call(model, where, adapter)
    with pytest.raises(TypeError, match=rf"^{name}: the state dict holds values that are not tensors, e.g. "
                                        r"\['step \(int\)'\]"):
        call({**model.state_dict(), "step": 3}, where, adapter)
    with pytest.raises(TypeError, match=rf"^{name} needs the model's state-dict adapter"):
        call(model.state_dict(), where, None)
    for threads in ("4", 0):
        with pytest.raises(ValueError, match=rf"^{name}: num_threads = {threads!r}; expected an integer of 1 or more"):
            call(model.state_dict(), where, adapter, num_threads=threads)
    assert not os.path.exists(tmp_path / "out")


def test_assets_without_a_model_type_export_through_the_adapter_named_for_them(tmp_path):
    """A `config.json` without `model_type`, its adapter named: the export copies the config
    with the adapter's `model_type` (which `transformers` needs); it was refused for lacking it."""
    from torchtitan_ckpt.hf import adapter_for_hf_dir

    untyped = {k: v for k, v in hf_config(ARGS).items() if k != "model_type"}
    assets = os.path.dirname(_config_file(tmp_path / "assets", json.dumps(untyped)))
    adapter = adapter_for_hf_dir(assets, adapter="llama")
    model = our_model()
    save_hf(model.state_dict(), str(tmp_path / "out"), adapter)
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["model_type"] == "llama"
    back = our_model(seed=1)
    load_hf(back.state_dict(), str(tmp_path / "out"), adapter)
    assert_same(back.state_dict(), model.state_dict())


@pytest.mark.parametrize("text, why", [("[1, 2]", r"a config.json must hold a JSON object"),
                                       ('{"model_type": ', r"cannot read the model config .*config.json: ")])
def test_a_torchtitan_adapters_assets_config_that_is_no_json_object_is_refused_naming_it(tmp_path, text, why):
    """The export copies the assets' config.json: one that is not a JSON object is our error
    naming the file, before anything is written."""
    assets = os.path.dirname(_config_file(tmp_path / "assets", text))
    with pytest.raises(CheckpointError) as raised:
        save_hf({"a": torch.ones(2)}, str(tmp_path / "hf"), _Renamed(assets))
    assert f"{assets}/config.json" in str(raised.value) and re.search(why, str(raised.value))
    assert not (tmp_path / "hf").exists()


_MANY_FILES = """
import os, resource, sys
import torch
from torchtitan_ckpt.example.model import Transformer, args_from_hf_config, hf_adapter
from torchtitan_ckpt.hf import load_hf, save_hf

out, mode = sys.argv[1], sys.argv[2]
args = args_from_hf_config({"model_type": "llama", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 150,
                            "num_attention_heads": 2, "vocab_size": 16})
torch.manual_seed(0)
model = Transformer(args)
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
save_hf(model.state_dict(), out, hf_adapter(args), max_shard_size=1, mode=mode)
back = Transformer(args)
load_hf(back.state_dict(), out, hf_adapter(args))
assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
print(len([f for f in os.listdir(out) if f.endswith(".safetensors")]))
"""


@pytest.mark.parametrize("mode", ["one_pass", "all_ranks"])
def test_an_export_of_more_files_than_the_open_file_limit_is_written(tmp_path, mode):
    """Each copying thread held every file it wrote open to the end: 1102 files failed an export
    under the common limit of 1024 descriptors (`OSError: Too many open files`)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _MANY_FILES, str(tmp_path / "out"), mode], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == 152


def test_float8_fnuz_files_are_read_and_written(tmp_path):
    """The `safetensors` library writes and reads F8_E4M3FNUZ and F8_E5M2FNUZ: an import refused
    such a file as unreadable, and an export said safetensors could not hold them."""
    sd = {k: v.detach() for k, v in Transformer(ARGS).state_dict().items()}
    adapter = hf_adapter(ARGS)
    for dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        out = tmp_path / str(dtype)
        save_hf({k: v.to(dtype) for k, v in sd.items()}, str(out), adapter)
        written = load_file(str(out / "model-00001-of-00001.safetensors"))
        assert {v.dtype for v in written.values()} == {dtype}
        back = {k: torch.zeros_like(v, dtype=dtype) for k, v in sd.items()}
        load_hf(back, str(out), adapter)
        for k, v in sd.items():
            assert torch.equal(back[k].view(torch.uint8), v.to(dtype).view(torch.uint8)), k


def test_a_model_file_named_in_place_of_its_folder_is_refused_naming_the_folder_to_give(tmp_path):
    from torchtitan_ckpt.errors import CheckpointNotFoundError
    from torchtitan_ckpt.hf.adapter import ForeignAdapter
    from torchtitan_ckpt.hf.load import read_hf_layout

    save_hf({"a": torch.ones(2)}, str(tmp_path / "hf"), ForeignAdapter(_Renamed(os.path.dirname(
        _config_file(tmp_path / "assets", "{}")))))
    file = str(tmp_path / "hf" / "model.safetensors.index.json")
    with pytest.raises(CheckpointNotFoundError, match=rf"^{file} is a file: name the folder that holds it"):
        read_hf_layout(file)
    with pytest.raises(CheckpointNotFoundError, match=r"empty has neither model.safetensors.index.json nor "):
        read_hf_layout(str(tmp_path / "empty"))
