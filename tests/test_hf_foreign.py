"""TorchTitan 0.3.0's own state-dict adapter (an adapter of whole tensors, `ForeignAdapter`)
imports an HF folder into its MoE model through `load_hf`: only the tensors the adapter maps are
read, as TorchTitan's own manager reads them, and the model's others (`expert_bias_E`, which has
no HF counterpart) keep their values. Runs in a subprocess with torchtitan 0.3.0 on its path."""

from __future__ import annotations

import os
import subprocess
import sys

from .test_torchtitan_interop import torchtitan_path
from .helpers import ROOT

SCRIPT = r'''
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

def build(seed):
    with torch.device("meta"):
        m = cfg.build()
    m.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        m.init_weights(buffer_device=None)
        for v in m.state_dict().values():
            v.add_(torch.randn_like(v))  # every tensor its own values, expert_bias_E too
    return m

out = sys.argv[1]
saved = build(0).state_dict()
bias = sorted(k for k in saved if k.endswith("expert_bias_E"))
assert bias, sorted(saved)
hf = {k: v.contiguous() for k, v in Qwen3StateDictAdapter(cfg, None).to_hf(saved).items()}
os.makedirs(os.path.join(out, "hf"))
save_file(hf, os.path.join(out, "hf", "model.safetensors"))

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(message)s")
fresh = build(1).state_dict()
kept = {k: fresh[k].clone() for k in bias}
load_hf(fresh, os.path.join(out, "hf"), Qwen3StateDictAdapter(cfg, None))
unequal = [k for k in saved if k not in bias and not torch.equal(saved[k], fresh[k])]
assert not unequal, unequal
assert all(torch.equal(fresh[k], kept[k]) for k in bias)
print("OK every tensor the adapter maps is read, expert_bias_E keeps its value")

del hf["model.norm.weight"]
os.makedirs(os.path.join(out, "short"))
save_file(hf, os.path.join(out, "short", "model.safetensors"))
other = build(2).state_dict()
before = {k: v.clone() for k, v in other.items()}
try:
    load_hf(other, os.path.join(out, "short"), Qwen3StateDictAdapter(cfg, None))
except AdapterMismatchError as e:
    assert "1 missing name(s) ['norm.weight']" in str(e), e
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
        "a tensor the adapter maps and the folder lacks is an error naming it"], log[-6000:]
    assert ("leaving 2 tensor(s) of the model as they are, which the adapter maps to no Hugging Face tensor: "
            "['layers.0.moe.expert_bias_E', 'layers.1.moe.expert_bias_E']") in proc.stdout, log[-6000:]
