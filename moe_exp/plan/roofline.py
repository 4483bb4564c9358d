"""The plan's step time, from its traced step's ops and the hardware profile.

Each op takes the longer of its FLOPs at the peak FLOP/s of its dtype and the bytes it reads
and writes at hardware.memory_bandwidth: a roofline of the eager step, with no fusion. Each
collective moves its message's bus share at hardware.link_bandwidth where its group is
within a node (hardware.devices_per_node), else at hardware.network_bandwidth; or it takes
the time a task=comm record measured, named by hardware.comm_from. The bus share is
nccl-tests' convention, as task=comm measures it: 2(n-1)/n for an all-reduce, (n-1)/n
otherwise. Nothing overlaps, so the time is an upper bound where FSDP's prefetch or DDP's
buckets hide communication. A pipeline's send (or receive) moves its bytes whole; from a
task=comm record, its send row (a hand-off as a pipeline makes it), or in a record without
one, a 2-rank all-to-all of twice its bytes."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

# others: (n - 1) / n; a send (a pipeline's) moves its message whole
BUS_SHARE = {"all_reduce": lambda n: 2 * (n - 1) / n, "send": lambda n: 1.0,
             "recv": lambda n: 1.0}
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
P2P = ("send", "recv")  # a pipeline's hand-off: task=comm's send row times it


def _peak(hw, dtype, precision: str) -> tuple[str, float | None]:
    name = DTYPES.get(dtype, "tf32" if precision == "tf32" else "fp32")
    return name, (hw.peak_flops or {}).get(name)


def compute_ms(ops, hw, precision: str) -> tuple[float | None, str | None]:
    """The ops' roofline time in ms, or None and why not."""
    if not hw.memory_bandwidth:
        return None, f"hardware={hw.name} gives no memory_bandwidth: set " \
                     "hardware.memory_bandwidth=<bytes/s per device>"
    from .ops import is_kernel

    seconds = 0.0
    for flops, nbytes, dtype, shape in filter(is_kernel, ops.ops):
        t = nbytes / hw.memory_bandwidth
        if flops:
            name, peak = _peak(hw, dtype, precision)
            if not peak:
                return None, f"no peak FLOP/s known for hardware={hw.name} at {name} (the " \
                             f"step's {name} matmuls): set ++hardware.peak_flops.{name}=<FLOP/s>"
            t = max(t, flops / peak)
        seconds += t
    return seconds * 1e3, None


def comm_curves(path: str) -> dict:
    """A task=comm record's measured latency by collective and message size.

    `path` is its metrics.json or the run dir that holds it. Returns {op: (world size,
    [(bytes, seconds)])}, and send_post, a send's sender's time posting it; raises
    ValueError naming the file and what is wrong. Read once while the file is unchanged
    (a plan asks for it per traced rank and per use)."""
    f = Path(path) / "metrics.json" if Path(path).is_dir() else Path(path)
    try:
        st = f.stat()
    except OSError as e:
        raise ValueError(f"cannot read a record from {f} ({type(e).__name__})") from None
    return _curves(str(f), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _curves(f: str, _mtime_ns: int, _size: int) -> dict:
    import json
    import math

    try:
        rec = json.loads(Path(f).read_text())
    except (OSError, ValueError) as e:  # (UnicodeDecodeError is a ValueError)
        raise ValueError(f"cannot read a record from {f} ({type(e).__name__})") from None
    if not isinstance(rec, dict) or rec.get("task") != "comm" or rec.get("status") != "ok" \
            or not isinstance(rec.get("comm"), list) or not rec["comm"]:
        raise ValueError(f"{f} is not a finished task=comm record")
    whole = lambda x: isinstance(x, int) and not isinstance(x, bool)  # noqa: E731
    world = rec.get("world_size")
    if not whole(world) or world < 1:
        raise ValueError(f"{f}: world_size is {world!r}, not a count of ranks")
    out = {}
    for i, r in enumerate(rec["comm"]):
        op = r.get("op") if isinstance(r, dict) else None
        if not isinstance(op, str):
            raise ValueError(f"{f}: comm row {i} names no collective (op)")
        size, us = r.get("bytes"), r.get("latency_us")
        if not whole(size) or size < 1:
            raise ValueError(f"{f}: comm row {i} ({op}) has bytes {size!r}, not a positive "
                             "whole number")
        if not isinstance(us, (int, float)) or isinstance(us, bool) or not math.isfinite(us) \
                or us <= 0:
            raise ValueError(f"{f}: comm row {i} ({op}) has latency_us {us!r}, not a positive "
                             "time")
        out.setdefault(op, (world, []))[1].append((size, us / 1e6))
        post = r.get("post_us")  # (a send's: its sender's time posting it)
        if isinstance(post, (int, float)) and not isinstance(post, bool) and post > 0:
            out.setdefault(op + "_post", (world, []))[1].append((size, post / 1e6))
    return {op: (n, sorted(points)) for op, (n, points) in out.items()}


def _share(name: str, n: int) -> float:
    return BUS_SHARE.get(name, lambda k: (k - 1) / k)(n)


def measured_s(curve, name: str, nbytes: int, n: int) -> float:
    """A message's time in seconds from task=comm's curve.

    Interpolated in log-log between the sizes measured, the smallest's latency below them,
    the largest's bandwidth above; scaled from the measured world size's bus share to this
    group's."""
    import math

    world, points = curve
    if nbytes <= points[0][0]:
        t = points[0][1]
    elif nbytes >= points[-1][0]:
        t = points[-1][1] * nbytes / points[-1][0]
    else:
        (s0, t0), (s1, t1) = next((a, b) for a, b in zip(points, points[1:])
                                  if a[0] <= nbytes <= b[0])
        f = math.log(nbytes / s0) / math.log(s1 / s0) if s1 > s0 else 0.0
        t = math.exp(math.log(t0) + f * math.log(t1 / t0))
    return t * _share(name, n) / _share(name, world) if world > 1 else t


def call_seconds(ops, hw) -> tuple[list | None, str | None]:
    """Each collective's time in seconds (ops.calls' order), or None and why not."""
    curves = comm_curves(hw.comm_from) if hw.comm_from else {}
    out = []
    for name, nbytes, ranks in ops.calls:
        n = len(ranks)
        if n <= 1:
            out.append(0.0)
        elif (key := "send" if name in P2P else name) in curves:
            out.append(measured_s(curves[key], key, nbytes, n))
        elif name in P2P and "all_to_all" in curves:  # (a record of before task=comm timed
            # sends: a 2-rank all-to-all of twice the bytes sends each rank's half, as one)
            out.append(measured_s(curves["all_to_all"], "all_to_all", 2 * nbytes, 2))
        else:
            within = len({r // hw.devices_per_node for r in ranks}) == 1
            bw = hw.link_bandwidth if within else hw.network_bandwidth
            if not bw:
                key = "link_bandwidth" if within else "network_bandwidth"
                return None, f"hardware={hw.name} gives no {key} (the {name} of {n} ranks " \
                             f"{'within a node' if within else 'across nodes'}): set " \
                             f"hardware.{key}=<bytes/s per device, each way>"
            out.append(nbytes * _share(name, n) / bw)
    return out, None
