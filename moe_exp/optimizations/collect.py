"""train.gc_every: when Python's garbage collection runs, and what it costs.

N > 0 turns the automatic collections off for the run, as they fall at random points of
random steps, and collects generations 0-1 every N steps, as torchtitan's gc_freq. Either
way every collection in the measured window is timed through gc.callbacks, so the record
says what GC cost.
"""
from __future__ import annotations

import gc
import time


class Collector:
    def __init__(self, every: int):
        self.every = every
        self.timing = False  # set per step: whether it is a measured one
        self.ms, self.count, self._t0, self._was = 0.0, 0, None, None

    def __enter__(self):
        self._was = gc.isenabled()
        if self.every:
            gc.collect()  # (a full one first: the build's garbage is not the first step's)
            gc.disable()
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        if self._was:
            gc.enable()

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter() if self.timing else None
        elif self._t0 is not None:
            self.ms += (time.perf_counter() - self._t0) * 1e3
            self.count += 1
            self._t0 = None

    def step(self, step: int) -> bool:
        """After a step, collect where a collection is due; True when it did."""
        if self.every and (step + 1) % self.every == 0:
            gc.collect(1)
            return True
        return False

    def per_step(self, steps: int) -> tuple[float | None, int]:
        """Over the measured window: collection ms per measured step, and collections made."""
        return (self.ms / steps if steps else None), self.count
