"""Peak memory, a CPU run's memory cap, and out-of-memory errors.

Peaks are the accelerator allocator's, through torch.cuda or torch.hpu and torch.xpu
alike; on CPU, the process's peak RSS above a baseline.
"""
from __future__ import annotations

import contextlib

import torch

from ..host import release_free_heap, status_kib
from .timer import device_module

GIB = 2**30


def mem_available_bytes() -> int | None:
    """Linux's MemAvailable: the memory that can be had without swapping; None if unreadable."""
    try:
        return status_kib("MemAvailable", "/proc/meminfo") * 1024
    except (OSError, RuntimeError):
        return None


def free_bytes(device_type: str) -> int | None:
    """The memory free now on this machine's CPU: MemAvailable, or less where the cgroup
    allows less; None where unknown, and for an accelerator (reading a GPU's before the
    run would make a CUDA context on GPU 0 in the launcher of its ranks)."""
    if device_type != "cpu":
        return None
    free, room = mem_available_bytes(), cgroup_free_bytes()
    return free if room is None else room if free is None else min(free, room)


def cgroup_free_bytes(proc_cgroup: str = "/proc/self/cgroup",
                      root: str = "/sys/fs/cgroup") -> int | None:
    """The memory this process's cgroup and its parents still allow; None without a limit.

    The cgroup may be a container's or a SLURM job's. Each allows its limit less its usage,
    plus its inactive file cache, which is reclaimable; the least counts. Reads cgroup v2's
    memory.max and v1's memory/memory.limit_in_bytes.
    """
    from pathlib import Path

    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    least = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, names = Path(root), ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base = Path(root) / "memory"
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        d = base / path.lstrip("/")
        if not d.is_dir():  # a container's own view: its cgroup is the mount's root
            d = base
        while True:
            free = _cgroup_dir_free(d, *names)
            if free is not None:
                least = free if least is None else min(least, free)
            if d == base or d.parent == d:
                break
            d = d.parent
    return least


def _cgroup_dir_free(d, limit_name: str, usage_name: str, inactive_key: str) -> int | None:
    try:
        limit = (d / limit_name).read_text().strip()
        if limit == "max" or int(limit) >= 2**60:  # v1 writes "no limit" as ~2^63
            return None
        usage = int((d / usage_name).read_text())
        stat = dict(x.split() for x in (d / "memory.stat").read_text().splitlines() if x)
    except (OSError, ValueError):
        return None
    return max(int(limit) - usage + int(stat.get(inactive_key, 0)), 0)


@contextlib.contextmanager
def cpu_memory_cap(memory_gib: float | None, ranks: int = 1):
    """Cap a CPU run's process at the memory free at its start, so running out is recorded.

    Free memory is the least of MemAvailable, the cgroup's room and hardware.memory_gib,
    shared evenly among this machine's `ranks`. Past the cap an allocation fails and the run
    ends `oom` with a record, as on a GPU, rather than the kernel's OOM killer silently
    ending this or another process. The cap is RLIMIT_DATA, which Linux >= 4.7 applies to
    anonymous mappings too, reserved as well as touched; a lower limit already set stays.
    Yields the bytes the process may allocate beyond what it holds at its start; None for
    no cap.
    """
    import resource

    free = free_bytes("cpu")
    if free is None or not hasattr(resource, "RLIMIT_DATA"):
        yield None
        return
    if memory_gib:
        free = min(free, int(memory_gib * GIB))
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    held = status_kib("VmData") * 1024
    cap = held + free // max(ranks, 1)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        yield max(soft - held, 0)
        return
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    try:
        yield cap - held
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def is_oom(e: BaseException) -> bool:
    """Whether e is a failed allocation.

    The accelerator's OutOfMemoryError, or torch's CPU allocator or Python refusing, past
    cpu_memory_cap or the machine's memory.
    """
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and oom_text(str(e)))


def oom_text(text: str) -> bool:
    """Whether an error's text, such as a rank's under the launcher, says an allocation failed."""
    return "MemoryError" in text or ("DefaultCPUAllocator: " in text and (
        "can't allocate memory" in text or "not enough memory" in text))


def oom_line(text: str, cap: int | None = None) -> str:
    """An allocation failure in one line, with the CPU process's cap where one is given.

    torch's CPU allocator's message loses its C++ assertion text; a bare MemoryError is
    named. cap: the bytes cpu_memory_cap allowed.
    """
    import re

    what = re.sub(r"\[enforce fail at [^\]]*\] [^.]*\. ", "", text)
    what = re.sub(r"\. Error code \d+ \([^)]*\)$", "", what)
    if not what or what.endswith("MemoryError"):
        what = f"{what[:-len('MemoryError')] if what else ''}out of memory (MemoryError)"
    if cap is None:
        return what
    return (f"{what} (the process could allocate {cap / 2**30:.2g} GiB: the least of the "
            "memory free at its start, its cgroup's room, hardware.memory_gib and ulimit -d)")


HEALTH = ("alloc_retries", "alloc_ooms")  # the allocator's counts over the window


class MemoryMeter:
    """A run's peak memory over the measured window.

    Call baseline() before the model is built, reset() before the window, read() after it.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.base_rss = self.base_alloc = self.base_reserved = 0
        self.reset_ok = True
        self.health0 = {}  # the allocator's retry and OOM counts at the window's opening

    def baseline(self) -> None:
        api = self._api()
        if api is not None:  # what an earlier run in this process (sweep.isolate=false)
            # left: its cached blocks freed, its live tensors not counted (0 in a new process)
            import gc

            gc.collect()
            api.synchronize()
            if hasattr(api, "empty_cache"):
                api.empty_cache()
            self.base_alloc = api.memory_allocated() if hasattr(api, "memory_allocated") else 0
            self.base_reserved = api.memory_reserved() if hasattr(api, "memory_reserved") else 0
        elif self.device.type == "cpu":
            release_free_heap()
            self.base_rss = status_kib("VmRSS") * 1024

    def _api(self):
        """The device's torch module where it has the peak-memory calls, from device_module."""
        return device_module(self.device, "synchronize", "reset_peak_memory_stats",
                             "max_memory_allocated")

    def reset(self) -> None:
        api = self._api()
        if api is not None:
            api.synchronize()
            api.reset_peak_memory_stats()
            self.health0 = self._health(api)
        elif self.device.type == "cpu":
            try:  # resets VmHWM to the current RSS
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self.reset_ok = False

    def read(self) -> tuple[dict, dict]:
        """The window's figures: returns (values, reasons for null values)."""
        api = self._api()
        if api is not None:
            api.synchronize()
            reserved = getattr(api, "max_memory_reserved", None)
            health = {k: v - self.health0.get(k, 0) for k, v in self._health(api).items()}
            why = {k: f"torch.{self.device.type} has no memory_stats" for k in HEALTH
                   if k not in health}
            if not reserved:
                why["peak_reserved_gib"] = f"torch.{self.device.type} has no max_memory_reserved"
            return {"peak_mem_gib": (api.max_memory_allocated() - self.base_alloc) / GIB,
                    "peak_reserved_gib": (reserved() - self.base_reserved) / GIB
                    if reserved else None, **dict.fromkeys(HEALTH), **health}, why
        if self.device.type == "cpu":
            peak = (status_kib("VmHWM") * 1024 - self.base_rss) / GIB
            why = {"peak_reserved_gib": "CPU has no caching allocator: peak_mem_gib is peak RSS "
                   "above the RSS before the model was built"}
            if not self.reset_ok:
                why["peak_mem_note"] = "could not reset VmHWM: peak includes warmup steps"
            if peak <= 0:  # the run reused heap that earlier work in this process freed
                why["peak_mem_gib"] = ("RSS never rose above the RSS before the model was "
                                       "built (memory freed earlier in this process was "
                                       "reused): run it in its own process, as sweeps do")
                peak = None
            why.update(dict.fromkeys(HEALTH, "CPU: no caching allocator to retry or run out"))
            return {"peak_mem_gib": peak, "peak_reserved_gib": None,
                    **dict.fromkeys(HEALTH)}, why
        reason = f"no memory API used for device type {self.device.type}"
        keys = ("peak_mem_gib", "peak_reserved_gib", *HEALTH)
        return dict.fromkeys(keys), dict.fromkeys(keys, reason)

    @staticmethod
    def _health(api) -> dict:
        """The caching allocator's cumulative retries and OOMs, where the device reports them.

        A retry is a cudaMalloc that failed, the cache freed and the call tried again:
        torchtitan's health figure.
        """
        stats = getattr(api, "memory_stats", None)
        s = stats() if stats else {}
        return {k: s[n] for k, n in zip(HEALTH, ("num_alloc_retries", "num_ooms")) if n in s}
