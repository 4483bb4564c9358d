"""The plan's memory tracker: torch's MemTracker (FSDPMemTracker under FSDP2) keeping the
step's peak only; a plan's fake step and a run's real one (bench on CPU) tracked alike."""
from __future__ import annotations

import torch

from ..config import FSDP2


class _PeakOnly:
    """A tracker that keeps the step's peak only: MemTracker updates every module's own peak
    at every op (a loop over the modules: mixtral_8x7b's plan spent 40% of its time there),
    which a plan does not read. Where torch's tracker lacks these internals, its own."""

    def _update_peak_stats(self, peak_state) -> None:
        if not all(hasattr(self, a) for a in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap")):
            return super()._update_peak_stats(peak_state)
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)


def step_tracker(cfg, applied, optimizer, tokens=None):
    """torch's tracker for the strategy (FSDP2's own under fsdp/hsdp), keeping the peak."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    inputs = () if tokens is None else (tokens,)
    if cfg.parallel.name in FSDP2:
        tracker = type("Tracker", (_PeakOnly, FSDPMemTracker), {})(applied.model, optimizer)
        tracker.track_inputs(inputs)
    else:
        tracker = type("Tracker", (_PeakOnly, MemTracker), {})()
        tracker.track_external(applied.model, optimizer, *inputs)
    return tracker


def live_tracker(cfg, applied, optimizer, device: torch.device):
    """A real step's live tensor memory, tracked as the plan tracks its fake one (task=bench
    on CPU: tracked_peak_gib). A context manager; its `peak()` after it exits."""
    tracker = step_tracker(cfg, applied, optimizer)
    tracker.peak = lambda: int(tracker.get_tracker_snapshot("peak").get(device, {})
                               .get("Total", 0))
    return tracker
