"""A plan's step time and peak against measured runs: each row is a task=bench run that
plans its own step first (train.plan), its record's planned_step_error and
planned_peak_error. With --calibration the plan's time comes from that calibration
(task=calibrate); without, from the profile's datasheet (a floor).

--rows pipeline: parallel.pp=2 on 2 gloo ranks, each schedule (tiny_moe, 4 blocks, 4
micro-batches): the planned bubble beside the measured one (issue 51).
--rows gpu: issue 50's table on a GPU (moe_1b bf16 micro-batch 8 x 2048 eager, balanced,
compiled and fully checkpointed; seed_moe8 at hidden 1024, 8 layers, fp32 and bf16, with
and without full checkpointing). --rows cpu: tiny_moe and small_moe x fp32, bf16 x none,
full, selective x eager, compiled (24 rows), routed balanced as their plans are: a learned
router's first steps load some experts past the padded dispatch's limit, which on CPU
falls back to one matmul an expert and pads the compiled step's buffers (benchmarks/
plans.md). --repeat N runs each row N times (CPU steps
move +-20% between processes) and reports the median error; the rows run in rounds (each
row once, then again), and each run records `machine_gflops`, a 512^3 matmul's rate just
before it (this VM's speed at that moment).

--cpu-peaks: the datasheet roofline at this CPU's own peaks, measured here first (the
median of an fp32, and bf16 where a row runs it, 2048^3 matmul's FLOP/s and of a 256 MiB
copy's bytes/s), not the cpu profile's; the basis without a calibration.

    PYTHONPATH=. python benchmarks/plan_rows.py --rows gpu|cpu [--calibration FILE |
        --cpu-peaks] [--repeat 1] [--only 0,3] [--json out.json] [override ...]
"""
from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import at_least, check_config, compose, out_file, save_json  # noqa: E402

MOE_1B = ["model=moe_1b", "precision=bf16", "train.micro_batch_size=8", "train.seq_len=2048"]
SEED = ["model=seed_moe8", "model.hidden_size=1024", "model.num_layers=8"]
ROWS = {
    "gpu": [MOE_1B, MOE_1B + ["model.routing=balanced"], MOE_1B + ["train.compile=default"],
            MOE_1B + ["train.activation_checkpointing=full"],
            SEED + ["precision=fp32"], SEED + ["precision=bf16"],
            SEED + ["precision=bf16", "train.activation_checkpointing=full"],
            SEED + ["precision=fp32", "train.activation_checkpointing=full"]],
    "cpu": [[f"model={m}", f"precision={p}", f"train.activation_checkpointing={a}",
             f"train.compile={c}", "hardware=cpu", "train.micro_batch_size=4",
             "model.routing=balanced"]
            for m, p, a, c in itertools.product(("tiny_moe", "small_moe"), ("fp32", "bf16"),
                                                ("none", "full", "selective"),
                                                ("off", "default"))],
}
PP = ["model=tiny_moe", "hardware=cpu", "parallel=fsdp", "hardware.devices=2", "parallel.pp=2",
      "parallel.pp_microbatches=4", "train.micro_batch_size=8", "model.num_layers=4",
      "parallel.profile_steps=3"]
ROWS["pipeline"] = [PP + [f"parallel.pp_schedule={s}"] + (
    ["parallel.reshard_after_forward=false"] if s == "zero_bubble" else [])
    for s in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")]
KEYS = ("status", "pp_bubble_share", "planned_pp_bubble_share", "planned_pp_bubble_error",
        "pp_overhead_share",
        "planned_step_ms", "planned_kernel_ms", "step_time_ms", "planned_step_error",
        "planned_peak_gib", "peak_mem_gib", "tracked_peak_gib", "planned_peak_error",
        "planned_time_basis", "plan_s", "compile_s", "device_name", "error", "pp_stage_ms",
        "planned_pp_stage_ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", choices=sorted(ROWS), default="gpu")
    ap.add_argument("--only", help="row numbers to run, e.g. 0,3")
    ap.add_argument("--calibration", help="hardware.calibration for every row")
    ap.add_argument("--cpu-peaks", action="store_true", help="the datasheet roofline at "
                    "this CPU's measured peaks")
    ap.add_argument("--repeat", type=at_least(1), default=1)
    ap.add_argument("--steps", type=at_least(1), default=8)
    ap.add_argument("--json", type=out_file)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    rows = ROWS[a.rows]
    if a.only:
        rows = [rows[int(i)] for i in a.only.split(",")]
    common = ["logger=none", f"train.steps={a.steps}", "train.warmup_steps=3",
              *([f"hardware.calibration={a.calibration}"] if a.calibration else []),
              *a.overrides]
    if a.cpu_peaks and a.calibration:
        ap.error("--cpu-peaks and --calibration: one time basis at a time")
    runs = [[*r, *common] for r in rows]
    check_config(ap, runs)
    from moe_exp.run import run

    peaks = None
    if a.cpu_peaks:
        half = any("precision=fp32" not in o for o in runs)
        peaks = cpu_peaks(dtypes=("fp32", "bf16") if half else ("fp32",))
        print(f"this CPU: fp32 matmul {peaks['fp32'] / 1e9:,.0f} GFLOP/s, " + (
            f"bf16 {peaks['bf16'] / 1e9:,.0f} GFLOP/s, " if half else "") +
            f"copy {peaks['bandwidth'] / 1e9:,.1f} GB/s")
        hw = [*(f"++hardware.peak_flops.{k}={v:.4g}" for k, v in peaks.items()
                if k != "bandwidth"), f"hardware.memory_bandwidth={peaks['bandwidth']:.4g}"]
        runs = [[*o, *hw] for o in runs]

    out, device, recs = [], None, [[] for _ in runs]
    for turn in range(a.repeat):  # (in rounds: a slow spell of this VM hits several rows
        for i, o in enumerate(runs):  # once each rather than one row's every run)
            speed = machine_speed()
            with tempfile.TemporaryDirectory() as d:
                rec = run(compose(o), out_dir=d, progress=False, overrides=o)
            recs[i].append({k: rec.get(k) for k in KEYS} | {"machine_gflops": speed})
            recs[i][-1]["null_reasons"] = {k: v for k, v in rec["null_reasons"].items()
                                           if k in KEYS}
            device = device or recs[i][0]["device_name"]
            out = [{"row": " ".join(r), "runs": rr, **_medians(rr),
                    **({"cpu_peaks": peaks} if peaks else {})}
                   for r, rr in zip(rows, recs) if rr]
            print(f"[round {turn + 1}/{a.repeat}, row {i + 1}/{len(runs)}] step error "
                  f"{_fmt(rec.get('planned_step_error'), '+.1%')}, this machine's "
                  f"{speed:,.0f} GFLOP/s before it", flush=True)
            if a.json:
                save_json(a.json, device or "", out)
    print("| row | status | planned ms | kernels ms | measured ms | step error | planned GiB "
          "| measured GiB | peak error |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in out:
        _print(row)
    errs = [abs(r["planned_step_error"]) for r in out if r["planned_step_error"] is not None]
    peaks = [abs(r["planned_peak_error"]) for r in out if r["planned_peak_error"] is not None]
    if errs:
        print(f"worst step error {max(errs):.1%}, worst peak error "
              f"{max(peaks, default=float('nan')):.1%} over {len(out)} rows"
              f"{f' (medians of {a.repeat})' if a.repeat > 1 else ''}; {device}")


def cpu_peaks(reps: int = 5, dtypes=("fp32", "bf16")) -> dict:
    """This CPU's matmul FLOP/s (of `dtypes`: fp32, bf16) and copy bandwidth (bytes read +
    written/s), medians. bf16 only where a row runs it: a CPU without bf16 matmul units
    (AVX2) takes a minute for each 2048^3 one."""
    import torch

    med = functools.partial(_median_s, reps=reps)
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


def machine_speed(reps: int = 5) -> float:
    """GFLOP/s of a 512^3 fp32 matmul now, the median of `reps`: how fast this machine
    runs at the moment a row starts (a shared VM's speed drifts by 2x within an hour)."""
    import torch

    x = torch.randn(512, 512)
    return 2 * 512**3 / _median_s(lambda: x @ x, reps) / 1e9


def _median_s(fn, reps: int) -> float:
    """Seconds a call of fn takes, the median of `reps` after one to warm up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fmt(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def _medians(recs: list) -> dict:
    """The median of each figure over a row's runs (its ok runs)."""
    ok = [r for r in recs if r["status"] == "ok"] or recs
    med = {}
    for k in ("planned_step_ms", "planned_kernel_ms", "step_time_ms", "planned_step_error",
              "planned_peak_gib", "peak_mem_gib", "tracked_peak_gib", "planned_peak_error",
              "pp_bubble_share", "planned_pp_bubble_share", "pp_overhead_share",
              "machine_gflops"):
        vals = [r[k] for r in ok if r.get(k) is not None]
        med[k] = statistics.median(vals) if vals else None
    med["status"] = ok[0]["status"]
    return med


def _print(r: dict) -> None:
    f = _fmt
    measured = r["peak_mem_gib"] if r["tracked_peak_gib"] is None else r["tracked_peak_gib"]
    print(f"| {r['row']} | {r['status']} | {f(r['planned_step_ms'], ',.1f')} | "
          f"{f(r['planned_kernel_ms'], ',.1f')} | {f(r['step_time_ms'], ',.1f')} | "
          f"{f(r['planned_step_error'], '+.1%')} | {f(r['planned_peak_gib'], ',.3f')} | "
          f"{f(measured, ',.3f')} | {f(r['planned_peak_error'], '+.1%')} |", flush=True)
    if r["pp_bubble_share"] is not None or r["planned_pp_bubble_share"] is not None:
        print(f"  bubble: planned {f(r['planned_pp_bubble_share'], '.1%')}, measured "
              f"{f(r['pp_bubble_share'], '.1%')} (overhead "
              f"{f(r.get('pp_overhead_share'), '.1%')})", flush=True)
    if r["status"] != "ok":
        print(f"  ({r['runs'][0].get('error')})", flush=True)


if __name__ == "__main__":
    main()
