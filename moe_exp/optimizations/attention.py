"""train.attention: the attention kernel, set as each attention layer's `attend`.

One SDPA backend alone, flash, efficient, math or cudnn, through torch's `sdpa_kernel`,
whose backward runs the kernel its forward chose; or FlexAttention with a causal block
mask, compiled as torchtitan runs it. `auto` leaves the model's SDPA call to its own
choice.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

SDPA = ("flash", "efficient", "math", "cudnn")
# SDPA's backends that take grouped k/v heads (enable_gqa): the others get them repeated
GQA = ("flash", "math")


def apply_attention(model: torch.nn.Module, name: str) -> None:
    """Set every attention layer's `attend` to that SDPA backend alone, or to FlexAttention.

    `auto` leaves the model's own, where SDPA picks its kernel.
    """
    if name == "auto":
        return
    attend = flex_causal if name == "flex" else functools.partial(sdpa_only, name)
    for mod in model.modules():
        if hasattr(mod, "attend"):
            mod.attend = attend


def sdpa_only(name: str, q, k, v):
    """Causal SDPA of q (B, h, S, D) over k, v (B, h_kv, S, D) with one backend allowed.

    No fallback: a backend that cannot run raises.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]
    gqa = k.shape[1] != q.shape[1]
    if gqa and name not in GQA:
        r = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1), False
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.cache
def causal_mask(seq_len: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_causal, None, None, seq_len, seq_len, device=device)


def flex_causal(q, k, v, compiled: bool = True):
    """Causal attention of q (B, h, S, D) over k, v (B, h_kv, S, D) with FlexAttention."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled_flex() if compiled else flex_attention
    mask = causal_mask(q.shape[-2], str(q.device))
    return fn(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def attention_unsupported(name: str, device: str, dtype: torch.dtype,
                          capability=None) -> str | None:
    """Why this device and dtype cannot run that kernel; None where it can.

    On CPU, torch's SDPA has the flash and math kernels only, and FlexAttention no backward.
    On CUDA, flash and cuDNN attention need fp16 or bf16 and compute capability >= 8.0, as
    torch's SDPA docs say.
    """
    if name in ("auto", "math"):
        return None
    if device == "cpu":
        if name in ("efficient", "cudnn"):
            return f"{name}: torch's CPU SDPA has the flash and math kernels only"
        if name == "flex":
            return "flex: FlexAttention has no backward on CPU (a GPU runs it)"
        return None
    if device != "cuda":
        return f"{name}: on {device} only math or auto"
    if name in ("flash", "cudnn") and dtype not in (torch.float16, torch.bfloat16):
        return (f"{name} needs fp16 or bf16 (precision=bf16 or fp16); this run's attention "
                f"is {str(dtype).removeprefix('torch.')}")
    if name in ("flash", "cudnn") and capability is not None and capability < (8, 0):
        return f"{name} needs compute capability >= 8.0; this GPU has {capability[0]}." \
               f"{capability[1]}"
    return None
