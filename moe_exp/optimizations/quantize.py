"""infer.quantize: weight quantization through torchao for generation.

int8: weight-only, per output channel, on CPU and GPU. fp8: float8 weights and dynamic
float8 activations, on GPUs with fp8. Quantized are the nn.Linear layers of attention, the
dense and shared FFNs and the LM head, but not the router's gate, where a rounding moves
tokens to other experts; and the stacked routed experts' 3-D weights, weight-only per
expert and output channel. Those are stored quantized and dequantized at each use: torchao
has no 3-D quantized matmul, so the saving is memory at rest, and a layer's dequantized
copy lives while it runs.
"""
from __future__ import annotations

import logging

import torch
from torch import nn


def _configs(how: str):
    """torchao's pieces for `how`, int8 or fp8.

    Returns (quantize_, the Linear layers' config, the stacked experts' config, FqnToConfig).
    """
    logging.getLogger("torchao").setLevel(logging.ERROR)  # (its import names every CUDA
    # kernel library a CPU cannot load)
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig,
                                      Float8WeightOnlyConfig, FqnToConfig,
                                      Int8WeightOnlyConfig, quantize_)
    from torchao.quantization.granularity import PerRow

    per_out = PerRow(dim=1)  # (E, in, out): a scale per expert and output channel
    if how == "int8":
        return (quantize_, Int8WeightOnlyConfig(), Int8WeightOnlyConfig(granularity=per_out),
                FqnToConfig)
    return (quantize_, Float8DynamicActivationFloat8WeightConfig(),
            Float8WeightOnlyConfig(granularity=per_out), FqnToConfig)


class _Dequantize(nn.Module):
    """A parametrization: the module reads its stored quantized weight dequantized."""

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return q.dequantize()


def quantize_weights(model: nn.Module, how: str) -> int:
    """Quantize the model's Linear layers and stacked expert weights in place.

    Which ones, and how, as the module says. Returns how many weights.
    """
    from torch.nn.utils import parametrize

    quantize_, linear, stacked, by_name = _configs(how)
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and not n.endswith("router.gate")]
    quantize_(model, linear, filter_fn=lambda m, fqn: fqn in names)
    model.requires_grad_(False)
    experts = [n for n, p in model.named_parameters() if p.dim() == 3]
    if experts:
        quantize_(model, by_name(dict.fromkeys(experts, stacked)), filter_fn=None)
        for n in experts:
            owner, _, attr = n.rpartition(".")
            parametrize.register_parametrization(model.get_submodule(owner), attr,
                                                 _Dequantize(), unsafe=True)
    return len(names) + len(experts)


def stored_bytes(p: torch.Tensor) -> int:
    """A parameter's bytes as stored: for a torchao tensor, its inner data and scales."""
    if hasattr(p, "__tensor_flatten__") and type(p) is not nn.Parameter:
        return sum(stored_bytes(getattr(p, n)) for n in p.__tensor_flatten__()[0])
    return p.numel() * p.element_size()
