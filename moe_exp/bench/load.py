"""Other processes' share of the machine's CPU during the measured window (Linux /proc).

A 2-core box shared with a test suite can make a step 20x slower: a run measured then is
not evidence. The record keeps the share (`cpu_other_load`) and the summary warns above
OTHER_LOAD_WARN. "Ours" is the run's process tree: its data-loader workers, and for a rank
the launcher's other local ranks.
"""
from __future__ import annotations

import os
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
OTHER_LOAD_WARN = 0.15  # the share benchmarks/_timing.py drops a round at


def _tree_ticks(root: int) -> int:
    """utime + stime (threads included) of root and every live process below it."""
    ticks, parent = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        pid = int(name)  # (fields from "state": ppid is the 2nd, utime the 12th)
        parent[pid], ticks[pid] = int(fields[1]), int(fields[11]) + int(fields[12])
    total = 0
    for pid, t in ticks.items():
        p, seen = pid, 0
        while p and p != root and seen < 64:
            p, seen = parent.get(p, 0), seen + 1
        total += t if p == root else 0
    return total


def _root() -> int:
    """Whose process tree is ours: a rank's launcher (its local ranks and their workers),
    else this process (and its data-loader workers)."""
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()


def snapshot() -> tuple[int, int, float] | None:
    """(machine's busy ticks, our process tree's ticks, monotonic time); None without
    /proc."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        busy = sum(v) - v[3] - (v[4] if len(v) > 4 else 0)  # minus idle and iowait
        return busy, _tree_ticks(_root()), time.monotonic()
    except (OSError, ValueError, IndexError):
        return None


def other_load(a, b) -> float | None:
    """Share of the machine's CPU time other processes used between snapshots a and b."""
    if a is None or b is None or b[2] <= a[2]:
        return None
    others = max(0, (b[0] - a[0]) - (b[1] - a[1])) / _TICK
    return min(1.0, others / ((b[2] - a[2]) * (os.cpu_count() or 1)))
