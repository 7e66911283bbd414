"""Real model families from `transformers`-made checkpoints: a Llama 3.1-shaped Llama (llama3 RoPE
scaling, its own FFN width, head_dim != hidden / heads), a Qwen2 (q/k/v biases), a tied Qwen3, a
Qwen3-MoE with a dense layer among its expert layers and a Mixtral; adapters built from config.json
alone; bad configs refused."""

from __future__ import annotations

import dataclasses
import filecmp
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from tests.helpers import assert_same, logits, perturbed, read_checkpoint
from torchtitan_ckpt.errors import AdapterMismatchError, CheckpointError, ConfigError, CorruptCheckpointError
from torchtitan_ckpt.example.model import ROPE_LAYOUT, Transformer, args_from_hf_config, hf_adapter
from torchtitan_ckpt.hf import (HFModelConfig, LlamaAdapter, MixtralAdapter, Qwen2Adapter, Qwen3Adapter,
                                Qwen3MoeAdapter, adapter_for_config, adapter_for_hf_dir, load_hf, save_hf)
from torchtitan_ckpt.hf.adapter import rope_row_order
from torchtitan_ckpt.hf.convert import convert
from torchtitan_ckpt.hf.files import RECORDED_CONFIG, RECORDED_LAYOUT

transformers = pytest.importorskip("transformers")

FAMILIES = {
    "llama31": ("LlamaForCausalLM", dict(
        model_type="llama", vocab_size=250, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=40, max_position_embeddings=256,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen3": ("Qwen3ForCausalLM", dict(
        model_type="qwen3", vocab_size=250, hidden_size=64, intermediate_size=100, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(
        model_type="qwen3_moe", vocab_size=250, hidden_size=48, intermediate_size=80, moe_intermediate_size=20,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "qwen2": ("Qwen2ForCausalLM", dict(
        model_type="qwen2", vocab_size=250, hidden_size=64, intermediate_size=72, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)),
    "mixtral": ("MixtralForCausalLM", dict(
        model_type="mixtral", vocab_size=250, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=5, num_experts_per_tok=2)),
}
EXPERT_FILES = {"qwen3_moe": "model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight",
                "mixtral": "model.layers.{layer}.block_sparse_moe.experts.{e}.{p}.weight"}
"""How the Hub names one expert's tensors, by family: `p` one of `EXPERT_PARTS`' names."""
EXPERT_PARTS = {"qwen3_moe": ("gate", "up", "down"), "mixtral": ("w1", "w3", "w2")}
MOE_LAYERS = {"qwen3_moe": (0, 2), "mixtral": (0, 1)}
TOKENS = torch.randint(0, 250, (2, 20), generator=torch.Generator().manual_seed(1))


def make_hf_model(family: str, seed: int = 0):
    """A `transformers` model of the family with random weights (norms and router included)."""
    cls, config = FAMILIES[family]
    torch.manual_seed(seed)
    return perturbed(getattr(transformers, cls)(transformers.AutoConfig.for_model(**config)).eval())


def logits_of(model) -> torch.Tensor:
    return logits(model, TOKENS)


def read_config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_folder(request, tmp_path_factory):
    """(family, a transformers checkpoint in several files, its logits)."""
    folder = str(tmp_path_factory.mktemp(request.param))
    model = make_hf_model(request.param)
    model.save_pretrained(folder, max_shard_size="60KB")
    assert len(glob.glob(os.path.join(folder, "*.safetensors"))) >= 3
    return request.param, folder, logits_of(model)


def test_the_adapter_comes_from_model_type():
    expected = {"llama31": LlamaAdapter, "qwen3": Qwen3Adapter, "qwen3_moe": Qwen3MoeAdapter,
                "qwen2": Qwen2Adapter, "mixtral": MixtralAdapter}
    for family, (_, config) in FAMILIES.items():
        assert type(adapter_for_config(config)) is expected[family]
    assert type(adapter_for_config({**FAMILIES["llama31"][1], "model_type": "mistral"})) is LlamaAdapter


def test_a_config_without_a_model_type_takes_the_adapter_named(tmp_path):
    """An adapter named for a config.json without `model_type` (what the name is for) is taken;
    the config was refused for its missing model_type. Without a name, it still is."""
    untyped = {k: v for k, v in FAMILIES["qwen3"][1].items() if k != "model_type"}
    adapter = adapter_for_config(untyped, adapter="qwen3")
    assert type(adapter) is Qwen3Adapter and adapter.config.model_type == "qwen3"
    assert adapter.config.hidden_size == untyped["hidden_size"]
    with pytest.raises(ConfigError, match=r"^config.json: model_type = None: no adapter for it"):
        adapter_for_config(untyped)


def test_the_rope_layout_is_the_familys_as_torchtitan_models_it_unless_given():
    """q and k rows (and Qwen3's q/k norms) are permuted for a model that rotates interleaved
    pairs (TorchTitan's Llama 3, the example model), not for one that rotates halves as HF
    does (TorchTitan's Qwen3): each family's default is TorchTitan's model's."""
    permuted = {name: bool(adapter_for_config(config).sources["layers.0.attention.wq.weight"].row_order)
                for name, (_, config) in FAMILIES.items()}
    assert permuted == {"llama31": True, "qwen3": False, "qwen3_moe": False, "qwen2": True, "mixtral": True}
    qwen3 = adapter_for_config(FAMILIES["qwen3"][1], rope_layout=ROPE_LAYOUT)
    assert {name: bool(qwen3.sources[f"layers.0.attention.{name}.weight"].row_order)
            for name in ("wq", "wk", "wv", "q_norm", "k_norm")} == {
        "wq": True, "wk": True, "wv": False, "q_norm": True, "k_norm": True}
    assert hf_adapter(args_from_hf_config(FAMILIES["qwen3"][1])).rope_layout == ROPE_LAYOUT == "interleaved"
    with pytest.raises(ValueError, match=r"rope_layout = 'complex'; expected one of interleaved, halves"):
        adapter_for_config(FAMILIES["qwen3"][1], rope_layout="complex")


def test_a_tied_config_refuses_to_drop_a_head_that_is_not_the_embedding(tmp_path):
    """A model that does not tie its head (started from a tied checkpoint, then trained) exported
    with a config that ties them would lose its head: refused, naming the setting. A head equal
    to the embedding (a tied model, a cast copy of it) exports as the embedding alone."""
    args = args_from_hf_config(FAMILIES["qwen3"][1])
    model = Transformer(args)
    adapter = hf_adapter(args)
    state = model.state_dict()
    assert adapter.tied and "output.weight" not in adapter.to_hf(state)  # the example ties it: one tensor
    untied = {**state, "output.weight": state["output.weight"] + 1}
    with pytest.raises(CheckpointError, match=r"^output.weight is not tok_embeddings.weight: the Hugging Face config "
                                              r"ties them \(tie_word_embeddings = true\)"):
        adapter.to_hf(untied)
    with pytest.raises(CheckpointError, match=r"output.weight is not tok_embeddings.weight"):
        save_hf(untied, str(tmp_path / "out"), adapter)
    assert not glob.glob(str(tmp_path / "out" / "*.safetensors"))


def test_a_head_untied_from_the_embedding_is_refused_before_training_where_an_export_ties_them(tmp_path):
    """A model materialised with `to_empty()` and a fresh init untied its head: it loaded, trained,
    and only the last save's export failed, after the training."""
    from torchtitan_ckpt import Checkpoint, CheckpointManager

    args = args_from_hf_config(FAMILIES["qwen3"][1])
    model = Transformer(args)
    config = Checkpoint(enable=True, last_save_in_hf=True)
    with CheckpointManager(config, [model], base_folder=str(tmp_path), state_dict_adapter=hf_adapter(args)) as manager:
        assert model.output.weight is model.tok_embeddings.weight
        model.output.weight = torch.nn.Parameter(model.tok_embeddings.weight.detach().clone())  # as to_empty() may
        with pytest.raises(CheckpointError, match=r"^load\(\): the Hugging Face config ties output.weight to "
                                                  r"tok_embeddings.weight .* the model's output.weight is a parameter"):
            manager.load()
    with pytest.raises(ConfigError, match=r"checkpoint.last_save_in_hf = True: the Hugging Face config ties"):
        CheckpointManager(config, [model], base_folder=str(tmp_path), state_dict_adapter=hf_adapter(args))
    untied = replace(args, tie_embeddings=False)
    CheckpointManager(config, [Transformer(untied)], base_folder=str(tmp_path),
                      state_dict_adapter=hf_adapter(untied)).close()


def test_the_example_model_loaded_through_the_adapter_gives_the_transformers_logits(hf_folder):
    family, src, expected = hf_folder
    args = args_from_hf_config(read_config(src))
    model = Transformer(args)
    load_hf(model.state_dict(), src, adapter_for_hf_dir(src, rope_layout=ROPE_LAYOUT))
    assert (logits_of(model) - expected).abs().max() < 1e-5
    if family == "llama31":  # the llama3 RoPE scaling is what makes them equal
        unscaled = Transformer(replace(args, rope_scaling=None))
        unscaled.load_state_dict(model.state_dict())
        assert (logits_of(unscaled) - expected).abs().max() > 1e-3


def test_hf_to_dcp_to_hf_gives_the_same_files_byte_for_byte(hf_folder, tmp_path):
    family, src, _ = hf_folder
    convert("dcp", src, str(tmp_path / "dcp"))  # no model, no flavor: config.json alone
    dcp_state = read_checkpoint(str(tmp_path / "dcp"))
    assert sorted(dcp_state) == sorted(Transformer(args_from_hf_config(read_config(src))).state_dict())
    convert("hf", str(tmp_path / "dcp"), str(tmp_path / "hf"), hf_assets_path=src)
    files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(src, "*.safetensors")))
    assert files == sorted(os.path.basename(f) for f in glob.glob(str(tmp_path / "hf" / "*.safetensors")))
    for file in files:
        assert filecmp.cmp(os.path.join(src, file), tmp_path / "hf" / file, shallow=False), file
    with open(os.path.join(src, "model.safetensors.index.json")) as a, open(tmp_path / "hf" / "model.safetensors.index.json") as b:
        assert json.load(a)["weight_map"] == json.load(b)["weight_map"]


@pytest.fixture(scope="module")
def qwen3_step(tmp_path_factory):
    """(a transformers Qwen3 in one file, a DCP step `convert --to dcp --rope-layout interleaved`
    made of it): q/k rows permuted, as the example model's Qwen3 needs them."""
    folder = tmp_path_factory.mktemp("qwen3_step")
    make_hf_model("qwen3").save_pretrained(str(folder / "hf"))
    convert("dcp", str(folder / "hf"), str(folder / "dcp"), rope_layout="interleaved")
    return str(folder / "hf"), str(folder / "dcp")


def assert_same_file(src: str, export: str) -> None:
    """The one safetensors file of `src` (transformers' `model.safetensors`) and that of the
    export (`model-00001-of-00001.safetensors`) are the same, byte for byte."""
    [a], [b] = glob.glob(os.path.join(src, "*.safetensors")), glob.glob(os.path.join(export, "*.safetensors"))
    assert filecmp.cmp(a, b, shallow=False)


def test_a_converted_step_records_its_rope_layout_and_exports_in_it(qwen3_step, tmp_path):
    """`--to dcp --rope-layout interleaved` of a Qwen3 (whose default is halves) records the
    layout; `--to hf` with none given takes it, and gives back the source's files."""
    src, step = qwen3_step
    [file] = glob.glob(os.path.join(src, "*.safetensors"))
    hf_q = load_file(file)["model.layers.0.self_attn.q_proj.weight"]  # 4 heads of 24 rows
    interleaved = hf_q.reshape(4, 24, -1)[:, list(rope_row_order(24))].reshape(hf_q.shape)
    assert torch.equal(read_checkpoint(step)["layers.0.attention.wq.weight"], interleaved)
    convert("hf", step, str(tmp_path / "hf"))
    assert_same_file(src, str(tmp_path / "hf"))
    with open(os.path.join(step, RECORDED_LAYOUT)) as f:
        assert json.load(f) == {"rope_layout": "interleaved"}
    with open(os.path.join(step, RECORDED_CONFIG)) as f:
        assert json.load(f) == read_config(src)  # ours stay out of the HF config's copy


def test_a_qwen3_step_of_an_older_convert_needs_its_rope_layout(qwen3_step, tmp_path):
    """A step with `hf_config.json` and no recorded layout was written by an older `convert`,
    which permuted every family before one release and followed the family's default after it:
    a Qwen3 one is refused without the layout, and exports with it."""
    src, step = qwen3_step
    older = shutil.copytree(step, tmp_path / "older")
    (older / RECORDED_LAYOUT).unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match=r"older does not record the RoPE layout of its model"):
        convert("hf", str(older), str(tmp_path / "refused"))
    convert("hf", str(older), str(tmp_path / "hf"), rope_layout="interleaved")
    assert_same_file(src, str(tmp_path / "hf"))


def test_a_qwen3_step_the_job_saved_needs_its_rope_layout(qwen3_step, tmp_path):
    """A step the training job saved records no config and no layout: a Qwen3 one exported
    with `--hf-assets` alone is refused (TorchTitan's Qwen3 and the example's differ), and
    exports with the layout given."""
    src, step = qwen3_step
    saved = str(tmp_path / "step-10")
    dcp.save(read_checkpoint(step), checkpoint_id=saved)
    message = (f"{saved} does not record the RoPE layout of its model (a step the training job saved), and qwen3 "
               "models differ in it: pass --rope-layout halves (TorchTitan's Qwen3) or interleaved (this "
               "package's example model)")
    with pytest.raises(CheckpointError, match=f"^{re.escape(message)}$"):
        convert("hf", saved, str(tmp_path / "refused"), hf_assets_path=src)
    assert not os.path.exists(tmp_path / "refused")
    convert("hf", saved, str(tmp_path / "hf"), hf_assets_path=src, rope_layout="interleaved")
    assert_same_file(src, str(tmp_path / "hf"))


def test_a_recorded_rope_layout_that_is_not_one_is_refused_naming_the_file(qwen3_step, tmp_path):
    src, step = qwen3_step
    bad = shutil.copytree(step, tmp_path / "bad")
    (bad / RECORDED_LAYOUT).write_text('{"rope_layout": "complex"}')
    with pytest.raises(CorruptCheckpointError, match=rf"^{re.escape(str(bad / RECORDED_LAYOUT))}: rope_layout = "
                                                     r"'complex', expected one of interleaved, halves; pass "
                                                     r"--rope-layout with the model's$"):
        convert("hf", str(bad), str(tmp_path / "hf"))


@pytest.mark.parametrize("titan", ["0.2", "0.3"])
def test_convert_to_hf_refuses_a_model_tensor_it_would_drop_and_names_the_bias_it_leaves_out(titan, tmp_path, caplog):
    """`convert --to hf` of a step holding every tensor the adapter knows and one more (a trained
    scale of the user's) exported without it, silently: refused, naming it. TorchTitan's routing
    bias (`moe.expert_bias`, 0.3's `moe.expert_bias_E`), which the Hub's format has no place
    for, is left out and said so, as the manager's export says."""
    from torchtitan_ckpt.hf.convert import _titan_03_name

    src = str(tmp_path / "hf")
    make_hf_model("qwen3_moe").save_pretrained(src)
    convert("dcp", src, str(tmp_path / "dcp"))
    state = read_checkpoint(str(tmp_path / "dcp"))
    state.update({f"layers.{i}.moe.expert_bias": torch.full((6,), 0.05) for i in MOE_LAYERS["qwen3_moe"]})
    if titan == "0.3":
        state = {_titan_03_name(k) if ".moe.expert_bias" not in k else k + "_E": v for k, v in state.items()}
    biases = sorted(k for k in state if ".moe.expert_bias" in k)
    for name, extra in (("step-1", {}), ("step-2", {"lora_scale": torch.ones(1)})):
        dcp.save({**state, **extra}, checkpoint_id=str(tmp_path / name))
        for recorded in (RECORDED_CONFIG, RECORDED_LAYOUT):
            shutil.copy(tmp_path / "dcp" / recorded, tmp_path / name)
    with pytest.raises(AdapterMismatchError, match=re.escape(
            f"{tmp_path / 'step-2'}: tensors in the checkpoint (unknown) vs the HF config's (missing): 1 unknown "
            "name(s) ['lora_scale [1]'] and 0 missing name(s) []")):
        convert("hf", str(tmp_path / "step-2"), str(tmp_path / "refused"))
    assert not os.path.exists(tmp_path / "refused")
    with caplog.at_level("WARNING", logger="torchtitan_ckpt.hf.convert"):
        convert("hf", str(tmp_path / "step-1"), str(tmp_path / "out"))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"{tmp_path / 'step-1'}: the export leaves out 2 model tensor(s) that the adapter maps "
        f"to no Hugging Face tensor, e.g. {biases}: the exported model lacks them"]
    assert_same_file(src, str(tmp_path / "out"))


def test_torchtitans_load_balancing_bias_is_set_to_zero_on_import_and_told_as_left_out_of_an_export(tmp_path, caplog):
    """TorchTitan's Qwen3-MoE holds a routing bias per MoE layer (`moe.expert_bias`, trained by
    its load balancing) that the Hub's model has none of: the adapter refused the model, for an
    import and an export alike (tests/torchtitan_qwen3.py: with TorchTitan's own model). An
    import sets it to zero, the Hub's routing; an export leaves it out, named when the manager
    is built."""
    from torchtitan_ckpt import Checkpoint, CheckpointManager

    family, folder = "qwen3_moe", str(tmp_path / "hf")
    make_hf_model(family).save_pretrained(folder)
    args = args_from_hf_config(read_config(folder))
    model = Transformer(args)
    biases = [f"layers.{i}.moe.expert_bias" for i in MOE_LAYERS[family]]
    for name in biases:
        model.get_submodule(name.rpartition(".")[0]).register_buffer("expert_bias", torch.full((6,), 0.05))
    adapter = adapter_for_hf_dir(folder, rope_layout="interleaved")
    load_hf(model.state_dict(), folder, adapter)
    assert all(not model.get_buffer(name).any() for name in biases)
    assert (logits_of(model) - logits_of(make_hf_model(family))).abs().max() < 1e-5

    with caplog.at_level("WARNING", logger="torchtitan_ckpt.manager"):
        with CheckpointManager(Checkpoint(enable=True, last_save_in_hf=True, export_dtype="float32"), [model],
                               base_folder=str(tmp_path / "run"), state_dict_adapter=adapter) as manager:
            manager.save(1, last_step=True)
    assert [m for m in caplog.messages if "leaves out" in m] == [
        f"the Hugging Face export (checkpoint.last_save_in_hf) leaves out 2 model tensor(s) that the state-dict "
        f"adapter maps to no Hugging Face tensor, e.g. {biases}: the exported model lacks them"]
    exported = str(tmp_path / "run" / "checkpoint" / "step-1")
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(exported).eval()
    assert (logits_of(back) - logits_of(model)).abs().max() < 1e-5


def test_a_converted_step_of_another_rope_layout_is_refused_as_initial_load_path(qwen3_step, tmp_path):
    """`convert --to dcp` of a Qwen3 without `--rope-layout` writes TorchTitan's layout
    (`halves`); the example job, whose model is `interleaved`, starting from it would train a
    model whose attention is scrambled: refused before any tensor changes, naming both layouts
    and the option. The step converted for its layout loads, giving the transformers logits."""
    from torchtitan_ckpt import CheckpointManager
    from torchtitan_ckpt.config import Checkpoint

    src, interleaved = qwen3_step
    halves = str(tmp_path / "halves")
    convert("dcp", src, halves)
    args = args_from_hf_config(read_config(src))
    model = Transformer(args)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def manager(path: str, folder: str) -> CheckpointManager:
        return CheckpointManager(Checkpoint(enable=True, initial_load_path=path, initial_load_model_only=True),
                                 [model], base_folder=str(tmp_path / folder), state_dict_adapter=hf_adapter(args))

    with manager(halves, "refused") as m, pytest.raises(CheckpointError, match=re.escape(
            f"{halves}: its q/k rows are in the halves RoPE layout (its rope_layout.json, written by `torchtitan-ckpt "
            "convert --to dcp`), and this job's model's is interleaved (its state-dict adapter's rope_layout): it "
            "would load with its attention scrambled. Convert the Hugging Face folder again with `torchtitan-ckpt "
            "convert --to dcp --rope-layout interleaved HF_DIR OUT_DIR`")):
        m.load()
    assert_same(model.state_dict(), before)
    with manager(interleaved, "loaded") as m:
        assert m.load()
    expected = logits_of(transformers.Qwen3ForCausalLM.from_pretrained(src).eval())
    assert (logits(model, TOKENS) - expected).abs().max() < 1e-5


def test_native_to_hf_to_native_is_exact_and_transformers_reads_it(hf_folder, tmp_path):
    family, src, _ = hf_folder
    args = args_from_hf_config(read_config(src))
    torch.manual_seed(7)
    ours = Transformer(args)
    save_hf(ours.state_dict(), str(tmp_path), hf_adapter(args), max_shard_size="50KB")
    assert len(glob.glob(str(tmp_path / "*.safetensors"))) >= 3
    if family in EXPERT_FILES:  # the Hub's layout: one 2-D tensor per expert
        with open(tmp_path / "model.safetensors.index.json") as f:
            names = json.load(f)["weight_map"]
        last = args.moe.num_experts - 1
        assert {EXPERT_FILES[family].format(layer=layer, e=last, p=p)
                for layer in MOE_LAYERS[family] for p in EXPERT_PARTS[family]} <= set(names)
        assert not any("layers.1.mlp.experts" in n for n in names)  # Qwen3-MoE's dense layer
    hf, info = getattr(transformers, FAMILIES[family][0]).from_pretrained(str(tmp_path), output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert (logits_of(hf.eval()) - logits_of(ours)).abs().max() < 1e-5
    torch.manual_seed(8)
    back = Transformer(args)
    load_hf(back.state_dict(), str(tmp_path), hf_adapter(args))
    assert_same(back.state_dict(), ours.state_dict())

    # what transformers' save_pretrained writes (its experts fused in memory) imports too
    hf.save_pretrained(str(tmp_path / "resaved"), max_shard_size="50KB")
    again = Transformer(args)
    resaved = adapter_for_hf_dir(str(tmp_path / "resaved"), rope_layout=ROPE_LAYOUT)
    load_hf(again.state_dict(), str(tmp_path / "resaved"), resaved)
    assert_same(again.state_dict(), ours.state_dict())


@pytest.fixture(scope="module")
def tied_with_head(tmp_path_factory):
    """(a tied Qwen3 checkpoint whose files also hold lm_head.weight, a copy of the embedding,
    in a file of its own, as Qwen3-0.6B's on the Hub hold one; its transformers logits)."""
    folder = str(tmp_path_factory.mktemp("tied_with_head"))
    model = make_hf_model("qwen3")
    model.save_pretrained(folder, max_shard_size="60KB")
    index_path = os.path.join(folder, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    embedding = load_file(os.path.join(folder, index["weight_map"]["model.embed_tokens.weight"]))
    head = "model-00099-of-00099.safetensors"
    save_file({"lm_head.weight": embedding["model.embed_tokens.weight"].clone()}, os.path.join(folder, head),
              metadata={"format": "pt"})
    index["weight_map"]["lm_head.weight"] = head
    with open(index_path, "w") as f:
        json.dump(index, f)
    assert read_config(folder)["tie_word_embeddings"] is True
    hf = transformers.Qwen3ForCausalLM.from_pretrained(folder).eval()
    assert (logits_of(hf) - logits_of(model)).abs().max() == 0
    return folder, logits_of(model)


@pytest.mark.parametrize("mode", ["one_pass", "all_ranks"])
def test_a_tied_checkpoint_that_stores_its_head_too_loads_and_exports_without_it(tied_with_head, tmp_path, mode,
                                                                                 caplog):
    """Its head is the embedding, as transformers ties them: the import reads the embedding and
    leaves lm_head.weight unread; an export with it as assets writes the embedding alone, in
    the assets' other files, numbered without the head's, and transformers reads it back."""
    src, expected = tied_with_head
    args = args_from_hf_config(read_config(src))
    model = Transformer(args)
    with caplog.at_level("INFO", logger="torchtitan_ckpt.hf.load"):
        load_hf(model.state_dict(), src, adapter_for_hf_dir(src, rope_layout=ROPE_LAYOUT))
    assert f"{src}: ignoring ['lm_head.weight']: its config.json ties the embedding to the head, which is read " \
           "from the embedding" in caplog.messages
    assert (logits_of(model) - expected).abs().max() < 1e-5
    out = str(tmp_path / "out")
    save_hf(model.state_dict(), out, adapter_for_hf_dir(src, rope_layout=ROPE_LAYOUT), mode=mode)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    files = sorted(glob.glob(os.path.join(src, "model-*.safetensors")))
    assert "lm_head.weight" not in weight_map and sorted(set(weight_map.values())) == [
        f"model-{i:05d}-of-{len(files) - 1:05d}.safetensors" for i in range(1, len(files))]
    assert sorted(os.path.basename(f) for f in glob.glob(os.path.join(out, "*.safetensors"))) == sorted(
        set(weight_map.values()))
    hf, info = transformers.Qwen3ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert (logits_of(hf.eval()) - expected).abs().max() < 1e-5


def test_a_head_in_a_folder_whose_config_does_not_tie_is_not_dropped_by_a_tied_model(tied_with_head, tmp_path):
    """The same files under a config that does not tie them hold a head of their own: a tied
    model (its adapter from another config) would lose it, so the import refuses it."""
    src, _ = tied_with_head
    folder = shutil.copytree(src, tmp_path / "untied")
    (folder / "config.json").write_text(json.dumps({**read_config(src), "tie_word_embeddings": False}))
    args = args_from_hf_config(read_config(src))
    with pytest.raises(AdapterMismatchError) as e:
        load_hf(Transformer(args).state_dict(), str(folder), hf_adapter(args))
    assert (e.value.unknown, e.value.missing) == (["lm_head.weight"], [])


MINIMAL = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=32, intermediate_size=48, vocab_size=100)


@pytest.mark.parametrize("config", [
    dict(model_type="llama", **MINIMAL),
    dict(model_type="mistral", **MINIMAL),
    dict(model_type="qwen3", **MINIMAL),
    dict(model_type="qwen3_moe", moe_intermediate_size=8, **MINIMAL),
    dict(model_type="qwen3", num_key_value_heads=None, **MINIMAL),  # null: the heads, as transformers has it
    dict(model_type="qwen2", **MINIMAL),
    dict(model_type="mixtral", **MINIMAL),
], ids=["llama", "mistral", "qwen3", "qwen3_moe", "qwen3_null_kv", "qwen2", "mixtral"])
def test_keys_a_config_leaves_out_take_the_defaults_transformers_gives_its_family(config, tmp_path):
    """A config.json without `head_dim`, `num_key_value_heads` or `num_experts` gives the
    shapes transformers builds from it (Qwen3's head_dim is 128, not hidden / heads; Mistral's
    8 key-value heads; Qwen3-MoE's 128 experts, 8 per token; Qwen2's 32 key-value heads;
    Mixtral's 8 experts, 2 per token), so the export loads in transformers."""
    theirs = transformers.AutoConfig.for_model(**config)
    ours = HFModelConfig.parse(config)
    expected = {"head_dim": getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads,
                "num_key_value_heads": theirs.num_key_value_heads,
                "num_experts": getattr(theirs, "num_experts", None) or getattr(theirs, "num_local_experts", 0),
                "num_experts_per_tok": getattr(theirs, "num_experts_per_tok", 0),
                "intermediate_size": theirs.intermediate_size, "tie_word_embeddings": theirs.tie_word_embeddings}
    assert {key: getattr(ours, key) for key in expected} == expected
    adapter = adapter_for_config(config)
    torch.manual_seed(0)
    state = {name: torch.randn(shape) for name, shape in adapter.state_dict_shapes().items()}
    save_hf(state, str(tmp_path), adapter)
    cls = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "mixtral": "MixtralForCausalLM"}[config["model_type"]]
    _, info = getattr(transformers, cls).from_pretrained(str(tmp_path), output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_a_config_built_in_python_exports_what_transformers_loads(family, tmp_path):
    """An `HFModelConfig` made from its fields (no config.json; a RoPE setting is none of them)
    was refused by `adapter_for_config` ("model_type = None") and, given to an adapter, exported a
    config.json holding only the dtype, which transformers cannot load: its fields are now
    written as transformers names them."""
    src = str(tmp_path / "src")
    make_hf_model(family).save_pretrained(src)
    parsed = HFModelConfig.parse(read_config(src))
    built = HFModelConfig(**{f.name: getattr(parsed, f.name) for f in dataclasses.fields(parsed) if f.compare})
    assert built == parsed and built.raw["model_type"] == FAMILIES[family][1]["model_type"]
    model = Transformer(args_from_hf_config(read_config(src)))
    load_hf(model.state_dict(), src, adapter_for_hf_dir(src, rope_layout=ROPE_LAYOUT))
    save_hf(model.state_dict(), str(tmp_path / "out"), adapter_for_config(built, rope_layout=ROPE_LAYOUT))
    back = getattr(transformers, FAMILIES[family][0]).from_pretrained(str(tmp_path / "out")).eval()
    assert (logits_of(back) - logits_of(make_hf_model(family))).abs().max() < 1e-5


def test_a_config_built_in_python_is_checked_as_a_files_is():
    fields = {f.name: getattr(HFModelConfig.parse(FAMILIES[family][1]), f.name)
              for family in ("qwen3_moe",) for f in dataclasses.fields(HFModelConfig) if f.compare}
    with pytest.raises(ConfigError, match=re.escape("HFModelConfig: decoder_sparse_step = 0: expected an integer in "
                                                    "[1, 3]")):
        HFModelConfig(**{**fields, "decoder_sparse_step": 0})
    with pytest.raises(ConfigError, match=re.escape("HFModelConfig: hidden_size = '48': expected an integer")):
        HFModelConfig(**{**fields, "hidden_size": "48"})
    mixtral = {**fields, "model_type": "mixtral", "mlp_only_layers": (), "norm_topk_prob": True}
    with pytest.raises(ConfigError, match=re.escape("HFModelConfig: moe_intermediate_size = 20: a mixtral config "
                                                    "with these fields gives 80")):
        HFModelConfig(**mixtral)
    assert HFModelConfig(**{**mixtral, "moe_intermediate_size": 80}).raw["num_local_experts"] == 6


def test_a_default_that_does_not_fit_the_config_says_it_is_the_default():
    with pytest.raises(ConfigError, match=re.escape(
            "config.json: num_key_value_heads = 32: expected an integer in [1, 16] (the config does not give it: "
            "this is transformers' default for its model_type)")):
        HFModelConfig.parse(dict(model_type="qwen3", **{**MINIMAL, "num_attention_heads": 16}))


# ---------------------------------------------------------------------------- bad input

def test_an_unsupported_model_type_names_the_supported_ones():
    with pytest.raises(ConfigError, match=r"model_type = 'gpt2': no adapter for it; supported: llama, mistral, "
                                          r"mixtral, qwen2, qwen3, qwen3_moe"):
        adapter_for_config({**FAMILIES["qwen3"][1], "model_type": "gpt2"})


def test_more_heads_than_channels_without_a_head_dim_is_refused_for_that(tmp_path):
    """A config of more attention heads than `hidden_size` and no `head_dim`: named for that, where
    it was refused for a `head_dim = 0` the file does not give."""
    crowded = {**FAMILIES["llama31"][1], "num_attention_heads": 64, "num_key_value_heads": 8}
    crowded.pop("head_dim", None)
    crowded["hidden_size"] = 32
    with pytest.raises(ConfigError, match=r"^config.json: num_attention_heads = 64: is more than hidden_size \(32\) "
                                          r"and the config gives no head_dim"):
        adapter_for_config(crowded)
    assert adapter_for_config({**crowded, "head_dim": 8}).config.head_dim == 8


def test_a_family_without_an_adapter_is_refused_for_its_model_type_not_for_a_key(tmp_path):
    """OLMoE gives no `moe_intermediate_size` (its experts are `intermediate_size` wide), which
    Qwen3-MoE must give; GPT-2 names its sizes otherwise (`n_embd`), and its folder was refused for
    "hidden_size = None: required"."""
    gpt2 = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4)
    gpt2.save_pretrained(tmp_path)
    for where, make in [("config.json", lambda: adapter_for_config(gpt2.to_dict())),
                        (f"{tmp_path}/config.json", lambda: adapter_for_hf_dir(str(tmp_path))),
                        (f"{tmp_path}/config.json", lambda: convert("dcp", str(tmp_path), str(tmp_path / "out")))]:
        with pytest.raises(ConfigError, match=rf"^{re.escape(where)}: model_type = 'gpt2': no adapter for it"):
            make()
    olmoe = transformers.OlmoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                     num_experts_per_tok=2)
    with pytest.raises(ConfigError, match=r"^config.json: model_type = 'olmoe': no adapter for it; supported: "
                                          r"llama, mistral, mixtral, qwen2, qwen3, qwen3_moe$"):
        adapter_for_config(olmoe.to_dict())
    qwen3_moe = {k: v for k, v in FAMILIES["qwen3_moe"][1].items() if k != "moe_intermediate_size"}
    with pytest.raises(ConfigError, match=r"^config.json: moe_intermediate_size = None: required by the qwen3_moe "
                                          r"adapter: its experts' width, a positive integer$"):
        adapter_for_config(qwen3_moe)
    with pytest.raises(ConfigError, match=r"^config.json: moe_intermediate_size = None: required by the example "
                                          r"model: its experts' width"):
        args_from_hf_config(qwen3_moe)


def test_the_qwen3_moe_adapter_requires_its_expert_width_of_any_config(tmp_path):
    """The Qwen3-MoE adapter asked for by name of an OLMoE config (experts, no
    `moe_intermediate_size`) refuses it, naming the file, rather than build experts of width 0."""
    olmoe = transformers.OlmoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                     num_experts_per_tok=2)
    (tmp_path / "config.json").write_text(json.dumps(olmoe.to_dict()))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path))}/config.json: moe_intermediate_size = None: "
                                          r"required by the qwen3_moe adapter: its experts' width, a positive "
                                          r"integer$"):
        adapter_for_hf_dir(str(tmp_path), adapter="qwen3_moe")
    with pytest.raises(ConfigError, match=r"^config.json: moe_intermediate_size = 0: required by the qwen3_moe"):
        adapter_for_config({**FAMILIES["qwen3_moe"][1], "moe_intermediate_size": 0})


@pytest.mark.parametrize("change, key", [
    ({"hidden_size": "96"}, "hidden_size"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_hidden_layers": 10**7}, "num_hidden_layers"),
    ({"vocab_size": 2**40}, "vocab_size"),
    ({"head_dim": 7.5}, "head_dim"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({"num_experts": -1}, "num_experts"),
    ({"num_experts_per_tok": 7}, "num_experts_per_tok"),
    ({"mlp_only_layers": [3]}, "mlp_only_layers"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_a_hostile_config_is_refused_naming_the_key(change, key):
    with pytest.raises(ConfigError, match=rf"^config.json: {key} = "):
        HFModelConfig.parse({**FAMILIES["qwen3_moe"][1], **change})


def test_a_config_that_is_not_an_object_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config.json = 'list': a config.json must hold a JSON object"):
        adapter_for_hf_dir(str(tmp_path))


def test_a_missing_expert_names_it(hf_folder, tmp_path):
    family, src, _ = hf_folder
    if family not in EXPERT_FILES:
        pytest.skip("experts only")
    config = read_config(src)
    extra = config.get("num_experts") or config["num_local_experts"]
    config.update(num_experts=extra + 1, num_local_experts=extra + 1)
    with pytest.raises(AdapterMismatchError) as e:
        load_hf(Transformer(args_from_hf_config(config)).state_dict(), src, adapter_for_config(config))
    assert e.value.unknown == [] and e.value.missing == sorted(
        EXPERT_FILES[family].format(layer=layer, e=extra, p=p) for layer in MOE_LAYERS[family]
        for p in EXPERT_PARTS[family])


def test_a_shape_the_files_contradict_names_both(hf_folder):
    family, src, _ = hf_folder
    if family != "qwen3":
        pytest.skip("one family is enough")
    config = {**read_config(src), "intermediate_size": 104}
    with pytest.raises(AdapterMismatchError) as e:
        load_hf(Transformer(args_from_hf_config(config)).state_dict(), src, adapter_for_config(config))
    assert "model.layers.0.mlp.up_proj.weight [100, 64]" in e.value.unknown
    assert "model.layers.0.mlp.up_proj.weight [104, 64]" in e.value.missing


def test_the_library_never_imports_the_example():
    code = ("import sys, torchtitan_ckpt, torchtitan_ckpt.hf, torchtitan_ckpt.cli; "
            "print([m for m in sys.modules if m.startswith('torchtitan_ckpt.example')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
