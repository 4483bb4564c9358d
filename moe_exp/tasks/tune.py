"""task=tune_batch: the largest micro-batch that fits, then the fastest of those that fit.

Each probe is a bench run, `task=bench train.micro_batch_size=N`, in its own process, so an
OOM, or the kernel's OOM killer, ends the probe and not the search. From
train.micro_batch_size the search doubles while probes fit, or halves while they do not,
then bisects between the last that fit and the first that did not, in steps of
tune.multiple. A probe fits if it ran: ok, or diverged, since its memory held. oom,
crashed and skipped do not fit: out of memory, killed, or skipped by the memory check. Any
other failure ends the search with that probe's error."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..bench.load import busy
from ..config import ConfigError
from ..results import fill_null_reasons, why_died
from ..record import Tune
from .protocol import Task
from .summary import summary_rows

FITS, NO_FIT = ("ok", "diverged"), ("oom", "crashed", "skipped")
RISE = 0.05  # tune.goal=fastest: tokens/s "still rising" means this much above the best
# the probes' own keys (set by the search), and what only the search's record carries
OWN = ("task=", "train.micro_batch_size=", "logger=", "logger.", "sweep.", "hydra.", "tune.")
KEEP = ("task", "overrides", "config_hash", "timestamp", "extra", "status", "error")


def search(fits, start: int, top: int) -> tuple[int | None, int | None]:
    """Search 1..top for the largest k where a monotone fits(k) holds, probing from start.

    It doubles or halves, then bisects. Returns that k or None, and the smallest k found not
    to fit or None."""
    k = min(max(start, 1), top)
    if fits(k):
        lo, hi = k, None
        while hi is None and lo < top:
            nxt = min(2 * lo, top)
            lo, hi = (nxt, None) if fits(nxt) else (lo, nxt)
        if hi is None:
            return lo, None
    else:
        lo, hi = 0, k
        while lo == 0 and hi > 1:
            half = hi // 2
            lo, hi = (half, hi) if fits(half) else (0, half)
        if lo == 0:
            return None, hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, hi


class Stop(Exception):
    """Ends the search before its limit is found; its text is the record's tune_limit."""


def plateaued(recs: dict) -> bool:
    """Whether tokens/s has stopped rising: the two largest micro-batches that fit each give
    under RISE more than the best of the smaller ones."""
    done = sorted((n, r["tokens_per_s"]) for n, r in recs.items()
                  if r["status"] in FITS and r.get("tokens_per_s") is not None)
    if len(done) < 3:
        return False
    best = max(t for _, t in done[:-2])
    return all(t < best * (1 + RISE) for _, t in done[-2:])


def probe_args(overrides: list[str], n: int, out: Path) -> list[str]:
    """The probe's command line: the run's overrides, as a bench run at micro-batch n."""
    kept = [o for o in overrides if not o.lstrip("~+").startswith(OWN)]
    return [sys.executable, "-m", "moe_exp.run", *kept, "task=bench", "logger=none",
            f"train.micro_batch_size={n}", f"hydra.run.dir={out}"]


def run_probe(overrides: list[str], n: int, out_dir: Path) -> dict:
    """Run one probe in its own process and return its record.

    A probe killed before it wrote one gets a crashed row that says so."""
    out = out_dir / "probes" / f"mbs{n}"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "probe.log", "w") as log:
        rc = subprocess.run(probe_args(overrides, n, out), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"}
                            ).returncode
    try:
        rec = json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError):
        rec = {"status": "crashed", "error": f"probe {why_died(rc)} (see {out}/probe.log)"}
    if rec.get("status") in (None, "running"):  # a record left mid-run by a killed probe
        rec.update(status="crashed", error=rec.get("error") or f"probe exit {rc}")
    return rec


def row(n: int, rec: dict) -> dict:
    return {"micro_batch_size": n, "status": rec["status"],
            **{k: rec.get(k) for k in ("tokens_per_s", "mfu", "peak_mem_gib", "cpu_other_load",
                                       "error")}}


class TuneTask(Task):
    """Search the micro-batches, then record the fastest probe that fit.

    The record holds that probe's measurements, tune_max_micro_batch, tune_best_micro_batch,
    tune_limit and every probe as a row."""
    name = "tune_batch"
    trains = True
    noun = "tune_batch"
    section = Tune
    tracked = False  # (its probes are runs of their own)
    model = False
    summary_rows = staticmethod(summary_rows)  # (the fastest probe's figures)

    @staticmethod
    def check(cfg) -> None:
        t = cfg.tune
        if t.max_micro_batch < t.multiple:
            raise ConfigError("tune.max_micro_batch", f"must be >= tune.multiple={t.multiple}, "
                              f"got {t.max_micro_batch}")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.recs: dict[int, dict] = {}  # micro-batch -> its probe's record

    def run(self, rec: dict) -> str:
        cfg, out_dir = self.ctx.cfg, self.ctx.out_dir
        unit, top = cfg.tune.multiple, cfg.tune.max_micro_batch // cfg.tune.multiple
        recs, failed, t0 = self.recs, [], time.monotonic()

        def fits(k: int) -> bool:
            n = k * unit
            if failed:  # (a failure other than not fitting stops the search)
                return False
            r = recs[n] = run_probe(self.ctx.overrides, n, out_dir)
            if self.ctx.progress:
                tps = r.get("tokens_per_s")
                print(f"tune_batch: micro-batch {n}: {r['status']}" +
                      (f", {tps:,.0f} tokens/s" if tps else "") +
                      (f", peak {r['peak_mem_gib']:.2f} GiB" if r.get("peak_mem_gib") else "") +
                      ("" if r["status"] in FITS + NO_FIT else f" ({r.get('error')})"),
                      flush=True)
            if r["status"] not in FITS + NO_FIT:
                failed.append(r)
            elif r["status"] in FITS and cfg.tune.goal == "fastest" and plateaued(recs):
                raise Stop("throughput")
            if cfg.tune.max_seconds and time.monotonic() - t0 > cfg.tune.max_seconds:
                raise Stop("tune.max_seconds")
            return r["status"] in FITS

        rec["task"] = "tune_batch"
        try:
            largest, first_no = search(fits, cfg.train.micro_batch_size // unit, top)
            limit = "memory" if first_no else "tune.max_micro_batch"
        except Stop as e:  # (the largest probed that fit: not the memory's limit)
            limit, first_no = str(e), None
            largest = max((n // unit for n, r in recs.items() if r["status"] in FITS),
                          default=None)
        done = {n: r for n, r in recs.items() if r["status"] in FITS}
        timed = {n: r for n, r in done.items() if r.get("tokens_per_s") is not None}
        if failed:
            rec.update(status=failed[0]["status"], error=f"probe: {failed[0].get('error')}")
        elif largest is None and first_no is None:
            rec.update(status="error", error=f"no probe fit before {limit} ended the search")
        elif largest is None:
            r = recs[first_no * unit]
            rec.update(status="oom", error=f"no micro-batch fits, not even {first_no * unit} "
                                           f"({r['status']}: {r.get('error')})")
        elif not timed:
            rec.update(status="error", error="no probe that fit measured its tokens/s")
        else:
            best = max(timed, key=lambda n: timed[n]["tokens_per_s"])
            rec.update({k: v for k, v in timed[best].items() if k not in KEEP})
            loads = [r["cpu_other_load"] for r in timed.values()
                     if r.get("cpu_other_load") is not None]
            rec["cpu_other_load"] = max(loads) if loads else None  # (the fastest is picked
            # among all: one loaded probe makes the pick unreliable)
            rec.update(status="ok", error=None, tune_max_micro_batch=largest * unit,
                       tune_best_micro_batch=best,
                       tune_limit=limit)
        self._probes(rec)
        return rec["status"]

    def interrupted(self, e: KeyboardInterrupt, rec: dict) -> None:
        rec.update(status="crashed", error=f"interrupted after {len(self.recs)} probes")
        self._probes(rec)

    def _probes(self, rec: dict) -> None:
        """Every probe as a row: in the record, and in probes.csv."""
        import pandas as pd

        rec["task"] = "tune_batch"
        rec["tune_probes"] = [row(n, r) for n, r in sorted(self.recs.items())]
        with contextlib.suppress(OSError):  # (the record, written next, holds them too)
            pd.DataFrame(rec["tune_probes"]).to_csv(self.ctx.out_dir / "probes.csv",
                                                    index=False)
        if rec["status"] != "ok":
            fill_null_reasons(rec, f"not measured: tune_batch {rec['status']}")

    def show(self, rec: dict) -> None:
        if busy(load := rec.get("cpu_other_load")):  # (before the answer it makes unreliable)
            print(f"WARNING: other processes used up to {load:.0%} of this machine's CPU "
                  "during the probes: the fastest micro-batch below is not reliable (re-run "
                  "task=tune_batch on a quiet machine)")
        limit = rec["tune_limit"]
        largest = f"largest micro-batch that fits {rec['tune_max_micro_batch']} (bounded by " \
            f"{limit})" if limit in ("memory", "tune.max_micro_batch") else \
            f"largest probed that fits {rec['tune_max_micro_batch']} (the search stopped: " + \
            ("tokens/s stopped rising; tune.goal=largest searches on" if limit == "throughput"
             else "tune.max_seconds passed") + ")"
        print(f"tune_batch: {largest}; fastest {rec['tune_best_micro_batch']}: "
              f"{rec['tokens_per_s']:,.0f} tokens/s, peak {rec['peak_mem_gib']:.2f} GiB"
              f"\nrecord: {self.ctx.out_dir / 'metrics.json'}")
