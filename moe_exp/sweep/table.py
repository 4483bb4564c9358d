"""A sweep's table: a row per job, its record, plus speedup and memory saved against a baseline.

Repeats are combined into median and spread."""
from __future__ import annotations

import functools
import json
import math
import os
import statistics
import sys
from pathlib import Path

from ..bench.load import OTHER_LOAD_WARN, busy
from ..config import OFF
from ..record import text_keys
from ..results import FIELDS

# Finished outcomes that a re-run would repeat: resume keeps them (error/crashed re-run).
DONE = ("ok", "oom", "diverged", "invalid", "skipped")
ADDED = ("job", "label", "repeats", "tokens_per_s_min", "tokens_per_s_max", "baseline",
         "baseline_job", "speedup", "speedup_significant", "mem_saved_pct", "loss_ok")
# What counts as "an optimization on" when choosing the default baseline (fewest on):
# config.OFF, from each knob's declared "off" value.
# the columns build_table computes from the rows (not a record's)
COMPUTED = ("label", "baseline", "baseline_job", "speedup", "speedup_significant",
            "mem_saved_pct", "loss_ok")
_HIDDEN_OVERRIDES = ("sweep.", "+sweep", "hydra.", "logger", "+logger")


def number_or_none(x) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


# keys every record has (results.new_record): a file without them is not one
RECORD_KEYS = ("status", "config_hash", "model", "precision", "overrides")
# the contract's fields that hold text (record.Header's types) and the overrides' list; the
# others hold numbers or null
TEXT_FIELDS = (*(k for k in text_keys() if k in FIELDS), "overrides")


def _not_a_number(rec: dict) -> str | None:
    """Why a record is malformed: its first field that holds the wrong kind of value; else None.

    A hand-edited file may hold a number field that is something else, a text field not
    text, or overrides not a list of text."""
    from ..results import FIELDS

    for k in FIELDS:
        v = rec.get(k)
        if v is None:
            continue
        if k == "overrides":
            if not isinstance(v, list) or not all(isinstance(o, str) for o in v):
                return f"overrides is {v!r}, not a list of text"
        elif k in TEXT_FIELDS:
            if not isinstance(v, str):
                return f"{k} is {v!r}, not text"
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"{k} is {v!r}, not a number"
    return None


def read_record(path: Path, warn: bool = False) -> dict | None:
    """A run's record; None where the file is missing or is not a record.

    warn: say so on stderr, naming the file."""
    rec, why = _read(path)
    if why is not None and warn:
        print(f"warning: {path}: {why}: left out of the table", file=sys.stderr)
    return rec


def _read(path: Path) -> tuple[dict | None, str | None]:
    """Reads a record: (record, None); (None, why it is not one); (None, None) without a file."""
    from ..results import STATUSES

    try:
        rec = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None, None
    except OSError as e:  # (a directory, no permission, an I/O error)
        return None, f"unreadable ({e.strerror or e})"
    except ValueError as e:
        return None, f"not JSON ({e})"
    missing = [k for k in RECORD_KEYS if k not in rec] if isinstance(rec, dict) else None
    why = ("not a record (JSON, but not an object)" if missing is None else
           f"not a record (no {', '.join(missing)})" if missing else
           f"not a record (status {rec['status']!r} is not one of: {', '.join(STATUSES)})"
           if rec["status"] not in STATUSES else
           f"not a record ({bad})" if (bad := _not_a_number(rec)) else None)
    return (rec, None) if why is None else (None, why)


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Job dirs of a sweep, those holding a metrics.json, in job order."""
    dirs = [p.parent for p in Path(sweep_dir).glob("*/metrics.json")]
    return sorted(dirs, key=lambda d: (0, int(d.name), "") if d.name.isdigit() else (1, 0, d.name))


def collect(sweep_dir: Path, warn: bool = True, keep: bool = False) -> list[dict]:
    """A sweep's job-level records, in job order, one per row.

    A row is a configuration and its labels (results.row_key); resume may copy a record,
    and the copy is left out. warn: name each file that is not a record. keep, for a table
    about to be rewritten: a job whose record cannot be read now, cut short or edited by
    hand, keeps the row the sweep's table holds of it, so a table is never rewritten with
    fewer rows. Rows are matched by job: its dir's name, as Hydra's default
    hydra.sweep.subdir names it."""
    from ..results import row_key

    out, seen, table = [], set(), None
    for d in job_dirs(sweep_dir):
        rec, why = _read(d / "metrics.json")
        if why is not None:
            if keep:
                if table is None:
                    table = _table_rows(Path(sweep_dir))
                rec = table[1].get(d.name)
                rec = dict(rec) if rec is not None else None
            if warn:
                print(f"warning: {d / 'metrics.json'}: {why}: " + (
                    f"its row in {table[0]} is kept (fix the record, or delete its dir to "
                    "drop the row)" if rec is not None else "left out of the table"),
                    file=sys.stderr)
        key = rec and row_key(rec)
        if rec is None or key in seen:
            continue
        seen.add(key)
        rec.setdefault("job", int(d.name) if d.name.isdigit() else d.name)
        out.append(rec)
    return out


def _table_rows(sweep_dir: Path) -> tuple[str | None, dict[str, dict]]:
    """The sweep's table rows as records: (the file read, {job: its row as a record}).

    From results.parquet, else results.csv; (None, {}) where neither reads. The columns the
    table computes, COMPUTED, are left out: build_table computes them anew."""
    import pandas as pd

    for name in ("results.parquet", "results.csv"):
        p = sweep_dir / name
        try:
            df = pd.read_parquet(p) if name.endswith("parquet") else \
                pd.read_csv(p, dtype={"config_hash": str, "job": str})
        except Exception:  # noqa: BLE001 - none, or not a table: the next, else none
            continue
        if "job" not in df or "config_hash" not in df:
            continue
        rows = {}
        for row in df.drop(columns=[c for c in COMPUTED if c in df]).to_dict("records"):
            rows[str(row["job"])] = {k: _unflat(k, v) for k, v in row.items()}
        return name, rows
    return None, {}


def _unflat(key: str, v):
    """A table cell as the record held it.

    NaN -> None, numpy -> Python, and a list or dict that flat() wrote as JSON text back to
    one."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):  # numpy scalar
        v = v.item()
        return None if isinstance(v, float) and math.isnan(v) else v
    if isinstance(v, str) and (key == "overrides" or key not in TEXT_FIELDS) and v[:1] in "[{":
        try:
            return json.loads(v)
        except ValueError:
            return v
    if key == "job" and isinstance(v, str) and v.isdigit():
        return int(v)
    return v


def combine(records: list[dict]) -> dict:
    """One record from a combination's repeats: medians over the ok ones, spread, worst status.

    The spread is the min and max of tokens/s, peak memory, step time and the held-out
    losses. A combination is ok only if all its repeats are."""
    ok = [r for r in records if r["status"] == "ok"]
    bad = [r for r in records if r["status"] != "ok"]
    rec = dict((ok or records)[0])
    rec.update(repeats=len(records), repeats_ok=len(ok), combined=True, repeat=None)
    if bad:
        first = bad[0]
        rec.update(status=first["status"], error=f"repeat {first.get('repeat', '?')}: "
                                                  f"{first.get('error')}")
    for k in rec:  # every measured number (extras too: startup_s, data_share, comm_ms, ...)
        vals = [r.get(k) for r in ok]
        if k not in ("repeat", "repeats", "repeats_ok", "job") and \
                all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals) \
                and len(set(vals)) > 1:
            rec[k] = statistics.median(vals)  # (equal values stay as they are: 8, not 8.0)
    if rec.get("tokens_per_s") and rec.get("tokens_per_step"):  # the step time the median
        # tokens/s means (for an even count their two medians are not each other's inverse)
        rec["step_time_ms"] = 1e3 * rec["tokens_per_step"] / rec["tokens_per_s"]
        _phases_of(rec, ok)
    loads = [r["cpu_other_load"] for r in ok if number_or_none(r.get("cpu_other_load")) is not None]
    if loads:  # the most contended repeat's: its figures are in the spread
        rec["cpu_other_load"] = max(loads)
    for k in ("tokens_per_s", "peak_mem_gib", "step_time_ms", "eval_loss", "eval_gap"):
        vals = [r[k] for r in ok if isinstance(r.get(k), (int, float))]
        rec[f"{k}_min"], rec[f"{k}_max"] = (min(vals), max(vals)) if vals else (None, None)
    return rec


PHASES = ("data_ms", "forward_ms", "backward_ms", "optimizer_ms")


def _phases_of(rec: dict, ok: list[dict]) -> None:
    """The breakdown of the combined step time: each phase's median share, times that time.

    A share is of its own repeat's step. Medians of the phases themselves need not add up to
    the step time when repeats differ widely."""
    for k in PHASES:
        shares = [r[k] / r["step_time_ms"] for r in ok
                  if isinstance(r.get(k), (int, float)) and r.get("step_time_ms")]
        if shares and len(shares) == len(ok):
            rec[k] = statistics.median(shares) * rec["step_time_ms"]
    if isinstance(rec.get("data_ms"), (int, float)):
        rec["data_share"] = rec["data_ms"] / rec["step_time_ms"]


def norm_key(key: str) -> str:
    key = key.lstrip("+")
    if key.startswith("train."):
        return key[len("train."):]
    return key[: -len(".name")] if key.endswith(".name") else key


def override_items(rec: dict) -> dict:
    items = {}
    for o in rec.get("overrides") or []:
        if "=" in o and not o.startswith(_HIDDEN_OVERRIDES):
            k, v = o.split("=", 1)
            items[k] = v
    return items


def labels(records: list[dict]) -> list[str]:
    """Each row's combination: the overrides whose value varies across the sweep."""
    items = [override_items(r) for r in records]
    keys = sorted({k for it in items for k in it})
    varying = [k for k in keys if len({it.get(k) for it in items}) > 1]
    out = []
    for r, it in zip(records, items):
        text = " ".join(f"{k}={it[k]}" for k in varying if k in it)
        # nothing varies yet (one finished row of an interrupted sweep): all its overrides
        out.append(text or " ".join(f"{k}={v}" for k, v in it.items()) or "defaults")
    return out


def _opts_on(row) -> int:
    on = sum(number_or_none(row.get(k)) is not None and not same_value(row.get(k), off)  # (a record
             for k, off in OFF.items())  # older than the knob has no value: it was off)
    return on + int((row.get("grad_accum_steps") or 1) > 1)


MISSING = object()


def row_value(row: dict, key: str, what: str):
    """A row's value of `key`: a table column, a dotted key into a dict column, or an override.

    A dotted key such as extra.seed_row reads into a dict column. A key the row's overrides
    set, such as parallel.prefetch, is typed as Hydra types it."""
    k = norm_key(key)
    if k in row:
        return row[k]
    head, _, rest = k.partition(".")
    sub = row.get(head, MISSING) if rest else MISSING
    if isinstance(sub, str):  # a dict column read back from a table file
        try:
            sub = json.loads(sub)
        except ValueError:
            sub = MISSING
    if isinstance(sub, dict):
        return sub.get(rest, MISSING)
    set_here = {norm_key(o): v for o, v in override_items(row).items()}
    if k in set_here:
        return typed_value(set_here[k])
    if rest:
        return MISSING  # a dotted key: an override other rows may set (_check_keys)
    raise KeyError(f"{what}: '{key}' is not a column of the table (e.g. precision, "
                   f"activation_checkpointing, compile, model, extra.seed_row)")


@functools.lru_cache(maxsize=None)  # the same few override texts, row after row
def typed_value(text: str):
    """An override's value as Hydra types it, e.g. true -> True, 1e-3 -> 0.001.

    It is compared with a baseline's value, which Hydra typed too."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(f"k={text}").value()
    except Exception:  # noqa: BLE001 - not a plain value: compare the text
        return text


def same_value(a, b) -> bool:
    """Whether a row's value and a baseline's are equal, as text or as numbers.

    1 and 1.0 are equal; True and 1 are not."""
    import numbers

    if str(a) == str(b):
        return True
    num = [isinstance(x, numbers.Number) and not isinstance(x, bool) for x in (a, b)]
    return all(num) and float(a) == float(b)


def _matches(row, baseline: dict, what: str = "sweep.baseline") -> bool:
    return all(same_value(row_value(row, key, what), want) for key, want in baseline.items())


def _check_keys(records: list[dict], keys, what: str) -> None:
    """Raises KeyError for a dotted key that no row has, such as extra.seed_rwo: a typo."""
    for key in keys:
        if records and all(row_value(r, key, what) is MISSING for r in records):
            raise KeyError(f"{what}: no row has '{key}'")


def baseline_text(baseline: dict) -> str:
    """A baseline as the command line gives it: key=value key=value."""
    return " ".join(f"{k}={v}" for k, v in baseline.items())


def build_table(records: list[dict], baseline: dict | None = None, by=("model",),
                names=("sweep.baseline", "sweep.baseline_by")):
    """The sweep's table as a DataFrame, each row against its group's baseline.

    Columns: the record fields, then job/label/speedup/mem_saved_pct, then the rest.
    `names` says where baseline and by came from, for the error on an unknown key."""
    import pandas as pd

    records = [dict(r) for r in records]
    for r, label in zip(records, labels(records)):
        r["label"] = label
        r.setdefault("repeats", 1)
    _check_keys(records, baseline or {}, names[0])
    _check_keys(records, by, names[1])
    groups: dict = {}
    # a baseline naming a size key (model.hidden_size) compares the sizes: one group
    sized = any(norm_key(k).startswith("model.") and norm_key(k) != "model.dispatch"
                for k in baseline or {})
    for r in records:
        key = tuple(row_value(r, b, names[1]) for b in by)
        if "model" in by and not sized:  # a model is its name and its size: a sweep over
            # model.hidden_size compares each size with itself, not with another architecture
            key += (r.get("params_total"), r.get("params_active"))
        groups.setdefault(tuple(str(None if v is MISSING else v) for v in key), []).append(r)
    for rows in groups.values():
        ok = [r for r in rows if r["status"] == "ok" and number_or_none(r.get("tokens_per_s"))]
        if baseline:
            # several matches: the one with the fewest optimizations on, if that is one
            cands = sorted((r for r in ok if _matches(r, baseline, names[0])), key=_opts_on)
            if len(cands) > 1 and _opts_on(cands[0]) == _opts_on(cands[1]):
                tied = [r["label"] for r in cands if _opts_on(r) == _opts_on(cands[0])]
                raise KeyError(f"{names[0]}: {baseline_text(baseline)} matches {len(tied)} "
                               f"rows equally ({'; '.join(tied)}): add a key that tells them "
                               "apart")
        else:
            cands = sorted(ok, key=_opts_on)[:1]
        base = cands[0] if cands else None
        for r in rows:
            r["baseline"] = r is base
            r["baseline_job"] = None if base is None else base.get("job")
            _relative(r, base)
    df = pd.DataFrame.from_records(records)
    for col in (*FIELDS, *ADDED):
        if col not in df:
            df[col] = None
    rest = [c for c in df.columns if c not in FIELDS and c not in ADDED]
    return df[["job", "label", *FIELDS, *ADDED[2:], *rest]]


def loss_ok(r: dict, base: dict) -> bool | None:
    """Whether the row's held-out loss is no worse than the baseline's beyond the measured noise.

    Its median may exceed the baseline's by at most the wider of the two rows' spreads:
    max - min over repeats of different initializations, sweep.vary_init. The loss compared
    is the gap to the data's floor where known, as seeds of the same data share the floor;
    else eval_loss. None where no spread was measured: one repeat, or repeats identical bit
    for bit."""
    key = "eval_gap" if number_or_none(r.get("eval_gap")) is not None else "eval_loss"
    vals = [number_or_none(x.get(k)) for x in (r, base) for k in (key, f"{key}_min", f"{key}_max")]
    if None in vals:
        return None
    med, lo, hi, bmed, blo, bhi = vals
    noise = max(hi - lo, bhi - blo)
    return None if noise == 0 else bool(med - bmed <= noise)


def _relative(r: dict, base: dict | None) -> None:
    r["speedup"] = r["mem_saved_pct"] = r["speedup_significant"] = r["loss_ok"] = None
    if base is None or r["status"] != "ok":
        return
    r["loss_ok"] = loss_ok(r, base)
    tps, btps = number_or_none(r.get("tokens_per_s")), number_or_none(base.get("tokens_per_s"))
    if tps and btps:
        r["speedup"] = tps / btps
    mem, bmem = number_or_none(r.get("peak_mem_gib")), number_or_none(base.get("peak_mem_gib"))
    if mem is not None and bmem:
        r["mem_saved_pct"] = 100.0 * (bmem - mem) / bmem
    if r.get("repeats", 1) > 1 and base.get("repeats", 1) > 1 and r is not base:
        lo, hi = r.get("tokens_per_s_min"), r.get("tokens_per_s_max")
        blo, bhi = base.get("tokens_per_s_min"), base.get("tokens_per_s_max")
        if None not in (lo, hi, blo, bhi):  # significant only if the ranges do not overlap
            r["speedup_significant"] = bool(lo > bhi or hi < blo)


def flat(df):
    """Lists and dicts as JSON strings: a table CSV and Parquet can hold."""
    out = df.copy()
    if "job" in out and out["job"].map(lambda v: isinstance(v, str)).any():
        out["job"] = out["job"].map(str)  # set-aside dirs (0-<hash>) beside numbered jobs
    for col in out.columns:
        if out[col].map(lambda v: isinstance(v, (list, dict))).any():
            out[col] = out[col].map(lambda v: json.dumps(v) if isinstance(v, (list, dict))
                                    else (None if v is None else str(v)))
    return out


def cell_text(v, spec: str, suffix: str = "") -> str:
    v = number_or_none(v)
    if v is None:
        return "—"
    text = f"{v:{spec}}"
    if text.startswith("-") and not text.strip("-0."):  # -0.3 -> "0", not "-0"
        text = text[1:]
    return text + suffix


def sweep_settings(sweep_dir: Path) -> tuple[dict | None, list[str]]:
    """A sweep's own sweep.baseline and sweep.baseline_by, from its dir's multirun.yaml.

    None and ["model"] where there is none."""
    p = Path(sweep_dir) / "multirun.yaml"
    if not p.is_file():
        return None, ["model"]
    from omegaconf import OmegaConf

    try:
        s = OmegaConf.load(p).get("sweep") or {}
        b, by = s.get("baseline"), s.get("baseline_by")
        return (OmegaConf.to_container(b, resolve=True) if b else None), \
            (["model"] if by is None else list(OmegaConf.to_container(by, resolve=True)))
    except Exception as e:  # noqa: BLE001 - a broken file: the user's to fix, one line
        why = " ".join(str(e).split())  # (YAML's errors span lines: one line here)
        raise ValueError(f"{p}: cannot read its sweep settings ({why}); pass --baseline and "
                         "--by") from None


def sweep_table(records: list[dict], baseline: dict | None, by) -> tuple:
    """A sweep's own table, by its sweep.baseline and sweep.baseline_by; returns (table, error).

    Where those name a key no row has, the table takes the default baseline per model and
    the error says why; else the error is None."""
    try:
        return build_table(records, baseline, by), None
    except KeyError as e:
        return build_table(records), e.args[0]


def compact(df):
    """The columns a reader compares, formatted for results.md and the terminal."""
    import pandas as pd

    if "task" in df and len(df) and (df["task"] == "comm").all():
        return _compact_comm(df)
    reps = (df["repeats"].fillna(1) > 1).any()
    # routing columns where a row has them: the load (a MoE), the drops (token capacity)
    load = "expert_load_max_over_mean" in df and df["expert_load_max_over_mean"].notna().any()
    drops = "drop_rate" in df and (df["drop_rate"].fillna(0) > 0).any()
    tune = "tune_max_micro_batch" in df and df["tune_max_micro_batch"].notna().any()
    judged = "loss_ok" in df and df["loss_ok"].notna().any()
    # checkpoints: their saves fall between steps, outside the median step's tokens/s
    ckpt = "checkpoint_saves" in df and (df["checkpoint_saves"].fillna(0) > 0).any()
    infer = "ttft_ms" in df and df["ttft_ms"].notna().any()  # (task=infer rows)
    served = "served_tokens_per_s" in df and df["served_tokens_per_s"].notna().any()
    planned = "task" in df and (df["task"] == "plan").any()  # task=plan rows
    # task=bench rows' check of their plan (train.plan): planned / measured - 1
    checked = [k for k in ("planned_peak_error", "planned_step_error")
               if k in df and df[k].notna().any()]
    if planned and (df["task"] == "plan").all():  # the plans that fit first, the fastest
        df = df.assign(_fits=df["planned_fits"].map({True: 0, False: 1}).fillna(2),  # first
                       _fast=-pd.to_numeric(df["planned_tokens_per_s"], errors="coerce"))
        df = df.sort_values(["_fits", "_fast"], kind="stable", na_position="last")
    rows = []
    for _, r in df.iterrows():
        sp = cell_text(r["speedup"], ".2f", "×")
        if r["speedup_significant"] is False:
            sp += " (n.s.)"
        row = {"job": r["job"], "combination": r["label"], "status": r["status"],
               "tokens/s": cell_text(r["tokens_per_s"], ",.0f")}
        if infer:
            row.update({"first token ms": cell_text(r["ttft_ms"], ".1f"),
                        "p99 token ms": cell_text(r["token_latency_ms_p99"], ".2f")})
        if served:  # (infer.batching: tokens/s is the stream's)
            row.update({"p50 request ms": cell_text(r["request_latency_ms_p50"], ",.1f"),
                        "p99 request ms": cell_text(r["request_latency_ms_p99"], ",.1f")})
        if ckpt:
            share = number_or_none(r["checkpoint_share"])
            row.update({"wall tokens/s": cell_text(r["tokens_per_s_wall"], ",.0f"),
                        "ckpt blocked": cell_text(share and share * 100, ".0f", "%")})
        if planned:  # task=plan: predictions, not measurements
            row.update({"planned peak GiB": cell_text(r["planned_peak_gib"], ",.3f"),
                        "fits": {True: "yes", False: "NO"}.get(r["planned_fits"], "—"),
                        "planned comm GiB": cell_text(r["planned_comm_gib"], ",.3f"),
                        "planned tokens/s": cell_text(r["planned_tokens_per_s"], ",.0f")})
        if tune:  # task=tune_batch: the largest micro-batch that fit, and the fastest
            row.update({"largest mbs": cell_text(r["tune_max_micro_batch"], ".0f"),
                        "fastest mbs": cell_text(r["tune_best_micro_batch"], ".0f")})
        if reps:
            lo, hi, med = number_or_none(r["tokens_per_s_min"]), number_or_none(r["tokens_per_s_max"]), \
                number_or_none(r["tokens_per_s"])
            row["spread"] = f"±{50 * (hi - lo) / med:.1f}%" if None not in (lo, hi) and med \
                else "—"
        row.update({
            "speedup": sp + (" (base)" if r["baseline"] else ""),
            "step ms": cell_text(r["step_time_ms"], ".1f"),
            "peak GiB": cell_text(r["peak_mem_gib"], ".3f"),
            "mem saved": _saved(r["mem_saved_pct"]),
            "MFU": cell_text(r["mfu"] * 100 if number_or_none(r["mfu"]) is not None else None, ".1f", "%"),
            "loss": cell_text(r["loss_last"], ".3f"),
        })
        for k in checked:
            err = number_or_none(r[k])
            row[f"plan {k.split('_')[1]} err"] = cell_text(err and err * 100, "+.0f", "%")
        if judged:  # (rows judged against the baseline's held-out loss and its noise)
            row["loss ok"] = {True: "yes", False: "NO"}.get(r["loss_ok"], "—")
        if load:
            row["load max/mean"] = cell_text(r["expert_load_max_over_mean"], ".2f")
        if drops:
            row["dropped"] = cell_text(number_or_none(r["drop_rate"]) and r["drop_rate"] * 100, ".1f", "%")
        row["error"] = str(r["error"])[:90] if isinstance(r["error"], str) else ""
        rows.append(row)
    return pd.DataFrame(rows)


def _saved(pct) -> str:
    """Memory saved against the baseline; where the row used more, how many times more."""
    pct = number_or_none(pct)
    return cell_text(pct, ".0f", "%") if pct is None or pct >= 0 else \
        f"none ({1 - pct / 100:.2f}×)"


def _compact_comm(df):
    """A task=comm sweep: the peak bus bandwidth of each collective over the sizes."""
    import pandas as pd

    ops = sorted(c[len("busbw_gbps_"):] for c in df.columns if c.startswith("busbw_gbps_"))
    rows = []
    for _, r in df.iterrows():
        row = {"job": r["job"], "combination": r["label"], "status": r["status"],
               "ranks": cell_text(r["world_size"], ".0f"),
               "backend": r["comm_backend"] if isinstance(r.get("comm_backend"), str) else "—"}
        row.update({f"{op} GB/s": cell_text(r[f"busbw_gbps_{op}"], ".3g") for op in ops})
        row["error"] = str(r["error"])[:90] if isinstance(r["error"], str) else ""
        rows.append(row)
    return pd.DataFrame(rows)


def contended(df) -> str:
    """The note naming rows measured under other processes' CPU load, else ''."""
    if "cpu_other_load" not in df:
        return ""
    is_busy = df["cpu_other_load"].map(busy).astype(bool)
    busy_rows = df[is_busy]
    rows = "; ".join(f"job {r.job} ({r.cpu_other_load:.0%})" for r in busy_rows.itertuples())
    if not rows:
        return ""
    note = (f"measured while other processes used over {OTHER_LOAD_WARN:.0%} of the "
            f"machine's CPU (cpu_other_load; their timings are not reliable): {rows}")
    if "baseline_job" in df:  # a quiet row's speedup over a contended baseline is not either
        on_busy = df[~is_busy & df["baseline_job"].isin(set(busy_rows["job"]))
                     & df["speedup"].map(lambda v: number_or_none(v) is not None)]
        on_busy = on_busy[on_busy["baseline"] != True]  # noqa: E712 - pandas mask
        if len(on_busy):
            jobs = [str(j) for j in on_busy["job"]]
            note += (f"; the speedup{'s' * (len(jobs) > 1)} of job{'s' * (len(jobs) > 1)} "
                     f"{', '.join(jobs)} {'are' if len(jobs) > 1 else 'is'} against a "
                     "contended baseline")
    return note


def plan_errors(df) -> str:
    """The rows' plan checks (train.plan) in one line: each error's median and range, and
    what the planned time rests on; '' where no row has one."""
    parts = []
    for key, what in (("planned_step_error", "step time"), ("planned_peak_error", "peak")):
        if key not in df:
            continue
        errs = sorted(v for v in map(number_or_none, df[key]) if v is not None)
        if errs:
            med = errs[len(errs) // 2] if len(errs) % 2 else \
                (errs[len(errs) // 2 - 1] + errs[len(errs) // 2]) / 2
            parts.append(f"{what} median {med:+.0%}, {errs[0]:+.0%} to {errs[-1]:+.0%} over "
                         f"{len(errs)} row{'s' * (len(errs) > 1)}")
    if not parts:
        return ""
    basis = sorted({b for b in df.get("planned_time_basis", []) if isinstance(b, str)})
    said = {"datasheet": "the datasheet's peaks, a floor"}
    steps = {b.split(" (")[0] for b in df.get("planned_memory_basis", []) if isinstance(b, str)}
    return ("Plan check (planned / measured − 1): " + "; ".join(parts) + (
        f" (time from {', '.join(said.get(b, b) for b in basis)})" if basis else "") + (
        "; compiled rows' peaks from the compiled step's partition"
        if "compiled step" in steps else "") + ".")


def markdown(df, title: str = "Sweep results", lead: str = "") -> str:
    """The table as markdown; `lead`, the report's answer, goes between the title and it."""
    lines = [f"# {title}", "", *([lead] if lead else []), compact(df).to_markdown(index=False),
             ""]
    base = df[df["baseline"] == True]  # noqa: E712 - pandas mask
    if len(base):
        lines.append("Baseline (speedup 1.00×, memory saved 0%): " +
                     "; ".join(f"job {r.job} ({r.label})" for r in base.itertuples()) + ".")
    if "loss_ok" in df and df["loss_ok"].notna().any():
        lines.append("loss ok: the row's held-out loss (its gap to the floor where known) is "
                     "above the baseline's by no more than the wider min–max spread of the "
                     "two over repeats of different initializations (sweep.vary_init).")
    if (df["repeats"].fillna(1) > 1).any():
        lines.append("Median over repeats; spread = half the min–max range; (n.s.) = the "
                     "tokens/s ranges of this row and its baseline overlap.")
    if checks := plan_errors(df):
        lines.append(checks)
    busy = contended(df)
    if busy:
        lines.append(f"**Warning**: {busy}.")
    if "task" in df and len(df) and (df["task"] == "comm").all():
        lines.append("GB/s: the peak bus bandwidth (nccl-tests convention) over the message "
                     "sizes; every size: each job's comm.csv.")
    lines.append("All fields: results.csv / results.parquet (nulls are explained in "
                 "null_reasons).")
    return "\n".join(lines) + "\n"


def write_tables(df, out_dir: Path, title: str = "Sweep results") -> dict:
    """Write results.csv, results.parquet and results.md in out_dir; returns their paths.

    Each is written to its own temporary file, then renamed: jobs of a launcher that runs
    them at once may write together. A write that fails, as on a full disk, leaves the
    tables as they were and no temporary file, and its OSError names the table."""
    import tempfile

    out_dir = Path(out_dir)
    paths = {ext: out_dir / f"results.{ext}" for ext in ("csv", "parquet", "md")}
    f = flat(df)
    tmp, ext = {}, "csv"
    try:
        for ext, p in paths.items():
            fd, tmp[ext] = tempfile.mkstemp(dir=out_dir, prefix=f".{p.name}.", suffix=".tmp")
            os.close(fd)
            os.chmod(tmp[ext], 0o644)
        ext = "csv"
        f.to_csv(tmp["csv"], index=False)
        ext = "parquet"
        f.to_parquet(tmp["parquet"], index=False)
        ext = "md"
        Path(tmp["md"]).write_text(markdown(df, title))
        for ext, p in paths.items():
            os.replace(tmp.pop(ext), p)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(paths[ext])) from None
    finally:
        for t in tmp.values():  # left by a failed write
            Path(t).unlink(missing_ok=True)
    return paths


def write_text_atomic(path: Path, text: str) -> None:
    """Write a text file whole or not at all, through a temporary file renamed.

    A write that fails, as on a full disk, leaves nothing behind; its OSError names `path`."""
    import tempfile

    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=Path(path).parent, prefix=f".{Path(path).name}.",
                                   suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def write_error_line(e: OSError) -> str:
    """One line for a write that failed, e.g. on a full or read-only disk: the path and problem.

    A write's OSError often names no file, as when a buffered write fails at close; then
    the path is that of the file the failing code had open."""
    path = e.filename or _open_file(e)
    what = os.strerror(e.errno) if e.errno else e.strerror or str(e)  # (pyarrow's is long)
    return f"cannot write {path}: {what}" if path else f"cannot write: {what}"


def _open_file(e: BaseException) -> str | None:
    import io

    frames, tb = [], e.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):  # the innermost first
        for v in frame.f_locals.values():
            if isinstance(v, io.IOBase) and isinstance(getattr(v, "name", None), str):
                return v.name
    return None


# the answer's columns first (sweep/answer.py), then the others from the left
FIRST = ("job", "combination", "status", "tokens/s", "speedup", "peak GiB", "loss ok", "fits",
         "planned tokens/s", "planned peak GiB", "error")


def print_table(df, title: str = "Sweep results", cols: int | None = None) -> None:
    """The table at the terminal's width (`cols`): the columns that fit, the rest named."""
    from .. import screen

    c = compact(df)
    cols = cols or screen.width()
    t, dropped = screen.table(title, [str(x) for x in c.columns],
                              [list(r) for r in c.itertuples(index=False)], cols, keep=FIRST,
                              wrap=("combination", "error"), right=(
        "tokens/s", "speedup", "step ms", "peak GiB", "mem saved", "MFU", "loss"))
    failed = [r for r in c.itertuples(index=False) if r.error] if "error" in dropped else []
    screen.show(t, [d for d in dropped if not failed or d != "error"], cols,
                "results.md has them all")
    for r in failed:  # the reason of each row that did not finish, as its column would
        print(screen.cut(f"job {r.job}: {r.error}", cols))
    busy = contended(df)
    if busy:
        print(screen.wrapped(f"warning: {busy}", cols), file=sys.stderr)
