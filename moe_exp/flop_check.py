"""Count the FLOPs of a real training step and compare them with the analytic formula.

    python -m moe_exp.flop_check [--meta] [model=small_moe precision=bf16 ...]

torch.utils.flop_counter.FlopCounterMode counts matmuls (mm, addmm, bmm) and GPU
attention, but has no formula for `aten._grouped_mm` and counts CPU attention as 0; its GPU
attention backward includes the recomputation of the scores, hardware FLOPs.
`count_step_flops` adds formulas for grouped_mm and every SDPA kernel, forward and
backward, with the model-FLOPs convention of bench/flops.py: attention forward = QK^T and
PV, causal counted in full; backward = the 4 matmuls of the gradients, no recomputation.
"""
from __future__ import annotations

import contextlib
import sys

import torch

from .bench.formulas import flop_formulas


def count_step_flops(model, tokens, targets, autocast=contextlib.nullcontext) -> dict:
    """FLOPs of one forward + backward of `model` on one micro-batch, counted per op."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=flop_formulas())
    with counter:
        with autocast():
            out = model(tokens, targets)
        out.loss.backward()
    by_op = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    total = counter.get_total_flops()
    kept = getattr(out, "counts", None)
    return {"total": total, "per_token": total / tokens.numel(), "by_op": by_op,
            "kept": int(kept.sum()) if kept is not None and not kept.is_meta else None}


def check_config(cfg) -> None:
    """A run's config checks of what flop_check reads: the model and the loop's shapes.

    Raises ConfigError on the first problem. The hardware checks are left out: --meta is
    for models too big for this machine."""
    from . import validate as v

    for fn in (v.check_resolves, v.check_complete, v.check_known_keys, v.check_finite,
               v.check_choices, v.check_ranges, v.check_train):
        fn(cfg)
    v.check_model(cfg.model)


def check(overrides=(), device: str = "cpu") -> dict:
    """Analytic flops_per_token vs the counted FLOPs of one step of the configured model.

    device="meta" counts from shapes alone, without memory or compute, with grouped
    dispatch: e.g. for moe_1b on a laptop."""
    from hydra import compose, initialize_config_module

    from .model import build_model
    from .optimizations.precision import DTYPES, autocast_factory
    from .bench.flops import flops_per_token

    with initialize_config_module(config_module="moe_exp.conf", version_base="1.3"):
        cfg = compose("run", overrides=list(overrides))
    check_config(cfg)
    m, t = cfg.model, cfg.train
    if not m.num_experts:
        m.dispatch = "loop"  # unused by a dense model
    elif device == "meta":  # the loop needs the counts' values
        m.dispatch = "grouped"
    elif m.dispatch in ("auto", "padded"):  # padded multiplies padding rows: not model FLOPs
        dtype = DTYPES.get(cfg.precision.autocast_dtype, torch.float32)
        from .model.moe import grouped_mm_supported

        m.dispatch = "grouped" if grouped_mm_supported("cpu", dtype) else "loop"
    torch.manual_seed(t.seed)
    with torch.device(device):
        model = build_model(m)
        if device == "meta":  # grouped_mm's meta kernel wants bf16; FLOPs are the same
            model = model.to(torch.bfloat16)
        tokens = torch.randint(0, m.vocab_size, (t.micro_batch_size, t.seq_len))
    counted = count_step_flops(model, tokens, tokens,
                               autocast_factory(cfg.precision, torch.device("cpu")))
    dropped = 0.0
    if m.num_experts and m.capacity_factor is not None and device != "meta":
        from .shapes import moe_layers

        # useful FLOPs: those of the choices kept (as the record counts them)
        dropped = 1 - counted["kept"] / (tokens.numel() * m.top_k * moe_layers(m))
    analytic = flops_per_token(m, t.seq_len, dropped)
    return {"model": m.name, "dispatch": m.dispatch if m.num_experts else None, "precision": cfg.precision.name,
            "analytic_per_token": analytic, "counted_per_token": counted["per_token"],
            "rel_diff": counted["per_token"] / analytic - 1, "by_op": counted["by_op"]}


def main(argv=None) -> int:
    import argparse

    from hydra.errors import HydraException

    from .config import ConfigError
    from .hydra_internals import hydra_error_line

    ap = argparse.ArgumentParser(prog="python -m moe_exp.flop_check", description=(
        "analytic FLOPs per token against FlopCounterMode on one real training step"))
    ap.add_argument("--meta", action="store_true", help="on the meta device (no memory, no "
                    "compute: for models too big for this machine)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="config overrides, as for python -m moe_exp.run (model=small_moe)")
    args = ap.parse_intermixed_args(argv)  # (--meta anywhere)
    try:
        r = check(args.overrides, "meta" if args.meta else "cpu")
    except HydraException as e:
        print(f"error: {hydra_error_line(e)}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"model={r['model']} precision={r['precision']} dispatch={r['dispatch']}")
    print(f"  analytic {r['analytic_per_token'] / 1e6:12.4f} MFLOP/token")
    print(f"  counted  {r['counted_per_token'] / 1e6:12.4f} MFLOP/token  "
          f"({100 * r['rel_diff']:+.3f}%)")
    for op, v in sorted(r["by_op"].items(), key=lambda kv: -kv[1]):
        print(f"    {op:60} {v:.4g}")
    return 0 if abs(r["rel_diff"]) <= 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
