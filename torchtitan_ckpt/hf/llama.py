"""The Llama adapter: our example model's (TorchTitan's) names <-> `transformers`' LlamaForCausalLM.

Besides renaming, the rows of `wq` and `wk` are permuted: our RoPE rotates interleaved channel
pairs (0,1), (2,3), ... of a head, HF's rotates channel i with channel i + head_dim/2. With tied
embeddings HF stores no `lm_head.weight`; our `output.weight` is the embedding.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..example.model import ModelArgs
from .adapter import HFSource, StateDictAdapter, check_names, permute_rows, rope_row_order

_LAYER_NAMES = {  # ours -> HF, under `layers.N.` / `model.layers.N.`
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TIED_HEAD = "output.weight"


class LlamaAdapter(StateDictAdapter):
    """Maps `torchtitan_ckpt.example.model.Transformer` to HF Llama, for the shapes in `model_args`."""

    def __init__(self, model_args: ModelArgs, hf_assets_path: str | None = None):
        super().__init__(hf_assets_path)
        self.args = model_args
        self.names = self._name_map()  # ours -> HF
        # the permuted tensors and the head count of each
        self.heads = {}
        for i in range(model_args.n_layers):
            self.heads[f"layers.{i}.attention.wq.weight"] = model_args.n_heads
            self.heads[f"layers.{i}.attention.wk.weight"] = model_args.n_kv_heads

    def _name_map(self) -> dict[str, str]:
        names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
        if not self.args.tie_embeddings:
            names[_TIED_HEAD] = "lm_head.weight"
        for i in range(self.args.n_layers):
            for ours, hf in _LAYER_NAMES.items():
                names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{hf}"
        return names

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        ours = dict(state_dict)
        if self.args.tie_embeddings:
            ours.pop(_TIED_HEAD, None)  # the same tensor as the embedding
        check_names("state dict -> HF", ours, self.names)
        out = {}
        for name, value in ours.items():
            if name in self.heads:
                value = permute_rows(value, self.heads[name], to_half_split=True)
            out[self.names[name]] = value
        return out

    def hf_sources(self, names: Iterable[str]) -> dict[str, HFSource]:
        given = set(names)
        ours = given - {_TIED_HEAD} if self.args.tie_embeddings else given  # tied: the embedding
        check_names("state dict -> HF", ours, self.names)
        order = rope_row_order(self.args.head_dim)
        out = {name: HFSource(self.names[name], order if name in self.heads else ()) for name in ours}
        if self.args.tie_embeddings and _TIED_HEAD in given:
            out[_TIED_HEAD] = out["tok_embeddings.weight"]
        return out

    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        return hf_llama_config(self.args, dtype)


def hf_llama_config(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """`config.json` of `transformers`' LlamaForCausalLM with the shapes and constants of `args`."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def llama_args_from_hf_config(config: dict[str, Any], where: str = "config.json") -> ModelArgs:
    """The `ModelArgs` our model needs to hold the checkpoint that `config` (a parsed HF
    `config.json`) describes. Raises ValueError naming the field our model cannot express."""
    try:
        dim, inter = config["hidden_size"], config["intermediate_size"]
        n_heads = config["num_attention_heads"]
        rope = config.get("rope_parameters") or {}
        args = dict(
            dim=dim, n_layers=config["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads, vocab_size=config["vocab_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=config.get("rope_theta", rope.get("rope_theta", 10000.0)),
            max_seq_len=config.get("max_position_embeddings", 2048),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise ValueError(f"{where} has no {e.args[0]!r}; is it a Llama config?") from None
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise ValueError(f"{where}: RoPE scaling {rope or config.get('rope_scaling')} is not "
                         "supported by the example model")
    if config.get("head_dim", dim // n_heads) != dim // n_heads:
        raise ValueError(f"{where}: head_dim {config['head_dim']} != hidden_size / num_attention_heads")
    # our FFN width is derived from `multiple_of`: pick one that yields intermediate_size
    for multiple_of in (32, 64, 128, 256, 512, 1024, 2048, 4096, inter):
        candidate = ModelArgs(**args, multiple_of=multiple_of)
        if candidate.ffn_dim == inter:
            return candidate
    raise ValueError(f"{where}: intermediate_size {inter} is smaller than the example model's "
                     f"FFN width for hidden_size {dim}")
