"""The measured training loop: warmup steps, then timed steps with a phase breakdown."""
from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..config import total_steps
from .memory import MemoryMeter
from .load import snapshot, window
from .timer import StepTimer, device_sync, process_age_s


class Diverged(Exception):
    def __init__(self, msg: str, losses: list | None = None):
        super().__init__(msg)
        self.losses = losses  # every step's loss before the first non-finite one


@dataclass
class LoopResult:
    losses: list = field(default_factory=list)  # per optimizer step (mean over micro-batches)
    timings: dict = field(default_factory=dict)
    first_step_s: float | None = None
    wall_s: float | None = None  # the measured window, wall clock
    counts: torch.Tensor | None = None  # tokens per expert summed over measured steps
    # per micro-step and layer, the busiest expert's tokens / the mean (rows-weighted mean)
    step_max_over_mean: float | None = None
    balance: float | None = None  # mean load-balancing loss over measured steps
    z: float | None = None
    steps_done: int = 0
    comm_ms: float | None = None  # per step, from the profiled last steps (distributed only)
    comm_share: float | None = None  # comm_ms / those profiled steps' own time
    startup_s: float | None = None  # process start -> first measured step (compile included)
    cpu_window: tuple | None = None  # CPU ticks in the window: load.window's tuple
    memory: tuple = ({}, {})  # MemoryMeter.read() at the window's end (before any profiler)


def micro_step(model, tokens, targets, autocast, scaler, accum: int, timer=None):
    """Forward and backward of one micro-batch; gradients accumulate over `accum` of them."""
    with autocast():
        out = model(tokens, targets)
    loss = out.loss / accum
    if timer:
        timer.lap("forward")
    (scaler.scale(loss) if scaler else loss).backward()
    if timer:
        timer.lap("backward")
    return out


def _profiler(device):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts)


_KINETO_MARKS = ("USDT:", "STAGE:")


@contextlib.contextmanager
def _kineto_quiet():
    """Kineto writes profiler_start/stop marks straight to fd 2 at every start and stop (no
    log level silences them; each rank would print them): catch fd 2 for just that call and
    pass every other line on. Where fd 2 cannot be caught, nothing is."""
    try:
        if sys.stderr is not None:
            sys.stderr.flush()
        tmp = tempfile.TemporaryFile()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    try:
        os.dup2(tmp.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        with tmp:
            tmp.seek(0)
            lines = tmp.read().decode(errors="replace").splitlines(keepends=True)
        out = "".join(x for x in lines if not x.startswith(_KINETO_MARKS))
        if out:
            os.write(2, out.encode())


def train_loop(cfg, applied, optimizer, scheduler, loader, device: torch.device,
               memory: MemoryMeter, on_log=None, progress: bool = True) -> LoopResult:
    t = cfg.train
    model, autocast, scaler = applied.model, applied.autocast, applied.scaler
    params = [p for g in optimizer.param_groups for p in g["params"]]
    total = total_steps(t)
    timer, res = StepTimer(device), LoopResult()
    # Per-step figures go into buffers made once: small tensors kept from every step would
    # pin freed heap between them (on CPU the run's peak RSS grew with train.steps).
    losses = torch.zeros(total, device=device)  # each step's loss, read at each log
    moe_sums = torch.zeros(3, dtype=torch.float64, device=device)  # balance, z, busiest
    moe_n, logged = 0, 0  # measured MoE micro-steps; steps whose loss has been read
    it = iter(loader)
    tty = sys.stderr.isatty()
    bar = tqdm(total=total, desc="warmup", unit="step", disable=not progress,
               mininterval=0.5 if tty else 10.0, dynamic_ncols=True)
    model.train()
    # Distributed: the last profile_steps measured steps run under torch.profiler to time
    # the collectives; they are left out of the step-time figures.
    n_prof = cfg.parallel.profile_steps if dist.is_initialized() else 0
    prof_from = total - n_prof if 0 < n_prof < t.steps else total
    prof = None

    def end_window():
        device_sync(device)
        res.wall_s = time.perf_counter() - wall0
        res.cpu_window = window(load0, snapshot())
        res.memory = memory.read()  # (the profiler's own memory is not the run's)

    try:
        for step in range(total):
            measured = step >= t.warmup_steps
            if step == prof_from:  # the window ends where the profiled steps begin
                end_window()
                prof = _profiler(device)
                with _kineto_quiet():
                    prof.__enter__()
                prof_t0 = time.perf_counter()
            if step == t.warmup_steps:
                res.startup_s = process_age_s()
                memory.reset()
                bar.set_description("bench")
                load0 = snapshot()  # (its /proc scan before the clock starts)
                wall0 = time.perf_counter()
            if step == 0:
                t0 = time.perf_counter()
            timer.start()
            step_loss = losses[step]
            for sync_ctx in applied.micro_contexts(t.grad_accum_steps):
                tokens, targets = next(it)
                tokens = tokens.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
                timer.lap("data")
                with sync_ctx:
                    out = micro_step(model, tokens, targets, autocast, scaler,
                                     t.grad_accum_steps, timer)
                step_loss += out.ce.detach() / t.grad_accum_steps
                if measured and step < prof_from and out.counts.numel():
                    res.counts = (out.counts.clone() if res.counts is None  # (a CUDA
                                  # graph's output is overwritten by its next replay)
                                  else res.counts.add_(out.counts))
                    moe_sums[0] += out.balance.detach()
                    moe_sums[1] += out.z.detach()
                    moe_sums[2] += out.counts.max(dim=1).values.sum()
                    moe_n += 1
            if applied.before_step:  # gradient sync outside DDP/FSDP's hooks (expert
                # parallelism): backward's, as under DDP/FSDP
                applied.before_step()
                timer.lap("backward")
            if scaler:
                scaler.unscale_(optimizer)
            if cfg.optim.grad_clip > 0:
                (applied.clip or torch.nn.utils.clip_grad_norm_)(params, cfg.optim.grad_clip)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            timer.lap("optimizer")
            if measured and step < prof_from:
                timer.end()
            if step == 0:
                device_sync(device)
                res.first_step_s = time.perf_counter() - t0
            res.steps_done = step + 1
            if (step + 1) % t.log_every == 0 or step + 1 == total:
                new = losses[logged: step + 1]
                if dist.is_initialized():  # the global batch's loss: same on every rank
                    from ..distributed import all_mean

                    new = all_mean(new)
                values = new.tolist()  # one sync per log interval
                logged = step + 1
                res.losses.extend(values)
                bar.set_postfix(loss=f"{values[-1]:.3f}", refresh=tty)  # (off a terminal:
                # the bar every 10 s, not every log)
                if on_log:
                    on_log(step, values)
                first = len(res.losses) - len(values)  # step of values[0]
                bad = next((first + i for i, v in enumerate(values) if not math.isfinite(v)), None)
                if bad is not None:  # the first non-finite step, whatever log_every is
                    raise Diverged(f"loss became {res.losses[bad]} at step {bad}",
                                   res.losses[:bad])
            bar.update(1)
        if res.wall_s is None:
            end_window()
        if prof is not None:
            device_sync(device)
            prof_ms = (time.perf_counter() - prof_t0) * 1e3 / (total - prof_from)
            with _kineto_quiet():
                prof.__exit__(None, None, None)
            from ..optimizations.parallel import comm_ms_per_step

            res.comm_ms = comm_ms_per_step(prof, total - prof_from)
            if res.comm_ms is not None:  # (the same steps: the median step is not)
                res.comm_share = res.comm_ms / prof_ms
            prof = None
    except KeyboardInterrupt as e:  # the record keeps the loss of every step done
        if not dist.is_initialized():  # (ranks: only the logged, global, losses)
            res.losses.extend(losses[logged: res.steps_done].tolist())
        e.losses, e.steps = res.losses, (res.steps_done, total)
        raise
    finally:
        if prof is not None:
            with _kineto_quiet():
                prof.__exit__(None, None, None)
        bar.close()
    res.timings = timer.results()
    if moe_n:  # (busiest: summed over micro-steps and layers, as the mean's rows)
        balance, z, busiest = moe_sums.tolist()
        res.balance, res.z = balance / moe_n, z / moe_n
        res.step_max_over_mean = busiest / (res.counts.sum().item() / res.counts.shape[1])
    return res
