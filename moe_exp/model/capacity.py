"""Expert capacity, model.capacity_factor: a cap on the pairs each expert takes per forward.

Each expert takes at most `capacity` of a forward's (token, choice) pairs; the rest are
dropped, their tokens passing through the residual alone. An over-full expert drops the
lowest routing weights first with policy "score", or the latest in the micro-batch's token
order with "position".
"""
from __future__ import annotations

import math

import torch

def capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Pairs each expert may take: ceil(factor * tokens * top_k / num_experts), at least 1.

    factor 1.0 is the balanced share.
    """
    return max(1, math.ceil(factor * tokens * top_k / num_experts))


def drop_over_capacity(experts: torch.Tensor, weights: torch.Tensor, num_experts: int,
                       cap: int, policy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the pairs over each expert's capacity; returns each pair's expert and the counts.

    The first result, (T*k,) in (token, choice) order, holds each pair's expert, or
    num_experts for a dropped pair: a null expert that sorts last and computes nothing.
    The second, (E,), counts the pairs that chose each expert before any drop.
    """
    flat = experts.reshape(-1)
    if policy == "score":  # by expert, the highest weight first (ties: token order)
        best = torch.argsort(weights.detach().reshape(-1), descending=True, stable=True)
        order = best[torch.argsort(flat[best], stable=True)]
    else:  # by expert, in token order
        order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=flat.dtype, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    sorted_experts = flat[order]
    rank = torch.arange(flat.numel(), device=flat.device) - \
        (counts.cumsum(0) - counts)[sorted_experts]  # place within its expert's pairs
    kept = torch.empty_like(rank, dtype=torch.bool).scatter_(0, order, rank < cap)
    return torch.where(kept, flat, num_experts), counts
