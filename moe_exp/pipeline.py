"""One run, before and after Hydra: prepare (resolve the hardware, validate) -> run (in this
process, or launch its ranks) -> record. No command line here (cli.py)."""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .config import ConfigError, override_texts
from .ranks import rank_env
from .results import failed_record, new_record, write_json_atomic


def hydra_info() -> tuple[Path | None, list[str], dict, bool]:
    """(output dir, task overrides, group choices, is multirun) when run under Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None, [], {}, False
    hc = HydraConfig.get()
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")}
    return (Path(hc.runtime.output_dir), override_texts(hc.overrides.task), choices,
            hc.mode == RunMode.MULTIRUN)

def from_launch_dir(path: str) -> str:
    """A relative path from where the command was run: hydra.job.chdir=true moves the run into
    its output dir (unchanged otherwise, so the config hash is too)."""
    from hydra.core.hydra_config import HydraConfig

    if os.path.isabs(path) or not HydraConfig.initialized():
        return path
    start = HydraConfig.get().runtime.cwd
    return path if os.path.realpath(start) == os.getcwd() else os.path.join(start, path)

def prepare(cfg: DictConfig, overrides: list[str],
            in_sweep: bool = False) -> tuple[DictConfig, dict | None]:
    """Resolve the hardware and validate, before any work. Returns (cfg, None) when the run
    can go ahead, else (cfg, record) with status `invalid` (a mistake), `skipped` (a valid
    request this hardware cannot do) or `error` (this environment is not ready: NotReady).
    in_sweep: a sweep's job (validate.check_unread)."""
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
    """Run one benchmark; never raises for a run's failure: the record's status says it.
    shared_process: a later run of an in-process sweep (see bench.runner.shared_process).
    in_sweep: a sweep's job (validate.check_unread)."""
    hydra_dir, hydra_overrides, hydra_choices, _ = hydra_info()
    overrides = hydra_overrides if overrides is None else overrides
    choices = hydra_choices if choices is None else choices
    out_dir = Path(out_dir or hydra_dir or "outputs/run")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg, rec = prepare(cfg, overrides, in_sweep)
    planned = None
    if rec is None and cfg.task == "bench":
        planned, rec = preflight_plan(cfg, overrides)
    if rec is not None:
        if (env := rank_env()) and env.rank != 0:  # torchrun's other ranks: rank 0 reports
            return rec
        write_json_atomic(out_dir / "metrics.json", rec)
        print(f"error: {rec['error']}", file=sys.stderr)
        log_record(rec)
        return rec

    from .hardware import hardware_env

    with hardware_env(cfg.hardware):
        try:
            rec = _run(cfg, out_dir, overrides, choices, progress, shared_process, planned)
        except KeyboardInterrupt:  # Ctrl-C / SIGTERM: the record it wrote, into run.log too
            with contextlib.suppress(OSError, ValueError, KeyError):
                done = json.loads((out_dir / "metrics.json").read_text())
                if done["status"] == "crashed" and "interrupted" in (done["error"] or ""):
                    log_record(done)
            raise
    if rec is not None:
        log_record(rec)
    return rec

def preflight_plan(cfg, overrides) -> tuple[dict, dict | None]:
    """A bench run's plan (train.plan: its keys for the record), and a `skipped` record
    where its planned peak cannot fit the memory (else None)."""
    from .plan.runner import bench_plan, too_big

    planned = bench_plan(cfg)
    if not (why := too_big(cfg, planned)):
        return planned, None
    rec = failed_record(container(cfg), overrides, "skipped", why, "not run: skipped")
    rec.update({k: v for k, v in planned.items() if k != "null_reasons"})
    return planned, rec


def log_record(rec: dict) -> None:
    """The record's gist into the run's log (Hydra's run.log; the terminal has the table)."""
    import logging

    log = logging.getLogger("moe_exp")
    log.info("overrides: %s", " ".join(rec.get("overrides") or []) or "(none)")
    log.info("status: %s%s", rec["status"], f": {rec['error']}" if rec.get("error") else "")
    if rec["status"] == "ok" and (rec.get("tokens_per_s") is not None  # a bench (not comm)
                                  or rec.get("task") == "plan"):
        if rec.get("task") == "infer":
            from .infer.runner import summary_rows
        elif rec.get("task") == "plan":
            from .plan.runner import summary_rows
        else:
            from .summary import summary_rows
        for label, text in summary_rows(rec):
            log.info("%s: %s", label, text)

def distributed_run(cfg) -> bool:
    """Whether the run has ranks (launched here, or started by torchrun / SLURM)."""
    return cfg.parallel.name != "none" or cfg.hardware.devices > 1 or cfg.task == "comm"

def _run(cfg: DictConfig, out_dir: Path, overrides, choices, progress,
         shared_process: bool = False, planned: dict | None = None) -> dict | None:
    cfg_dict = container(cfg)
    if cfg.task == "tune_batch":  # (its probes are runs of their own, with their ranks)
        from .bench.tune import tune_batch

        return tune_batch(cfg, cfg_dict, out_dir, overrides, progress)
    if cfg.task == "infer":  # (one device: validate refuses ranks)
        from .infer.runner import infer

        return infer(cfg, cfg_dict, new_record(cfg_dict, overrides), out_dir, choices, progress)
    if cfg.task == "plan":  # (no ranks: a plan traces one device)
        from .plan.runner import plan

        return plan(cfg, cfg_dict, new_record(cfg_dict, overrides), out_dir, choices)
    if distributed_run(cfg):
        from .distributed import is_rank

        if is_rank():  # started by torchrun / SLURM: this process is one of the ranks
            return rank_main(cfg_dict, str(out_dir), overrides, choices, progress,
                             planned=planned)
        return launch(cfg_dict, out_dir, overrides, choices, progress, planned)

    from .bench.runner import bench

    rec = _planned_record(cfg_dict, overrides, planned)
    return bench(cfg, cfg_dict, rec, out_dir, choices, progress, shared=shared_process)

def _planned_record(cfg_dict: dict, overrides, planned: dict | None) -> dict:
    """A new record with the run's plan in it (preflight_plan)."""
    rec = new_record(cfg_dict, overrides)
    if planned:
        rec.update({k: v for k, v in planned.items() if k != "null_reasons"})
        rec["null_reasons"].update(planned["null_reasons"])
    return rec

def launch(cfg_dict: dict, out_dir: Path, overrides, choices, progress,
           planned: dict | None = None) -> dict:
    """hardware.devices ranks on this machine via torch's elastic agent; rank 0's record.
    A rank that fails stops them all; the record names it (status error, oom, or crashed:
    killed by a signal)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .bench.memory import oom_line, oom_text
    from .distributed import (failure_message, failure_report, killed_by_signal,
                              launch as elastic, rank_entry)

    try:
        rec = elastic(rank_entry, cfg_dict["hardware"]["devices"], rank_main, cfg_dict,
                      str(out_dir), overrides, choices, progress, True, planned)
    except ChildFailedError as e:
        (out_dir / "error.log").write_text(failure_report(e))
        msg = failure_message(e)
        oom = oom_text(msg)
        msg = f"{oom_line(msg) if oom else msg} (see {out_dir}/error.log)"
        status = "oom" if oom else "crashed" if killed_by_signal(e) else "error"
        rec = failed_record(cfg_dict, overrides, status, msg, f"not measured: run {status}")
        if cfg_dict.get("task", "bench") == "bench":
            _known_before_the_run(rec, cfg_dict, planned)
        write_json_atomic(out_dir / "metrics.json", rec)
        print(f"error: run {rec['status']}: {msg}\nrecord: {out_dir / 'metrics.json'}",
              file=sys.stderr)
    return rec

def _known_before_the_run(rec: dict, cfg_dict: dict, planned: dict | None = None) -> None:
    """What a failed launch's record still knows (analytic, or of this process): parameter
    counts, FLOPs per token, the torch version, the plan."""
    import torch

    from .bench.flops import analytic

    known = {**analytic(OmegaConf.create(cfg_dict["model"]), cfg_dict["train"]["seq_len"]),
             "torch_version": torch.__version__,
             **{k: v for k, v in (planned or {}).items()
                if k != "null_reasons" and v is not None}}
    rec.update(known)
    for k in known:
        rec["null_reasons"].pop(k, None)

def rank_main(cfg_dict: dict, out_dir: str, overrides, choices, progress,
              launched_here: bool = False, planned: dict | None = None) -> dict | None:
    """One rank: join the group, run the task, leave. Rank 0 returns the record.
    launched_here: by `launch` (which records a failure), not by torchrun / SLURM.
    planned: the run's plan (preflight_plan)."""
    from . import distributed

    parent = os.getppid()  # (launched here: the process that runs launch)
    cfg = OmegaConf.create(cfg_dict)
    d = distributed.init(cfg)
    d.launched_here = launched_here
    try:
        rec = _planned_record(cfg_dict, overrides, planned)
        if cfg.task == "comm":
            from .bench.comm import comm_bench

            rec = comm_bench(cfg, cfg_dict, rec, Path(out_dir), choices, d)
        else:
            from .bench.runner import bench

            rec = bench(cfg, cfg_dict, rec, Path(out_dir), choices, progress, d)
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
