"""Precision: fp32, tf32, fp16 with autocast and GradScaler, bf16 with autocast, fp8 by torchao."""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def set_matmul_precision(device: torch.device, tf32: bool) -> None:
    """Turn TF32 for CUDA fp32 matmuls and cuDNN on or off.

    Through the legacy setters, which keep the legacy and the new fp32_precision flags in
    step: setting only the new ones makes a later read of the legacy ones raise, and
    inductor's matmul lowering in torch 2.9-2.11 reads them.
    """
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32


def autocast_factory(cfg, device: torch.device) -> Callable[[], ContextManager]:
    if cfg.autocast_dtype is None:
        return contextlib.nullcontext
    dtype = DTYPES[cfg.autocast_dtype]
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(cfg, device: torch.device) -> Optional[torch.amp.GradScaler]:
    return torch.amp.GradScaler(device.type) if cfg.grad_scaler else None


class FP32Linear(nn.Linear):
    """A Linear computed in fp32 whatever autocast says."""

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float(),
                            None if self.bias is None else self.bias.float())


def router_fp32(model: nn.Module) -> int:
    """precision.router_dtype=fp32: make every MoE router's gate compute in fp32.

    The gate's class is swapped, so its parameters and names stay. Returns how many.
    """
    from ..model.moe import Router

    routers = [m for m in model.modules() if isinstance(m, Router)]
    for r in routers:
        r.gate.__class__ = FP32Linear
    return len(routers)


def apply_fp8(model: nn.Module, cfg) -> nn.Module:
    """Swap nn.Linear layers for torchao's Float8Linear.

    Only those whose dims are multiples of 16, and not the LM head or the routers' gates.
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def want(mod: nn.Module, fqn: str) -> bool:
        return (isinstance(mod, nn.Linear) and fqn != "head" and not fqn.endswith("gate")
                and mod.in_features % 16 == 0 and mod.out_features % 16 == 0)

    config = Float8LinearConfig.from_recipe_name(cfg.fp8_recipe)
    return convert_to_float8_training(model, config=config, module_filter_fn=want)
