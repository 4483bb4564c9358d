"""A search trial's values for Optuna under `+sweep=search`: tokens/s and peak GiB.

They are those of a row that fits with its loss not judged bad. Any other row raises
TrialFailed, which the sweeper tells Optuna as a failed trial; the row is in the table all
the same."""
from __future__ import annotations

from pathlib import Path


class TrialFailed(Exception):
    """A trial Optuna must not learn values from: the reason, one line."""


DIRECTIONS = ["maximize", "minimize"]  # the trial's values: tokens/s, peak GiB


def direction_error(sweeper) -> str | None:
    """One line for a search whose directions are not DIRECTIONS; None where they are.

    The plugin's default is one direction, "minimize": Optuna would fail every trial, or
    minimize tokens/s."""
    from omegaconf import ListConfig

    d = sweeper.get("direction")
    got = [getattr(x, "name", str(x))  # (the plugin's Direction enum, or its name)
           for x in (d if isinstance(d, (list, tuple, ListConfig)) else [d])]
    if got == DIRECTIONS:
        return None
    return (f"hydra.sweeper.direction: a search's trials return (tokens/s, peak GiB), so "
            f"[maximize, minimize], got {got}: add +sweep=search")


def trial_values(rec: dict, sweep_dir: Path, sweep=None) -> list[float]:
    """[tokens/s, peak GiB] of rec; else raises TrialFailed.

    It raises where the run is not ok: oom or skipped, which do not fit, or invalid,
    diverged, error, crashed. Also where nothing was measured, or where its loss is not ok
    against the baseline row of the sweep's table so far: loss_ok false, by the sweep's own
    sweep.baseline and baseline_by. A loss not judged passes."""
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
    """rec's loss_ok in the table of the sweep dir's records, its own row included.

    `sweep` is cfg.sweep, whose baseline settings the table takes; None for the default
    baseline."""
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
