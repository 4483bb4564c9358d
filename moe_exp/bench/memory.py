"""Peak memory: the accelerator allocator's peaks (torch.cuda, or torch.hpu/xpu alike); on CPU
the process's peak RSS above a baseline."""
from __future__ import annotations

import contextlib

import torch

from .timer import device_module

GIB = 2**30


def _status_kib(field: str, path: str = "/proc/self/status") -> int:
    """A `Field: N kB` line of /proc/self/status (or /proc/meminfo), in KiB."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in {path}")


def _libc():
    import ctypes

    return ctypes.CDLL("libc.so.6")


def _release_free_heap() -> None:
    """glibc keeps freed heap memory for reuse; hand it back to the OS (malloc_trim), so
    that a run after bigger work in the same process still grows the RSS it measures."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def mem_available_bytes() -> int | None:
    """Linux's estimate of the memory that can be had without swapping (MemAvailable)."""
    try:
        return _status_kib("MemAvailable", "/proc/meminfo") * 1024
    except (OSError, RuntimeError):
        return None


def cgroup_free_bytes(proc_cgroup: str = "/proc/self/cgroup",
                      root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's memory cgroup (a container's, a SLURM job's) and its parents
    still allow: the least of limit - usage + inactive file cache (reclaimable); None
    without a limit. cgroup v2 (memory.max) and v1 (memory/memory.limit_in_bytes)."""
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
    """A CPU run's process may allocate at most the memory free at its start (the least of
    MemAvailable, its cgroup's room and hardware.memory_gib; shared evenly among this
    machine's `ranks`): past it an allocation fails, and the run ends `oom` with a record,
    as on a GPU, instead of the kernel's OOM killer ending the process (or another one)
    without a word. RLIMIT_DATA (Linux >= 4.7 counts anonymous mappings too: reserved as
    well as touched); a lower limit already set stays. Yields the bytes the process may
    allocate beyond what it holds at its start (None: no cap)."""
    import resource

    free = mem_available_bytes()
    if free is None or not hasattr(resource, "RLIMIT_DATA"):
        yield None
        return
    if (room := cgroup_free_bytes()) is not None:
        free = min(free, room)
    if memory_gib:
        free = min(free, int(memory_gib * GIB))
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    held = _status_kib("VmData") * 1024
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
    """An allocation that failed: the accelerator's OutOfMemoryError, torch's CPU
    allocator or Python's refusing (past cpu_memory_cap, or the machine's memory)."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and oom_text(str(e)))


def oom_text(text: str) -> bool:
    """An error's text (a rank's, under the launcher) that says an allocation failed."""
    return "MemoryError" in text or ("DefaultCPUAllocator: " in text and (
        "can't allocate memory" in text or "not enough memory" in text))


def oom_line(text: str, cap: int | None = None) -> str:
    """An allocation failure in one line: torch's CPU allocator's without its C++ assertion
    text, a bare MemoryError named; with the CPU process's cap (cpu_memory_cap)."""
    import re

    what = re.sub(r"\[enforce fail at [^\]]*\] [^.]*\. ", "", text)
    what = re.sub(r"\. Error code \d+ \([^)]*\)$", "", what)
    if not what or what.endswith("MemoryError"):
        what = f"{what[:-len('MemoryError')] if what else ''}out of memory (MemoryError)"
    if cap is None:
        return what
    return (f"{what} (the process could allocate {cap / 2**30:.2g} GiB: the least of the "
            "memory free at its start, its cgroup's room, hardware.memory_gib and ulimit -d)")


# mallopt parameters (malloc.h); thresholds get 2 GiB, the most a C int holds
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX, _RETAIN = -1, -3, -4, 2**31 - 1


def malloc_retain() -> bool:
    """glibc: serve big allocations from the heap and keep freed memory there (no mmap per
    tensor above 32 MiB, no trimming), so a step's big tensors reuse resident pages instead
    of faulting fresh ones in. Process-wide and for good (an in-process sweep,
    sweep.isolate=false, keeps it for later jobs). Returns whether glibc took it. (Under
    an LD_PRELOADed jemalloc/tcmalloc glibc's settings change nothing.)"""
    libc = _libc()
    if libc.mallopt(_M_TRIM_THRESHOLD, _RETAIN) != 1:
        return False
    # older glibc caps the mmap threshold at 32 MiB: then no mmap at all (M_MMAP_MAX 0)
    return libc.mallopt(_M_MMAP_THRESHOLD, _RETAIN) == 1 or libc.mallopt(_M_MMAP_MAX, 0) == 1


HEALTH = ("alloc_retries", "alloc_ooms")  # the allocator's counts over the window


class MemoryMeter:
    """baseline() before the model is built; reset() before the window; read() after it."""

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
            _release_free_heap()
            self.base_rss = _status_kib("VmRSS") * 1024

    def _api(self):
        """The device's torch module where it has the peak-memory calls (see device_module)."""
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
        """(values, reasons for null values)."""
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
            peak = (_status_kib("VmHWM") * 1024 - self.base_rss) / GIB
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
        """The caching allocator's cumulative retries (cudaMalloc failed, cache freed, tried
        again: torchtitan's health figure) and OOMs, where the device reports them."""
        stats = getattr(api, "memory_stats", None)
        s = stats() if stats else {}
        return {k: s[n] for k, n in zip(HEALTH, ("num_alloc_retries", "num_ooms")) if n in s}
