"""The Task protocol, the RunContext a task runs in, and execute(), shared by every task.

execute() handles the record, its status on failure, the W&B run and the summary."""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..results import close_record, hold_sigint, new_record, release_sigint


@dataclass
class RunContext:
    """One run: its typed config, where it writes, and how it was started."""
    cfg: RunConfig  # the schema's dataclasses, resolved (hardware, the MoE dispatch)
    cfg_dict: dict  # the config as asked (resolved): the record's, its hash's and W&B's
    out_dir: Path
    overrides: list = field(default_factory=list)
    choices: dict = field(default_factory=dict)  # {group: option} (W&B tags)
    progress: bool = True
    dist: Any = None  # distributed.Dist on a rank, else None
    shared_process: bool = False  # a later run of an in-process sweep (sweep.isolate=false)
    known: dict = field(default_factory=dict)  # record fields known before the run: its plan
    tracker: Any = None  # tracking.Tracker: the run's W&B run (rank 0; logger=wandb)
    memory_cap: int | None = None  # bytes the run may allocate (CPU), for its OOM line

    @property
    def main(self) -> bool:
        """Whether this process writes the record: the only process, or rank 0."""
        return self.dist is None or self.dist.main

    def new_record(self) -> dict:
        """The run's record before any work: its config, and what was known before."""
        rec = new_record(self.cfg_dict, self.overrides)
        rec.update({k: v for k, v in self.known.items() if k != "null_reasons"})
        rec["null_reasons"].update(self.known.get("null_reasons", {}))
        return rec


class Task:
    """A value of `task=`: its checks, its run and its record's summary.

    Each is one module under tasks/ and one line in tasks/__init__.py's registry."""
    name = ""
    section: type | None = None  # its part of the record (record.py)
    title = "moe_exp result"  # the summary table's
    noun = "run"  # what an error line calls it
    tracked = True  # logs a W&B run (deferred to the run's end)
    here = True  # runs on this machine (plan: on hardware it need not have)
    model = True  # builds the model in its own process (its MoE dispatch resolved there)
    trains = False  # a training step: the memory it needs is checked before any work
    own_ranks = False  # runs on ranks whatever parallel= says (task=comm's collectives)

    def __init__(self, ctx: RunContext):
        self.ctx = ctx

    @staticmethod
    def check(cfg) -> None:
        """Raise ConfigError for the task's configuration mistakes, before any work."""

    @staticmethod
    def check_here(cfg) -> None:
        """Raise Unsupported for what this machine cannot do for the task, after check."""

    @staticmethod
    def ranked(cfg) -> bool:
        """Whether it runs on ranks, launched here or started by torchrun."""
        return False

    @staticmethod
    def preflight(cfg) -> tuple[dict, str | None]:
        """Record fields known before the run, and why it cannot run, or None where it can."""
        return {}, None

    @staticmethod
    def summary_rows(rec: dict) -> list[tuple[str, str]]:
        """The record's headline figures as (label, text) rows, for the summary and run.log."""
        return []

    def run(self, rec: dict) -> str | None:
        """The work: fills rec; returns its status where not ok."""
        raise NotImplementedError

    def interrupted(self, e: KeyboardInterrupt, rec: dict) -> None:
        """Fill rec after a Ctrl-C or SIGTERM."""
        rec.update(status="crashed", error=f"interrupted before the {self.noun} finished")

    def failed(self, e: Exception, rec: dict) -> bool:
        """Fill rec's status and one-line error after an exception.

        Returns True where every rank ends in the same status. Otherwise the rank raises and
        the launcher stops the others."""
        d = self.ctx.dist
        rec.update(failure(e, self.ctx.out_dir, self.ctx.main, self.ctx.memory_cap,
                           "" if d is None else f"rank {d.rank}: "))
        return False

    @staticmethod
    def known_before(cfg, known: dict) -> dict:
        """What the record of a launch that failed still knows; known is its preflight's."""
        return {}

    def run_name(self) -> str:
        """Its W&B run's name."""
        c = self.ctx.cfg
        return f"{self.name}-{c.model.name}-{c.precision.name}"

    def tags(self) -> list[str]:
        """Its W&B run's tags."""
        return [f"{k}={v}" for k, v in sorted(self.ctx.choices.items())]

    def show(self, rec: dict) -> None:
        """What the terminal gets of a finished run."""
        from .summary import print_summary

        print_summary(rec, self.ctx.out_dir / "metrics.json", self.summary_rows(rec),
                      self.title)


def execute(task: Task) -> dict:
    """Run a task and close its record; rank 0 alone writes it, logs to W&B, prints a summary.

    A failure of the run does not raise: the record's status says it. Ctrl-C raises, and so
    does a failure on a rank: the launcher stops every rank and names the one that failed."""
    ctx = task.ctx
    rec, held = ctx.new_record(), None
    try:
        if ctx.main and task.tracked:
            from ..tracking import Tracker

            ctx.tracker = Tracker(ctx.cfg.logger, ctx.cfg_dict, ctx.out_dir, task.tags(),
                                  task.run_name(), defer=True)
        rec["status"] = task.run(rec) or "ok"
    except KeyboardInterrupt as e:
        task.interrupted(e, rec)
        held = hold_sigint()  # a second SIGINT (ranks get one from the agent too) must
        # not stop the record's write below
        if ctx.tracker:  # no W&B start-up for a run the user stopped
            ctx.tracker.discard()
        raise
    except BaseException as e:  # (DCP's CheckpointException is a BaseException)
        if isinstance(e, (SystemExit, GeneratorExit)):
            raise
        if not task.failed(e, rec) and ctx.dist is not None:  # the launcher stops every
            raise  # rank and records which failed
    finally:
        if ctx.main:
            close_record(rec, ctx.out_dir, ctx.tracker, task.noun,
                         show_error=not (ctx.dist and ctx.dist.launched_here))
        release_sigint(held)
    if ctx.main and rec["status"] == "ok":
        task.show(rec)
    return rec


def first_line(e: BaseException) -> str:
    """An exception's first line of text (DCP's CheckpointException: its first rank's
    failure), or its type's name where it has none."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:  # {rank: (exception, traceback)}
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return f"rank {next(iter(failures))}: {type(inner).__name__}: {first_line(inner)}"
    text = e.args[0] if len(e.args) > 1 and isinstance(e.args[0], str) else str(e)
    return (text.strip().splitlines() or [type(e).__name__])[0][:300]


def failure(e: BaseException, out_dir: Path, log: bool = True, cap=None, rank: str = "") -> dict:
    """An exception as a record's status and one-line error.

    The line is an OOM's with the memory cap, a nondeterministic op's message, or the
    exception's first line pointing to error.log. Where log is true, error.log gets the
    traceback of any exception but an OOM."""
    from ..bench.memory import is_oom, oom_line
    from ..hardware import nondeterministic_error

    oom = is_oom(e)
    if not oom and log:
        (out_dir / "error.log").write_text(traceback.format_exc())
    first = first_line(e)
    if oom:
        first = oom_line(first, cap)
    elif det := nondeterministic_error(e):
        first = det
    return {"status": "oom" if oom else "error",
            "error": rank + (first if oom or det else f"{type(e).__name__}: {first} "
                                                      f"(see {out_dir}/error.log)")}
