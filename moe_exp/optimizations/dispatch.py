"""Resolves model.dispatch=auto to the MoE layers' expert kernel for the run.

The kernel depends on the device, precision and compile mode. It is settled before the run,
in pipeline.context, and for a plan's traced step, in plan/trace.py."""
from __future__ import annotations


def resolve_model_dispatch(cfg, device) -> None:
    """Set model.dispatch=auto to the expert kernel that runs fastest on this device.

    model.moe.resolve_dispatch makes the choice. An explicit grouped that would run torch's
    slow fallback here warns."""
    import warnings

    import torch

    from ..model.moe import grouped_fast, resolve_dispatch
    from .precision import DTYPES

    m = cfg.model
    dtype = DTYPES.get(cfg.precision.autocast_dtype, torch.float32)
    if m.dispatch == "auto":
        m.dispatch = resolve_dispatch("auto", device, dtype, cfg.train.compile != "off",
                                      (m.hidden_size, m.ffn_hidden_size)) \
            if m.num_experts else "loop"
    elif m.dispatch == "grouped" and m.num_experts and not grouped_fast(device, dtype):
        warnings.warn(f"model.dispatch=grouped at precision={cfg.precision.name}: torch's "
                      "grouped_mm has no kernel for it on this GPU and runs its fallback (a "
                      "host sync and a matmul per expert, 9 per MoE layer and step); "
                      "model.dispatch=auto picks loop here", stacklevel=2)
