"""A running sweep's shared state: its table, its baseline setting and its W&B group.

The table is kept current after each job, under a lock. The callback, the jobs, the checks
and the report use it; it sits below them all in the imports, so there is no cycle."""
from __future__ import annotations

import contextlib
from pathlib import Path

from omegaconf import DictConfig


def sweep_group(cfg, sweep_dir: Path) -> str:
    """W&B group of a sweep's runs: the preset name and the sweep dir's timestamp."""
    stamp = "_".join(n for n in (sweep_dir.parent.name, sweep_dir.name) if n)
    return f"{cfg.sweep.name or 'sweep'}-{stamp}"


def update_table(sweep_dir: Path, sweep: DictConfig) -> None:
    """Keep results.* current, so that an interrupted sweep still has its table.

    It runs under a lock, so jobs that end together, as under submitit, each write a table
    read after the other's."""
    try:
        from .table import collect, sweep_table, write_tables

        with _locked(sweep_dir / ".results.lock"):  # (a bad baseline key: the report at
            # the end says so)
            df, _ = sweep_table(collect(sweep_dir, warn=False, keep=True), baseline_of(sweep),
                                sweep.baseline_by)  # (the report at the end names bad files)
            write_tables(df, sweep_dir, title=f"Sweep {sweep.name or sweep_dir}")  # (the
            # report's title at the end)
    except Exception as e:  # noqa: BLE001
        from .table import write_error_line

        why = write_error_line(e) if isinstance(e, OSError) else e  # (a full disk)
        print(f"[sweep] could not update the table yet: {why}", flush=True)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive flock on `path`, created if need be.

    Where the sweep's end removed the file while this process waited
    (SweepCallback.release), it locks a new one."""
    import fcntl
    import os

    while True:
        f = open(path, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
            if os.fstat(f.fileno()).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:  # (removed: a new one)
            pass
        except OSError:  # a filesystem without locks: unguarded
            break
        f.close()
    try:
        yield f
    finally:
        f.close()


def baseline_of(sweep: DictConfig) -> dict | None:
    from omegaconf import OmegaConf

    b = sweep.baseline
    return OmegaConf.to_container(b) if b is not None else None
