"""task=bench: build the model, apply the optimizations, run the measured loop, record."""
from __future__ import annotations

import contextlib
import math
import traceback
import warnings
from pathlib import Path

import torch

from ..config import total_steps
from .observe import record_checkpoints, record_eval, record_grad_norm, record_profile
from ..results import close_record, hold_sigint, release_sigint, stop_signal
from .balance import bias_spread
from .flops import analytic, flops_per_token
from .load import other_share

DENSE = "dense model (model.num_experts=0)"  # why its expert figures are null
from .loop import Diverged, train_loop
from .memory import GIB, MemoryMeter, cpu_memory_cap, is_oom, oom_line
from .metrics import step_metrics
from .timer import own_process


def _tags(choices: dict, cfg) -> list[str]:
    tags = [f"{k}={v}" for k, v in sorted(choices.items())]
    return tags + [f"ac={cfg.train.activation_checkpointing}", f"compile={cfg.train.compile}"]


def resolve_model_dispatch(cfg, device: torch.device) -> None:
    from ..model.moe import grouped_fast, resolve_dispatch
    from ..optimizations.precision import DTYPES

    m = cfg.model
    dtype = DTYPES.get(cfg.precision.autocast_dtype, torch.float32)
    if m.dispatch == "auto":
        m.dispatch = resolve_dispatch("auto", device, dtype, cfg.train.compile != "off",
                                      (m.hidden_size, m.ffn_hidden_size)) \
            if m.num_experts else "loop"
    elif m.dispatch == "grouped" and m.num_experts and not grouped_fast(device, dtype):
        warnings.warn(f"model.dispatch=grouped at precision={cfg.precision.name}: torch's "
                      "grouped_mm has no kernel for it on this GPU and runs its fallback (a "
                      "host sync and a matmul per expert, 9 per MoE layer and step); "
                      "model.dispatch=auto picks loop here", stacklevel=2)


def shared_process(rec: dict, device: str) -> None:
    """A later run of an in-process sweep: the process did not start for it, and on CPU its
    peak RSS counts memory that earlier runs left resident. Those figures become null."""
    why = "a later job of an in-process sweep (sweep.isolate=false): "
    lost = {"startup_s": why + "the process did not start for it"}
    if device == "cpu":
        lost["peak_mem_gib"] = why + "CPU peak RSS counts what earlier jobs left resident"
    for key, reason in lost.items():
        if rec.get(key) is not None:
            rec[key] = None
            rec.setdefault("null_reasons", {})[key] = reason


def bench(cfg, cfg_dict: dict, rec: dict, out_dir: Path, choices: dict, progress: bool,
          d=None, shared: bool = False) -> dict:
    """One measured run. Single process: never raises (the status says what went wrong).
    As a rank (d = distributed.Dist): only divergence is a status (every rank sees the same
    global loss); other errors propagate so the launcher stops all ranks and names this one.
    Rank 0 alone logs to W&B, writes the record and prints the summary.
    shared: a later run of an in-process sweep (see shared_process)."""
    from ..hardware import device_name, torch_device
    from ..tracking import Tracker

    device = torch_device(cfg)
    rec["device_name"] = device_name(device)
    rec["torch_version"] = torch.__version__
    name = "-".join([cfg.model.name, cfg.precision.name, f"ac_{cfg.train.activation_checkpointing}",
                     f"compile_{cfg.train.compile}"])
    if cfg.parallel.name != "none":
        name += f"-{cfg.parallel.name}x{cfg.hardware.devices}"
    main = d is None or d.main
    tracker = held = cap = None
    try:
        if main:
            tracker = Tracker(cfg, cfg_dict, out_dir, _tags(choices, cfg), name, defer=True)
        with _memory_cap(cfg, device, d) as cap:
            _measure(cfg, rec, device, tracker, progress and main, d, out_dir)
        if shared:  # before the record is printed, logged or written
            shared_process(rec, device.type)
        rec["status"] = "ok"
    except Diverged as e:
        rec.update(status="diverged", error=str(e), losses=e.losses)
        if e.losses:
            rec["loss_first"] = e.losses[0]
    except KeyboardInterrupt as e:  # Ctrl-C: a record that says so (a resumed sweep
        # reruns it), with the losses of the steps done
        done, total = getattr(e, "steps", (None, None))
        at = f" at step {done} of {total}" if done is not None else " before the run finished"
        rec.update(status="crashed", error=f"interrupted ({stop_signal(e)}){at}")
        if path := getattr(e, "checkpoint", None):  # (SIGTERM with checkpointing on)
            rec.update(getattr(e, "figures", {}), checkpoint_path=str(path))
            rec["error"] += f"; checkpoint saved: resume with train.resume_from={path}"
        if losses := getattr(e, "losses", None):
            rec.update(losses=losses, loss_first=losses[0], loss_last=losses[-1])
        held = hold_sigint()  # a second SIGINT (ranks get one from the agent too) must
        # not stop the record's write below
        if tracker:  # no W&B start-up for a run the user stopped
            tracker.discard()
        raise
    except Exception as e:  # noqa: BLE001 - a run's failure is a status, not a crash
        rec.update(failure(e, out_dir, main, cap, "" if d is None else f"rank {d.rank}: "))
        if d is not None:  # the launcher stops every rank (run.launch then records which
            # failed; under torchrun this record, rank 0's, says what rank 0 saw)
            raise
    finally:
        if main:  # (tracker: rank 0's only)
            close_record(rec, out_dir, tracker, show_error=not (d and d.launched_here))
        release_sigint(held)
    if not main:
        return rec
    if rec["status"] == "ok":
        from ..summary import print_summary

        print_summary(rec, out_dir / "metrics.json")
    return rec


def failure(e: Exception, out_dir: Path, log: bool = True, cap=None, rank: str = "") -> dict:
    """A run's exception as its record's status and one-line error: an OOM (with the memory
    cap), a nondeterministic op's message, or the first line with error.log's traceback
    (written where `log`)."""
    from ..hardware import nondeterministic_error

    oom = is_oom(e)
    if not oom and log:
        (out_dir / "error.log").write_text(traceback.format_exc())
    first = (str(e).strip().splitlines() or [""])[0][:300]
    if oom:
        first = oom_line(first, cap)
    elif det := nondeterministic_error(e):
        first = det
    return {"status": "oom" if oom else "error",
            "error": rank + (first if oom or det else f"{type(e).__name__}: {first} "
                                                      f"(see {out_dir}/error.log)")}


def _memory_cap(cfg, device: torch.device, d):
    """On CPU, the memory the run may allocate (bench.memory.cpu_memory_cap): this
    machine's ranks share it."""
    if device.type != "cpu":
        return contextlib.nullcontext()
    return cpu_memory_cap(cfg.hardware.memory_gib, cfg.hardware.devices if d else 1)


def _measure(cfg, rec: dict, device: torch.device, tracker, progress: bool, d=None,
             out_dir: Path | None = None) -> None:
    """Build, train the measured steps, record: the run as a plain training loop."""
    from .checkpoint import Checkpointer, find

    memory = MemoryMeter(device)
    resume = find(cfg.train.resume_from) if cfg.train.resume_from else None
    applied, optimizer, scheduler, loader, world = _build(cfg, rec, device, memory, d, resume)
    ckpt = Checkpointer(cfg, applied, optimizer, scheduler, out_dir, d.rank if d else 0, world)
    if resume:
        ckpt.load(resume)
    cached = _graph_counts()
    try:
        res = train_loop(cfg, applied, optimizer, scheduler, loader, device, memory,
                         _tracker_log(cfg, tracker), progress, ckpt)
    except KeyboardInterrupt as e:  # (the record names the checkpoint a SIGTERM saved)
        e.figures = ckpt.figures()[0]
        raise
    graphs = [a - b for a, b in zip(_graph_counts(), cached)]  # this run's
    _compile_cache(rec, cfg, *graphs[:4])
    _cudagraph_skips(rec, cfg, device, graphs[4])
    _record(cfg, rec, res, device, world)
    record_checkpoints(rec, ckpt, res)
    record_profile(cfg, rec, res, device, out_dir if d is None or d.main else None)
    from ..optimizations.parallel.hooks import record_reduce_bytes

    record_reduce_bytes(cfg, rec, applied.reduce_bytes)
    _record_moe(cfg, rec, res, applied.model, device, world)


def _build(cfg, rec: dict, device: torch.device, memory: MemoryMeter, d, resume=None):
    """The model (its memory counted from a baseline taken just before), the optimizations
    applied, the optimizer and the loader (resume: a checkpoint's dir, whose step's
    sequences the loader leaves out)."""
    from ..data import build_loader
    from ..hardware import setup_backends
    from ..model import build_model
    from ..optim import build_optimizer
    from ..optimizations import apply
    from .checkpoint import meta

    t = cfg.train
    setup_backends(cfg)
    rec["init_seed"] = t.seed + cfg.sweep.init_offset  # (sweep.vary_init: repeat i's)
    torch.manual_seed(rec["init_seed"])
    resolve_model_dispatch(cfg, device)
    # modules the run imports anyway (torch.optim imports dynamo lazily), loaded before the
    # memory baseline: on CPU their RSS (~45 MiB) would count as the run's memory
    import torch._dynamo as _  # noqa: F401 (binds no local `torch`)

    memory.baseline()
    with torch.device(device):
        model = build_model(cfg.model)
    rec.update(analytic(cfg.model, t.seq_len),
               moe_dispatch=cfg.model.dispatch if cfg.model.num_experts else None)
    assert rec["params_total"] == sum(p.numel() for p in model.parameters())
    if d is not None:  # every rank starts from the same weights (the seed), as one process
        torch.manual_seed(t.seed + 1 + d.rank)
    rank, world = (d.rank, d.world) if d else (0, 1)
    rec["world_size"] = world  # (a run that fails from here on has it too)
    applied = apply(model, cfg, device, world)
    optimizer, scheduler, rec["optim_impl"] = build_optimizer(applied.model, cfg, device)
    num_samples = total_steps(t) * t.grad_accum_steps * t.micro_batch_size
    done = meta(resume)["step"] if resume else 0
    loader = build_loader(cfg, device, num_samples, rank, world,
                          done * t.grad_accum_steps * t.micro_batch_size)
    return applied, optimizer, scheduler, loader, world


def _tracker_log(cfg, tracker):
    """The loop's on_log: each step's loss and learning rate to the tracker."""
    if tracker is None:
        return None

    def on_log(step, values, lrs, norms):
        first = step + 1 - len(values)
        for i, (v, lr, g) in enumerate(zip(values, lrs, norms)):
            tracker.log({"loss": v, "lr": lr} | ({"grad_norm": g} if math.isfinite(g) else {}),
                        step=first + i)

    return on_log


def _record(cfg, rec: dict, res, device: torch.device, world: int) -> None:
    """The loop's figures into the record (bench.metrics derives them), each null with its
    reason."""
    t, why = cfg.train, rec["null_reasons"]
    tm, (mem, mem_why) = res.timings, res.memory
    if world > 1:  # the slowest rank sets the pace; the largest peak is what must fit
        _across_ranks(res, tm, mem, device)
    peak = cfg.hardware.peak_flops.get(cfg.precision.name)
    rec.update(step_metrics(
        tm["step_ms"], tm, tokens_per_step=t.micro_batch_size * t.grad_accum_steps * t.seq_len,
        world=world, wall_s=res.wall_s, first_step_s=res.first_step_s,
        compiled=t.compile != "off", flops_per_token=rec["flops_per_token"], peak_flops=peak,
        startup_s=res.startup_s if own_process() else None),
        loss_first=res.losses[0], loss_last=res.losses[-1], losses=res.losses,
        lrs=res.lrs, gc_ms=res.gc_ms, gc_collections=res.gc_collections)
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

    rec["tracked_peak_gib"] = None if res.tracked_peak is None else res.tracked_peak / GIB
    if res.tracked_why:
        why["tracked_peak_gib"] = res.tracked_why
    record_errors(rec, device.type == "cpu")
    rec.update(comm_ms=res.comm_ms, comm_share=res.comm_share,  # (nulls present: a sweep's
               comm_exposed_ms=res.comm_exposed_ms)  # table has the columns for every row)
    if res.comm_ms is None:
        why["comm_ms"] = why["comm_share"] = why["comm_exposed_ms"] = (
            "one rank: no communication" if world == 1 else
            "parallel.profile_steps=0 or train.steps <= profile_steps")


def _record_moe(cfg, rec: dict, res, model, device: torch.device, world: int) -> None:
    """Expert load and router losses; the padded dispatch's fallbacks."""
    from .experts import load_stats

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


def _graph_counts() -> tuple[int, int, int, int, int]:
    """(graphs dynamo captured, graphs inductor took from its cache, compiled and stored,
    compiled bypassing the cache, run without the CUDA graphs their mode asked for) in this
    process so far."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return (counters["stats"]["unique_graphs"], c["fxgraph_cache_hit"],
            c["fxgraph_cache_miss"], c["fxgraph_cache_bypass"], c["cudagraph_skips"])


CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that use them


def _compile_cache(rec: dict, cfg, graphs: int, hit: int, miss: int, bypass: int) -> None:
    """compile_cache_hit_share: of the graphs this run needed compiled, the share that came
    from a cache (a warm one makes compile_s a fraction of a cold compile): inductor's on
    disk, or, where dynamo captured no new graph, this process's earlier compile of the same
    model (an in-process sweep's later job). The counts: this run's _graph_counts."""
    key, why = "compile_cache_hit_share", None
    if cfg.train.compile == "off":
        why = "train.compile=off"
    elif graphs and not hit + miss + bypass:
        why = "inductor's FX graph cache is off (TORCHINDUCTOR_FX_GRAPH_CACHE=0)"
    rec[key] = None if why else hit / (hit + miss + bypass) if graphs else 1.0
    if why:
        rec["null_reasons"][key] = why


def _cudagraph_skips(rec: dict, cfg, device: torch.device, skips: int) -> None:
    """cudagraph_skips: compiled graphs inductor ran without CUDA graphs under a mode that
    asks for them (e.g. data-dependent shapes: the loop dispatch's per-expert sizes)."""
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
    """moe_padded_fallback_share: of the eager padded MoE calls (warmup included, summed
    over ranks), the share that ran unpadded (grouped/loop: unbalanced routing)."""
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
    """Other processes' CPU share with several ranks: per host, the busy ticks less every
    local rank's own (siblings are ours, whoever launched them); the busiest host's."""
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
    """every (rank, key, step) per-step times -> {key: per step, from that step's slowest
    rank (by step_ms)}."""
    slowest = every[:, keys.index("step_ms")].argmax(0)
    pick = every[slowest, :, torch.arange(every.shape[2], device=every.device)]  # (step, key)
    return {k: pick[:, i].tolist() for i, k in enumerate(keys)}


def _across_ranks(res, tm: dict, mem: dict, device) -> None:
    """Each step's times -> those of the rank whose step was slowest (its phases with it,
    so they add up to its step); peaks, comm (time and share) and the per-step expert
    imbalance -> max; expert counts -> summed; the aux losses (each rank's, on its
    micro-batches) -> mean over ranks."""
    import torch.distributed as dist

    from ..distributed import all_gather_stack, all_max, all_mean, collective_device

    dev = collective_device(device)
    keys = list(tm)
    every = all_gather_stack(torch.tensor([tm[k] for k in keys], dtype=torch.float64,
                                          device=dev))  # (rank, key, step)
    tm.update(slowest_rank_steps(every, keys))
    mkeys = sorted(mem)  # the same keys on every rank, nulls included
    vals = all_max([*(mem[k] for k in mkeys), res.comm_ms, res.comm_share,
                    res.comm_exposed_ms, res.step_max_over_mean], dev)
    mem.update(zip(mkeys, vals))
    res.comm_ms, res.comm_share, res.comm_exposed_ms, res.step_max_over_mean = vals[-4:]
    if res.counts is not None:
        dist.all_reduce(res.counts)
        choices = torch.tensor([res.choices], dtype=torch.float64, device=dev)
        dist.all_reduce(choices)
        res.choices = int(choices.item())
    if res.balance is not None:
        res.balance, res.z, res.seq_balance = all_mean(torch.tensor(
            [res.balance, res.z, res.seq_balance], dtype=torch.float64, device=dev)).tolist()
