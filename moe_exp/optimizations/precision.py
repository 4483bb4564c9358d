"""Precision: fp32 / tf32 / fp16 (autocast + GradScaler) / bf16 (autocast) / fp8 (torchao)."""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional

import torch
from torch import nn

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def set_matmul_precision(device: torch.device, tf32: bool) -> None:
    """TF32 through the fp32_precision API only (mixing it with allow_tf32 raises)."""
    if device.type == "cuda":
        mode = "tf32" if tf32 else "ieee"
        torch.backends.cuda.matmul.fp32_precision = mode
        torch.backends.cudnn.conv.fp32_precision = mode


def autocast_factory(cfg, device: torch.device) -> Callable[[], ContextManager]:
    if cfg.autocast_dtype is None:
        return contextlib.nullcontext
    dtype = DTYPES[cfg.autocast_dtype]
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(cfg, device: torch.device) -> Optional[torch.amp.GradScaler]:
    return torch.amp.GradScaler(device.type) if cfg.grad_scaler else None


def apply_fp8(model: nn.Module, cfg) -> nn.Module:
    """Swap nn.Linear layers (dims divisible by 16, not the LM head) for torchao Float8Linear."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def want(mod: nn.Module, fqn: str) -> bool:
        return (isinstance(mod, nn.Linear) and fqn != "head" and not fqn.endswith("gate")
                and mod.in_features % 16 == 0 and mod.out_features % 16 == 0)

    config = Float8LinearConfig.from_recipe_name(cfg.fp8_recipe)
    return convert_to_float8_training(model, config=config, module_filter_fn=want)
