"""Report of a sweep dir: the table (printed, results.csv/.parquet/.md), PNG plots and
report.md; optionally a W&B summary run.

    python -m moe_exp.report SWEEP_DIR [--baseline precision=fp32 ...] [--by model] [--wandb]

Without --baseline / --by: the sweep's own sweep.baseline and sweep.baseline_by (from its
multirun.yaml), else the row with the fewest optimizations on, per model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def report(sweep_dir: Path, baseline: dict | None = None, by=("model",), wandb_cfg=None,
           group: str | None = None, title: str | None = None, plots: bool = True,
           strict: bool = False) -> dict:
    """Rebuild everything from the job records in sweep_dir; returns the output paths."""
    from .sweep.table import (build_table, collect, markdown, print_table, sweep_table,
                              write_tables)

    sweep_dir = Path(sweep_dir)
    title = title or f"Sweep {sweep_dir}"
    records = collect(sweep_dir)
    if not records:
        raise FileNotFoundError(f"no job records (*/metrics.json) under {sweep_dir}")
    if strict:  # `report --baseline/--by`: a bad key is the user's error, now
        df = build_table(records, baseline, by, ("--baseline", "--by"))
    else:  # a sweep's own settings: its table and report still come, with the default
        df, bad = sweep_table(records, baseline, by)
        if bad:
            print(f"[sweep] {bad}: the default baseline per model instead", file=sys.stderr)
            baseline = None
    if baseline and not df["baseline"].any():  # before the tables are rewritten
        want = " ".join(f"{k}={v}" for k, v in baseline.items())
        if strict:  # `report --baseline`: the user asked for it, now
            raise KeyError(f"--baseline {want}: no finished (status ok) row matches")
        print(f"[sweep] sweep.baseline {want} matches no finished (status ok) row: no "
              "speedups", file=sys.stderr)
    paths = write_tables(df, sweep_dir, title)
    print_table(df, title)
    pngs = {}
    if plots:
        from .sweep.plots import write_plots

        pngs = write_plots(df, sweep_dir / "plots")
    parts = [markdown(df, title)]
    from .sweep.seed import seed_tables

    seed = seed_tables(df)
    if seed:
        parts.append(seed)
        print(seed)
    for name, p in pngs.items():
        parts.append(f"## {name.capitalize()}\n\n![{name}]({p.relative_to(sweep_dir)})\n")
    paths["report"] = sweep_dir / "report.md"
    paths["report"].write_text("\n".join(parts))
    paths.update(pngs)
    if wandb_cfg is not None:
        from .tracking import log_sweep

        log_sweep(df, sweep_dir, wandb_cfg, group or f"report-{sweep_dir.name}", pngs)
    print(f"[report] {', '.join(str(p) for p in paths.values())}")
    return paths


def _pairs(items: list[str]) -> dict | None:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"error: --baseline: '{item}' is not key=value")
        k, v = item.split("=", 1)
        out[k] = v
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
        import os

        from omegaconf import OmegaConf

        wandb_cfg = OmegaConf.create({"project": "moe_exp", "entity": None,
                                      "mode": os.environ.get("WANDB_MODE", "offline")})
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
