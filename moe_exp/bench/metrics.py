"""The record's derived figures: a pure function of the loop's raw timings and run constants."""
from __future__ import annotations

from .timer import iqr, median

PHASES = ("data", "forward", "backward", "optimizer")


def step_metrics(step_ms: list, phase_ms: dict, *, tokens_per_step: int, world: int,
                 wall_s: float, first_step_s: float | None, compiled: bool,
                 startup_s: float | None, flops_per_token: float,
                 peak_flops: float | None, devices: int | None = None) -> dict:
    """Throughput, the phase breakdown, compile and startup time, TFLOP/s and MFU.

    step_ms: each measured step's time in ms, the slowest rank's; phase_ms: each phase's.
    world: the ranks that take their own tokens_per_step; devices: all ranks (tensor-parallel
    ones share their tokens), world where None. wall_s: the measured window's wall time;
    first_step_s: the first step's. A figure that cannot be derived is None; the caller,
    which knows the config, gives the reason.
    """
    step = median(step_ms)
    total = tokens_per_step * world / (step / 1e3)
    per_device = total / (devices or world)
    out = {
        "step_time_ms": step, "step_time_iqr_ms": iqr(step_ms),
        "tokens_per_s": total, "tokens_per_s_per_device": per_device,
        "tokens_per_s_wall": tokens_per_step * world * len(step_ms) / wall_s,
        **{f"{p}_ms": median(phase_ms[f"{p}_ms"]) for p in PHASES},
        "tokens_per_step": tokens_per_step * world, "measured_steps": len(step_ms),
    }
    out["data_share"] = out["data_ms"] / step
    # the first step's time beyond a steady step: compilation dominates it
    out["compile_s"] = max(0.0, first_step_s - step / 1e3) if compiled else None
    # framework overhead before the first measured step, compile excluded
    out["startup_s"] = None if startup_s is None else startup_s - (out["compile_s"] or 0.0)
    out["tflops_per_device"] = flops_per_token * per_device / 1e12
    out["peak_flops"] = peak_flops or None
    out["mfu"] = out["tflops_per_device"] * 1e12 / peak_flops if peak_flops else None
    return out
