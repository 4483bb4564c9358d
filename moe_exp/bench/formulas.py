"""FLOP formulas for the ops torch's flop_registry lacks or counts otherwise.

grouped_mm, and every SDPA kernel including the CPU's, forward and backward, with the
model-FLOPs convention of bench/flops.py: attention counts QK^T and PV, causal in full, and
its backward the 4 matmuls of the gradients, no recomputation; context parallel's
chunks as their sequence's causal call. Used by moe_exp/flop_check.py
and the plan's ops, plan/ops.py.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of one grouped_mm call, by its operands' ranks.

    2D x 3D -> 2D with rows grouped, 3D x 3D batched, 3D x 2D: 2 * out * K.
    2D x 2D -> 3D, the weight gradient, whose contraction is split into groups: 2 * K*N*M.
    """
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    out = 1
    for d in out_shape:
        out *= d
    return 2 * out * a_shape[-1]


def _sdpa_fwd(q, k, v) -> int:
    b, h, s_q, d_qk = q
    s_k, d_v = k[2], v[3]
    return 2 * b * h * s_q * s_k * (d_qk + d_v)  # QK^T and PV, every head of the query


def _prefix(q, k, mask) -> float:
    """A masked call of fewer queries than keys is this project's lower-right causal one
    (context parallel's chunk over the keys up to its end): counted as the convention
    counts causal, twice the pairs it attends, so that a sequence's chunks sum to its
    causal count, (S/cp)·S a rank. Else 1."""
    s_q, s_k = q[2], k[2]
    return (2 * s_k - s_q) / s_k if mask is not None and s_q < s_k else 1.0


def _mask(args, kwargs, at):
    """The mask's (or bias's) shape among an SDPA op's arguments after q, k, v: the keyword
    attn_mask (the CPU's kernel) or the positional one at `at`; None where there is none."""
    return kwargs.get("attn_mask", args[at] if at is not None and len(args) > at else None)


def _sdpa(at=None):
    def flop(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
        return round(_sdpa_fwd(q_shape, k_shape, v_shape)
                     * _prefix(q_shape, k_shape, _mask(args, kwargs, at)))
    return flop


def _sdpa_backward(at=None):
    def flop(grad_out_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
        return round(2 * _sdpa_fwd(q_shape, k_shape, v_shape)  # dV, dP, dQ, dK
                     * _prefix(q_shape, k_shape, _mask(args, kwargs, at)))
    return flop


def flop_formulas() -> dict:
    """FlopCounterMode's custom_mapping for these ops; those this torch build lacks are skipped."""
    # each kernel's mask or bias: its place after q, k, v (forward, backward); the CPU's is
    # the keyword attn_mask; CUDA's flash kernel takes none
    fwd = {"_scaled_dot_product_flash_attention_for_cpu": (None, None),
           "_scaled_dot_product_flash_attention": (None, None),
           "_scaled_dot_product_efficient_attention": (0, 0),
           "_scaled_dot_product_cudnn_attention": (0, 4)}
    out = {getattr(aten, n): _sdpa(f) for n, (f, _) in fwd.items() if hasattr(aten, n)}
    out.update({getattr(aten, n + "_backward"): _sdpa_backward(b) for n, (_, b) in fwd.items()
                if hasattr(aten, n + "_backward")})
    if hasattr(aten, "_grouped_mm"):
        out[aten._grouped_mm] = _grouped_mm_flop
    return out
