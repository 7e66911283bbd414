"""TorchTitan's own Qwen3 model (torchtitan 0.2.2) started from a `transformers` checkpoint through
our Qwen3 adapter as `adapter_for_hf_dir` builds it (TorchTitan's RoPE layout for the family,
rotate-half), and exported back: the logits are `transformers`'. Run by
tests/test_torchtitan_interop.py with that release on the path; prints `OK <check>` per check.

    python tests/torchtitan_qwen3.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

import torch
import transformers
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
from torchtitan.models.qwen3.model.model import Qwen3Model

from torchtitan_ckpt.hf import adapter_for_hf_dir, load_hf, save_hf

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, WIDTH = 64, 32, 4, 2, 16, 48


def hf_model() -> transformers.Qwen3ForCausalLM:
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=WIDTH,
                                      num_hidden_layers=2, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=64,
                                      rope_theta=1000000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # away from the initial values, the norms included
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def titan_model(norm_eps: float) -> Qwen3Model:
    args = Qwen3ModelArgs(dim=DIM, n_layers=2, n_heads=HEADS, n_kv_heads=KV_HEADS, vocab_size=VOCAB,
                          head_dim=HEAD_DIM, hidden_dim=WIDTH, max_seq_len=64, rope_theta=1000000.0,
                          norm_eps=norm_eps)
    model = Qwen3Model(args)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model.eval()


def main(out: str) -> None:
    hf = hf_model()
    src = os.path.join(out, "hf")
    hf.save_pretrained(src)
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        titan = titan_model(hf.config.rms_norm_eps)
        load_hf(titan.state_dict(), src, adapter_for_hf_dir(src))
        assert (titan(tokens) - expected).abs().max() < 1e-5, (titan(tokens) - expected).abs().max()
    print("OK TorchTitan's Qwen3 imports the transformers checkpoint through our adapter", flush=True)

    exported = os.path.join(out, "exported")
    save_hf(titan.state_dict(), exported, adapter_for_hf_dir(src))
    back = transformers.Qwen3ForCausalLM.from_pretrained(exported).eval()
    with torch.no_grad():
        assert (back(tokens).logits - expected).abs().max() < 1e-5
    print("OK transformers loads TorchTitan's Qwen3 exported through our adapter", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
