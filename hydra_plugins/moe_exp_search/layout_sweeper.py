"""moe_exp's `+sweep=layouts` sweeper: plans the layouts of hardware.devices GPUs.

The layouts come from the composed config (moe_exp.sweep.layouts), so they are no grid
Hydra could expand. It plans every data mesh without a pipeline at its fastest corner
(the largest micro-batch, no checkpointing), then best first the slower layouts that
could still win (moe_exp.sweep.layouts.Frontier); then the pipelines of the fastest data
mesh without tp, the same way. Each plan is a job of the sweep's table.

Plans run `sweep.plan_workers` at a time (default 2: a plan keeps one core busy), each
in a process forked from this one before it runs any plan, which runs the job as Hydra's
launcher would here; best first, a worker that finishes takes the next layout by bound,
knowing every plan finished by then."""
from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from hydra.plugins.sweeper import Sweeper
from omegaconf import OmegaConf


class LayoutSweeper(Sweeper):
    """(Not a BasicSweeper subclass: Hydra's plugin scan executes basic_sweeper.py again,
    and the class imported before it is no longer the one its super() names.)"""

    def __init__(self, **_basic) -> None:  # (the basic sweeper's keys, unread)
        self.config = self.hydra_context = self.launcher = self.pool = None
        self.workers = 1

    def setup(self, *, hydra_context, task_function, config) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)
        _LAUNCHER.append(self.launcher)

    def sweep(self, arguments):
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from moe_exp.sweep.layouts import KEYS, Frontier, no_layout

        for o in OverridesParser.create().parse_overrides(list(arguments)):
            if o.is_sweep_override():
                _refuse(f"{o.get_key_element()}: +sweep=layouts takes one value a key, got "
                        f"{o.input_line.split('=', 1)[1]} (run the search once per value)")
        base = self.hydra_context.config_loader.load_sweep_config(self.config, list(arguments))
        if why := no_layout(base):
            _refuse(why)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        self.fixed = [a for a in arguments if a.lstrip("+~").split("=")[0] not in KEYS]
        self.job, self.front, self.recs = 0, Frontier(), {}
        self.workers = base.sweep.plan_workers
        try:
            self._layouts(base)
        finally:
            if self.pool is not None:
                self.pool.shutdown()
        return list(self.recs.items())

    def _layouts(self, base) -> None:
        from moe_exp.sweep.layouts import layouts, pipelines, too_long

        flat = layouts(base)
        self.say(f"{len(flat)} data meshes without a pipeline, each at its fastest corner")
        self._run(flat, frontier=False)
        # the pipelines' data mesh: the fastest planned at tp 1 (fitting or not: a pipeline
        # holds a stage's parameters, not the model's; the slower layouts of a mesh are
        # slower, so its corners decide). A TP mesh's pipelines have tp x the micro-batches
        # a data rank: most would trace too long (docs/plan.md)
        known = [(t, v) for t, (ok, v) in self.front.planned.items()
                 if ok is not None and t.tp == 1 and t.pp == 1 and v]
        keep = []
        if known:
            best = max(known, key=lambda x: x[1])[0]
            keep, left = too_long(base, pipelines(base, best))
            for line in left:
                self.say(f"not planned: {line}")
            self.say(f"{len(keep)} pipelines of the fastest data mesh without tp, each at "
                     "its fastest corner; then best first, every mesh's slower layouts")
        self._run(keep, frontier=True)

    def say(self, line: str) -> None:
        print(f"[layouts] {line}", file=sys.stderr, flush=True)

    def _run(self, must: list, frontier: bool) -> None:
        """Plan `must`, then (frontier) best first what Frontier gives, a plan a worker:
        a worker that finishes takes the next at once, knowing every plan finished."""
        from concurrent.futures import FIRST_COMPLETED, wait

        must, running = list(must), {}
        while True:
            while len(running) < self.workers:
                if must:
                    lay = must.pop(0)
                else:
                    nxt = self.front.take(1, skip=set(running.values())) if frontier else []
                    if not nxt:
                        break
                    (lay, bound), = nxt
                    self.say(f"next: {lay.name()} (at most "
                             f"{bound:,.0f} tokens/s; the fastest that fits: "
                             f"{self.front.best():,.0f})")
                running[self._submit(lay)] = lay
            if not running:
                return
            for f in wait(running, return_when=FIRST_COMPLETED).done:
                lay = running.pop(f)
                try:
                    rec = f.result()
                except BrokenProcessPool:  # a plan's process died (killed: out of memory)
                    self.say(f"a plan's process died: {lay.name()} counts as not planned")
                    self.pool.shutdown(wait=False)
                    self.pool, rec = None, None
                self.recs[lay] = rec
                self.front.add(lay, _verdict(rec), (rec or {}).get("planned_tokens_per_s"))

    def _submit(self, lay):
        """Start one plan: in a worker process, or here with sweep.plan_workers=1."""
        from concurrent.futures import Future

        job = (self.fixed + lay.overrides(), self.job)
        self.job += 1
        if self.workers == 1:
            done = Future()
            done.set_result(_launch(job))
            return done
        if self.pool is None:  # (forked before this process plans anything)
            import multiprocessing

            self.pool = ProcessPoolExecutor(self.workers, multiprocessing.get_context("fork"))
        return self.pool.submit(_launch, job)


_LAUNCHER = []  # the sweep's launcher: forked plan processes inherit it (never pickled)


def _launch(job):
    """Run one plan (overrides, job number) as Hydra's launcher runs a job; its record."""
    overrides, idx = job
    return _LAUNCHER[-1].launch([overrides], initial_job_idx=idx)[0].return_value


def _refuse(line: str) -> None:
    """One line and exit code 2, before any plan (cli.EXIT_INVALID)."""
    print(f"error: {line}", file=sys.stderr)
    sys.exit(2)


def _verdict(rec) -> bool | None:
    """A plan's planned_fits; None where it was not planned (invalid, failed) or where its
    parameters, gradients and optimizer state alone do not fit: a smaller micro-batch or
    more checkpointing cannot make it fit."""
    from moe_exp.plan.predict import HEADROOM

    if not rec or rec.get("status") != "ok":
        return None
    if rec.get("planned_fits") is False and rec.get("planned_memory_gib"):
        held = sum(rec.get(f"planned_{k}_gib") or 0 for k in ("params", "grads", "optimizer"))
        if held > rec["planned_memory_gib"] * (1 - HEADROOM):
            return None
    return rec.get("planned_fits")
