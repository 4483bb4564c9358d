"""Whole training runs of several variants, each in its own process (its peak RSS its own),
interleaved over rounds in rotated orders (_timing.round_orders) so slow drifts hit every
variant alike; medians over the quiet runs (other load at most OTHER_LOAD_WARN)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import round_orders

from moe_exp.bench.load import OTHER_LOAD_WARN as BUSY

ROOT = Path(__file__).resolve().parents[1]


def one_run(overrides: list[str], out: Path, code: str | None = None) -> dict:
    """`python -m moe_exp.run OVERRIDES hydra.run.dir=OUT`, or with `code` `python -c CODE`
    (CODE.format(argv=...) runs the entrypoint on those arguments); the run's record. A
    failed run ends the benchmark."""
    argv = [*overrides, f"hydra.run.dir={out}"]
    cmd = ["-m", "moe_exp.run", *argv] if code is None else ["-c", code.format(argv=argv)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    p = subprocess.run([sys.executable, *cmd], capture_output=True, text=True,
                       cwd=out.parent, env=env)
    if p.returncode != 0:
        raise SystemExit(f"error: run {' '.join(overrides)} failed:\n{p.stderr[-2000:]}")
    return json.loads((out / "metrics.json").read_text())


def interleaved(variants: dict[str, list[str]], rounds: int,
                codes: dict[str, str] | None = None) -> dict[str, list[dict]]:
    """Each variant's records, one run per round (codes: a variant's `one_run` code)."""
    runs: dict[str, list[dict]] = {n: [] for n in variants}
    orders = round_orders(list(variants))
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for i, name in enumerate(next(orders)):
                rec = one_run(variants[name], Path(tmp) / f"{r}-{i}",
                              (codes or {}).get(name))
                runs[name].append(rec)
                print(f"  {name} round {r}: {rec['tokens_per_s']:,.0f} tok/s, peak "
                      f"{rec['peak_mem_gib']:.3f} GiB, loss {rec['loss_last']:.6f}, other "
                      f"load {rec['cpu_other_load'] or 0:.0%}", flush=True)
    return runs


def summarize(name: str, recs: list[dict]) -> dict:
    """Medians over the quiet runs, and how many distinct loss sequences the runs gave (1:
    bit-identical)."""
    quiet = [x for x in recs if (x["cpu_other_load"] or 0) <= BUSY] or recs
    return dict(variant=name, runs=len(quiet), dropped=len(recs) - len(quiet),
                tokens_per_s=statistics.median(x["tokens_per_s"] for x in quiet),
                peak_mem_gib=statistics.median(x["peak_mem_gib"] for x in quiet),
                step_time_ms=statistics.median(x["step_time_ms"] for x in quiet),
                distinct_losses=len({tuple(x["losses"]) for x in recs}),
                loss_last=sorted({x["loss_last"] for x in recs}))


def print_rows(rows: list[dict], base_of=None) -> None:
    """Tokens/s and peak memory with their ratios to the base row (base_of(row); by
    default the first)."""
    width = max(12, *(len(r["variant"]) for r in rows))
    print(f"\n{'variant':{width}} {'tokens/s':>10} {'×':>6} {'peak GiB':>9} {'×':>6} "
          f"{'runs':>5} {'loss sequences':>15}")
    for row in rows:
        base = base_of(row) if base_of else rows[0]
        print(f"{row['variant']:{width}} {row['tokens_per_s']:>10,.0f} "
              f"{row['tokens_per_s'] / base['tokens_per_s']:>5.2f}× "
              f"{row['peak_mem_gib']:>9.3f} {row['peak_mem_gib'] / base['peak_mem_gib']:>5.2f}× "
              f"{row['runs']:>5} {row['distinct_losses']:>15}")
