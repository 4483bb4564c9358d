"""The plan's memory tracker: torch's MemTracker, keeping the step's peak only.

Under FSDP2 it is FSDPMemTracker. A plan's fake step and a bench run's real step on CPU are
tracked alike."""
from __future__ import annotations

from ..config import FSDP2


class _PeakOnly:
    """A tracker mixin that keeps the step's peak only.

    MemTracker updates every module's own peak at every op, a loop over the modules that
    costs a big model's plan much of its time, and a plan does not read those peaks. Where
    torch's tracker lacks these internals, its own update runs."""

    def _update_peak_stats(self, peak_state) -> None:
        if not all(hasattr(self, a) for a in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap")):
            return super()._update_peak_stats(peak_state)
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)

    def restart_peak(self) -> None:
        """The peak from now on: what is live now (a step's phases each have their own)."""
        if all(hasattr(self, a) for a in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap")):
            for dev, snap in self._curr_mem_snap.items():
                self._peak_mem[dev], self._peak_mem_snap[dev] = snap["Total"], dict(snap)


def step_tracker(cfg, applied, optimizer, tokens=None):
    """torch's memory tracker for the run's strategy, keeping the peak only.

    Under fsdp/hsdp it is FSDP2's own tracker."""
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
