"""A search trial's values for Optuna (`+sweep=search`): (tokens/s, peak GiB) of a row that
fits with its loss not judged bad; any other row raises TrialFailed, which the sweeper
tells Optuna as a failed trial (the row is in the table all the same)."""
from __future__ import annotations

from pathlib import Path


class TrialFailed(Exception):
    """A trial Optuna must not learn values from: the reason, one line."""


def is_search(sweeper) -> bool:
    """hydra.sweeper is the Optuna sweeper (+sweep=search's, or the plugin's own): its trials
    return values, not records, and its number of trials is the sampler's."""
    target = str(sweeper.get("_target_", ""))
    return "optuna" in target.lower() or target.endswith(".SearchSweeper")


DIRECTIONS = ["maximize", "minimize"]  # the trial's values: tokens/s, peak GiB


def direction_error(sweeper) -> str | None:
    """A search whose directions are not DIRECTIONS (the plugin's default is one,
    "minimize"): Optuna would fail every trial, or minimize tokens/s."""
    from omegaconf import ListConfig

    d = sweeper.get("direction")
    got = [getattr(x, "name", str(x))  # (the plugin's Direction enum, or its name)
           for x in (d if isinstance(d, (list, tuple, ListConfig)) else [d])]
    if got == DIRECTIONS:
        return None
    return (f"hydra.sweeper.direction: a search's trials return (tokens/s, peak GiB), so "
            f"[maximize, minimize], got {got}: add +sweep=search")


def trial_values(rec: dict, sweep_dir: Path, sweep=None) -> list[float]:
    """[tokens/s, peak GiB] of rec, or TrialFailed: not ok (oom, skipped: it does not fit;
    invalid, diverged, error, crashed), nothing measured, or its loss not ok against the
    baseline row of the sweep's table so far (loss_ok false; null where not judged; the
    sweep's own sweep.baseline and baseline_by)."""
    if rec.get("status") != "ok":
        raise TrialFailed(f"{rec.get('status')}: {str(rec.get('error') or '')[:200]}")
    tps, mem = rec.get("tokens_per_s"), rec.get("peak_mem_gib")
    if tps is None or mem is None:
        raise TrialFailed("no tokens/s or peak memory measured "
                          f"({(rec.get('null_reasons') or {}).get('peak_mem_gib', '')})")
    if loss_verdict(rec, sweep_dir, sweep) is False:
        raise TrialFailed("loss not ok: its held-out loss is worse than the baseline's "
                          "beyond the measured noise")
    return [float(tps), float(mem)]


def loss_verdict(rec: dict, sweep_dir: Path, sweep=None) -> bool | None:
    """rec's loss_ok in the table of the sweep dir's records (its own row included), with
    the sweep's baseline settings (`sweep`: cfg.sweep; None: the default baseline)."""
    from ..results import row_key
    from .answer import verdict
    from .live import baseline_of
    from .table import collect, sweep_table

    records = collect(sweep_dir, warn=False)
    if not any(row_key(r) == row_key(rec) for r in records):
        records.append(rec)
    base, by = (None, ["model"]) if sweep is None else \
        (baseline_of(sweep), list(sweep.baseline_by))
    df, _ = sweep_table(records, base, by)
    mine = [v for r, v in zip(records, df["loss_ok"]) if row_key(r) == row_key(rec)]
    return verdict(mine[0]) if mine else None
