"""torch.compile of the whole model for training, or of the decode step for task=infer.

MoE dispatch compiles without graph breaks. A tensor-parallel model is compiled block by
block, as torchtitan compiles it: whole, inductor fails on its vocab-parallel embedding
("Mixing fake modes NYI", torch 2.13). Its embedding, head and loss run eager.
"""
from __future__ import annotations

import torch
from torch import nn

from ..model.transformer import block_items


def _options(mode: str) -> dict:
    import torch._dynamo.config as dynamo_config

    # Dropless dispatch has data-dependent shapes (tokens per expert).
    dynamo_config.capture_scalar_outputs = True
    dynamo_config.capture_dynamic_output_shape_ops = True
    return {"mode": None if mode == "default" else mode}


def _compile(fn, mode: str):
    return torch.compile(fn, **_options(mode))


def apply_compile(model: nn.Module, mode: str, per_block: bool = False) -> nn.Module:
    """The model compiled whole, or (per_block) each of its blocks in place (its
    parameters' names unchanged)."""
    if mode == "off":
        return model
    if not per_block:
        return _compile(model, mode)
    for _, block in block_items(model.layers):
        block.compile(**_options(mode))
    # The first block's input copied: a compiled block given a view that DTensor's to_local
    # made (the vocab-parallel embedding's output) lost its gradient (torch 2.13: the
    # embedding's was 0)
    if getattr(model, "embed", None) is not None:  # (a pipeline's later stages have none)
        model.embed.register_forward_hook(lambda _m, _args, out: out.clone())
    return model


def compile_decode(mode: str):
    """model.transformer.decode, compiled under train.compile's mode.

    It compiles twice: at the prompt's length, then once for every later step, as dynamo
    makes the cache's position and the step's length dynamic when they change. A new batch
    size compiles again.
    """
    from ..model.transformer import decode

    return decode if mode == "off" else _compile(decode, mode)
