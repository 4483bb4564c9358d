"""The seed guide's two tables, filled with a `+sweep=seed_table` run's measurements.

The guide is shared/seeds/000, its "Benchmark Results"; its claims stand beside the
measurements."""
from __future__ import annotations

import json
import math

import pandas as pd

# (row key in extra.seed_row, label as the seed prints it, the seed's claim)
THROUGHPUT_ROWS = (("baseline", "Baseline", "1.0x"),
                   ("mixed_precision", "+ Mixed Precision", "1.5x"),
                   ("checkpointing", "+ Gradient Checkpointing", "1.4x"),
                   ("expert_parallel", "+ Expert Parallelism", "2.7x"),
                   ("all", "All Optimizations", "3.2x"))
MEMORY_ROWS = (("baseline", "Baseline", "-"),
               ("mem_checkpointing", "+ Gradient Checkpointing", "29%"),
               ("mem_cpu_offload", "+ CPU Offloading", "47%"))


def seed_row_key(extra, key: str = "seed_row") -> str | None:
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            return None
    return extra.get(key) if isinstance(extra, dict) else None


def seed_cell(r, value: str) -> str:
    if r is None:
        return "not run"
    if r["status"] != "ok":
        err = str(r["error"] or "").split(": ", 1)[-1]
        if len(err) > 70:  # cut at a word, and say so
            err = err[:70].rsplit(" ", 1)[0] + " …"
        return f"{r['status']}: {err}"
    return value


def seed_markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def seed_tables(df) -> str:
    """Markdown for both tables, or "" when the sweep has no seed rows."""
    keys = [seed_row_key(e) for e in df.get("extra", [])]
    if not any(keys):
        return ""
    d = df.assign(seed_row=keys)
    d = d[d["seed_row"].notna()]
    models = list(dict.fromkeys(d["model"]))
    at = {(r.seed_row, r.model): r._asdict() for r in d.itertuples(index=False)}

    def params(m):  # the model's size from any row that measured it (NaN where skipped)
        return next((v["params_total"] for (k, mm), v in at.items()
                     if mm == m and pd.notna(v["params_total"]) and v["params_total"]), None)

    def size(m):
        n = params(m)
        return f"{m} ({n / 1e6:.1f}M)" if n else m

    rows = []
    for key, label, claim in THROUGHPUT_ROWS:
        cells, ratios = [], []
        for m in models:
            r, b = at.get((key, m)), at.get(("baseline", m))
            ok = r is not None and r["status"] == "ok"
            cells.append(seed_cell(r, f"{r['tokens_per_s']:,.0f}" if ok else ""))
            if ok and b is not None and b["status"] == "ok":
                ratios.append(r["tokens_per_s"] / b["tokens_per_s"])
        geo = f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}x" if ratios else "—"
        rows.append([label, *cells, geo, claim])
    out = ["## The seed's tables, measured", "",
           "### Training Throughput (tokens/second)", "",
           seed_markdown(["Configuration", *map(size, models), "Speedup (geo-mean)", "Seed claims"], rows),
           "", "Rows are cumulative as in the seed; speedup is the geometric mean over the "
           "columns of each model's tokens/s over its baseline. The expert-parallel rows run "
           "on 2 devices (ranks) at the same micro batch per rank, so their global batch is "
           "twice the baseline's and their tokens/s is the sum over both devices (weak "
           "scaling, as the seed's claim assumes); their loss is not comparable step for "
           "step.", ""]
    out += ["### Memory Usage", ""]
    for m in models:
        base = at.get(("baseline", m))
        n = params(m)
        weights = f"{n * 4 / 2**30:.3f} GiB" if n else "—"
        rows = []
        for key, label, claim in MEMORY_ROWS:
            r = at.get((key, m))
            # (a table's missing value is NaN: e.g. CPU peak memory in an in-process sweep)
            ok = r is not None and r["status"] == "ok" and pd.notna(r["peak_mem_gib"])
            saved = "-"
            if ok and key != "baseline" and base is not None and base["status"] == "ok" \
                    and pd.notna(base["peak_mem_gib"]):
                saved = f"{100 * (1 - r['peak_mem_gib'] / base['peak_mem_gib']):.0f}%"
            rows.append([label, weights, seed_cell(r, f"{r['peak_mem_gib']:.3f} GiB" if ok else "—"),
                         saved if ok else "—", claim])
        out += [f"**{size(m)}**", "",
                seed_markdown(["Optimization", "Model Size (fp32 weights)", "Peak Memory", "Memory Saved",
                     "Seed claims"], rows), ""]
    return "\n".join(out)


# +sweep=seed_inference: (row key in extra.seed_infer_row, the seed's option, its claim)
INFERENCE_ROWS = (
    ("selective", "Selective Expert Loading (max_experts_in_memory=4, usage_threshold=0.01)",
     "memory table: + Selective Loading, 60% saved"),
    ("offload", "CPU Offloading of experts (prefetch_experts=2)",
     "memory table: + CPU Offloading, 47% saved"),
    ("int8", "Model Quantization (int8 weights)", "quick reference: High impact"),
    ("compile", "Model Compilation (torch.compile, mode=\"max-autotune\")", "no figure"),
    ("static", "static batching (max_batch_size=32)", "—"),
    ("dynamic", "Dynamic Batching (max_batch_size=32, timeout_ms=100)",
     "quick reference: Dynamic Expert Loading, High impact; no figure for batching"),
    ("continuous", "continuous batching (max_batch_size=32)", "—"),
)


def _infer_cell(r, base) -> str:
    """What a seed_inference row measured, against the baseline row's figures."""
    def num(k):
        v = r.get(k)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else v

    parts = []
    if num("device_weights_gib") is not None and num("weights_gib"):
        full = base["weights_gib"] if base is not None else r["weights_gib"]
        parts.append(f"weights on the device {r['device_weights_gib']:.3f} of {full:.3f} GiB "
                     f"({100 * (1 - r['device_weights_gib'] / full):.0f}% saved)")
    if num("expert_hit_rate") is not None:
        parts.append(f"expert hit rate {r['expert_hit_rate']:.0%}, "
                     f"{r['expert_bytes_moved_per_token'] / 2**20:.1f} MiB moved per token")
    if num("expert_prefetch_hit_rate") is not None:
        parts.append(f"{r['expert_prefetch_hit_rate']:.0%} of prefetched experts used")
    if num("quantized_saved_gib") is not None:
        parts.append(f"{r['quantized_saved_gib']:.4f} GiB saved by int8")
    if num("request_latency_ms_p50") is not None:
        parts.append(f"{r['served_tokens_per_s']:,.0f} tokens/s served, request p50/p99 "
                     f"{r['request_latency_ms_p50']:,.0f}/{r['request_latency_ms_p99']:,.0f} "
                     f"ms, first token p50 {r['request_ttft_ms_p50']:,.0f} ms")
    elif base is not None and num("tokens_per_s") and base.get("tokens_per_s"):
        parts.append(f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x the baseline's "
                     "tokens/s")
    if num("eval_loss_change") is not None:
        parts.append(f"held-out loss {r['eval_loss_change']:+.4f}")
    return "; ".join(parts)


def seed_inference_table(df) -> str:
    """Markdown for +sweep=seed_inference's rows beside the seed's claims; "" without them."""
    keys = [seed_row_key(e, "seed_infer_row") for e in df.get("extra", [])]
    if not any(keys):
        return ""
    d = df.assign(seed_infer_row=keys)
    out = ["## The seed's inference options, measured", ""]
    for m in dict.fromkeys(d["model"]):
        at = {r["seed_infer_row"]: r for r in d[d["model"] == m].to_dict("records")
              if r["seed_infer_row"]}
        base = at.get("baseline")
        base = base if base is not None and base["status"] == "ok" else None
        rows = [[label, seed_cell(at.get(key), _infer_cell(at[key], base) if key in at else ""),
                 claim] for key, label, claim in INFERENCE_ROWS]
        head = f"**{m}** (baseline: " + (
            f"{base['tokens_per_s']:,.0f} tokens/s, weights {base['weights_gib']:.3f} GiB, "
            f"held-out loss {base['eval_loss']:.4f}" if base is not None else "not run") + ")"
        out += [head, "", seed_markdown(["Option (the seed's values)", "Measured", "Seed claims"], rows),
                ""]
    out.append("Memory here is the weights the device holds (expert moves are accounted, not "
               "made): the seed's table gives peak memory of a training run. Batching rows "
               "serve one simulated stream on costs measured on the model "
               "(docs/inference.md).")
    return "\n".join(out) + "\n"
