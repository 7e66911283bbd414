"""Hugging Face import and export on 2 real gloo ranks with the FSDP-sharded example model."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tests.helpers import DEBUG_CONFIG, assert_same, spawn
from torchtitan_ckpt.config import load_job_config
from torchtitan_ckpt.example.model import FLAVORS
from torchtitan_ckpt.hf import LlamaAdapter, hf_llama_config, load_hf, save_hf
from torchtitan_ckpt.hf.adapter import like, permute_rows
from torchtitan_ckpt.hf.convert import convert
from torchtitan_ckpt.states import ModelState
from torchtitan_ckpt.train import build_model, shard_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def _assert_same_files(a: str, b: str) -> None:
    """Same safetensors file names, and in each the same tensors bit for bit."""
    before, after = ({os.path.basename(f): load_file(f) for f in glob.glob(os.path.join(d, "*.safetensors"))}
                     for d in (a, b))
    assert sorted(before) == sorted(after)
    for file in before:
        assert_same(before[file], after[file])


def _check_permutation_across_a_split_head(world_size: int) -> None:
    """3 heads of 8 rows on 2 ranks: rank 0 holds rows 0-11, so head 1 is split between them."""
    mesh = init_device_mesh("cpu", (world_size,))
    w = torch.arange(24.0 * 2).reshape(24, 2)
    sharded = distribute_tensor(w, mesh, [Shard(0)])
    hf = permute_rows(sharded, n_heads=3, to_half_split=True)
    assert torch.equal(hf, permute_rows(w, n_heads=3, to_half_split=True))
    back = like(permute_rows(hf, n_heads=3, to_half_split=False), sharded)
    assert back.placements == sharded.placements and torch.equal(back.to_local(), sharded.to_local())


def _import_and_export(rank: int, world_size: int, src: str, out: str, expected: torch.Tensor) -> None:
    _check_permutation_across_a_split_head(world_size)
    config = load_job_config(DEBUG_CONFIG, [])
    model = build_model(config)  # other weights than the checkpoint's
    shard_model(model, world_size)
    args = model.args
    state = ModelState([model])
    sd = state.state_dict()
    load_hf(sd, src, LlamaAdapter(args))
    state.load_state_dict(sd)
    with torch.no_grad():
        assert (model(TOKENS) - expected).abs().max() < 1e-5

    # the assets' split: the same files, bit for bit
    save_hf(state.state_dict(), os.path.join(out, "same"), LlamaAdapter(args, hf_assets_path=src))
    # the planner's split, files written by both ranks (loaded by transformers below)
    save_hf(state.state_dict(), os.path.join(out, "planned"), LlamaAdapter(args), max_shard_size="100KB")
    if rank == 0:
        _assert_same_files(src, os.path.join(out, "same"))

    # the CLI's path under torchrun: HF -> DCP -> HF, each rank holding half of every tensor
    convert("dcp", src, os.path.join(out, "dcp"))
    convert("hf", os.path.join(out, "dcp"), os.path.join(out, "hf"), flavor="debugmodel", hf_assets_path=src)
    if rank == 0:
        _assert_same_files(src, os.path.join(out, "hf"))


def test_sharded_import_and_export_on_two_ranks(tmp_path):
    args = FLAVORS[load_job_config(DEBUG_CONFIG, []).model.flavor]
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_llama_config(args, torch.float32))).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        expected = hf(TOKENS).logits
    src = str(tmp_path / "src")
    hf.save_pretrained(src, max_shard_size="150KB")
    assert len(glob.glob(os.path.join(src, "*.safetensors"))) >= 3
    spawn(2, _import_and_export, src, str(tmp_path / "out"), expected)
    planned = str(tmp_path / "out" / "planned")
    assert len(glob.glob(os.path.join(planned, "*.safetensors"))) == 4
    exported = transformers.LlamaForCausalLM.from_pretrained(planned).eval()
    with torch.no_grad():
        assert (exported(TOKENS).logits - expected).abs().max() < 1e-5
