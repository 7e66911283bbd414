"""The example job's meshes without processes: which degrees each model and rank count accept
(a `ConfigError` naming the key otherwise), the data-parallel rank of each rank, the pipeline
stages as model parts, the device."""

from __future__ import annotations

import pytest
import torch

from torchtitan_ckpt import layout
from torchtitan_ckpt.errors import ConfigError
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.example.model import FLAVORS, Transformer
from torchtitan_ckpt.example.parallel import ParallelDims, pipeline_parts, select_device

from .helpers import losses, run_job


def _config(*argv: str):
    return load_job_config(None, list(argv))


@pytest.mark.parametrize("argv,key,says", [
    (["--model.flavor", "debugmodel", "--parallelism.tensor_parallel_degree", "4"],
     "parallelism.tensor_parallel_degree", "n_kv_heads of flavor debugmodel (2)"),
    (["--model.flavor", "debugmodel_mesh", "--parallelism.tensor_parallel_degree", "3"],
     "parallelism.tensor_parallel_degree", "n_heads of flavor debugmodel_mesh (4)"),
    (["--model.flavor", "qwen3_debug", "--parallelism.tensor_parallel_degree", "2"],
     "parallelism.tensor_parallel_degree", "q/k norms"),
    (["--parallelism.expert_parallel_degree", "2"], "parallelism.expert_parallel_degree", "no experts"),
    (["--model.flavor", "qwen3_moe_debug", "--parallelism.expert_parallel_degree", "3"],
     "parallelism.expert_parallel_degree", "number of experts of flavor qwen3_moe_debug (4)"),
    (["--model.flavor", "qwen3_moe_debug", "--parallelism.expert_parallel_degree", "2",
      "--parallelism.pipeline_parallel_degree", "2"],
     "parallelism.expert_parallel_degree", "expert parallelism inside pipeline stages is not built"),
    (["--model.flavor", "debugmodel", "--parallelism.pipeline_parallel_degree", "2",
      "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
     "parallelism.pipeline_parallel_degree", "4 stages and flavor debugmodel has 2 layers"),
    (["--model.flavor", "qwen3_debug", "--parallelism.pipeline_parallel_degree", "2"],
     "parallelism.pipeline_parallel_degree", "ties its embedding"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "3"],
     "parallelism.pipeline_parallel_microbatch_size", "local_batch_size (8)"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "8"],
     "parallelism.pipeline_parallel_microbatch_size", "makes 1 microbatches"),
    (["--parallelism.pipeline_parallel_schedule", "ZeroBubble"], "parallelism.pipeline_parallel_schedule", "GPipe"),
    (["--parallelism.tensor_parallel_degree", "0"], "parallelism.tensor_parallel_degree", ">= 1"),
    (["--training.device", "tpu"], "training.device", "auto, cpu, cuda"),
])
def test_degrees_the_model_cannot_take(argv, key, says):
    with pytest.raises(ConfigError) as e:
        _config(*argv)
    assert e.value.key == key and says in str(e.value)


@pytest.mark.parametrize("argv,world,key,says", [
    (["--model.flavor", "debugmodel_mesh", "--parallelism.tensor_parallel_degree", "4"], 2,
     "parallelism.tensor_parallel_degree", "= 4 must divide the number of ranks (2)"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "3"], 4,
     "parallelism.data_parallel_shard_degree", "= 6 must equal the number of ranks (4)"),
    (["--model.flavor", "qwen3_moe_debug", "--parallelism.expert_parallel_degree", "4",
      "--parallelism.data_parallel_replicate_degree", "2"], 4,
     "parallelism.expert_parallel_degree", "must divide data_parallel_shard_degree (2)"),
])
def test_degrees_that_do_not_fit_the_ranks(argv, world, key, says):
    with pytest.raises(ConfigError) as e:
        ParallelDims.from_config(_config(*argv).parallelism, world)
    assert e.value.key == key and says in str(e.value)


@pytest.mark.parametrize("argv,dims,dp_ranks", [
    ([], ParallelDims(dp_shard=4), [0, 1, 2, 3]),
    (["--parallelism.data_parallel_replicate_degree", "2"], ParallelDims(dp_replicate=2, dp_shard=2), [0, 1, 2, 3]),
    (["--parallelism.tensor_parallel_degree", "2"], ParallelDims(dp_shard=2, tp=2), [0, 0, 1, 1]),
    (["--parallelism.tensor_parallel_degree", "4"], ParallelDims(tp=4), [0, 0, 0, 0]),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
      "Interleaved1F1B"], ParallelDims(pp=2, dp_shard=2, stages_per_rank=2), [0, 1, 0, 1]),
    (["--model.flavor", "qwen3_moe_debug", "--parallelism.expert_parallel_degree", "2"],
     ParallelDims(dp_shard=4, ep=2), [0, 1, 2, 3]),
])
def test_layouts_on_4_ranks(argv, dims, dp_ranks):
    got = ParallelDims.from_config(_config("--model.flavor", "debugmodel_mesh", *argv).parallelism, 4)
    assert got == dims and [got.dp_rank(r) for r in range(4)] == dp_ranks


def test_pipeline_stages_are_model_parts_with_the_models_names():
    model = Transformer(FLAVORS["debugmodel_mesh"])
    dims = ParallelDims(pp=2, dp_shard=2, stages_per_rank=2)
    ranks = [pipeline_parts(model, dims, r) for r in range(2)]
    assert [[stage for stage, _ in parts] for parts in ranks] == [[0, 2], [1, 3]]
    keys = {stage: set(part.state_dict()) for parts in ranks for stage, part in parts}
    layer = lambda i: {k for k in model.state_dict() if k.startswith(f"layers.{i}.")}  # noqa: E731
    assert keys[0] == {"tok_embeddings.weight"} | layer(0)
    assert keys[1] == layer(1) and keys[2] == layer(2)
    assert keys[3] == layer(3) | {"norm.weight", "output.weight"}
    assert set().union(*keys.values()) == set(model.state_dict())
    first, last = ranks[0][0][1], ranks[1][1][1]
    tokens = torch.randint(0, 256, (2, 8))
    h = ranks[1][0][1](first(tokens))
    assert torch.equal(last(ranks[0][1][1](h)), model(tokens))  # the stages in turn are the model


def test_the_cpu_runs_on_gloo():
    assert select_device("cpu") == (torch.device("cpu"), "gloo")
    if not torch.cuda.is_available():
        assert select_device("auto") == (torch.device("cpu"), "gloo")
        with pytest.raises(ConfigError, match="no CUDA device"):
            select_device("cuda")


@pytest.mark.multirank
def test_the_job_refuses_degrees_that_do_not_fit_its_ranks_at_start(tmp_path):
    log = run_job(str(tmp_path), "--model.flavor", "debugmodel_mesh", "--parallelism.tensor_parallel_degree", "4",
                  nproc=2, expect_ok=False)
    assert "config error: parallelism.tensor_parallel_degree = 4" in log
    assert not (tmp_path / "checkpoint").exists()


@pytest.mark.multirank
def test_the_job_trains_a_pipeline_of_tensor_parallel_stages(tmp_path):
    """PP 2 x TP 2 through torchrun and the job's own start (device, group, meshes, schedule),
    stopped at step 2 and resumed there: every stage's tensors load on the ranks holding it
    (rank 0's stage alone once took the others' for a layer removed since the save)."""
    job = ("--model.flavor", "debugmodel_mesh", "--parallelism.pipeline_parallel_degree", "2",
           "--parallelism.tensor_parallel_degree", "2", "--training.steps", "4", "--training.local_batch_size", "2",
           "--training.seq_len", "16", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false")
    first = run_job(str(tmp_path), *job, "--training.stop_at_step", "2", nproc=4)
    assert "on 4 rank(s) (cpu)" in first and sorted(losses(first)) == [1, 2]
    log = run_job(str(tmp_path), *job, nproc=4)
    assert "loaded" in log and "model does not have" not in log and sorted(losses(log)) == [3, 4]
    assert layout.committed_steps(str(tmp_path / "checkpoint")) == [2, 4]


def _experts_as_on_one_process(rank: int, world_size: int) -> None:
    from torchtitan_ckpt.example.train import build_model, build_run

    config = _config("--model.flavor", "qwen3_moe_debug", "--parallelism.expert_parallel_degree", "2")
    run = build_run(config, world_size, rank, torch.device("cpu"))
    vocab = FLAVORS["qwen3_moe_debug"].vocab_size
    tokens = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = run.parts[0](tokens), build_model(config)(tokens)  # the same seed: the same weights
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.multirank
def test_expert_parallel_logits_are_one_processs(tmp_path):
    """EP 2 x FSDP 2 computes what one process does with the same weights. The experts a rank
    holds were counted outside their module's forward, where FSDP keeps them sharded: half of
    them were never used (logits off by 2e-3)."""
    from .helpers import spawn

    spawn(4, _experts_as_on_one_process)


@pytest.mark.multirank
def test_expert_parallel_training_where_ranks_route_tokens_unevenly(tmp_path):
    """Two tokens per rank: some experts get no token on one rank and some on its FSDP peer. The
    experts' module was called once per expert that got a token, each call an FSDP all-gather,
    so the peers' counts differed and the job hung in its second step."""
    log = run_job(str(tmp_path), "--model.flavor", "qwen3_moe_debug", "--parallelism.expert_parallel_degree", "2",
                  "--training.local_batch_size", "1", "--training.seq_len", "2", "--training.steps", "4",
                  "--checkpoint.enable", "false", nproc=4)
    assert sorted(losses(log)) == [1, 2, 3, 4]
