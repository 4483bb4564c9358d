"""The optim group: AdamW, or Muon on the hidden matrices and AdamW on the rest; lr schedules.

optim.schedule: linear warmup, then cosine, linear, constant or wsd; or onecycle.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import total_steps
from .muon import Muon, hidden_matrices


def build_optimizer(model: nn.Module, cfg, device: torch.device):
    """Build the optim group's optimizer and lr scheduler.

    Returns (optimizer, lr scheduler, implementation name for the record).
    """
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    muon = hidden_matrices(model) if o.name == "muon" else set()
    decay = [p for p in params if p.dim() >= 2 and id(p) not in muon]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    impl = o.impl
    if impl == "auto":
        impl = "fused" if device.type in ("cuda", "cpu") else "foreach"
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **kwargs)
    if o.name == "muon":
        opt = Muon([p for p in params if id(p) in muon], opt, lr=o.lr,
                   weight_decay=o.weight_decay, momentum=o.momentum, nesterov=o.nesterov,
                   ns_steps=o.ns_steps)
        impl = f"muon+adamw-{impl}"
    return opt, build_schedule(opt, total_steps(cfg.train), o), impl


def build_schedule(opt, total: int, o):
    """The lr scheduler for optim.schedule over the run's `total` steps, warmup included.

    onecycle is torch's OneCycleLR on the lr only: its momentum cycling would rewrite AdamW's
    beta1. The others scale the lr by lr_factor.
    """
    if o.schedule == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=[g["lr"] for g in opt.param_groups], total_steps=total,
            pct_start=o.pct_start, cycle_momentum=False)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, o))


def lr_factor(step: int, total: int, o) -> float:
    """The lr at `step` as a fraction of the peak, for every schedule but onecycle.

    Linear warmup reaches the peak on its last step, or on step 0 without warmup. Then:
    cosine or linear, down to min_lr_ratio on the last step; constant; or wsd, stable at the
    peak, then linear down to min_lr_ratio over the last decay_ratio of the steps after
    warmup, reached on the last step.
    """
    w = o.lr_warmup_steps
    if step < w:
        return (step + 1) / w
    done, span = (step - w + 1, total - w) if w else (step, total - 1)
    progress = min(1.0, done / max(1, span))
    low = o.min_lr_ratio
    if o.schedule == "constant":
        return 1.0
    if o.schedule == "linear":
        return 1 - (1 - low) * progress
    if o.schedule == "wsd":
        stable = 1 - o.decay_ratio  # progress where the decay starts
        return 1.0 if progress <= stable else 1 - (1 - low) * (progress - stable) / o.decay_ratio
    return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))
