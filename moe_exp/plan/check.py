"""A measured run's check of its plan (train.plan): the prediction errors in its record."""
from __future__ import annotations


def record_errors(rec: dict, cpu: bool) -> None:
    """A measured run's check of its plan: planned / measured - 1, of the peak (on CPU the
    live tensors tracked in the last warmup step, tracked_peak_gib: RSS holds what no plan
    sees) and of the step time."""
    why, real = rec["null_reasons"], "tracked_peak_gib" if cpu else "peak_mem_gib"
    for key, plan, got in (("planned_peak_error", "planned_peak_gib", real),
                           ("planned_step_error", "planned_step_ms", "step_time_ms")):
        p, g = rec.get(plan), rec.get(got)
        rec[key] = p / g - 1 if p is not None and g else None
        if rec[key] is None:
            why[key] = why.get(plan) if p is None else why.get(got, f"{got} not measured")
