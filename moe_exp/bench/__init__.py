"""Instruments: timers, memory, FLOPs, NVML, the profiler, CPU load, expert load."""
