"""Both directions between TorchTitan's own `CheckpointManager` and ours, with the real torchtitan
package (0.2.2 or 0.3.0, whichever is importable) on 2 gloo ranks: its llama3 debug model as it
ships (0.3.0: fused QKV), FSDP2, AdamW and TorchTitan's LR scheduler. Run by
tests/test_torchtitan_interop.py under torchrun; rank 0 prints `OK <check>` for each check passed.

    torchrun --standalone --nproc_per_node 2 tests/torchtitan_interop.py OUT_DIR

On CPU: TorchTitan picks "cuda" as its device when none is found (its `device_type`), so the mesh
is built on "cpu" here; FSDP's `PREMUL_SUM(1.0)` reduction, which gloo lacks, is the same as a
SUM; 0.3.0's FlexAttention has no CPU backward, so its attention runs as SDPA (no parameters:
the state dict is the same).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset

import torchtitan.distributed.parallel_dims as titan_parallel_dims

from torchtitan_ckpt import CheckpointManager, layout
from torchtitan_ckpt.config import Checkpoint

VERSION = importlib.metadata.version("torchtitan")
SEQ, BATCH, VOCAB = 32, 2, 2048
titan_parallel_dims.device_type = "cpu"


class Tokens(IterableDataset, Stateful):
    """A token stream whose position resumes: sample i of rank r depends on (r, i) only."""

    def __init__(self, rank: int):
        self.rank, self.index = rank, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(1000 * self.rank + self.index)
            self.index += 1
            x = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            yield {"input": x[:-1]}, x[1:]

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.index = state_dict["index"]


class TrainState(Stateful):
    """TorchTitan's trainer saves these two under `train_state`."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


@dataclass
class Stack:
    model: torch.nn.Module
    optimizers: Any
    schedulers: Any
    dataloader: Any
    train_state: TrainState
    adapter: Any
    loss: Any
    titan_config: Any
    batches: Any = None

    def parts(self) -> dict[str, Any]:
        return dict(model_parts=[self.model], optimizers=self.optimizers, lr_schedulers=self.schedulers,
                    dataloader=self.dataloader, states={"train_state": self.train_state})

    def train(self, steps: int) -> None:
        if self.batches is None:
            self.batches = iter(self.dataloader)
        for _ in range(steps):
            inputs, labels = next(self.batches)
            self.optimizers.zero_grad()
            self.loss(self.model(inputs["input"]), labels).backward()
            self.optimizers.step()
            self.schedulers.step()
            self.train_state.step += 1
            self.train_state.ntokens_seen += labels.numel()


def _sum_reductions(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def _init(model: torch.nn.Module, seed: int) -> None:
    _sum_reductions(model)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()


def _stack_022(rank: int, world: int, seed: int) -> Stack:
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.train_spec import get_train_spec

    jc = JobConfig()
    jc.model.name, jc.model.flavor = "llama3", "debugmodel"
    jc.training.seq_len, jc.training.local_batch_size, jc.training.steps = SEQ, BATCH, 10
    jc.training.mixed_precision_param = "float32"
    jc.parallelism.data_parallel_shard_degree = -1
    jc.optimizer.implementation = "foreach"
    jc.lr_scheduler.warmup_steps = 2
    jc.checkpoint.enable, jc.checkpoint.interval, jc.checkpoint.keep_latest_k = True, 1, 0
    jc.checkpoint.last_save_model_only = False
    spec = get_train_spec("llama3")
    args = spec.model_args["debugmodel"]
    args.update_from_config(jc)
    with torch.device("meta"):
        model = spec.model_cls(args)
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world)
    model = spec.parallelize_fn(model, dims, jc)
    _init(model, seed)
    optimizers = spec.build_optimizers_fn([model], jc.optimizer, dims)
    schedulers = spec.build_lr_schedulers_fn(optimizers, jc.lr_scheduler, jc.training.steps)
    loader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=BATCH)
    return Stack(model, optimizers, schedulers, loader, TrainState(), spec.state_dict_adapter(args, None),
                 spec.build_loss_fn(jc), jc.checkpoint)


def _stack_030(rank: int, world: int, seed: int) -> Stack:
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3StateDictAdapter, model_registry, parallelize_llama
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    cfg = llama3_debugmodel()
    cfg.model_spec = model_registry("debugmodel")
    for block in cfg.model_spec.model.layers:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg.training.seq_len, cfg.training.local_batch_size, cfg.training.steps = SEQ, BATCH, 10
    cfg.training.mixed_precision_param = "float32"
    cfg.optimizer.implementation = "foreach"
    cfg.lr_scheduler.warmup_steps = 2
    cfg.checkpoint.enable, cfg.checkpoint.interval, cfg.checkpoint.keep_latest_k = True, 1, 0
    cfg.checkpoint.last_save_model_only = False
    # torch 2.13's fully_shard rejects the plain tensors of the default "spmd_types" backend
    cfg.parallelism.spmd_backend = "partial_dtensor"
    model_config = cfg.model_spec.model
    model_config.update_from_config(config=cfg)
    with torch.device("meta"):
        model = model_config.build()
    dims = ParallelDims.from_config(cfg.parallelism, world)
    dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)
    model = parallelize_llama(model, parallel_dims=dims, training=cfg.training, parallelism=cfg.parallelism,
                              compile_config=cfg.compile, ac_config=cfg.activation_checkpoint,
                              dump_folder="")
    _init(model, seed)
    optimizers = cfg.optimizer.build(model_parts=[model])
    schedulers = cfg.lr_scheduler.build(optimizers=optimizers, training_steps=cfg.training.steps)
    loader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=BATCH)
    loss = CrossEntropyLoss.Config().build()
    return Stack(model, optimizers, schedulers, loader, TrainState(), Llama3StateDictAdapter(model_config, None),
                 lambda pred, labels: loss(pred, labels)[0], cfg.checkpoint)


def build_stack(seed: int) -> Stack:
    rank, world = dist.get_rank(), dist.get_world_size()
    return (_stack_022 if VERSION.startswith("0.2") else _stack_030)(rank, world, seed)


def titan_manager(stack: Stack, folder: str, **config: Any):
    for key, value in {"folder": folder, **config}.items():
        setattr(stack.titan_config, key, value)
    if VERSION.startswith("0.2"):
        from torchtitan.components.checkpoint import CheckpointManager as TitanManager

        return TitanManager(checkpoint_config=stack.titan_config, sd_adapter=stack.adapter, base_folder="",
                            **stack.parts())
    return stack.titan_config.build(sd_adapter=stack.adapter, base_folder="", **stack.parts())


def our_manager(stack: Stack, folder: str, **config: Any) -> CheckpointManager:
    """Ours, its config built from TorchTitan's own section as a TorchTitan job would."""
    config = Checkpoint.from_torchtitan(stack.titan_config, **{
        "enable": True, "folder": folder, "interval": 1, "keep_latest_k": 0, "last_save_model_only": False,
        "load_step": -1, "initial_load_path": None, **config})
    return CheckpointManager(config, sd_adapter=stack.adapter, **stack.parts())


def _plain(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value.clone() if isinstance(value, torch.Tensor) else value


def snapshot(stack: Stack) -> dict[str, Any]:
    """Everything a resume restores, as plain values (full tensors), then the next batch."""
    out = {f"model.{k}": _plain(v) for k, v in stack.model.state_dict().items()}
    out.update({f"optimizer.{k}": _plain(v) for k, v in stack.optimizers.state_dict().items()})
    for i, scheduler in enumerate(stack.schedulers.schedulers):
        out[f"lr_scheduler.{i}"] = (scheduler.last_epoch, scheduler.get_last_lr())
    out["train_state"] = stack.train_state.state_dict()
    if stack.batches is None:
        stack.batches = iter(stack.dataloader)
    out["next_batch"] = next(stack.batches)[0]["input"]
    return out


def compare(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:6]}"
    for key, value in want.items():
        same = torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value
        assert same, f"{what}: {key} differs: {got[key]!r} vs {value!r}"
    if dist.get_rank() == 0:
        print(f"OK {what}", flush=True)


def main(out: str) -> None:
    titan_folder = os.path.join(out, "titan")
    # TorchTitan saves steps 1-3
    source = build_stack(seed=0)
    titan = titan_manager(source, titan_folder)
    for _ in range(3):
        source.train(1)
        titan.save(curr_step=source.train_state.step)
    titan.close()
    after_titan = snapshot(source)

    # ours resumes the newest of TorchTitan's steps from checkpoint.folder, then saves 4 and 5
    resumed = build_stack(seed=1)
    ours = our_manager(resumed, titan_folder, keep_latest_k=1)
    assert ours.load()
    compare(snapshot(resumed), after_titan, "ours loads TorchTitan's step from checkpoint.folder")
    for _ in range(2):
        resumed.train(1)
        ours.save(resumed.train_state.step)
    ours.close()
    dist.barrier()
    found = [(s.step, s.status) for s in layout.scan(titan_folder)]
    assert found == [(1, "foreign"), (2, "foreign"), (3, "foreign"), (5, "complete")], found
    if dist.get_rank() == 0:
        print("OK TorchTitan's steps all kept with keep_latest_k = 1", flush=True)
    after_ours = snapshot(resumed)

    # ours, from TorchTitan's step as initial_load_path into an empty folder
    initial = build_stack(seed=2)
    with our_manager(initial, os.path.join(out, "empty"), initial_load_path=layout.step_dir(titan_folder, 3),
                     initial_load_model_only=False) as manager:
        assert manager.load()
    compare(snapshot(initial), after_titan, "ours loads TorchTitan's step as initial_load_path")

    # TorchTitan resumes our step 5
    back = build_stack(seed=3)
    titan = titan_manager(back, titan_folder)
    assert titan.load(step=5)
    titan.close()
    compare(snapshot(back), after_ours, "TorchTitan loads our step with load(step=5)")
    hf_round_trip(back, out)
    if not VERSION.startswith("0.2"):
        chosen_by_config(os.path.join(out, "chosen"))


def _hf_config(adapter: Any, hf: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`config.json` for TorchTitan's llama3 debug model (TorchTitan's adapters write none)."""
    args = getattr(adapter, "model_args", None)  # 0.2.2; 0.3.0 keeps a per-layer config
    attention = args if args is not None else adapter.model_config.layers[0].attention
    vocab, hidden = hf["model.embed_tokens.weight"].shape
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": hf["model.layers.0.mlp.gate_proj.weight"].shape[0],
            "num_hidden_layers": len({k.split(".")[2] for k in hf if k.startswith("model.layers.")}),
            "num_attention_heads": attention.n_heads, "vocab_size": vocab,
            "num_key_value_heads": attention.n_kv_heads or attention.n_heads,
            "tie_word_embeddings": "lm_head.weight" not in hf, "torch_dtype": "float32"}


def convert_step(step: str, assets: str, out: str, hf: dict[str, torch.Tensor]) -> None:
    """`torchtitan-ckpt convert --to hf` of our step of TorchTitan's model (its names, 0.2's or
    0.3's), in a process of its own: the files TorchTitan's adapter writes (`hf`)."""
    import glob
    import subprocess

    from safetensors.torch import load_file

    launcher = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("TORCHELASTIC")}
    ran = subprocess.run([sys.executable, "-m", "torchtitan_ckpt.cli", "convert", "--to", "hf", step, out,
                          "--hf-assets", assets], env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    files = {k: v for f in glob.glob(os.path.join(out, "*.safetensors")) for k, v in load_file(f).items()}
    compare(files, hf, "our convert writes TorchTitan's step as TorchTitan's adapter does")


def hf_round_trip(stack: Stack, out: str) -> None:
    """TorchTitan's own adapter through our manager: an export `transformers` loads, imported back."""
    import json

    full = {k: _plain(v) for k, v in stack.model.state_dict().items()}
    hf = stack.adapter.to_hf(dict(full))
    assets = os.path.join(out, "assets")
    if dist.get_rank() == 0:
        os.makedirs(assets)
        with open(os.path.join(assets, "config.json"), "w") as f:
            json.dump(_hf_config(stack.adapter, hf), f)
    dist.barrier()
    stack.adapter.hf_assets_path = assets
    with our_manager(stack, os.path.join(out, "hf"), last_save_in_hf=True, last_save_model_only=True) as manager:
        assert manager.save(stack.train_state.step, last_step=True)
    exported = layout.step_dir(os.path.join(out, "hf"), stack.train_state.step)
    if dist.get_rank() == 0:
        from transformers import LlamaForCausalLM

        loaded = LlamaForCausalLM.from_pretrained(exported).state_dict()
        compare({k: v for k, v in loaded.items() if k in hf}, hf, "TorchTitan's adapter exports an HF folder "
                "through ours that transformers loads")
        convert_step(layout.step_dir(os.path.join(out, "titan"), stack.train_state.step), assets,
                     os.path.join(out, "converted"), hf)
    dist.barrier()
    back = build_stack(seed=4)
    with our_manager(back, os.path.join(out, "hf-empty"), initial_load_path=exported,
                     initial_load_in_hf=True) as manager:
        assert manager.load()
    compare({k: _plain(v) for k, v in back.model.state_dict().items()}, full,
            "TorchTitan's adapter imports the HF folder back through ours")


def llama3_with_ours():
    """A job's `config_registry` function (TorchTitan 0.3) choosing this package as its checkpointer."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from torchtitan_ckpt.torchtitan_backend import TorchtitanCkptManager

    cfg = llama3_debugmodel()
    cfg.checkpoint = TorchtitanCkptManager.Config(enable=True, interval=2, keep_latest_k=0,
                                                  last_save_model_only=False)
    return cfg


def chosen_by_config(folder: str) -> None:
    """TorchTitan 0.3's command line over `llama3_with_ours`, our own keys among its flags: the
    checkpointer its config builds saves as ours, waits as TorchTitan's do, and resumes."""
    from torchtitan.config.manager import ConfigManager

    cfg = ConfigManager().parse_args([
        "--module", "tests.torchtitan_interop", "--config", "llama3_with_ours", "--checkpoint.folder", folder,
        "--checkpoint.async_mode", "async", "--checkpoint.dedup_policy", "lowest_rank",
        "--checkpoint.verify_on_load"])
    source = build_stack(seed=5)
    checkpointer = cfg.checkpoint.build(sd_adapter=source.adapter, base_folder="", **source.parts())
    settings = checkpointer.manager.config
    assert (settings.async_mode, settings.dedup_policy, settings.verify_on_load) == ("async", "lowest_rank", True)
    for _ in range(2):
        source.train(1)
        checkpointer.save(curr_step=source.train_state.step)
    checkpointer.maybe_wait_for_saving()
    if dist.get_rank() == 0:  # the rank that commits: durable once the wait returns
        found = [(s.step, s.status) for s in layout.scan(folder)]
        assert found == [(2, "complete")], found
    checkpointer.close()
    want = snapshot(source)
    back = build_stack(seed=6)
    checkpointer = cfg.checkpoint.build(sd_adapter=back.adapter, base_folder="", **back.parts())
    assert checkpointer.load(step=-1)
    checkpointer.close()
    compare(snapshot(back), want, "TorchTitan 0.3's config chooses ours, our keys on its command line")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        main(sys.argv[1])
    finally:
        dist.destroy_process_group()
