"""task=bench: build the model, apply the optimizations, run the measured loop, record."""
from __future__ import annotations

import contextlib
import math

import torch

from ..bench.flops import analytic
from ..bench.memory import MemoryMeter, cpu_memory_cap
from ..record import Training
from ..results import stop_signal
from ..train.loop import Diverged, train_loop
from . import bench_record as record
from .protocol import Task
from .summary import summary_rows


class BenchTask(Task):
    name = "bench"
    trains = True
    section = Training

    @staticmethod
    def check(cfg) -> None:
        """Check train.checkpoint_* and train.resume_from with train.checkpoint.check."""
        from ..ranks import world_size
        from ..train.checkpoint import check
        from ..train.loop import profiled_steps

        world = world_size(cfg.hardware.devices)
        check(cfg, world, profiled_steps(cfg, world > 1))

    @staticmethod
    def ranked(cfg) -> bool:
        return cfg.parallel.name != "none" or cfg.hardware.devices > 1

    @staticmethod
    def preflight(cfg) -> tuple[dict, str | None]:
        """The run's plan where train.plan is on, and why the run cannot fit where it cannot."""
        from ..plan.predict import bench_plan, too_big

        planned = bench_plan(cfg)
        return planned, too_big(cfg, planned)

    summary_rows = staticmethod(summary_rows)

    @staticmethod
    def known_before(cfg, known: dict) -> dict:
        """Parameter counts, FLOPs per token, the torch version, the plan."""
        return {**analytic(cfg.model, cfg.train.seq_len), "torch_version": torch.__version__,
                **{k: v for k, v in known.items() if k != "null_reasons" and v is not None}}

    def run_name(self) -> str:
        cfg = self.ctx.cfg
        name = "-".join([cfg.model.name, cfg.precision.name,
                         f"ac_{cfg.train.activation_checkpointing}",
                         f"compile_{cfg.train.compile}"])
        if cfg.parallel.name != "none":
            name += f"-{cfg.parallel.name}x{cfg.hardware.devices}"
        return name

    def tags(self) -> list[str]:
        t = self.ctx.cfg.train
        return super().tags() + [f"ac={t.activation_checkpointing}", f"compile={t.compile}"]

    def run(self, rec: dict) -> None:
        from ..hardware import device_name, torch_device

        c = self.ctx
        device = torch_device(c.cfg)
        rec["device_name"] = device_name(device)
        rec["torch_version"] = torch.__version__
        with self._memory_cap(device) as c.memory_cap:
            self._measure(rec, device)
        if c.shared_process:  # before the record is printed, logged or written
            shared_process(rec, device.type)

    def failed(self, e: Exception, rec: dict) -> bool:
        if isinstance(e, Diverged):  # every rank sees the same global loss: a status
            rec.update(status="diverged", error=str(e), losses=e.losses)
            if e.losses:
                rec["loss_first"] = e.losses[0]
            return True
        return super().failed(e, rec)

    def interrupted(self, e: KeyboardInterrupt, rec: dict) -> None:
        """Mark the record interrupted, with the steps' losses and the checkpoint a SIGTERM saved.

        A resumed sweep reruns such a run."""
        done, total = getattr(e, "steps", (None, None))
        at = f" at step {done} of {total}" if done is not None else " before the run finished"
        rec.update(status="crashed", error=f"interrupted ({stop_signal(e)}){at}")
        if path := getattr(e, "checkpoint", None):  # (SIGTERM with checkpointing on)
            rec.update(getattr(e, "figures", {}), checkpoint_path=str(path))
            rec["error"] += f"; checkpoint saved: resume with train.resume_from={path}"
        if losses := getattr(e, "losses", None):
            rec.update(losses=losses, loss_first=losses[0], loss_last=losses[-1])

    def _memory_cap(self, device: torch.device):
        """On CPU, cap the memory the run may allocate; this machine's ranks share the cap."""
        if device.type != "cpu":
            return contextlib.nullcontext()
        hw = self.ctx.cfg.hardware
        return cpu_memory_cap(hw.memory_gib, hw.devices if self.ctx.dist else 1)

    def _measure(self, rec: dict, device: torch.device) -> None:
        """Build, train the measured steps, record: the run as a plain training loop."""
        from ..optimizations.parallel.hooks import record_reduce_bytes
        from ..plan.check import StepWatch
        from ..train.build import build_run
        from ..train.checkpoint import Checkpointer, find, meta

        c, cfg = self.ctx, self.ctx.cfg
        d = c.dist
        memory = MemoryMeter(device)
        resume = find(cfg.train.resume_from) if cfg.train.resume_from else None
        start = meta(resume)["step"] if resume else 0
        rec["init_seed"] = cfg.train.seed + cfg.sweep.init_offset  # (sweep.vary_init)
        rec.update(analytic(cfg.model, cfg.train.seq_len),
                   moe_dispatch=cfg.model.dispatch if cfg.model.num_experts else None,
                   world_size=d.world if d else 1)  # (a run that fails has them too)
        built = build_run(cfg, device, memory, d, start, rec["init_seed"])
        assert rec["params_total"] == built.params
        rec["optim_impl"] = built.optim_impl
        ckpt = Checkpointer(cfg, built.applied, built.optimizer, built.scheduler, c.out_dir,
                            d.rank if d else 0, built.world)
        if resume:
            ckpt.load(resume)
        watch = StepWatch(cfg, device, start)
        cached = record.graph_counts()
        try:
            res = train_loop(cfg, built.applied, built.optimizer, built.scheduler,
                             built.loader, device, memory, _tracker_log(c.tracker),
                             c.progress and c.main, ckpt, watch if watch.step is not None
                             else None)
        except KeyboardInterrupt as e:  # (the record names the checkpoint a SIGTERM saved)
            e.figures = ckpt.figures()[0]
            raise
        graphs = [a - b for a, b in zip(record.graph_counts(), cached)]  # this run's
        record.record_compile_cache(rec, cfg, *graphs[:4])
        record.record_cudagraph_skips(rec, cfg, device, graphs[4])
        record.record_pipeline(cfg, rec, res, built.applied.model, device, built.world)
        record.record_run(cfg, rec, res, device, built.world, watch)
        record.record_checkpoints(rec, ckpt, res)
        record.record_profile(cfg, rec, res, device, c.out_dir if c.main else None)
        record_reduce_bytes(cfg, rec, built.applied.reduce_bytes)
        record.record_moe(cfg, rec, res, built.applied.model, device, built.world)


def _tracker_log(tracker):
    """The loop's on_log: each step's loss and learning rate to the tracker."""
    if tracker is None:
        return None

    def on_log(step, values, lrs, norms):
        first = step + 1 - len(values)
        for i, (v, lr, g) in enumerate(zip(values, lrs, norms)):
            tracker.log({"loss": v, "lr": lr} | ({"grad_norm": g} if math.isfinite(g) else {}),
                        step=first + i)

    return on_log


def shared_process(rec: dict, device: str) -> None:
    """Null the figures that a later run of an in-process sweep cannot measure.

    The process did not start for it, and on CPU its peak RSS counts memory that earlier runs
    left resident."""
    why = "a later job of an in-process sweep (sweep.isolate=false): "
    lost = {"startup_s": why + "the process did not start for it"}
    if device == "cpu":
        lost["peak_mem_gib"] = why + "CPU peak RSS counts what earlier jobs left resident"
    for key, reason in lost.items():
        if rec.get(key) is not None:
            rec[key] = None
            rec.setdefault("null_reasons", {})[key] = reason
