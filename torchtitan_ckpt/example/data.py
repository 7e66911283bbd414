"""Deterministic synthetic token data, served by torchdata's `StatefulDataLoader`.

Sample `i` depends only on (seed, i): a sequence that counts up from a random start with a random
stride modulo the vocabulary, so the model has something to learn and every run sees the same
data in the same order for the same seed and data-parallel layout.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from ..io.torch_archive import load_plain_pickle
from ..states import DP_RANK_PREFIX

SAMPLES = 1 << 16
"""Samples in the synthetic dataset. A run is at most one pass over it: the loader starts no
second epoch, so the config refuses steps that would need one."""


def _sample_seed(seed: int, index: int) -> int:
    """The generator seed of sample `index`. Taken modulo 2**64, where torch reads a negative seed
    as its two's complement: the same seed as before for every value that fitted in 64 bits, and
    no overflow for any 64-bit `seed`."""
    return (seed * 1_000_003 + index) % (1 << 64)


class SyntheticTokens(Dataset):
    def __init__(self, vocab_size: int, seq_len: int, seed: int, num_samples: int = SAMPLES):
        self.vocab_size, self.seq_len, self.seed, self.num_samples = vocab_size, seq_len, seed, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(_sample_seed(self.seed, index))
        start, stride = torch.randint(0, self.vocab_size, (2,), generator=g).tolist()
        tokens = (start + (stride | 1) * torch.arange(self.seq_len + 1)) % self.vocab_size
        return tokens[:-1], tokens[1:]


class DataParallelLoader(StatefulDataLoader):
    """A loader that knows its data-parallel rank, saved as TorchTitan's `ParallelAwareDataloader`
    saves it (`dp_rank_{r}`: the pickled position, `world_size`: the data-parallel degree), so the
    tensor-parallel ranks and pipeline stages that share a data-parallel rank save one entry.
    The manager checks the pickle is plain data before `load_state_dict` sees it."""

    def __init__(self, dataset: Dataset, dp_rank: int, dp_world_size: int, **kwargs):
        super().__init__(dataset, **kwargs)
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size

    def state_dict(self) -> dict[str, Any]:
        return {f"{DP_RANK_PREFIX}{self.dp_rank}": pickle.dumps(super().state_dict()),
                "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(load_plain_pickle(state_dict[f"{DP_RANK_PREFIX}{self.dp_rank}"]))


def build_dataloader(
    vocab_size: int, seq_len: int, batch_size: int, seed: int, dp_rank: int, dp_degree: int
) -> DataParallelLoader:
    dataset = SyntheticTokens(vocab_size, seq_len, seed)
    sampler = DistributedSampler(dataset, num_replicas=dp_degree, rank=dp_rank, shuffle=True, seed=seed)
    # its own generator: starting an iterator must not draw from the global RNG, whose state
    # the train state restores
    generator = torch.Generator().manual_seed(seed)
    return DataParallelLoader(dataset, dp_rank, dp_degree, batch_size=batch_size, sampler=sampler,
                              num_workers=0, drop_last=True, generator=generator)
