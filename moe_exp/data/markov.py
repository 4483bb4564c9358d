"""Synthetic tokens with learnable structure: a fixed random Markov chain.

Each token has `branching` successors, chosen at random from the seed; a sequence walks
the chain. The best achievable loss, loss_floor, is about ln(branching) nats, far below
the ln(vocab) of a fresh model, so a short run shows the loss falling.
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


CHUNK = 64  # samples drawn from one generator: sample i does not depend on num_samples


class MarkovTokens(Dataset):
    """num_samples walks of the chain, each seq_len + 1 tokens long.

    Made CHUNK at a time when first read, as the loader reads in order, so memory does not
    grow with the run's length.
    """

    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, branching: int = 4,
                 seed: int = 0, heldout: bool = False):
        self.succ = torch.randint(0, vocab_size, (vocab_size, branching),
                                  generator=torch.Generator().manual_seed(seed))
        self.vocab_size, self.seq_len, self.branching = vocab_size, seq_len, branching
        self.num_samples, self.seed, self.heldout = num_samples, seed, heldout
        self._cached: tuple[int, torch.Tensor] | None = None

    def chunk(self, c: int) -> torch.Tensor:
        """Samples [c * CHUNK, (c + 1) * CHUNK), from their own generator."""
        if self._cached is None or self._cached[0] != c:
            # held-out chunks count down from the seed's base, training's up (the generator
            # keeps a seed's low 32 bits: they would meet past 2**32 chunks together)
            step = -(c + 1) if self.heldout else c + 1
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) % 2**64)
            data = torch.empty(CHUNK, self.seq_len + 1, dtype=torch.long)
            data[:, 0] = torch.randint(0, self.vocab_size, (CHUNK,), generator=g)
            choice = torch.randint(0, self.branching, (CHUNK, self.seq_len), generator=g)
            for t in range(self.seq_len):  # vectorised over the chunk's samples
                data[:, t + 1] = self.succ[data[:, t], choice[:, t]]
            self._cached = (c, data)
        return self._cached[1]

    def loss_floor(self) -> float:
        """The lowest expected loss any model can reach on these samples."""
        return loss_floor(self.succ, self.seq_len)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int):
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        row = self.chunk(i // CHUNK)[i % CHUNK]
        return row[:-1], row[1:]


def loss_floor(succ: torch.Tensor, seq_len: int) -> float:
    """The lowest expected cross-entropy of any model on the chain's sequences, in nats/token.

    succ: (vocab, branching), each token's successors; one listed twice is twice as likely.
    At each of the seq_len positions, the entropy of the next token given the current one,
    weighted by where the chain stands there, averaged over the positions. The first token
    is uniform. Once the chain's distribution stops moving, the remaining positions take
    the settled value.
    """
    v, b = succ.shape
    same = (succ[:, :, None] == succ[:, None, :]).sum(-1).double()  # each listing's count
    entropy = -(same / b).log().sum(1) / b  # (vocab,): H(next | current)
    p = torch.full((v,), 1.0 / v, dtype=torch.float64)
    total = 0.0
    for t in range(seq_len):
        here = float(p @ entropy)
        nxt = torch.zeros(v, dtype=torch.float64).index_add_(
            0, succ.reshape(-1), (p / b).repeat_interleave(b))
        if float((nxt - p).abs().sum()) < 1e-13:  # settled
            return (total + here * (seq_len - t)) / seq_len
        total, p = total + here, nxt
    return total / seq_len
