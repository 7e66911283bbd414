"""Config: TOML loading, overrides, and every validation error naming its key."""

from __future__ import annotations

import dataclasses
import os
import typing

import numpy as np
import pytest
import torch

from torchtitan_ckpt import CheckpointManager, ConfigError
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.config import Checkpoint, DedupPolicy, ExportDtype, field_docs, load_config
from torchtitan_ckpt.io.dtypes import EXPORT_DTYPES
from torchtitan_ckpt.policy.dedup import POLICIES
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
    (["--config", "job.toml"], "--config", "the TOML file is load_config's path"),
    (["train.py", "--checkpoint.interval", "5"], "train.py", "no program name: sys.argv[1:]"),
    (["--checkpont.interval", "5"], "checkpont", "did you mean 'checkpoint'"),
    (["--checkpoint.interval", "five"], "checkpoint.interval", "expected an integer"),
    (["--checkpoint.interval", "\u0663"], "checkpoint.interval", "expected an integer"),  # int() read an Arabic 3
    (["--checkpoint.interval", "1_000"], "checkpoint.interval", "expected an integer"),
    (["--checkpoint.interval", "2.0"], "checkpoint.interval", "expected an integer"),
    (["--checkpoint.collective_timeout_s", "nan"], "checkpoint.collective_timeout_s", "expected a finite number"),
    (["--checkpoint.interval", "9" * 5000], "checkpoint.interval", "expected an integer"),  # int()'s digit limit
    (["--checkpoint.keep_latest_k", "1", "--checkpoint.folderr", "x"], "checkpoint.folderr", "did you mean 'folder'"),
    (["--checkpoint.zzz", "1"], "checkpoint.zzz", "unknown key; valid: "),
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
    (["--checkpoint.collective_timeout_s", "0.05"], "checkpoint.collective_timeout_s", "expected >= 1.0"),
    (["--checkpoint.storage_timeout_s", "0.001"], "checkpoint.storage_timeout_s", "expected >= 1.0"),
    (["--checkpoint.dedup_min_slice_bytes", "0"], "checkpoint.dedup_min_slice_bytes", "expected >= 1"),
    (["--parallelism.data_parallel_replicate_degree", "0"], "parallelism.data_parallel_replicate_degree",
     "expected >= 1"),
    (["--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--checkpoint.load_only"],
     "checkpoint.create_seed_checkpoint", "contradicts checkpoint.load_only"),
    (["--checkpoint.create_seed_checkpoint"], "checkpoint.create_seed_checkpoint", "checkpoint.enable = true"),
    (["--checkpoint.folder", ""], "checkpoint.folder", "non-empty"),
    (["--checkpoint.folder", "s3:/bkt/x"], "checkpoint.folder", "a mistyped URL (s3: without //)?"),
    (["--checkpoint.folder", "s3:"], "checkpoint.folder", "or for a local folder of that name ./s3:"),
    (["--checkpoint.folder", " s3://bkt/x"], "checkpoint.folder", "starts or ends with white space"),
    (["--checkpoint.initial_load_path", "s3:/bkt/x"], "checkpoint.initial_load_path", "a mistyped URL"),
    (["--checkpoint.staging_folder", "s3://bkt/x"], "checkpoint.staging_folder", "expected a local folder, not a URL"),
    (["--checkpoint.staging_folder", "s3:/x"], "checkpoint.staging_folder", "expected a local folder, not a URL"),
    (["--training.steps", "0"], "training.steps", "expected >= 1"),
    (["--training.seed", "1.5"], "training.seed", "expected an integer"),
    (["--optimizer.lr", "0"], "optimizer.lr", "expected > 0"),
    (["--model.flavor", "huge"], "model.flavor", "expected one of debugmodel"),
    (["--parallelism.data_parallel_shard_degree", "0"], "parallelism.data_parallel_shard_degree", "-1"),
    (["checkpoint.interval", "5"], "checkpoint.interval", "--section.key value"),
    # settings that would do nothing, found out after the run (a review of the config as users write it)
    (["--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.hf_export_interval", "1"],
     "checkpoint.hf_export_interval",
     "a Hugging Face export is a save, and checkpoint.load_only = true never saves"),
    (["--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.last_save_in_hf"], "checkpoint.last_save_in_hf",
     "never saves"),
    (["--checkpoint.folder", "~/ckpt"], "checkpoint.folder", "neither '~' nor an environment variable is expanded"),
    (["--checkpoint.initial_load_path", "$SCRATCH/run/step-10"], "checkpoint.initial_load_path", "is expanded"),
    (["--checkpoint.staging_folder", "/tmp/${USER}"], "checkpoint.staging_folder", "is expanded"),
    (["--checkpoint.enable_ft_dataloader_checkpoints", "bogus"], "checkpoint.enable_ft_dataloader_checkpoints",
     "expected a boolean"),
    (["--checkpoint.folder", "/"], "checkpoint.folder", "is the root folder: this package's files would be made there"),
    (["--checkpoint.folder", "s3://bkt/ckpt", "--checkpoint.upload_part_size", "5GiB",
      "--checkpoint.upload_parallel_parts", "256"],
     "checkpoint.upload_parallel_parts", "hold 1280.0 GiB of part buffers, more than half of this machine's"),
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
    bad.write_text("[checkpoint]\ninterval = " + "9" * 5000 + "\n")  # past int()'s digit limit: a raw ValueError
    assert "is not valid TOML: Exceeds the limit (4300 digits)" in str(_error([], bad))
    bad.write_text("[checkpoint]\ncollective_timeout_s = 1" + "0" * 400 + "\n")  # no float holds it: OverflowError
    assert str(_error([], bad)) == "checkpoint.collective_timeout_s = <an int of 1329 bits>: expected a finite number"


@pytest.mark.parametrize("key, text", [
    ("enable_checkpoint = true", "TorchTitan's earlier name of checkpoint.enable"),
    ("model_weights_only = true", "TorchTitan's earlier name of checkpoint.last_save_model_only"),
    ("initial_load_in_hf_quantized = true", "quantized Hugging Face checkpoints are not read"),
])
def test_torchtitans_keys_we_lack_are_named_for_what_they_are(tmp_path, key, text):
    """The closest key by spelling has another meaning (`enable_first_step_checkpoint` for
    `enable_checkpoint`, `initial_load_in_hf` for the quantized one)."""
    bad = tmp_path / "titan.toml"
    bad.write_text(f"[checkpoint]\n{key}\n")
    message = str(_error([], bad))
    assert text in message and "did you mean" not in message


def test_a_torchtitan_job_config_loads_as_torchtitan_reads_it(tmp_path, caplog):
    """TorchTitan 0.2.2's own defaults for the keys we lack change nothing here: left out with
    a log line, as `Checkpoint.from_torchtitan` leaves them. `initial_load_path = ""` is unset,
    as TorchTitan reads it; its parser's `--section.no_flag` and `--section.key-name` work."""
    titan = tmp_path / "titan.toml"
    titan.write_text('[checkpoint]\nenable = true\nenable_ft_dataloader_checkpoints = true\n'
                     'initial_load_in_hf_quantized = false\ninitial_load_path = ""\n')
    with caplog.at_level("INFO", logger="torchtitan_ckpt.config"):
        ck = load_job_config(titan, ["--checkpoint.no_initial_load_model_only", "--checkpoint.keep-latest-k", "3",
                                     "--checkpoint.no-last-save-model-only"]).checkpoint
    assert (ck.initial_load_path, ck.initial_load_model_only, ck.keep_latest_k, ck.last_save_model_only) == (
        None, False, 3, False)
    assert "checkpoint.enable_ft_dataloader_checkpoints = True: TorchTitan's setting, with no effect" in caplog.text
    assert "checkpoint.initial_load_in_hf_quantized = False: TorchTitan's setting, with no effect" in caplog.text
    assert _error(["--checkpoint.no_interval"], titan).key == "checkpoint.no_interval"  # not a flag: unknown
    ck = load_job_config(titan, ["--checkpoint.no-enable-ft-dataloader-checkpoints",
                                 "--checkpoint.no_initial_load_in_hf_quantized"]).checkpoint  # their flags' no- forms
    assert ck.enable


@pytest.mark.parametrize("argv, key", [
    (["--checkpoint.initial_load_path", "/ckpt/step-10"], "initial_load_path = '/ckpt/step-10'"),
    (["--checkpoint.load_only"], "load_only = True"),
    (["--checkpoint.load_step", "5"], "load_step = 5"),
])
def test_loading_settings_with_checkpointing_off_are_warned_of(argv, key, caplog):
    """The job trained from its initial weights with one INFO line saying checkpointing was off
    (a refusal would stop a debug run's `--checkpoint.no_enable` over a production TOML). Said
    once, though the manager checks the section again."""
    with caplog.at_level("WARNING"):
        config = load_job_config(DEBUG_CONFIG, [*argv, "--checkpoint.no_enable"]).checkpoint
        CheckpointManager(config, torch.nn.Linear(2, 2)).close()
    assert not config.enable
    assert caplog.text.count(f"checkpoint.{key} does not apply: with checkpoint.enable = false nothing is loaded, "
                             "and the job starts from its initial weights") == 1
    assert "part buffers" not in caplog.text
    load_job_config(DEBUG_CONFIG, ["--checkpoint.upload_part_size", "5GiB", "--checkpoint.upload_parallel_parts",
                                   "256"])  # no object storage: its buffers are never made


@pytest.mark.parametrize("argv, enabled", [
    (["--checkpoint.no_enable", "--checkpoint.enable", "true"], True),
    (["--checkpoint.enable", "true", "--checkpoint.no_enable"], False),
    (["--checkpoint.no_enable", "--checkpoint.enable"], True),
])
def test_the_last_of_a_flag_and_its_no_form_wins(argv, enabled):
    """A `no_` flag given before the key itself won, where the TOML holds the key (the debug
    config's `enable = true`)."""
    assert load_job_config(DEBUG_CONFIG, argv).checkpoint.enable is enabled


@dataclasses.dataclass
class _Trainer:
    ckpt: Checkpoint = dataclasses.field(default_factory=Checkpoint)


@dataclasses.dataclass
class _Embedding:
    trainer: _Trainer = dataclasses.field(default_factory=_Trainer)


def test_torchtitans_keys_are_known_in_a_section_embedded_under_another_name(tmp_path, caplog):
    """They were looked up as `checkpoint.<key>`: under `[trainer.ckpt]`, TorchFT's setting was
    an unknown key ("did you mean 'enable_first_step_checkpoint'?") and the message of an earlier
    name named `checkpoint.enable`."""
    config = tmp_path / "job.toml"
    config.write_text("[trainer.ckpt]\nenable = true\nenable_ft_dataloader_checkpoints = true\n")
    with caplog.at_level("INFO", logger="torchtitan_ckpt.config"):
        assert load_config(_Embedding, config, ["--trainer.ckpt.no-enable-ft-dataloader-checkpoints"]).trainer.ckpt.enable
    assert "trainer.ckpt.enable_ft_dataloader_checkpoints = False: TorchTitan's setting" in caplog.text
    with pytest.raises(ConfigError, match=r"^trainer.ckpt.enable_checkpoint = True: unknown key: TorchTitan's "
                                          r"earlier name of trainer.ckpt.enable$"):
        load_config(_Embedding, config, ["--trainer.ckpt.enable_checkpoint"])


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
    assert Checkpoint.from_torchtitan(_TitansSection(), initial_load_path="").initial_load_path is None  # unset


@pytest.mark.parametrize("values, key, text", [
    (dict(async_mode="sync"), "checkpoint.async_mode", "expected one of 'disabled', 'async', 'async_with_pinned_mem'"),
    (dict(export_dtype="bf16"), "checkpoint.export_dtype", "expected one of 'float16', 'bfloat16', 'float32'"),
    (dict(dedup_policy="round_robin"), "checkpoint.dedup_policy", "expected one of 'balanced'"),
    (dict(io_engine="Fast"), "checkpoint.io_engine", "expected one of 'fast', 'torch'"),
    (dict(consolidation="rank_0"), "checkpoint.consolidation", "expected one of 'one_pass'"),
    (dict(interval="5"), "checkpoint.interval", "expected an integer"),
    (dict(load_step=None), "checkpoint.load_step", "expected an integer"),
    (dict(keep_latest_k=2.5), "checkpoint.keep_latest_k", "expected an integer"),
    (dict(enable="false"), "checkpoint.enable", "expected a boolean"),
    (dict(exclude_from_loading="optimizer"), "checkpoint.exclude_from_loading", "expected a list"),
    (dict(folder=b"ckpt"), "checkpoint.folder", "expected a string"),
])
def test_a_section_built_in_python_is_checked_as_a_loaded_one(values, key, text):
    """Every field's type and choices, as the TOML loader checks them: a value of the wrong type,
    or not among a key's choices, was taken as it was (async_mode = "sync" made saves run in the
    background, export_dtype = "bf16" failed the last save)."""
    for build in (lambda: Checkpoint(**values).validate(), lambda: Checkpoint.from_torchtitan(_TitansSection(), **values)):
        with pytest.raises(ConfigError) as e:
            build()
        assert e.value.key == key and text in str(e.value)


def test_a_section_built_in_python_is_converted_as_a_loaded_one(tmp_path):
    """Paths may be `os.PathLike`, async_mode is read in any case (TorchTitan lower-cases it), a
    tuple is a list: `validate()` returns the section as the loader builds it, leaving the
    caller's as it is."""
    mine = Checkpoint(enable=True, folder=tmp_path / "ck", initial_load_path=tmp_path / "init", async_mode="Disabled",
                      exclude_from_loading=("dataloader",))
    ck = mine.validate()
    assert (ck.folder, ck.initial_load_path, ck.async_mode, ck.exclude_from_loading) == (
        str(tmp_path / "ck"), str(tmp_path / "init"), "disabled", ["dataloader"])
    assert mine.async_mode == "Disabled"
    mine.exclude_from_loading = ()
    with CheckpointManager(mine, torch.nn.Linear(2, 2)) as manager:  # saves in the foreground, as asked
        assert manager.config.async_mode == "disabled" and manager.config.folder == str(tmp_path / "ck")
    assert Checkpoint.from_torchtitan(_TitansSection(async_mode="ASYNC_WITH_PINNED_MEM")).async_mode == \
        "async_with_pinned_mem"
    assert load_job_config(None, ["--checkpoint.async_mode", "Async"]).checkpoint.async_mode == "async"
    numpys = Checkpoint(interval=np.int64(5), collective_timeout_s=np.float32(30.0)).validate()  # a trainer's numbers
    assert (type(numpys.interval), numpys.interval, type(numpys.collective_timeout_s)) == (int, 5, float)
    with pytest.raises(ConfigError, match="checkpoint.interval = np.float64\\(5.0\\): expected an integer"):
        Checkpoint(interval=np.float64(5.0)).validate()


def test_the_config_names_what_the_registries_hold():
    """The values a key accepts (its `Literal`) are the names the code looks up: a policy, a
    dtype or a mode added to one and not the other would pass validation and fail mid-save."""
    assert set(typing.get_args(DedupPolicy)) == set(POLICIES)
    assert set(typing.get_args(ExportDtype)) == set(EXPORT_DTYPES)


def test_a_folder_a_file_system_cannot_make_is_refused_before_any_level_is_made(tmp_path):
    """A name over NAME_MAX bytes, or a path whose levels outgrow PATH_MAX (less room for the files
    made in it), is refused naming the key: `makedirs` made the levels above it, then failed."""
    long_name = str(tmp_path / "a" / ("x" * 256) / "c")
    too_deep = str(tmp_path / "/".join(["d" * 200] * 20))
    for key, value, text in (("folder", long_name, "holds a name of 256 bytes; the file system takes at most 255"),
                             ("staging_folder", long_name, "holds a name of 256 bytes"),
                             ("folder", too_deep, f"gives a folder path of {len(too_deep)} bytes; at most 3968")):
        with pytest.raises(ConfigError) as e:
            Checkpoint(**{key: value}).validate()
        assert (e.value.key, e.value.value) == ("checkpoint." + key, value) and text in str(e.value)
    with pytest.raises(ConfigError, match=r"^checkpoint.folder = 'a\\ud800': is not a path this system can encode"):
        Checkpoint(folder="a\ud800").validate()
    with pytest.raises(ConfigError, match="^checkpoint.folder = "):
        CheckpointManager(Checkpoint(enable=True, folder=too_deep), torch.nn.Linear(2, 2))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("base, key, text", [
    ("s3://", "base_folder", "expected s3://bucket/prefix (no bucket given)"),
    ("gs://bkt/run", "base_folder", "gs:// is not a supported storage"),
    ("s3:", "base_folder", "a mistyped URL (s3: without //)?"),
    ("out ", "base_folder", "starts or ends with white space"),
    ("x" * 256, "base_folder", "holds a name of 256 bytes"),
    (None, "base_folder", "expected a string"),
    ("s3://bkt/run", "checkpoint.consolidation", "to object storage (base_folder = 's3://bkt/run') is written in one "
                                                 "pass"),
])
def test_the_folder_under_a_base_folder_is_checked_as_the_folder_is(base, key, text):
    """The manager's `base_folder` (a TorchTitan job's `job.dump_folder`) joined with `folder`: a
    URL there was taken unchecked ("s3://" made `checkpoint` the bucket; a two-phase export to
    object storage failed at the first export), or refused naming `folder` with a value no one
    wrote."""
    ck = Checkpoint(hf_export_interval=10, consolidation="rank0").validate()
    with pytest.raises(ConfigError) as e:
        ck.folder_under(base)
    assert e.value.key == key and text in str(e.value)
    assert Checkpoint().validate().folder_under("s3://bkt/run/") == "s3://bkt/run/checkpoint"
    assert Checkpoint().validate().folder_under("out") == os.path.join("out", "checkpoint")
    assert Checkpoint(folder="/abs").validate().folder_under("s3://") == "/abs"  # the base folder is not used
    assert Checkpoint(folder="s3://bkt/x").validate().folder_under("gs://y") == "s3://bkt/x"


def test_a_deep_folder_is_measured_as_the_kernel_walks_it_with_room_for_a_step(tmp_path, monkeypatch):
    """An existing folder whose path leaves room for a step's file names is taken (a save there
    worked before the check existed), spelt absolute or relative to the working directory; the
    staging folder keeps room for a URL's folder too. Joined under a base folder, the error
    names both settings."""
    levels = [tmp_path]
    while len(str(levels[-1])) < 3700:
        levels.append(levels[-1] / ("d" * 200))
    deep = levels[-1]
    deep.mkdir(parents=True)
    assert Checkpoint(folder=str(deep)).validate()
    monkeypatch.chdir(levels[-2])
    assert Checkpoint(folder=deep.name).validate()
    with pytest.raises(ConfigError, match=r"^checkpoint.staging_folder = '.*': gives a folder path of \d+ bytes; "
                                          "at most 3584"):
        Checkpoint(staging_folder=deep.name).validate()
    monkeypatch.chdir(tmp_path)
    folder = "f" * 200 + "/" + "f" * 200
    with pytest.raises(ConfigError) as e:
        Checkpoint(folder=folder).validate().folder_under(str(levels[-2]))
    assert e.value.key == "base_folder" and f"(with checkpoint.folder = '{folder}' under it)" in str(e.value)


@pytest.mark.parametrize("folder", ["C:/ckpt", "exp:/ckpt", "run:", "hf:org/model", "runs/2024-01-01T10:00"])
def test_a_local_name_with_a_colon_is_a_local_folder(folder):
    """Only a supported store's scheme makes a mistyped URL; other names stay the paths they were."""
    assert Checkpoint(folder=folder).validate().folder == folder


def test_a_config_value_nested_a_thousand_deep_is_refused_with_a_short_message(tmp_path):
    """A dotted key of a thousand parts is a table nested a thousand deep; printing it in the
    error overflowed the stack (RecursionError). An int of 5000 digits, which `repr` refuses,
    is named too."""
    toml = tmp_path / "deep.toml"
    toml.write_text("[checkpoint]\nx" + ".x" * 1000 + " = 1\n")
    for path, argv in ((toml, []), (None, ["--checkpoint" + ".x" * 1000, "1"])):
        e = _error(argv, path)
        if path is not None and e.key == "--config":  # tomli 2.5 (Python 3.10) refuses over 1000 parts itself
            assert str(e) == f"--config = '{toml}': is nested too deeply to be a job config"
            continue
        assert e.key == "checkpoint.x"
        assert str(e).startswith("checkpoint.x = {'x': {'x': {'x': {'x': {...}}}}}: unknown section")
    with pytest.raises(ConfigError, match=r"^checkpoint.interval = <an int of 16610 bits>: expected an integer"):
        Checkpoint(interval=10**5000).validate()


def test_misusing_the_loaders_api_is_a_type_error_saying_what_to_pass():
    with pytest.raises(TypeError, match=r"^argv\[1\] is of type int; argv holds strings"):
        load_job_config(None, ["--checkpoint.interval", 5])
    with pytest.raises(TypeError, match=r"^argv is of type str; pass a list of strings"):
        load_job_config(None, "--checkpoint.interval 5")
    for section in ({"enable": True}, None, _Slotted()):
        with pytest.raises(TypeError, match=r"not TorchTitan's \[checkpoint\] section .* pass job_config.checkpoint"):
            Checkpoint.from_torchtitan(section)


class _Slotted:
    __slots__ = ("enable", "folder")


def test_an_option_given_without_its_value_is_said_so():
    """`--checkpoint.folder --checkpoint.interval 5` read the folder as `true` and said only
    "checkpoint.folder = True: expected a string"."""
    with pytest.raises(ConfigError, match=r"^checkpoint.folder = True: expected a string .*; --checkpoint.folder was "
                                          r"given without a value \(alone, an option sets a boolean key to true\)$"):
        load_job_config(None, ["--checkpoint.folder", "--checkpoint.interval", "5"])
    assert load_job_config(None, ["--checkpoint.enable", "--checkpoint.interval", "5"]).checkpoint.enable


def test_sizes_are_taken_as_a_number_of_bytes_too(tmp_path):
    """`hf_max_shard_size = 5000000000` in a TOML file said "expected a string"."""
    toml = tmp_path / "job.toml"
    toml.write_text("[checkpoint]\nhf_max_shard_size = 2000000000\nupload_part_size = 16777216\n")
    ck = load_job_config(str(toml), []).checkpoint
    assert (ck.hf_max_shard_size, ck.upload_part_size) == (2000000000, 16777216)
    given = load_job_config(str(toml), ["--checkpoint.hf_max_shard_size", "300MB"]).checkpoint
    assert given.hf_max_shard_size == "300MB"
    toml.write_text("[checkpoint]\nhf_max_shard_size = true\n")
    with pytest.raises(ConfigError, match=r"^checkpoint.hf_max_shard_size = True: expected a string \(without NUL "
                                          r"characters\), or an integer within 64 bits$"):
        load_job_config(str(toml), [])
    with pytest.raises(ConfigError, match="size 0 must be positive"):
        Checkpoint(hf_max_shard_size=0).validate()
