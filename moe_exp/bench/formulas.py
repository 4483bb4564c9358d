"""FLOP formulas for the ops torch's flop_registry lacks or counts otherwise.

grouped_mm, and every SDPA kernel including the CPU's, forward and backward, with the
model-FLOPs convention of bench/flops.py: attention counts QK^T and PV, causal in full, and
its backward the 4 matmuls of the gradients, no recomputation. Used by moe_exp/flop_check.py
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


def _sdpa_flop(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return _sdpa_fwd(q_shape, k_shape, v_shape)


def _sdpa_backward_flop(grad_out_shape, q_shape, k_shape, v_shape, *args, out_shape=None,
                        **kwargs) -> int:
    return 2 * _sdpa_fwd(q_shape, k_shape, v_shape)  # dV, dP, dQ, dK


def flop_formulas() -> dict:
    """FlopCounterMode's custom_mapping for these ops; those this torch build lacks are skipped."""
    fwd = ["_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"]
    out = {getattr(aten, n): _sdpa_flop for n in fwd if hasattr(aten, n)}
    out.update({getattr(aten, n + "_backward"): _sdpa_backward_flop for n in fwd
                if hasattr(aten, n + "_backward")})
    if hasattr(aten, "_grouped_mm"):
        out[aten._grouped_mm] = _grouped_mm_flop
    return out
