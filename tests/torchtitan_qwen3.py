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

from safetensors.torch import load_file

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

    exported_through_ours(titan, src, os.path.join(out, "exported"), transformers.Qwen3ForCausalLM, tokens,
                          expected, "Qwen3")
    moe(out)


def exported_through_ours(titan: torch.nn.Module, src: str, out: str, cls: type, tokens: torch.Tensor,
                          expected: torch.Tensor, family: str) -> None:
    """TorchTitan's model exported through our adapter of `src`: `transformers`' `cls` loads it,
    and gives `expected` logits."""
    save_hf(titan.state_dict(), out, adapter_for_hf_dir(src))
    back = cls.from_pretrained(out).eval()
    with torch.no_grad():
        assert (back(tokens).logits - expected).abs().max() < 1e-5
    print(f"OK transformers loads TorchTitan's {family} exported through our adapter", flush=True)


def moe(out: str) -> None:
    """TorchTitan's Qwen3-MoE balances its experts' load with a routing bias (`expert_bias`, a
    buffer it saves) that the Hub's model has none of: our adapter refused the model. An import
    sets the bias to zero (the Hub's routing), an export leaves it out. (TorchTitan 0.2.2's MoE
    runs no forward on a CPU, `histc` of integers: the weights are compared.)"""
    from torchtitan.models.moe.moe import MoEArgs

    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=WIDTH,
                                         moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                         norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=HEADS,
                                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=64,
                                         rope_theta=1000000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    src = os.path.join(out, "hf-moe")
    hf.save_pretrained(src)
    args = Qwen3ModelArgs(dim=DIM, n_layers=2, n_heads=HEADS, n_kv_heads=KV_HEADS, vocab_size=VOCAB,
                          head_dim=HEAD_DIM, hidden_dim=WIDTH, max_seq_len=64, rope_theta=1000000.0,
                          norm_eps=config.rms_norm_eps, moe_enabled=True, moe_inter_dim=24,
                          moe_args=MoEArgs(num_experts=4, num_shared_experts=0, top_k=2, score_func="softmax",
                                           route_norm=True, score_before_experts=False, use_grouped_mm=False))
    titan = Qwen3Model(args)
    with torch.no_grad():
        titan.init_weights(buffer_device=torch.device("cpu"))
    biases = [k for k in titan.state_dict() if k.endswith("moe.expert_bias")]
    assert len(biases) == 2, biases  # load balancing is TorchTitan's default
    with torch.no_grad():
        for name in biases:
            titan.get_buffer(name).copy_(torch.tensor([0.05, -0.05, 0.03, -0.03]))  # as training leaves it
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        load_hf(titan.state_dict(), src, adapter_for_hf_dir(src))
    assert all(not titan.get_buffer(name).any() for name in biases)
    files = load_file(os.path.join(src, "model.safetensors"))
    for e in range(4):
        for ours, theirs in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            assert torch.equal(getattr(titan.layers["1"].moe.experts, ours)[e],
                               files[f"model.layers.1.mlp.experts.{e}.{theirs}_proj.weight"])
    assert torch.equal(titan.layers["1"].moe.router.gate.weight, files["model.layers.1.mlp.gate.weight"])
    print("OK TorchTitan's Qwen3-MoE imports the transformers checkpoint through our adapter", flush=True)

    exported_through_ours(titan, src, os.path.join(out, "exported-moe"), transformers.Qwen3MoeForCausalLM, tokens,
                          expected, "Qwen3-MoE")


if __name__ == "__main__":
    main(sys.argv[1])
