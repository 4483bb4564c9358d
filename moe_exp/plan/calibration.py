"""A calibration: what a device's kernels really achieve, and the step time it predicts.

task=calibrate measures it (plan/calibrate.py) and writes a JSON file; hardware.calibration
names one (a path, a shipped name such as h100, or auto: this machine's, made on first
use). Its grids hold achieved rates: FLOP/s of matmuls by (M, N, K), of grouped_mm by
(groups, rows, N, K), of each SDPA kernel by (query length, key length, head size), and
bytes/s of an out-of-place elementwise op by bytes moved; with the cost of dispatching one
op of an eager step, and on a CPU how much slower a step's ops run together (in_step:
the short ops most, tapering to none at TAPER's long end).
Between grid points, log(rate) is interpolated in log(size); outside, the nearest edge's
rate holds."""
from __future__ import annotations

import bisect
import functools
import json
import math
from pathlib import Path

import torch

VERSION = 3  # 3: in_step tapers with an op's time; 2: one in_step factor; 1: without it
# a CPU's in_step factor: an op this short (seconds, at its grid time) takes all of it, one
# this long none of it, and between, a share falling linearly in log(time)
TAPER = (1e-5, 1e-2)
SHIPPED = Path(__file__).resolve().parents[1] / "conf" / "hardware" / "calibration"
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class CalibrationError(ValueError):
    """A calibration file that cannot be read or lacks what a plan needs."""


class Grid:
    """Rates on a grid of sizes: axes (each ascending), rates (nested lists, axis order)."""

    def __init__(self, axes: list, rates):
        self.axes = [[math.log(x) for x in a] for a in axes]
        self.rates = rates

    def _at(self, idx: tuple) -> float:
        r = self.rates
        for i in idx:
            r = r[i]
        return math.log(r)

    def rate(self, *point) -> float:
        """The rate at point, multilinear in log-log between grid points, clamped outside."""
        corners = [((), 1.0)]
        for axis, x in zip(self.axes, point):
            if len(axis) == 1:
                corners = [(c + (0,), w) for c, w in corners]
                continue
            x = min(max(math.log(max(x, 1)), axis[0]), axis[-1])
            i = min(bisect.bisect_right(axis, x) - 1, len(axis) - 2)
            f = (x - axis[i]) / (axis[i + 1] - axis[i])
            corners = [(c + (j,), w * g) for c, w in corners
                       for j, g in ((i, 1 - f), (i + 1, f)) if g > 0]
        return math.exp(sum(w * self._at(c) for c, w in corners))


class Calibration:
    """A calibration file's rates; kernel_s gives an op's time on its device."""

    def __init__(self, data: dict, source: str):
        self.data, self.source = data, source
        self.device = data["device"]
        self.dispatch_us = data["dispatch_us"]  # {precision: µs an op}
        self.in_step = {k: v["factor"] for k, v in data.get("in_step", {}).items()}
        # (a version 2 file's factor holds for every op alike)
        self.taper = {k: tuple(v["taper_s"]) for k, v in data.get("in_step", {}).items()
                      if "taper_s" in v}
        self.sync_s = data.get("sync_us", 0.0) / 1e6
        grid = lambda g: Grid(g["axes"], g["rates"])  # noqa: E731
        self.mm = {k: grid(g) for k, g in data["matmul"].items()}
        self.gmm = {k: grid(g) for k, g in data.get("grouped_mm", {}).items()}
        self.sdpa = {k: grid(g) for k, g in data.get("sdpa", {}).items()}
        self.bw = grid(data["bandwidth"])
        self.attention = "auto"  # train.attention of the step planned (for_step sets it)
        self._memo: dict = {}

    def label(self) -> str:
        """Its source (a shipped one by name) and what it measured, when; on CPU, at how
        many threads, and where this process runs another count, that its rates do not
        hold here."""
        d, src = self.data, Path(self.source)
        name = src.stem if src.parent == SHIPPED else self.source
        def count(n):
            return f"{n} thread{'s' * (n != 1)}"

        made, now = d.get("threads"), torch.get_num_threads()
        threads = f", {count(made)}" if self.device == "cpu" and made else ""
        text = f"{name} ({d['device_name']}{threads}, torch {d['torch']}, {d['made'][:10]})"
        if threads and made != now:
            text += f"; this process runs {count(now)}: its rates differ"
        if self.device == "cpu" and not self.in_step:
            text += "; no in-step factor (made before it: calibrate again)"
        return text

    def kernel_s(self, flops: float, nbytes: int, dtype, shape, precision: str) -> float:
        """One op's kernel time in seconds: a compute op's FLOPs at its shape's rate, else
        its bytes at the bandwidth of its size."""
        key = (flops, nbytes, dtype, shape)
        if key in self._memo:
            return self._memo[key]
        if shape and flops:
            t = flops / self._rate(dtype, shape, precision)
        else:
            t = nbytes / self.bw.rate(nbytes) if nbytes else 0.0
        self._memo[key] = t
        return t

    def _rate(self, dtype, shape, precision: str) -> float:
        name = DTYPES.get(dtype, "fp32")
        if name == "fp32" and precision == "tf32" and "tf32:nn" in self.mm:
            name = "tf32"
        kind = shape[0]
        if name == "fp16" and "fp16:nn" not in self.mm and "bf16:nn" in self.mm:
            name = "bf16"  # (a CPU's: both emulated alike)
        if kind == "gmm" and name in self.gmm:
            g, rows, n, k = shape[1:]
            return self.gmm[name].rate(g, rows / max(g, 1), n, k)
        if kind == "gmm_w" and f"{name}:w" in self.gmm:  # (M: the grid's K; K: its rows)
            g, m, n, k = shape[1:]
            return self.gmm[f"{name}:w"].rate(g, k / max(g, 1), n, m)
        if kind == "sdpa" and (op := self._kernel(shape[1], name)) in self.sdpa:
            return self.sdpa[op].rate(math.sqrt(shape[2] * shape[3]), shape[4])  # (q = k)
        if f"{name}:nn" not in self.mm:
            raise CalibrationError(f"the calibration {self.source} has no {name} matmuls: "
                                   "calibrate with that precision in hardware.precisions")
        mm = self.mm[f"{name}:nn"]
        if kind == "gmm":  # as one matmul per group
            g, rows, n, k = shape[1:]
            return mm.rate(rows / max(g, 1), n, k)
        if kind == "gmm_w":  # a weight gradient: its contraction split into groups
            g, m, n, k = shape[1:]
            return self.mm.get(f"{name}:tn", mm).rate(m, n, k / max(g, 1))
        if kind == "sdpa":  # QK^T and PV as matmuls of its sizes
            return self.mm.get(f"{name}:nt", mm).rate(shape[2], shape[3], shape[4])
        m, n, k, lay, batch = shape[1:]
        if self.device == "cpu":  # a CPU's batched matmul: one matmul after another
            m //= batch
        return self.mm.get(f"{name}:{lay}", mm).rate(m, n, k)

    def dispatch_s(self, precision: str, ac: str = "none") -> float:
        """The cost of dispatching one op of an eager step, in seconds.

        Activation checkpointing's hooks make each op cost more: as measured at this
        precision (a CPU's calibration), else as much more, in proportion, as they did in
        the precision the calibration measured them in."""
        d = self.dispatch_us
        plain = {k: v for k, v in d.items() if "+" not in k}
        us = _by_precision(plain, precision) or next(iter(plain.values()), 0.0)
        if ac == "none":
            return us / 1e6
        hooked = {k.split("+")[0]: v for k, v in d.items() if k.endswith(f"+{ac}")}
        if own := _by_precision(hooked, precision):
            return own / 1e6
        base = next((k for k in hooked if plain.get(k)), None)
        return us * (hooked[base] / plain[base] if base else 1.0) / 1e6

    def factor(self, precision: str) -> float:
        """How much longer a step's short ops take together than at their grid times (a
        CPU's in_step probe; 1 where not measured)."""
        return _by_precision(self.in_step, precision) or 1.0

    def in_step_s(self, t: float, precision: str) -> float:
        """An op of grid time t seconds in a step: t times factor() where it is short,
        tapering to t itself (TAPER; a version 2 file's factor for every op)."""
        f = self.factor(precision)
        span = _by_precision(self.taper, precision)
        return t * (f + (1 - f) * long_share(t, span)) if span else t * f

    def _kernel(self, op: str, dtype: str) -> str:
        """The calibrated kernel for a traced SDPA op: on a GPU, the trace's CPU kernel is
        the one CUDA runs, train.attention's where it names one, else flash."""
        if self.device == "cuda" and op.startswith("scaled_dot_product_flash_attention_for_cpu"):
            kernel = self.attention if self.attention in ("efficient", "cudnn") else "flash"
            op = f"scaled_dot_product_{kernel}_attention" + (
                "_backward" if op.endswith("backward") else "")
        key = f"{op}:{dtype}"
        return key if key in self.sdpa or dtype != "fp16" else f"{op}:bf16"

    def step_s(self, ops, precision: str, ac: str = "none", compiled: bool = False,
               comm: list | None = None) -> tuple[float, float]:
        """The step's time and its kernels' busy share, in seconds, for a traced StepOps.

        On a CPU each op's dispatch and kernel run one after the other. On a GPU the host
        dispatches ops ahead of the device, which runs each once it is dispatched and the
        one before has run; a value read (a sync) makes the host wait for the device.
        comm: each collective's seconds (ops.calls' order), run one after another beside
        the compute from where the step starts it, once what it sends is computed; an op
        that reads what one writes waits for it (FSDP's prefetched all-gathers, its
        reduce-scatters during the backward, expert parallelism's all-to-alls, which the
        next op waits for at once). A collective the trace did not place (DDP's buckets)
        is exposed at the end. None: no collectives."""
        return self.timeline(self.launches(ops, precision, ac, compiled), comm)

    def timeline(self, launches: list, comm: list | None = None) -> tuple[float, float]:
        """step_s's time and busy share from launches' list, made once for both the step
        with its collectives and without."""
        host = dev = self.data.get("step_us", 0.0) / 1e6  # the loop's own work a step
        busy, link, ready, placed = 0.0, 0.0, {}, set()
        for kind, cost, t, ins, outs in launches:
            if kind == "sync":
                host = dev = max(host, dev) + self.sync_s
            elif kind == "comm":
                if comm is not None:
                    link = max(link, host, dev) + comm[t]
                    placed.add(t)
                    ready.update(dict.fromkeys(outs, link))
            else:
                wait = max((ready.get(k, 0.0) for k in ins), default=0.0)
                busy += t
                if self.device == "cpu":
                    host = dev = max(host + cost, wait) + t
                else:
                    host += cost
                    dev = max(dev, host, wait) + t
        end = max(host, dev, link)
        if comm is not None:
            end += sum(c for i, c in enumerate(comm) if i not in placed)
        return end, busy

    def launches(self, ops, precision: str, ac: str = "none", compiled: bool = False):
        """The step's work in order: ("kernel", host's cost, its time, storages read,
        storages written), ("sync", ...) and ("comm", 0, its index in ops.calls, read,
        written). Eager: an op a kernel, its dispatch cost the step's ops' share (views
        included). Compiled, the model's ops up to the optimizer's (ops.split): its
        matmuls and attention as they are, each run of other ops between them one fused
        kernel that reads what comes from outside the run and writes what is read after
        it, launched at a tiny op's cost. An eager op's dispatch times factor(), each
        op's kernel as in_step_s scales it, but a fused kernel's: it runs in buffers the
        compiled graph planned, not new ones."""
        from .ops import is_kernel

        recorded, f = sum(map(is_kernel, ops.ops)), self.factor(precision)
        per_op = self.dispatch_s(precision, ac) * ops.dispatched / max(recorded, 1) * f
        io = ops.io or [None] * len(ops.ops)
        split = (ops.split or 0) if compiled and ops.io else 0
        out, chain = [], []
        last_read = _last_reads(ops.io[:split]) if split else {}
        tiny = self.data.get("raw_op_us", 0.0) / 1e6
        for i, op in enumerate(ops.ops):
            fuse = i < split and op[3] is None
            if chain and not fuse:
                t, read, wrote = self._fused([io[j] for j in chain], chain[-1], last_read)
                out.append(("kernel", tiny, t, read, wrote))
                chain = []
            keys = [tuple(k for k, _ in part) for part in io[i]] if io[i] else [(), ()]
            if fuse:
                chain.append(i)
            elif op[3] == ("sync",):
                out.append(("sync", 0.0, 0.0, (), ()))
            elif op[3] and op[3][0] == "comm":
                out.append(("comm", 0.0, op[3][1], *keys))
            else:
                out.append(("kernel", tiny if i < split else per_op,
                            self.in_step_s(self.kernel_s(*op, precision), precision), *keys))
        return out

    def _fused(self, io: list, end: int, last_read: dict) -> tuple[float, tuple, tuple]:
        """One fused kernel's time (its bytes from outside and those read after it), and
        the storages it reads and writes."""
        made, read, wrote = set(), {}, {}
        for ins, outs in io:
            for key, nb in ins:
                if key not in made:
                    read[key] = max(nb, read.get(key, 0))
            for key, nb in outs:
                made.add(key)
                wrote[key] = max(nb, wrote.get(key, 0))
        nbytes = sum(read.values()) + sum(nb for key, nb in wrote.items()
                                          if last_read.get(key, end + 1) > end or key in read)
        return nbytes / self.bw.rate(nbytes) if nbytes else 0.0, tuple(read), tuple(wrote)


def _by_precision(measured: dict, precision: str):
    """A precision's measured figure; fp16 takes bf16's, tf32 fp32's where not measured."""
    return measured.get(precision) or measured.get({"fp16": "bf16", "tf32": "fp32"}.get(precision))


def long_share(t: float, span: tuple) -> float:
    """Where an op of t seconds lies between span's short (0) and long (1) end, in
    log(time)."""
    short, long = span
    return min(max(math.log(max(t, short) / short) / math.log(long / short), 0.0), 1.0)


def _last_reads(io: list) -> dict:
    """Each storage's last op reading it."""
    last = {}
    for i, pair in enumerate(io):
        for key, _ in (pair[0] if pair else ()):
            last[key] = i
    return last


def check_data(data, source: str) -> dict:
    """A calibration's JSON, checked: raises CalibrationError naming what is wrong."""
    if not isinstance(data, dict) or data.get("version") not in (1, 2, VERSION):
        raise CalibrationError(f"{source} is not a moe_exp calibration (version {VERSION}): "
                               "make one with task=calibrate")
    missing = [k for k in ("device", "device_name", "torch", "made", "dispatch_us", "matmul",
                           "bandwidth") if k not in data]
    if missing:
        raise CalibrationError(f"{source} lacks {', '.join(missing)}: make it again with "
                               "task=calibrate")
    try:
        Calibration(data, source).bw.rate(1)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CalibrationError(f"{source}: a grid cannot be read ({type(e).__name__}: {e})") \
            from None
    return data


def cache_dir() -> Path:
    import os

    return Path(os.environ.get("MOE_EXP_CACHE", Path.home() / ".cache" / "moe_exp")) \
        / "calibration"


def machine_key(device: torch.device) -> str:
    """This machine's calibration name: its device, CPU cores and torch threads (a CPU's
    rates scale with the threads) or GPU, torch version and the format's (a cache made
    before the in_step probe is made again)."""
    import os
    import re

    from ..hardware import device_name

    cores = f"-{os.cpu_count()}c{torch.get_num_threads()}t" if device.type == "cpu" else ""
    name = re.sub(r"[^A-Za-z0-9]+", "_", device_name(device)).strip("_")
    return f"{name}{cores}-torch{torch.__version__.split('+')[0]}-v{VERSION}"


def write(data: dict, path: Path) -> None:
    """A calibration's JSON into path, whole or not at all (written aside, then renamed)."""
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def path_of(value: str) -> Path:
    """hardware.calibration's file: a path, or a shipped calibration's name (h100)."""
    p = Path(value).expanduser()
    if p.is_file() or p.suffix == ".json" or "/" in value:
        return p
    return SHIPPED / f"{value}.json"


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime: float) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CalibrationError(f"cannot read a calibration from {path} "
                               f"({type(e).__name__})") from None
    return check_data(data, path)


def load(path: Path) -> Calibration:
    """The calibration in a file; CalibrationError where it cannot be read."""
    if not path.is_file():
        shipped = sorted(p.stem for p in SHIPPED.glob("*.json"))
        raise CalibrationError(f"no calibration file {path} (shipped: "
                               f"{', '.join(shipped) or 'none'}; auto: this machine's)")
    return Calibration(_read(str(path), path.stat().st_mtime), str(path))
