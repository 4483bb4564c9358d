"""Measures a calibration (plan/calibration.py) on the device at hand: task=calibrate's work.

Each grid point is timed in batches of calls long enough to time (CUDA events on a GPU), the
median of 3 batches. A point whose predicted time exceeds POINT_S is not measured: it takes
the best rate measured at a point no larger in any size (rates level off at large sizes).
On a CPU, the cost of dispatching one tiny op is taken off each point, since the plan adds
the measured dispatch cost of a whole eager step's ops itself."""
from __future__ import annotations

import copy
import functools
import itertools
import math
import os
import statistics
import sys
import time

import torch

from .calibration import TAPER, VERSION, Calibration, long_share

POINT_S = 0.05  # the longest call measured: larger points take a smaller one's rate
BATCH_S = 2e-3  # a timed batch of calls lasts at least this long
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16}
GRIDS = {  # (M, N, K) of the matmuls; (groups, rows per group, N, K); (sequence, head size)
    "cpu": dict(mm=([16, 128, 1024, 8192], [64, 256, 1024, 4096], [64, 256, 1024, 4096]),
                gmm=([4, 16], [16, 128, 1024], [64, 256, 1024], [64, 256, 1024]),
                sdpa=([128, 512, 2048], [64, 128]), bytes_max=2**26),
    "cuda": dict(mm=([16, 128, 1024, 8192, 32768], [128, 512, 2048, 8192, 32768],
                     [128, 512, 2048, 8192, 32768]),
                 gmm=([4, 16, 64], [16, 128, 1024, 4096], [256, 1024, 4096],
                      [256, 1024, 4096]),
                 sdpa=([256, 1024, 4096, 16384], [64, 128, 192]), bytes_max=2**30),
}
SDPA = {"cuda": ("flash", "efficient", "cudnn"), "cpu": ("flash",)}
SDPA_PRECISIONS = {"cuda": ("bf16",), "cpu": ("fp32", "bf16")}


class Timer:
    """Seconds per call of fn on device: batches of calls (BATCH_S long), the median of 3.

    On a GPU, a call shorter than GRAPH_S is timed inside a CUDA graph of the batch: back to
    back, its kernel's time alone, as in a step whose host runs ahead (the plan adds the
    host's dispatch itself)."""

    GRAPH_S = 1e-4

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.raw = 0.0
        x = torch.ones(1, device=device)
        self.raw = self(lambda: torch.add(x, x), sub=False, graph=False)  # an op's dispatch

    def _graph(self, fn, n: int) -> float:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                fn()
        g.replay()
        times = []
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / n)
        del g
        return statistics.median(times)

    def _batch(self, fn, n: int) -> float:
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(n):
                fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3 / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    def __call__(self, fn, sub: bool = True, graph: bool = True, batch_s: float = BATCH_S,
                 batches: int = 3) -> float:
        self._batch(fn, 1)  # (the warm-up)
        first = self._batch(fn, 3)
        n = max(1, min(int(1000 * batch_s / BATCH_S), int(batch_s / max(first, 1e-7))))
        if self.cuda and graph and first < self.GRAPH_S:
            return self._graph(fn, min(n, 200))
        t = statistics.median(self._batch(fn, n) for _ in range(batches))
        if sub and not self.cuda:  # the plan adds each op's dispatch itself
            t = max(t - self.raw, 0.05 * t)
        return t


def _filled(axes, measured: dict) -> list:
    """The grid's rates as nested lists, each point not measured given the best rate
    measured at a point no larger in any size."""
    def rate(p):
        if p in measured:
            return measured[p]
        below = [r for q, r in measured.items() if all(a <= b for a, b in zip(q, p))]
        return max(below)

    def nest(prefix, rest):
        if not rest:
            return rate(prefix)
        return [nest(prefix + (x,), rest[1:]) for x in rest[0]]

    return nest((), list(axes))


def _grid(timer, axes, make, flops_of, bar) -> dict:
    """Measures make(point)'s call at each grid point, smallest first: rate = FLOPs / s."""
    measured, best = {}, 0.0
    for p in itertools.product(*axes):
        bar.update()
        f = flops_of(p)
        if best and f / best > POINT_S:
            continue
        fn = make(p)
        if fn is None:
            continue
        measured[p] = f / timer(fn)
        best = max(best, measured[p])
        del fn
    return {"axes": [list(a) for a in axes], "rates": _filled(axes, measured),
            "measured": len(measured)}


LAYOUTS = ("nn", "nt", "tn")  # a linear's input gradient, forward, weight gradient
COLD_BYTES = 32 * 2**20  # on CPU, a read operand rotated over copies of this many bytes


def cold(timer, make_one):
    """An operand for each call in turn from copies of make_one() filling COLD_BYTES, so
    that on a CPU each call reads it from beyond the cache, as a step's ops read the weights
    and saved activations (tiny_moe's experts took 1.4x their hot-cache time in a step).
    On a GPU: one copy. (The rest cloned from the first, strides kept: a clone takes a
    third of randn's time, and the calibration makes copies for every point.)"""
    first = make_one()
    size = first.numel() * first.element_size()
    n = 1 if timer.cuda else max(1, min(64, COLD_BYTES // size))
    return functools.partial(next, itertools.cycle([first, *(first.clone()
                                                             for _ in range(n - 1))]))


def _matmuls(timer, dtype, axes, layout: str, bar) -> dict:
    dev = timer.device

    def operand(rows, cols, t):
        x = torch.randn(cols, rows, device=dev, dtype=dtype).t() if t == "t" else \
            torch.randn(rows, cols, device=dev, dtype=dtype)
        return x

    def make(p):  # (the weight read cold; a weight gradient's saved input: its a)
        m, n, k = p
        if layout == "tn":
            a, b = cold(timer, lambda: operand(m, k, "t")), operand(k, n, layout[1])
            return lambda: a() @ b
        a, b = operand(m, k, layout[0]), cold(timer, lambda: operand(k, n, layout[1]))
        return lambda: a @ b()

    return _grid(timer, axes, make, lambda p: 2 * p[0] * p[1] * p[2], bar)


def _grouped(timer, dtype, axes, bar, weights: bool = False) -> dict | None:
    """grouped_mm at (groups, rows per group, N, K): rows (g x rows, K) times each group's
    (K, N); weights: the weights' gradient, x^T (K, g x rows) times dy (g x rows, N)."""
    from ..model.moe import grouped_mm, grouped_mm_supported

    dev = timer.device
    if not grouped_mm_supported(dev, dtype):
        return None

    def make(p):  # (the weights read cold; their gradient's saved input)
        g, rows, n, k = p
        offs = torch.arange(1, g + 1, device=dev, dtype=torch.int32) * rows
        if weights:
            x = cold(timer, lambda: torch.randn(g * rows, k, device=dev, dtype=dtype))
            dy = torch.randn(g * rows, n, device=dev, dtype=dtype)
            return lambda: grouped_mm(x().t(), dy, offs)
        x = torch.randn(g * rows, k, device=dev, dtype=dtype)
        w = cold(timer, lambda: torch.randn(g, k, n, device=dev, dtype=dtype))
        return lambda: grouped_mm(x, w(), offs)

    return _grid(timer, axes, make, lambda p: 2 * p[0] * p[1] * p[2] * p[3], bar)


def _sdpa(timer, dtype, backend: str, axes, bar) -> dict:
    """One kernel's forward and backward grids, keyed by their ops' names."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from .ops import StepOps

    dev, out, measured = timer.device, {}, {}
    kernel = getattr(SDPBackend, {"flash": "FLASH_ATTENTION", "efficient":
                                  "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}[backend])
    best = 0.0
    for seq, head in itertools.product(*axes):
        bar.update()
        # (on a CPU, seq 512 in bf16 took 0.05 s with 16 heads, POINT_S: measured or not by
        # the VM's hour, and a plan of seq 256 moved by 2x)
        bh = max(2, 2**17 // seq if dev.type == "cuda" else 2**12 // seq)
        q, k, v = (torch.randn(1, bh, seq, head, device=dev, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        flops = 4 * bh * seq * seq * head
        if best and 3.5 * flops / best > POINT_S:
            continue
        try:
            with sdpa_kernel(kernel):
                ops = StepOps()
                ops.on = True
                with ops:
                    sdpa(q, k, v, is_causal=True).sum().backward()
                names = [(op[3][1], op[0]) for op in ops.ops if op[3] and op[3][0] == "sdpa"]
                if len(names) != 2:
                    continue
                fwd = timer(lambda: sdpa(q, k, v, is_causal=True), graph=False)
                both = timer(lambda: sdpa(q, k, v, is_causal=True).backward(
                    torch.ones(1, bh, seq, head, device=dev, dtype=dtype)), graph=False)
        except RuntimeError:  # this kernel does not take this shape or dtype
            continue
        for (name, f), t in zip(names, (fwd, max(both - fwd, 0.2 * both))):
            measured.setdefault(name, {})[(seq, head)] = f / t
            best = max(best, f / t)
    for name, points in measured.items():
        out[name] = {"axes": [list(a) for a in axes], "rates": _filled(axes, points),
                     "measured": len(points)}
    return out


COLD_BYTES = 2**26  # a CPU's adds cycle through this many bytes of operands


def _bandwidth(timer, top: int, bar) -> dict:
    """bytes/s of an out-of-place fp32 add (reads 2, writes 1) by bytes moved.

    On a CPU each call takes the next of copies of its operands that together outgrow
    the caches: a step's ops read what other ops left out of them (an add of 4 MB ran
    2.3x slower so than on operands kept hot, where a matmul's time did not change)."""
    sizes, rates = [], []
    n = 2**6
    while 12 * n <= top:
        bar.update()
        copies = 1 if timer.cuda else max(1, min(64, COLD_BYTES // (8 * n)))
        pairs = [(torch.ones(n, device=timer.device), torch.ones(n, device=timer.device))
                 for _ in range(copies)]
        turn = itertools.cycle(pairs)
        sizes.append(12 * n)
        # (longer batches than a grid point's: in 2 ms ones a point moved by 2.5x between
        # calibrations, and a plan's elementwise time with it)
        rates.append(12 * n / timer(lambda: torch.add(*next(turn)), batch_s=0.02,
                                    batches=5))
        n *= 4
    return {"axes": [sizes], "rates": rates, "measured": len(sizes)}


def _tiny(cfg, precision: str, shape: dict, ac: str = "none"):
    """A tiny_moe run's config at this precision and shape (SHAPES), routed balanced as
    plans route: eager, one device."""
    from omegaconf import OmegaConf

    from ..config import CONF, ModelConfig, PrecisionConfig

    def load(group, name):
        return OmegaConf.to_container(OmegaConf.load(CONF / group / f"{name}.yaml"))

    cfg = copy.deepcopy(cfg)
    cfg.precision = PrecisionConfig(**load("precision", precision))
    cfg.model = ModelConfig(**{**load("model", "tiny_moe"), **shape["model"],
                               "routing": "balanced"})
    cfg.train.seq_len, cfg.train.micro_batch_size = shape["seq_len"], shape["micro_batch"]
    cfg.train.activation_checkpointing, cfg.train.compile = ac, "off"
    cfg.train.grad_accum_steps, cfg.parallel.name, cfg.hardware.devices = 1, "none", 1
    return cfg


SHAPES = {  # the calibration's own bench runs (tiny_moe's architecture)
    # kernels a small part of its step, which its ops' dispatch and the loop's work fill
    "dispatch": dict(model=dict(hidden_size=32, ffn_hidden_size=32, vocab_size=64,
                                max_seq_len=16, num_layers=8), seq_len=16, micro_batch=1),
    # kernels most of it: a step's ops together against their grid times (no row of
    # benchmarks/plan_rows.py has its shape)
    "in_step": dict(model=dict(hidden_size=192, ffn_hidden_size=384, vocab_size=512,
                               max_seq_len=64, num_layers=2), seq_len=64, micro_batch=4),
}


def _measured_step_s(cfg, precision: str, shape: dict, device, ac: str = "none") -> float:
    """The median step of a bench run of its own at a SHAPES shape, as task=bench
    measures it."""
    import json
    import subprocess
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        model = [f"model.{k}={v}" for k, v in shape["model"].items()]
        cmd = [sys.executable, "-m", "moe_exp.run", "model=tiny_moe", *model,
               "model.routing=balanced", f"precision={precision}",
               f"train.activation_checkpointing={ac}",
               f"hardware={'cpu' if device.type == 'cpu' else 'auto'}",
               f"train.seq_len={shape['seq_len']}",
               f"train.micro_batch_size={shape['micro_batch']}", "train.steps=20",
               "train.warmup_steps=3", "train.plan=false", "logger=none",
               f"hydra.run.dir={d}"]
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        f = Path(d) / "metrics.json"
        rec = json.loads(f.read_text()) if f.is_file() else {}
        if rec.get("status") != "ok":
            tail = (got.stderr.strip().splitlines() or [""])[-1]
            raise RuntimeError(f"the calibration's bench run failed: "
                               f"{rec.get('error') or tail}")
        return rec["step_time_ms"] / 1e3


def _traced(cfg, precision: str, shape: dict, cal: Calibration,
            ac: str = "none") -> tuple[int, float]:
    """The plan's dispatched ops and its kernels' time (on a GPU: its syncs') for a
    calibration's run."""
    from .ops import is_kernel
    from .trace import trace_step

    ops = trace_step(_tiny(cfg, precision, shape, ac)).ops
    if cal.device == "cuda":
        return ops.dispatched, sum(op[3] == ("sync",) for op in ops.ops) * cal.sync_s
    return ops.dispatched, sum(cal.kernel_s(*op, precision) for op in filter(is_kernel,
                                                                             ops.ops))


def _dispatch(cfg, device, cal: Calibration, precisions: list) -> tuple[dict, float]:
    """The cost of an eager step's ops: µs per op dispatched, by precision and by
    activation checkpointing ("fp32+full"; on a GPU, its first precision's only), and µs
    per step (0: in the ops' cost). (On a CPU each precision's own: on an EPYC, full
    checkpointing cost fp32's ops 1.90x and bf16's 1.26x, selective 3.22x and 2.37x.)

    A tiny bench run (SHAPES' dispatch) in each precision and each checkpointing (whose
    hooks cost each op more): its step's time less its kernels' predicted time (on a GPU,
    the host runs ahead of them) over the ops it dispatches. (A fit of a cost per step and
    one per op over 2 and 8 layers moved by a factor of 2 between calibrations of this
    2-core VM, whose steps move by 15% between processes: one run's ratio holds better.)"""
    out, shape = {}, SHAPES["dispatch"]
    hooked = precisions if device.type == "cpu" else precisions[:1]
    for p, ac in [(p, "none") for p in precisions] + [
            (p, ac) for p in hooked for ac in ("full", "selective")]:
        n, k = _traced(cfg, p, shape, cal, ac)
        key = p if ac == "none" else f"{p}+{ac}"
        out[key] = max((_measured_step_s(cfg, p, shape, device, ac) - k) / n, 0.0) * 1e6
    return out, 0.0


def _in_step(cfg, device, cal: Calibration, precisions: list) -> dict:
    """A CPU's step against its grids, by precision: {"factor", "taper_s", "measured_ms",
    "planned_ms"} of a bench run whose kernels fill most of its step (SHAPES' in_step),
    planned at this calibration without it.

    A step's kernels run slower than each timed alone: they share the caches, and its
    buffers are new memory (profiled: tiny_moe's expert matmuls 1.2x their grid time,
    small_moe's 1.06x; its SiLU's and log-softmax's several times theirs). The short ops
    suffer most, so the factor tapers with an op's time (calibration.TAPER): each op's
    dispatch and a short op's kernel take all of it, an op of TAPER's long end none, and
    the factor is what makes the probe's plan its measured step."""
    from .trace import trace_step

    out, shape = {}, SHAPES["in_step"]
    for p in precisions:
        launches = cal.launches(trace_step(_tiny(cfg, p, shape)).ops, p)
        planned = cal.timeline(launches)[0]
        measured = _measured_step_s(cfg, p, shape, device)
        whole = part = 0.0  # (seconds the factor multiplies; seconds it leaves as they are)
        for kind, cost, t, *_ in launches:
            if kind == "kernel":
                x = long_share(t, TAPER)
                whole, part = whole + cost + t * (1 - x), part + t * x
        out[p] = {"factor": (measured - part) / whole, "taper_s": list(TAPER),
                  "measured_ms": measured * 1e3, "planned_ms": planned * 1e3}
    return out


def calibrate(cfg, device: torch.device, progress: bool = True) -> dict:
    """This device's calibration as a dict (calibration.py's format)."""
    from tqdm.auto import tqdm

    from ..hardware import device_name

    t0 = time.perf_counter()
    kind = "cuda" if device.type == "cuda" else "cpu"
    grids = GRIDS[kind]
    precisions = [p for p in cfg.hardware.precisions if p in DTYPES]
    if kind == "cpu":  # (fp16 takes bf16's rates: both emulated alike on a CPU)
        precisions = [p for p in precisions if p not in ("tf32", "fp16")]
    timer = Timer(device)
    mm_n = math.prod(len(a) for a in grids["mm"])
    gmm_n = math.prod(len(a) for a in grids["gmm"]) if "gmm" in grids else 0
    sdpa_n = math.prod(len(a) for a in grids["sdpa"]) * len(SDPA[kind]) * len(
        set(SDPA_PRECISIONS[kind]) & set(precisions))
    grouped = "fp32" if kind == "cpu" else "bf16"  # (as model.dispatch=auto picks grouped)
    grouped = grouped if grouped in precisions else None
    total = mm_n * len(precisions) * len(LAYOUTS) + 2 * gmm_n * bool(grouped) + sdpa_n \
        + int(math.log(grids["bytes_max"] / 768, 4)) + 1
    data = {"version": VERSION, "device": kind, "device_name": device_name(device),
            "torch": torch.__version__, "made": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "raw_op_us": timer.raw * 1e6, "matmul": {}, "grouped_mm": {}, "sdpa": {}}
    if kind == "cpu":
        data["cores"], data["threads"] = os.cpu_count(), torch.get_num_threads()
    data["section_s"], last = {}, [time.perf_counter()]

    def lap(name):
        now = time.perf_counter()
        data["section_s"][name], last[0] = now - last[0], now

    with tqdm(total=total, desc="calibrating", unit="shape", disable=not progress,
              file=sys.stderr) as bar:
        data["bandwidth"] = _bandwidth(timer, grids["bytes_max"], bar)
        lap("bandwidth")
        for p, lay in itertools.product(precisions, LAYOUTS):
            bar.set_description(f"calibrating {p} matmuls ({lay})")
            with _tf32(kind, p == "tf32"):
                data["matmul"][f"{p}:{lay}"] = _matmuls(timer, DTYPES[p], grids["mm"], lay,
                                                        bar)
        lap("matmul")
        for weights in (False, True) if gmm_n and grouped else ():
            bar.set_description(f"calibrating {grouped} grouped_mm" + " (weights)" * weights)
            if got := _grouped(timer, DTYPES[grouped], grids["gmm"], bar, weights):
                data["grouped_mm"][f"{grouped}{':w' * weights}"] = got
        lap("grouped_mm")
        for p in SDPA_PRECISIONS[kind]:  # (fp16 reads bf16's: the same kernels)
            if p not in precisions:
                continue
            for backend in SDPA[kind]:
                bar.set_description(f"calibrating {p} attention ({backend})")
                for name, g in _sdpa(timer, DTYPES[p], backend, grids["sdpa"], bar).items():
                    data["sdpa"][f"{name}:{p}"] = g
        bar.set_description("calibrating an eager step's dispatch")
        data["sync_us"] = _sync_us(timer) if kind == "cuda" else 0.0
        lap("sdpa")
        plain = [p for p in precisions if p in ("fp32", "bf16")]
        data["dispatch_us"], data["step_us"] = _dispatch(cfg, device, Calibration(
            {**data, "dispatch_us": {}}, "(being made)"), plain)
        lap("dispatch")
        if kind == "cpu":
            bar.set_description("calibrating a step's ops together")
            data["in_step"] = _in_step(cfg, device, Calibration(data, "(being made)"), plain)
            lap("in_step")
    data["seconds"] = time.perf_counter() - t0
    return data


def _sync_us(timer) -> float:
    """µs the host waits to read a value back from an idle device."""
    x = torch.ones(1, device=timer.device)
    return timer(lambda: x.item(), sub=False, graph=False) * 1e6


def _tf32(kind: str, on: bool):
    import contextlib

    if kind != "cuda":
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def ctx():
        old = torch.backends.cuda.matmul.fp32_precision
        torch.backends.cuda.matmul.fp32_precision = "tf32" if on else "ieee"
        try:
            yield
        finally:
            torch.backends.cuda.matmul.fp32_precision = old
    return ctx()


def calibration_for(cfg, progress: bool = True):
    """hardware.calibration's Calibration, and the seconds spent making it now (None where
    read). auto: this machine's, from the cache, made and cached where missing (not by a
    torchrun rank: CalibrationError)."""
    from ..ranks import rank_env
    from .calibration import (Calibration, CalibrationError, cache_dir, load, machine_key,
                              path_of, write)

    value = cfg.hardware.calibration
    if value != "auto":
        return load(path_of(value)), None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = cache_dir() / f"{machine_key(device)}.json"
    if path.is_file():
        return load(path), None
    if rank_env() is not None:  # (torchrun's ranks: each would make it, at once)
        raise CalibrationError(f"hardware.calibration=auto: this machine's ({path.name}) is "
                               "not made yet, and torchrun's ranks do not make it: run "
                               "task=calibrate here first, with the ranks' OMP_NUM_THREADS")
    print(f"[plan] calibrating this {device.type.upper()} for the plan's time (once per "
          f"machine, about 2 minutes; cached in {path})", file=sys.stderr, flush=True)
    data = calibrate(cfg, device, progress)
    write(data, path)
    return Calibration(data, str(path)), data["seconds"]
