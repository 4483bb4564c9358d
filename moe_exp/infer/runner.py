"""task=infer: build the model (its weights from infer.checkpoint, or the seed's), generate
greedily with a KV cache for infer.warmup + infer.batches batches of held-out prompts, and
record the prefill and decode throughput, time to first token, per-token latency, memory
and the experts' load during decode."""
from __future__ import annotations

import statistics
from pathlib import Path

import torch

from ..bench.memory import GIB
from ..results import close_record, fill_null_reasons
from .experts import Residency, drop_rare
from .generate import generate

WHY = "task=infer generates: no training step"  # the training figures' null reason
# the record's training settings, which a generation run does not have
TRAINING = ("optim", "grad_accum_steps", "activation_checkpointing", "lr_schedule", "attention",
            "gc_every", "checkpoint_every", "checkpoint_async", "comm_hook")


def infer(cfg, cfg_dict: dict, rec: dict, out_dir: Path, choices: dict,
          progress: bool) -> dict:
    """One measured generation run; never raises but on Ctrl-C (the status says what went
    wrong), as a bench run."""
    from ..hardware import device_name, torch_device
    from ..tracking import Tracker

    device = torch_device(cfg)
    i = cfg.infer
    rec.update(task="infer", batching=i.batching, quantize=i.quantize,
               device_name=device_name(device),
               torch_version=torch.__version__,
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
        from ..bench.runner import failure

        rec.update(failure(e, out_dir))
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
    autocast, step = apply_inference(model, cfg, device)
    n, b = i.warmup + i.batches, i.batch_size
    rows = prompts(cfg, n * b, i.prompt_len).to(device)
    held = prompts(cfg, n * b + i.eval_sequences, i.prompt_len + i.new_tokens + 1)[n * b:]
    held = held.to(device)
    base = _eval(model, held, autocast) if i.eval_sequences else None
    full = _weights(model)
    if i.quantize != "none":  # (after the loss it changes was measured without it)
        from ..optimizations.quantize import quantize_weights

        rec["quantized_layers"] = quantize_weights(model, i.quantize)
    else:
        rec["quantized_layers"] = None
        why["quantized_layers"] = "infer.quantize=none"
    res = Residency(model, i.experts_resident, i.prefetch) if i.experts_resident else None
    usage, runs, dropped = [], [], ([], 0, [])
    try:
        for k in tqdm(range(n), desc="infer", unit="batch", disable=not progress):
            if k == i.warmup:
                if i.usage_threshold:  # selective loading: from the warmup's routing
                    dropped = drop_rare(model, sum(usage), i.usage_threshold)
                    if res:
                        res.guesses = {}  # (none from the eval's pass)
                memory.reset()
                if res:
                    res.reset_counts()

            def on_step(c, warm=k < i.warmup):
                if res:
                    res.step(c)
                if warm and i.usage_threshold:
                    usage.append(c)
            runs.append(generate(model, rows[k * b:(k + 1) * b], i.new_tokens, autocast,
                                 device, on_step if res or i.usage_threshold else None, step))
        mem, mem_why = memory.read()
        changed = sum(dropped[0]) or i.quantize != "none"
        after = _eval(model, held, autocast) if i.eval_sequences and changed else base
        served = _serve(cfg, model, rows, autocast, device, step)  # (the row's model: its drops)
    finally:
        for h in dropped[2]:
            h.remove()
        if res:
            res.close()
    _record(cfg, rec, runs[i.warmup:], model, mem, mem_why)
    rec["quantized_saved_gib"] = (full - rec["weights_gib"] * GIB) / GIB \
        if i.quantize != "none" else None
    if rec["quantized_saved_gib"] is None:
        why["quantized_saved_gib"] = "infer.quantize=none"
    _record_experts(cfg, rec, res, dropped[:2], model)
    _record_serving(cfg, rec, served)
    rec.update(eval_loss=after, eval_loss_change=after - base if changed else None)
    if not i.eval_sequences:
        why["eval_loss"] = "infer.eval_sequences=0"
    if rec["eval_loss_change"] is None:
        why["eval_loss_change"] = ("infer.usage_threshold: no expert below it" if
                                   i.usage_threshold else
                                   "no infer option changes the model's math "
                                   "(infer.usage_threshold=0, quantize=none)") \
            if i.eval_sequences else "infer.eval_sequences=0"
    counts = [r.counts for r in runs[i.warmup:] if r.counts is not None]
    if counts:  # (choices: each decoded token's top_k, kept or dropped)
        rec.update(load_stats(sum(counts), i.batch_size * (i.new_tokens - 1) * i.batches
                              * m.top_k))
    else:
        why["expert_load_cv"] = why["expert_load_max_over_mean"] = \
            "dense model (model.num_experts=0)" if not m.num_experts else \
            "infer.new_tokens=1: no decode step"


SERVING = ("request_latency_ms_p50", "request_latency_ms_p90", "request_latency_ms_p99",
           "request_ttft_ms_p50", "request_ttft_ms_p99", "served_tokens_per_s",
           "batch_size_mean", "batch_size_max", "requests", "serving_costs")


def _record_serving(cfg, rec: dict, served: dict | None) -> None:
    """The stream's figures (_serve's); tokens_per_s becomes its served tokens per second."""
    if served is None:
        rec.update(dict.fromkeys(SERVING))
        rec["null_reasons"].update(dict.fromkeys(SERVING, "infer.batching=none"))
        return
    rec.update(served)
    rec["tokens_per_s"] = rec["tokens_per_s_per_device"] = rec["served_tokens_per_s"]


def _serve(cfg, model, rows: torch.Tensor, autocast, device, step) -> dict | None:
    """infer.batching: the stream's figures (None without), on a clock of costs measured
    here (a prefill and a decode step at batch sizes 1, 2, 4, ... and max_batch_size)."""
    from . import batching as b

    i = cfg.infer
    if i.batching == "none":
        return None
    sizes = sorted({2**k for k in range(i.max_batch_size.bit_length())
                    if 2**k < i.max_batch_size} | {i.max_batch_size})
    prompts = rows[:1].expand(i.max_batch_size, -1)  # (the costs: one prompt, repeated)
    for n in sizes if cfg.train.compile != "off" else sizes[-1:]:  # warm (compiled: each
        generate(model, prompts[:n], i.new_tokens, autocast, device, step=step)  # size)
    runs = [[generate(model, prompts[:n], i.new_tokens, autocast, device, step=step)
             for _ in range(3)]
            for n in sizes]  # (medians of 3: one noisy generation skewed a whole stream)
    cost = b.Cost(sizes, [statistics.median(r.prefill_s for r in rs) for rs in runs],
                  [statistics.median(t for r in rs for t in r.token_s) for rs in runs],
                  i.prompt_len)
    reqs = b.stream(i.requests, i.arrival_rate, i.prompt_len, i.new_tokens, i.length_spread,
                    cfg.train.seed)
    served = b.serve(reqs, i.batching, i.max_batch_size, i.timeout_ms / 1e3, cost)
    return b.figures(served) | {"serving_costs": {
        "batch_sizes": sizes, "prefill_ms": [x * 1e3 for x in cost.prefill_s],
        "step_ms": [x * 1e3 for x in cost.step_s]}}


def _weights(model) -> int:
    """The parameters' bytes as stored (quantized ones: their int8/fp8 data and scales)."""
    from ..optimizations.quantize import stored_bytes

    return sum(stored_bytes(p) for p in model.parameters())


@torch.no_grad()
def _eval(model, rows: torch.Tensor, autocast) -> float:
    """The held-out loss of rows (n, length + 1): next-token cross-entropy."""
    with autocast():
        return model(rows[:, :-1], rows[:, 1:]).ce.item()


def _record_experts(cfg, rec: dict, res, dropped: tuple, model) -> None:
    """Residency's and selective loading's figures, and the weights on the device."""
    from .experts import expert_bytes, moe_layers

    i, why = cfg.infer, rec["null_reasons"]
    keys = ("expert_hit_rate", "expert_bytes_moved_per_token", "expert_prefetch_hit_rate")
    if res:
        rec.update(res.figures(rec["generated_tokens"]))
        if rec["expert_prefetch_hit_rate"] is None:
            why["expert_prefetch_hit_rate"] = "infer.prefetch=0" if not i.prefetch else \
                "nothing was loaded ahead"
    else:
        rec.update(dict.fromkeys(keys))
        why.update(dict.fromkeys(keys, "infer.experts_resident=null: every expert resident"
                                 if cfg.model.num_experts else "dense model"))
    rec["expert_move_ms_per_token"] = None
    why["expert_move_ms_per_token"] = (
        "the moves are accounted, not made: expert_bytes_moved_per_token over the host link's "
        "bandwidth estimates it")
    per_layer = dropped[0] or [0] * len(moe_layers(model))
    rec.update(experts_dropped=sum(per_layer), dropped_experts_gib=dropped[1] / GIB)
    device = rec["weights_gib"] * GIB - dropped[1]
    if i.experts_resident:  # (of each layer's experts left, at most N on the device)
        for moe, gone in zip(moe_layers(model), per_layer):
            device -= max(0, moe.num_experts - gone - i.experts_resident) * expert_bytes(moe)
    rec["device_weights_gib"] = device / GIB


def _record(cfg, rec: dict, runs: list, model, mem: dict, mem_why: dict) -> None:
    """The measured batches' figures into the record."""
    i, why = cfg.infer, rec["null_reasons"]
    steps = [s for r in runs for s in r.token_s]
    prefill = statistics.median(r.prefill_s for r in runs)
    total = sum(r.prefill_s + sum(r.token_s) for r in runs)
    q = statistics.quantiles(steps, n=100, method="inclusive") if len(steps) > 1 else None
    weights = _weights(model) / GIB
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
        ("run", f"task=infer model={r['model']} precision={r['precision']} "
                + (f"compile={r['compile']} " if r.get("compile", "off") != "off" else "")
                + f"on {r['device_name']}"),
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
    if r.get("expert_hit_rate") is not None:
        pre = r.get("expert_prefetch_hit_rate")
        rows.append(("residency", f"{r['expert_hit_rate']:.1%} of expert fetches hit the "
                                  f"device; {r['expert_bytes_moved_per_token'] / 2**20:,.2f} MiB "
                                  "moved per generated token (accounted, not timed)"
                     + (f"; {pre:.0%} of prefetched experts used" if pre is not None else "")))
    if r.get("experts_dropped"):
        rows.append(("selective", f"{r['experts_dropped']} experts dropped, "
                                  f"{r['dropped_experts_gib']:.4f} GiB saved"))
    if r.get("served_tokens_per_s") is not None:
        rows.append(("serving", f"{r['requests']} requests, {r['batching']} batching: "
                                f"{r['served_tokens_per_s']:,.0f} tokens/s; latency p50 "
                                f"{r['request_latency_ms_p50']:,.1f} ms, p99 "
                                f"{r['request_latency_ms_p99']:,.1f} ms; first token p50 "
                                f"{r['request_ttft_ms_p50']:,.1f} ms; a decode step's "
                                f"batch {r['batch_size_mean'] or 0:.1f} on average (simulated "
                                "on measured costs)"))
    if r.get("quantized_layers"):
        rows.append(("quantized", f"{r['quantized_layers']} weights {r['quantize']} (Linear "
                                  f"layers, stacked experts): {r['quantized_saved_gib']:.4f} "
                                  "GiB saved"))
    if r.get("eval_loss") is not None:
        change = r.get("eval_loss_change")
        rows.append(("loss", f"held-out {r['eval_loss']:.4f}" + (
            f" ({change:+.4f} from the options that change the math)"
            if change is not None else "")))
    return rows


