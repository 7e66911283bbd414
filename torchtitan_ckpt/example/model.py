"""A small decoder in the Llama 3 / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral families: RMSNorm,
grouped-query attention (optionally with Qwen2's q/k/v biases or Qwen3's per-head q/k norms), RoPE
(optionally Llama 3.1's scaling), and SwiGLU, or a mixture of experts (a router, experts stored as
grouped 3-D weights as TorchTitan stores them, an optional shared expert).

RoPE follows TorchTitan's convention: frequencies as complex numbers, applied to *interleaved*
pairs of a head's channels (0,1), (2,3), ... (Hugging Face uses the half-split layout; the HF
adapters permute `wq`/`wk` rows, and q/k norm weights, between the two).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import ConfigError
from ..hf import HFModelConfig, StateDictAdapter, adapter_for_config
from ..hf.files import CONFIG_FILE
from ..hf.model_config import positive_float, read_hf_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as `transformers` names it: "linear" divides every frequency by
    `factor`; "llama3" (Llama 3.1 and later) divides the low frequencies by `factor`, keeps the
    high ones and blends in between."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class MoEArgs:
    """A mixture-of-experts FFN: `num_experts` experts of width `hidden`, `top_k` per token."""

    num_experts: int
    top_k: int
    hidden: int
    norm_topk_prob: bool = True
    """Renormalise the `top_k` routing weights of a token to sum to 1."""
    shared_hidden: int = 0
    """Width of an expert every token also goes through (0: none)."""
    every: int = 1
    """Layers l with (l + 1) % every == 0 are MoE layers (HF's `decoder_sparse_step`)."""
    dense_layers: tuple[int, ...] = ()
    """Layers that keep a dense FFN (HF's `mlp_only_layers`)."""


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    """Share one matrix between `tok_embeddings` and `output` (as HF's `tie_word_embeddings`)."""
    ffn_hidden: int = 0
    """FFN width; 0 derives it from `dim` and `multiple_of` (Llama 3's rule)."""
    head_size: int = 0
    """Channels per head; 0 means dim / n_heads."""
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2)."""
    moe: MoEArgs | None = None

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        hidden = int(2 * 4 * self.dim / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def model_type(self) -> str:
        """The HF family whose layout this model has (checked by `hf_config`)."""
        if self.moe:
            return "qwen3_moe" if self.qk_norm else "mixtral"
        return "qwen3" if self.qk_norm else "qwen2" if self.qkv_bias else "llama"

    def is_moe_layer(self, layer: int) -> bool:
        moe = self.moe
        return moe is not None and layer not in moe.dense_layers and (layer + 1) % moe.every == 0


FLAVORS = {
    "debugmodel": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256),
    "small": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048),
    # about 128M parameters: 1.5 GB of fp32 weights plus AdamW state, for benchmarks
    "bench": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32000, multiple_of=256),
    # Llama 3.1's shape in small: its own FFN width and head_dim, llama3 RoPE scaling
    "llama31_debug": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=200,
                               head_size=24, rope_theta=500000.0,
                               rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64)),
    "qwen3_debug": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=96,
                             head_size=32, norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True, tie_embeddings=True),
    # every mesh of the layout tests: 4 layers (two stages per pipeline rank at pp 2), 4 KV heads (tp 4)
    "debugmodel_mesh": ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=256),
    # a small MoE model: about 0.2 GB with AdamW state, 8 experts per layer
    "small_moe": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, ffn_hidden=704,
                           head_size=32, norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
                           moe=MoEArgs(num_experts=8, top_k=2, hidden=512)),
    # the MoE layout of benchmarks/meshes.py at the dense `bench` size: about 127M parameters
    # (1.5 GB with AdamW state), 70% of them in 16 experts per layer
    "bench_moe": ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=32000, ffn_hidden=1024,
                           head_size=64, norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
                           moe=MoEArgs(num_experts=16, top_k=2, hidden=448)),
    "qwen3_moe_debug": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=96,
                                 head_size=16, norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
                                 moe=MoEArgs(num_experts=4, top_k=2, hidden=32)),
    "qwen2_debug": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=96,
                             norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True),
    "mixtral_debug": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=48,
                               rope_theta=1000000.0, moe=MoEArgs(num_experts=4, top_k=2, hidden=48)),
}


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The `config.json` of the `transformers` model with the shapes and constants of `args`."""
    family = args.model_type
    if unfit := _unfit(args):
        raise ValueError(f"{family} has {unfit}; this model has not, so no HF family holds it")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        rope.update(vars(args.rope_scaling))
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
    config = {
        "architectures": [arch[args.model_type]], "model_type": args.model_type,
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_parameters": rope,
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu", "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if family in ("llama", "qwen3", "qwen3_moe"):  # Qwen2 and Mixtral have no such key
        config["attention_bias"] = False
    if family == "mixtral":
        config.update(num_local_experts=args.moe.num_experts, num_experts_per_tok=args.moe.top_k,
                      intermediate_size=args.moe.hidden)
    elif args.moe is not None:
        config.update(num_experts=args.moe.num_experts, num_experts_per_tok=args.moe.top_k,
                      moe_intermediate_size=args.moe.hidden, norm_topk_prob=args.moe.norm_topk_prob,
                      decoder_sparse_step=args.moe.every, mlp_only_layers=list(args.moe.dense_layers))
    return config


def _unfit(args: ModelArgs) -> str:
    """What the family `args.model_type` has that `args` has not (or the other way round), in
    words; empty when it fits."""
    moe, family = args.moe, args.model_type
    if moe is not None and moe.shared_hidden:
        return "no shared expert"
    if args.qkv_bias and family != "qwen2":
        return "no biases"
    if family == "mixtral" and (moe.every != 1 or moe.dense_layers or not moe.norm_topk_prob):
        return "experts in every layer, their top-k weights renormalised"
    return ""


ROPE_LAYOUT = "interleaved"
"""This model's RoPE rotates channel pairs (2i, 2i+1) of a head, for every family (`hf.adapter.ROPE_LAYOUTS`)."""


_FORWARD = ("norm_eps", "rope_theta", "rope_scaling", "qk_norm", "qkv_bias", "moe")
"""The `ModelArgs` that change the forward pass besides the weights' shapes (which the adapter
compares): an export's `config.json` must give the model's."""


def _as_float32(value: Any) -> Any:
    """`value` (a number, or a dataclass of them) with its floats as the model computes with
    them: a config's `rms_norm_eps` of 9.999999747378752e-06 (1e-5 rounded to float32, as
    configs converted from GGUF give it) is the model's 1e-5."""
    if isinstance(value, float):
        return struct.unpack("f", struct.pack("f", value))[0]
    if dataclasses.is_dataclass(value):
        return tuple(_as_float32(getattr(value, f.name)) for f in dataclasses.fields(value))
    return value


def hf_adapter(args: ModelArgs, hf_assets_path: str | None = None) -> StateDictAdapter:
    """The HF adapter of a model with `args`, built from its `config.json` (`hf_config`). An
    `hf_assets_path` whose `config.json` describes another forward pass (another RoPE, norm
    epsilon or family: a flavor of the right sizes for another model) is a `ConfigError`: the
    model would train with the flavor's and be exported under that config."""
    path = os.path.join(hf_assets_path or "", CONFIG_FILE)
    if hf_assets_path is not None and os.path.isfile(path):
        theirs = args_from_hf_config(read_hf_config(path).raw, path)
        if differ := [f"{f} = {getattr(theirs, f)} there, {getattr(args, f)} in the flavor" for f in _FORWARD
                      if _as_float32(getattr(theirs, f)) != _as_float32(getattr(args, f))]:
            raise ConfigError("model.hf_assets_path", hf_assets_path,
                              f"its {CONFIG_FILE} describes another model than the flavor ({'; '.join(differ)}); "
                              "pick the flavor of that model, or assets of this one")
    return adapter_for_config(hf_config(args), hf_assets_path, where=f"the {args.model_type} model's config",
                              rope_layout=ROPE_LAYOUT)


FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")
"""The HF `model_type`s whose models this one builds (`args_from_hf_config`)."""


_FORWARD_DEFAULTS = {"mixtral": (1e-5, 1e6)}
"""`model_type` -> the `rms_norm_eps` and `rope_theta` `transformers` gives a config that leaves
them out, where they are not every other family's (1e-6, 10000)."""


def args_from_hf_config(raw: Any, where: str = CONFIG_FILE) -> ModelArgs:
    """The `ModelArgs` of the model a parsed HF `config.json` describes. Raises `ConfigError`
    naming the key this model cannot express (biases, another activation, a RoPE type it does
    not implement)."""
    c = HFModelConfig.parse(raw, where)
    if c.model_type not in FAMILIES:
        raise ConfigError(f"{where}: model_type", c.model_type, f"expected one of {', '.join(FAMILIES)}")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise ConfigError(f"{where}: {key}", raw[key], "the example model has no biases but Qwen2's")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act", raw["hidden_act"], "the example model uses silu")
    if raw.get("sliding_window") and raw.get("use_sliding_window", True):
        logger.warning("%s: sliding_window %s is ignored: the example model attends to the whole context",
                       where, raw["sliding_window"])
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: rope_parameters", rope, "expected an object")
    eps, theta = _FORWARD_DEFAULTS.get(c.model_type, (1e-6, 10000.0))
    theta = positive_float(raw, "rope_theta", positive_float(rope, "rope_theta", theta, where), where)
    return ModelArgs(
        dim=c.hidden_size, n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads, vocab_size=c.vocab_size, ffn_hidden=c.intermediate_size,
        head_size=c.head_dim, norm_eps=positive_float(raw, "rms_norm_eps", eps, where), rope_theta=theta,
        max_seq_len=int(positive_float(raw, "max_position_embeddings", 2048, where)),
        tie_embeddings=c.tie_word_embeddings, rope_scaling=_rope_scaling(rope, where),
        qk_norm=c.model_type.startswith("qwen3"), qkv_bias=c.model_type == "qwen2", moe=_moe_args(c),
    )


def _rope_scaling(rope: dict[str, Any], where: str) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise ConfigError(f"{where}: rope_type", kind, "the example model implements default, linear and llama3 "
                          "RoPE (the HF adapters take any: scaling changes no weight)")
    factor = positive_float(rope, "factor", 1.0, where)
    if kind == "linear":
        return RopeScaling(kind, factor)
    low, high = positive_float(rope, "low_freq_factor", 1.0, where), positive_float(rope, "high_freq_factor", 4.0, where)
    if high <= low:
        raise ConfigError(f"{where}: high_freq_factor", high, f"must exceed low_freq_factor ({low})")
    original = int(positive_float(rope, "original_max_position_embeddings", 8192, where))
    return RopeScaling(kind, factor, low, high, original)


def _moe_args(c: HFModelConfig) -> MoEArgs | None:
    if not c.num_experts:
        return None
    return MoEArgs(num_experts=c.num_experts, top_k=c.num_experts_per_tok, hidden=c.expert_width("the example model"),
                   norm_topk_prob=c.norm_topk_prob, every=c.decoder_sparse_step,
                   dense_layers=c.mlp_only_layers)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The rotation frequency of each channel pair of a head, scaled as `scaling` says."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    if scaling is None:
        return freqs
    if scaling.rope_type == "linear":
        return freqs / scaling.factor
    wavelen = 2 * math.pi / freqs
    original = scaling.original_max_position_embeddings
    scaled = torch.where(wavelen > original / scaling.low_freq_factor, freqs / scaling.factor, freqs)
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    medium = (wavelen >= original / scaling.high_freq_factor) & (wavelen <= original / scaling.low_freq_factor)
    return torch.where(medium, (1 - smooth) * scaled / scaling.factor + smooth * scaled, scaled)


def precompute_freqs_cis(args: ModelArgs) -> torch.Tensor:
    freqs = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    angles = torch.outer(torch.arange(args.max_seq_len).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # complex64 [seq_len, head_dim / 2]


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs of `x` [batch, seq, heads, head_dim]."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = pairs * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(rotated).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds n_heads / tp of them
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        repeat = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)


class GroupedExperts(nn.Module):
    """All experts' SwiGLU weights as 3-D tensors [expert, out, in], as TorchTitan stores them
    (expert parallelism shards dim 0)."""

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, first: int) -> torch.Tensor:
        """Each token's sum over the experts this rank holds (numbered from `first`; all of them
        without expert parallelism) that `chosen` picks for it, weighted by `weights`.

        One call per MoE forward on every rank, whatever the routing, and every expert in the
        graph (an expert given no token gets a zero gradient, not none): FSDP gathers the
        experts for each call and reduces their gradients, and its peers must do so alike. The
        experts this rank holds are counted here, where FSDP has gathered them."""
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        out = torch.zeros_like(x)
        for i in range(w1.shape[0]):
            token, slot = torch.where(chosen == first + i)
            y = (F.silu(x[token] @ w1[i].T) * (x[token] @ w3[i].T)) @ w2[i].T
            out.index_add_(0, token, y * weights[token, slot, None])
        return out


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts: the local shard of an expert-parallel DTensor, else the tensor."""
    return w.to_local() if isinstance(w, DTensor) else w


class MoE(nn.Module):
    def __init__(self, dim: int, moe: MoEArgs):
        super().__init__()
        self.args = moe
        self.router = Router(dim, moe.num_experts)
        self.experts = GroupedExperts(dim, moe.hidden, moe.num_experts)
        if moe.shared_hidden:
            self.shared_experts = FeedForward(dim, moe.shared_hidden)
        self.ep_group: dist.ProcessGroup | None = None
        """The expert-parallel group whose ranks hold the experts in turn (`parallel.py`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router.gate(flat), dim=-1, dtype=torch.float)
        weights, chosen = probs.topk(self.args.top_k, dim=-1)
        if self.args.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        routed = self.experts(flat, chosen, weights, 0) if self.ep_group is None else self._ep(flat, chosen, weights)
        if self.args.shared_hidden:
            routed = routed + self.shared_experts(flat)
        return routed.view(x.shape)

    def _ep(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Expert parallel: every rank of the group applies its experts to the tokens of all of
        them, and the sums go back to the tokens' ranks (an all-gather and a sum-scatter, where
        TorchTitan uses an all-to-all: the same values, with simpler code)."""
        group = self.ep_group
        all_flat, all_weights = (_Rows.apply(t, group, True) for t in (flat, weights))
        first = dist.get_rank(group) * (self.args.num_experts // dist.get_world_size(group))
        out = self.experts(all_flat, _gather_rows(chosen, group), all_weights, first)
        return _Rows.apply(out, group, False)


def _gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The ranks' `x` one after another along dim 0, in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def _sum_scatter_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's block of rows of the ranks' sum of `x`: an all-reduce, then a slice. The
    functional collectives' reduce-scatter on gloo (torch 2.13) now and then corrupted the heap
    and crashed the expert-parallel job."""
    total = x.contiguous().clone()
    dist.all_reduce(total, group=group)
    return total.chunk(dist.get_world_size(group))[dist.get_rank(group)].clone()


class _Rows(torch.autograd.Function):
    """`_gather_rows` (`gather` true) or `_sum_scatter_rows`, each the other's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, gather: bool) -> torch.Tensor:
        ctx.group, ctx.gather = group, gather
        return (_gather_rows if gather else _sum_scatter_rows)(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (_sum_scatter_rows if ctx.gather else _gather_rows)(grad, ctx.group), None, None


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.attention = Attention(args)
        if args.is_moe_layer(layer):
            self.moe = MoE(args.dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


def _weight(m: nn.Module | nn.Parameter) -> torch.Tensor:
    return m.weight if isinstance(m, nn.Linear) else m


class Transformer(nn.Module):
    """Parameter names match TorchTitan's Llama 3 / Qwen3 (`tok_embeddings`,
    `layers.N.attention.wq`, `layers.N.moe.experts.w1`, ...)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # derived from the config, so not part of the checkpoint
        self.register_buffer("freqs_cis", precompute_freqs_cis(args), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic given the global seed, identical on every rank; every value the model
        holds, so that one built on the meta device is whole after `to_empty` and this (the norms'
        weights and the rotary table as well, which `to_empty` leaves undefined, and the tie of
        head and embedding, which it undoes)."""
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        for module in self.modules():
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        self.freqs_cis.copy_(precompute_freqs_cis(self.args))
        nn.init.normal_(self.tok_embeddings.weight)
        std_out = 0.02 / (2 * self.args.n_layers) ** 0.5
        for block in self.layers.values():
            att = block.attention
            ffns = [block.moe.experts, *([block.moe.shared_experts] if block.moe.args.shared_hidden else [])] \
                if hasattr(block, "moe") else [block.feed_forward]
            weights = [_weight(getattr(f, w)) for f in ffns for w in ("w1", "w2", "w3")]
            for w in (att.wq.weight, att.wk.weight, att.wv.weight, *weights[0::3]):
                nn.init.trunc_normal_(w, std=0.02)
            if self.args.qkv_bias:
                for w in (att.wq.bias, att.wk.bias, att.wv.bias):
                    nn.init.trunc_normal_(w, std=0.02)
            for w in (att.wo.weight, *weights[1::3], *weights[2::3]):
                nn.init.trunc_normal_(w, std=std_out)
            if hasattr(block, "moe"):
                nn.init.trunc_normal_(block.moe.router.gate.weight, std=0.02)
        if not self.args.tie_embeddings:  # tied: the embedding's init is the head's
            nn.init.trunc_normal_(self.output.weight, std=self.args.dim**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens to logits; a pipeline stage (`parallel.pipeline_parts`) lacks the embedding
        (it takes the previous stage's activations) or the norm and output (it returns its own)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.freqs_cis)
        return self.output(self.norm(h)) if self.output is not None else h
