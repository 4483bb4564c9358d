"""A measured run's check of its own plan, which train.plan turns on: errors in its record."""
from __future__ import annotations

from ..config import pp_size


def record_errors(rec: dict, cpu: bool) -> None:
    """The plan's errors into rec: planned / measured - 1, of the peak and the step time and
    of a pipeline's stages' time in their actions; planned - measured of its bubble share.

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
    p, g = rec.get("planned_pp_stage_ms"), rec.get("pp_stage_ms")
    ok = p is not None and g is not None and len(p) == len(g) and all(g)
    rec["planned_pp_stage_error"] = [a / b - 1 for a, b in zip(p, g)] if ok else None
    if not ok:
        why["planned_pp_stage_error"] = why.get("planned_pp_stage_ms") if p is None \
            else why.get("pp_stage_ms", "pp_stage_ms not measured")


class StepWatch:
    """Tracks a real step's live tensor memory as the plan tracks its fake one.

    On CPU it tracks the last warmup step, which holds the optimizer's state; tracked_peak_gib
    and the peak's error are measured on it. train.loop.train_loop takes it as `watch`. A
    compiled step's is the CPU allocator's (Allocations): no tracker sees inductor's
    buffers."""

    def __init__(self, cfg, device, start: int = 0):
        self.cfg, self.device, self.peak = cfg, device, None
        self.step, self.why = _tracked_step(cfg, device, start)
        self._tracker = None

    def begin(self, applied, optimizer) -> None:
        from .tracker import step_tracker

        self._tracker = Allocations(applied.model, optimizer) \
            if self.cfg.train.compile != "off" else step_tracker(self.cfg, applied, optimizer)
        self._tracker.__enter__()

    def micro(self) -> None:
        if not isinstance(self._tracker, Allocations):
            self._tracker.reset_mod_stats()  # (its per-module figures: one pass's)

    def end(self) -> None:
        t, self._tracker = self._tracker, None
        t.__exit__(None, None, None)
        self.peak = t.peak if isinstance(t, Allocations) else \
            int(t.get_tracker_snapshot("peak").get(self.device, {}).get("Total", 0))


class Allocations:
    """A CPU step's live tensor bytes at its peak, from what the CPU allocator reports to
    torch's profiler (profile_memory): what was live at the start (the model's parameters,
    buffers and gradients, the optimizer's state) plus the most the step's own allocations
    held at once. It sees the buffers of inductor's kernels, which allocate below the
    dispatcher that a tracker watches."""

    def __init__(self, model, optimizer):
        import torch

        held = [*model.parameters(), *model.buffers(),
                *(p.grad for p in model.parameters() if p.grad is not None),
                *(v for s in optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor))]
        held = [t.to_local() if hasattr(t, "to_local") else t for t in held]  # (DTensors)
        self.base = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                         for t in held}.values())
        self.peak = None
        self._prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._quiet = None

    def __enter__(self):
        from ..train.loop import kineto_quiet

        self._quiet = kineto_quiet()  # (the step's stderr, less the profiler's own lines)
        self._quiet.__enter__()
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from torch._C._profiler import _EventType

        try:
            self._prof.__exit__(*exc)
        finally:
            self._quiet.__exit__(*exc)
        events, todo = [], list(self._prof.profiler.kineto_results.experimental_event_tree())
        while todo:
            e = todo.pop()
            todo.extend(e.children)
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                f = e.extra_fields
                events.append((e.start_time_ns, f.alloc_size, f.total_allocated))
        events.sort()
        # the allocator's running total counts what was allocated while profiled: relative
        # to its value before the first event
        start = events[0][2] - events[0][1] if events else 0
        self.peak = self.base + max((e[2] - start for e in events), default=0)


def _tracked_step(cfg, device, start: int) -> tuple[int | None, str | None]:
    """The step whose live tensors are tracked, or None and why not.

    It is the last warmup step, counted after a resumed run's start."""
    t = cfg.train
    step = max(t.warmup_steps, start) - 1
    if device.type != "cpu":
        return None, "tracked on CPU only: a GPU's peak_mem_gib is its allocator's"
    if not t.plan:
        return None, "train.plan=false"
    if pp_size(cfg.parallel) > 1:
        return None, "parallel.pp: the run does not track a pipeline's step yet"
    if step < max(start, 1):
        return None, f"train.warmup_steps={t.warmup_steps}: the step tracked is the last " \
                     "warmup step after the first (with the optimizer's state): >= 2"
    return step, None
