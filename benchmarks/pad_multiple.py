"""Padded dispatch: capacity = the largest group exactly, or rounded up to a multiple
(moe_exp.model.moe.PAD_MULTIPLE), in whole training runs.

    PYTHONPATH=. python benchmarks/pad_multiple.py [--rounds 3] [--multiples 1,16]
        [--compile off,default] [--json out.json] [-- overrides...]

A layer benchmark repeats one routing, so it meets one shape; a run meets a new largest
group most steps. On CPU in bf16 every new matmul shape builds (JIT) and caches oneDNN
kernels, which costs time and resident memory. Each run is its own process (peak RSS is
the run's own): `python -m moe_exp.run model.dispatch=padded [overrides]` with
PAD_MULTIPLE set, interleaved over rounds in rotated orders (_timing.round_orders).
Prints the median tokens/s and peak memory per multiple and their ratios to the first.
Default overrides: precision=bf16 train.steps=40 logger=none.
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

RUN = ("import sys; sys.path.insert(0, {root!r}); import moe_exp.model.moe as m; "
       "m.PAD_MULTIPLE = {multiple}; from moe_exp.run import cli; "
       "sys.argv = ['moe_exp.run'] + {argv!r}; cli()")


def one_run(multiple: int, overrides: list[str], out: Path) -> dict:
    argv = ["model.dispatch=padded", *overrides, f"hydra.run.dir={out}"]
    p = subprocess.run([sys.executable, "-c", RUN.format(root=str(ROOT), multiple=multiple,
                                                          argv=argv)],
                       capture_output=True, text=True, cwd=out.parent)
    if p.returncode != 0:
        raise SystemExit(f"error: run with PAD_MULTIPLE={multiple} failed:\n{p.stderr[-2000:]}")
    return json.loads((out / "metrics.json").read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--multiples", default="1,16")
    ap.add_argument("--compile", default="off,default")
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    multiples = [int(m) for m in a.multiples.split(",")]
    overrides = a.overrides or ["precision=bf16", "train.steps=40", "logger=none"]
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in a.compile.split(","):
            runs = {m: [] for m in multiples}
            orders = round_orders([str(m) for m in multiples])
            for r in range(a.rounds):
                for m in map(int, next(orders)):
                    rec = one_run(m, [*overrides, f"train.compile={mode}"],
                                  Path(tmp) / f"{mode}-{m}-{r}")
                    runs[m].append(rec)
                    print(f"  compile={mode} PAD_MULTIPLE={m} round {r}: "
                          f"{rec['tokens_per_s']:,.0f} tok/s, peak {rec['peak_mem_gib']:.3f} "
                          f"GiB, other load {rec['cpu_other_load'] or 0:.0%}", flush=True)
            for m, recs in runs.items():
                quiet = [x for x in recs if (x["cpu_other_load"] or 0) <= BUSY] or recs
                rows.append(dict(
                    compile=mode, multiple=m, runs=len(quiet), dropped=len(recs) - len(quiet),
                    tokens_per_s=statistics.median(x["tokens_per_s"] for x in quiet),
                    peak_mem_gib=statistics.median(x["peak_mem_gib"] for x in quiet),
                    loss_last=quiet[0]["loss_last"]))
    print(f"\n{'compile':8} {'multiple':>8} {'tokens/s':>10} {'×':>6} {'peak GiB':>9} "
          f"{'×':>6} {'runs':>5}")
    for row in rows:
        base = next(x for x in rows if x["compile"] == row["compile"])
        print(f"{row['compile']:8} {row['multiple']:>8} {row['tokens_per_s']:>10,.0f} "
              f"{row['tokens_per_s'] / base['tokens_per_s']:>5.2f}× "
              f"{row['peak_mem_gib']:>9.3f} {row['peak_mem_gib'] / base['peak_mem_gib']:>5.2f}× "
              f"{row['runs']:>5}")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "date": dt.date.today().isoformat(), "overrides": overrides, "rows": rows,
            "command": "python benchmarks/pad_multiple.py " + " ".join(argv or sys.argv[1:])},
            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
