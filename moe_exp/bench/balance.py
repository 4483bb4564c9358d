"""Auxiliary-loss-free balancing's step (model.bias_update_rate > 0): the tokens each expert
got over a step (every micro-batch, every rank) move each MoE layer's routing bias."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..model.moe import Router, update_expert_bias


def bias_routers(model: torch.nn.Module) -> list[Router]:
    """The routers with an aux-loss-free bias, in model order (the order of the MoE layers'
    rows in the model's counts)."""
    return [m for m in model.modules() if isinstance(m, Router) and m.bias_rate > 0]


class BiasBalancer:
    def __init__(self, model: torch.nn.Module):
        self.routers = bias_routers(model)
        self.counts = None

    def add(self, counts: torch.Tensor) -> None:
        """A micro-step's (MoE layers, experts) counts."""
        if self.routers:
            self.counts = counts.clone() if self.counts is None else self.counts.add_(counts)

    def step(self) -> None:
        """After the optimizer step: every rank moves its biases by the global counts (so
        replicas keep the same biases)."""
        if self.counts is None:
            return
        if dist.is_initialized():
            dist.all_reduce(self.counts)
        for router, counts in zip(self.routers, self.counts):
            update_expert_bias(router, counts)
        self.counts = None


def bias_spread(model: torch.nn.Module) -> float | None:
    """The largest spread (max - min) of a layer's routing biases; None without them."""
    spreads = [(r.expert_bias.max() - r.expert_bias.min()).item() for r in bias_routers(model)]
    return max(spreads) if spreads else None
