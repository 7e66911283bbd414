"""The manager's Hugging Face paths: last-step export, interval copies, initial load, resume."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch

from torchtitan_ckpt import CheckpointError, CheckpointManager, ConfigError, commit, layout
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.hf.files import MAX_ASSET_BYTES

from .helpers import ROOT, assert_same, run_job
from .jobs import make_job

transformers = pytest.importorskip("transformers")


def _folder(tmp_path) -> str:
    return os.path.join(tmp_path, "checkpoint")


def test_last_step_in_hf_is_a_committed_transformers_folder(tmp_path):
    job = make_job(str(tmp_path), steps=4, interval=2, last_save_in_hf=True, export_dtype="bfloat16")
    job.run_to(4, steps=4)
    job.manager.close()
    step4 = layout.step_dir(_folder(tmp_path), 4)
    info = commit.read_marker(step4)
    assert (info.format, info.states) == ("hf", ["model"])
    assert {"config.json", "model.safetensors.index.json", "model-00001-of-00001.safetensors"} <= set(info.files)
    assert commit.verify(step4) == []
    hf = transformers.LlamaForCausalLM.from_pretrained(step4)
    assert hf.dtype == torch.bfloat16
    ours = job.model.state_dict()
    assert torch.equal(hf.model.embed_tokens.weight, ours["tok_embeddings.weight"].to(torch.bfloat16))

    # the HF step loads the model (only) through the HF reader, to a job that loads only; a job
    # that resumes goes on from the newest full step instead
    fresh = make_job(str(tmp_path), steps=4, init_seed=5, load_step=4, load_only=True)
    assert fresh.manager.load() and fresh.train_state.step == 0
    assert_same(fresh.model.state_dict(), {k: v.to(torch.bfloat16).float() for k, v in ours.items()})
    fresh.manager.close()
    resumed = make_job(str(tmp_path), steps=4, init_seed=5)
    assert resumed.manager.load() and resumed.train_state.step == 2
    resumed.manager.close()


def test_hf_copies_at_an_interval_beside_the_dcp_steps(tmp_path):
    job = make_job(str(tmp_path), steps=9, interval=2, hf_export_interval=3, keep_latest_k=1,
                   last_save_model_only=False)
    job.run_to(9, steps=9)
    job.manager.close()
    assert layout.committed_steps(_folder(tmp_path)) == [8, 9]  # no retention after the last save
    copies = os.path.join(_folder(tmp_path), "hf")
    assert layout.committed_steps(copies) == [6, 9]  # keep_latest_k applies to the copies too (3 went)
    with open(os.path.join(layout.step_dir(copies, 9), "model.safetensors.index.json")) as f:
        assert "model.embed_tokens.weight" in json.load(f)["weight_map"]


def test_initial_load_in_hf(tmp_path):
    source = make_job(str(tmp_path / "a"), steps=2, interval=10, last_save_in_hf=True)
    source.run_to(2, steps=2)
    source.manager.close()
    hf_dir = layout.step_dir(_folder(tmp_path / "a"), 2)
    job = make_job(str(tmp_path / "b"), init_seed=9, initial_load_in_hf=True, initial_load_path=hf_dir)
    assert job.manager.load()
    assert_same(job.model.state_dict(), source.model.state_dict())
    job.manager.close()


def test_initial_load_in_hf_checks_the_folder_as_any_initial_load(tmp_path):
    """`initial_load_in_hf` read the folder as it was: an HF step of ours whose save did not
    finish loaded, `verify_on_load` was skipped (a flipped byte loaded), and a DCP step gave an
    error naming neither the setting nor the format."""
    from torchtitan_ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError

    source = make_job(str(tmp_path / "a"), steps=3, interval=2, last_save_in_hf=True, keep_latest_k=0)
    source.run_to(3, steps=3)
    source.manager.close()
    dcp_step, hf_step = (layout.step_dir(_folder(tmp_path / "a"), step) for step in (2, 3))
    assert [commit.read_marker(step).format for step in (dcp_step, hf_step)] == ["dcp", "hf"]

    def flip(data: str) -> None:
        with open(data, "r+b") as f:
            f.seek(-100, os.SEEK_END)
            byte = f.read(1)
            f.seek(-100, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))

    def load(path: str, **config) -> None:
        job = make_job(str(tmp_path / "b"), init_seed=9, initial_load_in_hf=True, initial_load_path=path, **config)
        try:
            assert job.manager.load()
            assert_same(job.model.state_dict(), source.model.state_dict())
        finally:
            job.manager.close()

    load(hf_step, verify_on_load=True)
    flip(next(os.path.join(dcp_step, n) for n in os.listdir(dcp_step) if n.endswith(".distcp")))
    with pytest.raises(CheckpointError, match=rf"^checkpoint.initial_load_path = {re.escape(dcp_step)} is a DCP "
                                              r"checkpoint, and checkpoint.initial_load_in_hf = true asks for a "
                                              r"Hugging Face safetensors folder: set it to false"):
        load(dcp_step, verify_on_load=True)  # refused for its format before its files are read
    from torchtitan_ckpt.example.model import hf_adapter

    model = source.model
    config = Checkpoint(enable=True, initial_load_in_hf=True)
    with pytest.raises(CheckpointError, match=rf"^the adapter's hf_assets_path = {re.escape(dcp_step)} is a DCP "
                                              r"checkpoint, .*: to start from it, set checkpoint.initial_load_path = "
                                              rf"{re.escape(dcp_step)} and checkpoint.initial_load_in_hf = false$"):
        with CheckpointManager(config, [model], base_folder=str(tmp_path / "d"),
                               state_dict_adapter=hf_adapter(model.args, hf_assets_path=dcp_step)) as manager:
            manager.load()
    flip(next(os.path.join(hf_step, n) for n in os.listdir(hf_step) if n.endswith(".safetensors")))
    with pytest.raises(CorruptCheckpointError, match=rf"^checkpoint.initial_load_path = {re.escape(hf_step)} "
                                                     r"failed verification: .*CRC-32"):
        load(hf_step, verify_on_load=True)
    os.remove(os.path.join(hf_step, commit.MARKER))  # its save never finished: IN_PROGRESS.json stays
    assert commit.is_in_progress(hf_step)
    with pytest.raises(CheckpointNotFoundError, match="its save did not finish"):
        load(hf_step)


def test_a_last_save_in_hf_commits_the_assets_named_chat_templates(tmp_path):
    """The templates' folder of the assets is a folder of the step: listed in its manifest
    (`verify` checks it), and read back by `AutoTokenizer`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from torchtitan_ckpt.example.model import FLAVORS, Transformer, hf_adapter, hf_config

    model = Transformer(FLAVORS["debugmodel"])
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps(hf_config(model.args)))
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(8)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0")
    tokenizer.chat_template = {"default": "{{ messages }}", "tool_use": "TOOLS {{ tools }}"}
    tokenizer.save_pretrained(str(assets))
    config = Checkpoint(enable=True, interval=1, last_save_in_hf=True)
    with CheckpointManager(config, [model], base_folder=str(tmp_path),
                           state_dict_adapter=hf_adapter(model.args, hf_assets_path=str(assets))) as manager:
        manager.save(1, last_step=True)
    step = layout.step_dir(_folder(tmp_path), 1)
    assert commit.read_marker(step).files["additional_chat_templates/tool_use.jinja"]["size"] == len("TOOLS {{ tools }}")
    assert commit.verify(step) == []
    assert list(transformers.AutoTokenizer.from_pretrained(step).chat_template) == ["default", "tool_use"]


def test_hf_options_need_an_adapter(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.last_save_in_hf.*state_dict_adapter="):
        CheckpointManager(Checkpoint(enable=True, last_save_in_hf=True), [torch.nn.Linear(2, 2)],
                          base_folder=str(tmp_path))


def test_an_assets_file_split_is_checked_when_the_manager_starts(tmp_path):
    """An assets' index lacking a tensor the model exports would fail the HF export, after all
    the training up to it: refused when the manager is built. One listing tensors the model does
    not export (an FP8 checkpoint's `weight_scale_inv`s) is no mismatch: the export leaves them
    out."""
    from torchtitan_ckpt.example.model import FLAVORS, Transformer, hf_adapter

    model = Transformer(FLAVORS["debugmodel"])
    names = hf_adapter(model.args).hf_names
    assets = tmp_path / "assets"
    assets.mkdir()
    index = assets / "model.safetensors.index.json"

    def manager(weight_map: dict[str, str]) -> CheckpointManager:
        index.write_text(json.dumps({"weight_map": weight_map}))
        return CheckpointManager(Checkpoint(enable=True, last_save_in_hf=True), [model], base_folder=str(tmp_path),
                                 state_dict_adapter=hf_adapter(model.args, hf_assets_path=str(assets)))

    with pytest.raises(ConfigError, match=re.escape(
            f"checkpoint.last_save_in_hf = True: {index}, the file split of the adapter's hf_assets_path, lacks "
            f"tensors the model exports (missing): 0 unknown name(s) [] and 1 missing name(s) ['{names[0]}']")):
        manager(dict.fromkeys(names[1:], "model.safetensors"))
    with manager({**dict.fromkeys(names, "model.safetensors"), "lm_head.weight_scale_inv": "model.safetensors"}) as m:
        assert m.save(1, last_step=True)
    with open(os.path.join(layout.step_dir(_folder(tmp_path), 1), "model.safetensors.index.json")) as f:
        assert json.load(f)["weight_map"] == dict.fromkeys(names, "model-00001-of-00001.safetensors")
    (assets / "tokenizer.json").write_bytes(b"\0" * (MAX_ASSET_BYTES + 1))  # known after the training, before
    with pytest.raises(ConfigError, match=re.escape(
            f"checkpoint.last_save_in_hf = True: {assets}/tokenizer.json: the assets' tokenizer.json is larger than")):
        manager(dict.fromkeys(names, "model.safetensors"))


class _ExtraState(torch.nn.Module):
    """A module keeping a value of its own beside its tensors (TransformerEngine's FP8 metadata)."""

    def __init__(self):
        super().__init__()
        self.value = {"amax_history": [1.0, 2.0], "recipe": "delayed"}

    def get_extra_state(self):
        return self.value

    def set_extra_state(self, state):
        self.value = state


@pytest.mark.parametrize("extra", ["lora", "extra_state"])
def test_model_tensors_the_adapter_cannot_export_are_refused_when_the_manager_starts(tmp_path, extra):
    """A LoRA adapter's weights, or a module's `_extra_state`, failed the export at the job's last
    save (with a hint about the checkpoint the adapter was made for), leaving the run's end unsaved."""
    from torchtitan_ckpt.example.model import FLAVORS, Transformer, hf_adapter

    model = Transformer(FLAVORS["debugmodel"])
    if extra == "lora":
        model.layers["0"].attention.wq.register_parameter("lora_a", torch.nn.Parameter(torch.zeros(2, 2)))
        name = "layers.0.attention.wq.lora_a"
    else:
        model.layers["0"].register_module("fp8", _ExtraState())
        name = "layers.0.fp8._extra_state"
    for key in ("last_save_in_hf", "hf_export_interval"):
        with pytest.raises(ConfigError, match=re.escape(
                f"checkpoint.{key} = {True if key == 'last_save_in_hf' else 5}: state dict -> HF: 1 unknown name(s) "
                f"['{name}'] and 0 missing name(s) []; is the adapter's model config the model's? A tensor it "
                "maps to none")):
            CheckpointManager(Checkpoint(enable=True, **{key: True if key == "last_save_in_hf" else 5}), [model],
                              base_folder=str(tmp_path), state_dict_adapter=hf_adapter(model.args))
    assert not os.path.exists(_folder(tmp_path)) or not layout.scan(_folder(tmp_path))


@pytest.mark.parametrize("field, value, problem", [
    ("vocab_size", 320, r"tok_embeddings.weight is \[320, 64\] where it gives \[256, 64\]; output.weight is "
                        r"\[320, 64\] where it gives \[256, 64\]"),
    ("n_heads", 2, r"layers.0.attention.wk.weight is \[64, 64\] where it gives \[32, 64\]")])
def test_a_model_of_other_sizes_than_the_adapters_config_is_refused_when_the_manager_starts(tmp_path, field, value,
                                                                                           problem):
    """A model built with other sizes than the adapter's config.json (a vocabulary padded, another
    head count): the last save exported its tensors under that config, which transformers refuses,
    or failed inside the RoPE permutation with a bare shape error; `save_hf` too, writing nothing."""
    import dataclasses

    from torchtitan_ckpt.example.model import FLAVORS, Transformer, hf_adapter
    from torchtitan_ckpt.hf import save_hf

    model = Transformer(dataclasses.replace(FLAVORS["debugmodel"], **{field: value}))
    adapter = hf_adapter(FLAVORS["debugmodel"])
    with pytest.raises(ConfigError, match=r"checkpoint.last_save_in_hf = True: the model is not of the sizes of the "
                                          r"adapter's Hugging Face config \(the llama model's config\): \d+ "
                                          rf"tensor\(s\) of other shapes, e.g. {problem}"):
        CheckpointManager(Checkpoint(enable=True, last_save_in_hf=True), [model], base_folder=str(tmp_path),
                          state_dict_adapter=adapter)
    with pytest.raises(CheckpointError, match=rf"of other shapes, e.g. {problem}"):
        save_hf(model.state_dict(), str(tmp_path / "hf"), adapter)
    assert not (tmp_path / "hf").exists() and not os.path.exists(_folder(tmp_path))


def test_a_modules_extra_state_of_tensors_resumes_without_a_word_of_unloaded_tensors(tmp_path, caplog):
    """Its tensors are entries of the step: told as model tensors the model does not have."""
    def model(scale: float) -> torch.nn.Module:
        built = torch.nn.Sequential(torch.nn.Linear(2, 2), _ExtraState())
        built[1].value = {"scale": torch.full((2,), scale), "recipe": "delayed"}
        return built

    with CheckpointManager(Checkpoint(enable=True, interval=1), [model(2.0)], base_folder=str(tmp_path)) as manager:
        manager.save(1)
    loaded = model(0.0)
    with CheckpointManager(Checkpoint(enable=True), [loaded], base_folder=str(tmp_path)) as manager:
        assert manager.load()
    assert torch.equal(loaded[1].value["scale"], torch.full((2,), 2.0))
    assert "does not have" not in caplog.text


def test_a_modules_extra_state_goes_into_the_last_model_only_save_as_it_is(tmp_path):
    """The export's cast took every value for a tensor: the run's last save failed
    ("'dict' object has no attribute 'dtype'") after all its training."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), _ExtraState())
    config = Checkpoint(enable=True, interval=10, export_dtype="bfloat16")
    with CheckpointManager(config, [model], base_folder=str(tmp_path)) as manager:
        assert manager.save(1, last_step=True)
    loaded = torch.nn.Sequential(torch.nn.Linear(2, 2), _ExtraState())
    loaded[1].value = {"amax_history": [0.0, 0.0], "recipe": "none"}  # a fresh module's
    with CheckpointManager(Checkpoint(enable=True, load_only=True), [loaded], base_folder=str(tmp_path)) as manager:
        assert manager.load()
    assert loaded[1].value == {"amax_history": [1.0, 2.0], "recipe": "delayed"}
    assert torch.equal(loaded[0].weight, model[0].weight.to(torch.bfloat16).float())


@pytest.mark.multirank
def test_two_rank_job_exports_hf_that_transformers_loads(tmp_path):
    run_job(str(tmp_path), "--checkpoint.last_save_in_hf", "true", "--training.steps", "6",
            "--checkpoint.consolidation", "all_ranks", nproc=2)
    step6 = layout.step_dir(_folder(tmp_path), 6)
    assert commit.read_marker(step6).format == "hf"
    hf, info = transformers.LlamaForCausalLM.from_pretrained(step6, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert hf.dtype == torch.bfloat16  # the example config's export_dtype


@pytest.mark.parametrize("mode", ["all_ranks", "rank0"])
def test_two_phase_exports_equal_the_one_pass_export(tmp_path, mode):
    from safetensors.torch import load_file

    files = {}
    for m in ("one_pass", mode):
        job = make_job(str(tmp_path / m), steps=2, interval=10, last_save_in_hf=True, consolidation=m)
        job.run_to(2, steps=2)
        job.manager.close()
        step2 = layout.step_dir(_folder(tmp_path / m), 2)
        assert not os.path.exists(os.path.join(step2, "sharded"))  # shards removed once consolidated
        files[m] = sorted(f for f in os.listdir(step2) if f.endswith(".safetensors"))
        loaded = {f: load_file(os.path.join(step2, f)) for f in files[m]}
        files[m] = (files[m], loaded)
    (names_a, a), (names_b, b) = files["one_pass"], files[mode]
    assert names_a == names_b
    for f in names_a:
        assert_same(a[f], b[f])


def test_an_export_into_a_folder_named_with_glob_characters_touches_only_its_own_files(tmp_path):
    """`run[1]` as a glob pattern is `run1`: clearing the export folder deleted the files of
    another run's committed step, and the manifest of the new step missed its own model files."""
    decoy = tmp_path / "run1" / "checkpoint" / "step-2" / "model-00001-of-00001.safetensors"
    decoy.parent.mkdir(parents=True)
    decoy.write_bytes(b"another run's weights")
    job = make_job(str(tmp_path / "run[1]"), steps=2, interval=10, last_save_in_hf=True)
    job.run_to(2, steps=2)
    job.manager.close()
    assert decoy.read_bytes() == b"another run's weights"
    step2 = layout.step_dir(str(tmp_path / "run[1]" / "checkpoint"), 2)
    assert "model-00001-of-00001.safetensors" in commit.read_marker(step2).files
    assert commit.verify(step2) == []


class SameNames:  # docs/hf.md's
    def __init__(self, hf_assets_path: str, tied: bool):
        self.hf_assets_path = hf_assets_path
        self.fqn_to_index_mapping = None
        self.tied = tied

    def to_hf(self, state_dict):
        return {k: v for k, v in state_dict.items() if not (self.tied and k == "lm_head.weight")}

    def from_hf(self, hf_state_dict):
        head = {"lm_head.weight": hf_state_dict["model.embed_tokens.weight"]} if self.tied else {}
        return {**hf_state_dict, **head}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_transformers_model_comes_in_and_goes_out_through_an_adapter_that_renames_nothing(tmp_path, tied):
    """What docs/hf.md says for a model with Hugging Face's own names: an adapter of TorchTitan's
    surface whose `to_hf` and `from_hf` change nothing but a tied head (which the files do not
    hold); `transformers` loads the export."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    torch.manual_seed(0)
    LlamaForCausalLM(hf_config).save_pretrained(tmp_path / "hf")

    torch.manual_seed(1)
    model = LlamaForCausalLM(hf_config)
    config = Checkpoint(enable=True, interval=1, initial_load_path=str(tmp_path / "hf"), initial_load_in_hf=True,
                        last_save_in_hf=True, export_dtype="float32")
    adapter = SameNames(str(tmp_path / "hf"), model.config.tie_word_embeddings)
    with CheckpointManager(config, model, state_dict_adapter=adapter, base_folder=str(tmp_path / "run")) as manager:
        assert manager.load()
        assert_same(model.state_dict(), LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict())
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        manager.save(1, last_step=True)
    exported = layout.step_dir(_folder(tmp_path / "run"), 1)
    back = LlamaForCausalLM.from_pretrained(exported)
    assert back.lm_head.weight is back.model.embed_tokens.weight if tied else not back.config.tie_word_embeddings
    tokens = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, model(tokens).logits)

    # the package's own adapter maps TorchTitan's names: for this model, it says to rename nothing,
    # when the manager is built (an export is configured)
    from torchtitan_ckpt.hf import AdapterMismatchError, adapter_for_hf_dir
    with pytest.raises(ConfigError, match=r"checkpoint.last_save_in_hf = True: state dict -> HF: .* the model's "
                                          r"names are already the Hugging Face folder's, which this adapter maps from "
                                          r"TorchTitan's: .*'SameNames'"):
        CheckpointManager(config, model, state_dict_adapter=adapter_for_hf_dir(str(tmp_path / "hf")),
                          base_folder=str(tmp_path / "run2"))
    config.last_save_in_hf = False  # at load(), where none is
    with pytest.raises(AdapterMismatchError, match=r"the model's names are already the Hugging Face folder's, "
                                                   r"which this adapter maps from TorchTitan's: .*'SameNames'"):
        with CheckpointManager(config, model, state_dict_adapter=adapter_for_hf_dir(str(tmp_path / "hf")),
                               base_folder=str(tmp_path / "run2")) as manager:
            manager.load()


def test_an_export_under_names_the_assets_model_does_not_have_is_refused_when_the_manager_is_built(tmp_path, caplog):
    """A peft model (its modules under `base_model.model`) exported through docs/hf.md's adapter
    that renames nothing: the export held peft's names under Llama's config.json, and
    `transformers` loaded it as a model started at random, with a warning table. Its names are
    now checked against the family of the assets' config when the manager is built; an adapter
    that gives the Hub's names exports, a name of the model's own beside them told."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    LlamaForCausalLM(hf_config).save_pretrained(tmp_path / "hf")
    wrapped = torch.nn.Module()  # peft's `PeftModel.base_model.model`
    wrapped.base_model = torch.nn.Module()
    wrapped.base_model.model = LlamaForCausalLM(hf_config)
    config = Checkpoint(enable=True, last_save_in_hf=True, export_dtype="float32")
    with pytest.raises(ConfigError, match=re.escape(
            "checkpoint.last_save_in_hf = True: none of the 12 tensor names the state-dict adapter's to_hf gives is "
            f"one of the Hugging Face model of {tmp_path}/hf/config.json, e.g. ['base_model.model.lm_head.weight', "
            "'base_model.model.model.embed_tokens.weight', 'base_model.model.model.layers.0.input_layernorm.weight']: "
            "transformers would read none of them")):
        CheckpointManager(config, wrapped, state_dict_adapter=SameNames(str(tmp_path / "hf"), False),
                          base_folder=str(tmp_path / "run"))

    class Unwrapped(SameNames):
        def to_hf(self, state_dict):
            return super().to_hf({k.removeprefix("base_model.model."): v for k, v in state_dict.items()})

    wrapped.base_model.model.register_buffer("seen", torch.zeros(1))  # a name of its own: exported, told
    with caplog.at_level(logging.WARNING, logger="torchtitan_ckpt"):
        with CheckpointManager(config, wrapped, state_dict_adapter=Unwrapped(str(tmp_path / "hf"), False),
                               base_folder=str(tmp_path / "run")) as manager:
            manager.save(1, last_step=True)
    assert [m for m in caplog.messages if "does not have" in m] == [
        f"the state-dict adapter's to_hf gives 1 tensor name(s) that the Hugging Face model of {tmp_path}/hf/config.json "
        "does not have, e.g. ['seen']: exported, and left unread by transformers"]
    back = LlamaForCausalLM.from_pretrained(layout.step_dir(_folder(tmp_path / "run"), 1))
    assert_same(back.state_dict(), {k: v for k, v in wrapped.base_model.model.state_dict().items() if k != "seen"})


def test_tensors_another_adapters_export_leaves_out_are_told_when_the_manager_is_built(tmp_path, caplog):
    """TorchTitan's Qwen3-MoE adapter leaves each MoE layer's `expert_bias` out of its export (the
    Hub's format has no place for it), which training moves: the export went through without a
    word, and its model routed otherwise. The tensors such an adapter leaves out are named when
    the manager is built; of an adapter that cannot take empty tensors, that they are not known."""
    from safetensors.torch import load_file

    os.makedirs(tmp_path / "assets")
    (tmp_path / "assets" / "config.json").write_text(json.dumps({"model_type": "toy"}))

    class DropsBias:
        hf_assets_path, fqn_to_index_mapping = str(tmp_path / "assets"), None

        def to_hf(self, state_dict):
            return {"model." + k: v for k, v in state_dict.items() if k != "expert_bias"}

        def from_hf(self, hf_state_dict):
            return {k.removeprefix("model."): v for k, v in hf_state_dict.items()}

    class ReadsValues(DropsBias):
        def to_hf(self, state_dict):
            assert state_dict["w"].sum().item() == state_dict["w"].sum().item()  # meta tensors have no value
            return super().to_hf(state_dict)

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.arange(4.0).reshape(2, 2))
    model.register_buffer("expert_bias", torch.tensor([0.05, -0.05]))
    config = Checkpoint(enable=True, interval=1, last_save_in_hf=True, export_dtype="float32")
    for adapter, told in ((DropsBias(), True), (ReadsValues(), False)):
        caplog.clear()
        folder = tmp_path / type(adapter).__name__
        with caplog.at_level("INFO", logger="torchtitan_ckpt.manager"):
            with CheckpointManager(config, model, state_dict_adapter=adapter, base_folder=str(folder)) as manager:
                warned = [m for m in caplog.messages if "leaves out" in m]
                assert warned == ([
                    "the Hugging Face export (checkpoint.last_save_in_hf) leaves out 1 model tensor(s) that the "
                    "state-dict adapter maps to no Hugging Face tensor, e.g. ['expert_bias']: the exported model "
                    "lacks them"] if told else [
                    "the Hugging Face export (checkpoint.last_save_in_hf): which model tensors it leaves out is not "
                    "known before it (on 1 rank(s) the state-dict adapter's to_hf and from_hf do not take empty "
                    "tensors of the model's shapes)"])
                manager.save(1, last_step=True)
        step = layout.step_dir(_folder(folder), 1)
        exported = {k: v for f in sorted(os.listdir(step)) if f.endswith(".safetensors")
                    for k, v in load_file(os.path.join(step, f)).items()}
        assert list(exported) == ["model.w"] and torch.equal(exported["model.w"], model.w.detach())


@pytest.mark.parametrize("counter, fits", [(torch.int64, True), (torch.int32, False)])
def test_an_adapter_of_the_users_gives_integers_read_into_narrower_ones_refused(tmp_path, counter, fits):
    """An adapter of the user's own (read through whole tensors): its int64 values were cast into
    the model's int32 buffer and wrapped, where the package's own adapters refused them."""
    from safetensors.torch import save_file

    from torchtitan_ckpt.errors import CheckpointError

    os.makedirs(tmp_path / "hf")
    save_file({"w": torch.ones(2, 2), "seen": torch.tensor([2**40 + 5])}, tmp_path / "hf" / "model.safetensors",
              metadata={"format": "pt"})

    class SameNames:
        hf_assets_path, fqn_to_index_mapping = str(tmp_path / "hf"), None

        def to_hf(self, state_dict):
            return dict(state_dict)

        def from_hf(self, hf_state_dict):
            return dict(hf_state_dict)

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(2, 2))
    model.register_buffer("seen", torch.zeros(1, dtype=counter))
    config = Checkpoint(enable=True, initial_load_path=str(tmp_path / "hf"), initial_load_in_hf=True)
    with CheckpointManager(config, model, state_dict_adapter=SameNames(), base_folder=str(tmp_path / "run")) as manager:
        if fits:
            assert manager.load() and model.seen.item() == 2**40 + 5 and torch.equal(model.w, torch.ones(2, 2))
        else:
            with pytest.raises(CheckpointError, match=r"does not fit this model: seen: torch.int64 from the adapter's "
                                                      r"from_hf, torch.int32 expected \(floating-point dtypes are "
                                                      "cast; others only into a dtype that holds each of their values"):
                manager.load()
            assert torch.equal(model.w, torch.zeros(2, 2))


def test_the_copies_folder_is_checked_before_training(tmp_path):
    """The folder of the hf_export_interval copies was looked at only by the first copy, after
    the training up to it: another job's checkpoint folder there lost its steps to the copies'
    retention (running, or ended), an initial checkpoint there was replaced by a copy and then
    deleted, and a file of that name failed the first copy. A job saving there while the
    exporting job runs is refused too (`test_a_job_into_a_running_jobs_copies_is_refused`)."""
    other = make_job(str(tmp_path), steps=4, interval=2, keep_latest_k=0, folder="checkpoint/hf")
    other.run_to(2, steps=4)
    other.manager.close()  # ended: its lock file stays, unheld (one running is `test_a_job_into_...`)
    with pytest.raises(ConfigError, match=r"the copies go into .*checkpoint/hf, which holds .*checkpoint/hf/step-2 in "
                                          r"DCP's format, no copy: another job's checkpoint folder\?"):
        make_job(str(tmp_path), steps=4, interval=2, hf_export_interval=2, keep_latest_k=1)
    assert layout.committed_steps(os.path.join(_folder(tmp_path), "hf")) == [2]

    copies = tmp_path / "b" / "checkpoint" / "hf"
    source = make_job(str(tmp_path / "b"), steps=2, interval=2, hf_export_interval=2, keep_latest_k=0)
    source.run_to(2, steps=2)
    source.manager.close()
    start = str(copies / "step-2")
    with pytest.raises(ConfigError, match=rf"checkpoint.initial_load_path = {re.escape(start)} is in "
                                          rf"{re.escape(str(copies))}, where this job's copies go"):
        make_job(str(tmp_path / "b"), steps=2, interval=2, hf_export_interval=2, initial_load_path=start,
                 initial_load_in_hf=True)
    assets = copies / "assets"  # beside the copies' step folders: never touched
    assets.mkdir()
    make_job(str(tmp_path / "b"), steps=2, interval=2, hf_export_interval=2, initial_load_path=str(assets),
             initial_load_in_hf=True).manager.close()
    (tmp_path / "c" / "checkpoint").mkdir(parents=True)
    (tmp_path / "c" / "checkpoint" / "hf").write_text("mine")
    with pytest.raises(ConfigError, match=r"the copies go into .*c/checkpoint/hf, which is not a folder"):
        make_job(str(tmp_path / "c"), steps=2, interval=2, hf_export_interval=2)
    assert (tmp_path / "c" / "checkpoint" / "hf").read_text() == "mine"


def test_a_job_into_a_running_jobs_copies_is_refused(tmp_path):
    """A job started with checkpoint.folder = X/hf while a job saving into X with
    hf_export_interval ran: the copies replaced its steps and their retention deleted them.
    Each job in a process of its own, as they run."""
    exporting = make_job(str(tmp_path), steps=4, interval=2, hf_export_interval=2, keep_latest_k=1)
    code = ("import sys, torch\nfrom torchtitan_ckpt import Checkpoint, CheckpointError, CheckpointManager\n"
            "try:\n    CheckpointManager(Checkpoint(enable=True, folder=sys.argv[1]), [torch.nn.Linear(2, 2)]).close()\n"
            "except CheckpointError as e:\n    print(e)\n")
    copies = os.path.join(_folder(tmp_path), "hf")
    run = subprocess.run([sys.executable, "-c", code, copies], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert re.match(rf"checkpoint.folder = '{re.escape(copies)}': another process \(pid {os.getpid()} on .*\) uses "
                    rf"{re.escape(copies)} to save into: one job saves into a folder at a time", run.stdout), \
        run.stdout + run.stderr[-3000:]
    clean = subprocess.run([sys.executable, "-m", "torchtitan_ckpt.cli", "clean", copies], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert clean.returncode == 2 and f"uses {copies} to save into: clean removes partial steps" in clean.stderr, \
        clean.stderr  # a copy in flight is a partial step: clean removed it
    exporting.run_to(2, steps=4)
    exporting.manager.close()
    assert commit.read_marker(layout.step_dir(copies, 2)).format == "hf"
