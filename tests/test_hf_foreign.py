"""TorchTitan 0.3.0's own state-dict adapter (an adapter of whole tensors, `ForeignAdapter`)
imports an HF folder into its MoE model through `load_hf`: only the tensors the adapter maps are
read, as TorchTitan's own manager reads them, and the model's others (`expert_bias_E`, which has
no HF counterpart) keep their values. Runs in a subprocess with torchtitan 0.3.0 on its path."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from .test_torchtitan_interop import torchtitan_path
from .helpers import ROOT

N_EXTRA = 24
"""Tensors of the folder "mtp" that the model does not have: a copy of layer 1 as layer 2 (21), 3 others."""

MODEL = r"""
import torch

def model(config, seed):
    with torch.device("meta"):
        m = config.build()
    m.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        m.init_weights(buffer_device=None)
        for v in m.state_dict().values():
            v.add_(torch.randn_like(v))
    return {k: v.detach().clone() for k, v in m.state_dict().items()}
"""
"""A model of TorchTitan's (`config`) with values of its own in every tensor (`expert_bias_E` too), as
a state dict: what the scripts below build."""

SCRIPT = MODEL + r'''
import logging, os, sys, torch
from safetensors.torch import save_file
from torchtitan.models import qwen3 as q
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan_ckpt.errors import AdapterMismatchError
from torchtitan_ckpt.hf.load import load_hf

V, D, HD = 128, 64, 16
layers = q._build_qwen3_moe_layers(n_layers=2, dim=D, n_heads=4, n_kv_heads=2, head_dim=HD, moe_hidden_dim=32,
                                   num_experts=4, top_k=2, fuse_qkv=True, attn_backend="flex",
                                   moe_comm_backend="standard", rope=CosSinRoPE.Config(dim=HD, max_seq_len=64,
                                                                                       theta=1e6))
for block in layers:
    block.attention.inner_attention = ScaledDotProductAttention.Config()
cfg = Qwen3Model.Config(vocab_size=V, dim=D, norm=q._qwen3_norm(D), enable_weight_tying=False, layers=layers,
                        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=D, param_init=q._EMBEDDING_INIT),
                        lm_head=Linear.Config(in_features=D, out_features=V, param_init=q._LINEAR_INIT))

out = sys.argv[1]
saved = model(cfg, 0)
bias = sorted(k for k in saved if k.endswith("expert_bias_E"))
assert bias, sorted(saved)
hf = {k: v.contiguous() for k, v in Qwen3StateDictAdapter(cfg, None).to_hf(saved).items()}
os.makedirs(os.path.join(out, "hf"))
save_file(hf, os.path.join(out, "hf", "model.safetensors"))

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(levelname)s %(message)s")
fresh = model(cfg, 1)
kept = {k: fresh[k].clone() for k in bias}
load_hf(fresh, os.path.join(out, "hf"), Qwen3StateDictAdapter(cfg, None))
unequal = [k for k in saved if k not in bias and not torch.equal(saved[k], fresh[k])]
assert not unequal, unequal
assert all(torch.equal(fresh[k], kept[k]) for k in bias)
print("OK every tensor the adapter maps is read, expert_bias_E keeps its value")

# as the Hub's DeepSeek-V3 folders hold: an MTP layer numbered past the model's layers (a whole layer and
# tensors of its own, which from_hf knows no name for), and FP8 scales, in a file of their own
import json
import torchtitan_ckpt.hf.load as load
extra = {k.replace("model.layers.1.", "model.layers.2."): v.clone() for k, v in hf.items()
         if k.startswith("model.layers.1.")}
extra.update({"model.layers.2.eh_proj.weight": torch.ones(D, 2 * D), "model.layers.2.enorm.weight": torch.ones(D),
              "model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(1, 1)})
os.makedirs(os.path.join(out, "mtp"))
save_file(hf, os.path.join(out, "mtp", "model-00001-of-00002.safetensors"))
save_file(extra, os.path.join(out, "mtp", "model-00002-of-00002.safetensors"))
with open(os.path.join(out, "mtp", "model.safetensors.index.json"), "w") as f:
    json.dump({"weight_map": {**dict.fromkeys(hf, "model-00001-of-00002.safetensors"),
                              **dict.fromkeys(extra, "model-00002-of-00002.safetensors")}}, f)
read, read_whole = [], load._read_whole
load._read_whole = lambda layout: (read.extend(layout), read_whole(layout))[1]
fresh = model(cfg, 3)
load_hf(fresh, os.path.join(out, "mtp"), Qwen3StateDictAdapter(cfg, None))
assert sorted(read) == sorted(hf), sorted(set(read) ^ set(hf))
unequal = [k for k in saved if k not in bias and not torch.equal(saved[k], fresh[k])]
assert not unequal, unequal
load._read_whole = read_whole
print(f"OK the folder's {len(extra)} tensors the model does not have are not read")

del hf["model.norm.weight"]
os.makedirs(os.path.join(out, "short"))
save_file(hf, os.path.join(out, "short", "model.safetensors"))
other = model(cfg, 2)
before = {k: v.clone() for k, v in other.items()}
try:
    load_hf(other, os.path.join(out, "short"), Qwen3StateDictAdapter(cfg, None))
except AdapterMismatchError as e:
    assert "1 missing name(s) ['model.norm.weight']" in str(e), e
    assert all(torch.equal(before[k], other[k]) for k in before)
    print("OK a tensor the adapter maps and the folder lacks is an error naming it")
'''


def test_torchtitan_030_moe_adapter_imports_an_hf_folder_leaving_expert_bias(tmp_path):
    env = {**os.environ, "PYTHONPATH": torchtitan_path("0.3.0"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert [line[3:] for line in proc.stdout.splitlines() if line.startswith("OK ")] == [
        "every tensor the adapter maps is read, expert_bias_E keeps its value",
        f"the folder's {N_EXTRA} tensors the model does not have are not read",
        "a tensor the adapter maps and the folder lacks is an error naming it"], log[-6000:]
    leaving = ("leaving 2 tensor(s) of the model as they are, which the adapter maps to no Hugging Face tensor: "
               "layers.0.moe.expert_bias_E, layers.1.moe.expert_bias_E")
    assert f"LOG INFO {tmp_path}/hf: {leaving}\n" in proc.stdout, log[-6000:]  # the Hub's format has no place
    assert (f"LOG WARNING {tmp_path}/mtp: {leaving}; and {N_EXTRA} tensor(s) of the folder are not read, which the "
            "adapter maps to no tensor of the model: where it misnames them, these keep their initial values"
            ) in proc.stdout, log[-6000:]  # beside tensors of the folder it does not read
    assert (f"/mtp: ignoring {N_EXTRA} tensors of the folder that the model does not have, such as "
            "model.layers.0.self_attn.q_proj.weight_scale_inv, model.layers.2.eh_proj.weight, "
            "model.layers.2.enorm.weight") in proc.stdout, log[-6000:]



TWO_RANKS = MODEL + r"""
import sys, torch, torch.distributed as dist
import torchtitan_ckpt.hf.load as load

dist.init_process_group("gloo")
rank, out = dist.get_rank(), sys.argv[1]
read, read_whole = [], load._read_whole
load._read_whole = lambda layout: (read.extend(layout), read_whole(layout))[1]  # the HF tensors this rank reads

def say(line):
    said = [None] * dist.get_world_size()
    dist.all_gather_object(said, line)
    if rank == 0:
        print("".join(f"OK {line}\n" for line in said), end="", flush=True)
"""
"""What the 2-rank scripts share: the group, the HF tensors each rank reads (`read`), a model of
TorchTitan's with its own values (`model`), and `say`: rank 0 prints each rank's line in order."""


def _on_two_ranks(script: str, tmp_path) -> list[str]:
    """The `OK` lines of `script` (after `TWO_RANKS`) run by torchrun on 2 gloo ranks with torchtitan
    0.3.0, given `tmp_path`."""
    env = {**os.environ, "PYTHONPATH": torchtitan_path("0.3.0"), "OMP_NUM_THREADS": "1"}
    path = tmp_path / "script.py"
    path.write_text(TWO_RANKS + script + "\ndist.destroy_process_group()\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(path), str(tmp_path)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return [line[3:] for line in proc.stdout.splitlines() if line.startswith("OK ")]


STAGES = r"""
import os
from safetensors.torch import save_file
from torchtitan.models import qwen3 as q
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

V, D, HD = 128, 64, 16

def config(tied):
    layers = q._build_qwen3_layers(n_layers=2, dim=D, n_heads=4, n_kv_heads=2, head_dim=HD, hidden_dim=96,
                                   attn_backend="flex", rope=CosSinRoPE.Config(dim=HD, max_seq_len=64, theta=1e6))
    for block in layers:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    return Qwen3Model.Config(vocab_size=V, dim=D, norm=q._qwen3_norm(D), enable_weight_tying=tied, layers=layers,
                             tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=D,
                                                             param_init=q._EMBEDDING_INIT),
                             lm_head=Linear.Config(in_features=D, out_features=V, param_init=q._LINEAR_INIT))

def stage(sd):  # rank 0: the embedding and layer 0; rank 1: layer 1, the norm and the head
    first = lambda k: k.startswith(("tok_embeddings.", "layers.0."))
    return {k: v for k, v in sd.items() if first(k) == (rank == 0)}

for tied in (False, True):
    cfg = config(tied)
    saved = model(cfg, 0)
    hf = {k: v.contiguous() for k, v in Qwen3StateDictAdapter(cfg, None).to_hf(saved).items()}
    folder = os.path.join(out, f"tied{tied}")
    if rank == 0:
        os.makedirs(folder)
        save_file(hf, os.path.join(folder, "model.safetensors"))
    dist.barrier()
    part, read[:] = stage(model(cfg, 1)), []
    load.load_hf(part, folder, Qwen3StateDictAdapter(cfg, None))
    unequal = [k for k in part if not torch.equal(part[k], saved["tok_embeddings.weight" if tied and
                                                                  k == "lm_head.weight" else k])]
    assert not unequal, unequal
    own = set(Qwen3StateDictAdapter(cfg, None).to_hf(stage(saved)))
    want = set(hf) if tied and rank == 1 else own  # the tied head is read from the embedding
    assert sorted(read) == sorted(want), sorted(set(read) ^ want)
    say(f"{'tied' if tied else 'untied'}: rank {rank} reads {len(read)} of {len(hf)} tensors")
"""


def test_torchtitan_adapter_import_into_pipeline_stages_reads_each_stages_tensors(tmp_path):
    """TorchTitan 0.3.0's Qwen3 adapter, a model split into two pipeline stages on 2 ranks: each
    rank reads only the HF tensors of its stage, as TorchTitan's own manager does; with the head
    tied to the embedding, which the other stage holds, the head's rank reads the whole folder
    (`from_hf` needs the embedding for it) and the head gets the embedding's values."""
    assert _on_two_ranks(STAGES, tmp_path) == [
        "untied: rank 0 reads 12 of 25 tensors", "untied: rank 1 reads 13 of 25 tensors",
        "tied: rank 0 reads 12 of 24 tensors", "tied: rank 1 reads 24 of 24 tensors"]


TIED = r'''
import os, sys, torch
from transformers import LlamaConfig
from torchtitan.experiments.transformers_modeling_backend.config_registry import (
    transformers_modeling_backend_debugmodel)
from torchtitan.experiments.transformers_modeling_backend.state_dict_adapter import HFTransformerStateDictAdapter
from torchtitan_ckpt.hf.load import load_hf

out = sys.argv[1]
LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True, architectures=["LlamaForCausalLM"]).save_pretrained(out)
job = transformers_modeling_backend_debugmodel()
job.hf_model = out  # a local config.json instead of the Hub's
config = job.model_spec.model
config.update_from_config(config=job)

def model(seed):
    with torch.device("meta"):
        m = config.build()
    m.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        for v in m.state_dict().values():
            v.normal_()
    m.model.tie_weights()
    return m

saved = model(0)
saved.model.save_pretrained(os.path.join(out, "hf"))  # transformers' own folder: no lm_head.weight
fresh = model(1).state_dict()
load_hf(fresh, os.path.join(out, "hf"), HFTransformerStateDictAdapter(config, None))
want = saved.state_dict()
assert not [k for k in fresh if not torch.equal(fresh[k], want[k])]
assert torch.equal(fresh["model.lm_head.weight"], want["model.model.embed_tokens.weight"])
print("OK a tied model's folder without its head loads through TorchTitan's transformers-backend adapter")
'''


def test_a_tied_head_that_to_hf_maps_alone_but_drops_beside_the_embedding(tmp_path):
    """TorchTitan 0.3.0's transformers-backend adapter drops `lm_head.weight` from `to_hf` only
    beside the embedding (and `from_hf` makes it from the embedding): asked about the head alone,
    it named `lm_head.weight`, so the folder `transformers` saves for a tied model (no head) was
    refused as lacking it. A tensor's HF names are now checked against the whole model's."""
    env = {**os.environ, "PYTHONPATH": torchtitan_path("0.3.0"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", TIED, str(tmp_path)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "OK a tied model's folder without its head loads through" in proc.stdout



FUSED_STAGES = r"""
import re
from safetensors.torch import save_file
from torchtitan.models.kimi_k2_7 import KimiK25StateDictAdapter, model_registry

config = model_registry("debugmodel", attn_backend="flex").model

def stage(sd):  # rank 0: the vision tower, the embedding and layer 0; rank 1: the other layers, the norm, the head
    first = lambda k: (m := re.match(r"layers\.(\d+)\.", k)) and m.group(1) == "0" or \
        not k.startswith(("layers.", "norm.", "output."))
    return {k: v for k, v in sd.items() if bool(first(k)) == (rank == 0)}

saved = model(config, 0)
hf = {k: v.contiguous() for k, v in KimiK25StateDictAdapter(config, None).to_hf(saved).items()}
if rank == 0:
    save_file(hf, out + "/model.safetensors")
dist.barrier()
part = stage(model(config, 1))
load.load_hf(part, out, KimiK25StateDictAdapter(config, None))
assert not [k for k in part if not torch.equal(part[k], saved[k])]
own = set(KimiK25StateDictAdapter(config, None).to_hf(stage(saved)))
assert sorted(read) == sorted(own), sorted(set(read) ^ own)
say(f"rank {rank} reads {len(read)} of {len(hf)} tensors")
"""


def test_an_adapter_fusing_tensors_it_cannot_convert_alone_reads_each_stages_tensors(tmp_path):
    """TorchTitan 0.3.0's Kimi K2.5 adapter fuses each vision block's q, k and v into one HF
    tensor and fails on any of them alone: its names were asked of the whole model only, so each
    pipeline stage's rank read the whole folder. A tensor it cannot convert alone is asked with
    the tensors of its module: each rank reads only the HF tensors of its stage."""
    assert _on_two_ranks(FUSED_STAGES, tmp_path) == ["rank 0 reads 71 of 252 tensors",
                                                     "rank 1 reads 181 of 252 tensors"]

class _FusesPair:
    """An adapter of TorchTitan's surface that fuses `w` and `u` into one HF tensor, expecting
    both (as Qwen3.5's MoE adapter fuses gate and up projections), and drops `expert_bias`."""
    hf_assets_path, fqn_to_index_mapping = None, None

    def to_hf(self, state_dict):
        out = {"model.wu": torch.cat([state_dict["w"], state_dict["u"]])} if "w" in state_dict or "u" in state_dict \
            else {}
        out.update({"model." + k: v for k, v in state_dict.items() if k not in ("w", "u", "expert_bias")})
        return out

    def from_hf(self, hf_state_dict):
        out = {k.removeprefix("model."): v for k, v in hf_state_dict.items() if k != "model.wu"}
        if "model.wu" in hf_state_dict:
            out["w"], out["u"] = hf_state_dict["model.wu"].chunk(2)
        return out


def test_an_adapter_that_converts_no_tensor_alone_leaves_what_its_export_drops(tmp_path):
    """Asked about each tensor alone, the adapter fails (`u` is missing beside `w`), and its names
    are of no module to ask it with: every model tensor was then required from the folder,
    `expert_bias` too, which its own export leaves out, so a model could not load its own export
    (as Qwen3.5-MoE, whose experts are now asked by module). What is required is now what its
    `from_hf` gives back from its whole `to_hf`."""
    from safetensors.torch import save_file

    from torchtitan_ckpt.hf.load import load_hf

    saved = {"w": torch.randn(2, 3), "u": torch.randn(2, 3), "norm": torch.randn(3), "expert_bias": torch.ones(2)}
    save_file({k: v.contiguous() for k, v in _FusesPair().to_hf(saved).items()}, tmp_path / "model.safetensors")
    fresh = {k: torch.zeros_like(v) for k, v in saved.items()}
    load_hf(fresh, tmp_path, _FusesPair())
    assert all(torch.equal(fresh[k], saved[k]) for k in ("w", "u", "norm"))
    assert torch.equal(fresh["expert_bias"], torch.zeros(2))
