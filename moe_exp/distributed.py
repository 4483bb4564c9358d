"""Ranks on torch.distributed: launched by the app, or joined where torchrun or SLURM started them.

The app launches its ranks with torch's elastic agent and keeps one output dir and one
record. A process that torchrun or SLURM started is already a rank, and joins.

    python -m moe_exp.run parallel=expert hardware.devices=2          # 2 ranks, launched here
    torchrun --nnodes=2 --nproc-per-node=8 -m moe_exp.run parallel=fsdp hardware.devices=8
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from .ranks import rank_env


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    launched_here: bool = False  # by pipeline.launch, which records a rank's failure itself

    @property
    def main(self) -> bool:
        return self.rank == 0


def is_rank() -> bool:
    """Whether a launcher started this process as a rank, with torch's env: don't launch again."""
    return rank_env() is not None


def backend(cfg) -> str:
    b = cfg.parallel.backend
    return b if b != "auto" else ("nccl" if cfg.hardware.device == "cuda" else "gloo")


def init(cfg) -> Dist:
    """Join the process group, by the env:// rendezvous that the launcher set up."""
    d = Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
             int(os.environ.get("LOCAL_RANK", 0)))
    if cfg.hardware.device == "cuda":
        torch.cuda.set_device(d.local_rank)
    elif (threads := rank_threads(local := int(os.environ.get("LOCAL_WORLD_SIZE", d.world)))):
        torch.set_num_threads(threads)  # (a forked rank keeps its parent's count otherwise)
        if cfg.hardware.pin_ranks:
            pin(d.local_rank, local, threads)
    if not dist.is_initialized():
        dist.init_process_group(backend(cfg), timeout=dt.timedelta(seconds=cfg.parallel.timeout_s))
    return d


def pin(local_rank: int, local: int, threads: int) -> None:
    """Bind this CPU rank, and the threads it starts (gloo's), to `threads` cores of its own,
    where the `local` ranks' threads fit the cores this process may use.

    Left to the scheduler, two ranks' compute threads share a core now and then while
    another idles, and a rank waits its turn inside a send: on 2 gloo ranks of 2 cores, one
    post in ten waited 1-8 ms on the run queue; bound, none did (tiny_moe's GPipe bubble
    0.30 -> 0.24, its step 150-165 -> 136 ms). The load measurement keeps every core
    (bench/load.py: keep_cpus)."""
    from .bench.load import keep_cpus

    cpus = keep_cpus()
    if local > 1 and local * threads <= len(cpus) and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus[local_rank * threads:(local_rank + 1) * threads])


def rank_threads(local: int) -> int | None:
    """Torch threads of each of `local` CPU ranks: OMP_NUM_THREADS where set, else the cores
    shared out (no oversubscription). None where OMP_NUM_THREADS is not one number."""
    env = os.environ.get("OMP_NUM_THREADS")
    if env is None:
        return max(1, (os.cpu_count() or 1) // local)
    return int(env) if env.strip().isdigit() and int(env) > 0 else None


def start_method(n: int, fork: bool) -> str:
    """How launch starts n local ranks: "fork" where asked, CUDA is not initialized here and
    each rank runs one thread, else "spawn". GNU OpenMP's thread pool does not survive a
    fork: a forked rank running 2 threads, after its parent had, hung in
    gomp_team_barrier_wait_end (an in-process sweep's second job)."""
    ok = fork and not torch.cuda.is_initialized() and rank_threads(n) == 1
    return "fork" if ok else "spawn"


def finish() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _no_failure_dump(record: logging.LogRecord) -> bool:
    """Log filter that drops the agent's failure dumps.

    The agent logs a failed rank's whole traceback, tens of lines of stderr, and a line per
    rank it then stops. The run prints one line instead, failure_message, and keeps every
    traceback in its error.log."""
    return not str(record.msg).startswith(("failed (exitcode", "Sending process",
                                           "Closing process", "Terminating process"))


AGENT_LOGS = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")


def launch(entry, n: int, *args, run_id: str | None = None, fork: bool = False):
    """Run entry(*args) on n local ranks; returns rank 0's return value.

    A rank that fails ends all of them, as the agent stops the rest, and raises
    ChildFailedError naming it. fork: the ranks forked from this process where start_method
    allows (CPU ranks of one thread; 0.8 s a launch of 2 where spawning, each rank
    importing torch again, takes 4 s), else spawned."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    fork = start_method(n, fork) == "fork"
    lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n,
                      run_id=run_id or f"moe_exp-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                      rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.2,
                      start_method="fork" if fork else "spawn")
    from torch.distributed.elastic.multiprocessing.api import SignalException

    # the agent installs handlers that raise SignalException (an Exception) and leaves them:
    # put the process's own back afterwards, so a later Ctrl-C is an interrupt again
    saved = {s: signal.getsignal(s)
             for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    for name in AGENT_LOGS:
        logging.getLogger(name).addFilter(_no_failure_dump)
    from .bench import timer

    before = timer.STARTED
    try:
        if fork:  # (a forked rank's startup_s counts from this process's start)
            try:
                timer.STARTED = before if before is not None else timer.start_ticks()
            except (OSError, ValueError, IndexError):
                pass
        return elastic_launch(lc, entry)(*args)[0]
    except SignalException as e:  # the agent stopped the ranks on a signal: Ctrl-C or
        if e.sigval == signal.SIGINT:  # SIGTERM is an interrupt (rank 0 recorded it)
            raise KeyboardInterrupt from None
        if e.sigval == signal.SIGTERM:
            raise KeyboardInterrupt("SIGTERM") from None
        raise
    finally:
        timer.STARTED = before
        for name in AGENT_LOGS:
            logging.getLogger(name).removeFilter(_no_failure_dump)
        for s, handler in saved.items():
            if handler is not None:
                try:
                    signal.signal(s, handler)
                except ValueError:  # not the main thread: the agent could not set them
                    pass


# Errors a rank gets because another rank died, or the agent stopped it after one did.
_SECONDARY = ("closed by peer", "reset by peer", "remote worker crash", "communicator was aborted",
              "Broken pipe", "Socket Timeout", "(SIGTERM)")


def _text(f) -> str:
    m = f.message
    text = m.get("message", "") if isinstance(m, dict) else str(m or "")
    # the agent's stand-in where a rank exited without an error file
    return "" if text.startswith("To enable traceback see") else text


def _first_failure(err) -> int:
    """The rank that failed first in a ChildFailedError.

    It is the earliest failure that is not a peer's lost connection: a rank can record that
    one before the cause."""
    order = sorted(err.failures, key=lambda r: err.failures[r].timestamp)
    causes = [r for r in order if not any(s in _text(err.failures[r]) for s in _SECONDARY)]
    return (causes or order)[0]


def failure_message(err) -> str:
    """One line naming the rank that failed first and its error."""
    rank = _first_failure(err)
    f = err.failures[rank]
    lines = [ln for ln in _text(f).strip().splitlines() if ln.strip()]
    return f"rank {rank} failed: {(lines[-1] if lines else f'exit code {f.exitcode}')[:300]}"


def killed_by_signal(err) -> bool:
    """Whether the failed rank's process was killed by a signal: a `crashed` run.

    E.g. SIGKILL from the kernel's OOM killer, or a segfault; a sweep job's dead process is
    a crash alike."""
    return (err.failures[_first_failure(err)].exitcode or 0) < 0


def failure_report(err) -> str:
    """Every failed rank's error with its traceback, for the run's error.log."""
    parts = []
    for rank in sorted(err.failures):
        f = err.failures[rank]
        info = f.message.get("extraInfo", {}) if isinstance(f.message, dict) else {}
        stack = info.get("py_callstack", "") if isinstance(info, dict) else ""
        parts.append(f"== rank {rank} (exit code {f.exitcode})\n{stack or _text(f)}".strip())
    return "\n\n".join(parts) + "\n"


def parent_vanished(parent: int, wait_s: float = 0.0) -> str | None:
    """Why a launched rank was interrupted, where its launcher is gone; else None.

    torch's spawn sets PR_SET_PDEATHSIG=SIGINT on each rank, so a launching process killed
    outright, by kill -9 or the kernel's OOM killer, reaches the ranks as a Ctrl-C.
    `parent` is the rank's parent pid at its start; None where it is still the parent after
    wait_s. The wait is needed: the signal comes when the launcher's thread that started
    the rank dies, and the process's other threads, which hold the pid, can take a moment
    more."""
    end = time.monotonic() + wait_s
    while os.getppid() == parent:
        if time.monotonic() >= end:
            return None
        time.sleep(0.02)
    return (f"its launching process, pid {parent}, vanished: killed outright, e.g. by kill "
            "-9 or the OOM killer; the ranks got SIGINT")


VANISH_WAIT_S = 2.0  # how long rank 0 gives a launcher being killed to be gone


def vanish_wait(e: BaseException) -> float:
    """Seconds rank 0, stopped by `e`, waits to see whether its launcher is gone.

    It waits after a SIGINT or a lost peer, as the other ranks got the same SIGINT; not
    after a failure of its own, which the launcher, alive, records."""
    secondary = isinstance(e, Exception) and any(s in str(e) for s in _SECONDARY)
    return VANISH_WAIT_S if isinstance(e, KeyboardInterrupt) or secondary else 0.0


def reword_for_vanished_launcher(path, parent: int, wait_s: float = VANISH_WAIT_S) -> bool:
    """Rewrites rank 0's record at `path` as crashed, where the launching process vanished.

    The record said `interrupted (Ctrl-C / SIGINT)`, or the error a collective raised when
    the other ranks stopped, such as Connection closed by peer. It becomes `crashed`, its
    error `interrupted (<why the launcher vanished>)` with what it said after. Returns
    whether it did."""
    from .results import hold_sigint, release_sigint, write_json_atomic

    held = hold_sigint()  # (the SIGINT that stopped the ranks may still be pending here)
    try:
        try:
            rec = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return False
        if not isinstance(rec, dict) or rec.get("status") == "ok" or \
                (why := parent_vanished(parent, wait_s)) is None:
            return False
        said, ctrl_c = str(rec.get("error") or ""), "interrupted (Ctrl-C / SIGINT)"
        error = f"interrupted ({why}){said[len(ctrl_c):]}" if said.startswith(ctrl_c) else \
            f"interrupted ({why})" + (f"; rank 0 then saw: {said}" if said else "")
        was = f"not measured: run {rec.get('status')}"
        reasons = {k: ("not measured: run crashed" if v == was else v)
                   for k, v in (rec.get("null_reasons") or {}).items()}
        write_json_atomic(path, {**rec, "status": "crashed", "error": error,
                                 "null_reasons": reasons})
        return True
    finally:
        release_sigint(held)


PEER_GRACE_S = 3.0  # a rank that lost a peer waits this long before it fails


@record
def rank_entry(fn, *args):
    """What each launched rank runs; its errors land in the agent's error file.

    The parent then names the rank. A rank whose error is a peer's lost connection waits
    first, so the agent sees the peer's own failure before this one. Else, on a loaded
    machine, the peer could still be exiting when the agent stops every rank, and the run
    would name the connection, not the cause."""
    from .results import stop_on_sigterm

    stop_on_sigterm()  # the agent passes a SIGTERM on to the ranks: rank 0 records it
    # a forked rank inherits the agent's SIGINT handler (it raises SignalException): a
    # SIGINT, a Ctrl-C or its launcher's death, is a KeyboardInterrupt here, as when spawned
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return fn(*args)
    except Exception as e:
        if any(s in str(e) for s in _SECONDARY):
            time.sleep(PEER_GRACE_S)
        raise


def collective_device(device: torch.device):
    """Where the loop's own collectives keep their small tensors: the GPU on CUDA, else CPU."""
    return device if device.type == "cuda" else "cpu"


def all_max(values: list[float | None], device) -> list[float | None]:
    """Each value's max over ranks.

    None, a value a rank did not measure, is left out; it stays None where no rank has a
    value. Every rank passes the same number of values."""
    t = torch.tensor([-math.inf if v is None else v for v in values], dtype=torch.float64,
                     device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [None if v == -math.inf else v for v in t.tolist()]


def all_gather_stack(t: torch.Tensor) -> torch.Tensor:
    """Every rank's t, stacked: shape (world, *t.shape)."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def all_mean(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG if dist.get_backend() == "nccl" else dist.ReduceOp.SUM)
    return t if dist.get_backend() == "nccl" else t / dist.get_world_size()
