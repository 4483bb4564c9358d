"""moe_exp's `+sweep=layouts` sweeper: plans the layouts of hardware.devices GPUs.

The layouts come from the composed config (moe_exp.sweep.layouts), so they are no grid
Hydra could expand. It plans every data mesh without a pipeline at its fastest corner
(the largest micro-batch, no checkpointing), then best first the slower layouts that
could still win (moe_exp.sweep.layouts.Frontier); then the pipelines of the fastest data
mesh without tp, the same way. Each plan is a job of the sweep's table."""
from __future__ import annotations

import sys
from pathlib import Path

from hydra.plugins.sweeper import Sweeper
from omegaconf import OmegaConf


class LayoutSweeper(Sweeper):
    """(Not a BasicSweeper subclass: Hydra's plugin scan executes basic_sweeper.py again,
    and the class imported before it is no longer the one its super() names.)"""

    def __init__(self, **_basic) -> None:  # (the basic sweeper's keys, unread)
        self.config = self.hydra_context = self.launcher = None

    def setup(self, *, hydra_context, task_function, config) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments):
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from moe_exp.sweep.layouts import (KEYS, Frontier, layouts, no_layout, pipelines,
                                           too_long)

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
        self._search(layouts(base), "data meshes without a pipeline")
        # the pipelines' data mesh: the fastest planned without tp (fitting or not: a
        # pipeline holds a stage's parameters, not the model's)
        flat = [(t, v) for t, (ok, v) in self.front.planned.items()
                if ok is not None and t.tp == 1 and t.pp == 1 and v]
        if flat:
            best = max(flat, key=lambda x: x[1])[0]
            keep, left = too_long(base, pipelines(base, best))
            for line in left:
                print(f"[layouts] not planned: {line}", file=sys.stderr, flush=True)
            self._search(keep, "pipelines of the fastest data mesh without tp")
        return list(self.recs.items())

    def _search(self, corners, what: str) -> None:
        """Plan the corners, then best first what Frontier gives."""
        from moe_exp.sweep.layouts import layout_name

        say = lambda m: print(f"[layouts] {m}", file=sys.stderr, flush=True)  # noqa: E731
        say(f"{len(corners)} {what}, each at its fastest corner")
        self._plan(corners)
        while (nxt := self.front.next()) is not None:
            lay, bound = nxt
            say(f"next: {layout_name(' '.join(lay.overrides()))} (at most {bound:,.0f} "
                f"tokens/s; the fastest that fits: {self.front.best():,.0f})")
            self._plan([lay])

    def _plan(self, todo) -> None:
        returns = self.launcher.launch([self.fixed + t.overrides() for t in todo],
                                       initial_job_idx=self.job)
        self.job += len(todo)
        for t, r in zip(todo, returns):
            rec = r.return_value
            self.recs[t] = rec
            self.front.add(t, _verdict(rec), (rec or {}).get("planned_tokens_per_s"))


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
