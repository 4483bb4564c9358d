"""task=plan: one training step of the configuration traced on fake tensors (plan/trace.py)
for the hardware profile named, whether or not this machine has it: per-device peak memory
by kind, whether it fits, and the step's FLOPs against the profile's peak (a compute-bound
floor of the step time). Nothing is allocated and nothing is measured."""
from __future__ import annotations

import time
from pathlib import Path

from ..bench.memory import GIB
from ..results import close_record, fill_null_reasons

HEADROOM = 0.10  # of the device's memory kept free: the allocator's fragmentation, the
# CUDA context and the kernels' workspaces, which no tensor tracker sees
WHY = "task=plan predicts: nothing is measured"
KINDS = ("params", "grads", "optimizer", "activations", "temporaries", "buffers",
         "collective", "other")


def plan(cfg, cfg_dict: dict, rec: dict, out_dir: Path, choices: dict) -> dict:
    """The plan's record (metrics.json) and its summary; never raises but on Ctrl-C."""
    from ..tracking import Tracker

    rec.update(task="plan", device_name=f"{cfg.hardware.name} (planned)")
    tracker = None
    try:
        tracker = Tracker(cfg, cfg_dict, out_dir, [f"{k}={v}" for k, v in sorted(choices.items())],
                          f"plan-{cfg.model.name}-{cfg.precision.name}", defer=True)
        _plan(cfg, rec)
        rec["status"] = "ok"
    except KeyboardInterrupt:
        rec.update(status="crashed", error="interrupted before the plan finished")
        raise
    except Exception as e:  # noqa: BLE001 - a run's failure is a status, not a crash
        from ..bench.runner import failure

        rec.update(failure(e, out_dir))
    finally:
        close_record(rec, out_dir, tracker)
    if rec["status"] == "ok":
        from ..summary import print_summary

        print_summary(rec, out_dir / "metrics.json", summary_rows(rec), "moe_exp plan")
    return rec


def _plan(cfg, rec: dict) -> None:
    from ..bench.flops import param_counts
    from .trace import trace_step

    why, t = rec["null_reasons"], cfg.train
    t0 = time.perf_counter()
    step = trace_step(cfg)
    rec["plan_s"] = time.perf_counter() - t0
    rec.update(param_counts(cfg.model))
    rec["planned_peak_gib"] = step.peak_bytes / GIB
    for k in KINDS:
        rec[f"planned_{k}_gib"] = step.at_peak.get(k, 0) / GIB
    mem = cfg.hardware.memory_gib
    if mem:
        rec["planned_fits"] = bool(rec["planned_peak_gib"] <= mem * (1 - HEADROOM))
        rec["planned_memory_gib"] = float(mem)
    else:
        rec["planned_fits"] = rec["planned_memory_gib"] = None
        why["planned_fits"] = why["planned_memory_gib"] = (
            f"hardware={cfg.hardware.name} gives no memory_gib (read from the device when "
            "run): set hardware.memory_gib=<GiB per device>")
    rec["planned_flops_per_step"] = step.flops
    rec["planned_comm"] = {k: {"calls": v["calls"], "gib": v["bytes"] / GIB}
                           for k, v in sorted(step.comm.items())}
    rec["planned_comm_gib"] = sum(v["gib"] for v in rec["planned_comm"].values())
    peak = (cfg.hardware.peak_flops or {}).get(cfg.precision.name)
    rec["world_size"] = world = cfg.hardware.devices
    tokens = t.micro_batch_size * t.grad_accum_steps * t.seq_len * world  # (every rank's)
    if peak:
        rec["planned_step_ms"] = step.flops / peak * 1e3
        rec["planned_tokens_per_s"] = tokens / (step.flops / peak)
    else:
        rec["planned_step_ms"] = rec["planned_tokens_per_s"] = None
        why["planned_step_ms"] = why["planned_tokens_per_s"] = (
            f"no peak FLOP/s known for hardware={cfg.hardware.name} at precision="
            f"{cfg.precision.name}; set ++hardware.peak_flops.{cfg.precision.name}=<FLOP/s>")
    fill_null_reasons(rec, WHY)


def _gib(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def summary_rows(r: dict) -> list[tuple[str, str]]:
    """The plan's headline figures, (label, text) rows (the terminal's table, run.log)."""
    mem, ok = r.get("planned_memory_gib"), r.get("planned_fits")
    if ok is None:
        fits = f"null: {r['null_reasons'].get('planned_fits', '')}"
    else:
        fits = f"{'yes' if ok else 'NO'}: {r['planned_peak_gib']:.3g} of {mem:.3g} GiB less " \
               f"{HEADROOM:.0%} headroom ({mem * (1 - HEADROOM):.3g} GiB)"
    split = ", ".join(f"{k} {r[f'planned_{k}_gib']:,.3f}" for k in KINDS
                      if r.get(f"planned_{k}_gib"))
    step, world = r.get("planned_step_ms"), r.get("world_size") or 1
    where = "one device" if world == 1 else f"rank 0 of {world} ({r['parallel']})"
    return [
        ("plan", f"model={r['model']} precision={r['precision']} "
                 f"ac={r['activation_checkpointing']} micro-batch {r['micro_batch_size']} on "
                 f"{r['hardware']}, {where} (traced in {r['plan_s']:.1f} s)"),
        ("peak memory", f"{r['planned_peak_gib']:,.3f} GiB per device: {split}"),
        ("fits", fits),
        *([("collectives", ", ".join(f"{k} {_gib(v['gib'])} GiB in {v['calls']} calls"
                                     for k, v in r["planned_comm"].items())
            + " a step (each rank)")] if r.get("planned_comm") else []),
        ("step", f"{r['planned_flops_per_step']:.3g} FLOPs" + (
            f"; at the profile's peak {step:,.1f} ms, {r['planned_tokens_per_s']:,.0f} "
            "tokens/s (a compute-bound floor: neither the memory-bound ops' time nor the "
            "collectives' is in it)"
            if step is not None else f"; time: null ({r['null_reasons']['planned_step_ms']})")),
    ]
