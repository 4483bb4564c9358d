"""Seed 002's claims beside what a `+sweep=seed002` run measured.

The claims are shared/seeds/002's "Expected Performance Improvements"; each checklist item
is measured against its reference row."""
from __future__ import annotations

from .seed import seed_cell, seed_markdown, seed_row_key

# (row key in extra.seed002_row, label, the seed's claim, the row it is measured against)
ROWS = (("baseline", "Baseline (every item off; fp32, math attention)", "-", None),
        ("cudnn_benchmark", "cuDNN benchmarking", "5-10% faster", "baseline"),
        ("mixed_precision", "Mixed precision (bf16)", "40-60% faster, 50% less memory",
         "baseline"),
        ("flash_attention", "Flash attention (bf16)", "30-50% faster", "mixed_precision"),
        ("compile", "Model compilation", "10-20% faster", "baseline"),
        ("gc", "Garbage collection every 5 steps", "-", "baseline"),
        ("data_loader", "Loader workers, pinned, persistent", "-", "baseline"),
        ("onecycle", "OneCycleLR schedule", "(quality)", "baseline"),
        ("ddp", "DDP over 2 ranks", "-", None),
        ("grad_compression", "fp16 gradient compression (DDP hook)", "-", "ddp"))


def _pct(new, old) -> str:
    return f"{100 * (new / old - 1):+.0f}%"


def seed002_table(df) -> str:
    """Markdown of the seed's claims and the measured change per item; "" without seed002 rows.

    One row per item: the first run of each, so one model."""
    at = {}
    for r, key in zip(df.to_dict("records"), (seed_row_key(e, "seed002_row") for e in df.get("extra", []))):
        if key and key not in at:
            at[key] = r
    if not at:
        return ""
    rows = []
    for key, label, claim, ref in ROWS:
        r, b = at.get(key), at.get(ref) if ref else None
        ok = r is not None and r["status"] == "ok"
        both = ok and b is not None and b["status"] == "ok"
        speed = _pct(r["tokens_per_s"], b["tokens_per_s"]) if both else "-"
        mem = _pct(r["peak_mem_gib"], b["peak_mem_gib"]) if both and r["peak_mem_gib"] and \
            b["peak_mem_gib"] else "-"
        loss = f"{r['loss_last']:.3f}" if ok else "-"
        rows.append([label, seed_cell(r, f"{r['tokens_per_s']:,.0f}" if ok else ""),
                     f"{speed} (vs {ref})" if ref and both else speed, mem, loss, claim])
    return "\n".join([
        "## Seed 002's claims, measured", "",
        seed_markdown(["Item", "tokens/s", "Speed change", "Peak memory change", "Last loss",
             "Seed claims"], rows), "",
        "Each item is measured against its reference row (in brackets) at the same model "
        "and micro-batch; the DDP rows run 2 ranks (their tokens/s sums both). `gc_ms` says "
        "what Python's collections cost in each row, `grad_reduce_bytes` what DDP reduced.",
        ""])
