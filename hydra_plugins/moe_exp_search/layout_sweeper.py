"""moe_exp's `+sweep=layouts` sweeper: plans every layout of hardware.devices GPUs.

The layouts come from the composed config (moe_exp.sweep.layouts), so they are no grid
Hydra could expand. It plans them in rungs: every layout without a pipeline at no
checkpointing; those that do not fit again at the next checkpointing; then the pipelines
of the fastest one's data mesh, the same way. Each plan is a job of the sweep's table."""
from __future__ import annotations

import sys
from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from omegaconf import OmegaConf


class LayoutSweeper(BasicSweeper):
    def sweep(self, arguments):
        from moe_exp.sweep.layouts import KEYS, layouts, no_layout, pipelines

        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        base = self.hydra_context.config_loader.load_sweep_config(self.config, list(arguments))
        if why := no_layout(base):
            print(f"error: {why}", file=sys.stderr)
            sys.exit(2)
        fixed = [a for a in arguments if a.lstrip("+~").split("=")[0] not in KEYS]
        self.job = 0
        done = self._rungs(layouts(base), fixed, "without a pipeline")
        fits = [(lay, r) for lay, r in done if _fits(r) and lay.tp == 1]
        if fits:
            best = max(fits, key=lambda x: x[1]["planned_tokens_per_s"] or 0)[0]
            done += self._rungs(pipelines(base, best), fixed,
                                "pipelines of the fastest one's data mesh")
        return done

    def _rungs(self, todo, fixed, what: str) -> list:
        """Plan `todo`, then rung by rung the layouts one step slower than those that did
        not fit (moe_exp.sweep.layouts.next_rung)."""
        from moe_exp.sweep.layouts import next_rung

        done, rung = [], 1
        while todo:
            print(f"[layouts] {what}: rung {rung}, {len(todo)} layouts", file=sys.stderr,
                  flush=True)
            returns = self.launcher.launch([fixed + t.overrides() for t in todo],
                                           initial_job_idx=self.job)
            self.job += len(todo)
            done += [(t, r.return_value) for t, r in zip(todo, returns)]
            todo, rung = next_rung([(t, _verdict(r), (r or {}).get("planned_tokens_per_s"))
                                    for t, r in done]), rung + 1
        return done


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


def _fits(rec) -> bool:
    return bool(rec) and rec.get("status") == "ok" and rec.get("planned_fits") is True \
        and rec.get("planned_tokens_per_s") is not None
