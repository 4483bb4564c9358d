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
    from .sweep.answer import answer_text
    from .sweep.table import markdown, print_table, write_tables, write_text_atomic

    sweep_dir = Path(sweep_dir)
    title = title or f"Sweep {sweep_dir}"
    df = sweep_df(sweep_dir, baseline, by, strict)  # (before the tables are rewritten)
    paths = write_tables(df, sweep_dir, title)
    lead = answer_text(df)
    if lead:
        print(lead)
    print_table(df, title)
    pngs = {}
    if plots:
        from .sweep.plots import write_plots

        pngs = write_plots(df, sweep_dir / "plots")
    parts = [markdown(df, title, lead)]
    from .sweep.seed import seed_inference_table, seed_tables
    from .sweep.seed002 import seed002_table

    for seed in (seed_tables(df), seed002_table(df), seed_inference_table(df)):
        if seed:
            parts.append(seed)
            print(seed)
    for name, p in pngs.items():
        parts.append(f"## {name.capitalize()}\n\n![{name}]({p.relative_to(sweep_dir)})\n")
    if profiles := profile_links(df, sweep_dir):
        parts.append(profiles)
    paths["report"] = sweep_dir / "report.md"
    write_text_atomic(paths["report"], "\n".join(parts))
    paths.update(pngs)
    if wandb_cfg is not None:
        from .tracking import log_sweep

        group = group or own_group(sweep_dir) or f"report-{sweep_dir.resolve().name}"
        try:
            log_sweep(df, sweep_dir, wandb_cfg, group, pngs)
        except Exception as e:  # noqa: BLE001 - W&B's failure (a full disk, its service):
            # a warning, the tables are written
            line = (str(e).strip().splitlines() or [""])[0][:300]
            print(f"warning: W&B summary run failed: {type(e).__name__}: {line}",
                  file=sys.stderr)
            wandb_cfg = None
    if wandb_cfg is not None:
        print(f"[report] W&B run {group}-summary ({wandb_cfg.mode}) in project "
              f"{wandb_cfg.project}, files under {sweep_dir / 'wandb'}"
              if wandb_cfg.mode != "disabled" else "[report] W&B: mode disabled, nothing "
              "logged")
    print(f"[report] {', '.join(str(p) for p in paths.values())}")
    return paths


def profile_links(df, sweep_dir: Path) -> str | None:
    """A section linking each traced job's files (train.profile), with its shares."""
    from .bench.profile import top_shares

    lines = []
    for r in df.itertuples():
        shares = getattr(r, "profile_shares", None)
        if not isinstance(shares, dict) or r.job is None:
            continue
        found = sorted((sweep_dir / str(r.job)).glob("**/trace.json"))  # (repeats: rep<i>/)
        if not found:
            continue
        d = found[0].parent.relative_to(sweep_dir)
        files = [f"[trace]({d}/trace.json)", f"[top ops]({d}/profile.txt)"]
        if (sweep_dir / d / "memory_snapshot.pickle").exists():
            files.append(f"[memory snapshot]({d}/memory_snapshot.pickle)")
        lines.append(f"- job {r.job} ({r.label}): {' · '.join(files)} — {top_shares(shares)}")
    if not lines:
        return None
    return ("## Profiles\n\nTraces open in <https://ui.perfetto.dev> or TensorBoard's "
            "profiler; memory snapshots in <https://pytorch.org/memory_viz>.\n\n"
            + "\n".join(lines) + "\n")


def sweep_df(sweep_dir: Path, baseline: dict | None, by, strict: bool,
             names=("--baseline", "--by")):
    """The table of sweep_dir's job records. strict (the user named baseline / by, as
    `names`): a key no row has, or a baseline no finished row matches, is an error; else
    (the sweep's own settings) the table still comes, with a note and the default."""
    from .sweep.table import baseline_text, build_table, collect, sweep_table

    records = collect(sweep_dir, keep=True)  # (a record that broke keeps its table row)
    if not records:
        raise FileNotFoundError(f"no job records (*/metrics.json) under {sweep_dir}")
    if strict:
        df = build_table(records, baseline, by, names)
    else:
        df, bad = sweep_table(records, baseline, by)
        if bad:
            print(f"[report] {bad}: the default baseline per model instead", file=sys.stderr)
            baseline = None
    if baseline and not df["baseline"].any():
        want = baseline_text(baseline)
        if strict:
            raise KeyError(f"{names[0]} {want}: no finished (status ok) row matches")
        print(f"[report] sweep.baseline {want} matches no finished (status ok) row: no "
              "speedups", file=sys.stderr)
    return df


def _multirun(sweep_dir: Path):
    """The config Hydra saved in a sweep's dir (multirun.yaml); None where there is none or
    it does not load."""
    from omegaconf import DictConfig, OmegaConf

    try:
        cfg = OmegaConf.load(Path(sweep_dir) / "multirun.yaml")
    except Exception:  # noqa: BLE001 - no such file, or not YAML
        return None
    return cfg if isinstance(cfg, DictConfig) else None


def own_group(sweep_dir: Path) -> str | None:
    """The W&B group the sweep's own runs went to (its multirun.yaml), if it has one."""
    from omegaconf import OmegaConf

    from .sweep.live import sweep_group

    cfg = _multirun(sweep_dir)
    try:
        # the dir as the sweep named it (its jobs' group came from that); an interpolation
        # (the default multirun/${now:...}): this dir's own <date>/<time>
        raw = OmegaConf.to_container(cfg, resolve=False).get("hydra", {}).get("sweep", {}) \
            .get("dir")
        d = Path(raw) if isinstance(raw, str) and "${" not in raw else Path(sweep_dir).resolve()
        return cfg.logger.get("group") or sweep_group(cfg, d)
    except Exception:  # noqa: BLE001 - no such file, or not a sweep's: the report's own name
        return None


def own_logger(sweep_dir: Path):
    """`report --wandb`'s W&B settings: the sweep's own project and entity (its
    multirun.yaml; else moe_exp's defaults), in WANDB_MODE's mode (default offline)."""
    import os

    from omegaconf import OmegaConf

    from .config import CHOICES

    cfg = {"project": "moe_exp", "entity": None}
    own = (_multirun(sweep_dir) or {}).get("logger")
    if own is not None:  # (else moe_exp's defaults)
        own = OmegaConf.to_container(own, resolve=False)
        cfg.update({k: own[k] for k in cfg if isinstance(own.get(k), str)})
    mode = os.environ.get("WANDB_MODE", "offline")
    if mode not in CHOICES["logger.mode"]:
        raise ValueError(f"WANDB_MODE: '{mode}' is not one of: "
                         f"{', '.join(CHOICES['logger.mode'])}")
    return OmegaConf.create({**cfg, "mode": mode})


def find_sweep_dir(sweep_dir=None, start: Path | None = None) -> Path:
    """The notebook's SWEEP_DIR: None -> the newest sweep (a dir with Hydra's multirun.yaml:
    multirun/<date>/<time>, or a hydra.sweep.dir=multirun/NAME) under multirun/ in `start`
    (the cwd) or a parent; a relative path -> the first of start, its parents that has it
    (Jupyter runs in notebooks/, a sweep prints its dir relative to where it ran)."""
    start = Path(start or Path.cwd()).resolve()
    here = (start, *start.parents)
    if sweep_dir is None:
        runs = [p.parent for d in here for p in (d / "multirun").rglob("multirun.yaml")]
        if not runs:
            raise FileNotFoundError(f"no sweep (multirun/.../multirun.yaml) in {start} or a "
                                    "parent dir: set SWEEP_DIR")
        return max(runs, key=lambda p: p.stat().st_mtime)
    p = Path(sweep_dir).expanduser()
    found = p if p.is_absolute() else next((d / p for d in here if (d / p).is_dir()), None)
    if found is None or not found.is_dir():
        raise FileNotFoundError(f"SWEEP_DIR: no directory {sweep_dir}"
                                + ("" if p.is_absolute() else f" in {start} or a parent dir"))
    return found


def notebook_table(sweep_dir=None, baseline: dict | None = None):
    """(the sweep dir, its table) for notebooks/results.ipynb: baseline None = the sweep's
    own (as its results.md); a dict = that one, an error where no finished row matches."""
    from .sweep.table import sweep_settings

    if baseline is not None and not isinstance(baseline, dict):
        raise TypeError(f"BASELINE: a dict of key: value (e.g. {{'precision': 'bf16'}}), {{}} "
                        f"or None, got {baseline!r}")
    d = find_sweep_dir(sweep_dir)
    own, by = sweep_settings(d)
    strict = baseline is not None
    return d, sweep_df(d, baseline if strict else own, by, strict,
                       ("BASELINE", "sweep.baseline_by"))


def _pairs(items: list[str]) -> dict | None:
    from .sweep.table import _typed

    out = {}
    for item in items or []:
        if "=" not in item:
            print(f"error: --baseline: '{item}' is not key=value", file=sys.stderr)
            raise SystemExit(2)
        k, v = item.split("=", 1)
        if k in out:
            print(f"error: --baseline: {k} given twice; one value per key", file=sys.stderr)
            raise SystemExit(2)
        out[k] = _typed(v)  # as Hydra typed the swept value (1e-3 -> 0.001, true -> True)
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
