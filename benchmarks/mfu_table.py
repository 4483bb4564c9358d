"""The MFU table of gpu_mfu.sh's records, one row per run, and the best MFU. Needs no GPU:
it also reads records merged from several calls of the lent machine.

    python benchmarks/mfu_table.py benchmarks/results/<gpu>-<date>/mfu
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def records(folder: Path) -> list[tuple[str, dict]]:
    """(run name, record) of every <run>/metrics.json in folder, by name."""
    return [(f.parent.name, json.loads(f.read_text()))
            for f in sorted(folder.glob("*/metrics.json"))]


def table(rows: list[tuple[str, dict]]) -> list[str]:
    def cell(r, key, fmt, scale=1):
        ok = r["status"] == "ok" and r.get(key) is not None
        return format(scale * r[key], fmt) if ok else "—"

    out = [f"{'run':18} {'status':8} {'step ms':>9} {'tokens/s':>10} {'TFLOP/s':>8} "
           f"{'MFU %':>6} {'peak GiB':>9} {'data %':>7}"]
    for name, r in rows:
        out.append(f"{name:18} {r['status']:8} {cell(r, 'step_time_ms', '.1f'):>9} "
                   f"{cell(r, 'tokens_per_s', ',.0f'):>10} "
                   f"{cell(r, 'tflops_per_device', '.1f'):>8} {cell(r, 'mfu', '.1f', 100):>6} "
                   f"{cell(r, 'peak_mem_gib', '.1f'):>9} {cell(r, 'data_share', '.2f', 100):>7}")
    best = max((r for _, r in rows if r["status"] == "ok" and r.get("mfu") is not None),
               key=lambda r: r["mfu"], default=None)
    if best:
        out.append(f"\nbest MFU {100 * best['mfu']:.1f}% (goal >= 50%): micro_batch_size="
                   f"{best['micro_batch_size']} compile={best['compile']} on "
                   f"{best['device_name']}, torch {best['torch_version']}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="gpu_mfu.sh's mfu/ folder")
    a = ap.parse_args(argv)
    rows = records(a.folder) if a.folder.is_dir() else []
    if not rows:
        ap.error(f"folder: no <run>/metrics.json under '{a.folder}'")
    print("\n".join(["", *table(rows), f"records: {a.folder}/*/metrics.json"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
