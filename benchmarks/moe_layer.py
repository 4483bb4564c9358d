"""MoE layer forward + backward (dropless): our dispatch paths against the naive loop.

    PYTHONPATH=. python benchmarks/moe_layer.py [--shapes tiny,small,1b] [--dtypes fp32,bf16]
                                                [--reps 20] [--json out.json]
                                                [--skew S] [--no-compile] [--malloc-retain]

Contenders, all with the same router, the same weights and the same routing:
  naive     the per-expert loop popular model libraries use: Hugging Face transformers 5.x
            Mixtral (stacked expert weights indexed per expert): for each expert hit,
            torch.where(one_hot mask), gather its tokens, SwiGLU, scale by the routing
            weight, index_add_ into the output. Written here (class Naive).
  naive-v4  the same loop over one nn.Linear module per expert (transformers 4.x Mixtral).
  hf        Hugging Face transformers' own layer at that shape, as it runs by default
            (its experts_implementation: grouped_mm where torch has it): Qwen3-MoE's
            (softmax, renormalised top-k) or, with shared experts, DeepSeek-V3's (sigmoid,
            one shared expert); its own router, with the same weights. Where transformers
            is installed.
  loop      moe_exp's `model.dispatch=loop` (sort by expert, split, per-expert matmuls)
  grouped   moe_exp's `model.dispatch=grouped` (sort by expert, three grouped matmuls)
  padded    moe_exp's `model.dispatch=padded` (groups padded to the largest, three bmm)
  auto      what `model.dispatch=auto` picks on this device and dtype
  compiled  the same layer under torch.compile (`train.compile=default`), with the dispatch
            `auto` picks for compiled code; --no-compile leaves it out
  naive-c   naive under torch.compile (its loop over experts hit breaks the graph)
  mm-only   not an implementation: the layer's expert matmuls alone (3 forward, 6 backward,
            bmm over perfectly balanced groups, in the matmul dtype). naive / mm-only is the
            most any dropless implementation could gain with everything else free.

Timing: every contender runs once per round, each in every place equally often (so machine
noise and the previous contender's after-effects hit all alike), after warmup rounds;
rounds during which other processes used the CPU are dropped and rerun
(benchmarks/_timing.py). The table gives median ms per fwd+bwd and
speedup = naive's median / the contender's. bf16 means autocast to bfloat16 (the model's bf16 precision).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1" if (os.cpu_count() or 1) <= 4 else "8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import (add_device, at_least, device_name, one_of, out_file,  # noqa: E402
                     run_rounds)

from moe_exp.model.moe import MoE, resolve_dispatch  # noqa: E402

# name: (tokens, hidden, ffn, experts, top_k[, shared ffn]); tokens = micro_batch_size *
# seq_len; shared ffn: always-on shared experts' size (DeepSeek's; 0: none)
SHAPES = {
    "tiny": (8 * 128, 128, 256, 8, 2),  # tiny_moe, default micro batch 8
    "small": (8 * 256, 256, 512, 16, 2),  # small_moe, micro batch 8
    "1b-cpu": (2048, 1024, 1152, 16, 2),  # moe_1b's layer, one 2048-token sequence
    "1b": (4 * 2048, 1024, 1152, 16, 2),  # moe_1b, micro batch 4 (GPU)
    "fine": (2048, 512, 128, 64, 8),  # fine-grained: 64 experts of ffn 128, top-8
    "fine-shared": (2048, 512, 128, 64, 6, 256),  # + two shared experts' worth (DeepSeek)
    "qwen3": (4 * 2048, 2048, 768, 128, 8),  # Qwen3-30B-A3B's layer, micro batch 4 (GPU)
}


COLS = ("naive", "naive-v4", "hf", "loop", "grouped", "padded", "auto", "naive-c",
        "compiled", "mm-only")


def moe_layer(shape, dispatch: str) -> MoE:
    """moe_exp's layer at `shape`: Qwen3's router (softmax, renormalised) or, with shared
    experts, DeepSeek-V3's (sigmoid, one group)."""
    t, h, f, e, k, *shared = shape
    shared = shared[0] if shared else 0
    return MoE(h, f, e, k, dispatch=dispatch, shared_ffn=shared,
               score_func="sigmoid" if shared else "softmax")


def hf_layer(base: MoE):
    """Hugging Face's own layer with base's weights; None where transformers is missing."""
    try:
        import transformers
    except ImportError:
        return None
    ex, h = base.experts, base.experts.w1.shape[1]
    e, f = ex.w1.shape[0], ex.w1.shape[2]
    # (what a model built from its config runs: modeling_utils'
    # get_correct_experts_implementation picks grouped_mm where it can dispatch)
    common = dict(hidden_size=h, moe_intermediate_size=f, num_experts_per_tok=base.top_k,
                  norm_topk_prob=True, experts_implementation="grouped_mm")
    if base.shared_experts is None:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        block = Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(num_experts=e, **common))
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        shared = base.shared_experts.w1.out_features
        block = DeepseekV3MoE(transformers.DeepseekV3Config(
            n_routed_experts=e, n_shared_experts=shared // f, n_group=1, topk_group=1,
            routed_scaling_factor=1.0, **common))
        sh = block.shared_experts
        for ours, theirs in ((base.shared_experts.w1, sh.gate_proj),
                             (base.shared_experts.w3, sh.up_proj),
                             (base.shared_experts.w2, sh.down_proj)):
            theirs.weight = torch.nn.Parameter(ours.weight.detach().clone())
    block.gate.weight = torch.nn.Parameter(base.router.gate.weight.detach().clone())
    block.experts.gate_up_proj = torch.nn.Parameter(
        torch.cat([ex.w1, ex.w3], dim=2).transpose(1, 2).contiguous().detach())
    block.experts.down_proj = torch.nn.Parameter(ex.w2.transpose(1, 2).contiguous().detach())
    return Batched(block).to(ex.w1.device)


class Batched(torch.nn.Module):
    """A layer that takes (batch, seq, hidden), called on (tokens, hidden)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        y = self.block(x[None])
        return (y[0] if isinstance(y, tuple) else y)[0]


class Naive(torch.nn.Module):
    """The per-expert loop of Hugging Face transformers' Mixtral, over moe_exp's router.

    style="v5": transformers 5.x `MixtralExperts`: stacked parameters gate_up_proj (E, 2F, H)
    and down_proj (E, H, F), indexed per expert (`F.linear(x, self.gate_up_proj[e])`).
    style="v4": transformers 4.x `MixtralSparseMoeBlock`: one module per expert with its own
    nn.Linear w1, w3, w2. Both: one_hot mask, experts hit, torch.where, gather the expert's
    tokens, SwiGLU, scale by the routing weight, index_add_ into the output.
    The weights are copies of `moe`'s (same numbers, own parameters).
    """

    def __init__(self, moe: MoE, style: str = "v5"):
        super().__init__()
        self.router, self.num_experts, self.style = moe.router, moe.num_experts, style
        self.shared = moe.shared_experts  # (the same module: a dense FFN, not the loop's)
        ex = moe.experts
        with torch.no_grad():
            if style == "v5":
                self.gate_up_proj = torch.nn.Parameter(
                    torch.cat([ex.w1, ex.w3], dim=2).transpose(1, 2).contiguous())
                self.down_proj = torch.nn.Parameter(ex.w2.transpose(1, 2).contiguous())
            else:
                self.experts = torch.nn.ModuleList()
                for e in range(self.num_experts):
                    m = torch.nn.Module()
                    for name in ("w1", "w3", "w2"):
                        w = getattr(ex, name)[e]
                        lin = torch.nn.Linear(w.shape[0], w.shape[1], bias=False)
                        lin.weight.copy_(w.t())
                        setattr(m, name, lin)
                    self.experts.append(m)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        _, _, weights, experts = self.router(x)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        with torch.no_grad():
            mask = F.one_hot(experts, num_classes=self.num_experts).permute(2, 1, 0)  # E, k, T
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            idx, top_x = torch.where(mask[e])
            cur = x[top_x]
            if self.style == "v5":
                gate, up = F.linear(cur, self.gate_up_proj[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.down_proj[e])
            else:
                m = self.experts[int(e)]
                y = m.w2(F.silu(m.w1(cur)) * m.w3(cur))
            y = y * weights[top_x, idx, None]
            out.index_add_(0, top_x, y.to(out.dtype))
        if self.shared is not None:
            out = out + self.shared(x)
        return out.reshape(shape)


def mm_only(shape, device, dtype):
    """The expert matmuls of one layer alone: forward and backward, balanced groups."""
    t, h, f, e, k = shape[:5]
    n = t * k // e
    torch.manual_seed(2)
    leaf = dict(requires_grad=True, device=device, dtype=dtype)
    xp, hp = torch.randn(e, n, h, **leaf), torch.randn(e, n, f, **leaf)
    w1, w3, w2 = (torch.randn(e, a, b, **leaf) for a, b in ((h, f), (h, f), (f, h)))
    g1, g2 = torch.randn(e, n, f, device=device, dtype=dtype), torch.randn(
        e, n, h, device=device, dtype=dtype)

    def step():
        for p in (xp, hp, w1, w3, w2):
            p.grad = None
        ys = [torch.bmm(xp, w1), torch.bmm(xp, w3), torch.bmm(hp, w2)]
        torch.autograd.backward(ys, [g1, g1, g2])
    return step


def compiled(model):
    from moe_exp.optimizations.compile import apply_compile

    return apply_compile(model, "default")


def contenders(shape, device, dtype, skew=1.0):
    t, h, f, e, k = shape[:5]
    torch.manual_seed(0)
    base = moe_layer(shape, "loop").to(device)
    for p in base.parameters():
        torch.nn.init.normal_(p, std=0.02)
    with torch.no_grad():  # skew > 1: the first E/8 experts' logits spread wider, so they
        # win more tokens (unbalanced routing, as trained routers have it)
        base.router.gate.weight[: max(1, e // 8)] *= skew
    out = {"naive": Naive(base, "v5").to(device), "naive-v4": Naive(base, "v4").to(device),
           "loop": base}
    if (hf := hf_layer(base)) is not None:
        out["hf"] = hf
    auto = resolve_dispatch("auto", device, dtype)
    for d in ("grouped", "padded"):
        if d == "grouped" and resolve_dispatch("grouped", device, dtype) != "grouped":
            continue  # grouped_mm does not run here
        m = moe_layer(shape, d).to(device)
        m.load_state_dict(base.state_dict())
        out[d] = m
    out["auto"] = out[auto]
    return out, auto


def compiled_contenders(models, shape, device, dtype):
    """naive and moe_exp's layer (dispatch auto picks under compile) under torch.compile."""
    d = resolve_dispatch("auto", device, dtype, compiled=True)
    m = moe_layer(shape, d).to(device)
    m.load_state_dict(models["loop"].state_dict())
    return {"naive-c": compiled(models["naive"]), "compiled": compiled(m)}, d


def step_fn(model, x, g, autocast):
    def step():
        for p in model.parameters():
            p.grad = None
        x.grad = None
        with autocast():
            y = model(x)
            y = y[0] if isinstance(y, tuple) else y
        y.backward(g)
    return step


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_shape(name, shape, device, dtype, reps, warmup, compile_=True, skew=1.0):
    t, h, f, e, k = shape[:5]
    models, auto = contenders(shape, device, dtype, skew)
    auto_c = None
    if compile_:
        # a fresh dynamo per shape and dtype: a run has one shape; without it, the second
        # shape would get a graph generalised to any token count (automatic dynamic shapes)
        torch._dynamo.reset()
        more, auto_c = compiled_contenders(models, shape, device, dtype)
        models.update(more)
    torch.manual_seed(1)
    x = torch.randn(t, h, device=device, requires_grad=True)
    g = torch.randn(t, h, device=device)
    if dtype == torch.float32:
        autocast = contextlib.nullcontext
    else:
        g = g.to(dtype)
        autocast = lambda: torch.autocast(device.type, dtype=dtype)  # noqa: E731
    steps = {n: step_fn(m, x, g, autocast) for n, m in models.items() if n != "auto"}
    compile_s = {}
    for n in ("naive-c", "compiled"):
        if n in steps:  # the first calls compile (forward, backward): timed apart
            t0 = time.perf_counter()
            steps[n]()
            steps[n]()
            sync(device)
            compile_s[n] = round(time.perf_counter() - t0, 1)
    with torch.no_grad(), autocast():  # the routing the timed steps see
        counts = models["loop"](x)[4].float()
    load = {"max_over_mean": (counts.max() / counts.mean()).item(),
            "cv": (counts.std() / counts.mean()).item()}
    # Same numbers from every contender (bf16: loose).
    ref = None
    for mname, m in models.items():
        if mname == "auto":
            continue
        with autocast():
            y = m(x)
            y = (y[0] if isinstance(y, tuple) else y).float()
        if ref is None:
            ref = y
        else:
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(y, ref, rtol=tol, atol=tol * ref.abs().max().item(),
                                       msg=lambda s, n=mname: f"{n} differs from naive: {s}")
    steps["mm-only"] = mm_only(shape, device, dtype)
    res = run_rounds(steps, reps, warmup, sync=lambda: sync(device))
    med = dict(res["median_ms"])
    med["auto"] = med[auto]
    return {"auto": auto, "auto_compiled": auto_c, "compile_s": compile_s, "shape": name,
            "skew": skew, "load": load,
            "tokens": t, "hidden": h, "ffn": f, "experts": e, "top_k": k,
            "shared_ffn": shape[5] if len(shape) > 5 else 0,
            "dtype": str(dtype).replace("torch.", ""), "device": device.type,
            "rounds": res["rounds"], "dropped_rounds": res["dropped_rounds"], "order": res["order"],
            "contended": res["contended"],
            "median_ms": med, "speedup_vs_naive": {n: med["naive"] / v for n, v in med.items()}}


def skew_type(text: str) -> float:
    """argparse type for --skew: a finite number > 0 (a scale of router rows)."""
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got '{text}'")
    return x


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device(ap)
    ap.add_argument("--shapes", default=None, type=one_of(SHAPES),
                    help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--dtypes", default=None, type=one_of(("fp32", "bf16")),
                    help="fp32,bf16 (CPU default) or bf16 (CUDA)")
    ap.add_argument("--reps", type=at_least(1), default=20)
    ap.add_argument("--warmup", type=at_least(0), default=3)
    ap.add_argument("--threads", type=at_least(1), default=None, help="torch.set_num_threads")
    ap.add_argument("--json", default=None, type=out_file, help="write the results here")
    ap.add_argument("--no-compile", action="store_true", help="leave out the compiled contenders")
    ap.add_argument("--skew", type=skew_type, default=1.0,
                    help="scale of the first E/8 experts' router rows: 1 = as initialised "
                         "(balanced), 2 = max/mean load ~2 at 16 experts (as small_moe trained)")
    ap.add_argument("--malloc-retain", action="store_true",
                    help="glibc keeps freed memory (hardware.malloc_retain=true), for all alike")
    a = ap.parse_args(argv)
    if a.malloc_retain:
        from moe_exp.host import malloc_retain
        if not malloc_retain():
            ap.error("--malloc-retain: glibc's mallopt refused it")
    device = torch.device(a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    cuda = device.type == "cuda"
    shapes = (a.shapes or ("tiny,small,1b" if cuda else "tiny,small,1b-cpu")).split(",")
    dtypes = (a.dtypes or ("bf16" if cuda else "fp32,bf16")).split(",")
    dmap = {"fp32": torch.float32, "bf16": torch.bfloat16}
    dev_name = device_name(device)
    print(f"# MoE layer fwd+bwd, {dev_name}, torch {torch.__version__}, "
          f"python {platform.python_version()}, {dt.date.today()}, median of {a.reps}")
    print(f"{'shape':8} {'T x H x F x E x k':>24} {'dtype':>8}  "
          + "  ".join(f"{n:>16}" for n in COLS) + "  auto is (eager/compiled)")
    rows = []
    for s in shapes:
        for dn in dtypes:
            r = bench_shape(s, SHAPES[s], device, dmap[dn], a.reps, a.warmup, not a.no_compile,
                            a.skew)
            rows.append(r)
            dims = "x".join(str(v) for v in SHAPES[s])
            cells = []
            for n in COLS:
                ms = r["median_ms"].get(n)
                cells.append(f"{'—':>16}" if ms is None else
                             f"{ms:8.2f} ({r['speedup_vs_naive'][n]:4.1f}x)")
            cells.append(f"  {r['auto']}" + (f"/{r['auto_compiled']}" if r["auto_compiled"] else ""))
            cells.append(f"  [load max/mean {r['load']['max_over_mean']:.2f}, {r['rounds']} rounds, "
                         f"{r['dropped_rounds']} dropped"
                         + (", CONTENDED]" if r["contended"] else "]"))
            print(f"{s:8} {dims:>24} {dn:>8}  " + "  ".join(cells), flush=True)
            if a.json:  # after every row: a run cut short keeps what it measured
                meta = {"device": dev_name, "torch": torch.__version__,
                        "date": str(dt.date.today()), "command": " ".join(sys.argv),
                        "reps": a.reps, "skew": a.skew, "malloc_retain": a.malloc_retain}
                Path(a.json).parent.mkdir(parents=True, exist_ok=True)
                Path(a.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
