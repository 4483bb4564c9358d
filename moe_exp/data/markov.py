"""Synthetic tokens with learnable structure: a fixed random Markov chain.

Each token has `branching` successors chosen at random (from the seed); a sequence
walks the chain. The best achievable loss is ln(branching) nats, far below the
ln(vocab) of a fresh model, so a short run shows the loss falling.
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


class MarkovTokens(Dataset):
    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, branching: int = 4,
                 seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        succ = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)
        data = torch.empty(num_samples, seq_len + 1, dtype=torch.long)
        data[:, 0] = torch.randint(0, vocab_size, (num_samples,), generator=g)
        choice = torch.randint(0, branching, (num_samples, seq_len), generator=g)
        for t in range(seq_len):  # vectorised over samples
            data[:, t + 1] = succ[data[:, t], choice[:, t]]
        self.data = data

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int):
        row = self.data[i]
        return row[:-1], row[1:]
