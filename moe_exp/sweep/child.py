"""A sweep job's own process: runs the resolved config in job.json, writes metrics.json beside it.

    python -m moe_exp.sweep.child <job.json>

sweep/job.py starts it."""
from __future__ import annotations

import sys
from pathlib import Path


def main(spec_path: str) -> int:
    from omegaconf import OmegaConf

    from ..results import stop_on_sigterm
    from ..pipeline import run
    from .job import load_spec

    stop_on_sigterm()
    spec = load_spec(spec_path)
    cfg = OmegaConf.create(spec["config"])
    try:
        run(cfg, out_dir=Path(spec_path).parent, progress=spec.get("progress", False),
            overrides=spec["overrides"], choices=spec["choices"], in_sweep=True)
    except OSError as e:  # a full or read-only disk: one line (the job's row says it)
        from .table import write_error_line

        print(f"error: {write_error_line(e)}", file=sys.stderr)
        return 1
    return 0  # the record's status says how the run went


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
