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
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import interleaved, print_rows, summarize  # noqa: E402
from _timing import at_least, check_config, out_file  # noqa: E402


def parse_variant(text: str) -> tuple[str, list[str]]:
    """argparse type for --variant: (NAME, overrides)."""
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:override override ...")
    return name.strip(), rest.split()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", required=True, type=parse_variant,
                    help='"NAME:override ..." (two or more)')
    ap.add_argument("--rounds", type=at_least(1), default=3)
    ap.add_argument("--json", type=out_file)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    variants = dict(a.variant)
    if len(variants) < 2:
        ap.error("argument --variant: give two or more, with distinct names")
    common = a.overrides or ["logger=none"]
    check_config(ap, [[*common, *o] for o in variants.values()])
    runs = interleaved({n: [*common, *o] for n, o in variants.items()}, a.rounds)
    rows = [summarize(n, recs) for n, recs in runs.items()]
    print_rows(rows)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        first = next(iter(runs.values()))[0]
        Path(a.json).write_text(json.dumps({
            "date": dt.date.today().isoformat(), "device": first.get("device_name"),
            "torch": first.get("torch_version"), "common": common, "variants": variants,
            "rows": rows, "command": "python benchmarks/ab_runs.py " +
            " ".join(argv or sys.argv[1:])}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
