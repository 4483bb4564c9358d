"""Mixture-of-Experts FFN: softmax top-k router, SwiGLU experts, dropless dispatch.

Dispatch: every (token, choice) pair is sorted by expert, each expert multiplies its
contiguous slice (one grouped matmul, or a loop of matmuls), and the weighted
outputs are scattered back with index_add. No token is ever dropped.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _mm_dtype(x: torch.Tensor) -> torch.dtype:
    """Dtype autocast would give a matmul on x (grouped_mm has no autocast rule)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (N, K) rows grouped by expert, w (E, K, M), offs (E,) int32 group ends."""
    return _grouped_mm(x, w, offs=offs)


def grouped_mm_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether forward and backward of grouped_mm run here (probed on tiny tensors)."""
    if _grouped_mm is None:
        return False
    try:
        x = torch.randn(24, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([8, 24], device=device, dtype=torch.int32)
        y = grouped_mm(x, w, offs)
        y.backward(torch.ones_like(y))
        return bool(torch.isfinite(x.grad).all())
    except Exception:  # noqa: BLE001 - any failure means "not supported here"
        return False


class Router(nn.Module):
    """Softmax router, top-k, renormalised over the chosen experts (Mixtral-style)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.num_experts = num_experts
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)

    def forward(self, x: torch.Tensor):
        logits = self.gate(x).float()  # (T, E), router math in fp32
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (T, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights, experts


class Experts(nn.Module):
    """num_experts SwiGLU FFNs held as stacked weights (E, in, out)."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
        """x: (N, H) rows sorted by expert; counts: (E,) rows per expert."""
        if grouped:
            dt = _mm_dtype(x)
            x = x.to(dt)
            offs = counts.cumsum(0).to(torch.int32)
            w1, w3, w2 = (w.to(dt) for w in (self.w1, self.w3, self.w2))
            h = F.silu(grouped_mm(x, w1, offs)) * grouped_mm(x, w3, offs)
            return grouped_mm(h, w2, offs)
        sizes = counts.tolist()
        for n in sizes:  # tells torch.compile these data-dependent sizes are valid
            torch._check(n >= 0)
        torch._check(sum(sizes) == x.shape[0])
        outs = []
        for e, xe in enumerate(torch.split(x, sizes)):
            h = F.silu(xe @ self.w1[e]) * (xe @ self.w3[e])
            outs.append(h @ self.w2[e])
        return torch.cat(outs)


class MoE(nn.Module):
    """Dropless top-k MoE FFN. Returns (output, aux losses, tokens per expert)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                 dispatch: str = "loop"):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.grouped = dispatch == "grouped"
        self.router = Router(hidden_size, num_experts, top_k)
        self.experts = Experts(num_experts, hidden_size, ffn_hidden_size)

    def forward(self, x: torch.Tensor):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, H)
        logits, probs, weights, experts = self.router(x)
        flat = experts.reshape(-1)  # (T*k,)
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        # static-shape histogram (bincount's output size is data-dependent under compile)
        counts = flat.new_zeros(self.num_experts).scatter_add_(0, flat, torch.ones_like(flat))
        y = self.experts(x[token], counts, self.grouped)
        y = y * weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        out = torch.zeros(x.shape[0], shape[-1], dtype=y.dtype, device=x.device)
        out = out.index_add(0, token, y)
        # Switch load-balancing loss: E * sum_e (fraction of assignments to e) * (mean prob of e)
        frac = counts.to(probs.dtype) / flat.numel()
        balance = self.num_experts * (frac * probs.mean(dim=0)).sum()
        z = torch.logsumexp(logits, dim=-1).square().mean()
        return out.reshape(shape), balance, z, counts
