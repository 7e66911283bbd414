"""The example job refuses at start, with a `ConfigError` naming the key, what its first step
(or a later one) would otherwise fail on with a raw exception; and takes `--config=FILE`."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from torchtitan_ckpt.errors import ConfigError
from torchtitan_ckpt.example import train
from torchtitan_ckpt.example.config import JobConfig, load_job_config
from torchtitan_ckpt.example.data import SyntheticTokens, build_dataloader
from torchtitan_ckpt.example.parallel import ParallelDims

from .helpers import DEBUG_CONFIG, ROOT

# ----------------------------------------------------------------------------- the seed


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 9223372036854775, -9223372036854775])
def test_every_64_bit_seed_draws_batches(seed):
    """`seed * 1_000_003 + index` overflowed torch's seed for |seed| above about 9.2e12."""
    inputs, labels = next(iter(build_dataloader(256, 4, 2, seed, 0, 1)))
    assert inputs.shape == labels.shape == (2, 4)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


@pytest.mark.parametrize("seed", [0, 7, -1, 9_000_000_000_000])
def test_the_data_of_seeds_that_fitted_is_unchanged(seed):
    """A run resumed across the fix sees the samples it would have seen before it."""
    data = SyntheticTokens(256, 6, seed)
    for index in (0, 1, 65535):
        g = torch.Generator().manual_seed(seed * 1_000_003 + index)
        start, stride = torch.randint(0, 256, (2,), generator=g).tolist()
        tokens = (start + (stride | 1) * torch.arange(7)) % 256
        assert [t.tolist() for t in data[index]] == [tokens[:-1].tolist(), tokens[1:].tolist()]


# ----------------------------------------------------------------------------- ranges at load


@pytest.mark.parametrize("argv,key,says", [
    (["--training.seq_len", "2049"], "training.seq_len",
     "flavor debugmodel takes at most max_seq_len (2048) tokens per sequence"),
    (["--training.seq_len", str(2**63 - 1)], "training.seq_len", "max_seq_len (2048)"),
    (["--training.local_batch_size", "65537", "--training.steps", "1"], "training.local_batch_size",
     "expected at most 65536: a data-parallel rank's share of the synthetic dataset (65536 samples over 1 rank(s))"),
    (["--training.local_batch_size", str(2**63 - 1), "--training.steps", "1"], "training.local_batch_size",
     "expected at most 65536"),
    (["--training.local_batch_size", "16385", "--training.steps", "1", "--parallelism.data_parallel_replicate_degree",
      "2", "--parallelism.data_parallel_shard_degree", "2"], "training.local_batch_size", "expected at most 16384"),
    (["--training.local_batch_size", "8192", "--training.steps", "9"], "training.steps",
     "the synthetic dataset (65536 samples over 1 data-parallel rank(s)) makes 8 batches of "
     "training.local_batch_size (8192) per rank; use at most 8 steps or a smaller batch"),
    (["--training.local_batch_size", "65536", "--training.steps", "2"], "training.steps", "makes 1 batches"),
    (["--training.steps", "8193"], "training.steps", "makes 8192 batches"),
    (["--optimizer.eps", "-1.0"], "optimizer.eps", "expected >= 0 and finite"),
    (["--optimizer.weight_decay", "-1.0"], "optimizer.weight_decay", "expected >= 0 and finite"),
])
def test_values_the_job_cannot_train_with_are_refused_at_load(argv, key, says):
    with pytest.raises(ConfigError) as e:
        load_job_config(DEBUG_CONFIG, argv)
    assert e.value.key == key
    assert str(e.value).startswith(f"{key} = {argv[argv.index('--' + key) + 1]}: ")
    assert says in str(e.value)


@pytest.mark.parametrize("folder,says", [
    ("s3://", "expected s3://bucket/prefix (no bucket given)"),  # joined: the bucket "checkpoint"
    ("s3:", "a mistyped URL (s3: without //)?"),
    ("gs://b/x", "gs:// is not a supported storage"),
])
def test_a_dump_folder_the_checkpoint_folder_cannot_be_under_is_refused_naming_it(folder, says):
    """The step folders go under it; the error names the key the user wrote, not the folder joined."""
    with pytest.raises(ConfigError, match=f"^job.dump_folder = {folder!r}: ") as e:
        load_job_config(DEBUG_CONFIG, ["--job.dump_folder", folder])
    assert says in str(e.value)


def test_the_limits_themselves_are_accepted():
    c = load_job_config(DEBUG_CONFIG, ["--training.seq_len", "2048", "--training.local_batch_size", "8192",
                                       "--training.steps", "8", "--optimizer.eps", "0",
                                       "--optimizer.weight_decay", "0", "--training.seed", str(-(2**63))])
    assert (c.training.seq_len, c.training.local_batch_size, c.training.steps) == (2048, 8192, 8)


@pytest.mark.parametrize("key,value", [("lr", math.nan), ("lr", math.inf), ("eps", math.nan), ("eps", -1e-9),
                                       ("weight_decay", math.inf), ("weight_decay", -0.5)])
def test_optimizer_values_set_in_python_are_checked_too(key, value):
    c = JobConfig()
    setattr(c.optimizer, key, value)
    with pytest.raises(ConfigError) as e:
        c.validate()
    assert (e.value.key, e.value.value) == (f"optimizer.{key}", value)


@pytest.mark.parametrize("argv", [["--training.seq_len", "2049"], ["--training.local_batch_size", "65537"],
                                  ["--optimizer.eps", "-1.0"], ["--optimizer.weight_decay", "-1.0"]])
def test_the_job_stops_at_start_with_the_config_error(tmp_path, capsys, argv):
    """The fuzzed cases: a message and status 2 before anything is written, not a traceback at step 1."""
    dump = tmp_path / "out"
    assert train.main(["--config", DEBUG_CONFIG, "--job.dump_folder", str(dump), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: {argv[0][2:]} = {argv[1]}: ") and err.count("\n") == 1, err
    assert not dump.exists()


# ----------------------------------------------------------------------------- the ranks, at start


@pytest.mark.parametrize("argv,world,key,says", [
    (["--training.local_batch_size", "32768", "--training.steps", "1"], 4, "training.local_batch_size",
     "expected at most 16384: a data-parallel rank's share of the synthetic dataset (65536 samples over 4 rank(s))"),
    (["--training.steps", "4096"], 4, "training.steps",
     "(65536 samples over 4 data-parallel rank(s)) makes 2048 batches"),
    (["--training.steps", "4097", "--parallelism.tensor_parallel_degree", "2"], 4, "training.steps",
     "(65536 samples over 2 data-parallel rank(s)) makes 4096 batches"),
])
def test_the_data_parallel_degree_of_the_ranks_is_checked_before_the_model_is_built(argv, world, key, says):
    """With data_parallel_shard_degree -1 the degree is known at start (the tp ranks share one
    data-parallel rank): checked before any mesh or process group is needed (there is none here)."""
    config = load_job_config(DEBUG_CONFIG, argv)
    with pytest.raises(ConfigError) as e:
        train.build_run(config, world, 0, torch.device("cpu"))
    assert e.value.key == key and says in str(e.value)


@pytest.mark.parametrize("argv,world,key,value", [
    (["--parallelism.tensor_parallel_degree", "2"], 1, "parallelism.tensor_parallel_degree", 2),
    (["--parallelism.pipeline_parallel_degree", "2"], 1, "parallelism.pipeline_parallel_degree", 2),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"], 2,
     "parallelism.tensor_parallel_degree", 2),
    (["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"], 1,
     "parallelism.tensor_parallel_degree", 2),
    (["--parallelism.data_parallel_replicate_degree", "3"], 4, "parallelism.data_parallel_replicate_degree", 3),
])
def test_degrees_that_do_not_divide_the_ranks_name_a_key_the_user_set(argv, world, key, value):
    """`--parallelism.tensor_parallel_degree 2` on one rank named data_parallel_replicate_degree = 1."""
    with pytest.raises(ConfigError) as e:
        ParallelDims.from_config(load_job_config(DEBUG_CONFIG, argv).parallelism, world)
    assert (e.value.key, e.value.value) == (key, value)
    assert f"must divide the number of ranks ({world})" in str(e.value)


# ----------------------------------------------------------------------------- --config


@pytest.mark.parametrize("form", ["--config FILE", "--config=FILE"])
def test_both_forms_of_config_read_the_file(tmp_path, capsys, form):
    """`--config=FILE` was taken for an override: `config = '...': unknown key`."""
    path = tmp_path / "job.toml"
    path.write_text("[training]\nsteps = 0\n")
    args = ["--config", str(path)] if form == "--config FILE" else [f"--config={path}"]
    assert train.main([*args, "--job.dump_folder", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == "config error: training.steps = 0: expected >= 1\n"


@pytest.mark.parametrize("argv,says", [
    (["--config", DEBUG_CONFIG, f"--config={DEBUG_CONFIG}"], "--config is given twice; pass one TOML file"),
    (["--config", DEBUG_CONFIG, "--config", DEBUG_CONFIG], "--config is given twice; pass one TOML file"),
    (["--training.steps", "1", "--config"], "--config needs a path to a TOML file"),
    (["--config", "--training.steps", "1"], "--config needs a path to a TOML file"),
    (["--config="], "--config needs a path to a TOML file"),
])
def test_config_given_wrongly_is_refused(argv, says):
    with pytest.raises(SystemExit, match=f"^{says}$"):
        train.main(argv)


def test_the_job_trains_with_config_equals_and_the_largest_seed(tmp_path):
    dump = str(tmp_path / "out")
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_ckpt.example.train", f"--config={DEBUG_CONFIG}", "--job.dump_folder", dump,
         "--training.steps", "2", "--training.seed", str(2**63 - 1)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "done at step 2" in log and os.path.isdir(os.path.join(dump, "checkpoint", "step-2"))


@pytest.mark.parametrize("flavor", ["llama31_debug", "qwen3_debug", "qwen3_moe_debug"])
def test_a_model_built_on_the_meta_device_is_whole_after_to_empty_and_init_weights(flavor):
    """`init_weights` left the norms' weights and the rotary table as `to_empty` made them
    (undefined memory; NaNs seen), and a tied head untied (`to_empty` makes each parameter
    anew): a fresh start from a meta-built model trained on garbage."""
    from torchtitan_ckpt.example.model import FLAVORS, Transformer

    built = Transformer(FLAVORS[flavor])
    torch.manual_seed(3)
    built.init_weights()
    with torch.device("meta"):
        model = Transformer(FLAVORS[flavor])
    model.to_empty(device="cpu")
    for t in [*model.parameters(), *model.buffers()]:  # what to_empty's memory may hold
        t.detach().view(torch.uint8).fill_(0xFF)
    torch.manual_seed(3)
    model.init_weights()
    assert set(model.state_dict()) == set(built.state_dict())
    for name, t in built.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    assert torch.equal(model.freqs_cis, built.freqs_cis)
    assert (model.output.weight is model.tok_embeddings.weight) == FLAVORS[flavor].tie_embeddings
