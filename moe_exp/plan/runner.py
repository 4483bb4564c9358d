"""task=plan: one training step of the configuration traced on fake tensors (plan/trace.py)
for the hardware profile named, whether or not this machine has it: per-device peak memory
by kind, whether it fits, the step's collectives, and its time (plan/roofline.py). Nothing
is allocated and nothing is measured. A bench run's own plan and pre-flight: bench_plan,
too_big."""
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
    mem = plan_memory_gib(cfg.hardware)
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
    rec["world_size"] = world = cfg.hardware.devices
    _times(cfg, rec, step, t.micro_batch_size * t.grad_accum_steps * t.seq_len * world)
    fill_null_reasons(rec, WHY)


# what a task=bench run records of its plan (train.plan)
BENCH = ("plan_s", "planned_peak_gib", "planned_step_ms", "planned_compute_ms",
         "planned_comm_ms", "planned_tokens_per_s", "planned_comm_gib")


def bench_plan(cfg) -> dict:
    """A task=bench run's plan (train.plan), before any work: BENCH's keys, each null with
    its reason where the plan could not be made (a plan that fails is a null, never the
    run's failure)."""
    from .trace import unplannable

    rec, why = {"null_reasons": {}}, None
    if not cfg.train.plan:
        why = "train.plan=false"
    elif cant := unplannable(cfg):
        why = f"not planned: {cant[1]}"
    else:
        try:
            _plan(cfg, rec)
        except Exception as e:  # noqa: BLE001 - the plan is a check on the run, not the run
            why = f"the plan failed: {type(e).__name__}: " \
                  f"{(str(e).strip().splitlines() or [''])[0][:200]}"
    out = {k: rec.get(k) for k in BENCH}
    out["null_reasons"] = {k: why or rec["null_reasons"].get(k, WHY) for k in BENCH
                           if out[k] is None}
    return out


def too_big(cfg, planned: dict) -> str | None:
    """The pre-flight's verdict on a planned peak: why the run cannot fit (a GPU holds one
    rank; a CPU's memory, this machine's ranks together), else None."""
    mem, peak = cfg.hardware.memory_gib, planned.get("planned_peak_gib")
    if not mem or peak is None:
        return None
    n = cfg.hardware.devices if cfg.hardware.device == "cpu" else 1
    if peak * n <= mem:
        return None
    where = f"{n} CPU ranks" if n > 1 else "a device"
    return (f"train.micro_batch_size: the plan of this step peaks at {peak * n:,.3g} GiB on "
            f"{where} (task=plan for its split); hardware={cfg.hardware.name} has {mem:,.3g} "
            "GiB (a smaller micro-batch, activation checkpointing or more sharding; "
            "train.plan=false runs it anyway)")


def plan_memory_gib(hw) -> float | None:
    """The memory a plan fits against: the device's (set, or read where it is here), else
    the part's as its profile gives it (spec_memory_gib)."""
    return hw.memory_gib or hw.spec_memory_gib


def _times(cfg, rec: dict, step, tokens: int) -> None:
    """The roofline's step time (plan.roofline), tokens/s (every rank's tokens) and MFU."""
    from .roofline import comm_ms, compute_ms

    why, hw = rec["null_reasons"], cfg.hardware
    rec["planned_compute_ms"], why_compute = compute_ms(step.ops, hw, cfg.precision.name)
    rec["planned_comm_ms"], why_comm = comm_ms(step.ops, hw)
    peak = (hw.peak_flops or {}).get(cfg.precision.name)
    if why_compute or why_comm:
        for k in ("planned_step_ms", "planned_tokens_per_s", "planned_mfu"):
            rec[k], why[k] = None, why_compute or why_comm
        for k, text in (("planned_compute_ms", why_compute), ("planned_comm_ms", why_comm)):
            if text:
                why[k] = text
        return
    ms = rec["planned_step_ms"] = rec["planned_compute_ms"] + rec["planned_comm_ms"]
    rec["planned_tokens_per_s"] = tokens / (ms / 1e3)
    rec["planned_mfu"] = step.flops / (ms / 1e3) / peak if peak else None
    if not peak:
        why["planned_mfu"] = f"no peak FLOP/s known for hardware={hw.name} at precision=" \
                             f"{cfg.precision.name}"


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
            f"; {step:,.1f} ms ({r['planned_compute_ms']:,.1f} computing at the profile's "
            f"roofline, {r['planned_comm_ms']:,.1f} communicating, no overlap), "
            f"{r['planned_tokens_per_s']:,.0f} tokens/s"
            + (f", MFU {r['planned_mfu']:.0%}" if r.get("planned_mfu") is not None else "")
            if step is not None else f"; time: null ({r['null_reasons']['planned_step_ms']})")),
    ]
