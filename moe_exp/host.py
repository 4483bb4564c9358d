"""This machine's process facts: /proc's memory lines and glibc's malloc settings."""
from __future__ import annotations

import platform


def status_kib(field: str, path: str = "/proc/self/status") -> int:
    """A `Field: N kB` line of /proc/self/status, or of `path` such as /proc/meminfo, in KiB."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in {path}")


def _libc():
    import ctypes

    return ctypes.CDLL("libc.so.6")


def release_free_heap() -> None:
    """Hands the heap memory glibc keeps for reuse back to the OS, with malloc_trim.

    A run after bigger work in the same process then still grows the RSS it measures."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


# mallopt parameters (malloc.h); thresholds get 2 GiB, the most a C int holds
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX, _RETAIN = -1, -3, -4, 2**31 - 1


def malloc_retain() -> bool:
    """Makes glibc serve big allocations from the heap and keep freed memory there.

    With no mmap per tensor above 32 MiB and no trimming, a step's big tensors reuse
    resident pages instead of faulting fresh ones in. It is process-wide and for good: an
    in-process sweep, sweep.isolate=false, keeps it for later jobs. Under an LD_PRELOADed
    jemalloc or tcmalloc it changes nothing. Returns whether glibc took it."""
    libc = _libc()
    if libc.mallopt(_M_TRIM_THRESHOLD, _RETAIN) != 1:
        return False
    # older glibc caps the mmap threshold at 32 MiB: then no mmap at all (M_MMAP_MAX 0)
    return libc.mallopt(_M_MMAP_THRESHOLD, _RETAIN) == 1 or libc.mallopt(_M_MMAP_MAX, 0) == 1




def glibc() -> bool:
    return platform.libc_ver()[0] == "glibc"
