"""One sweep job: validate it, run it in its own process, return a record whatever happens.

cli.main calls it under -m. A job never raises, so Hydra always reaches `on_multirun_end`.

Layout of <sweep dir>/<job num>/: metrics.json, and with sweep.repeats=N a rep<i>/metrics.json
per repeat beside the combined record; job.log, the child's output; job.json, the resolved
config the child ran.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from pathlib import Path

from omegaconf import OmegaConf

from ..config import override_texts
from ..results import (config_hash, failed_record, why_died, hold_sigint, release_sigint,
                       row_key, stop_signal, write_json_atomic)
from ..hydra_internals import is_search
from .live import sweep_group
from .search import trial_values
from .table import DONE, combine, read_record


CACHE_ENV = "MOE_EXP_JOB_CACHE"  # a job's compile-cache dir: child.py removes it on exit


def run_job(cfg) -> dict:
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    job_dir, sweep_dir = Path(hc.runtime.output_dir), Path(hc.sweep.dir)
    overrides = override_texts(hc.overrides.task)
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")}
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    if cfg.logger.group is None:
        cfg.logger.group = sweep_group(cfg, sweep_dir)
    try:
        rec = _run_job(cfg, job_dir, sweep_dir, overrides, choices, hc.job.num)
    except Exception as e:  # noqa: BLE001 - a job must not raise (Hydra would drop the table)
        with contextlib.suppress(OSError):  # (a full disk: the record below says it)
            (job_dir / "error.log").write_text(traceback.format_exc())
        from ..pipeline import container

        rec = failed_record(container(cfg), overrides, "error",
                            f"{type(e).__name__}: {e}"[:300], "not measured: job error")
    rec["job"] = hc.job.num
    try:
        write_json_atomic(job_dir / "metrics.json", rec)
    except OSError as e:  # a full or read-only disk: no job after this one gets a row either
        from .table import write_error_line

        print(f"error: {write_error_line(e)}: the sweep stops here (the jobs before this "
              f"one keep their records: python -m moe_exp.report {sweep_dir} remakes the table "
              "once there is room)", file=sys.stderr, flush=True)
        raise SystemExit(1) from None  # (Hydra passes SystemExit on: cli.EXIT_FAILED)
    if is_search(hc.sweeper):  # Optuna's sweeper learns from values (or a failed trial)
        return trial_values(rec, sweep_dir, cfg.sweep)
    return rec


def _run_job(cfg, job_dir: Path, sweep_dir: Path, overrides, choices, num: int) -> dict:
    from ..pipeline import container, log_record, prepare

    s = cfg.sweep
    cfg, rec = prepare(cfg, overrides, in_sweep=True)
    set_aside(job_dir, row_key(rec if rec is not None else key_record(container(cfg))))
    if rec is not None:  # invalid or skipped: no process started
        print(f"[sweep] job #{num}: {rec['status']}: {rec['error']}", file=sys.stderr)
        log_record(rec)
        return rec
    cfg_dict = container(cfg)
    t0 = time.time()
    try:
        return _repeats(cfg, cfg_dict, job_dir, sweep_dir, overrides, choices, num)
    except KeyboardInterrupt as e:  # Ctrl-C: the sweep stops; this job is a row that says so
        from .live import update_table

        held = hold_sigint()
        try:  # the run's own record where it wrote one (in this process: the steps it did)
            rec = _interrupted_record(job_dir, t0) or failed_record(
                cfg_dict, overrides, "crashed",
                f"interrupted ({stop_signal(e)}): the sweep stopped during this job",
                "not measured: interrupted")
            rec["job"] = num
            write_json_atomic(job_dir / "metrics.json", rec)
            update_table(sweep_dir, s)
        finally:
            release_sigint(held)
        raise


def _repeats(cfg, cfg_dict: dict, job_dir: Path, sweep_dir: Path, overrides, choices,
             num: int) -> dict:
    """The job's sweep.repeats runs, or the records a resume finds for them; the job's record."""
    from ..pipeline import log_record

    s = cfg.sweep
    pool = finished_records(sweep_dir, row_key(key_record(cfg_dict)), job_dir) \
        if s.resume else []
    reps = []
    for i in range(s.repeats):
        rdir = job_dir / f"rep{i}" if s.repeats > 1 else job_dir
        if s.vary_init:  # this repeat's init seed (unhashed: the same row)
            cfg, cfg_dict = _init_offset(cfg, cfg_dict, i)
        if pool:
            path, prev = pool.pop(0)
            if path != rdir / "metrics.json":
                prev = {**prev, "resumed_from": str(path)}
                write_json_atomic(rdir / "metrics.json", prev)
            print(f"[sweep] job #{num}: already done ({prev['status']}, {path}); skipped by "
                  "sweep.resume", file=sys.stderr)
            reps.append(prev)
            continue
        if s.isolate:
            rec = run_child(cfg_dict, overrides, choices, rdir, s)
            log_record(rec)  # into this job's run.log (the child has no log file)
        else:
            from ..pipeline import ranked, run

            global _RUNS_HERE
            # a later run in this process (a run with ranks: those are fresh processes,
            # their figures are theirs)
            shared = _RUNS_HERE > 0 and not ranked(cfg)
            rec = run(cfg, out_dir=rdir, progress=sys.stderr.isatty(), overrides=overrides,
                      choices=choices, shared_process=shared, in_sweep=True)
            _RUNS_HERE += 1
        rec.update(repeat=i, repeats=s.repeats)
        write_json_atomic(rdir / "metrics.json", rec)
        if s.isolate and rec["status"] == "crashed":  # (a child that ran to its end said so
            # itself; one whose record could not be written either: run_job says that)
            print(f"[sweep] job #{num}: crashed: {rec['error']}", file=sys.stderr)
        reps.append(rec)
    return reps[0] if s.repeats == 1 else combine(reps)


def _init_offset(cfg, cfg_dict: dict, i: int):
    """sweep.vary_init: the run's config with sweep.init_offset = i."""
    from omegaconf import OmegaConf

    cfg = cfg.copy()
    OmegaConf.update(cfg, "sweep.init_offset", i)
    return cfg, {**cfg_dict, "sweep": {**cfg_dict["sweep"], "init_offset": i}}


_RUNS_HERE = 0  # runs of an in-process sweep (sweep.isolate=false) made by this process


def _interrupted_record(job_dir: Path, since: float) -> dict | None:
    """The newest record a run of this job wrote on Ctrl-C after `since`: crashed, interrupted."""
    found = [(t, r) for p in [job_dir / "metrics.json", *job_dir.glob("rep*/metrics.json")]
             if p.is_file() and (t := p.stat().st_mtime) >= since
             and (r := read_record(p)) is not None and r.get("status") == "crashed"
             and "interrupted" in str(r.get("error"))]
    return max(found, key=lambda x: x[0])[1] if found else None


def key_record(cfg_dict: dict) -> dict:
    """The parts of a record row_key reads, from a job's config."""
    return {"config_hash": config_hash(cfg_dict), "extra": dict(cfg_dict.get("extra") or {})}


def set_aside(job_dir: Path, key: tuple) -> Path | None:
    """Moves another configuration's records out of job_dir, before this job writes there.

    A resumed sweep numbers its jobs anew, so with other values job_dir may hold another
    configuration's records. They move to <num>-<their config hash> beside it, where the
    table and a later resume still find them. The job-level record moves last, so a move cut
    short is found and finished next time. Returns where they went, or None."""
    prev = next((r for p in [job_dir / "metrics.json", *sorted(job_dir.glob("rep*/metrics.json"))]
                 if (r := read_record(p)) is not None), None)
    if prev is None or row_key(prev) == key:
        return None
    base = f"{job_dir.name}-{prev.get('config_hash') or 'other'}"
    dest, i = job_dir.parent / base, 2
    while dest.exists():
        dest, i = job_dir.parent / f"{base}-{i}", i + 1
    dest.mkdir()
    for p in sorted(job_dir.iterdir(), key=lambda p: p.name == "metrics.json"):
        if p.name == ".hydra":  # (Hydra has written this job's over the old one's)
            continue
        if p.name == "run.log":  # Hydra's open log of this job: copied, then emptied
            shutil.copy2(p, dest / p.name)
            with open(p, "r+") as f:
                f.truncate(0)
            continue
        shutil.move(str(p), str(dest / p.name))
    if (moved := read_record(dest / "metrics.json")) is not None:  # its row is named so
        write_json_atomic(dest / "metrics.json", {**moved, "job": dest.name})
    print(f"[sweep] {job_dir} held another configuration's records: moved to {dest}",
          file=sys.stderr)
    return dest


def finished_records(sweep_dir: Path, key: tuple, job_dir: Path) -> list[tuple[Path, dict]]:
    """Per-run records of this row, by results.row_key, with a finished status; this job's first."""
    found = []
    for p in sorted(Path(sweep_dir).glob("*/metrics.json")) + \
            sorted(Path(sweep_dir).glob("*/rep*/metrics.json")):
        rec = read_record(p)
        if rec and row_key(rec) == key and rec.get("status") in DONE \
                and not rec.get("combined"):
            found.append((p, rec))
    found.sort(key=lambda pr: job_dir not in pr[0].parents)
    return found


def run_child(cfg_dict: dict, overrides, choices, out_dir: Path, s) -> dict:
    """`python -m moe_exp.sweep.child` on this job; a process that dies is a `crashed` row."""
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = out_dir / "metrics.json"
    metrics.unlink(missing_ok=True)
    spec = out_dir / "job.json"
    # progress on: of a job killed at sweep.job_timeout_s or by a signal, its bar, every 10 s
    # off a terminal, is all that job.log holds
    write_json_atomic(spec, {"config": cfg_dict, "overrides": overrides, "choices": choices,
                             "progress": True})
    from ..hardware import env_for

    env = {**os.environ, **env_for(cfg_dict["hardware"])}  # set from its start
    cache = None
    if s.fresh_compile_cache:  # this job's compile time is its own, not a cache hit
        cache = tempfile.mkdtemp(prefix="moe_exp_compile_")
        env.update(TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"),
                   **{CACHE_ENV: cache})  # (the child removes it too: see child.py)
    tail: deque = deque(maxlen=40)
    cmd = [sys.executable, "-m", "moe_exp.sweep.child", str(spec)]
    with open(out_dir / "job.log", "wb", buffering=0) as log:  # (nothing left to fail at close)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # its own group: killed as a whole
        reader = threading.Thread(target=_forward, args=(proc.stdout, log, tail), daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=s.job_timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(proc)
        except BaseException:  # Ctrl-C: take the child down with the sweep
            _kill(proc)
            raise
        finally:
            reader.join(timeout=10)
            if cache:
                shutil.rmtree(cache, ignore_errors=True)
    rec = read_record(metrics)
    if rec is not None and not timed_out:
        return rec
    lines = [ln for ln in b"".join(tail).decode(errors="replace").replace("\r", "\n")
             .splitlines() if ln.strip()]
    why = (f"was killed after sweep.job_timeout_s={s.job_timeout_s:g} s" if timed_out
           else why_died(proc.returncode))
    last = f": {lines[-1].strip()[:200]}" if lines and not timed_out else ""
    return failed_record(cfg_dict, overrides, "crashed",
                         f"job process {why}{last} (see {out_dir}/job.log)",
                         "not measured: the job's process died")


def remeasure_loaded(sweep_dir: Path, s) -> int:
    """sweep.remeasure_loaded: each ok run of the sweep measured under other processes' CPU
    load runs once more, from its job.json. A new ok record replaces the old, which is kept
    as metrics.loaded.json (.2.json and on after a later re-measure); a failed one leaves
    the old in place. Returns the runs re-run."""
    from ..bench.load import busy
    from .table import job_dirs

    n = 0
    for d in job_dirs(sweep_dir):
        paths = sorted(d.glob("rep*/metrics.json"), key=lambda p: int(p.parent.name[3:])
                       if p.parent.name[3:].isdigit() else 0) or [d / "metrics.json"]
        redone = False
        for p in paths:
            old = read_record(p)
            if old is None or old.get("status") != "ok" or \
                    not busy(load := old.get("cpu_other_load")):
                continue
            spec = p.parent / "job.json"
            if not spec.is_file():  # (reused from another dir, or run in-process)
                print(f"[sweep] job #{d.name}: measured under {load:.0%} other CPU load, "
                      f"but {spec} is gone: not measured again", file=sys.stderr)
                continue
            print(f"[sweep] job #{d.name}{'' if p.parent == d else ' ' + p.parent.name}: "
                  f"measured under {load:.0%} other CPU load: measuring it again",
                  file=sys.stderr, flush=True)
            sp = load_spec(spec)
            new = run_child(sp["config"], sp["overrides"], sp["choices"],
                            p.parent / "remeasured", s)
            n += 1
            if new.get("status") != "ok":
                print(f"[sweep] job #{d.name}: the second run ended {new['status']} "
                      f"({new.get('error')}): the first record stays", file=sys.stderr)
                continue
            new.update({k: old.get(k) for k in ("job", "repeat", "repeats") if k in old})
            kept, i = p.with_name("metrics.loaded.json"), 2
            while kept.exists():  # (an earlier re-measure's: kept too)
                kept, i = p.with_name(f"metrics.loaded.{i}.json"), i + 1
            shutil.copy2(p, kept)  # (then the row's record replaced at once: never absent)
            write_json_atomic(p, new)
            redone = True
            now = new.get("cpu_other_load")
            print(f"[sweep] job #{d.name}: {old.get('tokens_per_s') or 0:,.0f} -> "
                  f"{new.get('tokens_per_s') or 0:,.0f} tokens/s (other load "
                  f"{load:.0%} -> {'?' if now is None else f'{now:.0%}'})", file=sys.stderr)
        if redone and paths[0].parent != d:  # repeats: the job's row combines them anew
            job = read_record(d / "metrics.json") or {}
            write_json_atomic(d / "metrics.json", {**combine([read_record(p) for p in paths]),
                                                   "job": job.get("job")})
    return n


def _forward(stream, log, tail: deque) -> None:
    out = getattr(sys.stdout, "buffer", None)
    for chunk in iter(lambda: stream.read1(65536), b""):
        if log is not None:
            try:
                log.write(chunk)
            except OSError:  # a full disk: job.log stops (the record, or its failure, says
                log = None  # why), the terminal still gets the output
        tail.append(chunk)
        try:
            if out:
                out.write(chunk)
                out.flush()
            else:
                sys.stdout.write(chunk.decode(errors="replace"))
        except (OSError, ValueError):
            pass


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def load_spec(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
