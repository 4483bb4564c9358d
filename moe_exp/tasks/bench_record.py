"""Writes a bench run's figures into its record, each null with its reason.

The figures: speed and memory across ranks, the MoE layers' load, the held-out loss, the
gradient norm, checkpoints, NVML's figures and train.profile's trace."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..train.balance import bias_spread
from ..bench.flops import flops_per_token
from ..bench.load import other_share
from ..bench.memory import GIB
from ..bench.metrics import step_metrics
from ..bench.timer import own_process

DENSE = "dense model (model.num_experts=0)"  # why its expert figures are null


def record_profile(cfg, rec: dict, res, device: torch.device, out_dir: Path | None) -> None:
    """Record NVML's figures and train.profile's trace, table, shares and memory snapshot.

    Rank 0 writes the profile's files into the run's dir."""
    from ..bench.profile import FIELDS, write

    gpu = dict(res.gpu)
    rec["null_reasons"].update(gpu.pop("null_reasons", {}))
    rec.update(gpu)
    rec.update(dict.fromkeys(FIELDS))
    if res.profiler is not None and out_dir is not None:
        rec.update(write(res.profiler, res.memory_snapshot, out_dir, device.type == "cuda"))
    for k in FIELDS:
        if rec[k] is None:
            rec["null_reasons"][k] = (
                "train.profile=false" if not cfg.train.profile else
                "on CUDA only" if k == "memory_snapshot" else "written by rank 0 only")


SPIKE = 10  # a step's gradient norm this many times the run's median: the summary warns


def record_grad_norm(cfg, rec: dict, res) -> None:
    """Every step's gradient norm before clipping, their median, and the largest spike."""
    import statistics

    norms = [g if math.isfinite(g) else None for g in res.grad_norms]
    seen = [g for g in norms if g is not None]
    rec.update(grad_norms=norms if seen else None,
               grad_norm=statistics.median(seen) if seen else None, grad_norm_spike=None)
    if not seen:
        rec["null_reasons"]["grad_norm"] = rec["null_reasons"]["grad_norms"] = (
            "optim.grad_clip=0: the norm is computed only to clip" if cfg.optim.grad_clip <= 0
            else "no finite gradient norm (fp16 overflow steps)")
    for i in range(3, len(norms)):  # the first step at SPIKE x the median of the 20 before
        before = [g for g in norms[max(i - 20, 0):i] if g is not None]
        if norms[i] is not None and before and norms[i] > SPIKE * statistics.median(before):
            rec["grad_norm_spike"] = [i, norms[i] / statistics.median(before)]
            break
    if rec["grad_norm_spike"] is None:
        rec["null_reasons"]["grad_norm_spike"] = f"no step's norm reached {SPIKE}x the median " \
                                                 "of the 20 steps before it"


def record_eval(cfg, rec: dict, res) -> None:
    """Record the held-out loss, its curve, its gap to the floor and the time to target_loss.

    That time is steps x the median measured step, so compile and evals are left out."""
    t, why = cfg.train, rec["null_reasons"]
    curve = res.eval_losses
    rec.update(eval_losses=curve or None, eval_loss=curve[-1][1] if curve else None)
    if not curve:
        why["eval_loss"] = why["eval_losses"] = (
            "train.eval_sequences=0" if not t.eval_sequences else
            "data=tokens: no held-out split (data.heldout=true holds the file's last "
            "train.eval_sequences sequences out of training)")
    floor = rec["loss_floor"]
    rec["eval_gap"] = rec["eval_loss"] - floor if None not in (rec["eval_loss"], floor) else None
    if rec["eval_gap"] is None:
        why["eval_gap"] = why.get("eval_loss") or why["loss_floor"]
    n = res.steps_to_target
    rec["steps_to_target"] = n
    rec["seconds_to_target"] = n * rec["step_time_ms"] / 1e3 if n and rec["step_time_ms"] \
        else None
    if n is None:
        best = min((v for _, v in curve), default=None)
        why["steps_to_target"] = why["seconds_to_target"] = (
            "train.target_loss not set" if t.target_loss is None else
            f"eval loss {best:.4f} at best in {len(res.losses)} steps: train.target_loss="
            f"{t.target_loss} not reached")


def record_checkpoints(rec: dict, ckpt, res) -> None:
    """Record the checkpoints' figures and the share of the measured window their saves blocked.

    The figures are train.checkpoint's. tokens_per_s_wall includes the saves' time; the median
    step does not."""
    figures, why = ckpt.figures()
    rec.update(figures, resumed_from_step=ckpt.resumed["step"] if ckpt.resumed else None)
    rec["checkpoint_share"] = res.checkpoint_s / res.wall_s if ckpt.root and res.wall_s \
        else None
    why.setdefault("checkpoint_share", why.get("checkpoint_saves") or "no measured window")
    if rec["resumed_from_step"] is None:
        why["resumed_from_step"] = "train.resume_from=null"
    for k, v in why.items():
        if rec.get(k) is None:
            rec["null_reasons"][k] = v


def record_run(cfg, rec: dict, res, device: torch.device, world: int, watch=None) -> None:
    """Record the loop's figures, each null with its reason; bench.metrics derives them.

    Tensor-parallel ranks share their tokens: the step's are the data ranks'."""
    from ..config import data_ranks, pp_size, routing_copies

    t, why = cfg.train, rec["null_reasons"]
    tm, (mem, mem_why) = res.timings, res.memory
    if world > 1:  # the slowest rank sets the pace; the largest peak is what must fit
        _across_ranks(res, tm, mem, device, routing_copies(cfg.parallel))
    peak = cfg.hardware.peak_flops.get(cfg.precision.name)
    rec.update(step_metrics(
        tm["step_ms"], tm, tokens_per_step=t.micro_batch_size * t.grad_accum_steps * t.seq_len,
        world=data_ranks(cfg.parallel, world), devices=world, wall_s=res.wall_s,
        first_step_s=res.first_step_s,
        compiled=t.compile != "off", flops_per_token=rec["flops_per_token"], peak_flops=peak,
        startup_s=res.startup_s if own_process() else None),
        loss_first=res.losses[0], loss_last=res.losses[-1], losses=res.losses,
        lrs=res.lrs, gc_ms=res.gc_ms, gc_collections=res.gc_collections)
    if pp_size(cfg.parallel) > 1:
        rec["backward_ms"] = None
        why["backward_ms"] = "parallel.pp: the schedule interleaves the micro-batches' " \
            "forwards and backwards; forward_ms holds both"
    from ..data import markov_floor

    rec["loss_floor"] = markov_floor(cfg)
    if rec["loss_floor"] is None:
        why["loss_floor"] = "data=tokens: a corpus's lowest achievable loss is not known"
    record_eval(cfg, rec, res)
    record_grad_norm(cfg, rec, res)
    if rec["step_time_iqr_ms"] is None:
        why["step_time_iqr_ms"] = "one timed step: an IQR needs two" + (
            f" (of train.steps={t.steps}, the last {t.steps - 1} ran under the profiler for "
            "comm_ms, untimed: raise train.steps)" if t.steps > 1 else
            ": train.steps >= 2")
    if t.compile == "off":
        why["compile_s"] = "train.compile=off"
    if rec["startup_s"] is None:
        why["startup_s"] = "process not started for this run (in-process call), or no /proc"
    if not peak:
        why["mfu"] = why["peak_flops"] = (
            f"no peak FLOP/s known for hardware={cfg.hardware.name} at precision="
            f"{cfg.precision.name}; set ++hardware.peak_flops.{cfg.precision.name}=<FLOP/s>")
    rec["cpu_other_load"] = (other_load_across_ranks(res.cpu_window, device) if world > 1
                             else None if res.cpu_window is None
                             else other_share(*res.cpu_window))
    if rec["cpu_other_load"] is None:
        why["cpu_other_load"] = "no /proc to read the machine's CPU time from"
    rec.update(mem)
    why.update({k: v for k, v in mem_why.items() if mem.get(k) is None})  # (another rank's
    # figure may fill a null)
    from ..plan.check import record_errors

    peak = watch.peak if watch is not None else None
    rec["tracked_peak_gib"] = None if peak is None else peak / GIB
    if watch is not None and watch.why:
        why["tracked_peak_gib"] = watch.why
    record_errors(rec, device.type == "cpu")
    rec.update(comm_ms=res.comm_ms, comm_share=res.comm_share,  # (nulls present: a sweep's
               comm_exposed_ms=res.comm_exposed_ms,  # table has the columns for every row)
               comm_kinds=res.comm_kinds or None)
    if res.comm_ms is None:
        why["comm_ms"] = why["comm_share"] = why["comm_exposed_ms"] = why["comm_kinds"] = (
            "one rank: no communication" if world == 1 else
            "parallel.profile_steps=0 or train.steps <= profile_steps")


PIPELINE = ("pp_bubble_share", "pp_overhead_share", "pp_send_gib", "pp_stage_peaks_gib",
            "pp_stage_ms")


def record_pipeline(cfg, rec: dict, res, model, device: torch.device, world: int) -> None:
    """parallel.pp's figures: the bubble and overhead shares (the ranks' means), the bytes
    a rank sends a step (the most of any rank), each stage's peak and its time in its
    actions a schedule step (its ranks' most). Before record_run, which keeps the ranks'
    largest peak only."""
    from ..config import pp_size, record_pp_columns
    from ..distributed import all_gather_stack, collective_device

    why, pp = rec["null_reasons"], pp_size(cfg.parallel)
    record_pp_columns(rec, cfg, PIPELINE)
    if pp == 1:
        return
    peak, (bubble, busy, over) = res.memory[0].get("peak_mem_gib"), _clock(cfg, model)
    mine = [math.nan if v is None else v
            for v in (peak, bubble, model.send_bytes() / GIB, busy, over)]
    every = all_gather_stack(torch.tensor(mine, dtype=torch.float64,
                                          device=collective_device(device))).tolist()
    per = world // pp  # (ranks of a stage; rank r holds stage r // per, mesh (pp, ...))
    for key, col in (("pp_stage_peaks_gib", 0), ("pp_stage_ms", 3)):
        stages = [max(r[col] for r in every[i * per:(i + 1) * per]) for i in range(pp)]
        rec[key] = None if any(map(math.isnan, stages)) else stages
    for key, col in (("pp_bubble_share", 1), ("pp_overhead_share", 4)):
        got = [r[col] for r in every if not math.isnan(r[col])]
        rec[key] = sum(got) / len(got) if got else None
    rec["pp_send_gib"] = max(r[2] for r in every)
    if rec["pp_stage_peaks_gib"] is None:
        why["pp_stage_peaks_gib"] = res.memory[1].get("peak_mem_gib", "a rank's peak unknown")
    for key in ("pp_bubble_share", "pp_stage_ms", "pp_overhead_share"):
        if rec[key] is None:
            why[key] = ("on a GPU the host's work between actions runs ahead of the device"
                        if key == "pp_overhead_share" and device.type == "cuda"
                        else "no measured step")


def _clock(cfg, model) -> tuple:
    """The medians over the measured steps of a rank's bubble share of its schedule's
    span, its ms in its actions and its overhead share (None on a GPU)
    (PipelineModel.clock), each micro-step's schedule step apart."""
    import statistics

    from ..config import total_steps
    from ..train.loop import profiled_steps

    t, n = cfg.train, cfg.train.grad_accum_steps
    total = total_steps(t)
    start = total - len(model.clock.timed_steps) // n  # (a resumed run's first step)
    first, last = max(t.warmup_steps, start), total - profiled_steps(cfg, True)
    steps = model.clock.steps((first - start) * n, (last - start) * n)
    if not steps:
        return None, None, None
    over = [o for _, _, o in steps if o is not None]
    return (statistics.median(s for s, _, _ in steps),
            statistics.median(b for _, b, _ in steps) * 1e3,
            statistics.median(over) if over else None)


def record_moe(cfg, rec: dict, res, model, device: torch.device, world: int) -> None:
    """Expert load and router losses; the padded dispatch's fallbacks."""
    from ..bench.experts import load_stats

    why = rec["null_reasons"]
    if cfg.model.dispatch == "padded" and cfg.model.capacity_factor is None:
        _padded_fallbacks(model, cfg, rec, device, world)
    elif cfg.model.num_experts and cfg.model.capacity_factor is not None:
        rec["moe_padded_fallback_share"] = None
        why["moe_padded_fallback_share"] = "model.capacity_factor: not counted on the capacity " \
            "path (pad_to_capacity never falls back)"
    else:  # (a sweep's table has the column for every row: say why it is empty)
        rec["moe_padded_fallback_share"] = None
        why["moe_padded_fallback_share"] = (
            f"model.dispatch={cfg.model.dispatch}: only padded falls back"
            if cfg.model.num_experts else DENSE)
    rec["router_bias_spread"] = bias_spread(model)
    if world > 1 and getattr(model, "pipelined", False):  # (a rank: its stages' routers)
        from ..distributed import all_max, collective_device

        rec["router_bias_spread"] = all_max([rec["router_bias_spread"]],
                                            collective_device(device))[0]
    if rec["router_bias_spread"] is None:
        why["router_bias_spread"] = "model.bias_update_rate=0: no routing bias" \
            if cfg.model.num_experts else DENSE
    if res.counts is not None:
        rec.update(load_stats(res.counts, res.choices))
        if rec["drop_rate"]:  # useful FLOPs: the dropped choices computed nothing
            full = rec["flops_per_token"]
            rec["flops_per_token"] = flops_per_token(cfg.model, cfg.train.seq_len,
                                                     rec["drop_rate"])
            for k in ("tflops_per_device", "mfu"):
                if rec.get(k) is not None:
                    rec[k] *= rec["flops_per_token"] / full
        rec["expert_load_step_max_over_mean"] = res.step_max_over_mean
        rec["aux_loss"] = res.balance
        rec["z_loss"] = res.z
        rec["seq_aux_loss"] = res.seq_balance if cfg.model.seq_aux_loss_coef else None
        if rec["seq_aux_loss"] is None:
            why["seq_aux_loss"] = "model.seq_aux_loss_coef=0: not computed"
    else:
        for k in ("aux_loss", "seq_aux_loss", "expert_load_cv", "expert_load_max_over_mean",
                  "expert_load_step_max_over_mean", "moe_dispatch", "drop_rate", "dead_experts",
                  "expert_load_quantiles_per_layer"):
            rec[k] = None
            why[k] = DENSE


def graph_counts() -> tuple[int, int, int, int, int]:
    """Five counts of the graphs this process has compiled or run so far.

    In order: graphs dynamo captured, graphs inductor took from its cache, compiled and
    stored, compiled bypassing the cache, and ran without the CUDA graphs their mode asked
    for."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return (counters["stats"]["unique_graphs"], c["fxgraph_cache_hit"],
            c["fxgraph_cache_miss"], c["fxgraph_cache_bypass"], c["cudagraph_skips"])


CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that use them


def record_compile_cache(rec: dict, cfg, graphs: int, hit: int, miss: int, bypass: int) -> None:
    """Record compile_cache_hit_share: of the graphs this run needed compiled, the share cached.

    The cache is inductor's on disk or, where dynamo captured no new graph, this process's
    earlier compile of the same model, as in an in-process sweep's later job. A warm cache
    makes compile_s a fraction of a cold compile. The counts are this run's graph_counts."""
    key, why = "compile_cache_hit_share", None
    if cfg.train.compile == "off":
        why = "train.compile=off"
    elif graphs and not hit + miss + bypass:
        why = "inductor's FX graph cache is off (TORCHINDUCTOR_FX_GRAPH_CACHE=0)"
    rec[key] = None if why else hit / (hit + miss + bypass) if graphs else 1.0
    if why:
        rec["null_reasons"][key] = why


def record_cudagraph_skips(rec: dict, cfg, device: torch.device, skips: int) -> None:
    """Record cudagraph_skips: graphs run without CUDA graphs under a mode that asks for them.

    Data-dependent shapes cause skips, such as the loop dispatch's per-expert sizes."""
    if cfg.train.compile not in CUDAGRAPH_MODES:
        why = f"train.compile={cfg.train.compile} uses no CUDA graphs"
    elif device.type != "cuda":
        why = f"no CUDA graphs on {device.type}"
    else:
        rec["cudagraph_skips"] = skips
        return
    rec["cudagraph_skips"] = None
    rec["null_reasons"]["cudagraph_skips"] = why


def _padded_fallbacks(model, cfg, rec, device, world: int) -> None:
    """Record moe_padded_fallback_share: the share of eager padded MoE calls that ran unpadded.

    Calls include warmup and are summed over ranks. Unbalanced routing makes a call fall back
    to grouped or loop."""
    from ..distributed import collective_device
    from ..model.moe import MoE

    key = "moe_padded_fallback_share"
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    n = torch.tensor([sum(m.padded_calls for m in layers),
                      sum(m.padded_fallbacks for m in layers)], dtype=torch.float64,
                     device=collective_device(device))
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(n)
    calls, falls = n.tolist()
    rec[key] = falls / calls if calls else None
    if not calls:
        rec["null_reasons"][key] = (
            "train.compile: compiled padded always pads" if cfg.train.compile != "off" else
            f"parallel={cfg.parallel.name}: not counted under expert parallelism"
            if cfg.parallel.name.startswith("expert")
            else "no padded call ran")


def other_load_across_ranks(w, device) -> float | None:
    """Other processes' CPU share with several ranks: the busiest host's.

    Per host, that is the busy ticks less every local rank's own. Sibling ranks count as ours,
    whoever launched them."""
    import hashlib
    import socket

    from ..distributed import all_gather_stack, collective_device

    host = int(hashlib.sha1(socket.gethostname().encode()).hexdigest()[:12], 16)  # < 2**53
    mine = [host, *w] if w is not None else [host, math.nan, math.nan, math.nan, math.nan]
    every = all_gather_stack(torch.tensor(mine, dtype=torch.float64,
                                          device=collective_device(device))).tolist()
    shares = []
    for h in {r[0] for r in every}:
        rows = [r for r in every if r[0] == h and not math.isnan(r[1])]
        if rows:  # busy ticks and CPUs: the host's (every rank read them); ours: summed
            shares.append(other_share(max(r[1] for r in rows), sum(r[2] for r in rows),
                                      max(r[3] for r in rows), int(max(r[4] for r in rows))))
    return max(shares) if shares else None


def slowest_rank_steps(every: torch.Tensor, keys: list[str]) -> dict:
    """Per-step times from each step's slowest rank by step_ms: {key: a value per step}.

    every holds the times as (rank, key, step)."""
    slowest = every[:, keys.index("step_ms")].argmax(0)
    pick = every[slowest, :, torch.arange(every.shape[2], device=every.device)]  # (step, key)
    return {k: pick[:, i].tolist() for i, k in enumerate(keys)}


def _across_ranks(res, tm: dict, mem: dict, device, share: int = 1) -> None:
    """Combine the ranks' step times, peaks, comm, expert counts and aux losses, in place.

    Each step takes the times of the rank whose step was slowest, its phases too, so they add
    up to its step. Peaks, comm time (each kind's too) and share and the per-step expert
    imbalance take the max. Expert counts are summed, divided by `share`: the ranks that
    route the same tokens (tensor parallel's). The aux losses, each rank's over its
    micro-batches, take the mean over ranks."""
    import torch.distributed as dist

    from ..distributed import all_gather_stack, all_max, all_mean, collective_device
    from ..optimizations.parallel import COMM_KINDS

    dev = collective_device(device)
    keys = list(tm)
    every = all_gather_stack(torch.tensor([tm[k] for k in keys], dtype=torch.float64,
                                          device=dev))  # (rank, key, step)
    tm.update(slowest_rank_steps(every, keys))
    mkeys = sorted(mem)  # the same keys on every rank, nulls included
    kinds = [(k, f) for k in COMM_KINDS for f in ("ms", "exposed_ms")]
    vals = all_max([*(mem[k] for k in mkeys),
                    *((res.comm_kinds.get(k) or {}).get(f) for k, f in kinds), res.comm_ms,
                    res.comm_share, res.comm_exposed_ms, res.step_max_over_mean], dev)
    mem.update(zip(mkeys, vals))
    by_kind = dict(zip(kinds, vals[len(mkeys):]))
    res.comm_kinds = {k: {f: by_kind[k, f] for f in ("ms", "exposed_ms")} for k in COMM_KINDS
                      if by_kind[k, "ms"] is not None}
    res.comm_ms, res.comm_share, res.comm_exposed_ms, res.step_max_over_mean = vals[-4:]
    if res.counts is not None:  # (tensor-parallel ranks route the same tokens: once)
        dist.all_reduce(res.counts)
        choices = torch.tensor([res.choices], dtype=torch.float64, device=dev)
        dist.all_reduce(choices)
        res.counts //= share
        res.choices = int(choices.item()) // share
    if res.balance is not None:
        res.balance, res.z, res.seq_balance = all_mean(torch.tensor(
            [res.balance, res.z, res.seq_balance], dtype=torch.float64, device=dev)).tolist()
