"""Per-step phase timing without syncs inside a step.

On CUDA each boundary records an event, with no host sync, and the events are read after
the window, so the figures are GPU time between boundaries. On CPU, wall time between
boundaries. On other accelerators, such as Gaudi's hpu, each boundary waits for the device
first (device_sync), so the phases hold the device's work, at the cost of those syncs.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

PHASES = ("data", "forward", "backward", "optimizer")


def device_sync(device: torch.device) -> None:
    """Wait for the device's queued work through torch.<type>.synchronize().

    That covers cuda, xpu, mps, and hpu once its bridge is imported. Nothing on CPU or where
    torch has no such module; the run's device check refuses those first.
    """
    mod = device_module(device, "synchronize")
    if mod is not None:
        mod.synchronize()


def device_module(device: torch.device, *calls: str):
    """torch's module for the device type, such as torch.cuda, where it has all these calls.

    None on CPU or without them. torch.hpu exists once Gaudi's bridge is imported.
    """
    mod = getattr(torch, device.type, None) if device.type != "cpu" else None
    return mod if mod is not None and all(hasattr(mod, c) for c in calls) else None


class StepTimer:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.steps: list[list] = []
        self._cur: list = []

    def _stamp(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        device_sync(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self._cur = [(None, self._stamp())]

    def lap(self, phase: str) -> None:
        """Attribute the time since the previous boundary to `phase`."""
        self._cur.append((phase, self._stamp()))

    def end(self) -> None:
        self.steps.append(self._cur)

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def results(self) -> dict:
        """Per-step totals and per-phase sums in ms; syncs once on CUDA."""
        if self.cuda:
            torch.cuda.synchronize()
        totals, phases = [], {p: [] for p in PHASES}
        for marks in self.steps:
            totals.append(self._ms(marks[0][1], marks[-1][1]))
            acc = dict.fromkeys(PHASES, 0.0)
            for (_, a), (phase, b) in zip(marks, marks[1:]):
                if phase in acc:  # (another lap, e.g. gc: in the step's total only)
                    acc[phase] += self._ms(a, b)
            for p in PHASES:
                phases[p].append(acc[p])
        return {"step_ms": totals, **{f"{p}_ms": v for p, v in phases.items()}}


def median(xs):
    return statistics.median(xs) if xs else None


def iqr(xs):
    if len(xs) < 2:
        return None
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[2] - q[0]


# a rank forked by distributed.launch: the launching process's start (its /proc starttime),
# for it is where the run started, not the fork
STARTED: int | None = None


def start_ticks() -> int:
    """This process's start, in clock ticks since boot (Linux /proc, field 22: starttime)."""
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def process_age_s() -> float | None:
    """Seconds since this process (a forked rank: its launcher) started, from Linux /proc;
    None elsewhere."""
    try:
        ticks = STARTED if STARTED is not None else start_ticks()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def own_process() -> bool:
    """Whether this process was started for one run, so that its start is the run's start.

    True under `python -m moe_exp.run`, the moe-exp script, or a sweep job's child.
    """
    import sys

    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", "") or ""
    return name in ("moe_exp.run", "moe_exp.sweep.child") or \
        os.path.basename(sys.argv[0] if sys.argv else "") == "moe-exp"
