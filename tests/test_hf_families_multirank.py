"""The model families of test_hf_families on 2 real gloo ranks: FSDP-sharded dense models, and
the Qwen3-MoE and Mixtral flavors with expert parallelism (EP = 2: experts `Shard(0)` on an `ep`
mesh), whose import reads only the experts a rank holds and whose export writes each expert from
its rank."""

from __future__ import annotations

import filecmp
import glob
import logging
import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tests.helpers import RecordedReads, spawn
from tests.test_hf_families import EXPERT_FILES, EXPERT_PARTS, FAMILIES, MOE_LAYERS, logits_of, make_hf_model, \
    read_config
from torchtitan_ckpt.example.model import ROPE_LAYOUT, Transformer, args_from_hf_config
from torchtitan_ckpt.example.train import shard_model
from torchtitan_ckpt.hf import adapter_for_hf_dir, load_hf, save_hf
from torchtitan_ckpt.hf.adapter import PermutedRows, RowOf
from torchtitan_ckpt.hf.consolidate import _local_block
from torchtitan_ckpt.hf.convert import convert
from torchtitan_ckpt.progress import fmt_bytes
from torchtitan_ckpt.states import ModelState

pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank


def _same_files(a: str, b: str) -> None:
    files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(a, "*.safetensors")))
    assert files == sorted(os.path.basename(f) for f in glob.glob(os.path.join(b, "*.safetensors")))
    for file in files:
        assert filecmp.cmp(os.path.join(a, file), os.path.join(b, file), shallow=False), file


def _dense(rank: int, world_size: int, src: str, expected: torch.Tensor) -> None:
    torch.manual_seed(5)
    model = Transformer(args_from_hf_config(read_config(src)))
    shard_model(model, world_size)
    state = ModelState([model])
    sd = state.state_dict()
    load_hf(sd, src, adapter_for_hf_dir(src, rope_layout=ROPE_LAYOUT))
    state.load_state_dict(sd)
    assert (logits_of(model) - expected).abs().max() < 1e-5


def _experts_of(rank: int, world_size: int, experts: int) -> range:
    per = -(-experts // world_size)
    return range(rank * per, min(experts, (rank + 1) * per))


def _moe_with_ep(rank: int, world_size: int, family: str, src: str, out: str, expected: torch.Tensor) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    args = args_from_hf_config(read_config(src))
    torch.manual_seed(5)
    # experts Shard(0) on `ep`: this rank holds its experts; the rest FSDP-like rows
    sd = {k: distribute_tensor(v.detach().clone(), mesh, [Shard(0)]) for k, v in Transformer(args).state_dict().items()}
    adapter = adapter_for_hf_dir(src, rope_layout=ROPE_LAYOUT)
    with RecordedReads() as recorded:
        load_hf(sd, src, adapter)
    own = _experts_of(rank, world_size, args.moe.num_experts)
    read_experts = {n for n in recorded.tensors(src) if ".experts." in n}
    assert read_experts == {EXPERT_FILES[family].format(layer=layer, e=e, p=p)
                            for layer in MOE_LAYERS[family] for e in own for p in EXPERT_PARTS[family]}
    held = sum(v.to_local().nbytes for v in sd.values())
    assert sum(n for _, _, n in recorded.reads) <= 1.1 * held
    plain = Transformer(args)
    plain.load_state_dict({k: v.full_tensor() for k, v in sd.items()})
    assert (logits_of(plain) - expected).abs().max() < 1e-5

    # the export writes each expert from the rank holding it, no rank gathering them
    writes = {n for n, v in adapter.to_hf(sd).items() if isinstance(v, RowOf) and _local_block(n, v, "F32")}
    assert writes == read_experts
    save_hf(sd, out, adapter)
    if rank == 0:
        _same_files(src, out)
    # a two-phase export gathers them on every rank, which rank 0 says, with the bytes each holds
    said: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = said.append
    logging.getLogger("torchtitan_ckpt.hf.save").addHandler(handler)
    save_hf(sd, out + "_two_phase", adapter, mode="all_ranks")
    views = adapter.to_hf(sd).values()  # each grouped weight once (a RowOf per expert), and the q/k rows cut
    gathered = {id(v.tensor): v.tensor for v in views if isinstance(v, (RowOf, PermutedRows))}
    experts = sum(t.numel() * t.element_size() for t in gathered.values())
    told = [f"{out}_two_phase (all_ranks): every rank gathers the sharded weights it exports whole (experts, q/k "
            f"projections whose shards cut a head), {fmt_bytes(experts)} held at once on each: consolidation = "
            "'one_pass' writes them from the ranks holding them"]
    assert [r.getMessage() for r in said] == (told if rank == 0 else []), [r.getMessage() for r in said]
    if rank == 0:
        _same_files(src, out + "_two_phase")


def _on_two_ranks(rank: int, world_size: int, folders: dict[str, str], logits: dict[str, torch.Tensor],
                  out: str) -> None:
    for family, src in folders.items():
        if family in EXPERT_FILES:
            _moe_with_ep(rank, world_size, family, src, os.path.join(out, family + "_export"), logits[family])
        else:
            _dense(rank, world_size, src, logits[family])
        # the CLI's path under torchrun: HF -> DCP -> HF, each rank holding half of every tensor
        dcp_dir, hf_dir = (os.path.join(out, family + suffix) for suffix in ("_dcp", "_hf"))
        convert("dcp", src, dcp_dir)
        convert("hf", dcp_dir, hf_dir, hf_assets_path=src)
        if rank == 0:
            _same_files(src, hf_dir)


def test_families_on_two_ranks(tmp_path):
    folders, logits = {}, {}
    for family in FAMILIES:
        model = make_hf_model(family)
        folders[family] = str(tmp_path / family)
        model.save_pretrained(folders[family], max_shard_size="60KB")
        logits[family] = logits_of(model)
    spawn(2, _on_two_ranks, folders, logits, str(tmp_path / "out"))
