"""Whole training step, torch.compile vs eager, per model size, side by side in one process.

    PYTHONPATH=. python benchmarks/compile_step.py [--models tiny_moe,small_moe]
        [--precisions fp32,bf16] [--reps 10] [--json out.json] [override ...]

For each model and precision: two copies of the same model (same weights, same batch),
one eager (train.compile=off) and one compiled (train.compile=default), each built the way
a run builds it (moe_exp.optimizations.apply, the run's optimizer) with the MoE dispatch
`auto` resolves to for that mode. A step = forward + backward + clip + optimizer step.
The first compiled step's time is reported as compile time (cold: a fresh inductor cache
unless --warm-cache); then rounds alternate one
eager and one compiled step (rounds disturbed by other processes are rerun, see
_timing.py) and the table gives median ms and eager/compiled speedup.
Default: tiny_moe, small_moe on CPU; tiny_moe, small_moe, moe_1b on CUDA (bf16).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1" if (os.cpu_count() or 1) <= 4 else "8")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import (add_device, at_least, check_config, compose, device_name,  # noqa: E402
                     one_of, out_file, run_rounds, save_json)


def build(cfg, device, state=None):
    from moe_exp.optimizations.dispatch import resolve_model_dispatch
    from moe_exp.model import build_model
    from moe_exp.optim import build_optimizer
    from moe_exp.optimizations import apply

    resolve_model_dispatch(cfg, device)
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(cfg.model)
    if state is not None:
        model.load_state_dict(state)
    applied = apply(model, cfg, device)
    opt, _, _ = build_optimizer(applied.model, cfg, device)
    params = [p for g in opt.param_groups for p in g["params"]]

    scaler = applied.scaler  # fp16: as the run's loop uses it

    def step(tokens):
        with applied.autocast():
            out = applied.model(tokens, tokens)
        (scaler.scale(out.loss) if scaler else out.loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    return model, step, cfg.model.dispatch


def configs(model_name, precision, extra):
    """The overrides of the eager and the compiled model."""
    base = [f"model={model_name}", f"precision={precision}", "logger=none", *extra]
    return [*base, "train.compile=off"], [*base, "train.compile=default"]


def bench(model_name, precision, device, reps, extra):
    eager_cfg, comp_cfg = (compose(o) for o in configs(model_name, precision, extra))
    from moe_exp.hardware import resolve

    resolve(eager_cfg)
    resolve(comp_cfg)
    t = eager_cfg.train
    eager, eager_step, eager_dispatch = build(eager_cfg, device)
    _, comp_step, comp_dispatch = build(comp_cfg, device, eager.state_dict())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, eager_cfg.model.vocab_size, (t.micro_batch_size, t.seq_len),
                           generator=g).to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    comp_step(tokens)
    sync()
    first = time.perf_counter() - t0
    res = run_rounds({"eager": lambda: eager_step(tokens), "compiled": lambda: comp_step(tokens)},
                     reps, warmup=2, sync=sync)
    med = res["median_ms"]
    return {"model": model_name, "precision": precision, "device": device.type,
            "tokens_per_step": t.micro_batch_size * t.seq_len,
            "dispatch": {"eager": eager_dispatch, "compiled": comp_dispatch},
            "first_compiled_step_s": first, "median_ms": med,
            "speedup": med["eager"] / med["compiled"], "rounds": res["rounds"],
            "dropped_rounds": res["dropped_rounds"], "contended": res["contended"],
            "order": res["order"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device(ap)
    conf = ROOT / "moe_exp" / "conf"
    names = lambda group: sorted(p.stem for p in (conf / group).glob("*.yaml"))  # noqa: E731
    ap.add_argument("--models", default=None, type=one_of(names("model")),
                    help="comma list of model options")
    ap.add_argument("--precisions", default=None, type=one_of(names("precision")),
                    help="comma list of precision options")
    ap.add_argument("--reps", type=at_least(1), default=10)
    ap.add_argument("--json", default=None, type=out_file)
    ap.add_argument("--warm-cache", action="store_true",
                    help="keep inductor's cache (default: a fresh one: cold compile times)")
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every model")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    models = (a.models or ("tiny_moe,small_moe,moe_1b" if cuda else "tiny_moe,small_moe")).split(",")
    precisions = (a.precisions or ("bf16" if cuda else "fp32,bf16")).split(",")
    # every config validated as a run does, before any work
    check_config(ap, [o for m in models for p in precisions for o in configs(m, p, a.overrides)])
    if not a.warm_cache:
        import atexit
        import shutil
        import tempfile

        cache = tempfile.mkdtemp(prefix="inductor-cold-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
    dev_name = device_name(device)
    print(f"# whole train step, compiled vs eager, {dev_name}, torch {torch.__version__}, "
          f"{dt.date.today()}, median of {a.reps}")
    print(f"{'model':10} {'precision':9} {'dispatch e/c':>16} {'eager ms':>10} {'compiled ms':>12} "
          f"{'speedup':>8} {'compile s':>10}")
    rows = []
    for m in models:
        for p in precisions:
            r = bench(m, p, device, a.reps, a.overrides)
            rows.append(r)
            d = f"{r['dispatch']['eager']}/{r['dispatch']['compiled']}"
            print(f"{m:10} {p:9} {d:>16} {r['median_ms']['eager']:10.1f} "
                  f"{r['median_ms']['compiled']:12.1f} {r['speedup']:7.2f}x "
                  f"{r['first_compiled_step_s']:10.1f}  [{r['rounds']} rounds, "
                  f"{r['dropped_rounds']} dropped{', CONTENDED' if r['contended'] else ''}]",
                  flush=True)
            torch._dynamo.reset()
            if a.json:  # after every row: a run cut short keeps what it measured
                save_json(a.json, dev_name, rows)
    return rows


if __name__ == "__main__":
    main()
