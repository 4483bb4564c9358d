"""AdamW with linear warmup + cosine decay (the optim group)."""
from __future__ import annotations

import math

import torch
from torch import nn

from .config import total_steps


def build_optimizer(model: nn.Module, cfg, device: torch.device):
    o = cfg.optim
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    impl = o.impl
    if impl == "auto":
        impl = "fused" if device.type in ("cuda", "cpu") else "foreach"
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **kwargs)
    total = total_steps(cfg.train)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, o))
    return opt, sched, impl


def lr_factor(step: int, total: int, o) -> float:
    if step < o.lr_warmup_steps:
        return (step + 1) / o.lr_warmup_steps
    progress = min(1.0, (step - o.lr_warmup_steps) / max(1, total - o.lr_warmup_steps))
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
