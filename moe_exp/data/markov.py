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
    """num_samples sequences of seq_len + 1 tokens, made CHUNK at a time when first read (the
    loader reads in order): memory does not grow with the run's length."""

    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, branching: int = 4,
                 seed: int = 0):
        self.succ = torch.randint(0, vocab_size, (vocab_size, branching),
                                  generator=torch.Generator().manual_seed(seed))
        self.vocab_size, self.seq_len, self.branching = vocab_size, seq_len, branching
        self.num_samples, self.seed = num_samples, seed
        self._cached: tuple[int, torch.Tensor] | None = None

    def chunk(self, c: int) -> torch.Tensor:
        """Samples [c * CHUNK, (c + 1) * CHUNK), from their own generator."""
        if self._cached is None or self._cached[0] != c:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + c + 1)
            data = torch.empty(CHUNK, self.seq_len + 1, dtype=torch.long)
            data[:, 0] = torch.randint(0, self.vocab_size, (CHUNK,), generator=g)
            choice = torch.randint(0, self.branching, (CHUNK, self.seq_len), generator=g)
            for t in range(self.seq_len):  # vectorised over the chunk's samples
                data[:, t + 1] = self.succ[data[:, t], choice[:, t]]
            self._cached = (c, data)
        return self._cached[1]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int):
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        row = self.chunk(i // CHUNK)[i % CHUNK]
        return row[:-1], row[1:]
