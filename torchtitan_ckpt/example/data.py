"""Deterministic synthetic token data, served by torchdata's `StatefulDataLoader`.

Sample `i` depends only on (seed, i): a sequence that counts up from a random start with a random
stride modulo the vocabulary, so the model has something to learn and every run sees the same
data in the same order for the same seed and data-parallel layout.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader


class SyntheticTokens(Dataset):
    def __init__(self, vocab_size: int, seq_len: int, seed: int, num_samples: int = 1 << 16):
        self.vocab_size, self.seq_len, self.seed, self.num_samples = vocab_size, seq_len, seed, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start, stride = torch.randint(0, self.vocab_size, (2,), generator=g).tolist()
        tokens = (start + (stride | 1) * torch.arange(self.seq_len + 1)) % self.vocab_size
        return tokens[:-1], tokens[1:]


def build_dataloader(
    vocab_size: int, seq_len: int, batch_size: int, seed: int, dp_rank: int, dp_degree: int
) -> StatefulDataLoader:
    dataset = SyntheticTokens(vocab_size, seq_len, seed)
    sampler = DistributedSampler(dataset, num_replicas=dp_degree, rank=dp_rank, shuffle=True, seed=seed)
    # its own generator: starting an iterator must not draw from the global RNG, whose state
    # the train state restores
    generator = torch.Generator().manual_seed(seed)
    return StatefulDataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=0,
                              drop_last=True, generator=generator)
