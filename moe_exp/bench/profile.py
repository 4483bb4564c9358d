"""train.profile: a torch.profiler trace of the run's last train.profile_steps steps.

Those steps are kept out of the timing figures, as the communication window is. Writes
trace.json in Chrome/Perfetto format, profile.txt with the top operators by self time and
the record's profile_shares; on CUDA also memory_snapshot.pickle, a memory snapshot of the
first of those steps for https://pytorch.org/memory_viz.
"""
from __future__ import annotations

import pickle
from pathlib import Path

# (category, name fragments, lower case): the first that matches the op's name
CATEGORIES = (
    ("all_to_all", ("all_to_all", "alltoall")),
    ("all_reduce", ("all_reduce", "allreduce", "reduce_scatter", "reducescatter",
                    "all_gather", "allgather")),
    ("attention", ("attention", "flash", "sdpa", "flex")),
    ("optimizer", ("optimizer", "adam", "foreach", "muon")),
    ("matmul", ("aten::mm", "aten::bmm", "aten::addmm", "_grouped_mm", "matmul", "linear")),
)
SHARES = tuple(c for c, _ in CATEGORIES) + ("other",)
FIELDS = ("profile_trace", "profile_shares", "memory_snapshot")  # the record's


def category(name: str) -> str:
    low = name.lower()
    for cat, parts in CATEGORIES:
        if any(p in low for p in parts):
            return cat
    return "other"


def shares(prof, on_device: bool) -> dict[str, float]:
    """Each category's share of the profiled steps' time, by the op that spent it.

    On a GPU, each op's self device time: every kernel counted once, to the op that
    launched it. On a CPU, each op's self time. The shares sum to 1, or are all 0 where
    nothing ran.
    """
    from torch.autograd import DeviceType

    attr = "self_device_time_total" if on_device else "self_cpu_time_total"
    out = dict.fromkeys(SHARES, 0.0)
    for e in prof.key_averages():
        if e.device_type == DeviceType.CPU:  # (kernels and GPU-side ranges: their ops')
            out[category(e.key)] += max(getattr(e, attr, 0) or 0, 0)
    total = sum(out.values())
    return {k: (v / total if total else 0.0) for k, v in out.items()}


def top_shares(shares: dict) -> str:
    """The shares on one line, largest first, as 'matmul 48%, other 40%'; under 0.5% left out."""
    return ", ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])
                     if v >= 0.005)


def write(prof, snapshot, out_dir: Path, on_device: bool) -> dict:
    """The trace, the table and the snapshot into out_dir; the record's fields."""
    trace = out_dir / "trace.json"
    prof.export_chrome_trace(str(trace))
    sort = "self_device_time_total" if on_device else "self_cpu_time_total"
    (out_dir / "profile.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=30))
    fields = {"profile_trace": trace.name, "profile_shares": shares(prof, on_device)}
    if snapshot is not None:
        with open(out_dir / "memory_snapshot.pickle", "wb") as f:
            pickle.dump(snapshot, f)
        fields["memory_snapshot"] = "memory_snapshot.pickle"
    return fields
