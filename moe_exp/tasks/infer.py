"""task=infer: measures greedy generation with a KV cache on batches of held-out prompts.

The weights come from infer.checkpoint, else from the seed. Of infer.warmup + infer.batches
batches, the warmup ones are not measured. The record holds the prefill and decode
throughput, time to first token, per-token latency, memory and the experts' load during
decode."""
from __future__ import annotations

import statistics
from pathlib import Path

import torch

from ..bench.memory import GIB
from ..bench.load import busy, load_warning, other_load, snapshot
from ..config import ConfigError, Unsupported
from ..infer.experts import Residency, drop_rare
from ..infer.generate import generate
from ..results import fill_null_reasons
from ..config import unrecorded
from ..record import Inference
from .protocol import Task
from .summary import run_line

WHY = "task=infer generates: no training step"  # the training figures' null reason


class InferTask(Task):
    name = "infer"
    noun = "run"
    title = "moe_exp inference"
    section = Inference

    @staticmethod
    def check(cfg) -> None:
        """Check the run suits task=infer: one device, its options, a checkpoint of this model.

        Prompt plus output must fit the model's positions; options it does not apply are
        refused."""
        from ..ranks import world_size

        i, m = cfg.infer, cfg.model
        if i.prompt_len + i.new_tokens > m.max_seq_len:
            raise ConfigError("infer.new_tokens", f"infer.prompt_len + new_tokens = "
                              f"{i.prompt_len + i.new_tokens} exceeds model.max_seq_len="
                              f"{m.max_seq_len}")
        if cfg.parallel.name != "none" or world_size(cfg.hardware.devices) != 1:
            raise ConfigError("parallel", "task=infer runs on one device: parallel=none "
                              "hardware.devices=1")
        if cfg.train.compile != "off" and i.warmup < 1:
            raise ConfigError("infer.warmup", f"must be >= 1 with train.compile="
                              f"{cfg.train.compile} (the first batch compiles: it must not be "
                              "measured)")
        if cfg.precision.name == "fp8":
            raise ConfigError("precision", "fp8 is a training recipe (torchao's float8 "
                              "training); task=infer quantizes with infer.quantize=fp8")
        if (i.experts_resident is not None or i.usage_threshold) and not m.num_experts:
            raise ConfigError("infer.experts_resident" if i.experts_resident is not None else
                              "infer.usage_threshold", "a MoE model's option (model.num_experts "
                              "> 0)")
        if i.experts_resident is not None and not 1 <= i.experts_resident <= m.num_experts:
            raise ConfigError("infer.experts_resident", f"must be in 1..model.num_experts="
                              f"{m.num_experts} or null, got {i.experts_resident}")
        if i.experts_resident is not None and i.prefetch > i.experts_resident:
            raise ConfigError("infer.prefetch", f"must be at most infer.experts_resident="
                              f"{i.experts_resident} (the experts loaded ahead are held among "
                              f"the resident ones), got {i.prefetch}")
        if i.batching != "none" and i.new_tokens < 2:
            raise ConfigError("infer.new_tokens", "must be >= 2 with infer.batching (a decode "
                              "step's cost is measured)")
        if i.usage_threshold and i.warmup < 1:
            raise ConfigError("infer.warmup", "must be >= 1 with infer.usage_threshold (the "
                              "warmup batches' routing picks the experts to drop)")
        if i.checkpoint is not None:
            from ..train.checkpoint import check_weights

            check_weights(cfg)

    @staticmethod
    def check_here(cfg) -> None:
        """infer.quantize: torchao installed; fp8 on a GPU with float8 matmuls."""
        import importlib.util

        q = cfg.infer.quantize
        if q == "fp8" and not (cfg.hardware.device == "cuda" and torch.cuda.is_available() and
                               torch.cuda.get_device_capability(0) >= (8, 9)):
            raise Unsupported("infer.quantize", "fp8 needs a CUDA GPU with compute capability "
                              ">= 8.9 (H100, H200, L4, RTX 40xx)")
        if q != "none" and importlib.util.find_spec("torchao") is None:
            raise Unsupported("infer.quantize", "needs torchao: pip install -e \".[fp8]\"")
        if q != "none":  # (its FqnToConfig names the stacked experts' 3-D weights)
            from importlib.metadata import version

            have = version("torchao")
            if tuple(int(x) for x in have.split(".")[:2] if x.isdigit()) < (0, 18):
                raise Unsupported("infer.quantize", f"needs torchao >= 0.18 (its FqnToConfig "
                                  f"quantizes the stacked experts), found {have}: pip install "
                                  "\"torchao>=0.18\"")

    @staticmethod
    def summary_rows(rec: dict) -> list[tuple[str, str]]:
        return summary_rows(rec)

    def run(self, rec: dict) -> None:
        """One measured generation run."""
        from ..hardware import device_name, torch_device

        cfg = self.ctx.cfg
        device = torch_device(cfg)
        i = cfg.infer
        rec.update(dict.fromkeys(unrecorded("infer")))  # (the training settings)
        rec.update(task="infer", batching=i.batching, quantize=i.quantize,
                   device_name=device_name(device), torch_version=torch.__version__,
                   world_size=1, micro_batch_size=i.batch_size,
                   seq_len=i.prompt_len + i.new_tokens)
        _measure(cfg, rec, device, self.ctx.progress)


def _measure(cfg, rec: dict, device: torch.device, progress: bool) -> None:
    from tqdm.auto import tqdm

    from ..train.checkpoint import check_weights, load_weights
    from ..bench.experts import load_stats
    from ..bench.flops import param_counts
    from ..bench.memory import MemoryMeter
    from ..data import prompts
    from ..hardware import setup_backends
    from ..model import build_model
    from ..optimizations import apply_inference

    i, m = cfg.infer, cfg.model
    setup_backends(cfg)
    torch.manual_seed(cfg.train.seed)
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
    load0 = None  # (the measured batches' CPU window: opened at k == i.warmup)
    try:
        for k in tqdm(range(n), desc="infer", unit="batch", disable=not progress):
            if k == i.warmup:
                load0 = snapshot()
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
        rec["cpu_other_load"] = other_load(load0, snapshot())
        if rec["cpu_other_load"] is None:
            why["cpu_other_load"] = "no /proc to read the machine's CPU time from"
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
    """Record _serve's stream figures; tokens_per_s becomes its served tokens per second."""
    if served is None:
        rec.update(dict.fromkeys(SERVING))
        rec["null_reasons"].update(dict.fromkeys(SERVING, "infer.batching=none"))
        return
    rec.update(served)
    rec["tokens_per_s"] = rec["tokens_per_s_per_device"] = rec["served_tokens_per_s"]


def _serve(cfg, model, rows: torch.Tensor, autocast, device, step) -> dict | None:
    """Serve infer.batching's request stream; its figures, or None with infer.batching=none.

    The clock is costs measured here: a prefill and a decode step at batch sizes 1, 2, 4, ...
    and max_batch_size."""
    from ..infer import batching as b

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
            for n in sizes]  # medians of 3: one noisy generation would skew a whole stream
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
    """The parameters' bytes as stored; a quantized one counts its int8/fp8 data and scales."""
    from ..optimizations.quantize import stored_bytes

    return sum(stored_bytes(p) for p in model.parameters())


@torch.no_grad()
def _eval(model, rows: torch.Tensor, autocast) -> float:
    """The held-out loss of rows (n, length + 1): next-token cross-entropy."""
    with autocast():
        return model(rows[:, :-1], rows[:, 1:]).ce.item()


def _record_experts(cfg, rec: dict, res, dropped: tuple, model) -> None:
    """Residency's and selective loading's figures, and the weights on the device."""
    from ..infer.experts import expert_bytes, moe_layers

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
    """The record's headline figures as (label, text) rows, for the terminal's table and run.log."""
    f = lambda x, spec, unit="": "null" if x is None else f"{x:{spec}}{unit}"  # noqa: E731
    rows = [
        ("run", f"task=infer {run_line(r)} on {r['device_name']}"),
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
    if busy(load := r.get("cpu_other_load")):  # (said first: its figures are not firm)
        rows.insert(1, ("WARNING", load_warning(load, "the measured batches")))
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


