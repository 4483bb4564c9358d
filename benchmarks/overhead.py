"""Framework overhead: process start -> first measured step, and the whole default run.

    PYTHONPATH=. python benchmarks/overhead.py [--runs 5] [--json out.json] [-- overrides...]

Runs, in subprocesses, interleaved (one of each per round, in the orders of
_timing.round_orders, --runs rounds; rounds where other processes loaded the CPU are
flagged):
  default     `python -m moe_exp.run [overrides]`: wall time, and the record's startup_s
              (process start -> first measured step, compile excluded)
  none        the same with logger=none (left out where the overrides set it)
  torch       `python -c "import torch; torch.optim.AdamW(...)"`: what any PyTorch training
              process pays before its first step (interpreter, torch, and torch._dynamo,
              which torch.optim imports on first use)
then one more run of the default command with a phase timeline (process age when each
phase ends: imports, Hydra compose, hardware/validate, model build, optimizer, data,
warmup steps, first measured step, W&B, summary) and the slowest imports (-X importtime).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import (_cpu_ticks, at_least, check_config, other_load, out_file,  # noqa: E402
                     round_orders)

TORCH_FLOOR = ("import torch; p = torch.nn.Parameter(torch.zeros(4)); "
               "torch.optim.AdamW([p], fused=True).step()")

# Runs the entrypoint with timing wrappers around its phases (see --phases).
PHASES = r'''
import os, sys
def process_age_s():  # as moe_exp.bench.timer's, without importing torch first
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - start / os.sysconf("SC_CLK_TCK")
marks = [("interpreter ready", process_age_s())]
sys.path.insert(0, {root!r})
def mark(name):
    marks.append((name, process_age_s()))
def wrap(mod, attr, name, before=None):
    import importlib
    m = importlib.import_module(mod)
    f = getattr(m, attr)
    def g(*a, **k):
        if before:
            mark(before)
        try:
            return f(*a, **k)
        finally:
            mark(name)
    setattr(m, attr, g)
import moe_exp.run  # noqa: F401  (torch, hydra, moe_exp)
mark("imports (torch, hydra, moe_exp)")
wrap("moe_exp.pipeline", "prepare", "hardware resolve + validate", before="Hydra set-up + compose")
import moe_exp.tasks.bench as R, moe_exp.train.loop as L
wrap("moe_exp.optimizations.dispatch", "resolve_model_dispatch", "dispatch probe")
wrap("moe_exp.model", "build_model", "model build")
wrap("moe_exp.optimizations", "apply", "optimizations applied")
wrap("moe_exp.optim", "build_optimizer", "optimizer (imports torch._dynamo)")
wrap("moe_exp.data", "build_loader", "data loader")
orig = L.process_age_s
def first_measured():
    mark("warmup steps -> first measured step")
    return orig()
L.process_age_s = first_measured
wrap("moe_exp.train.loop", "train_loop", "measured steps")
R.train_loop = L.train_loop
import moe_exp.tracking as T
fin = T.Tracker.finish
def finish(self, ok):
    fin(self, ok)
    mark("W&B (deferred start, replay, finish)")
T.Tracker.finish = finish
wrap("moe_exp.tasks.summary", "print_summary", "summary printed")
sys.argv = [moe_exp.run.__file__, *{args!r}]
try:
    moe_exp.run.main()
except SystemExit:
    pass
import json
print("PHASES " + json.dumps(marks))
'''


def run(cmd, cwd, env):
    c0, t0 = _cpu_ticks(), time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    return p, wall, other_load(c0, _cpu_ticks(), wall)


def record(cwd: Path) -> dict:
    files = sorted(cwd.glob("outputs/*/*/metrics.json"), key=os.path.getmtime)
    return json.loads(files[-1].read_text())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=at_least(1), default=5)
    ap.add_argument("--json", default=None, type=out_file)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    check_config(ap, [a.overrides, ["logger=none", *a.overrides]])  # before any run
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    py = sys.executable
    cmds = {
        "default": [py, "-m", "moe_exp.run", *a.overrides],
        "none": [py, "-m", "moe_exp.run", "logger=none", *a.overrides],
        "torch": [py, "-c", TORCH_FLOOR],
    }
    if "logger=none" in a.overrides:  # (the default command is then "none" itself)
        del cmds["none"]
    res = {n: {"wall_s": [], "startup_s": [], "other_load": []} for n in cmds}
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        orders = round_orders(list(cmds))  # no contender keeps its place (_timing.py)
        for _ in range(a.runs):
            for n in next(orders):
                _, wall, load = run(cmds[n], cwd, env)
                res[n]["wall_s"].append(wall)
                res[n]["other_load"].append(load)
                if n != "torch":
                    res[n]["startup_s"].append(record(cwd)["startup_s"])
        code = PHASES.format(root=str(ROOT), args=list(a.overrides))
        p, wall, _ = run([py, "-c", code], cwd, env)
        marks = json.loads(p.stdout.split("PHASES ", 1)[1].splitlines()[0])
        p = subprocess.run([py, "-X", "importtime", "-m", "moe_exp.run", "logger=none",
                            *a.overrides], cwd=cwd, env=env, capture_output=True, text=True)
    imports = []
    for line in p.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cum, name = line.split("|")
            if not name.startswith("  ") and name.strip() and cum.strip().isdigit():
                imports.append((int(cum) / 1e6, name.strip()))
    imports.sort(reverse=True)

    print(f"# framework overhead, `python -m moe_exp.run {' '.join(a.overrides)}`, "
          f"{os.cpu_count()}-core CPU, python {sys.version.split()[0]}, {dt.date.today()}, "
          f"median of {a.runs} interleaved rounds")
    print(f"{'command':10} {'wall s':>8} {'startup s':>10}  max other load")
    summary = {}
    for n, r in res.items():
        w = statistics.median(r["wall_s"])
        s = statistics.median(r["startup_s"]) if r["startup_s"] else None
        summary[n] = {"wall_s": w, "startup_s": s, "samples": r}  # medians, then every run
        loads = [x for x in r["other_load"] if x is not None]
        print(f"{n:10} {w:8.2f} {('—' if s is None else f'{s:.2f}'):>10}  "
              f"{max(loads) if loads else float('nan'):.0%}")
    print("\nphase timeline of one default run (process age at the end of each phase):")
    prev = 0.0
    for name, t in marks:
        print(f"  {t:6.2f} s  (+{t - prev:5.2f})  {name}")
        prev = t
    print("\nslowest top-level imports (cumulative s, logger=none run):")
    for s, name in imports[:8]:
        print(f"  {s:6.2f}  {name}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({
            "meta": {"command": " ".join(sys.argv), "date": str(dt.date.today()),
                     "cpus": os.cpu_count()},
            "runs": summary, "phases": marks, "imports": imports[:20]}, indent=2))


if __name__ == "__main__":
    main()
