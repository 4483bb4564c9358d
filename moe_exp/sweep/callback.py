"""Hydra callback of every multirun: progress, the table after each job, the report at the end.

Progress is job k of n, its combination, the time elapsed and the time left. The table is
rebuilt after each job, so an interrupted sweep keeps its rows. At the end come the printed
table, plots, report.md and the W&B summary run."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from omegaconf.errors import InterpolationResolutionError

from ..config import override_texts
from ..hydra_internals import is_search, plan
from .live import baseline_of, sweep_group, update_table
from .search import direction_error
from .table import read_record


# set at the end of a multirun where no job finished ok: `python -m moe_exp.run -m` exits 1
NO_JOB_OK = False
HELD: list = []  # (callback, sweep dir) of the sweeps this process holds the lock of


def no_job_ok() -> bool:
    """Whether the last multirun of this process ended with no job ok; cli then exits 1."""
    return NO_JOB_OK


def _jobs(n: int) -> str:
    return f"{n} job{'s' * (n != 1)}"


def _fmt_s(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def reused(rec, job_t0: float) -> bool:
    """Whether the record is from before the job started: sweep.resume reused it, nothing ran."""
    import datetime as dt

    try:
        start = dt.datetime.fromisoformat(rec["timestamp"]).timestamp()
    except (TypeError, KeyError, ValueError):  # no record, or no time in it
        return False
    return start < job_t0 - 2  # (the record's time is in whole seconds)


class SweepCallback(Callback):
    def __init__(self) -> None:
        self.total, self.varying, self.search = None, [], False
        self.t0 = self.job_t0 = time.time()
        self.ran: list[float] = []  # durations of jobs that did run (not resumed/skipped)
        self.finished = 0
        self.active = False  # single runs call on_job_start/end too: nothing to do there
        self.lock = None  # the sweep dir's lock file (checks.claim_dir), held to the end

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global NO_JOB_OK
        NO_JOB_OK = False
        self.active = True
        jobs, swept = plan(config)
        self.search = is_search(config.hydra.sweeper)
        self.total = len(jobs) if jobs is not None else \
            (config.hydra.sweeper.n_trials if self.search else None)
        # (a search's trials draw from its sweeper's params: each job's progress line names them)
        self.varying = list(swept) or [str(k) for k in config.hydra.sweeper.get("params") or {}]
        from .checks import (SweepError, check_jobs, check_search, check_sweep, claim_dir,
                             resume_warning)

        launcher = str(config.hydra.launcher.get("_target_", ""))
        try:  # before any job
            if self.search and (line := direction_error(config.hydra.sweeper)) is not None:
                raise SweepError(line)
            if config.sweep.remeasure_loaded and (self.search or not config.sweep.isolate
                                                  or "submitit" in launcher):
                raise SweepError(
                    "sweep.remeasure_loaded: re-runs a grid sweep's jobs from their job.json, "
                    "in this process's launcher: not with +sweep=search, sweep.isolate=false "
                    "or the submitit launcher")
            check_sweep(config, swept)
            if self.search:
                check_search(config)
            if jobs:  # (submitit: jobs resolve their hardware where they run)
                check_jobs(config, jobs, validate="submitit" not in launcher)
            self.lock = claim_dir(Path(config.hydra.sweep.dir))
            HELD.append((self, Path(config.hydra.sweep.dir)))
        except (SweepError, InterpolationResolutionError) as e:
            from ..hydra_internals import interpolation_error_line

            line = e if isinstance(e, SweepError) else interpolation_error_line(e, sys.argv[1:])
            print(f"error: {line}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None  # cli.EXIT_INVALID (Hydra passes SystemExit on)
        if warning := resume_warning(config):
            print(warning, file=sys.stderr, flush=True)
        self.t0 = time.time()
        n = _jobs(self.total) if self.total else "jobs"
        print(f"[sweep] {n} -> {config.hydra.sweep.dir}", flush=True)
        if "submitit" in launcher:  # jobs run elsewhere: their callbacks too
            print("[sweep] submitit launcher: each job's progress is in its own log "
                  "(hydra.launcher.submitit_folder); the table is updated as jobs finish",
                  flush=True)
        if launcher.endswith("submitit_launcher.LocalLauncher") and self.total != 1:
            print("[sweep] warning: submitit_local starts every job at once on this machine: "
                  "they share its cores and memory, so their timings interfere; the default "
                  "launcher runs one job at a time", file=sys.stderr, flush=True)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.active:
            return
        self.job_t0 = time.time()
        num = config.hydra.job.num
        items = dict(o.split("=", 1) for o in override_texts(config.hydra.overrides.task)
                     if "=" in o)
        combo = " ".join(f"{k}={items[k]}" for k in self.varying if k in items) or "(no sweep)"
        elapsed = time.time() - self.t0
        left = self.total - self.finished if self.total else None
        eta = (f"~{_fmt_s(sum(self.ran) / len(self.ran) * left)} left" if self.ran and left
               else "time left: after the first job that runs")
        of = f"/{self.total}" if self.total else ""
        from ..screen import wrapped

        print(wrapped(f"[sweep] job {num + 1}{of} (#{num}) · {combo} · elapsed "
                      f"{_fmt_s(elapsed)} · {eta}"), flush=True)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if not self.active:  # a single run; or a job whose launcher runs it in another
            # process (submitit): there only the table is ours to keep current
            if _is_sweep_job(config):
                _update_table(config)
            return
        self.finished += 1
        rec = job_return._return_value if hasattr(job_return, "_return_value") else None
        if not isinstance(rec, dict):  # a search trial's values (or its failure): the record
            rec = read_record(Path(config.hydra.runtime.output_dir) / "metrics.json")
        status = rec.get("status", "?") if isinstance(rec, dict) else "error"
        dt = time.time() - self.job_t0
        if status not in ("invalid", "skipped") and not reused(rec, self.job_t0):
            self.ran.append(dt)
        if self.search:
            print(_trial_line(config.hydra.job.num, self.total, rec, status), flush=True)
        _update_table(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from .report import report
        from .table import collect

        sweep_dir = Path(config.hydra.sweep.dir)
        if config.sweep.remeasure_loaded:
            from .job import remeasure_loaded

            if remeasure_loaded(sweep_dir, config.sweep):
                _update_table(config)
        counts: dict[str, int] = {}
        # the table's records (a job's callbacks may have run in another process)
        records = collect(sweep_dir, warn=False, keep=True)  # (the report names bad files)
        for r in records:
            counts[r.get("status", "?")] = counts.get(r.get("status", "?"), 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        jobs = self.total or len(records)
        rows = "" if jobs == len(records) else f" (the table: {len(records)} rows, " + (
            "one per configuration the search drew, with the sweep dir's others)"
            if self.search else "with the sweep dir's other configurations)")
        print(f"[sweep] done: {_jobs(jobs)} in {_fmt_s(time.time() - self.t0)}{rows}"
              f"{': ' + summary if summary else ''}", flush=True)
        if records and not counts.get("ok"):
            global NO_JOB_OK
            NO_JOB_OK = True
            print("[sweep] no job finished ok: see the table's status and error columns "
                  "(exit status 1)", file=sys.stderr, flush=True)
        try:
            report(sweep_dir, baseline=baseline_of(config.sweep),
                   by=list(config.sweep.baseline_by),
                   wandb_cfg=config.logger if config.logger.name == "wandb" else None,
                   group=config.logger.get("group") or sweep_group(config, sweep_dir),
                   title=f"Sweep {config.sweep.name or sweep_dir}")
        except OSError as e:  # a full or read-only disk: the table after the last job stays
            from .table import write_error_line

            print(f"error: {write_error_line(e)} (every job's record is in its dir: python "
                  f"-m moe_exp.report {sweep_dir} makes the table once there is room)",
                  file=sys.stderr, flush=True)
            raise SystemExit(1) from None  # (Hydra passes SystemExit on: cli.EXIT_FAILED)
        finally:
            self.release(sweep_dir)

    def release(self, sweep_dir: Path) -> None:
        """Removes the ended sweep's lock files.

        .results.lock goes first: only this sweep's jobs take it, as its .sweep.lock keeps
        other sweeps out, and they have ended. Then .sweep.lock, removed while still held: a
        sweep that opened it just before and locks it after finds the file gone and opens a
        new one (checks.claim_dir), so no two sweeps ever hold the dir. An interrupted sweep
        leaves them, which is harmless: a lock is the flock on an open file, which ends with
        the process, not the file."""
        if self.lock is None:
            return
        try:
            for name in (".results.lock", ".sweep.lock"):
                (sweep_dir / name).unlink(missing_ok=True)
        except OSError:  # (a read-only dir: they stay, harmless)
            pass
        finally:
            self.lock.close()
            self.lock = None


def release_held() -> None:
    """Remove the lock files of the sweeps this process holds: at its exit, however it ends."""
    while HELD:
        callback, sweep_dir = HELD.pop()
        callback.release(sweep_dir)


def _trial_line(num: int, total, rec, status: str) -> str:
    """A search's one line per trial: its status and the two values the study reads."""
    from .table import cell_text

    rec = rec if isinstance(rec, dict) else {}
    got = f": {cell_text(rec.get('tokens_per_s'), ',.0f')} tokens/s, peak " \
        f"{cell_text(rec.get('peak_mem_gib'), '.3f')} GiB" if status == "ok" else \
        f": {str(rec.get('error') or '')[:100]}" if rec.get("error") else ""
    return f"[search] trial {num + 1}{f'/{total}' if total else ''} {status}{got}"


def _is_sweep_job(config: DictConfig) -> bool:
    from hydra.types import RunMode

    return config.hydra.get("mode") == RunMode.MULTIRUN


def _update_table(config: DictConfig) -> None:
    update_table(Path(config.hydra.sweep.dir), config.sweep)
