"""task=infer: build the model (its weights from infer.checkpoint, or the seed's), generate
greedily with a KV cache for infer.warmup + infer.batches batches of held-out prompts, and
record the prefill and decode throughput, time to first token, per-token latency, memory
and the experts' load during decode."""
from __future__ import annotations

import statistics
import traceback
from pathlib import Path

import torch

from ..results import close_record, fill_null_reasons
from .generate import generate

GIB = 2**30
WHY = "task=infer generates: no training step"  # the training figures' null reason
# the record's training settings, which a generation run does not have
TRAINING = ("optim", "grad_accum_steps", "activation_checkpointing", "lr_schedule", "attention",
            "gc_every", "checkpoint_every", "checkpoint_async", "comm_hook")


def infer(cfg, cfg_dict: dict, rec: dict, out_dir: Path, choices: dict,
          progress: bool) -> dict:
    """One measured generation run; never raises but on Ctrl-C (the status says what went
    wrong), as a bench run."""
    from ..bench.memory import is_oom, oom_line
    from ..hardware import device_name, torch_device
    from ..tracking import Tracker

    device = torch_device(cfg)
    i = cfg.infer
    rec.update(task="infer", device_name=device_name(device), torch_version=torch.__version__,
               world_size=1, micro_batch_size=i.batch_size, seq_len=i.prompt_len + i.new_tokens,
               **dict.fromkeys(TRAINING))
    tracker = None
    try:
        tracker = Tracker(cfg, cfg_dict, out_dir, [f"{k}={v}" for k, v in sorted(choices.items())],
                          f"infer-{cfg.model.name}-{cfg.precision.name}", defer=True)
        _measure(cfg, rec, device, progress)
        rec["status"] = "ok"
    except KeyboardInterrupt:
        rec.update(status="crashed", error="interrupted before the run finished")
        raise
    except Exception as e:  # noqa: BLE001 - a run's failure is a status, not a crash
        oom = is_oom(e)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        if not oom:
            (out_dir / "error.log").write_text(traceback.format_exc())
        rec.update(status="oom" if oom else "error",
                   error=oom_line(first) if oom else
                   f"{type(e).__name__}: {first} (see {out_dir}/error.log)")
    finally:
        close_record(rec, out_dir, tracker)
    if rec["status"] == "ok":
        from ..summary import print_summary

        print_summary(rec, out_dir / "metrics.json", summary_rows(rec), "moe_exp inference")
    return rec


def _measure(cfg, rec: dict, device: torch.device, progress: bool) -> None:
    from tqdm.auto import tqdm

    from ..bench.checkpoint import check_weights, load_weights
    from ..bench.experts import load_stats
    from ..bench.flops import param_counts
    from ..bench.memory import MemoryMeter
    from ..bench.runner import resolve_model_dispatch
    from ..data import prompts
    from ..hardware import setup_backends
    from ..model import build_model
    from ..optimizations import apply_inference

    i, m = cfg.infer, cfg.model
    setup_backends(cfg)
    torch.manual_seed(cfg.train.seed)
    resolve_model_dispatch(cfg, device)
    memory = MemoryMeter(device)
    memory.baseline()
    with torch.device(device):
        model = build_model(m)
    model.eval()
    why = rec["null_reasons"]
    counts = param_counts(m)
    rec.update(params_total=counts["params_total"], params_active=counts["params_active"],
               weights_from=None,
               moe_dispatch=m.dispatch if m.num_experts else None, checkpoint_load_s=None)
    if i.checkpoint:
        path = check_weights(cfg)
        rec.update(checkpoint_load_s=load_weights(model, path), weights_from=str(path))
    else:
        why["weights_from"] = f"infer.checkpoint=null: the initialization of train.seed=" \
                              f"{cfg.train.seed}"
        why["checkpoint_load_s"] = "infer.checkpoint=null"
    autocast = apply_inference(model, cfg, device)
    n = i.warmup + i.batches
    rows = prompts(cfg, n * i.batch_size, i.prompt_len).to(device)
    runs = []
    for b in tqdm(range(n), desc="infer", unit="batch", disable=not progress):
        if b == i.warmup:
            memory.reset()
        runs.append(generate(model, rows[b * i.batch_size:(b + 1) * i.batch_size],
                             i.new_tokens, autocast, device))
    mem, mem_why = memory.read()
    _record(cfg, rec, runs[i.warmup:], model, mem, mem_why)
    counts = [r.counts for r in runs[i.warmup:] if r.counts is not None]
    if counts:  # (choices: each decoded token's top_k, kept or dropped)
        rec.update(load_stats(sum(counts), i.batch_size * (i.new_tokens - 1) * i.batches
                              * m.top_k))
    else:
        why["expert_load_cv"] = why["expert_load_max_over_mean"] = \
            "dense model (model.num_experts=0)" if not m.num_experts else \
            "infer.new_tokens=1: no decode step"


def _record(cfg, rec: dict, runs: list, model, mem: dict, mem_why: dict) -> None:
    """The measured batches' figures into the record."""
    i, why = cfg.infer, rec["null_reasons"]
    steps = [s for r in runs for s in r.token_s]
    prefill = statistics.median(r.prefill_s for r in runs)
    total = sum(r.prefill_s + sum(r.token_s) for r in runs)
    q = statistics.quantiles(steps, n=100, method="inclusive") if len(steps) > 1 else None
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / GIB
    kv = max(r.kv_bytes for r in runs) / GIB
    rec.update(
        tokens_per_s=i.batch_size * i.new_tokens * len(runs) / total,
        prefill_tokens_per_s=i.batch_size * i.prompt_len / prefill,
        decode_tokens_per_s=i.batch_size * len(steps) / sum(steps) if steps else None,
        ttft_ms=prefill * 1e3,
        step_time_ms=statistics.median(steps) * 1e3 if steps else None,
        token_latency_ms_p50=q[49] * 1e3 if q else None,
        token_latency_ms_p90=q[89] * 1e3 if q else None,
        token_latency_ms_p99=q[98] * 1e3 if q else None,
        weights_gib=weights, kv_cache_gib=kv, measured_batches=len(runs),
        generated_tokens=i.batch_size * i.new_tokens * len(runs), **mem)
    rec["tokens_per_s_per_device"] = rec["tokens_per_s"]
    if rec.get("peak_mem_gib") is not None:
        rec["infer_other_gib"] = max(0.0, rec["peak_mem_gib"] - weights - kv)
    else:
        rec["infer_other_gib"] = None
        why["infer_other_gib"] = mem_why.get("peak_mem_gib", "no peak memory")
    why.update({k: v for k, v in mem_why.items() if rec.get(k) is None})
    for k in ("decode_tokens_per_s", "step_time_ms", "token_latency_ms_p50",
              "token_latency_ms_p90", "token_latency_ms_p99"):
        if rec[k] is None:
            why[k] = "infer.new_tokens=1 (or one decode step): no latency spread"
    fill_null_reasons(rec, WHY)


def summary_rows(r: dict) -> list[tuple[str, str]]:
    """The record's headline figures, (label, text) rows (the terminal's table, run.log)."""
    f = lambda x, spec, unit="": "null" if x is None else f"{x:{spec}}{unit}"  # noqa: E731
    rows = [
        ("run", f"task=infer model={r['model']} precision={r['precision']} on "
                f"{r['device_name']}"),
        ("weights", r.get("weights_from") or "initialized (infer.checkpoint=null)"),
        ("throughput", f"{r['tokens_per_s']:,.0f} generated tokens/s; prefill "
                       f"{r['prefill_tokens_per_s']:,.0f} tokens/s, decode "
                       f"{f(r['decode_tokens_per_s'], ',.0f')} tokens/s"),
        ("latency", f"first token {r['ttft_ms']:.1f} ms; per token p50 "
                    f"{f(r['token_latency_ms_p50'], '.2f')} ms, p90 "
                    f"{f(r['token_latency_ms_p90'], '.2f')} ms, p99 "
                    f"{f(r['token_latency_ms_p99'], '.2f')} ms"),
        ("memory", f"peak {f(r['peak_mem_gib'], '.3f', ' GiB')}: weights "
                   f"{r['weights_gib']:.3f} GiB, KV cache {r['kv_cache_gib']:.4f} GiB, "
                   f"the rest {f(r['infer_other_gib'], '.3f', ' GiB')}"),
    ]
    if r.get("expert_load_cv") is not None:
        rows.append(("expert load", f"decode: CV {r['expert_load_cv']:.3f}, max/mean "
                                    f"{r['expert_load_max_over_mean']:.2f}"))
    return rows


