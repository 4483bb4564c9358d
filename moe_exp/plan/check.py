"""A measured run's check of its own plan, which train.plan turns on: errors in its record."""
from __future__ import annotations

from ..config import pp_size


def record_errors(rec: dict, cpu: bool) -> None:
    """The plan's errors into rec: planned / measured - 1, of the peak and the step time;
    planned - measured of a pipeline's bubble share.

    On CPU the peak compared is tracked_peak_gib, the live tensors tracked in the last warmup
    step: the RSS holds memory that no plan sees."""
    why, real = rec["null_reasons"], "tracked_peak_gib" if cpu else "peak_mem_gib"
    for key, plan, got in (("planned_peak_error", "planned_peak_gib", real),
                           ("planned_step_error", "planned_step_ms", "step_time_ms")):
        p, g = rec.get(plan), rec.get(got)
        rec[key] = p / g - 1 if p is not None and g else None
        if rec[key] is None:
            why[key] = why.get(plan) if p is None else why.get(got, f"{got} not measured")
    # a pipeline's bubble, a share: planned - measured
    p, g = rec.get("planned_pp_bubble_share"), rec.get("pp_bubble_share")
    rec["planned_pp_bubble_error"] = p - g if p is not None and g is not None else None
    if rec["planned_pp_bubble_error"] is None:
        why["planned_pp_bubble_error"] = why.get("planned_pp_bubble_share") if p is None \
            else why.get("pp_bubble_share", "pp_bubble_share not measured")


class StepWatch:
    """Tracks a real step's live tensor memory as the plan tracks its fake one.

    On CPU it tracks the last warmup step, which holds the optimizer's state; tracked_peak_gib
    and the peak's error are measured on it. train.loop.train_loop takes it as `watch`."""

    def __init__(self, cfg, device, start: int = 0):
        self.cfg, self.device, self.peak = cfg, device, None
        self.step, self.why = _tracked_step(cfg, device, start)
        self._tracker = None

    def begin(self, applied, optimizer) -> None:
        from .tracker import step_tracker

        self._tracker = step_tracker(self.cfg, applied, optimizer)
        self._tracker.__enter__()

    def micro(self) -> None:
        self._tracker.reset_mod_stats()  # (its per-module figures: one pass's)

    def end(self) -> None:
        t, self._tracker = self._tracker, None
        t.__exit__(None, None, None)
        self.peak = int(t.get_tracker_snapshot("peak").get(self.device, {}).get("Total", 0))


def _tracked_step(cfg, device, start: int) -> tuple[int | None, str | None]:
    """The step whose live tensors are tracked, or None and why not.

    It is the last warmup step, counted after a resumed run's start."""
    t = cfg.train
    step = max(t.warmup_steps, start) - 1
    if device.type != "cpu":
        return None, "tracked on CPU only: a GPU's peak_mem_gib is its allocator's"
    if not t.plan:
        return None, "train.plan=false"
    if t.compile != "off":
        return None, "train.compile: the tracker follows eager ops, not a compiled step's"
    if pp_size(cfg.parallel) > 1:
        return None, "parallel.pp: the run does not track a pipeline's step yet"
    if step < max(start, 1):
        return None, f"train.warmup_steps={t.warmup_steps}: the step tracked is the last " \
                     "warmup step after the first (with the optimizer's state): >= 2"
    return step, None
