"""Muon's step under FSDP: round-robin Newton-Schulz vs every rank gathering every matrix.

    PYTHONPATH=. python benchmarks/muon_fsdp.py [--models tiny_dense,small_moe] [--ranks 2]
        [--reps 10] [--json out.json] [override ...]

On `--ranks` local ranks (gloo on CPU, NCCL on GPUs), each model is built and FSDP-sharded
as a run does (`parallel=fsdp optim=muon`), one backward makes the gradients, then the same
optimizer steps in rounds, each round timing both ways (the order changes from round to
round, both ranks the same): `round-robin` (moe_exp's: each sharded matrix orthogonalized
on one rank, two all-to-alls), `gathered` (the previous way: every rank all-gathers every
matrix and orthogonalizes all of them). Median ms per step of the slower rank. Expert
stacks sharded on the expert dim stay local either way, so MoE models gain on their
attention and router matrices only; dense models on every matrix.
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import (at_least, check_config, compose, device_name, one_of,  # noqa: E402
                     out_file, round_orders, save_json)

WAYS = ("round-robin", "gathered")


def config(name: str, ranks: int, extra: list[str]) -> list[str]:
    """The overrides every rank builds a model with."""
    return [f"model={name}", "logger=none", "parallel=fsdp", "optim=muon",
            f"hardware.devices={ranks}", *extra]


def rank_bench(models: list[str], ranks: int, reps: int, extra: list[str]) -> list[dict]:
    """On every rank: both ways per model; returns rank 0's rows (slowest rank's medians)."""
    import statistics

    import torch.distributed as dist

    import moe_exp.optim.muon as muon
    from moe_exp import distributed
    from moe_exp.hardware import resolve
    from moe_exp.model import build_model
    from moe_exp.optim import build_optimizer
    from moe_exp.optimizations import apply

    rows = []
    d = None
    for name in models:
        cfg = compose(config(name, ranks, extra))
        resolve(cfg)  # hardware=auto -> this machine's device
        d = d or distributed.init(cfg)
        device = torch.device(f"cuda:{d.local_rank}" if cfg.hardware.device == "cuda"
                              else "cpu")
        torch.manual_seed(0)
        with torch.device(device):
            applied = apply(build_model(cfg.model), cfg, device, d.world)
        opt = build_optimizer(applied.model, cfg, device)[0]
        g = torch.Generator().manual_seed(1 + d.rank)
        t = cfg.train
        tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1),
                               generator=g).to(device)
        applied.model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
        real_ok = muon.round_robin_ok

        def step(way):
            muon.round_robin_ok = real_ok if way == "round-robin" else (lambda u: False)
            try:
                opt.step()
            finally:
                muon.round_robin_ok = real_ok

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()

        times = {w: [] for w in WAYS}
        orders = round_orders(list(WAYS))
        for r in range(reps + 2):  # 2 warmup rounds
            for way in next(orders):
                sync()
                t0 = time.perf_counter()
                step(way)
                sync()
                if r >= 2:
                    times[way].append((time.perf_counter() - t0) * 1e3)
        med = {w: statistics.median(v) for w, v in times.items()}
        slowest = torch.tensor([med[w] for w in WAYS], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        med = dict(zip(WAYS, slowest.tolist()))
        rows.append({"model": name, "ranks": d.world, "median_ms": med,
                     "speedup": med["gathered"] / med["round-robin"], "rounds": reps,
                     "params_m": sum(p.numel() for p in applied.model.parameters()) / 1e6})
    distributed.finish()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = sorted(p.stem for p in (ROOT / "moe_exp" / "conf" / "model").glob("*.yaml"))
    ap.add_argument("--models", default="tiny_dense,small_moe", type=one_of(names))
    ap.add_argument("--ranks", type=at_least(2), default=2)
    ap.add_argument("--reps", type=at_least(1), default=10)
    ap.add_argument("--json", default=None, type=out_file)
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every model")
    a = ap.parse_args(argv)
    # (also ranks past this CPU's cores or the GPUs: hardware.devices={ranks})
    check_config(ap, [config(m, a.ranks, a.overrides) for m in a.models.split(",")])
    from moe_exp.distributed import launch, rank_entry

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = device_name(dev)
    print(f"# Muon step under FSDP on {a.ranks} ranks, {name}, torch {torch.__version__}, "
          f"{dt.date.today()}, median of {a.reps} (slower rank)")
    rows = launch(rank_entry, a.ranks, rank_bench, a.models.split(","), a.ranks, a.reps,
                  a.overrides)
    print(f"{'model':12} {'params M':>9} {'gathered ms':>12} {'round-robin ms':>15} {'speedup':>8}")
    for r in rows:
        m = r["median_ms"]
        print(f"{r['model']:12} {r['params_m']:9.1f} {m['gathered']:12.2f} "
              f"{m['round-robin']:15.2f} {r['speedup']:7.2f}x")
    if a.json:
        save_json(a.json, f"{name}, {a.ranks} ranks", rows)
    return rows


if __name__ == "__main__":
    main()
