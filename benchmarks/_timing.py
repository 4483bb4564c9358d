"""Side-by-side timing on a shared machine: interleaved rounds, contended rounds dropped.

Every contender runs once per round, so slow drifts hit all alike, and no contender keeps
its place: in a fixed order, the same code measured twice in one round differed by up to
15% with its place (after which contender it ran), more than most effects measured here.
`round_orders` draws a shuffled order (seeded) and rotates it over the next n rounds, so
over every n rounds each contender runs once in each position, and the contender before
it changes from one block of n rounds to the next.
On Linux each round also reads /proc/stat: when other processes used more than
`max_other` of the machine's CPU time during the round, the whole round is dropped and
run again (up to `max_tries` rounds in all); a 2-core box shared with a test suite
otherwise turns a 10 ms step into 500 ms (OpenMP threads waiting for a preempted peer).
The report says how many rounds were dropped and, if fewer quiet rounds came than asked
for, that the figures were taken under contention (the quiet ones, or with none, all).
"""
from __future__ import annotations

import os
import random
import statistics
import time
from typing import Callable, Iterator

from moe_exp.bench import load as _load


def _cpu_ticks():
    """A reading for other_load (moe_exp.bench.load.snapshot: our CPUs' busy ticks, this
    process tree's ticks, the time)."""
    return _load.snapshot()


def other_load(t0, t1, wall_s: float | None = None) -> float | None:
    """Share of our CPUs' time that other processes used between two readings (wall_s:
    unused, the readings hold their times)."""
    return _load.other_load(t0, t1)


def round_orders(names: list[str], seed: int = 0) -> Iterator[list[str]]:
    """Orders for successive rounds: each block of len(names) rounds rotates one shuffled
    order (see module doc)."""
    rng = random.Random(seed)
    while True:
        base = list(names)
        rng.shuffle(base)
        for r in range(len(base)):
            yield base[r:] + base[:r]


def run_rounds(fns: dict[str, Callable[[], None]], reps: int, warmup: int = 2,
               sync: Callable[[], None] = lambda: None, max_other: float | None = None,
               max_tries: int | None = None, seed: int = 0) -> dict:
    """Median ms per contender over `reps` quiet rounds (see module doc).

    max_other: default 0.15, plus the share of cores this process leaves free
    (torch.get_num_threads() below the core count).
    """
    if max_other is None:
        import torch

        cores = os.cpu_count() or 1
        max_other = 0.15 + max(0, cores - torch.get_num_threads()) / cores
    max_tries = max_tries or 4 * reps + warmup
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync()
    times: dict[str, list[float]] = {n: [] for n in fns}
    noisy: dict[str, list[float]] = {n: [] for n in fns}
    dropped = tries = 0
    orders = round_orders(list(fns), seed)
    while min(len(v) for v in times.values()) < reps and tries < max_tries:
        tries += 1
        c0, w0 = _cpu_ticks(), time.perf_counter()
        row = {}
        for n in next(orders):
            sync()
            t = time.perf_counter()
            fns[n]()
            sync()
            row[n] = (time.perf_counter() - t) * 1e3
        load = other_load(c0, _cpu_ticks(), time.perf_counter() - w0)
        target = times if load is None or load <= max_other else noisy
        if target is noisy:
            dropped += 1
        for n, ms in row.items():
            target[n].append(ms)
    # fewer quiet rounds than asked for: flagged (medians are of the quiet ones, if any)
    contended = min(len(v) for v in times.values()) < reps
    use = noisy if min(len(v) for v in times.values()) == 0 else times
    return {
        "median_ms": {n: statistics.median(v) for n, v in use.items()},
        "rounds": min(len(v) for v in use.values()),
        "dropped_rounds": dropped,
        "contended": contended,
        "order": f"shuffled, rotated over each block of {len(fns)} rounds (seed {seed})",
    }


def at_least(low: int):
    """argparse type: an int >= low."""
    import argparse

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        return n
    return parse


def one_of(allowed):
    """argparse type: a comma list, each item one of `allowed`."""
    import argparse

    def parse(text: str) -> str:
        bad = [x for x in text.split(",") if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(bad)}: not one of "
                                             f"{', '.join(allowed)}")
        return text
    return parse


def add_device(ap) -> None:
    """--device: cpu, or cuda where a CUDA GPU is visible (then the default)."""
    import argparse

    import torch

    def parse(text: str) -> str:
        if text not in ("cpu", "cuda"):
            raise argparse.ArgumentTypeError(f"'{text}' is not one of cpu, cuda")
        if text == "cuda" and not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("cuda: no CUDA GPU is visible; use --device cpu")
        return text
    ap.add_argument("--device", type=parse, help="cpu or cuda",
                    default="cuda" if torch.cuda.is_available() else "cpu")


def out_file(text: str) -> str:
    """argparse type: a file path that can be written (its folder exists or can be made)."""
    import argparse
    from pathlib import Path

    path = Path(text).absolute()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a folder, not a file")
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {folder} is a file, not a folder")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: not writable")
    return text


def compose(overrides):
    """The run's config (moe_exp/conf/run.yaml) with these overrides, not struct."""
    from hydra import compose as hcompose
    from hydra import initialize_config_module
    from omegaconf import OmegaConf

    with initialize_config_module(config_module="moe_exp.conf", version_base="1.3"):
        cfg = hcompose("run", overrides=list(overrides))
    OmegaConf.set_struct(cfg, False)
    return cfg


def check_config(ap, runs) -> None:
    """Each list of overrides in `runs` composed and validated as `python -m moe_exp.run`
    does, before any work; the first bad one ends the script (ap.error: one line, exit 2)."""
    from moe_exp.hydra_internals import hydra_error_line
    from moe_exp.run import prepare

    for overrides in runs:
        try:
            cfg = compose(overrides)
        except Exception as e:  # noqa: BLE001 - Hydra's composition errors
            ap.error(f"overrides: {hydra_error_line(e)}")
        rec = prepare(cfg, list(overrides))[1]
        if rec is not None:
            ap.error(rec["error"])


def device_name(device) -> str:
    """The GPU's name, or the CPU's model, cores and torch threads: each table's first
    line (the CPU figures depend on the model: bf16 matmuls on AMX or not)."""
    import torch

    from moe_exp.hardware import device_name as name

    if device.type != "cpu":
        return name(device)
    return f"cpu ({name(device)}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def save_json(path: str, device: str, rows: list) -> None:
    """A benchmark's rows with their provenance (device, torch, date, command)."""
    import datetime as dt
    import json
    import sys
    from pathlib import Path

    import torch

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"meta": {
        "device": device, "torch": torch.__version__, "date": str(dt.date.today()),
        "command": " ".join(sys.argv)}, "rows": rows}, indent=2))
