"""Whole runs of two or more settings, interleaved over rounds: speed, memory, and whether
each setting repeats its losses bit for bit.

    PYTHONPATH=. python benchmarks/ab_runs.py --variant "off:" \\
        --variant "det:hardware.deterministic=true" [--rounds 3] [--json out.json] \\
        [-- common overrides...]

Each run is its own process (`python -m moe_exp.run`, its peak RSS its own), in rotated
orders (_timing.round_orders) so slow drifts hit every variant alike. A variant is
"NAME:override override ...". Prints per variant the median tokens/s and peak memory over
the quiet runs (other load at most OTHER_LOAD_WARN), their ratios to the first variant, and
how many distinct loss sequences its runs gave (1: bit-identical). Default common
overrides: logger=none. Sweeps run their repeats back to back; this interleaves them.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import round_orders  # noqa: E402

from moe_exp.bench.load import OTHER_LOAD_WARN as BUSY  # noqa: E402 (busier runs left out)


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise SystemExit(f"error: --variant {text!r}: expected NAME:override override ...")
    return name.strip(), rest.split()


def one_run(overrides: list[str], out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    p = subprocess.run([sys.executable, "-m", "moe_exp.run", *overrides,
                        f"hydra.run.dir={out}"], capture_output=True, text=True,
                       cwd=out.parent, env=env)
    if p.returncode != 0:
        raise SystemExit(f"error: run {' '.join(overrides)} failed:\n{p.stderr[-2000:]}")
    return json.loads((out / "metrics.json").read_text())


def summarize(name: str, recs: list[dict]) -> dict:
    quiet = [x for x in recs if (x["cpu_other_load"] or 0) <= BUSY] or recs
    return dict(variant=name, runs=len(quiet), dropped=len(recs) - len(quiet),
                tokens_per_s=statistics.median(x["tokens_per_s"] for x in quiet),
                peak_mem_gib=statistics.median(x["peak_mem_gib"] for x in quiet),
                step_time_ms=statistics.median(x["step_time_ms"] for x in quiet),
                distinct_losses=len({tuple(x["losses"]) for x in recs}),
                loss_last=sorted({x["loss_last"] for x in recs}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", required=True,
                    help='"NAME:override ..." (two or more)')
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    variants = dict(parse_variant(v) for v in a.variant)
    if len(variants) < 2:
        raise SystemExit("error: --variant: give two or more, with distinct names")
    common = a.overrides or ["logger=none"]
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    runs = {n: [] for n in variants}
    orders = round_orders(list(variants))
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name in next(orders):
                rec = one_run([*common, *variants[name]], Path(tmp) / f"{name}-{r}")
                runs[name].append(rec)
                print(f"  {name} round {r}: {rec['tokens_per_s']:,.0f} tok/s, peak "
                      f"{rec['peak_mem_gib']:.3f} GiB, loss {rec['loss_last']:.6f}, other "
                      f"load {rec['cpu_other_load'] or 0:.0%}", flush=True)
    rows = [summarize(n, recs) for n, recs in runs.items()]
    base = rows[0]
    print(f"\n{'variant':12} {'tokens/s':>10} {'×':>6} {'peak GiB':>9} {'×':>6} "
          f"{'runs':>5} {'loss sequences':>15}")
    for row in rows:
        print(f"{row['variant']:12} {row['tokens_per_s']:>10,.0f} "
              f"{row['tokens_per_s'] / base['tokens_per_s']:>5.2f}× "
              f"{row['peak_mem_gib']:>9.3f} {row['peak_mem_gib'] / base['peak_mem_gib']:>5.2f}× "
              f"{row['runs']:>5} {row['distinct_losses']:>15}")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "date": dt.date.today().isoformat(), "common": common, "variants": variants,
            "rows": rows, "command": "python benchmarks/ab_runs.py " +
            " ".join(argv or sys.argv[1:])}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
