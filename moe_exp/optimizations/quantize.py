"""infer.quantize: weight quantization through torchao for generation. int8: weight-only,
per output channel (CPU and GPU); fp8: float8 weights and dynamic float8 activations
(GPUs with fp8). Quantized: the nn.Linear layers (attention, dense and shared FFNs, the
LM head), not the router's gate (a rounding there moves tokens to other experts) nor the
stacked routed experts (3-D weights that torch's quantize_ does not take yet)."""
from __future__ import annotations

import logging

import torch
from torch import nn


def _configs(how: str):
    logging.getLogger("torchao").setLevel(logging.ERROR)  # (its import names every CUDA
    # kernel library a CPU cannot load)
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig,
                                      Int8WeightOnlyConfig, quantize_)

    config = Int8WeightOnlyConfig() if how == "int8" else \
        Float8DynamicActivationFloat8WeightConfig()
    return quantize_, config


def quantize_weights(model: nn.Module, how: str) -> int:
    """Quantize the model's Linear layers in place (see above); returns how many."""
    quantize_, config = _configs(how)
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and not n.endswith("router.gate")]
    quantize_(model, config, filter_fn=lambda m, fqn: fqn in names)
    return len(names)


def stored_bytes(p: torch.Tensor) -> int:
    """A parameter's bytes as stored: a torchao tensor's inner tensors (int8 data, scales)."""
    if hasattr(p, "__tensor_flatten__") and type(p) is not nn.Parameter:
        return sum(stored_bytes(getattr(p, n)) for n in p.__tensor_flatten__()[0])
    return p.numel() * p.element_size()
