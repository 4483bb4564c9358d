"""Every optimization, applied to a plain model in one place (see `apply`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch
from torch import nn

from .checkpointing import apply_checkpointing
from .compile import apply_compile
from .precision import apply_fp8, autocast_factory, grad_scaler, set_matmul_precision


@dataclass
class Applied:
    model: nn.Module  # what the loop calls (maybe compiled or wrapped)
    autocast: Callable[[], ContextManager]
    scaler: Optional[torch.amp.GradScaler]


def apply(model: nn.Module, cfg, device: torch.device) -> Applied:
    """precision -> activation checkpointing -> compile (the order torchtitan uses).

    Gradient accumulation is a loop knob (train.grad_accum_steps), done in bench.loop.
    """
    set_matmul_precision(device, cfg.precision.tf32)
    if cfg.precision.name == "fp8":
        model = apply_fp8(model, cfg.precision)
    model = apply_checkpointing(model, cfg.train.activation_checkpointing)
    model = apply_compile(model, cfg.train.compile)
    return Applied(model, autocast_factory(cfg.precision, device), grad_scaler(cfg.precision, device))
