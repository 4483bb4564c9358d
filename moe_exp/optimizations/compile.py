"""torch.compile of the whole model; MoE dispatch compiles without graph breaks."""
from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module, mode: str) -> nn.Module:
    if mode == "off":
        return model
    import torch._dynamo.config as dynamo_config

    # Dropless dispatch has data-dependent shapes (tokens per expert).
    dynamo_config.capture_scalar_outputs = True
    dynamo_config.capture_dynamic_output_shape_ops = True
    return torch.compile(model, mode=None if mode == "default" else mode)
