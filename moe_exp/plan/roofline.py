"""The plan's step time from its traced step (plan.trace.StepOps) and the hardware profile:
each op takes the longer of its FLOPs at the peak FLOP/s of its dtype and its bytes (read
and written) at hardware.memory_bandwidth (a roofline of the eager step: no fusion); each
collective moves its message's bus share (nccl-tests' convention, as task=comm measures it:
2(n-1)/n for an all-reduce, (n-1)/n otherwise) at hardware.link_bandwidth where its group
is within a node (hardware.devices_per_node), else at hardware.network_bandwidth. Nothing
overlaps: an upper bound where FSDP's prefetch or DDP's buckets hide communication."""
from __future__ import annotations

import torch

BUS_SHARE = {"all_reduce": lambda n: 2 * (n - 1) / n}  # others: (n - 1) / n
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _peak(hw, dtype, precision: str) -> tuple[str, float | None]:
    name = DTYPES.get(dtype, "tf32" if precision == "tf32" else "fp32")
    return name, (hw.peak_flops or {}).get(name)


def compute_ms(ops, hw, precision: str) -> tuple[float | None, str | None]:
    """(the ops' roofline time in ms, or None and why)."""
    if not hw.memory_bandwidth:
        return None, f"hardware={hw.name} gives no memory_bandwidth: set " \
                     "hardware.memory_bandwidth=<bytes/s per device>"
    seconds = 0.0
    for flops, nbytes, dtype in ops.ops:
        t = nbytes / hw.memory_bandwidth
        if flops:
            name, peak = _peak(hw, dtype, precision)
            if not peak:
                return None, f"no peak FLOP/s known for hardware={hw.name} at {name} (the " \
                             f"step's {name} matmuls): set ++hardware.peak_flops.{name}=<FLOP/s>"
            t = max(t, flops / peak)
        seconds += t
    return seconds * 1e3, None


def comm_ms(ops, hw) -> tuple[float | None, str | None]:
    """(the collectives' time in ms, or None and why)."""
    seconds = 0.0
    for name, nbytes, ranks in ops.calls:
        n = len(ranks)
        if n <= 1:
            continue
        within = len({r // hw.devices_per_node for r in ranks}) == 1
        bw = hw.link_bandwidth if within else hw.network_bandwidth
        if not bw:
            key = "link_bandwidth" if within else "network_bandwidth"
            return None, f"hardware={hw.name} gives no {key} (the {name} of {n} ranks " \
                         f"{'within a node' if within else 'across nodes'}): set " \
                         f"hardware.{key}=<bytes/s per device, each way>"
        seconds += nbytes * BUS_SHARE.get(name, lambda k: (k - 1) / k)(n) / bw
    return seconds * 1e3, None
