"""A sweep dir's report: its table, PNG plots and report.md, optionally a W&B summary run.

The table is printed and written as results.csv, .parquet and .md. The notebook's table
comes from here too. The command line is moe_exp/report.py."""
from __future__ import annotations

import sys
from pathlib import Path


def report(sweep_dir: Path, baseline: dict | None = None, by=("model",), wandb_cfg=None,
           group: str | None = None, title: str | None = None, plots: bool = True,
           strict: bool = False) -> dict:
    """Rebuild everything from the job records in sweep_dir; returns the output paths."""
    from .. import screen
    from .answer import answer_text
    from .table import markdown, print_table, write_tables, write_text_atomic

    sweep_dir = Path(sweep_dir)
    title = title or f"Sweep {sweep_dir}"
    df = sweep_df(sweep_dir, baseline, by, strict)  # (before the tables are rewritten)
    paths = write_tables(df, sweep_dir, title)
    lead = answer_text(df)
    cols = screen.width()
    if lead:
        print(screen.text(lead, cols))
    print_table(df, title, cols)
    pngs = {}
    if plots:
        from .plots import write_plots

        pngs = write_plots(df, sweep_dir / "plots")
    parts = [markdown(df, title, lead)]
    from .seed import seed_inference_table, seed_tables
    from .seed002 import seed002_table

    for seed in (seed_tables(df), seed002_table(df), seed_inference_table(df)):
        if seed:
            parts.append(seed)
            fits = max(map(len, seed.splitlines())) <= cols
            print(seed if fits else f"{seed.splitlines()[0]}: wider than this terminal; "
                  "in report.md")
    for name, p in pngs.items():
        parts.append(f"## {name.capitalize()}\n\n![{name}]({p.relative_to(sweep_dir)})\n")
    if profiles := profile_links(df, sweep_dir):
        parts.append(profiles)
    paths["report"] = sweep_dir / "report.md"
    write_text_atomic(paths["report"], "\n".join(parts))
    paths.update(pngs)
    if wandb_cfg is not None:
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
    print(screen.wrapped(f"[report] {', '.join(str(p) for p in paths.values())}", cols))
    return paths


def profile_links(df, sweep_dir: Path) -> str | None:
    """A report section linking each traced job's files, from train.profile, with its shares."""
    from ..bench.profile import top_shares

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
    """The table of sweep_dir's job records.

    strict: the user named baseline and by, as `names` calls them; a key no row has, or a
    baseline no finished row matches, is an error. Else they are the sweep's own settings,
    and the table still comes, with a note and the default baseline."""
    from .table import baseline_text, build_table, collect, sweep_table

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
    """The config Hydra saved in a sweep's dir as multirun.yaml; None where none loads."""
    from omegaconf import DictConfig, OmegaConf

    try:
        cfg = OmegaConf.load(Path(sweep_dir) / "multirun.yaml")
    except Exception:  # noqa: BLE001 - no such file, or not YAML
        return None
    return cfg if isinstance(cfg, DictConfig) else None


def own_group(sweep_dir: Path) -> str | None:
    """The W&B group the sweep's own runs went to, from its multirun.yaml; None without one."""
    from omegaconf import OmegaConf

    from .live import sweep_group

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
    """`report --wandb`'s W&B settings: the sweep's own project and entity, in WANDB_MODE's mode.

    Project and entity come from its multirun.yaml, else moe_exp's defaults; the mode
    defaults to offline."""
    import os

    from omegaconf import OmegaConf

    from ..config import CHOICES

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
    """The notebook's SWEEP_DIR, looked for in `start`, the cwd by default, and its parents.

    None gives the newest sweep under multirun/: a dir with Hydra's multirun.yaml, such as
    multirun/<date>/<time> or a hydra.sweep.dir=multirun/NAME. A relative path is the first
    found in start or a parent: Jupyter runs in notebooks/, and a sweep prints its dir
    relative to where it ran."""
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
    """The sweep dir and its table, for notebooks/results.ipynb.

    baseline None takes the sweep's own, as its results.md does; a dict takes that one, and
    no finished row matching it is an error."""
    from .table import sweep_settings

    if baseline is not None and not isinstance(baseline, dict):
        raise TypeError(f"BASELINE: a dict of key: value (e.g. {{'precision': 'bf16'}}), {{}} "
                        f"or None, got {baseline!r}")
    d = find_sweep_dir(sweep_dir)
    own, by = sweep_settings(d)
    strict = baseline is not None
    return d, sweep_df(d, baseline if strict else own, by, strict,
                       ("BASELINE", "sweep.baseline_by"))


def log_sweep(df, sweep_dir: Path, logger_cfg, group: str, pngs: dict) -> None:
    """One summary run for a sweep: the results table, bar charts and the PNG plots."""
    import wandb

    from ..tracking import wandb_settings
    from .plots import ok_rows
    from .table import flat

    run = wandb.init(project=logger_cfg.project, entity=logger_cfg.entity, group=group,
                     mode=logger_cfg.mode, dir=str(sweep_dir), name=f"{group}-summary",
                     job_type="sweep-summary", config={"sweep_dir": str(sweep_dir)},
                     settings=wandb_settings())
    try:
        f = flat(df)
        f = f.astype(object).where(f.notna(), None)
        ok = ok_rows(df)
        charts = {}
        for key, col, title in (("throughput", "tokens_per_s", "tokens/s by combination"),
                                ("peak_memory", "peak_mem_gib", "peak memory (GiB)")):
            d = ok[ok[col].notna()]
            t = wandb.Table(columns=["combination", col],
                            data=[[n, float(v)] for n, v in zip(d["name"], d[col])])
            charts[key] = wandb.plot.bar(t, "combination", col, title=title)
        images = {f"plot/{k}": wandb.Image(str(p)) for k, p in pngs.items()}
        run.log({"results": wandb.Table(dataframe=f, allow_mixed_types=True), **charts, **images})
        best = ok.loc[ok["tokens_per_s"].idxmax()] if len(ok) else None
        run.summary.update({"jobs": len(df), "jobs_ok": int((df["status"] == "ok").sum()),
                            **({"best_combination": best["name"],
                                "best_tokens_per_s": float(best["tokens_per_s"])}
                               if best is not None else {})})
    finally:
        run.finish()
