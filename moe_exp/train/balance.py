"""Auxiliary-loss-free balancing: each step, the tokens each expert got move its routing bias.

On when model.bias_update_rate > 0. A step's counts cover every micro-batch and every rank."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..model.moe import Router, update_expert_bias


def bias_routers(model: torch.nn.Module) -> list[Router]:
    """The routers with an aux-loss-free bias, in model order.

    That is the order of the MoE layers' rows in the model's counts."""
    return [m for m in model.modules() if isinstance(m, Router) and m.bias_rate > 0]


class BiasBalancer:
    def __init__(self, model: torch.nn.Module):
        self.routers = bias_routers(model)
        self.rows = getattr(model, "moe_rows", None)  # a pipeline's: its stages' layers
        self.counts = None

    def add(self, counts: torch.Tensor) -> None:
        """Add a micro-step's counts: a row per MoE layer, a column per expert."""
        if self.routers:
            self.counts = counts.clone() if self.counts is None else self.counts.add_(counts)

    def step(self) -> None:
        """After the optimizer step, move each router's bias by the step's counts.

        Every rank uses the counts summed over all ranks, so replicas keep the same biases."""
        if self.counts is None:
            return
        if dist.is_initialized():
            dist.all_reduce(self.counts)
        counts = self.counts if self.rows is None else self.counts[self.rows]
        for router, counts in zip(self.routers, counts):
            update_expert_bias(router, counts)
        self.counts = None


def bias_spread(model: torch.nn.Module) -> float | None:
    """The largest max - min of one layer's routing biases; None without such biases."""
    spreads = [(r.expert_bias.max() - r.expert_bias.min()).item() for r in bias_routers(model)]
    return max(spreads) if spreads else None
