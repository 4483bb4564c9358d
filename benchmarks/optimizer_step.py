"""Optimizer step, AdamW vs Muon (Newton-Schulz steps 3, 5, 7), side by side in one process.

    PYTHONPATH=. python benchmarks/optimizer_step.py [--models tiny_moe,small_moe]
        [--ns-steps 3,5,7] [--reps 10] [--json out.json] [override ...]

For each model: one model built as a run builds it, gradients from one backward pass, then
one optimizer per contender (the run's own build_optimizer: optim=adamw, and optim=muon with
each optim.ns_steps), all stepping the same parameters (the step's cost does not depend on
their values). Rounds run every contender once (rounds disturbed by other processes are
rerun, see _timing.py); the table gives median ms per step, the ratio to AdamW's, and the
optimizer state each keeps (MiB). Seed 003 claims fewer Newton-Schulz steps are faster
("3-5 small, 5-7 large"): this measures by how much.
Default: tiny_moe, small_moe on CPU; small_moe, moe_1b on CUDA.
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import (add_device, at_least, check_config, compose, device_name,  # noqa: E402
                     one_of, out_file, run_rounds, save_json)


def state_mib(opt) -> float:
    """Bytes held in optimizer state (Muon's and its inner AdamW's), in MiB."""
    opts = [opt, *([opt.adamw] if hasattr(opt, "adamw") else [])]
    states = {id(o.state): o.state for o in opts}  # (Muon's holds its AdamW's: counted once)
    return sum(t.numel() * t.element_size() for st in states.values() for s in st.values()
               for t in s.values() if torch.is_tensor(t) and t.dim() > 0) / 2**20


def configs(model_name, ns_steps, extra):
    """The overrides of AdamW's config, then Muon's at each ns_steps."""
    base = [f"model={model_name}", "logger=none", *extra]
    return [base, *([*base, "optim=muon", f"optim.ns_steps={n}"] for n in ns_steps)]


def bench(model_name, ns_steps, device, reps, extra):
    from moe_exp.model import build_model
    from moe_exp.optim import build_optimizer

    base, *muons = configs(model_name, ns_steps, extra)
    cfg = compose(base)
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(cfg.model)
    t = cfg.train
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len),
                           generator=g).to(device)
    model(tokens, tokens).loss.backward()  # real gradients, kept for every step
    opts = {"adamw": build_optimizer(model, cfg, device)[0]}
    for n, overrides in zip(ns_steps, muons):
        opts[f"muon ns={n}"] = build_optimizer(model, compose(overrides), device)[0]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    res = run_rounds({k: o.step for k, o in opts.items()}, reps, warmup=2, sync=sync)
    med = res["median_ms"]
    return {"model": model_name, "device": device.type, "median_ms": med,
            "vs_adamw": {k: v / med["adamw"] for k, v in med.items()},
            "state_mib": {k: state_mib(o) for k, o in opts.items()},
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
            "rounds": res["rounds"], "dropped_rounds": res["dropped_rounds"],
            "contended": res["contended"], "order": res["order"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device(ap)
    conf = ROOT / "moe_exp" / "conf"
    names = sorted(p.stem for p in (conf / "model").glob("*.yaml"))
    ap.add_argument("--models", default=None, type=one_of(names), help="comma list of models")
    ap.add_argument("--ns-steps", default="3,5,7", type=one_of([str(i) for i in range(1, 21)]),
                    help="comma list of optim.ns_steps for muon")
    ap.add_argument("--reps", type=at_least(1), default=10)
    ap.add_argument("--json", default=None, type=out_file)
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every model")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    models = (a.models or ("small_moe,moe_1b" if cuda else "tiny_moe,small_moe")).split(",")
    ns = [int(x) for x in a.ns_steps.split(",")]
    # every config validated as a run does, before any work
    check_config(ap, [o for m in models for o in configs(m, ns, a.overrides)])
    dev_name = device_name(device)
    print(f"# optimizer step, AdamW vs Muon, {dev_name}, torch {torch.__version__}, "
          f"{dt.date.today()}, median of {a.reps}")
    print(f"{'model':10} {'optimizer':10} {'ms':>9} {'vs adamw':>9} {'state MiB':>10}")
    rows = []
    for m in models:
        r = bench(m, ns, device, a.reps, a.overrides)
        rows.append(r)
        for k, ms in r["median_ms"].items():
            print(f"{m:10} {k:10} {ms:9.2f} {r['vs_adamw'][k]:8.2f}x {r['state_mib'][k]:10.1f}")
        print(f"{'':10} [{r['params_m']:.1f}M params, {r['rounds']} rounds, "
              f"{r['dropped_rounds']} dropped{', CONTENDED' if r['contended'] else ''}]",
              flush=True)
        if a.json:  # after every row: a run cut short keeps what it measured
            save_json(a.json, dev_name, rows)
    return rows


if __name__ == "__main__":
    main()
