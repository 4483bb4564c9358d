"""Report of a sweep dir: its table, PNG plots and report.md; optionally a W&B summary run.

    python -m moe_exp.report SWEEP_DIR [--baseline precision=fp32 ...] [--by model] [--wandb]

The table is printed and written as results.csv, .parquet and .md. Without --baseline and
--by, the baseline is the sweep's own sweep.baseline and sweep.baseline_by from its
multirun.yaml, else the row with the fewest optimizations on, per model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .sweep.report import own_logger, report


def _pairs(items: list[str]) -> dict | None:
    from .sweep.table import typed_value

    out = {}
    for item in items or []:
        if "=" not in item:
            print(f"error: --baseline: '{item}' is not key=value", file=sys.stderr)
            raise SystemExit(2)
        k, v = item.split("=", 1)
        if k in out:
            print(f"error: --baseline: {k} given twice; one value per key", file=sys.stderr)
            raise SystemExit(2)
        out[k] = typed_value(v)  # as Hydra typed the swept value (1e-3 -> 0.001, true -> True)
    return out or None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_exp.report", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--baseline", nargs="*", metavar="KEY=VALUE",
                    help="the baseline row (default: the sweep's sweep.baseline, else the "
                    "one with the fewest optimizations on; --baseline alone: the latter)")
    ap.add_argument("--by", nargs="*", help="one baseline per value of (default: the "
                    "sweep's sweep.baseline_by, else model)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--wandb", action="store_true", help="log a W&B summary run (offline "
                    "unless WANDB_MODE=online)")
    a = ap.parse_args(argv)
    if not a.sweep_dir.is_dir():
        print(f"error: sweep_dir: no directory {a.sweep_dir}", file=sys.stderr)
        return 2
    wandb_cfg = None
    if a.wandb:
        try:
            wandb_cfg = own_logger(a.sweep_dir)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    from .sweep.table import sweep_settings

    try:
        own, own_by = sweep_settings(a.sweep_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        baseline = _pairs(a.baseline) if a.baseline is not None else own
        by = a.by if a.by is not None else own_by  # (--by alone: one group for all rows)
        if a.baseline is None and own:
            print(f"[report] baseline: the sweep's own, "
                  f"{' '.join(f'{k}={v}' for k, v in own.items())} (--baseline to choose "
                  "another)", file=sys.stderr)
        # strict where the user named them here
        report(a.sweep_dir, baseline, by, wandb_cfg, plots=not a.no_plots,
               strict=a.baseline is not None or a.by is not None)
    except (FileNotFoundError, KeyError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full or read-only disk: the tables are as they were
        from .sweep.table import write_error_line

        print(f"error: {write_error_line(e)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
