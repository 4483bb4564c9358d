"""The optim group: AdamW, or Muon on the hidden matrices with AdamW on the rest; linear
warmup then cosine decay."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import total_steps
from .muon import Muon, hidden_matrices


def build_optimizer(model: nn.Module, cfg, device: torch.device):
    """(optimizer, lr scheduler, implementation name for the record)."""
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
    total = total_steps(cfg.train)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, o))
    return opt, sched, impl


def lr_factor(step: int, total: int, o) -> float:
    """Linear warmup to the peak (reached on the last warmup step, or on step 0 without
    warmup), then cosine down to min_lr_ratio, reached on the last step."""
    w = o.lr_warmup_steps
    if step < w:
        return (step + 1) / w
    done, span = (step - w + 1, total - w) if w else (step, total - 1)
    progress = min(1.0, done / max(1, span))
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
