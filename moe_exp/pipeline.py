"""One run, before and after Hydra: prepare, then run, then record.

prepare resolves the hardware and validates; the run is in this process or on ranks it
launches. The command line is in cli.py."""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .config import ConfigError, nothing_left, override_texts, typed
from .ranks import rank_env
from .results import failed_record, write_json_atomic


def hydra_info() -> tuple[Path | None, list[str], dict, bool]:
    """Hydra's output dir, task overrides, group choices and multirun flag; empty without it."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None, [], {}, False
    hc = HydraConfig.get()
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")}
    return (Path(hc.runtime.output_dir), override_texts(hc.overrides.task), choices,
            hc.mode == RunMode.MULTIRUN)

def from_launch_dir(path: str) -> str:
    """A relative path given from where the command was run, made valid in the run's cwd.

    hydra.job.chdir=true moves the run into its output dir. Otherwise the path is left
    unchanged, and so is the config hash."""
    from hydra.core.hydra_config import HydraConfig

    if os.path.isabs(path) or not HydraConfig.initialized():
        return path
    start = HydraConfig.get().runtime.cwd
    return path if os.path.realpath(start) == os.getcwd() else os.path.join(start, path)

def prepare(cfg: DictConfig, overrides: list[str],
            in_sweep: bool = False) -> tuple[DictConfig, dict | None]:
    """Resolve the hardware and validate, before any work.

    Returns (cfg, None) when the run can go ahead, else (cfg, record). The record's status
    is `invalid` for a mistake, `skipped` for a valid request this hardware cannot do, or
    `error` for NotReady: this environment is not ready. in_sweep marks a sweep's job, for
    validate.check_unread."""
    from .config import NotReady, Unsupported
    from .hardware import resolve
    from .validate import check_complete, check_resolves, validate

    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    try:
        check_resolves(cfg)
        check_complete(cfg)
        if not OmegaConf.is_missing(cfg.data, "path") and isinstance(cfg.data.path, str):
            cfg.data.path = from_launch_dir(os.path.expanduser(cfg.data.path))  # ~/corpus.bin
        if isinstance(cfg.hardware.get("comm_from"), str):  # (a task=comm record's path)
            cfg.hardware.comm_from = from_launch_dir(os.path.expanduser(cfg.hardware.comm_from))
        resolve(cfg)
        validate(cfg, overrides, in_sweep)
    except ConfigError as e:
        status = "skipped" if isinstance(e, Unsupported) else \
            "error" if isinstance(e, NotReady) else "invalid"
        return cfg, failed_record(container(cfg), overrides, status, str(e), f"not run: {status}")
    return cfg, None

def run(cfg: DictConfig, out_dir: Path | None = None, progress: bool = True,
        overrides: list[str] | None = None, choices: dict | None = None,
        shared_process: bool = False, in_sweep: bool = False) -> dict:
    """Run one configuration; a run's failure does not raise, the record's status says it.

    shared_process marks a later run of an in-process sweep, as tasks.bench.shared_process
    handles. in_sweep marks a sweep's job, for validate.check_unread."""
    hydra_dir, hydra_overrides, hydra_choices, _ = hydra_info()
    overrides = hydra_overrides if overrides is None else overrides
    choices = hydra_choices if choices is None else choices
    out_dir = Path(out_dir or hydra_dir or "outputs/run")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg, rec = prepare(cfg, overrides, in_sweep)
    if rec is None:
        rec = _time_split(cfg, overrides)
    cfg_dict, asked, known = container(cfg), None, {}
    if rec is None:
        asked = typed(cfg_dict)
        known, rec = preflight(asked, cfg_dict, overrides)
    if rec is not None:
        if (env := rank_env()) and env.rank != 0:  # torchrun's other ranks: rank 0 reports
            return rec
        write_json_atomic(out_dir / "metrics.json", rec)
        print(rec["error"] if nothing_left(rec) else f"error: {rec['error']}", file=sys.stderr)
        log_record(rec)
        return rec

    from .hardware import hardware_env

    with hardware_env(cfg.hardware):
        try:
            rec = _run(asked, cfg_dict, out_dir, overrides, choices, progress,
                       shared_process, known)
        except KeyboardInterrupt:  # Ctrl-C / SIGTERM: the record it wrote, into run.log too
            with contextlib.suppress(OSError, ValueError, KeyError):
                done = json.loads((out_dir / "metrics.json").read_text())
                if done["status"] == "crashed" and "interrupted" in (done["error"] or ""):
                    log_record(done)
            raise
    if rec is not None:
        log_record(rec)
    return rec


def _time_split(cfg, overrides) -> dict | None:
    """parallel.pp_balance=time's split, resolved once the run is valid (a sweep's checks
    do not plan it); an `invalid` record where the plan cannot time a block."""
    from .plan.blocks import resolve_split

    try:
        resolve_split(cfg)
    except ConfigError as e:
        return failed_record(container(cfg), overrides, "invalid", str(e), "not run: invalid")
    return None


def preflight(cfg, cfg_dict: dict, overrides) -> tuple[dict, dict | None]:
    """What the task knows before any work, and a `skipped` record where it cannot go ahead.

    For task=bench, what it knows is its plan. The record is None where the run can go
    ahead. cfg is typed, as asked."""
    from .tasks import TASKS

    known, why = TASKS[cfg.task].preflight(cfg)
    if not why:
        return known, None
    rec = failed_record(cfg_dict, overrides, "skipped", why, "not run: skipped")
    rec.update({k: v for k, v in known.items() if k != "null_reasons"})
    return known, rec


def log_record(rec: dict) -> None:
    """Write the record's gist into Hydra's run.log; the terminal has the table."""
    import logging

    from .tasks import TASKS

    log = logging.getLogger("moe_exp")
    log.info("overrides: %s", " ".join(rec.get("overrides") or []) or "(none)")
    log.info("status: %s%s", rec["status"], f": {rec['error']}" if rec.get("error") else "")
    task = TASKS.get(rec.get("task") or "bench")
    if rec["status"] == "ok" and task is not None:
        for label, text in task.summary_rows(rec):
            log.info("%s: %s", label, text)


def ranked(cfg) -> bool:
    """Whether the run has ranks, launched here or started by torchrun / SLURM."""
    from .tasks import TASKS

    return TASKS[cfg.task].ranked(cfg)


def _run(cfg, cfg_dict: dict, out_dir: Path, overrides, choices, progress,
         shared_process: bool = False, known: dict | None = None) -> dict | None:
    from .tasks import TASKS
    from .tasks.protocol import execute

    if ranked(cfg):
        from .distributed import is_rank

        if is_rank():  # started by torchrun / SLURM: this process is one of the ranks
            return rank_main(cfg_dict, str(out_dir), overrides, choices, progress,
                             known=known)
        return launch(cfg_dict, out_dir, overrides, choices, progress, known)
    ctx = context(cfg_dict, out_dir, overrides, choices, progress, cfg=cfg, known=known,
                  shared_process=shared_process)
    return execute(TASKS[ctx.cfg.task](ctx))


def context(cfg_dict: dict, out_dir: Path, overrides, choices, progress: bool = True,
            cfg=None, **kw):
    """The run's context for this process, with the MoE dispatch resolved for its device.

    cfg is the typed config, made from cfg_dict where not given. The dispatch is resolved
    only where the task builds the model here. A launcher of ranks makes no context, each
    rank does: a probe on a GPU would hold a CUDA context in the launcher."""
    from .tasks import TASKS
    from .tasks.protocol import RunContext

    cfg = cfg or typed(cfg_dict)
    task = TASKS[cfg.task]
    if task.here and task.model:
        from .hardware import torch_device
        from .optimizations.dispatch import resolve_model_dispatch

        resolve_model_dispatch(cfg, torch_device(cfg))
    return RunContext(cfg, cfg_dict, Path(out_dir), list(overrides), dict(choices),
                      progress, **kw)


def launch(cfg_dict: dict, out_dir: Path, overrides, choices, progress,
           known: dict | None = None) -> dict:
    """Launch hardware.devices ranks here with torch's elastic agent; returns rank 0's record.

    A rank that fails stops them all, and the record names it with status error, oom, or
    crashed where a signal killed it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .bench.memory import oom_line, oom_text
    from .distributed import (failure_message, failure_report, killed_by_signal,
                              launch as elastic, rank_entry)
    from .tasks import TASKS

    try:
        rec = elastic(rank_entry, cfg_dict["hardware"]["devices"], rank_main, cfg_dict,
                      str(out_dir), overrides, choices, progress, True, known,
                      fork=cfg_dict["hardware"]["device"] == "cpu" and  # (hardware.env's
                      not cfg_dict["hardware"].get("env"))  # variables: read by a start)
    except ChildFailedError as e:
        (out_dir / "error.log").write_text(failure_report(e))
        msg = failure_message(e)
        oom = oom_text(msg)
        msg = f"{oom_line(msg) if oom else msg} (see {out_dir}/error.log)"
        status = "oom" if oom else "crashed" if killed_by_signal(e) else "error"
        rec = failed_record(cfg_dict, overrides, status, msg, f"not measured: run {status}")
        before = TASKS[cfg_dict["task"]].known_before(typed(cfg_dict), known or {})
        rec.update(before)
        for k in before:
            rec["null_reasons"].pop(k, None)
        write_json_atomic(out_dir / "metrics.json", rec)
        print(f"error: run {rec['status']}: {msg}\nrecord: {out_dir / 'metrics.json'}",
              file=sys.stderr)
    return rec


def rank_main(cfg_dict: dict, out_dir: str, overrides, choices, progress,
              launched_here: bool = False, known: dict | None = None) -> dict | None:
    """One rank: join the group, run the task, leave. Rank 0 returns the record.

    launched_here: started by `launch`, which records a failure, not by torchrun / SLURM.
    known: what the task knew before the run, from preflight."""
    from . import distributed
    from .tasks import TASKS
    from .tasks.protocol import execute

    parent = os.getppid()  # (launched here: the process that runs launch)
    cfg = typed(cfg_dict)
    d = distributed.init(cfg)
    d.launched_here = launched_here
    try:
        ctx = context(cfg_dict, Path(out_dir), overrides, choices, progress, cfg=cfg, dist=d,
                      known=known or {})
        rec = execute(TASKS[ctx.cfg.task](ctx))
        return rec if d.main else None
    except BaseException as e:  # a SIGINT (Ctrl-C, or the launcher killed outright), or
        # what a collective raised when the other ranks stopped
        if launched_here and d.main:
            distributed.reword_for_vanished_launcher(Path(out_dir) / "metrics.json", parent,
                                                     distributed.vanish_wait(e))
        raise
    finally:
        distributed.finish()


def container(cfg) -> dict:
    """The config as a dict, resolved; where a ${...} does not resolve, that value null."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - e.g. ${bogus}: keep what resolves
        return _resolved(cfg)

def _resolved(node):
    from omegaconf import DictConfig, ListConfig

    if isinstance(node, ListConfig):
        keys = range(len(node))
    elif isinstance(node, DictConfig):
        keys = list(node.keys())
    else:
        return node
    out = [None] * len(keys) if isinstance(node, ListConfig) else {}
    for k in keys:
        try:
            out[k] = _resolved(node[k])
        except Exception:  # noqa: BLE001 - this value does not resolve (or is missing)
            out[k] = None
    return out
