"""The attention kernels (train.attention) side by side: the attention alone and the whole
model's forward + backward with each kernel, and the attention's share of the model's time.

    PYTHONPATH=. python benchmarks/attention.py [--kernels auto,flash,math] [--reps 10]
                    [--device cpu|cuda] [--dtype fp32|bf16] [--json out.json] [OVERRIDES...]

OVERRIDES are the run's (model=moe_1b train.seq_len=2048 train.micro_batch_size=2 ...): the
model and batch shape. A kernel this device and dtype cannot run (moe_exp's own check, as a
run's) is a row with the reason. `attention_ms`: the kernel's forward + backward on the
model's q, k, v (B, heads, S, head_dim; grouped k/v heads as the model has them);
`model_ms`: the model's forward + backward with that kernel in every layer; `share`:
layers x attention_ms / model_ms. `speedup`: math's model_ms over the kernel's (the seeds'
"flash attention 30-50% faster" compares against the unfused kernel). Timing: interleaved
rounds, contended rounds dropped (benchmarks/_timing.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _timing import (add_device, at_least, device_name, one_of, out_file,  # noqa: E402
                     run_rounds, save_json)

from moe_exp.config import ATTENTION  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def contenders(cfg, kernels, device, dtype):
    """{kernel: (attention fn, model fn)} for the kernels that run here; {kernel: reason}."""
    from moe_exp.model import build_model
    from moe_exp.optimizations.attention import apply_attention, attention_unsupported

    m, t = cfg.model, cfg.train
    b, s, hd = t.micro_batch_size, t.seq_len, m.hidden_size // m.num_heads
    torch.manual_seed(0)
    leaf = dict(device=device, dtype=dtype, requires_grad=True)
    q = torch.randn(b, m.num_heads, s, hd, **leaf)
    k, v = (torch.randn(b, m.num_kv_heads, s, hd, **leaf) for _ in range(2))
    tokens = torch.randint(0, m.vocab_size, (b, s + 1), device=device)
    cap = torch.cuda.get_device_capability() if device.type == "cuda" else None
    fns, skipped = {}, {}
    for name in kernels:
        why = attention_unsupported(name, device.type, dtype, cap)
        if why:
            skipped[name] = why
            continue
        torch.manual_seed(0)
        with torch.device(device):
            model = build_model(m)
        apply_attention(model, name)
        attend = next(x.attend for x in model.modules() if hasattr(x, "attend"))
        fns[name] = (_step(lambda a=attend: a(q, k, v).sum(), (q, k, v), dtype, device),
                     _step(lambda mod=model: mod(tokens[:, :-1], tokens[:, 1:]).loss,
                           list(model.parameters()), dtype, device))
    return fns, skipped


def _step(loss_fn, leaves, dtype, device):
    def run():
        for x in leaves:
            x.grad = None
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_fn()
        loss.backward()
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", type=one_of(ATTENTION), default="auto,flash,math")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--reps", type=at_least(1), default=10)
    ap.add_argument("--json", type=out_file)
    add_device(ap)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    from hydra import compose, initialize_config_module

    try:
        with initialize_config_module(config_module="moe_exp.conf", version_base="1.3"):
            cfg = compose("run", overrides=list(args.overrides))
    except Exception as e:  # noqa: BLE001 - a bad override: one line
        ap.error(f"overrides: {str(e).splitlines()[0]}")
    if cfg.train.seq_len > cfg.model.max_seq_len:
        ap.error(f"overrides: train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len="
                 f"{cfg.model.max_seq_len}")
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    fns, skipped = contenders(cfg, args.kernels.split(","), device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    attn = run_rounds({n: f[0] for n, f in fns.items()}, args.reps, sync=sync) if fns else None
    whole = run_rounds({n: f[1] for n, f in fns.items()}, args.reps, sync=sync) if fns else None
    layers, rows = cfg.model.num_layers, []
    ref = whole and whole["median_ms"].get("math")
    print(f"# attention kernels: {device_name(device)}, {args.dtype}, model={cfg.model.name} "
          f"batch {cfg.train.micro_batch_size} x {cfg.train.seq_len}")
    print(f"{'kernel':<10}{'attention ms':>14}{'model ms':>11}{'share':>8}{'speedup':>9}")
    for name in args.kernels.split(","):
        if name in skipped:
            rows.append({"kernel": name, "skipped": skipped[name]})
            print(f"{name:<10}skipped: {skipped[name]}")
            continue
        a, w = attn["median_ms"][name], whole["median_ms"][name]
        row = {"kernel": name, "attention_ms": a, "model_ms": w, "share": layers * a / w,
               "speedup": ref / w if ref else None}
        rows.append(row)
        print(f"{name:<10}{a:>14.3f}{w:>11.2f}{row['share']:>8.0%}" +
              (f"{row['speedup']:>8.2f}×" if ref else f"{'-':>9}"))
    for what, res in (("attention", attn), ("model", whole)):
        if res and (res["dropped_rounds"] or res["contended"]):
            print(f"({what}: {res['dropped_rounds']} contended rounds dropped"
                  f"{'; too few quiet rounds: figures taken under contention' if res['contended'] else ''})")
    if args.json:
        save_json(args.json, device_name(device), [{**r, "dtype": args.dtype} for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
