"""Synthetic tokens with learnable structure: a fixed random Markov chain.

Each token has `branching` successors chosen at random (from the seed); a sequence
walks the chain. The best achievable loss is ln(branching) nats, far below the
ln(vocab) of a fresh model, so a short run shows the loss falling.
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


CHUNK = 64  # samples drawn from one generator: sample i does not depend on num_samples


class MarkovTokens(Dataset):
    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, branching: int = 4,
                 seed: int = 0):
        succ = torch.randint(0, vocab_size, (vocab_size, branching),
                             generator=torch.Generator().manual_seed(seed))
        n = -(-num_samples // CHUNK) * CHUNK
        data = torch.empty(n, seq_len + 1, dtype=torch.long)
        choice = torch.empty(n, seq_len, dtype=torch.long)
        for c in range(0, n, CHUNK):  # runs of any length see the same data
            g = torch.Generator().manual_seed(seed * 1_000_003 + c // CHUNK + 1)
            data[c: c + CHUNK, 0] = torch.randint(0, vocab_size, (CHUNK,), generator=g)
            choice[c: c + CHUNK] = torch.randint(0, branching, (CHUNK, seq_len), generator=g)
        for t in range(seq_len):  # vectorised over samples
            data[:, t + 1] = succ[data[:, t], choice[:, t]]
        self.data = data[:num_samples]

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int):
        row = self.data[i]
        return row[:-1], row[1:]
