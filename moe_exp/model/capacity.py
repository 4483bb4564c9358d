"""Token capacity (model.capacity_factor): each expert takes at most `capacity` of a
forward's (token, choice) pairs; the rest are dropped, their tokens passing through the
residual alone. Which pairs an over-full expert drops: the lowest routing weights first
("score"), or the latest in the micro-batch's token order ("position")."""
from __future__ import annotations

import math

import torch

def capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """ceil(factor * tokens * top_k / num_experts): factor 1.0 is the balanced share."""
    return max(1, math.ceil(factor * tokens * top_k / num_experts))


def drop_over_capacity(experts: torch.Tensor, weights: torch.Tensor, num_experts: int,
                       cap: int, policy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(T*k,) each pair's expert, in (token, choice) order, with the dropped pairs' set to
    num_experts (a null expert that sorts last and computes nothing); and (E,) the pairs
    each expert was chosen by (before any drop)."""
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
