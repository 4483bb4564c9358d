"""Padded dispatch: capacity = the largest group exactly, or rounded up to a multiple
(moe_exp.model.moe.PAD_MULTIPLE), in whole training runs.

    PYTHONPATH=. python benchmarks/pad_multiple.py [--rounds 3] [--multiples 1,16]
        [--compile off,default] [--json out.json] [-- overrides...]

A layer benchmark repeats one routing, so it meets one shape; a run meets a new largest
group most steps. On CPU in bf16 every new matmul shape builds (JIT) and caches oneDNN
kernels, which costs time and resident memory. Each run is its own process (peak RSS is
the run's own): `python -m moe_exp.run model.dispatch=padded [overrides]` with
PAD_MULTIPLE set, interleaved over rounds in rotated orders (_timing.round_orders).
Prints the median tokens/s and peak memory per multiple and their ratios to the first
(_runs.py, as ab_runs.py).
Default overrides: precision=bf16 train.steps=40 logger=none.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import interleaved, print_rows, summarize  # noqa: E402
from _timing import at_least, check_config, one_of, out_file  # noqa: E402

from moe_exp.config import CHOICES  # noqa: E402

RUN = ("import sys; sys.path.insert(0, {root!r}); import moe_exp.model.moe as m; "
       "m.PAD_MULTIPLE = {multiple}; from moe_exp.run import cli; "
       "sys.argv = ['moe_exp.run'] + {{argv!r}}; cli()")


def multiples(text: str) -> list[int]:
    """argparse type: a comma list of whole numbers >= 1."""
    return [at_least(1)(x) for x in text.split(",")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=at_least(1), default=3)
    ap.add_argument("--multiples", type=multiples, default="1,16")
    ap.add_argument("--compile", type=one_of(CHOICES["train.compile"]), default="off,default")
    ap.add_argument("--json", type=out_file)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    overrides = a.overrides or ["precision=bf16", "train.steps=40", "logger=none"]
    check_config(ap, [["model.dispatch=padded", *overrides, f"train.compile={mode}"]
                      for mode in a.compile.split(",")])
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1" if (os.cpu_count() or 1) <= 4 else "8")
    rows = []
    for mode in a.compile.split(","):
        names = {f"compile={mode} pad={m}": m for m in a.multiples}
        runs = interleaved(
            {n: ["model.dispatch=padded", *overrides, f"train.compile={mode}"] for n in names},
            a.rounds, {n: RUN.format(root=str(ROOT), multiple=m) for n, m in names.items()})
        rows += [{"compile": mode, "multiple": names[n], **summarize(n, recs)}
                 for n, recs in runs.items()]
    print_rows(rows, lambda row: next(x for x in rows if x["compile"] == row["compile"]))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({
            "date": dt.date.today().isoformat(), "overrides": overrides, "rows": rows,
            "command": "python benchmarks/pad_multiple.py " + " ".join(argv or sys.argv[1:])},
            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
