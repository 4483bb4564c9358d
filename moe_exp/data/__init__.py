"""Data sources (markov, tokens) and the DataLoader built from the data group."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from .markov import MarkovTokens
from .tokens import TokenFile, prepare, read_meta

__all__ = ["MarkovTokens", "TokenFile", "build_loader", "prepare", "read_meta"]


def build_loader(cfg, device: torch.device, num_samples: int) -> DataLoader:
    """Exactly num_samples sequences of train.seq_len tokens, in order, no repeats."""
    d, t = cfg.data, cfg.train
    if d.source == "markov":
        ds = MarkovTokens(cfg.model.vocab_size, t.seq_len, num_samples, d.branching, t.seed)
    else:
        ds = TokenFile(d.path, t.seq_len, num_samples, t.seed)
    kwargs = {}
    if d.num_workers > 0:
        kwargs["persistent_workers"] = d.persistent_workers
        if d.prefetch_factor is not None:
            kwargs["prefetch_factor"] = d.prefetch_factor
    return DataLoader(ds, batch_size=t.micro_batch_size, shuffle=False, drop_last=True,
                      num_workers=d.num_workers, pin_memory=d.pin_memory and device.type == "cuda",
                      **kwargs)
