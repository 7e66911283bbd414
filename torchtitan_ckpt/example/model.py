"""A small Llama 3 style decoder: RMSNorm, grouped-query attention, RoPE, SwiGLU.

RoPE follows TorchTitan's convention: frequencies as complex numbers, applied to *interleaved*
pairs of a head's channels (0,1), (2,3), ... (Hugging Face's Llama uses the half-split layout;
an HF adapter has to permute `wq`/`wk` rows between the two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


FLAVORS = {
    "debugmodel": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256),
    "small": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048),
    # about 128M parameters: 1.5 GB of fp32 weights plus AdamW state, for benchmarks
    "bench": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32000, multiple_of=256),
}


def precompute_freqs_cis(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), freqs)
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
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(bs, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bs, seq, self.n_kv_heads, self.head_dim)
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


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Parameter names match TorchTitan's Llama 3 (`tok_embeddings`, `layers.N.attention.wq`, ...)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # derived from the config, so not part of the checkpoint
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta),
            persistent=False,
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic given the global seed, identical on every rank."""
        nn.init.normal_(self.tok_embeddings.weight)
        std_out = 0.02 / (2 * self.args.n_layers) ** 0.5
        for block in self.layers.values():
            for lin in (block.attention.wq, block.attention.wk, block.attention.wv, block.feed_forward.w1):
                nn.init.trunc_normal_(lin.weight, std=0.02)
            for lin in (block.attention.wo, block.feed_forward.w2, block.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, std=std_out)
        if not self.args.tie_embeddings:  # tied: the embedding's init is the head's
            nn.init.trunc_normal_(self.output.weight, std=self.args.dim**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h, self.freqs_cis)
        return self.output(self.norm(h))
