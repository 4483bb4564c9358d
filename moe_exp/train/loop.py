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

from ..config import cp_size, total_steps
from ..optimizations.collect import Collector
from .balance import BiasBalancer
from .evaluate import Evaluator
from ..bench.memory import MemoryMeter
from ..bench.nvml import GpuSampler
from ..bench.load import snapshot, window
from ..bench.timer import StepTimer, device_sync, process_age_s
from ..screen import Ticking


class Diverged(Exception):
    def __init__(self, msg: str, losses: list | None = None):
        super().__init__(msg)
        self.losses = losses  # every step's loss before the first non-finite one


@dataclass
class LoopResult:
    losses: list = field(default_factory=list)  # per optimizer step (mean over micro-batches)
    lrs: list = field(default_factory=list)  # each step's learning rate (the first group's)
    grad_norms: list = field(default_factory=list)  # each step's, before clipping (nan: none)
    gc_ms: float | None = None  # Python's collections in the measured window, per step
    gc_collections: int | None = None  # their count
    timings: dict = field(default_factory=dict)
    first_step_s: float | None = None
    wall_s: float | None = None  # the measured window, wall clock
    counts: torch.Tensor | None = None  # tokens per expert summed over measured steps
    choices: int = 0  # (token, choice) pairs each MoE layer routed in them (kept or dropped)
    # per micro-step and layer, the busiest expert's tokens / the mean (rows-weighted mean)
    step_max_over_mean: float | None = None
    balance: float | None = None  # mean load-balancing loss over measured steps
    z: float | None = None
    seq_balance: float | None = None  # the same per sequence (computed where weighted)
    steps_done: int = 0
    comm_ms: float | None = None  # per step, from the profiled last steps (distributed only)
    comm_share: float | None = None  # comm_ms / those profiled steps' own time
    comm_exposed_ms: float | None = None  # of comm_ms, the time no computation overlaps
    comm_kinds: dict = field(default_factory=dict)  # per collective kind: ms, exposed_ms
    startup_s: float | None = None  # process start -> first measured step (compile included)
    cpu_window: tuple | None = None  # CPU ticks in the window: load.window's tuple
    memory: tuple = ({}, {})  # MemoryMeter.read() at the window's end (before any profiler)
    eval_losses: list = field(default_factory=list)  # [steps done, held-out loss]
    steps_to_target: int | None = None  # the first eval step at or below train.target_loss
    gpu: dict = field(default_factory=dict)  # nvml.GpuSampler's fields over the window
    profiler: object = None  # train.profile: the closed torch.profiler of the last steps
    memory_snapshot: dict | None = None  # train.profile on CUDA: one step's allocations
    checkpoint_s: float = 0.0  # the measured window's time blocked by checkpoint saves


def micro_step(model, tokens, targets, autocast, scaler, accum: int, timer=None):
    """Forward and backward of one micro-batch; gradients accumulate over `accum` of them.

    A pipeline's model (parallel.pp) runs both in its forward, its schedule interleaving
    them: the time is forward's."""
    with autocast():
        out = model(tokens, targets)
    if getattr(model, "pipelined", False):
        if timer:
            timer.lap("forward")
        return out
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
# (profile_memory: the CPU allocator logs a free of a block older than the profiler once)
_OLD_BLOCK = "Memory block of unknown size was allocated before the profiling started"


@contextlib.contextmanager
def kineto_quiet():
    """Hide Kineto's profiler start/stop marks (and the CPU allocator's line about a block
    older than a memory profile) from stderr, passing every other line on.

    Kineto writes them straight to fd 2 at every start and stop, no log level silences them,
    and each rank would print them. fd 2 is caught for just that call; where it cannot be
    caught, nothing is."""
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
        out = "".join(x for x in lines if not x.startswith(_KINETO_MARKS)
                      and _OLD_BLOCK not in x)
        if out:
            os.write(2, out.encode())


def profiled_steps(cfg, ranks: bool) -> int:
    """How many of the run's last steps run under torch.profiler, untimed.

    The larger of parallel.profile_steps with several ranks and train.profile_steps with
    train.profile; none where they would leave no timed step."""
    t = cfg.train
    n = max(cfg.parallel.profile_steps if ranks else 0, t.profile_steps if t.profile else 0)
    return n if 0 < n < t.steps else 0


class _Window:
    """The measured window, from the end of warmup to the profiled steps.

    Its wall time, CPU ticks and memory go into the loop's result. With several ranks the
    last parallel.profile_steps steps run under torch.profiler to time the collectives, and
    are left out of the step-time figures."""

    def __init__(self, cfg, device, memory: MemoryMeter, res: LoopResult, start: int = 0):
        t = cfg.train
        self.device, self.memory, self.res = device, memory, res
        # (a resumed run: its steps from the checkpoint's on, warm from the first measured)
        self.total, self.warmup = total_steps(t), max(t.warmup_steps, start)
        n_prof = profiled_steps(cfg, dist.is_initialized())
        self.prof_from = self.total - n_prof
        self.prof = None
        self.wall0 = None
        self.trace = t.profile  # keep the profile (train.profile): its trace is written
        self.snapshot = t.profile and device.type == "cuda"  # a memory snapshot of a step
        self.gpu = GpuSampler(device)

    def pause(self, seconds: float) -> None:
        """Leave time spent outside training, such as an eval, out of the open window."""
        if self.wall0 is not None and self.res.wall_s is None:
            self.wall0 += seconds
        if self.prof is not None:
            self.prof_t0 += seconds

    def measured(self, step: int) -> bool:
        return self.warmup <= step < self.prof_from

    def begin(self, step: int, bar) -> None:
        """At a step's start, open the window after warmup or close it at the profiled steps."""
        if step == self.prof_from + 1 and self.snapshot:
            self._take_snapshot()
        if step == self.prof_from:
            self._end()
            if self.snapshot:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            self.prof = _profiler(self.device)
            with kineto_quiet():
                self.prof.__enter__()
            self.prof_t0 = time.perf_counter()
        if step == self.warmup:
            self.res.startup_s = process_age_s()
            self.memory.reset()
            bar.set_description("bench")
            self.load0 = snapshot()  # (its /proc scan before the clock starts)
            self.gpu.start()
            self.wall0 = time.perf_counter()

    def _end(self) -> None:
        device_sync(self.device)
        self.res.wall_s = time.perf_counter() - self.wall0
        self.res.cpu_window = window(self.load0, snapshot())
        self.res.gpu = self.gpu.stop()
        self.res.memory = self.memory.read()  # (the profiler's own memory is not the run's)

    def _take_snapshot(self) -> None:
        device_sync(self.device)
        self.res.memory_snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self.snapshot = False

    def finish(self) -> None:
        """After the last step: the window's figures, and the profiled steps' comm time."""
        if self.res.wall_s is None:
            self._end()
        if self.prof is None:
            return
        from ..optimizations.parallel import comm_times

        device_sync(self.device)
        n = self.total - self.prof_from
        prof_ms = (time.perf_counter() - self.prof_t0) * 1e3 / n
        self.close()
        if self.snapshot:  # (one profiled step: it ended just now)
            self._take_snapshot()
        if self.trace:
            self.res.profiler = self._closed
        if not dist.is_initialized():
            return
        self.res.comm_ms, self.res.comm_exposed_ms, self.res.comm_kinds = \
            comm_times(self._closed, n)
        if self.res.comm_ms is not None:  # (the same steps: the median step is not)
            self.res.comm_share = self.res.comm_ms / prof_ms

    def close(self) -> None:
        if self.prof is not None:
            with kineto_quiet():
                self.prof.__exit__(None, None, None)
            self._closed, self.prof = self.prof, None


class _MoeStats:
    """Expert load and router losses summed over the measured micro-steps.

    The sums stay on the device and are read once at the end."""

    def __init__(self, device, top_k: int):
        # balance, z, busiest, sequence balance
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.n, self.counts, self.top_k, self.choices = 0, None, top_k, 0

    def add(self, out, tokens: int) -> None:
        if not out.counts.numel():  # (a dense model)
            return
        self.choices += tokens * self.top_k
        self.counts = (out.counts.clone() if self.counts is None  # (a CUDA graph's output
                       else self.counts.add_(out.counts))  # is overwritten by its next replay)
        self.sums[0] += out.balance.detach()
        self.sums[1] += out.z.detach()
        self.sums[2] += out.counts.max(dim=1).values.sum()
        self.sums[3] += out.seq_balance.detach()
        self.n += 1

    def into(self, res: LoopResult) -> None:
        res.counts, res.choices = self.counts, self.choices
        if self.n:  # (busiest: summed over micro-steps and layers, as the mean's rows)
            balance, z, busiest, seq = self.sums.tolist()
            res.balance, res.z, res.seq_balance = balance / self.n, z / self.n, seq / self.n
            res.step_max_over_mean = busiest / (self.counts.sum().item() / self.counts.shape[1])


class _LossLog:
    """Reads the steps' losses at log steps into the result, the progress bar and the tracker.

    Each step's loss stays on the device until a log step reads the new ones at once: one
    sync per train.log_every steps. A non-finite loss raises Diverged."""

    def __init__(self, losses: torch.Tensor, norms: torch.Tensor, res: LoopResult, bar, on_log):
        self.losses, self.norms, self.res, self.bar, self.on_log = losses, norms, res, bar, on_log
        self.logged = 0  # steps whose loss has been read

    def read(self, step: int) -> None:
        new = self.losses[self.logged: step + 1]
        if dist.is_initialized():  # the global batch's loss: same on every rank
            from ..distributed import all_mean

            new = all_mean(new)
        values = new.tolist()
        norms = self.norms[self.logged: step + 1].tolist()  # (the same on every rank)
        self.logged = step + 1
        self.res.losses.extend(values)
        self.res.grad_norms.extend(norms)
        self.bar.set_postfix(loss=f"{values[-1]:.3f}", refresh=sys.stderr.isatty())  # (off a
        # terminal: the bar every 10 s, not every log)
        if self.on_log:
            self.on_log(step, values, self.res.lrs[step + 1 - len(values): step + 1], norms)
        first = len(self.res.losses) - len(values)  # step of values[0]
        bad = next((first + i for i, v in enumerate(values) if not math.isfinite(v)), None)
        if bad is not None:  # the first non-finite step, whatever log_every is
            raise Diverged(f"loss became {self.res.losses[bad]} at step {bad}",
                           self.res.losses[:bad])

    def unread(self) -> list:
        """The losses of the steps done since the last log; with one process they are global."""
        return self.losses[self.logged: self.res.steps_done].tolist()


def optimizer_step(cfg, applied, optimizer, scheduler, scaler, params, timer):
    """Sync, unscale and clip the gradients, step, zero them and advance the schedule.

    The sync is the one outside DDP/FSDP's hooks, expert parallelism's; it is timed as
    backward, as under DDP/FSDP. Returns the gradient norm before clipping, global across
    ranks and on the device, or None without clipping."""
    if applied.before_step:
        applied.before_step()
        if timer is not None:
            timer.lap("backward")
    if scaler:
        scaler.unscale_(optimizer)
    norm = None
    if cfg.optim.grad_clip > 0:
        norm = (applied.clip or torch.nn.utils.clip_grad_norm_)(params, cfg.optim.grad_clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # (FSDP2: DTensor)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return norm


def _checkpoint(ckpt, step: int, read: bool, log: _LossLog, res: LoopResult,
                measured: bool, last: bool = False) -> None:
    """At a step's end, save a checkpoint when due, at the run's last step, or when a
    SIGTERM came.

    After a SIGTERM's save the run stops with KeyboardInterrupt("SIGTERM"), which carries the
    checkpoint's dir. With several ranks a SIGTERM is acted on at a loss read, where every
    rank learns whether any rank got one."""
    stop = ckpt.stop_requested(agree=True) if read or not dist.is_initialized() else False
    if not (stop or ckpt.due(step + 1) or last):
        return
    if log.logged < step + 1:
        log.read(step)
    t0 = time.perf_counter()
    path = ckpt.save(step + 1, {"losses": res.losses, "lrs": res.lrs,
                                "grad_norms": res.grad_norms}, blocking=stop)
    if measured:
        res.checkpoint_s += time.perf_counter() - t0
    if stop:
        ckpt.wait()
        e = KeyboardInterrupt("SIGTERM")
        e.checkpoint = path
        raise e


def train_loop(cfg, applied, optimizer, scheduler, loader, device: torch.device,
               memory: MemoryMeter, on_log=None, progress: bool = True,
               ckpt=None, watch=None) -> LoopResult:
    """Run the warmup and measured steps and return the loop's figures.

    ckpt is the run's train.checkpoint.Checkpointer: it saves, and a resumed run starts at
    its loaded step with the loss history before it. watch, the plan's check of a real
    step's memory, observes step watch.step: begin(applied, optimizer) before it, micro()
    after each micro-batch, end() after its optimizer step."""
    t = cfg.train
    model, autocast, scaler, accum = applied.model, applied.autocast, applied.scaler, \
        t.grad_accum_steps
    params = [p for g in optimizer.param_groups for p in g["params"]]
    total, cp = total_steps(t), cp_size(cfg.parallel)
    timer, res = StepTimer(device), LoopResult()
    resumed = ckpt.resumed if ckpt else None
    start = resumed["step"] if resumed else 0
    if resumed:  # the steps before the checkpoint's, as the uninterrupted run recorded them
        h = resumed["history"]
        res.losses, res.lrs, res.grad_norms = list(h["losses"]), list(h["lrs"]), \
            list(h["grad_norms"])
    # Per-step figures go into buffers made once: small tensors kept from every step would
    # pin freed heap between them, and on CPU the run's peak RSS would grow with train.steps.
    losses = torch.zeros(total, device=device)  # each step's loss, read at each log
    norms = torch.full((total,), math.nan, device=device)  # each step's gradient norm
    bar = tqdm(total=total, initial=start, desc="warmup", unit="step", disable=not progress,
               mininterval=0.5 if sys.stderr.isatty() else 10.0, dynamic_ncols=True)
    win, moe, log = _Window(cfg, device, memory, res, start), \
        _MoeStats(device, cfg.model.top_k), _LossLog(losses, norms, res, bar, on_log)
    log.logged = start
    balancer = BiasBalancer(model)
    evaluate = Evaluator(cfg, applied, device)
    batches = iter(loader)
    model.train()
    collector = Collector(t.gc_every)  # (entered in the try: its exit restores GC)
    live = None  # watch, while its step runs
    ticking = None  # the compiling step's redraws
    done = False
    try:
        collector.__enter__()
        if ckpt:
            ckpt.__enter__()  # (its SIGTERM handler; exited in the finally)
        for step in range(start, total):
            if t.compile != "off" and step - start < 2:  # (its first step compiles: a word
                bar.set_description("compiling the step" if step == start else  # while
                                    "bench" if win.measured(step) else "warmup")  # it waits)
                if step == start and not bar.disable:  # (and its seconds)
                    ticking = Ticking(bar)
            win.begin(step, bar)
            collector.timing = win.measured(step)
            if step == start:
                t0 = time.perf_counter()
            timer.start()
            if watch is not None and step == watch.step:
                live = watch
                live.begin(applied, optimizer)
            step_loss = losses[step]
            for sync_ctx in applied.micro_contexts(accum):
                tokens, targets = next(batches)
                tokens = tokens.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
                timer.lap("data")
                with sync_ctx:
                    out = micro_step(model, tokens, targets, autocast, scaler, accum, timer)
                if live is not None:
                    live.micro()
                step_loss += out.ce.detach() / accum
                if win.measured(step):
                    moe.add(out, tokens.numel() // cp)  # (cp: each rank routes its part)
                balancer.add(out.routed)
            res.lrs.append(optimizer.param_groups[0]["lr"])
            norm = optimizer_step(cfg, applied, optimizer, scheduler, scaler, params, timer)
            if norm is not None:
                norms[step] = norm.detach()
            balancer.step()
            if live is not None:
                live.end()
                live = None
            timer.lap("optimizer")
            if collector.step(step):
                timer.lap("gc")  # (in the step's time, in no phase)
            if win.measured(step):
                timer.end()
            if step == start:
                device_sync(device)
                res.first_step_s = time.perf_counter() - t0
            res.steps_done = step + 1
            read = (step + 1) % t.log_every == 0 or step + 1 == total
            if read:
                log.read(step)
            if ckpt and ckpt.root:
                _checkpoint(ckpt, step, read, log, res, win.measured(step))
            if step + 1 < total and step < win.prof_from and evaluate.due(step + 1, False):
                win.pause(evaluate(step + 1))  # (not under the profiler: its
                # collectives would count in comm_ms)
            if ticking is not None:
                ticking.close()
                ticking = None
            bar.update(1)
        win.finish()
        if ckpt and ckpt.root and start < total and not ckpt.due(total):  # the last step's
            _checkpoint(ckpt, total - 1, True, log, res, False, last=True)  # (after the
            # window and the profiler: in no figure)
        if evaluate.due(total, True):  # after the window: in no figure
            evaluate(total)
        done = True
    except KeyboardInterrupt as e:  # the record keeps the loss of every step done
        if not dist.is_initialized():  # (ranks: only the logged, global, losses)
            res.losses.extend(log.unread())
        e.losses, e.steps = res.losses, (res.steps_done, total)
        raise
    finally:
        if ticking is not None:
            ticking.close()
        if live is not None:
            live.end()
        if ckpt:
            ckpt.__exit__(None if done else Exception, None, None)
        collector.__exit__(None, None, None)
        win.close()
        bar.close()
    res.eval_losses, res.steps_to_target = evaluate.curve, evaluate.reached
    res.timings = timer.results()
    res.gc_ms, res.gc_collections = collector.per_step(len(res.timings["step_ms"]))
    moe.into(res)
    return res
