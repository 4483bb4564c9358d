"""A sweep job's own process: runs the resolved config in job.json, writes metrics.json beside it.

    python -m moe_exp.sweep.child <job.json>

sweep/job.py starts it."""
from __future__ import annotations

import os
import sys
from pathlib import Path



def main(spec_path: str) -> int:
    from omegaconf import OmegaConf

    from ..results import stop_on_sigterm
    from ..pipeline import run
    from .job import load_spec

    stop_on_sigterm()
    watch_parent(os.getppid())
    spec = load_spec(spec_path)
    cfg = OmegaConf.create(spec["config"])
    try:
        run(cfg, out_dir=Path(spec_path).parent, progress=spec.get("progress", False),
            overrides=spec["overrides"], choices=spec["choices"], in_sweep=True)
    except OSError as e:  # a full or read-only disk: one line (the job's row says it)
        from .table import write_error_line

        print(f"error: {write_error_line(e)}", file=sys.stderr)
        return 1
    finally:
        remove_cache()
    return 0  # the record's status says how the run went


def remove_cache() -> None:
    """Remove the job's compile-cache dir (job.CACHE_ENV), on every exit."""
    import shutil

    from .job import CACHE_ENV

    if os.environ.get(CACHE_ENV):
        shutil.rmtree(os.environ[CACHE_ENV], ignore_errors=True)


def watch_parent(parent: int, every_s: float = 0.2, grace_s: float = 2.0) -> None:
    """Stop this job when the sweep that started it dies (kill -9 included).

    A thread polls the parent's pid; once this process is reparented it sends SIGTERM to
    the job's process group (the job, its ranks, its compile workers), and SIGKILL after
    `grace_s`: no job runs on, unseen, beside a resumed sweep."""
    import signal
    import threading
    import time

    def watch():
        while os.getppid() == parent:
            time.sleep(every_s)
        try:  # (the sweep read this job's output: the pipe is likely broken)
            print(f"error: the sweep that started this job (pid {parent}) is gone: stopping",
                  file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
        group = os.getpgrp() == os.getpid()  # (as sweep/job.py starts it: its own group)
        kill = (lambda s: os.killpg(0, s)) if group else (lambda s: os.kill(os.getpid(), s))
        kill(signal.SIGTERM)
        time.sleep(grace_s)
        remove_cache()
        kill(signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="watch-parent").start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
