"""Activation checkpointing per transformer block: full, or selective, saving the matmuls."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..model.transformer import block_items

_aten = torch.ops.aten
# Selective: keep the outputs of the expensive ops, recompute the cheap elementwise ones.
SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}
if hasattr(_aten, "_grouped_mm"):
    SAVE_OPS.add(_aten._grouped_mm.default)


def _ignore_profiler_ops() -> None:
    """Leave the profiler's record_function marks out of selective AC's op count.

    Selective AC replays the forward's ops by their count per op. The marks are not values,
    and FSDP2's hooks add more of them in a recompute than in the forward when a fully_shard
    module, such as expert_fsdp's experts, sits inside the checkpointed block. Upstream torch
    leaves them out the same way (pytorch/pytorch#185178).
    """
    from torch.utils import checkpoint

    for name in ("_record_function_enter", "_record_function_enter_new",
                 "_record_function_exit"):
        packet = getattr(torch.ops.profiler, name, None)
        for overload in packet.overloads() if packet is not None else ():
            checkpoint.SAC_IGNORED_OPS.add(getattr(packet, overload))


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    if mode == "none":
        return model
    kwargs = {"preserve_rng_state": False}  # checkpoint_wrapper is non-reentrant
    if mode == "selective":
        _ignore_profiler_ops()
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _policy)
    for key, block in block_items(model.layers):
        model.layers[key] = checkpoint_wrapper(block, **kwargs)
    return model
