"""torch.compile of the whole model for training, or of the decode step for task=infer.

MoE dispatch compiles without graph breaks.
"""
from __future__ import annotations

import torch
from torch import nn


def _compile(fn, mode: str):
    import torch._dynamo.config as dynamo_config

    # Dropless dispatch has data-dependent shapes (tokens per expert).
    dynamo_config.capture_scalar_outputs = True
    dynamo_config.capture_dynamic_output_shape_ops = True
    return torch.compile(fn, mode=None if mode == "default" else mode)


def apply_compile(model: nn.Module, mode: str) -> nn.Module:
    return model if mode == "off" else _compile(model, mode)


def compile_decode(mode: str):
    """model.transformer.decode, compiled under train.compile's mode.

    It compiles twice: at the prompt's length, then once for every later step, as dynamo
    makes the cache's position and the step's length dynamic when they change. A new batch
    size compiles again.
    """
    from ..model.transformer import decode

    return decode if mode == "off" else _compile(decode, mode)
