"""KV cache: the keys and values of the positions a generation has decoded so far.

One buffer per layer, allocated on first use in the dtype the layer's keys come in.
"""
from __future__ import annotations

import torch


class LayerCache:
    def __init__(self, max_len: int):
        self.max_len, self.pos = max_len, 0
        self.k = self.v = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, heads, new, D) at positions pos.. ; return every position's so far."""
        end = self.pos + k.shape[-2]
        if end > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions: {end} asked")
        if self.k is None:
            self.k = k.new_empty(*k.shape[:-2], self.max_len, k.shape[-1])
            self.v = v.new_empty(*v.shape[:-2], self.max_len, v.shape[-1])
        self.k[..., self.pos:end, :] = k
        self.v[..., self.pos:end, :] = v
        return self.k[..., :end, :], self.v[..., :end, :]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)


class KVCache:
    """Every layer's cache, advanced together.

    pos: the positions decoded so far, the same in every layer and every sequence of the
    batch.
    """

    def __init__(self, num_layers: int, max_len: int):
        self.layers = [LayerCache(max_len) for _ in range(num_layers)]
        self.pos = 0

    def advance(self, n: int) -> None:
        self.pos += n
        for c in self.layers:
            c.pos = self.pos

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers)
