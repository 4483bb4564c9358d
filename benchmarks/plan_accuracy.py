"""task=plan's accuracy: each configuration's planned peak (fake tensors, balanced routing)
beside the live tensor memory the same step tracks on real tensors (learned routing), and
the time each took. The issue's goal: within 10% of measured.

--bench: each configuration also runs as a task=bench run (train.plan, its record's
planned_peak_error against the tracked last warmup step and planned_step_error against
its median step), its roofline given this CPU's own peaks, measured here first: the
median of an fp32 (and bf16) 2048^3 matmul's FLOP/s and of a 256 MiB copy's bytes/s.

    PYTHONPATH=. python benchmarks/plan_accuracy.py [--models tiny_moe,small_moe]
        [--precisions fp32,bf16] [--ac none,full,selective] [--micro-batch 4]
        [--bench] [--json out.json] [override ...]
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import at_least, check_config, compose, device_name, out_file, save_json  # noqa


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny_moe,small_moe")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--ac", default="none,full,selective")
    ap.add_argument("--micro-batch", type=at_least(1), default=4)
    ap.add_argument("--parallel", default="none", help="e.g. none,ddp,fsdp,expert: the "
                    "others on 2 gloo ranks (rank 0's real step against the plan of rank 0)")
    ap.add_argument("--bench", action="store_true", help="also run each as a bench run")
    ap.add_argument("--json", type=out_file)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    runs = [[f"model={m}", f"precision={p}", f"train.activation_checkpointing={c}",
             "hardware=cpu", f"train.micro_batch_size={a.micro_batch}",
             *([f"parallel={par}", "hardware.devices=2"] if par != "none" else []),
             *a.overrides]
            for par, m, p, c in itertools.product(a.parallel.split(","), a.models.split(","),
                                                  a.precisions.split(","), a.ac.split(","))]
    check_config(ap, runs)
    from moe_exp.plan.trace import trace_step

    print(device_name(torch.device("cpu")))
    print("| parallel | model | precision | AC | planned MiB | measured MiB | error | plan s | "
          "run s |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for o in runs:
        cfg = compose(o)
        t0 = time.perf_counter()
        plan = trace_step(cfg)
        t1 = time.perf_counter()
        real = _measured(cfg, o)
        t2 = time.perf_counter()
        err = plan.peak_bytes / real.peak_bytes - 1
        row = dict(parallel=cfg.parallel.name, model=cfg.model.name,
                   precision=cfg.precision.name, ac=cfg.train.activation_checkpointing,
                   planned_mib=plan.peak_bytes / 2**20, measured_mib=real.peak_bytes / 2**20,
                   error=err, plan_s=t1 - t0,
                   run_s=t2 - t1, planned=plan.at_peak, measured=real.at_peak)
        rows.append(row)
        print(f"| {row['parallel']} | {row['model']} | {row['precision']} | {row['ac']} | "
              f"{row['planned_mib']:,.1f} | {row['measured_mib']:,.1f} | {err:+.1%} | "
              f"{row['plan_s']:.1f} | {row['run_s']:.1f} |", flush=True)
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst error {worst:.1%} over {len(rows)} configurations (goal: within 10%)")
    if a.bench:
        _benches([o for o, r in zip(runs, rows) if r["parallel"] == "none"],
                 [r for r in rows if r["parallel"] == "none"])
    if a.json:
        save_json(a.json, device_name(torch.device("cpu")), rows)


def _measured(cfg, overrides):
    """The real step's tracked memory: here, or on 2 gloo ranks (rank 0's)."""
    from moe_exp.plan.trace import measure_step

    if cfg.parallel.name == "none":
        return measure_step(cfg)
    from moe_exp.distributed import launch, rank_entry

    return launch(rank_entry, cfg.hardware.devices, _rank_step, overrides)


def _rank_step(overrides):
    """One rank: join the group, track the real step, leave (rank 0's StepMemory)."""
    from moe_exp import distributed
    from moe_exp.plan.trace import measure_step

    cfg = compose(overrides)
    distributed.init(cfg)
    try:
        got = measure_step(cfg)
        got.ops = None  # (its ops stay here)
        return got
    finally:
        distributed.finish()


def cpu_peaks(reps: int = 5, dtypes=("fp32", "bf16")) -> dict:
    """This CPU's matmul FLOP/s (of `dtypes`: fp32, bf16) and copy bandwidth (bytes read +
    written/s), medians. bf16 only where a row runs it: a CPU without bf16 matmul units
    (AVX2) takes a minute for each 2048^3 one."""
    import statistics

    def med(fn):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    n, out = 2048, {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if name not in dtypes:
            continue
        x = torch.randn(n, n, dtype=dtype)
        out[name] = 2 * n**3 / med(lambda: x @ x)
    src = torch.ones(2**26)  # 256 MiB
    dst = torch.empty_like(src)
    out["bandwidth"] = 2 * src.numel() * 4 / med(lambda: dst.copy_(src))
    return out


def _benches(runs, rows) -> None:
    """Each configuration as a bench run that plans its step, given this CPU's peaks."""
    import tempfile

    from moe_exp.run import run

    half = any(r["precision"] != "fp32" for r in rows)
    peaks = cpu_peaks(dtypes=("fp32", "bf16") if half else ("fp32",))
    print(f"\nthis CPU: fp32 matmul {peaks['fp32'] / 1e9:,.0f} GFLOP/s, " + (
        f"bf16 {peaks['bf16'] / 1e9:,.0f} GFLOP/s, " if half else "") +
        f"copy {peaks['bandwidth'] / 1e9:,.1f} GB/s")
    print("| model | precision | AC | planned MiB | tracked MiB | peak error | planned ms | "
          "step ms | step error |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    hw = [*(f"++hardware.peak_flops.{k}={v:.4g}" for k, v in peaks.items() if k != "bandwidth"),
          f"hardware.memory_bandwidth={peaks['bandwidth']:.4g}", "logger=none"]
    for o, row in zip(runs, rows):
        with tempfile.TemporaryDirectory() as d:
            rec = run(compose([*o, *hw]), out_dir=d, progress=False, overrides=[*o, *hw])
        row["bench"] = {k: rec.get(k) for k in (
            "status", "planned_peak_gib", "tracked_peak_gib", "planned_peak_error",
            "planned_step_ms", "planned_compute_ms", "step_time_ms", "planned_step_error")}
        row["cpu_peaks"] = peaks
        b = row["bench"]
        if b["status"] != "ok" or b["planned_peak_error"] is None:
            print(f"| {row['model']} | {row['precision']} | {row['ac']} | {b['status']}: "
                  f"{rec.get('error') or rec['null_reasons'].get('planned_peak_error')} |")
            continue
        step = b["planned_step_error"]
        print(f"| {row['model']} | {row['precision']} | {row['ac']} | "
              f"{b['planned_peak_gib'] * 1024:,.1f} | {b['tracked_peak_gib'] * 1024:,.1f} | "
              f"{b['planned_peak_error']:+.1%} | {b['planned_step_ms']:,.1f} | "
              f"{b['step_time_ms']:,.1f} | "
              f"{'—' if step is None else f'{step:+.0%}'} |", flush=True)


if __name__ == "__main__":
    main()
