"""task=plan's accuracy: each configuration's planned peak (fake tensors, balanced routing)
beside the live tensor memory the same two steps track on real tensors (learned routing),
and the time each took. The issue's goal: within 10% of measured.

    PYTHONPATH=. python benchmarks/plan_accuracy.py [--models tiny_moe,small_moe]
        [--precisions fp32,bf16] [--ac none,full,selective] [--micro-batch 4]
        [--json out.json] [override ...]
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
    ap.add_argument("--json", type=out_file)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    runs = [[f"model={m}", f"precision={p}", f"train.activation_checkpointing={c}",
             "hardware=cpu", f"train.micro_batch_size={a.micro_batch}", *a.overrides]
            for m, p, c in itertools.product(a.models.split(","), a.precisions.split(","),
                                              a.ac.split(","))]
    check_config(ap, runs)
    from moe_exp.plan.trace import measure_step, trace_step

    print(device_name(torch.device("cpu")))
    print("| model | precision | AC | planned MiB | measured MiB | error | plan s | run s |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for o in runs:
        cfg = compose(o)
        t0 = time.perf_counter()
        plan = trace_step(cfg)
        t1 = time.perf_counter()
        real = measure_step(cfg)
        t2 = time.perf_counter()
        err = plan.peak_bytes / real.peak_bytes - 1
        row = dict(model=cfg.model.name, precision=cfg.precision.name,
                   ac=cfg.train.activation_checkpointing, planned_mib=plan.peak_bytes / 2**20,
                   measured_mib=real.peak_bytes / 2**20, error=err, plan_s=t1 - t0,
                   run_s=t2 - t1, planned=plan.at_peak, measured=real.at_peak)
        rows.append(row)
        print(f"| {row['model']} | {row['precision']} | {row['ac']} | "
              f"{row['planned_mib']:,.1f} | {row['measured_mib']:,.1f} | {err:+.1%} | "
              f"{row['plan_s']:.1f} | {row['run_s']:.1f} |", flush=True)
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst error {worst:.1%} over {len(rows)} configurations (goal: within 10%)")
    if a.json:
        save_json(a.json, device_name(torch.device("cpu")), rows)


if __name__ == "__main__":
    main()
