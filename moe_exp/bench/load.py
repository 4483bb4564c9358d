"""Other processes' share of the CPU during the measured window, from Linux /proc.

On a small shared machine other work can make a step many times slower, and a run measured
then is not evidence. The record keeps the share, `cpu_other_load`, and the summary warns
above OTHER_LOAD_WARN. "Ours" is this process's tree: its data-loader workers and the
children it has waited for; the caller adds a rank's sibling ranks, summed per host
(tasks/bench_record.py). The CPUs are those this process may run on, such as a container's
cpuset. Busy is every state but idle and iowait; guest time is inside user time already.
"""
from __future__ import annotations

import os
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
OTHER_LOAD_WARN = 0.15  # the share benchmarks/_timing.py drops a round at


def busy(load) -> bool:
    """Whether a cpu_other_load is above OTHER_LOAD_WARN, making timings unreliable.

    load may be None, or NaN from a table: neither is busy.
    """
    return isinstance(load, (int, float)) and load == load and load > OTHER_LOAD_WARN


def load_warning(load: float, during: str) -> str:
    """The summary's line for a busy cpu_other_load measured during `during`."""
    return f"other processes used {load:.0%} of this machine's CPU during {during}: its " \
        "timings are not reliable"


_KEPT: set[int] | None = None  # the process's cores before a rank bound itself to some


def _cpus() -> set[int]:
    if _KEPT is not None:
        return set(_KEPT)
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def keep_cpus() -> list[int]:
    """This process's cores, sorted, kept as the ones the load is measured over: a rank
    about to bind itself to some of them (distributed.pin) still measures the machine's."""
    global _KEPT
    _KEPT = _cpus()
    return sorted(_KEPT)


def _busy_ticks(cpus: set[int]) -> int:
    """Busy ticks of the given CPUs since boot, from /proc/stat's cpuN lines."""
    total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *v = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                user, nice, system, _idle, _iowait, *rest = (int(x) for x in v)
                total += user + nice + system + sum(rest[:3])  # irq softirq steal
    return total


def _tree_ticks(root: int) -> int:
    """CPU ticks of root and every live process below it.

    Each process's own ticks, threads included, and its waited-for children's: a finished
    child's time moves to its parent.
    """
    ticks, parent = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        pid = int(name)  # (fields from "state": ppid 2nd; utime stime cutime cstime 12th-15th)
        parent[pid], ticks[pid] = int(fields[1]), sum(int(x) for x in fields[11:15])
    total = 0
    for pid, t in ticks.items():
        p, hops = pid, 0
        while p and p != root and hops < 64:
            p, hops = parent.get(p, 0), hops + 1
        total += t if p == root else 0
    return total


def snapshot() -> tuple | None:
    """The CPU counters now, for window(); None without /proc.

    A tuple: busy ticks of our CPUs, our tree's ticks, monotonic time, the number of our CPUs.
    """
    try:
        cpus = _cpus()
        return _busy_ticks(cpus), _tree_ticks(os.getpid()), time.monotonic(), len(cpus)
    except (OSError, ValueError, IndexError):
        return None


def window(a, b) -> tuple | None:
    """The counters' change between snapshots a and b: busy ticks, our ticks, seconds, CPUs.

    None if either snapshot is unknown or no time passed.
    """
    if a is None or b is None or b[2] <= a[2]:
        return None
    return b[0] - a[0], b[1] - a[1], b[2] - a[2], b[3]


def other_share(busy: float, ours: float, secs: float, cpus: int) -> float:
    """The share of cpus x secs of CPU time that others used, busy minus ours, in [0, 1]."""
    return min(1.0, max(0.0, busy - ours) / _TICK / (secs * max(1, cpus)))


def other_load(a, b) -> float | None:
    w = window(a, b)
    return None if w is None else other_share(*w)
