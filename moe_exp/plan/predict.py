"""A plan's figures: a configuration's training step predicted for a hardware profile.

plan/trace.py traces the step on fake tensors for the profile named, whether or not this
machine has it. The figures are per-device peak memory by kind, whether it fits, the step's
collectives, and its time from plan/roofline.py. task=plan records them (tasks/plan.py); a
bench run records its own plan and is skipped where it cannot fit: bench_plan, too_big."""
from __future__ import annotations

import time
from pathlib import Path

from ..bench.memory import GIB
from ..config import (data_ranks, mesh_dims, pp_microbatches, pp_size,
                      record_pp_columns)
from ..screen import Status, phase
from ..results import fill_null_reasons

HEADROOM = 0.10  # of the device's memory kept free: the allocator's fragmentation, the
# CUDA context and the kernels' workspaces, which no tensor tracker sees
WHY = "task=plan predicts: nothing is measured"
KINDS = ("params", "grads", "optimizer", "activations", "temporaries", "buffers",
         "collective", "other")


def plan_step(cfg, rec: dict) -> None:
    """The plan's figures into rec: memory by kind, fit, FLOPs, collectives, roofline time.

    A model of many alike blocks is traced at two small depths and its figures taken on
    the line through them (plan/depth.py, train.plan_depth)."""
    from .compiled import memory_basis
    from .depth import traced_depths
    from .trace import trace_step

    t0 = time.perf_counter()
    with Status(f"[plan] {cfg.model.name} on {cfg.hardware.name}" + (
            f", rank 0 of {cfg.hardware.devices:,}" if cfg.hardware.devices > 1 else "")):
        depths = traced_depths(cfg)
        if pp_size(cfg.parallel) > 1:
            _pipelined(cfg, rec)
            rec["plan_s"] = time.perf_counter() - t0
            if rec.get("planned_from_blocks") is None:
                rec["planned_from_blocks"] = None
                rec["null_reasons"]["planned_from_blocks"] = \
                    "train.plan_depth=full" if cfg.train.plan_depth == "full" else \
                    "every block traced (stages too short to gain from two depths)"
        elif depths is None:
            step = trace_step(cfg)
            rec["plan_s"] = time.perf_counter() - t0
            _figures(cfg, rec, step)
            rec["planned_from_blocks"] = None
            rec["null_reasons"]["planned_from_blocks"] = \
                "train.plan_depth=full" if cfg.train.plan_depth == "full" else \
                f"every block traced (models of {cfg.model.num_layers} blocks are)"
        else:
            _deep(cfg, rec, depths)
            rec["plan_s"] = time.perf_counter() - t0
    rec["planned_memory_basis"] = memory_basis(cfg)
    record_pp_columns(rec, cfg, PIPELINE)
    fill_null_reasons(rec, WHY)


PIPELINE = ("planned_pp_stage_peaks_gib", "planned_pp_bubble_share", "planned_pp_send_gib",
            "planned_pp_stage_ms")


def _deep(cfg, rec: dict, depths: tuple[int, int]) -> None:
    """The plan of cfg's model from plans of `depths` blocks, on the line through them."""
    from .depth import at_depth, extrapolate
    from .trace import trace_step

    recs, steps = [], []
    for d in depths:
        phase(f"tracing {d} of the model's {cfg.model.num_layers} blocks")
        shallow, got = at_depth(cfg, d), {"null_reasons": {}}
        steps.append(trace_step(shallow))
        _figures(shallow, got, steps[-1])
        recs.append(got)
    line, peak, at_peak = extrapolate(cfg, depths, recs, steps)
    rec.update(line)  # (figures not on a line, as tokens/s, are set again below)
    rec["calibration_s"] = recs[0].get("calibration_s")  # (made, if at all, by the first)
    rec["null_reasons"] = recs[0]["null_reasons"]
    rec["planned_from_blocks"] = list(depths)
    _params(cfg, rec)
    _memory(cfg, rec, peak, at_peak)
    if rec.get("planned_step_ms") is not None:
        _rates(cfg, rec, rec["planned_step_ms"], _tokens(cfg))


def _pipelined(cfg, rec: dict) -> None:
    """A pipeline's plan: each pp rank traced (its stages, the real schedule), the step's
    time the schedule's simulated span over the traced actions' times, their collectives
    included (plan/pipeline.py), plus the slowest rank's own work beside them (its
    optimizer step, its collectives outside the actions). The record's memory and
    collectives are the rank with the largest peak's; every stage's peak is in
    planned_pp_stage_peaks_gib.

    Stages of many blocks are traced at two small depths a stage, each rank's figures
    and each action's time taken on the line through them at its stages' depths
    (plan/depth.py: stage_depths)."""
    from .depth import at_stage_depth, on_line, stage_depths, stage_moe_blocks
    from .pipeline import each_action, schedule_order, simulate

    depths = stage_depths(cfg)
    if depths is None:
        ranks = _pp_ranks(cfg)
    else:
        (a, _), per = depths, stage_moe_blocks(cfg)
        shallow = [_pp_ranks(at_stage_depth(cfg, d), f"{d} blocks a stage") for d in depths]
        ranks = []
        for x, y in zip(*shallow):
            mine = [per[s] for s, _ in x["tags"]]
            f = sum(mine) / len(mine) - a  # (the rank's stages' mean depth, less a)
            got, peak, at_peak = on_line(f, [x["rec"], y["rec"]], [x["phases"], y["phases"]])
            got["null_reasons"] = x["rec"]["null_reasons"]
            _memory(cfg, got, peak, at_peak)
            tags = {t: x["tags"][t] + (per[t[0]] - a) * (y["tags"][t] - x["tags"][t])
                    for t in x["tags"]}
            ranks.append({**x, "rec": got, "tags": tags,
                          "flops": x["flops"] + f * (y["flops"] - x["flops"])})
    recs = [r["rec"] for r in ranks]
    worst = max(range(len(recs)), key=lambda i: recs[i]["planned_peak_gib"])
    rec.update(recs[worst])
    if depths is not None:
        rec["planned_from_blocks"] = list(depths)  # (a stage's MoE blocks)
    _params(cfg, rec)
    rec["planned_pp_stage_peaks_gib"] = [g["planned_peak_gib"] for g in recs]
    rec["planned_pp_send_gib"] = max(r["send"] for r in ranks) / GIB
    rec["planned_flops_per_step"] = sum(r["flops"] for r in ranks) / len(ranks)  # (a device's)
    why, m = rec["null_reasons"], pp_microbatches(cfg.parallel)
    if rec.get("planned_step_ms") is None:
        for k in ("planned_pp_bubble_share", "planned_pp_stage_ms"):
            rec[k] = None
            why[k] = why.get("planned_step_ms", WHY)
        return
    seconds, rest = {}, []
    for r in ranks:
        seconds.update(each_action(r["tags"], m))
        rest.append(r["rec"]["planned_step_ms"] - sum(r["tags"].values()) * 1e3)
    span, busy, posted = simulate(schedule_order(cfg.parallel, m), seconds,
                                  *ranks[0]["handoff"])
    # (the bubble: waiting on other ranks; posting a send is the rank's own work)
    rec["planned_pp_bubble_share"] = sum(1 - (b + p) / span
                                         for b, p in zip(busy, posted)) / len(busy)
    rec["planned_pp_stage_ms"] = [b * 1e3 for b in busy]
    rec["planned_step_ms"] = span * 1e3 + max(rest)
    _rates(cfg, rec, rec["planned_step_ms"], _tokens(cfg))


def _pp_ranks(cfg, depth: str = "") -> list[dict]:
    """Each pp rank of cfg traced: its figures (rec), memory phases, sends' bytes, FLOPs,
    actions' seconds ((stage, kind) -> seconds, every micro-batch's) and one hand-off's.

    Where the ranks between the second and the last but one hold alike stages, only those
    two of them are traced: their actions are alike, and their memory differs by the
    micro-batches each holds in flight, which falls by the same count a rank in 1F1B and
    interleaved 1F1B; each between is on the line through them."""
    from .depth import on_line, phases_on_line
    from .pipeline import traced_ranks
    from .roofline import call_seconds
    from .trace import trace_step

    wait, ranks = Status.current, traced_ranks(cfg)
    pp, keep = len(ranks), _traced_pp_ranks(cfg)
    what = wait.what.rsplit(", rank 0 of", 1)[0].split(", pp rank")[0] if wait else ""
    out = {}
    for n, i in enumerate(keep):
        if wait:  # (the trace's own phases follow it: forward, block k of n, ...)
            wait.what = f"{what}, pp rank {i + 1} ({n + 1} of {len(keep)} traced; rank " \
                        f"{ranks[i]:,} of {cfg.hardware.devices:,}" \
                        f"{', ' + depth if depth else ''})"
        got, step = {"null_reasons": {}}, trace_step(cfg, rank=ranks[i])
        calls = call_seconds(step.ops, cfg.hardware)  # (once: the step's, actions', sends')
        _figures(cfg, got, step, calls)
        each = calls[0]
        out[i] = {"rec": got, "phases": step.phases, "flops": step.flops,
                  "send": step.comm.get("send", {}).get("bytes", 0),
                  "tags": _action_seconds(cfg, step, each),
                  "handoff": _handoff_s(cfg, step, each)}
    x, y = out[1] if pp > 2 else None, out[pp - 2] if pp > 2 else None
    for i in range(pp):
        if i in out:
            continue
        f = (i - 1) / (pp - 3)
        got, peak, at_peak = on_line(f, [x["rec"], y["rec"]], [x["phases"], y["phases"]])
        got["null_reasons"] = x["rec"]["null_reasons"]
        _memory(cfg, got, peak, at_peak)
        out[i] = {**x, "rec": got, "phases": phases_on_line(f, x["phases"], y["phases"]),
                  "tags": {(s + i - 1, k): v for (s, k), v in x["tags"].items()}}
    return [out[i] for i in range(pp)]


def _traced_pp_ranks(cfg) -> list[int]:
    """The pp ranks a plan traces: the first two and the last two where the ranks between
    hold stages of the same blocks as the second (train.plan_depth=auto), else every one."""
    from ..config import pp_stages

    p, layers = cfg.parallel, cfg.model.num_layers
    pp, first = p.pp, pp_stages(cfg) + [layers]
    size = [b - a for a, b in zip(first, first[1:])]
    held = [[size[s] for s in range(r, len(size), pp)] for r in range(pp)]
    if cfg.train.plan_depth == "full" or pp < 5 or any(h != held[1] for h in held[1:-1]):
        return list(range(pp))
    return [0, 1, pp - 2, pp - 1]


def _call_seconds(cfg, ops, calls=None) -> tuple[list | None, str | None]:
    """roofline.call_seconds (or calls, its result already made), a pipeline's sends at 0
    (its schedule's simulation places them)."""
    from .roofline import call_seconds

    each, why = calls or call_seconds(ops, cfg.hardware)
    if each is not None and pp_size(cfg.parallel) > 1:
        each = _no_sends(ops.calls, each)
    return each, why


def _no_sends(calls, each: list) -> list:
    from .roofline import P2P

    return [0.0 if c[0] in P2P else t for c, t in zip(calls, each)]


def _handoff_s(cfg, step, each: list | None) -> tuple[float, float]:
    """One micro-batch's hand-off between stages, in seconds: the traced sends' mean (each:
    the step's call_seconds), and its sender's time posting it (a task=comm record's
    send_post, else 0)."""
    from .roofline import comm_curves, measured_s

    hw = cfg.hardware
    sends = [(t, b) for (name, b, _), t in zip(step.ops.calls, each or []) if name == "send"]
    if not sends:
        return 0.0, 0.0
    post = (comm_curves(hw.comm_from) if hw.comm_from else {}).get("send_post")
    return (sum(t for t, _ in sends) / len(sends),
            sum(measured_s(post, "send", b, 2) for _, b in sends) / len(sends) if post
            else 0.0)


def _action_seconds(cfg, step, each: list | None) -> dict:
    """The seconds of the ops each pipeline action ran (each: the step's call_seconds),
    summed over micro-batches:
    (stage, kind) -> seconds, at the plan's basis: the calibration's rates with the
    action's own collectives overlapped as the step's are (expert parallel's all-to-alls,
    FSDP2's gathers), else the datasheet's roofline plus those collectives."""
    import copy

    from .roofline import compute_ms

    ops, out, hw = step.ops, {}, cfg.hardware
    each = _no_sends(ops.calls, each) if each else [0.0] * len(ops.calls)
    if hw.calibration:
        from .calibrate import calibration_for

        cal = calibration_for(cfg)[0]
        cal.attention = cfg.train.attention
    for tag in dict.fromkeys(t for t in ops.tags if t is not None):
        keep = [t == tag for t in ops.tags]
        sub = copy.copy(ops)
        sub.ops = [o for o, k in zip(ops.ops, keep) if k]
        sub.io = [x for x, k in zip(ops.io, keep) if k] if ops.io else []
        sub.split = None
        sub.dispatched = round(ops.dispatched * len(sub.ops) / max(1, len(ops.ops)))
        mine = {o[3][1] for o in sub.ops if o[3] and o[3][0] == "comm"}
        comm = [t if i in mine else 0.0 for i, t in enumerate(each)]
        if hw.calibration:
            launches = cal.launches(sub, cfg.precision.name,
                                    cfg.train.activation_checkpointing)
            out[tag] = cal.timeline(launches, comm)[0] - cal.data.get("step_us", 0.0) / 1e6
        else:
            out[tag] = (compute_ms(sub, hw, cfg.precision.name)[0] or 0.0) / 1e3 + sum(comm)
    return out


def _tokens(cfg) -> int:
    """A step's tokens over every rank (tensor-parallel ranks share theirs)."""
    t = cfg.train
    return t.micro_batch_size * t.grad_accum_steps * t.seq_len * \
        data_ranks(cfg.parallel, cfg.hardware.devices)


def _params(cfg, rec: dict) -> None:
    from ..bench.flops import param_counts

    counts = param_counts(cfg.model)
    rec.update(params_total=counts["params_total"], params_active=counts["params_active"])


def _memory(cfg, rec: dict, peak: int, at_peak: dict) -> None:
    """The peak, its bytes by kind and whether it fits, into rec."""
    rec["planned_peak_gib"] = peak / GIB
    for k in KINDS:
        rec[f"planned_{k}_gib"] = at_peak.get(k, 0) / GIB
    mem = plan_memory_gib(cfg.hardware)
    if mem:
        rec["planned_fits"] = bool(rec["planned_peak_gib"] <= mem * (1 - HEADROOM))
        rec["planned_memory_gib"] = float(mem)
    else:
        rec["planned_fits"] = rec["planned_memory_gib"] = None
        rec["null_reasons"]["planned_fits"] = rec["null_reasons"]["planned_memory_gib"] = (
            f"hardware={cfg.hardware.name} gives no memory_gib (read from the device when "
            "run): set hardware.memory_gib=<GiB per device>")


def _figures(cfg, rec: dict, step, calls=None) -> None:
    _params(cfg, rec)
    _memory(cfg, rec, step.peak_bytes, step.at_peak)
    rec["planned_flops_per_step"] = step.flops
    rec["planned_comm"] = {k: {"calls": v["calls"], "gib": v["bytes"] / GIB}
                           for k, v in sorted(step.comm.items())}
    rec["planned_comm_gib"] = sum(v["gib"] for v in rec["planned_comm"].values())
    rec["world_size"] = world = cfg.hardware.devices
    rec["planned_comm_groups"] = {
        g: {k: {"calls": v["calls"], "gib": v["bytes"] / GIB} for k, v in kinds.items()}
        for g, kinds in step.ops.comm_by_group(mesh_dims(cfg.parallel, world, world)).items()}
    phase("the step's time")
    _times(cfg, rec, step, _tokens(cfg), calls)


# what a task=bench run records of its plan (train.plan)
BENCH = ("plan_s", "planned_peak_gib", "planned_step_ms", "planned_compute_ms",
         "planned_comm_ms", "planned_comm_exposed_ms", "planned_tokens_per_s",
         "planned_comm_gib", "planned_time_basis", "planned_memory_basis",
         "planned_kernel_ms", "calibration_s", *PIPELINE)


def bench_plan(cfg) -> dict:
    """A task=bench run's plan, made before any work where train.plan is on: BENCH's keys.

    Where the plan cannot be made, each key is null with its reason; a plan that fails never
    fails the run."""
    from .trace import unplannable

    rec, why = {"null_reasons": {}}, None
    if not cfg.train.plan:
        why = "train.plan=false"
    elif cant := unplannable(cfg):
        why = f"not planned: {cant[1]}"
    else:
        try:
            plan_step(cfg, rec)
        except Exception as e:  # noqa: BLE001 - the plan is a check on the run, not the run
            why = f"the plan failed: {type(e).__name__}: " \
                  f"{(str(e).strip().splitlines() or [''])[0][:200]}"
    out = {k: rec.get(k) for k in BENCH}
    out["null_reasons"] = {k: why or rec["null_reasons"].get(k, WHY) for k in BENCH
                           if out[k] is None}
    return out


def too_big(cfg, planned: dict) -> str | None:
    """The pre-flight's verdict on a planned peak: why the run cannot fit, else None.

    It must fit the device's memory, and on a CPU what is free of it now. A GPU holds one
    rank; a CPU's memory holds all of this machine's ranks together."""
    from ..bench.memory import free_bytes
    from ..ranks import rank_env

    mem, peak = cfg.hardware.memory_gib, planned.get("planned_peak_gib")
    if peak is None:
        return None
    n = cfg.hardware.devices if cfg.hardware.device == "cpu" else 1
    # (not on a torchrun rank: each rank reads it at its own moment, and all must agree)
    free = free_bytes(cfg.hardware.device) if rank_env() is None else None
    free = None if free is None else free / GIB
    if (not mem or peak * n <= mem) and (free is None or peak * n <= free):
        return None
    where = f"{n} CPU ranks" if n > 1 else "a device"
    has = f"hardware={cfg.hardware.name} has {mem:,.3g} GiB" if mem and peak * n > mem else \
        f"this machine has {free:,.3g} GiB free now"
    return (f"train.micro_batch_size: the plan of this step peaks at {peak * n:,.3g} GiB on "
            f"{where} (task=plan for its split); {has} (a smaller micro-batch, activation "
            "checkpointing or more sharding; train.plan=false runs it anyway)")


def plan_memory_gib(hw) -> float | None:
    """The memory a plan fits against, in GiB.

    The device's memory_gib, set or read from the device where it is here; else the part's
    spec_memory_gib from its profile."""
    return hw.memory_gib or hw.spec_memory_gib


def _times(cfg, rec: dict, step, tokens: int, calls=None) -> None:
    """The step time, tokens/s and MFU into rec; `tokens` counts every rank's.

    With hardware.calibration, the compute at its rates and the collectives beside it,
    as the strategy overlaps them (planned_comm_exposed_ms: what they add); else the
    datasheet's roofline, a floor, and the collectives after it."""
    from .roofline import compute_ms

    why, hw = rec["null_reasons"], cfg.hardware
    each, why_comm = _call_seconds(cfg, step.ops, calls)
    rec["planned_comm_ms"] = None if each is None else sum(each) * 1e3
    if hw.calibration:
        step_ms, why_compute = _calibrated_ms(cfg, rec, step.ops, each)
    else:
        rec["planned_compute_ms"], why_compute = compute_ms(step.ops, hw, cfg.precision.name)
        rec["planned_time_basis"], rec["planned_kernel_ms"], rec["calibration_s"] = \
            "datasheet", None, None
        why["planned_kernel_ms"] = why["calibration_s"] = "hardware.calibration=null: the " \
            "datasheet's roofline, a floor"
        step_ms = None if why_compute or why_comm else \
            rec["planned_compute_ms"] + rec["planned_comm_ms"]
        rec["planned_comm_exposed_ms"] = rec["planned_comm_ms"]
    if why_compute or why_comm:
        for k in ("planned_step_ms", "planned_tokens_per_s", "planned_mfu",
                  "planned_comm_exposed_ms"):
            rec[k], why[k] = None, why_compute or why_comm
        for k, text in (("planned_compute_ms", why_compute), ("planned_comm_ms", why_comm)):
            if text:
                rec[k], why[k] = None, text
        return
    rec["planned_step_ms"] = step_ms
    _rates(cfg, rec, step_ms, tokens)


def _rates(cfg, rec: dict, ms: float, tokens: int) -> None:
    """Tokens/s and MFU of a step of `ms` into rec; `tokens` counts every rank's."""
    hw = cfg.hardware
    peak = (hw.peak_flops or {}).get(cfg.precision.name)
    rec["planned_tokens_per_s"] = tokens / (ms / 1e3)
    rec["planned_mfu"] = rec["planned_flops_per_step"] / (ms / 1e3) / peak if peak else None
    if not peak:
        rec["null_reasons"]["planned_mfu"] = f"no peak FLOP/s known for hardware={hw.name} " \
                                             f"at precision={cfg.precision.name}"


def _calibrated_ms(cfg, rec: dict, ops, comm: list | None) -> tuple[float | None, str | None]:
    """The step's time at a calibration's rates with its collectives overlapped, in ms, or
    None and why not. Into rec: the compute alone, the collectives' exposed share, the
    kernels' busy time, the calibration's source and (where made now) its making's time."""
    from .calibrate import calibration_for
    from .calibration import CalibrationError

    why = rec["null_reasons"]
    try:
        cal, made = calibration_for(cfg)
        cal.attention = cfg.train.attention
        launches = cal.launches(ops, cfg.precision.name, cfg.train.activation_checkpointing,
                                compiled=cfg.train.compile != "off")
        alone, busy = cal.timeline(launches)
        both = cal.timeline(launches, comm)[0] if comm else alone
    except CalibrationError as e:
        return None, str(e)
    rec["planned_compute_ms"] = alone * 1e3
    rec["planned_comm_exposed_ms"] = (both - alone) * 1e3 if comm is not None else None
    rec["planned_time_basis"] = f"calibration {cal.label()}"
    rec["planned_kernel_ms"], rec["calibration_s"] = busy * 1e3, made
    if made is None:
        why["calibration_s"] = f"read from {cal.source}: made before this run"
    return both * 1e3, None
