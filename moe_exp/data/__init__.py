"""Data sources, markov and tokens, and the DataLoader built from the data group."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Subset

from .markov import CHUNK, MarkovTokens
from .tokens import TokenFile, held_tokens, prepare, read_meta

__all__ = ["MarkovTokens", "TokenFile", "build_loader", "heldout", "markov_floor", "prepare",
           "prompts", "read_meta"]


def markov_floor(cfg) -> float | None:
    """The run's loss_floor: MarkovTokens.loss_floor for data=markov, None for a corpus."""
    return _markov(cfg, 0).loss_floor() if cfg.data.source == "markov" else None


def _markov(cfg, num_samples: int, heldout: bool = False) -> MarkovTokens:
    return MarkovTokens(cfg.model.vocab_size, cfg.train.seq_len, num_samples,
                        cfg.data.branching, cfg.train.seed, heldout)


def heldout(cfg) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The eval set: train.eval_sequences sequences no run trains on; None where there is none.

    The same for every configuration of a model and data source. data=markov: walks of the
    same chain from generators no training chunk uses (MarkovTokens.chunk). A token file
    with data.heldout: its last windows, which no training window reaches.
    """
    n = cfg.train.eval_sequences
    if not n or cfg.data.source != "markov" and not cfg.data.heldout:
        return None
    rows = held_rows(cfg, n, cfg.train.seq_len)
    return rows[:, :-1], rows[:, 1:]


def held_rows(cfg, n: int, seq_len: int) -> torch.Tensor:
    """n held-out rows of seq_len + 1 tokens.

    For data=markov, walks of the chain from generators no training chunk uses; otherwise a
    token file's last windows.
    """
    if cfg.data.source == "markov":
        ds = MarkovTokens(cfg.model.vocab_size, seq_len, n, cfg.data.branching, cfg.train.seed,
                          heldout=True)
        return torch.cat([ds.chunk(c) for c in range(-(-n // CHUNK))])[:n]
    return TokenFile(cfg.data.path, seq_len, 0).tail(n)



def prompts(cfg, n: int, length: int) -> torch.Tensor:
    """task=infer's n prompts of `length` tokens: the first tokens of held-out rows."""
    return held_rows(cfg, n, length)[:, :length]


def build_loader(cfg, device: torch.device, num_samples: int, rank: int = 0,
                 world: int = 1, start: int = 0) -> DataLoader:
    """The training loader: exactly num_samples sequences of train.seq_len tokens for this rank.

    In order, no repeats. With several ranks, global micro-batch m is samples
    [m*B*world, (m+1)*B*world) and rank r takes its r-th block of B, so together the ranks
    see what one process with micro_batch_size B*world would. start: how many of this rank's
    first sequences to leave out, those a resumed run has already trained on.
    """
    d, t = cfg.data, cfg.train
    n = num_samples * world
    if d.source == "markov":
        ds = _markov(cfg, n)
    else:
        ds = TokenFile(d.path, t.seq_len, n, t.seed, held_tokens(cfg))
    if world > 1:
        b = t.micro_batch_size
        ds = Subset(ds, [m * b * world + rank * b + i for m in range(num_samples // b)
                         for i in range(b)])
    if start:
        ds = Subset(ds, range(start, len(ds)))
    kwargs = {}
    if d.num_workers > 0:
        kwargs["persistent_workers"] = d.persistent_workers
        if d.prefetch_factor is not None:
            kwargs["prefetch_factor"] = d.prefetch_factor
    return DataLoader(ds, batch_size=t.micro_batch_size, shuffle=False, drop_last=True,
                      num_workers=d.num_workers, pin_memory=d.pin_memory and device.type == "cuda",
                      **kwargs)
