"""Config: TOML loading, overrides, and every validation error naming its key."""

from __future__ import annotations

import dataclasses
import os

import pytest

from torchtitan_ckpt import ConfigError
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.config import Checkpoint, field_docs
from torchtitan_ckpt.example.config import JobConfig

from .helpers import DEBUG_CONFIG, ROOT


def test_example_configs_load():
    configs = os.path.join(ROOT, "configs")
    for name in os.listdir(configs):
        assert load_job_config(os.path.join(configs, name)).checkpoint.enable


def test_defaults_match_torchtitan():
    ck = Checkpoint()
    assert (ck.enable, ck.folder, ck.interval, ck.initial_load_path) == (False, "checkpoint", 500, None)
    assert (ck.initial_load_model_only, ck.initial_load_in_hf) == (True, False)
    assert (ck.last_save_model_only, ck.last_save_in_hf, ck.export_dtype) == (True, False, "float32")
    assert (ck.async_mode, ck.keep_latest_k, ck.load_step) == ("disabled", 10, -1)
    assert ck.exclude_from_loading == []
    assert (ck.enable_first_step_checkpoint, ck.create_seed_checkpoint, ck.load_only) == (False, False, False)


def test_overrides_on_the_command_line():
    c = load_job_config(DEBUG_CONFIG, [
        "--checkpoint.interval", "10",
        "--checkpoint.exclude_from_loading", "dataloader,lr_scheduler",
        "--checkpoint.load_only",
        "--training.seq_len=32",
        "--optimizer.lr", "1e-3",
    ])
    assert c.checkpoint.interval == 10
    assert c.checkpoint.exclude_from_loading == ["dataloader", "lr_scheduler"]
    assert c.checkpoint.load_only is True
    assert c.training.seq_len == 32
    assert c.optimizer.lr == 1e-3
    assert c.checkpoint_folder == os.path.join("./outputs", "checkpoint")


def _error(argv, path=None) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load_job_config(path, argv)
    return e.value


@pytest.mark.parametrize("argv, key, text", [
    (["--checkpoint.intervall", "5"], "checkpoint.intervall", "did you mean 'interval'"),
    (["--checkpont.interval", "5"], "checkpont", "did you mean 'checkpoint'"),
    (["--checkpoint.interval", "five"], "checkpoint.interval", "expected an integer"),
    (["--checkpoint.interval", "0"], "checkpoint.interval", "expected >= 1"),
    (["--checkpoint.keep_latest_k", "-1"], "checkpoint.keep_latest_k", "expected >= 0"),
    (["--checkpoint.load_step", "-2"], "checkpoint.load_step", "expected >= -1"),
    (["--checkpoint.save_threads", "0"], "checkpoint.save_threads", "expected >= 1"),
    (["--checkpoint.load_threads", "0"], "checkpoint.load_threads", "expected >= 1"),
    (["--checkpoint.enable", "yes"], "checkpoint.enable", "expected a boolean"),
    (["--checkpoint.async_mode", "threads"], "checkpoint.async_mode", "expected one of 'disabled', 'async'"),
    (["--checkpoint.export_dtype", "fp8"], "checkpoint.export_dtype", "expected one of 'float16'"),
    (["--checkpoint.exclude_from_loading", "model"], "checkpoint.exclude_from_loading", "model is always loaded"),
    (["--checkpoint.exclude_from_loading", "optimizer,optimizer"], "checkpoint.exclude_from_loading", "twice"),
    (["--checkpoint.exclude_from_loading", "lr-scheduler"], "checkpoint.exclude_from_loading", "not a state name"),
    (["--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_model_only", "false"],
     "checkpoint.initial_load_in_hf", "initial_load_model_only = true"),
    (["--checkpoint.last_save_in_hf", "true", "--checkpoint.last_save_model_only", "false"],
     "checkpoint.last_save_in_hf", "last_save_model_only = true"),
    (["--checkpoint.hf_max_shard_size", "lots"], "checkpoint.hf_max_shard_size", "lots"),
    (["--checkpoint.hf_export_interval", "-1"], "checkpoint.hf_export_interval", "expected >= 0"),
    (["--checkpoint.initial_load_in_hf", "true"], "checkpoint.initial_load_in_hf", "model.hf_assets_path"),
    (["--model.hf_assets_path", "/nonexistent/hf"], "model.hf_assets_path", "existing folder"),
    (["--checkpoint.dedup_policy", "random"], "checkpoint.dedup_policy",
     "expected one of 'balanced', 'lowest_rank', 'replica_slices'"),
    (["--checkpoint.collective_timeout_s", "0"], "checkpoint.collective_timeout_s", "expected > 0"),
    (["--checkpoint.dedup_min_slice_bytes", "0"], "checkpoint.dedup_min_slice_bytes", "expected >= 1"),
    (["--parallelism.data_parallel_replicate_degree", "0"], "parallelism.data_parallel_replicate_degree",
     "expected >= 1"),
    (["--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--checkpoint.load_only"],
     "checkpoint.create_seed_checkpoint", "contradicts checkpoint.load_only"),
    (["--checkpoint.create_seed_checkpoint"], "checkpoint.create_seed_checkpoint", "checkpoint.enable = true"),
    (["--checkpoint.folder", ""], "checkpoint.folder", "non-empty"),
    (["--training.steps", "0"], "training.steps", "expected >= 1"),
    (["--training.seed", "1.5"], "training.seed", "expected an integer"),
    (["--optimizer.lr", "0"], "optimizer.lr", "expected > 0"),
    (["--model.flavor", "huge"], "model.flavor", "expected one of debugmodel"),
    (["--parallelism.data_parallel_shard_degree", "0"], "parallelism.data_parallel_shard_degree", "-1"),
    (["checkpoint.interval", "5"], "checkpoint.interval", "--section.key value"),
])
def test_validation_errors_name_the_key(argv, key, text):
    e = _error(argv)
    assert e.key == key
    assert str(e).startswith(key)
    assert text in str(e)




def test_toml_type_errors_and_unknown_sections(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[checkpoint]\ninterval = "5"\n')
    assert _error([], bad).key == "checkpoint.interval"
    bad.write_text("[checkpoint]\nexclude_from_loading = 3\n")
    assert _error([], bad).key == "checkpoint.exclude_from_loading"
    bad.write_text("[chekpoint]\nenable = true\n")
    assert "did you mean 'checkpoint'" in str(_error([], bad))
    bad.write_text("[checkpoint\n")
    assert _error([], bad).key == "--config"
    assert _error([], tmp_path / "missing.toml").key == "--config"


def test_every_field_has_a_docstring():
    from torchtitan_ckpt.config import sections
    import dataclasses

    for name, cls in sections(JobConfig).items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{name}.{f.name} has no docstring"


@dataclasses.dataclass
class _TitansSection:
    """The shape of TorchTitan 0.2's `[checkpoint]` section, some values changed (the real ones
    are built from each release in tests/torchtitan_interop.py)."""

    enable: bool = True
    enable_ft_dataloader_checkpoints: bool = True
    folder: str = "ckpt"
    interval: int = 50
    initial_load_in_hf_quantized: bool = False
    async_mode: str = "async"
    exclude_from_loading: list = dataclasses.field(default_factory=lambda: ["dataloader"])


def test_a_section_is_built_from_torchtitans(caplog):
    with caplog.at_level("INFO", logger="torchtitan_ckpt.config"):
        ck = Checkpoint.from_torchtitan(_TitansSection(), keep_latest_k=3)
    assert (ck.enable, ck.folder, ck.interval, ck.async_mode, ck.exclude_from_loading, ck.keep_latest_k) == (
        True, "ckpt", 50, "async", ["dataloader"], 3)
    assert ck.load_threads == Checkpoint().load_threads  # ours alone: our default
    assert "no equivalent here, left out: enable_ft_dataloader_checkpoints" in caplog.text
    with pytest.raises(ConfigError, match=r"^checkpoint.initial_load_in_hf_quantized = True: quantized"):
        Checkpoint.from_torchtitan(_TitansSection(initial_load_in_hf_quantized=True))
    with pytest.raises(ConfigError, match=r"^checkpoint.intervl = 5: unknown key; did you mean 'interval'\?"):
        Checkpoint.from_torchtitan(_TitansSection(), intervl=5)
    with pytest.raises(ConfigError, match=r"^checkpoint.interval = 0: expected >= 1"):
        Checkpoint.from_torchtitan(_TitansSection(interval=0))
    with pytest.raises(ConfigError, match=r"^checkpoint.initial_load_path = '': expected a path"):
        Checkpoint.from_torchtitan(_TitansSection(), initial_load_path="")
