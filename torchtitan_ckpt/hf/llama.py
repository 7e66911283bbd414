"""Llama-layout adapters, from an HF config alone: TorchTitan's names <-> `transformers`'
LlamaForCausalLM (also Mistral's layout), Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM
and MixtralForCausalLM.

Besides renaming, for a model whose RoPE rotates interleaved channel pairs (0,1), (2,3), ... of a
head (`rope_layout` "interleaved": TorchTitan's Llama 3, the default of `LlamaAdapter`) the rows of
`wq` and `wk` are permuted within each head, as HF's rotates channel i with channel
i + head_dim/2; Qwen3's per-head `q_norm`/`k_norm` weights scale those same channels, so their
entries move the same way. TorchTitan's Qwen3 rotates halves as HF does: the Qwen3 adapters'
default layout is "halves", with no permutation. With tied embeddings our `output.weight` is the
embedding: an export writes no `lm_head.weight`, and an import ignores one (some tied checkpoints
store a copy of the embedding there). Qwen3-MoE experts are one grouped 3-D weight per projection on
our side (`moe.experts.w1` [experts, width, hidden], as TorchTitan stores them) and one 2-D tensor
per expert on the Hub's (`mlp.experts.E.gate_proj.weight`; Mixtral's `block_sparse_moe.experts.E.w1`).
Qwen2's q, k and v projections have biases, whose entries move with their rows.
"""

from __future__ import annotations

from ..errors import ConfigError
from .adapter import EMBEDDING, TIED_HEAD, StateDictAdapter


class LlamaAdapter(StateDictAdapter):
    """Llama and Mistral: any `intermediate_size`, `head_dim`, grouped-query attention, tied or
    untied embeddings; RoPE scaling changes no weight, so any `rope_scaling` is accepted."""

    QKV_BIAS = False
    """The q, k and v projections have biases."""

    def _build(self) -> None:
        c = self.config
        # in the model's order, which an export's file split follows
        self.add(EMBEDDING, "model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        for i in range(c.num_hidden_layers):
            self._attention(f"layers.{i}.", f"model.layers.{i}.")
            self._mlp(i, f"layers.{i}.", f"model.layers.{i}.")
            self.add(f"layers.{i}.attention_norm.weight", f"model.layers.{i}.input_layernorm.weight", (c.hidden_size,))
            self.add(f"layers.{i}.ffn_norm.weight", f"model.layers.{i}.post_attention_layernorm.weight",
                     (c.hidden_size,))
        self.add("norm.weight", "model.norm.weight", (c.hidden_size,))
        if self.tied:
            self.tied_copies.add("lm_head.weight")
        else:
            self.add(TIED_HEAD, "lm_head.weight", (c.vocab_size, c.hidden_size))

    def _attention(self, ours: str, hf: str) -> None:
        c, rope = self.config, self.rope_rows()
        q_rows, kv_rows = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        for name, hf_name, rows, order in (("wq", "q_proj", q_rows, rope), ("wk", "k_proj", kv_rows, rope),
                                           ("wv", "v_proj", kv_rows, ())):
            self.add(f"{ours}attention.{name}.weight", f"{hf}self_attn.{hf_name}.weight", (rows, c.hidden_size), order)
            if self.QKV_BIAS:
                self.add(f"{ours}attention.{name}.bias", f"{hf}self_attn.{hf_name}.bias", (rows,), order)
        self.add(ours + "attention.wo.weight", hf + "self_attn.o_proj.weight", (c.hidden_size, q_rows))

    def _mlp(self, layer: int, ours: str, hf: str) -> None:
        dim, width = self.config.hidden_size, self.config.intermediate_size
        self.add(ours + "feed_forward.w1.weight", hf + "mlp.gate_proj.weight", (width, dim))
        self.add(ours + "feed_forward.w3.weight", hf + "mlp.up_proj.weight", (width, dim))
        self.add(ours + "feed_forward.w2.weight", hf + "mlp.down_proj.weight", (dim, width))


class Qwen2Adapter(LlamaAdapter):
    """Qwen2 (Qwen2.5 too): Llama's layout with biases on q, k and v. No TorchTitan model of it
    sets the RoPE layout, so it is Llama's, as for Mistral."""

    QKV_BIAS = True


class Qwen3Adapter(LlamaAdapter):
    """Qwen3 dense: Llama's layout plus an RMSNorm over each head of q and of k."""

    ROPE_LAYOUT = "halves"

    def _attention(self, ours: str, hf: str) -> None:
        super()._attention(ours, hf)
        rope = self.rope_rows()
        self.add(ours + "attention.q_norm.weight", hf + "self_attn.q_norm.weight", (self.config.head_dim,), rope)
        self.add(ours + "attention.k_norm.weight", hf + "self_attn.k_norm.weight", (self.config.head_dim,), rope)


class Qwen3MoeAdapter(Qwen3Adapter):
    """Qwen3-MoE: Qwen3's attention; in the layers `HFModelConfig.is_moe_layer` picks, a router
    and `num_experts` experts of width `moe_intermediate_size` (no shared expert); the other
    layers have a dense FFN of width `intermediate_size`. TorchTitan's model of it balances the
    experts' load with a bias added to the router's scores for the choice of experts, which
    the Hub's model has no place for: `unmapped`."""

    def _build(self) -> None:
        if self.config.num_experts:
            self.config.expert_width("the qwen3_moe adapter")
        super()._build()

    def _mlp(self, layer: int, ours: str, hf: str) -> None:
        c = self.config
        if not c.is_moe_layer(layer):
            super()._mlp(layer, ours, hf)
            return
        dim, width, experts = c.hidden_size, c.moe_intermediate_size, c.num_experts
        self.add(ours + "moe.router.gate.weight", hf + "mlp.gate.weight", (experts, dim))
        self.add_stack(ours + "moe.experts.w1", hf + "mlp.experts.{}.gate_proj.weight", experts, (width, dim))
        self.add_stack(ours + "moe.experts.w3", hf + "mlp.experts.{}.up_proj.weight", experts, (width, dim))
        self.add_stack(ours + "moe.experts.w2", hf + "mlp.experts.{}.down_proj.weight", experts, (dim, width))
        self.unmapped.add(ours + "moe.expert_bias")  # TorchTitan's load balancing (`StateDictAdapter.unmapped`)


class MixtralAdapter(LlamaAdapter):
    """Mixtral: Llama's attention; in every layer a router and `num_local_experts` experts of
    width `intermediate_size`, stored per expert as `w1` (gate), `w3` (up) and `w2` (down)."""

    def _build(self) -> None:
        if not self.config.num_experts:
            raise ConfigError(f"{self.config.where}: num_local_experts", 0, "a Mixtral has experts: expected >= 1")
        super()._build()

    def _mlp(self, layer: int, ours: str, hf: str) -> None:
        c = self.config
        dim, width, experts = c.hidden_size, c.moe_intermediate_size, c.num_experts
        self.add(ours + "moe.router.gate.weight", hf + "block_sparse_moe.gate.weight", (experts, dim))
        for w, shape in (("w1", (width, dim)), ("w3", (width, dim)), ("w2", (dim, width))):
            hf_name = hf + "block_sparse_moe.experts.{}." + w + ".weight"  # {}: the expert
            self.add_stack(f"{ours}moe.experts.{w}", hf_name, experts, shape)
