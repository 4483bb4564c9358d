"""task=comm: measures the latency and bus bandwidth of MoE training's collectives by size.

It follows nccl-tests' conventions. size is the full buffer per rank: all_reduce's tensor,
all_gather's output, reduce_scatter's input, all_to_all's input, send's message. algbw =
size / time. busbw = algbw x 2(n-1)/n for all_reduce, algbw for send and algbw x (n-1)/n
for the others, comparable with the link's bandwidth. Times are the max over ranks of the
median over comm.iters, each bracketed by a device sync.

send is a pipeline's hand-off between stages, measured as a pipeline runs it: rank 2k
computes a micro-batch (BUSY_S of matmuls) and sends it to 2k + 1, STREAM times; the
receiver receives each, then computes it for longer (the slower stage, so each message is
sent before its receive is posted, at a phase of the sender's next compute that drifts
through it). Its time is the receiver's, from posting a receive to holding its data (the
first of each stream, which waits for the sender's compute, is not counted): the wait a
stage's next action has once both sides are ready; post_us is the sender's, posting it
(time its next action waits too). It is the mean, not the median: a pipeline pays every
hand-off, and on a CPU, whose ranks' compute holds the cores their transport's threads
need, their times have a long tail (2 gloo ranks of an AMD EPYC, 256 KiB, unbound: median
0.2 ms, one in ten over 2 ms; bound, hardware.pin_ranks: a mean of 0.28 ms).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import ConfigError, Unsupported
from ..distributed import collective_device
from ..results import fill_null_reasons
from ..record import Comm
from .protocol import Task

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
BUSY_S, STREAM = 0.005, 8  # send: the sender's compute a message, messages a stream


def _op(name: str, n: int, numel: int, dtype, device):
    x = torch.ones(numel, dtype=dtype, device=device)
    if name == "all_reduce":
        return lambda: dist.all_reduce(x), 2 * (n - 1) / n
    if name == "all_gather":
        part = x[: numel // n].clone()
        return lambda: dist.all_gather_into_tensor(x, part), (n - 1) / n
    if name == "reduce_scatter":
        part = x[: numel // n].clone()
        return lambda: dist.reduce_scatter_tensor(part, x), (n - 1) / n
    out = torch.empty_like(x)
    return lambda: dist.all_to_all_single(out, x), (n - 1) / n


def sizes(c, world: int) -> tuple[list[int], int]:
    """The message sizes to measure, and the unit they are whole multiples of, in bytes.

    Sizes are comm.min_bytes x factor^k up to max_bytes, each rounded down to whole elements
    per rank but at least one, repeats dropped."""
    unit = world * torch.tensor([], dtype=getattr(torch, c.dtype)).element_size()
    out, size = [], c.min_bytes
    while size <= c.max_bytes:
        out.append(max(unit, size // unit * unit))
        size *= c.factor
    return sorted(set(out)), unit


def _compute(a: torch.Tensor, seconds: float, sync) -> None:
    """Matmuls of `a` (n x n, each entry 1/n: a fixed point) for `seconds` of this rank's
    time: a pipeline stage's compute."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = a @ a
        sync()


def _handoffs(d, numel: int, dtype, device, sync, c) -> tuple[list, list]:
    """A receiver's seconds per hand-off (module doc), comm.iters x (STREAM - 1) of them
    after comm.warmup streams, and a sender's seconds posting each send; ([], []) on an odd
    world's last rank."""
    x = torch.ones(numel, dtype=dtype, device=device)
    n = 4096 if device.type == "cuda" else 256
    a = torch.full((n, n), 1.0 / n, device=device)
    peer = d.rank + 1 if d.rank % 2 == 0 else d.rank - 1
    times, posts = [], []
    for k in range(c.warmup + c.iters):
        sync()
        dist.barrier()
        if peer >= d.world:
            continue
        works, timed = [], k >= c.warmup
        for i in range(STREAM):
            if d.rank % 2 == 0:
                _compute(a, BUSY_S, sync)
                t0 = time.perf_counter()
                works += dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer)])
                posts += [time.perf_counter() - t0] if timed else []
                continue
            t0 = time.perf_counter()
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, peer)]):
                w.wait()
            sync()
            times += [time.perf_counter() - t0] if i and timed else []
            _compute(a, 1.2 * BUSY_S, sync)
        for w in works:
            w.wait()
    return times, posts


def measure(cfg, d, device) -> list[dict]:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    c = cfg.comm
    dtype = getattr(torch, c.dtype)
    esize = torch.tensor([], dtype=dtype).element_size()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows, measured = [], sizes(c, d.world)[0]
    for name in c.ops:
        for nbytes in measured:
            numel = nbytes // esize
            if name == "send":
                got = _handoffs(d, numel, dtype, device, sync, c)
                (mid, post), bus = [statistics.mean(x or [0.0]) for x in got], 1.0
            else:
                post = None
                times, (fn, bus) = [], _op(name, d.world, numel, dtype, device)
                for i in range(c.warmup + c.iters):
                    sync()
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    if i >= c.warmup:
                        times.append(time.perf_counter() - t0)
                mid = statistics.median(times)
            t = torch.tensor([mid, post or 0.0], dtype=torch.float64,
                             device=collective_device(device))
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            (sec, post_s), real = t.tolist(), numel * esize
            rows.append({"op": name, "bytes": real, "latency_us": sec * 1e6,
                         "algbw_gbps": real / sec / 1e9, "busbw_gbps": real / sec / 1e9 * bus,
                         **({"post_us": post_s * 1e6} if post is not None else {})})
    return rows


class CommTask(Task):
    name = "comm"
    section = Comm
    model = False
    own_ranks = True

    @staticmethod
    def check(cfg) -> None:
        c = cfg.comm
        bad = [op for op in c.ops if op not in OPS]
        if len(set(c.ops)) < len(c.ops):
            raise ConfigError("comm.ops", f"{list(c.ops)} names an op twice: each is one row")
        if bad or not c.ops:
            raise ConfigError("comm.ops", f"{bad or 'empty'}: allowed are {', '.join(OPS)}")
        if c.max_bytes < c.min_bytes:
            raise ConfigError("comm.max_bytes", f"must be >= comm.min_bytes={c.min_bytes}")
        if cfg.hardware.devices < 2:
            raise ConfigError("hardware.devices", "task=comm measures collectives between "
                              "ranks: set hardware.devices >= 2")

    @staticmethod
    def check_here(cfg) -> None:
        """Skip where the largest size's buffers, per rank, do not fit hardware.memory_gib
        (a CPU's holds this machine's ranks together)."""
        from ..ranks import world_size

        c, mem, n = cfg.comm, cfg.hardware.memory_gib, world_size(cfg.hardware.devices)
        if mem is None:
            return
        local = n if cfg.hardware.device == "cpu" else 1
        largest = sizes(c, n)[0][-1]
        # all_reduce, send: in place; all_gather / reduce_scatter: + a rank's part;
        # all_to_all: x2
        bufs = max({"all_reduce": 1, "send": 1, "all_to_all": 2}.get(op, 1 + 1 / n)
                   for op in c.ops)
        need = bufs * largest * local / 2**30
        if need > mem:
            where = f"{local} CPU ranks together" if local > 1 else "one device"
            many = f"{bufs:g} buffer" + ("s" if bufs != 1 else "")
            gib = lambda x: f"{x:,.0f}" if x >= 10 else f"{x:.2g}"  # noqa: E731
            raise Unsupported("comm.max_bytes", f"its largest size ({largest:,} bytes) needs "
                              f">= {gib(need)} GiB on {where} ({many} of it per rank); "
                              f"hardware={cfg.hardware.name} has {gib(mem)} GiB")

    @staticmethod
    def ranked(cfg) -> bool:
        return True

    def run_name(self) -> str:
        return f"comm-{dist.get_backend()}x{self.ctx.dist.world}"

    def run(self, rec: dict) -> None:
        import pandas as pd

        from ..hardware import device_name, torch_device

        cfg, d, out_dir = self.ctx.cfg, self.ctx.dist, self.ctx.out_dir
        device = torch_device(cfg)
        measured, unit = sizes(cfg.comm, d.world)
        if d.main and cfg.comm.min_bytes % unit:
            print(f"[comm] sizes are whole elements per rank: multiples of {unit} bytes "
                  f"({d.world} ranks x {cfg.comm.dtype}); comm.min_bytes="
                  f"{cfg.comm.min_bytes} is measured as {measured[0]}", file=sys.stderr,
                  flush=True)
        rows = measure(cfg, d, device)
        if not d.main:
            return
        df = pd.DataFrame(rows)
        df.to_csv(out_dir / "comm.csv", index=False)
        (out_dir / "comm.md").write_text(df.to_markdown(index=False, floatfmt=".3f") + "\n")
        best = df.loc[df.groupby("op")["busbw_gbps"].idxmax()]
        rec.update(task="comm", comm=rows, world_size=d.world,
                   device_name=device_name(device), torch_version=torch.__version__,
                   comm_backend=dist.get_backend(),
                   **{f"busbw_gbps_{r.op}": r.busbw_gbps for r in best.itertuples()})
        fill_null_reasons(rec, "task=comm measures collectives, not training")
        if self.ctx.tracker:
            self.ctx.tracker.table("comm", df)

    def show(self, rec: dict) -> None:
        import pandas as pd

        _print(pd.DataFrame(rec["comm"]), self.ctx.dist, self.ctx.out_dir)


def _print(df, d, out_dir: Path) -> None:
    from rich.table import Table

    t = Table(title=f"collectives on {d.world} ranks ({dist.get_backend()})")
    for col in ("op", "size", "latency", "algbw", "busbw"):
        t.add_column(col, justify="left" if col == "op" else "right")
    for r in df.itertuples():
        size = f"{r.bytes / 2**20:.2f} MiB" if r.bytes >= 2**20 else \
            f"{r.bytes / 1024:.0f} KiB" if r.bytes >= 1024 else f"{r.bytes} B"
        t.add_row(r.op, size, f"{r.latency_us:,.1f} us", f"{r.algbw_gbps:.3f} GB/s",
                  f"{r.busbw_gbps:.3f} GB/s")
    from .. import screen

    screen.console().print(t)
    print(f"record: {out_dir / 'metrics.json'} (table: comm.csv, comm.md)", file=sys.stderr)
