"""How many trials `+sweep=search` needs to find the best row of a measured grid.

    python benchmarks/search_trials.py GRID_DIR [--seeds 20] [--samplers tpe,nsgaii,random]
                                       [--json out.json]

GRID_DIR: a finished `-m +sweep=optimizations` sweep (its job records, or its
results.parquet alone). The search is
replayed against them: each trial's values are its row's measured (tokens/s, peak GiB) and
a row that is not ok is a failed trial, as moe_exp.sweep.search.trial_values tells Optuna
in a real search; the study is the one the preset makes (its space, the baseline enqueued
first, the sampler with the preset's settings, one seed per study). Per sampler it prints the
seeds that found the grid's fastest ok row within 3x the grid's size in trials, the median
over the seeds of the distinct configurations run until then (the cost: a repeated one
costs nothing, the sweep's resume reuses its record) and of the trials, and how many seeds
found it within a third of the grid in configurations.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "moe_exp" / "conf" / "sweep" / "search.yaml"


def space():
    """The preset's search space, as the Optuna sweeper parses it."""
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides
    from omegaconf import OmegaConf

    params = OmegaConf.load(PRESET).hydra.sweeper.params
    dists, _ = create_params_from_overrides([f"{k}={v}" for k, v in params.items()])
    return dists


def grid_rows(grid_dir: Path, names) -> dict:
    """{params tuple: (status, tokens/s, peak GiB)} of the grid's rows: its job records,
    else its table (results.parquet, as committed under benchmarks/results/)."""
    import pandas as pd

    from moe_exp.sweep.table import collect, number_or_none, override_items

    recs = collect(grid_dir, warn=False)
    if not recs and (grid_dir / "results.parquet").is_file():
        df = pd.read_parquet(grid_dir / "results.parquet")
        recs = [{**r, "overrides": json.loads(r["overrides"])} for r in df.to_dict("records")]
    rows = {}
    for rec in recs:
        items = {k.lstrip("+"): v for k, v in override_items(rec).items()}
        key = tuple(str(items.get(n, "")) for n in names)
        rows[key] = (rec.get("status"), number_or_none(rec.get("tokens_per_s")),
                     number_or_none(rec.get("peak_mem_gib")))
    return rows


def unrunnable(dists: dict, rows: dict) -> list[str]:
    """The precisions whose every row is skipped, out of dists (in place), as the search
    sweeper leaves out what its machine cannot run (moe_exp.sweep.searcher.drop_unrunnable)."""
    import optuna

    names, key = list(dists), "precision"
    if key not in dists:
        return []
    i = names.index(key)
    gone = [v for v in dists[key].choices
            if all(st == "skipped" for k, (st, _, _) in rows.items() if k[i] == str(v))]
    kept = [v for v in dists[key].choices if v not in gone]
    if gone and kept:
        dists[key] = optuna.distributions.CategoricalDistribution(kept)
        return [str(v) for v in gone]
    return []


def sampler(name: str, seed: int):
    """`preset`: the preset's own (NSGA-II with its population_size); the others as Optuna
    makes them by default."""
    import optuna
    from omegaconf import OmegaConf

    pop = OmegaConf.load(PRESET).hydra.sweeper.sampler.population_size
    return {"preset": lambda: optuna.samplers.NSGAIISampler(seed=seed, population_size=pop),
            "nsgaii8": lambda: optuna.samplers.NSGAIISampler(seed=seed, population_size=8),
            "tpe": lambda: optuna.samplers.TPESampler(seed=seed),
            "random": lambda: optuna.samplers.RandomSampler(seed=seed)}[name]()


def replay(name: str, seed: int, dists: dict, rows: dict, target: tuple, limit: int):
    """(trials, distinct configurations) until `target` was tried; None past `limit`."""
    import optuna

    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler(name, seed))
    study.enqueue_trial({k: d.choices[0] for k, d in dists.items()})  # (the baseline first)
    seen = set()
    for n in range(1, limit + 1):
        trial = study.ask()
        for k, d in dists.items():
            trial._suggest(k, d)  # (as the Optuna sweeper does)
        key = tuple(str(trial.params[k]) for k in dists)
        seen.add(key)
        status, tps, mem = rows[key]
        if status == "ok" and tps is not None and mem is not None:
            study.tell(trial, [tps, mem])
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        if key == target:
            return n, len(seen)
    return None, len(seen)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("grid_dir", type=Path)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--samplers", default="preset,nsgaii8,tpe,random")
    ap.add_argument("--keep-unrunnable", action="store_true", help="keep the precisions "
                    "whose every row is skipped in the space (the sweeper leaves them out)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    dists = space()
    rows = grid_rows(a.grid_dir, list(dists))
    size = 1
    for d in dists.values():
        size *= len(d.choices)
    missing = size - len(rows)
    if missing:
        print(f"error: {a.grid_dir}: {len(rows)} rows, the preset's space has {size}",
              file=sys.stderr)
        return 2
    ok = {k: v for k, v in rows.items() if v[0] == "ok" and v[1] is not None}
    target = max(ok, key=lambda k: ok[k][1])
    print(f"grid: {size} configurations, {len(ok)} ok; fastest: "
          f"{' '.join(f'{k}={v}' for k, v in zip(dists, target))} ({ok[target][1]:,.0f} "
          f"tokens/s)")
    dropped = [] if a.keep_unrunnable else unrunnable(dists, rows)
    n_space = 1
    for d in dists.values():
        n_space *= len(d.choices)
    if dropped:
        print(f"space: {n_space} configurations (precision {', '.join(dropped)} left out, as "
              "the sweeper leaves out what the grid's machine cannot run: every row skipped)")
    out = {"grid": str(a.grid_dir), "size": size, "space": n_space, "ok": len(ok),
           "seeds": a.seeds, "target": dict(zip(dists, target)), "samplers": {}}
    budget = 3 * size
    print(f"{'sampler':8} {'found':>7} {'configs median':>15} {'trials median':>14} "
          f"{'configs <= size/3':>18}   (within {budget} trials; '-': not found)")
    for name in a.samplers.split(","):
        res = [replay(name, s, dists, rows, target, budget) for s in range(a.seeds)]
        found = [(t, c) for t, c in res if t is not None]
        # (a seed that never found it counts as more than any that did)
        configs = [c if t is not None else float("inf") for t, c in res]
        trials = [t if t is not None else float("inf") for t, c in res]
        within = sum(c <= size / 3 for c in configs)
        out["samplers"][name] = {"trials": [t for t, _ in res],
                                 "configs": [c if t is not None else None for t, c in res],
                                 "found": len(found), "within_third": within}
        med_c, med_t = statistics.median(configs), statistics.median(trials)
        print(f"{name:8} {len(found):>3}/{a.seeds:<3} "
              f"{'-' if med_c == float('inf') else f'{med_c:g}':>15} "
              f"{'-' if med_t == float('inf') else f'{med_t:g}':>14} {within:>14}/{a.seeds}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
