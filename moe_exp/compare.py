"""Compare two sweep tables row by row and fail on a regression.

    python -m moe_exp.compare BASE NEW [--threshold 5]

BASE and NEW are sweep dirs or results.csv/.parquet files. Rows are matched by config hash
and `extra` labels, or by the hash alone where it is one row on each side.

Exit 1 when a configuration's tokens/s fell, or its peak memory grew, by more than the
threshold percent plus the noise its repeats measured: half the min-max range of each
side. For task=comm rows, a collective's bus bandwidth counts as tokens/s does. Exit 1
also when a run that was ok is no longer ok or no longer measures one of them, or when an
ok configuration is missing from NEW. Exit 0 otherwise; exit 2 on bad input.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .bench.load import OTHER_LOAD_WARN, busy
from .results import row_key


def load(path: Path):
    """The table of a sweep dir or of a table file.

    A sweep dir's table is built from its job records, else read from its results.parquet:
    results.* may be older than the records, while a sweep still runs or after an edit."""
    import pandas as pd

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.is_dir():
        from .sweep.table import build_table, collect, job_dirs

        if job_dirs(path):
            records = collect(path)
            if not records:
                raise FileNotFoundError(f"{path}: no readable job record (see the warnings)")
            return _possible(build_table(records, by=()), path, records=True)
        if (path / "results.parquet").is_file():
            return _possible(pd.read_parquet(path / "results.parquet"),
                             path / "results.parquet")
        single = " (a single run's dir: compare takes sweep dirs and tables)" \
            if (path / ".hydra").is_dir() else ""
        raise FileNotFoundError(f"{path}: no job records and no results.parquet{single}")
    try:
        if path.suffix == ".parquet":
            return _possible(_numbers(pd.read_parquet(path), path), path)
        if path.suffix == ".csv":
            # (a hash of digits, or digits and one e, would read as a number)
            return _possible(_numbers(pd.read_csv(path, dtype={"config_hash": str}), path),
                             path)
    except (OSError, ValueError) as e:  # (an empty file, not a table)
        if str(e).startswith(f"{path}: "):  # (_numbers: names the column)
            raise
        raise ValueError(f"{path}: not a readable table ({str(e).strip() or type(e).__name__})"
                         ) from None
    raise FileNotFoundError(f"{path}: not a sweep dir, .csv or .parquet file")


def _numbers(df, path: Path):
    """A table file's number columns as numbers.

    A cell that is not a number, as in a hand-edited table, is a ValueError naming the file,
    the column and the cell."""
    import pandas as pd

    from .results import FIELDS
    from .sweep.table import TEXT_FIELDS

    for col in df.columns:
        base = col[:-4] if col.endswith(("_min", "_max")) else col
        if base in FIELDS and base not in TEXT_FIELDS and not pd.api.types.is_numeric_dtype(df[col]):
            num = pd.to_numeric(df[col], errors="coerce")
            bad = df[col][num.isna() & df[col].notna()]
            if len(bad):
                raise ValueError(f"{path}: column {col}: {bad.iloc[0]!r} is not a number")
            df[col] = num
    return df


def compared(columns) -> list[str]:
    """The measured columns compare reads: tokens/s, peak memory, task=comm's bus bandwidth.

    Also their repeats' min and max, and the CPU load they ran under."""
    base = [c for c in columns if c in ("tokens_per_s", "peak_mem_gib", "cpu_other_load")
            or c.startswith("busbw_gbps_")]
    return [c for c in columns if c in base or (c.endswith(("_min", "_max")) and c[:-4] in base)]


def _possible(df, path: Path, records: bool = False):
    """Rejects a measured value that no run can have, such as inf tokens/s or a negative peak.

    Such a value, from a hand-edited record or table, is a ValueError naming the record, or
    the file and row, the column and the value. Null (NaN) is not measured, not impossible."""
    import math
    import numbers

    for col in compared(df.columns):
        for job, v in zip(df["job"] if "job" in df else range(len(df)), df[col]):
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or v != v:
                continue
            if math.isinf(v) or v < 0:
                where = f"{path / str(job) / 'metrics.json'}" if records else \
                    f"{path}: row of job {job}"
                raise ValueError(f"{where}: {col} is {float(v)!r}: a measured value is a finite "
                                 "number >= 0")
    return df


def _val(row, key):
    v = row.get(key)
    return None if v is None or v != v else float(v)


def _noise_pct(b, n, key: str) -> float:
    """Half the min-max range of each side, as a percent of the base median; 0 if unknown."""
    med = _val(b, key)
    if not med:
        return 0.0
    half = 0.0
    for row in (b, n):
        lo, hi = _val(row, f"{key}_min"), _val(row, f"{key}_max")
        if lo is not None and hi is not None:
            half += (hi - lo) / 2
    return 100.0 * half / med


REQUIRED = ("config_hash", "status", "tokens_per_s", "peak_mem_gib")


def _rows(df, side: str) -> dict:
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise ValueError(f"{side}: not a moe_exp results table (no column {', '.join(missing)})")
    rows = {}
    for r in df.to_dict("records"):
        if row_key(r) in rows:
            print(f"warning: {side} has {r.get('label') or r['config_hash']} more than once; "
                  "its last row is compared", file=sys.stderr)
        rows[row_key(r)] = r
    return rows


def compare(base, new, threshold: float = 5.0) -> tuple[list[dict], list[str]]:
    """Compares matched rows: an entry per matched configuration, and those on one side only.

    An ok configuration that NEW lacks is a regression, marked "REGRESSION" in that list."""
    b_rows, n_rows = _rows(base, "BASE"), _rows(new, "NEW")
    metrics = [("tokens_per_s", -1, "tokens/s"), ("peak_mem_gib", 1, "peak mem")]
    # task=comm rows: bus bandwidth per collective (higher is better)
    metrics += [(c, -1, c[len("busbw_gbps_"):] + " GB/s") for c in base.columns
                if c.startswith("busbw_gbps_") and not c.endswith(("_min", "_max"))
                and c in new.columns]
    out = []
    pairs = _pairs(list(b_rows), list(n_rows))
    for kb, kn in pairs:
        b, n = b_rows[kb], n_rows[kn]
        e = {"config": n.get("label") or kn[0], "base_status": b["status"],
             "new_status": n["status"], "regressions": []}
        for key, worse, name in metrics:
            bv, nv = _val(b, key), _val(n, key)
            e[key] = (bv, nv)
            if bv and nv is not None:
                change = 100.0 * (nv - bv) / bv
                e[f"{key}_change"] = change
                limit = threshold + _noise_pct(b, n, key)
                if change * worse > limit:
                    e["regressions"].append(f"{name} {change:+.1f}% (limit ±{limit:.1f}%)")
            elif bv is not None and nv is None and n["status"] == "ok":
                e["regressions"].append(f"{name} no longer measured")
        if b["status"] == "ok" and n["status"] != "ok":
            e["regressions"].append(f"status ok -> {n['status']}: {n.get('error')}")
        loaded = [f"{side} {load:.0%}" for side, row in (("BASE", b), ("NEW", n))
                  if busy(load := _val(row, "cpu_other_load"))]
        if loaded:  # its timings (either side's) are not reliable: a verdict to re-measure
            e["contended"] = f"measured under other processes' CPU load ({', '.join(loaded)})"
        out.append(e)
    paired_b, paired_n = {kb for kb, _ in pairs}, {kn for _, kn in pairs}
    only = [("REGRESSION: ok in BASE, absent from NEW: " if r["status"] == "ok" else
             "only in BASE: ") + str(r.get("label") or h[0])
            for h, r in b_rows.items() if h not in paired_b]
    only += [f"only in NEW: {r.get('label') or h[0]}" for h, r in n_rows.items()
             if h not in paired_n]
    return out, only


def _pairs(base: list[tuple], new: list[tuple]) -> list[tuple]:
    """Pairs of row keys (config_hash, extra) matched between BASE and NEW.

    Of the rows left unmatched, those whose config_hash is one row on each side are matched
    by it alone: their labels changed between the runs, as with +extra.note=before / after."""
    pairs = [(k, k) for k in base if k in new]
    left_b, left_n = [k for k in base if k not in new], [k for k in new if k not in base]
    for kb in left_b:
        same_b = [k for k in left_b if k[0] == kb[0]]
        same_n = [k for k in left_n if k[0] == kb[0]]
        if len(same_b) == len(same_n) == 1:
            pairs.append((kb, same_n[0]))
    return pairs


def _pct(e, key):
    c = e.get(f"{key}_change")
    return "—" if c is None else f"{c:+.1f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_exp.compare",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--threshold", type=float, default=5.0,
                    help="percent a metric may worsen beyond the measured noise (default 5)")
    a = ap.parse_args(argv)
    if not a.threshold >= 0:  # (nan too)
        print(f"error: --threshold: must be a number >= 0, got {a.threshold}", file=sys.stderr)
        return 2
    try:
        base, new = load(a.base), load(a.new)
        entries, only = compare(base, new, a.threshold)
    except (FileNotFoundError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not entries:  # unrelated tables: a mistake, not NEW having lost every row
        print(f"error: no configuration appears in both tables (matched by config_hash and "
              f"extra; BASE has {sum(o.startswith(('REG', 'only in BASE')) for o in only)}, NEW "
              f"{sum(o.startswith('only in NEW') for o in only)})", file=sys.stderr)
        return 2
    from . import screen

    rows = []
    for e in entries:
        (bt, nt), (bm, nm) = e["tokens_per_s"], e["peak_mem_gib"]
        f = lambda v, s: "—" if v is None else format(v, s)  # noqa: E731
        rows.append([e["config"], f"{e['base_status']} -> {e['new_status']}",
                     f"{f(bt, ',.0f')} -> {f(nt, ',.0f')}", _pct(e, "tokens_per_s"),
                     f"{f(bm, '.3f')} -> {f(nm, '.3f')}", _pct(e, "peak_mem_gib"),
                     ("REGRESSION: " + "; ".join(e["regressions"]) if e["regressions"] else "ok")
                     + (f"; {e['contended']}: re-measure" if e.get("contended") else "")])
    cols = screen.width()
    t, dropped = screen.table(f"{a.base} -> {a.new} (threshold {a.threshold:g}%)", [
        "configuration", "status", "tokens/s", "change", "peak GiB", "mem change", "verdict"],
        rows, cols, keep=("configuration", "verdict", "tokens/s", "change", "peak GiB",
                          "mem change", "status"),
        wrap=("configuration", "verdict"))
    screen.show(t, dropped, cols)
    for line in only:
        print(line)
    bad = [e for e in entries if e["regressions"]]
    gone = [line for line in only if line.startswith("REGRESSION")]
    n_busy = sum(bool(e.get("contended")) for e in entries)
    print(f"{len(bad)} regression(s) in {len(entries)} matched configuration(s)"
          + (f", {len(gone)} ok configuration(s) gone" if gone else "")
          + (f"; {n_busy} measured under other CPU load (cpu_other_load > "
             f"{OTHER_LOAD_WARN:.0%}): their verdicts are not reliable" if n_busy else ""))
    return 1 if bad or gone else 0


if __name__ == "__main__":
    sys.exit(main())
